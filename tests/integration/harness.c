/*
 * harness.c — the integration suites' shared helpers (harness.h): children on ephemeral ports
 * found through their ports files, stopped with deadlines and never left running; DEALER
 * sockets speaking km_msg; HTTP GET and /metrics on an admin port; a private network of network
 * namespaces for the suites across hosts; whole clusters that `kvmesh up` runs, stopped the same
 * way. Plain sockets for HTTP, so the suites do not depend on the client library they may be
 * testing; `ip` (iproute2) for the namespaces.
 */
#define _GNU_SOURCE /* setns */
#include "tests/integration/harness.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#define IT_MAX_CHILDREN 64

static pid_t g_children[IT_MAX_CHILDREN]; /* running children, 0 where free */
static void *g_zctx;

static void it_remember(pid_t pid)
{
    for (int i = 0; i < IT_MAX_CHILDREN; i++)
        if (!g_children[i]) {
            g_children[i] = pid;
            return;
        }
    cr_assert_fail("more than %d children at once", IT_MAX_CHILDREN);
}

static void it_forget(pid_t pid)
{
    for (int i = 0; i < IT_MAX_CHILDREN; i++)
        if (g_children[i] == pid) g_children[i] = 0;
}

const char *it_bin(const char *name)
{
    static char paths[8][256];
    static int n;
    const char *dir = getenv("KVMESH_IT_BIN");
    char want[256];
    snprintf(want, sizeof want, "%s/%s", dir && *dir ? dir : "build/bin", name);
    for (int i = 0; i < n; i++)
        if (!strcmp(paths[i], want)) return paths[i];
    if (n == 8) return "build/bin/unknown"; /* more daemons than kvmesh has */
    snprintf(paths[n], sizeof paths[n], "%s", want);
    return paths[n++];
}

bool it_have(const char *const *paths)
{
    for (int i = 0; paths[i]; i++)
        if (access(paths[i], strstr(paths[i], "/bin/") ? X_OK : R_OK)) {
            cr_skip_test("needs %s (%s)", paths[i],
                         strstr(paths[i], "models/") ? "make deps" : "make build");
            return false;
        }
    return true;
}

bool it_have_curl(void)
{
    if (!system("command -v curl >/dev/null 2>&1")) return true;
    cr_skip_test("curl is not installed");
    return false;
}

void it_proc_dir(it_proc *p, const char *tag)
{
    if (p->dir[0]) return;
    snprintf(p->dir, sizeof p->dir, "/tmp/kvmesh-%s-XXXXXX", tag);
    cr_assert_not_null(mkdtemp(p->dir), "mkdtemp %s", p->dir);
}

static void it_read_ports(it_proc *p, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[600];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        const char *eq = strchr(line, '=');
        if (!eq) continue;
        const char *v = eq + 1;
        size_t k = (size_t)(eq - line);
        if (k == 6 && !strncmp(line, "listen", k)) snprintf(p->listen, sizeof p->listen, "%s", v);
        if (k == 4 && !strncmp(line, "view", k)) snprintf(p->view, sizeof p->view, "%s", v);
        if (k == 8 && !strncmp(line, "requests", k)) snprintf(p->req, sizeof p->req, "%s", v);
        if (k == 6 && !strncmp(line, "events", k)) snprintf(p->ev, sizeof p->ev, "%s", v);
        if (k == 5 && !strncmp(line, "front", k)) snprintf(p->front, sizeof p->front, "%s", v);
        if (k == 4 && !strncmp(line, "http", k)) p->http_port = atoi(v);
        if (k == 5 && !strncmp(line, "admin", k)) { /* "PORT" or "HOST:PORT" */
            const char *c = strrchr(v, ':');
            p->admin_port = atoi(c ? c + 1 : v);
        }
    }
    fclose(f);
}

void it_spawn(it_proc *p, const char *const *argv, const char *const *extra, const char *logname)
{
    const char *args[64];
    int n = 0;
    if (p->ns[0]) { /* ip execs the command in place: p->pid is the daemon's own pid */
        const char *in[] = {"ip", "netns", "exec", p->ns};
        for (int i = 0; i < 4; i++) args[n++] = in[i];
    }
    for (int i = 0; argv[i] && n < 63; i++) args[n++] = argv[i];
    for (int i = 0; extra && extra[i] && n < 63; i++) args[n++] = extra[i];
    args[n] = NULL;
    char ports[128], log[128];
    snprintf(ports, sizeof ports, "%s/ports", p->dir);
    snprintf(log, sizeof log, "%s/%s", p->dir, logname);
    unlink(ports);
    pid_t parent = getpid();
    p->pid = fork();
    cr_assert(p->pid >= 0, "fork");
    if (p->pid == 0) {
        /* a test killed at its time-out runs no fini: its daemons die with it (the signal
         * survives exec); the parent may have died before this line already */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) || getppid() != parent) _exit(127);
        FILE *f = freopen(log, "a", stderr);
        FILE *o = freopen("/dev/null", "w", stdout);
        (void)f, (void)o;
        /* the suites on this harness are about other things: the daemons run without CURVE, on
         * purpose (the security suite, test_security.c, runs them with keys) */
        setenv("KVMESH_INSECURE", "1", 1);
        execvp(args[0], (char *const *)args);
        _exit(127);
    }
    it_remember(p->pid);
    if (!p->no_wait) it_spawn_wait(p);
}

void it_spawn_wait(it_proc *p)
{
    p->no_wait = false;
    char ports[128];
    snprintf(ports, sizeof ports, "%s/ports", p->dir);
    for (int i = 0; i < 600; i++) {
        if (!access(ports, R_OK)) {
            it_read_ports(p, ports);
            return;
        }
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            it_forget(p->pid);
            p->pid = 0;
            cr_assert_fail("the daemon of %s exited at start (its log is there)", p->dir);
        }
        usleep(50000);
    }
    cr_assert_fail("the daemon of %s did not start in 30 s (its log is there)", p->dir);
}

const char *it_worker_bin(void)
{
    const char *w = getenv("KVMESH_IT_WORKER");
    return w && *w ? w : IT_WORKER;
}

void it_start_worker(it_proc *p, const char *tag, const char *const *flags,
                     const char *const *extra)
{
    it_proc_dir(p, tag);
    char ports[128];
    snprintf(ports, sizeof ports, "%s/ports", p->dir);
    const char *argv[48] = {it_worker_bin(), "--listen=tcp://127.0.0.1:*",
                            "--events=tcp://127.0.0.1:*", "--ports-file", ports};
    int n = 5;
    for (int i = 0; flags && flags[i] && n < 47; i++) argv[n++] = flags[i];
    argv[n] = NULL;
    it_spawn(p, argv, extra, "worker.log");
}

bool it_router_http_start(it_proc *r, it_proc *w, int nw, int threads, const char *tag,
                          const char *const *extra)
{
    if (!it_have((const char *const[]){IT_MODEL, IT_WORKER, IT_ROUTER, NULL})) return false;
    char workers[4096] = "--workers=", nthreads[32];
    snprintf(nthreads, sizeof nthreads, "--threads=%d", threads);
    for (int i = 0; i < nw; i++) {
        char id[32];
        snprintf(id, sizeof id, "--worker-id=w%d", i);
        const char *flags[] = {"--admin-port=-1", nthreads, "--log-level=warn", id, NULL};
        memset(&w[i], 0, sizeof w[i]);
        it_start_worker(&w[i], tag, flags, NULL);
        snprintf(workers + strlen(workers), sizeof workers - strlen(workers), "%sw%d=%s+%s",
                 i ? "," : "", i, w[i].req, w[i].ev);
    }
    memset(r, 0, sizeof *r);
    it_proc_dir(r, tag);
    char ports[128];
    snprintf(ports, sizeof ports, "%s/ports", r->dir);
    const char *argv[] = {IT_ROUTER,       "--front=tcp://127.0.0.1:*",
                          "--http-port=0", "--log-level=warn",
                          workers,         "--ports-file",
                          ports,           NULL};
    it_spawn(r, argv, extra, "log");
    char out[64];
    IT_WAIT(it_http_get(r->http_port, "/readyz", out, sizeof out) == 200, 30000,
            "no worker came up at the router (logs in %s)", r->dir);
    return true;
}

int it_wait_exit(it_proc *p, int timeout_ms)
{
    if (p->pid <= 0) return -1;
    int st = 0;
    pid_t pid = p->pid;
    p->pid = 0;
    for (int i = 0; i < timeout_ms / 20; i++) {
        if (waitpid(pid, &st, WNOHANG) == pid) {
            it_forget(pid);
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    it_forget(pid);
    return -1;
}

void it_stop(it_proc *p)
{
    if (p->pid <= 0) return;
    kill(p->pid, SIGCONT);
    kill(p->pid, SIGTERM);
    it_wait_exit(p, 5000);
}

void it_kill_all(void)
{
    for (int i = 0; i < IT_MAX_CHILDREN; i++)
        if (g_children[i] > 0) {
            kill(g_children[i], SIGCONT);
            kill(g_children[i], SIGKILL);
            waitpid(g_children[i], NULL, 0);
            g_children[i] = 0;
        }
    it_net_destroy(); /* once nothing runs inside its namespaces */
}

/* ---------------------------------------------------------------- ZeroMQ */

uint64_t it_deadline(int timeout_ms)
{
    return km_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

bool it_poll(uint64_t deadline)
{
    if (km_now_ns() >= deadline) return false;
    km_sleep_ms(IT_POLL_MS);
    return true;
}

void *it_zctx(void)
{
    if (!g_zctx) g_zctx = km_zctx_create();
    cr_assert_not_null(g_zctx);
    return g_zctx;
}

void *it_dealer(const char *ep)
{
    void *s = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_open(it_zctx(), KM_ZDEALER, NULL, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_connect(s, ep, &err), 0, "%s", err.msg);
    return s;
}

void *it_xpub(const char *url, char *ep, size_t cap)
{
    void *s = zmq_socket(it_zctx(), ZMQ_XPUB);
    cr_assert_not_null(s, "XPUB: %s", zmq_strerror(zmq_errno()));
    const int one = 1, zero = 0;
    cr_assert_eq(zmq_setsockopt(s, ZMQ_XPUB_VERBOSE, &one, sizeof one), 0);
    cr_assert_eq(zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero), 0);
    cr_assert_eq(zmq_bind(s, url), 0, "bind %s: %s", url, zmq_strerror(zmq_errno()));
    size_t n = cap;
    cr_assert_eq(zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &n), 0);
    return s;
}

void it_wait_subscribed(void *xpub, int n, int timeout_ms)
{
    const uint64_t end = it_deadline(timeout_ms);
    int got = 0;
    while (got < n) {
        uint8_t b[256];
        int len = zmq_recv(xpub, b, sizeof b, ZMQ_DONTWAIT);
        if (len > 0) {
            got += b[0] == 1; /* 1: subscribe, 0: unsubscribe */
            continue;
        }
        cr_assert(it_poll(end), "%d of %d subscriptions reached the publisher in %d ms", got, n,
                  timeout_ms);
    }
}

void it_send_raw(void *s, const void *p, size_t n)
{
    km_zframe f = {p, n};
    cr_assert_eq(km_zsend(s, &f, 1, 0, NULL), 0);
}

void it_send_msg(void *s, const km_msg *m)
{
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(m, NULL, &b, &err), 0, "%s", err.msg);
    it_send_raw(s, b.data, b.len);
    km_buf_free(&b);
}

bool it_recv_msg(void *s, km_msg *m, int timeout_ms)
{
    km_zmsg z = {0};
    if (km_zrecv(s, &z, timeout_ms, NULL)) {
        km_zmsg_clear(&z);
        return false;
    }
    const km_zframe *b = km_zmsg_body(&z);
    cr_assert_not_null(b, "a message without a body frame");
    km_errbuf err = {{0}};
    int rc = km_msg_decode(b->data, b->len, NULL, m, &err);
    km_zmsg_clear(&z);
    cr_assert_eq(rc, 0, "an undecodable frame: %s", err.msg);
    return true;
}

/* ---------------------------------------------------------------- HTTP and metrics */

int it_http_get_at(const char *host, int port, const char *path, char *out, size_t cap)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    cr_assert_eq(inet_pton(AF_INET, host, &a.sin_addr), 1, "not an IPv4 address: %s", host);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {.tv_sec = 10}; /* a server that accepts and never answers */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    char req[256];
    int n =
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t len = 0;
    ssize_t r;
    while (len + 1 < cap && (r = read(fd, out + len, cap - 1 - len)) > 0) len += (size_t)r;
    out[len] = 0;
    close(fd);
    int code = -1;
    if (sscanf(out, "HTTP/1.%*d %d", &code) != 1) code = -1;
    return code;
}

int it_http_get(int port, const char *path, char *out, size_t cap)
{
    return it_http_get_at("127.0.0.1", port, path, out, cap);
}

double it_metric_in(const char *text, const char *series)
{
    const char *p = text;
    size_t sl = strlen(series);
    while ((p = strstr(p, series))) {
        if ((p == text || p[-1] == '\n') && p[sl] == ' ') return atof(p + sl + 1);
        p += sl;
    }
    return -1;
}

double it_metric_at(const char *host, int port, const char *series)
{
    static char text[1 << 18];
    int code = it_http_get_at(host, port, "/metrics", text, sizeof text);
    cr_assert_eq(code, 200, "GET /metrics on %s:%d answered %d", host, port, code);
    return it_metric_in(text, series);
}

double it_metric(int admin_port, const char *series)
{
    return it_metric_at("127.0.0.1", admin_port, series);
}

/* ---------------------------------------------------------------- across hosts */

#define IT_NET_PREFIX "kvmesh-it-"
#define IT_NET_SUBNET "10.250.0" /* a /24 private to each network: nothing routes between them */

static struct {
    bool made, at_exit;
    char hub[64];  /* the bridge's namespace */
    char self[64]; /* the test process's namespace */
    int n;
    char ns[IT_NET_HOSTS][64];
} g_net;

int it_sh(const char *fmt, ...)
{
    char cmd[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    cr_assert(n > 0 && (size_t)n < sizeof cmd, "command too long: %s", fmt);
    int rc = system(cmd);
    return rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* Each line of a command's output (at most max lines, cut at 127 characters) into lines;
 * returns the count. */
static int it_lines(const char *cmd, char lines[][128], int max)
{
    FILE *f = popen(cmd, "r");
    if (!f) return 0;
    int n = 0;
    char line[512];
    while (n < max && fgets(line, sizeof line, f)) {
        size_t l = strcspn(line, "\n");
        if (l > 127) l = 127; /* what the callers look for is at a line's start */
        memcpy(lines[n], line, l);
        lines[n++][l] = 0;
    }
    pclose(f);
    return n;
}

/* What a run of this harness that died left: its namespaces (named with its pid, which no
 * longer runs), after SIGKILLing by pid the processes still inside (its daemons, whose parent
 * died without a fini). Their links go with them. */
static void it_net_reap_stale(void)
{
    static char names[256][128];
    int n = it_lines("ip netns list 2>/dev/null", names, 256);
    for (int i = 0; i < n; i++) {
        int pid = 0;
        names[i][strcspn(names[i], " ")] = 0; /* "NAME (id: N)" */
        if (sscanf(names[i], IT_NET_PREFIX "%d-", &pid) != 1 || pid <= 0 || pid == getpid())
            continue;
        if (!kill(pid, 0) || errno != ESRCH) continue; /* its run goes on */
        char cmd[256], pids[64][128];
        snprintf(cmd, sizeof cmd, "ip netns pids %s 2>/dev/null", names[i]);
        int k = it_lines(cmd, pids, 64);
        for (int j = 0; j < k; j++) {
            pid_t q = (pid_t)atoi(pids[j]);
            if (q > 1) kill(q, SIGKILL);
        }
        it_sh("ip netns del %s 2>/dev/null", names[i]);
    }
}

#define IT_MUST(...) cr_assert_eq(it_sh(__VA_ARGS__), 0, "failed: " __VA_ARGS__)

/* Namespace ns, on the bridge through hub-side link hub_if, with address ip. */
static void it_net_join(const char *ns, const char *hub_if, const char *ip)
{
    IT_MUST("ip netns add %s", ns);
    snprintf(g_net.ns[g_net.n++], sizeof g_net.ns[0], "%s", ns);
    IT_MUST("ip -n %s link add %s type veth peer name eth0 netns %s && "
            "ip -n %s link set %s master br0 up",
            g_net.hub, hub_if, ns, g_net.hub, hub_if);
    IT_MUST("ip -n %s addr add %s/24 dev eth0 && ip -n %s link set eth0 up && "
            "ip -n %s link set lo up",
            ns, ip, ns, ns);
}

bool it_net_create(const char *const *names, it_host *hosts)
{
    cr_assert(!g_net.made, "one network per test process");
    /* the sockets and threads made from here on are in the test's namespace; a ZeroMQ context
     * made before would keep its I/O threads outside */
    cr_assert_null(g_zctx, "it_net_create comes before the test's first socket");
    it_net_reap_stale();
    int pid = getpid();
    snprintf(g_net.hub, sizeof g_net.hub, IT_NET_PREFIX "%d-hub", pid);
    if (it_sh("ip netns add %s 2>/dev/null", g_net.hub)) {
        cr_skip_test("`ip netns add` is not permitted here (needs root or CAP_SYS_ADMIN, and "
                     "iproute2): the test across network namespaces is skipped");
        return false;
    }
    g_net.made = true;
    if (!g_net.at_exit) atexit(it_net_destroy); /* a test that exits without its fini */
    g_net.at_exit = true;
    IT_MUST("ip -n %s link add br0 type bridge && ip -n %s link set br0 up", g_net.hub, g_net.hub);
    snprintf(g_net.self, sizeof g_net.self, IT_NET_PREFIX "%d-self", pid);
    it_net_join(g_net.self, "self", it_net_self());
    for (int i = 0; names[i]; i++) {
        cr_assert_lt(i, IT_NET_HOSTS - 1, "more than %d hosts", IT_NET_HOSTS - 1);
        it_host *h = &hosts[i];
        char hub_if[16];
        snprintf(h->ns, sizeof h->ns, IT_NET_PREFIX "%d-%s", pid, names[i]);
        snprintf(h->ip, sizeof h->ip, IT_NET_SUBNET ".%d", 10 + i);
        snprintf(hub_if, sizeof hub_if, "h%d", i);
        it_net_join(h->ns, hub_if, h->ip);
    }
    /* and the test process moves into its own: children it starts outside any host's
     * namespace run there too (setns moves this thread; threads started later follow it) */
    char path[128];
    snprintf(path, sizeof path, "/run/netns/%s", g_net.self);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    cr_assert(fd >= 0, "open %s", path);
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    cr_assert_eq(rc, 0, "setns %s: %s", path, strerror(errno));
    return true;
}

const char *it_net_self(void)
{
    return IT_NET_SUBNET ".1";
}

void it_net_self_link(bool up)
{
    IT_MUST("ip -n %s link set eth0 %s", g_net.self, up ? "up" : "down");
}

void it_net_decoy(const it_host *h)
{
    const char *ns = h ? h->ns : g_net.self;
    IT_MUST("ip -n %s link add decoy type veth peer name decoyp && "
            "ip -n %s addr add 10.251.0.1/30 dev decoy && ip -n %s link set decoy up && "
            "ip -n %s link set decoyp up",
            ns, ns, ns, ns);
}

void it_net_destroy(void)
{
    if (!g_net.made) return;
    for (int i = 0; i < g_net.n; i++) it_sh("ip netns del %s 2>/dev/null", g_net.ns[i]);
    it_sh("ip netns del %s 2>/dev/null", g_net.hub);
    g_net.made = false;
    g_net.n = 0;
}

/* ---------------------------------------------------------------- `kvmesh up` clusters */

void it_up_start(it_up *u, const char *tag, const char *const *args)
{
    memset(u, 0, sizeof *u);
    snprintf(u->dir, sizeof u->dir, "/tmp/kvmesh-%s-XXXXXX", tag);
    cr_assert_not_null(mkdtemp(u->dir), "mkdtemp %s", u->dir);
    snprintf(u->cluster, sizeof u->cluster, "%s/cluster.env", u->dir);
    char run[96], logs[96], out[96];
    snprintf(run, sizeof run, "--run-dir=%s", u->dir);
    snprintf(logs, sizeof logs, "--log-dir=%s/logs", u->dir);
    snprintf(out, sizeof out, "%s/up.log", u->dir);
    const char *argv[48] = {IT_KVMESH, "up", "--base-port=0", run, logs};
    int n = 5;
    for (int i = 0; args && args[i] && n < 47; i++) argv[n++] = args[i];
    argv[n] = NULL;
    const pid_t parent = getpid();
    u->pid = fork();
    cr_assert(u->pid >= 0, "fork");
    if (u->pid == 0) {
        /* a test killed at its time-out runs no fini: SIGTERM then makes kvmesh up stop its
         * daemons, as it_up_stop would */
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) || getppid() != parent) _exit(127);
        FILE *o = freopen(out, "w", stdout);
        FILE *e = freopen(out, "a", stderr);
        (void)o, (void)e;
        execv(IT_KVMESH, (char *const *)argv);
        _exit(127);
    }
}

void it_up_stop(it_up *u)
{
    if (u->pid > 0) {
        kill(u->pid, SIGTERM);
        for (int i = 0; i < 400 && waitpid(u->pid, NULL, WNOHANG) == 0; i++) usleep(50000);
        kill(u->pid, SIGKILL);
        waitpid(u->pid, NULL, 0);
        u->pid = 0;
    }
    FILE *f = u->cluster[0] ? fopen(u->cluster, "r") : NULL;
    char line[1024];
    while (f && fgets(line, sizeof line, f)) { /* role=... id=... pid=N ... */
        const char *p = strstr(line, " pid=");
        int pid = p ? atoi(p + 5) : 0;
        if (pid > 0 && kill(pid, 0) == 0) kill(pid, SIGKILL);
    }
    if (f) fclose(f);
}

char *it_stdout(const char *cmd)
{
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    km_buf b = {0};
    char tmp[4096];
    size_t n;
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) km_buf_append(&b, tmp, n);
    pclose(f);
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

char *it_curl_post(const char *url, const char *body_path, int max_s, int *status)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "curl -sN --max-time %d -w '\\n%%{http_code}' -H 'Content-Type: application/json' "
             "--data-binary @%s %s",
             max_s, body_path, url);
    char *out = it_stdout(cmd);
    char *nl = strrchr(out, '\n');
    cr_assert_not_null(nl, "no answer from %s", url);
    *status = atoi(nl + 1);
    *nl = 0;
    return out;
}

int it_shell(const char *cmd, char **out)
{
    char full[4096];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *f = popen(full, "r");
    cr_assert_not_null(f);
    size_t cap = 0;
    *out = NULL;
    if (getdelim(out, &cap, 0, f) < 0) { /* the output has no NUL: all of it at once */
        free(*out);
        *out = strdup("");
    }
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

void it_shell_expect(const char *cmd, int status, const char *says)
{
    char *out;
    int rc = it_shell(cmd, &out);
    cr_assert_eq(rc, status, "%s: exit %d, want %d:\n%s", cmd, rc, status, out);
    cr_assert(strstr(out, says), "%s: no '%s' in:\n%s", cmd, says, out);
    free(out);
}
