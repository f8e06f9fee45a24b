/*
 * up_plan.c — what `kvmesh up` runs: every process's id, ports, endpoints and argv. The
 * controller comes first (--listen for workers' heartbeats and operators, --view for routers),
 * then worker i on base+10i (requests), base+10i+1 (events), base+10i+2 (admin), then the
 * routers (which need the workers' endpoints). With --base-port 0 every port is picked free, so
 * clusters can run side by side; --netns puts one worker in a network namespace.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cli/up.h"

#define UP_ARGV_MAX 96

static char *xfmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xfmt(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0) s = NULL;
    va_end(ap);
    return s;
}

/* Splits extra arguments on spaces into argv (appended). */
static void push_args(char **argv, int *argc, int max, const char *extra)
{
    if (!extra) return;
    char *copy = strdup(extra);
    for (char *save = NULL, *t = strtok_r(copy, " ", &save); t && *argc < max - 1;
         t = strtok_r(NULL, " ", &save))
        argv[(*argc)++] = strdup(t);
    free(copy);
}

/* The flags of `spec` ("ID:FLAGS;ID:FLAGS...") that belong to worker id, appended. */
static void push_args_for(char **argv, int *argc, int max, const char *spec, const char *id)
{
    if (!spec) return;
    char *copy = strdup(spec);
    size_t idl = strlen(id);
    for (char *save = NULL, *t = strtok_r(copy, ";", &save); t; t = strtok_r(NULL, ";", &save)) {
        while (*t == ' ') t++;
        if (!strncmp(t, id, idl) && t[idl] == ':') push_args(argv, argc, max, t + idl + 1);
    }
    free(copy);
}

/* A TCP port that nothing on 127.0.0.1 holds now, for --base-port 0. It is drawn below the
 * kernel's ephemeral range (32768 and up), so the tcp://127.0.0.1:* sockets that tests and other
 * clusters bind cannot take it between this look and the daemon's bind, and at random, so two
 * clusters started at once do not pick the same ones. */
static int up_pick_port(const int *taken, int n_taken)
{
    for (int tries = 0; tries < 2000; tries++) {
        int port = 20000 + (int)(random() % 12000);
        bool dup = false;
        for (int i = 0; i < n_taken; i++) dup |= taken[i] == port;
        if (dup) continue;
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
        close(fd);
        if (ok) return port;
    }
    return -1;
}

typedef struct up_ports {
    bool autopick;
    int taken[256], n;
} up_ports;

/* fixed when the user gave ports, a free one otherwise */
static int up_port(up_ports *pp, int fixed)
{
    int port = pp->autopick ? up_pick_port(pp->taken, pp->n) : fixed;
    if (pp->n < 256) pp->taken[pp->n++] = port;
    return port;
}

int up_parse_netns(const char *spec, up_netns *out)
{
    memset(out, 0, sizeof *out);
    if (!spec) return 0;
    if (sscanf(spec, "%63[^=]=%63[^,],%63[^,],%63s", out->worker, out->ns, out->worker_addr,
               out->host_addr) != 4)
        return -1;
    return 1;
}

/* What the plan of one process needs besides the options: where the daemons are, the port
 * picker, and the endpoints that later processes are given (controller's, workers' list). */
typedef struct up_planner {
    const up_opts *o;
    const char *bin_dir;
    up_ports pp;
    char ctl_listen[128], ctl_view[128];
    km_buf workers; /* --workers of the routers: id=requests+events,... */
} up_planner;

/* Every daemon's security: the cluster's key directory (each daemon's own certificate is the
 * one named after it there), or --insecure when asked for. */
static void plan_security(const up_opts *o, up_proc *p, int *k)
{
    p->argv[(*k)++] = o->insecure ? strdup("--insecure") : xfmt("--keydir=%s", o->keydir);
    if (!o->insecure && !strcmp(p->role, "router"))
        p->argv[(*k)++] = xfmt("--api-keys=%s", o->api_keys);
    if (!o->insecure && !strcmp(p->role, "worker")) /* disk pages with a MAC, when on disk */
        p->argv[(*k)++] = xfmt("--cluster-secret=%s/cluster.secret", o->keydir);
}

static void plan_controller(up_planner *pl, up_proc *p, int *k)
{
    const up_opts *o = pl->o;
    const char *ctl_host = o->has_ns ? o->ns.host_addr : "127.0.0.1";
    int lp = up_port(&pl->pp, (int)o->ctl_port), vp = up_port(&pl->pp, (int)o->ctl_port + 1);
    int ap = up_port(&pl->pp, (int)o->ctl_admin_port);
    p->role = "controller";
    snprintf(p->name, sizeof p->name, "controller");
    snprintf(pl->ctl_listen, sizeof pl->ctl_listen, "tcp://%s:%d", ctl_host, lp);
    /* the view too: a worker in the namespace subscribes to it for its peers (--peer-view) */
    snprintf(pl->ctl_view, sizeof pl->ctl_view, "tcp://%s:%d", ctl_host, vp);
    snprintf(p->listen, sizeof p->listen, "%s", pl->ctl_listen);
    snprintf(p->view, sizeof p->view, "%s", pl->ctl_view);
    snprintf(p->admin, sizeof p->admin, "http://127.0.0.1:%d", ap);
    p->argv[(*k)++] = xfmt("%s/kvmesh-controller", pl->bin_dir);
    p->argv[(*k)++] = xfmt("--listen=%s", pl->ctl_listen);
    p->argv[(*k)++] = xfmt("--view=%s", pl->ctl_view);
    p->argv[(*k)++] = xfmt("--admin-port=%d", ap);
    p->argv[(*k)++] = xfmt("--controller-id=controller");
    plan_security(o, p, k);
    push_args(p->argv, k, UP_ARGV_MAX, o->ctl_args);
}

/* The worker's transfer node (on by default: docs/transfer.md): --peer-listen HOST:PORT from its
 * flags (the last one wins), else one on its own host (loopback, or its --netns address) unless
 * they say --no-peer. Port 0 becomes a port planned like the others (base + 10i + 3), so
 * cluster.env can say where each worker's UCX listener is (peer=HOST:PORT). */
static void plan_peer(up_planner *pl, up_proc *p, int wi, int *argc, const char *own_host)
{
    int at = -1, off = 0;
    bool none = false; /* the worker's --no-peer wins over any --peer-listen */
    for (int i = 0; i < *argc; i++) {
        if (!strncmp(p->argv[i], "--peer-listen=", 14))
            at = i, off = 14;
        else if (!strcmp(p->argv[i], "--peer-listen") && i + 1 < *argc)
            at = i + 1, off = 0;
        none |= !strcmp(p->argv[i], "--no-peer") || !strcmp(p->argv[i], "--peer=false");
    }
    if (none) return;
    if (at < 0 && *argc < UP_ARGV_MAX - 1) {
        at = (*argc)++;
        off = 14;
        p->argv[at] = xfmt("--peer-listen=%s:0", own_host);
    }
    if (at < 0) return;
    const char *v = p->argv[at] + off, *colon = strrchr(v, ':');
    if (!colon || colon == v) return; /* the worker refuses it and says why */
    int port = atoi(colon + 1);
    char host[96];
    snprintf(host, sizeof host, "%.*s", (int)(colon - v), v);
    if (port == 0) {
        port = up_port(&pl->pp, (int)pl->o->base_port + 10 * wi + 3);
        /* a worker restarted after a SIGKILL binds the same port while its peers' connections
         * to the old process still hold it: UCX's listener must reuse the address */
        setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
        char *now = xfmt("%s%s:%d", off ? "--peer-listen=" : "", host, port);
        free(p->argv[at]);
        p->argv[at] = now;
    }
    snprintf(p->peer, sizeof p->peer, "%s:%d", host, port);
}

static void plan_worker(up_planner *pl, up_proc *p, int wi, int *k)
{
    const up_opts *o = pl->o;
    int rp = up_port(&pl->pp, (int)o->base_port + 10 * wi);
    int ep = up_port(&pl->pp, (int)o->base_port + 10 * wi + 1);
    int ap = up_port(&pl->pp, (int)o->base_port + 10 * wi + 2);
    p->role = "worker";
    snprintf(p->name, sizeof p->name, "w%d", wi);
    bool in_ns = o->has_ns && !strcmp(o->ns.worker, p->name);
    /* with a namespace, the other workers bind the host end of its veth: the one in the
     * namespace reaches them there (pulls, handoffs), as the router does from the host */
    const char *host = in_ns ? o->ns.worker_addr : o->has_ns ? o->ns.host_addr : "127.0.0.1";
    snprintf(p->requests, sizeof p->requests, "tcp://%s:%d", host, rp);
    snprintf(p->events, sizeof p->events, "tcp://%s:%d", host, ep);
    snprintf(p->admin, sizeof p->admin, "http://%s:%d", host, ap);
    if (in_ns) {
        p->argv[(*k)++] = strdup("/usr/sbin/ip");
        if (access(p->argv[0], X_OK)) {
            free(p->argv[0]);
            p->argv[0] = strdup("/sbin/ip");
        }
        p->argv[(*k)++] = strdup("netns");
        p->argv[(*k)++] = strdup("exec");
        p->argv[(*k)++] = strdup(o->ns.ns);
    }
    p->argv[(*k)++] = xfmt("%s/kvmesh-worker", pl->bin_dir);
    p->argv[(*k)++] = xfmt("--worker-id=%s", p->name);
    p->argv[(*k)++] = xfmt("--listen=%s", p->requests);
    p->argv[(*k)++] = xfmt("--events=%s", p->events);
    p->argv[(*k)++] = xfmt("--admin-host=%s", host);
    p->argv[(*k)++] = xfmt("--admin-port=%d", ap);
    p->argv[(*k)++] = xfmt("--threads=%lld", (long long)o->threads);
    p->argv[(*k)++] = xfmt("--cluster-seed=%lld", (long long)o->cluster_seed);
    plan_security(o, p, k);
    if (o->with_controller) {
        p->argv[(*k)++] = xfmt("--controller=%s", pl->ctl_listen);
        /* the peers a drain hands its pages to, and the holders a pull hint may name */
        p->argv[(*k)++] = xfmt("--peer-view=%s", pl->ctl_view);
    }
    if (o->model) p->argv[(*k)++] = xfmt("--model=%s", o->model);
    if (o->kv_bytes) p->argv[(*k)++] = xfmt("--kv-bytes=%s", o->kv_bytes);
    if (wi < o->n_prefill + o->n_decode) /* before the extra flags, which may override it */
        p->argv[(*k)++] = xfmt("--role=%s", wi < o->n_prefill ? "prefill" : "decode");
    push_args(p->argv, k, UP_ARGV_MAX, o->worker_args);
    push_args_for(p->argv, k, UP_ARGV_MAX, o->worker_args_for, p->name);
    plan_peer(pl, p, wi, k, host);
    km_buf_printf(&pl->workers, "%s%s=%s+%s", wi ? "," : "", p->name, p->requests, p->events);
}

/* The smallest --max-ctx given to any worker (--worker-args, --worker-args-for), or 0: the router
 * refuses HTTP requests over it (its --max-ctx), and a request may land on any worker. */
static long long workers_max_ctx(const up_opts *o)
{
    long long min = 0;
    const char *lists[] = {o->worker_args, o->worker_args_for};
    for (int i = 0; i < 2; i++)
        for (const char *p = lists[i]; p && (p = strstr(p, "--max-ctx")); p++) {
            long long v = 0;
            if (sscanf(p + strlen("--max-ctx"), "%*[= ]%lld", &v) == 1 && v > 0 &&
                (!min || v < min))
                min = v;
        }
    return min;
}

static void plan_router(up_planner *pl, up_proc *p, int ri, int *k)
{
    const up_opts *o = pl->o;
    int fp = up_port(&pl->pp, (int)o->front_port + ri),
        hp = up_port(&pl->pp, (int)o->http_port + ri);
    p->role = "router";
    if (ri)
        snprintf(p->name, sizeof p->name, "router%d", ri);
    else
        snprintf(p->name, sizeof p->name, "router");
    snprintf(p->requests, sizeof p->requests, "tcp://127.0.0.1:%d", fp);
    /* --router-args with a certificate: the front is HTTPS (cluster.env says so too) */
    snprintf(p->http, sizeof p->http, "%s://127.0.0.1:%d",
             o->router_args && strstr(o->router_args, "--tls-cert") ? "https" : "http", hp);
    p->argv[(*k)++] = xfmt("%s/kvmesh-router", pl->bin_dir);
    p->argv[(*k)++] = xfmt("--workers=%s", (const char *)pl->workers.data);
    p->argv[(*k)++] = xfmt("--front=%s", p->requests);
    p->argv[(*k)++] = xfmt("--http-port=%d", hp);
    p->argv[(*k)++] = xfmt("--cluster-seed=%lld", (long long)o->cluster_seed);
    p->argv[(*k)++] = xfmt("--mode=%s", o->mode);
    plan_security(o, p, k);
    if (o->with_controller) p->argv[(*k)++] = xfmt("--controller=%s", pl->ctl_view);
    if (o->model) p->argv[(*k)++] = xfmt("--model=%s", o->model);
    long long ctx = workers_max_ctx(o);
    if (ctx) p->argv[(*k)++] = xfmt("--max-ctx=%lld", ctx);
    push_args(p->argv, k, UP_ARGV_MAX, o->router_args);
}

/* A new entry of the process table, its argv empty. */
static up_proc *plan_open(up_state *st)
{
    up_proc *p = &st->p[st->n++];
    p->st = st;
    p->argv = calloc(UP_ARGV_MAX, sizeof *p->argv);
    return p;
}

/* The entry's log file and restart timer, and checks that its daemon is there and that its ports
 * were found: 0, or 1 after saying why not. */
static int plan_close(up_state *st, const up_planner *pl, up_proc *p, int k)
{
    const up_opts *o = pl->o;
    int status = 0;
    bool ctl = !strcmp(p->role, "controller");
    p->argc = k;
    p->log_fd = -1;
    if (o->log_dir) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%s.log", o->log_dir, p->name);
        p->log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    }
    uv_timer_init(st->loop, &p->backoff);
    p->backoff.data = p;
    const char *bin = p->argv[0];
    for (int a = 0; a < k; a++) /* the daemon, not a flag whose path has "kvmesh-" in it */
        if (p->argv[a][0] != '-' && strstr(p->argv[a], "/kvmesh-")) {
            bin = p->argv[a];
            break;
        }
    if (access(bin, X_OK)) {
        fprintf(stderr, "kvmesh up: %s not found (build it: make%s)\n", bin,
                ctl ? "; or run without one: --no-controller" : "");
        status = 1;
    }
    for (int a = 0; a < pl->pp.n; a++)
        if (pl->pp.taken[a] < 0) {
            fprintf(stderr, "kvmesh up: no free port found\n");
            status = 1;
        }
    return status;
}

int up_plan(up_state *st, const up_opts *o, const char *bin_dir)
{
    up_planner pl = {.o = o, .bin_dir = bin_dir, .pp = {.autopick = o->base_port == 0}};
    int status = 0;
    int total = (o->with_controller ? 1 : 0) + (int)o->n_workers + (int)o->n_routers;
    for (int i = 0; i < total && status == 0; i++) {
        int wi = i - (o->with_controller ? 1 : 0);
        up_proc *p = plan_open(st);
        int k = 0;
        if (wi < 0)
            plan_controller(&pl, p, &k);
        else if (wi < o->n_workers)
            plan_worker(&pl, p, wi, &k);
        else
            plan_router(&pl, p, wi - (int)o->n_workers, &k);
        status = plan_close(st, &pl, p, k);
    }
    km_buf_free(&pl.workers);
    return status;
}

int up_plan_worker(up_state *st, int wi)
{
    const up_opts *o = st->o;
    if (st->n >= UP_MAX || !o->with_controller) return 1;
    /* the controller's endpoints, as planned; ports that clash with the running processes' are
     * refused by the worker's bind and retried by the supervisor's restart */
    up_planner pl = {.o = o, .bin_dir = st->bin_dir, .pp = {.autopick = o->base_port == 0}};
    snprintf(pl.ctl_listen, sizeof pl.ctl_listen, "%s", st->p[0].listen);
    snprintf(pl.ctl_view, sizeof pl.ctl_view, "%s", st->p[0].view);
    up_proc *p = plan_open(st);
    int k = 0;
    plan_worker(&pl, p, wi, &k);
    int status = plan_close(st, &pl, p, k);
    km_buf_free(&pl.workers);
    return status;
}
