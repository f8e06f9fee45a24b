/*
 * chaos_cluster.c — the cluster a chaos scenario runs against, and the clean-up when interrupted:
 * `kvmesh up --base-port 0` started from this very binary in the run directory (free ports, so it
 * never collides with tests running beside it), its processes found through up's cluster.env,
 * the network namespace of the partition scenario, and the signal thread that stops all of it on
 * Ctrl-C.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/chaos.h"

/* What to clean up if we are interrupted (the signal thread reads them). */
static volatile pid_t g_up_pid;
static char g_netns[32], g_veth[16], g_cluster_file[128];
static volatile pid_t g_helper_pid;

void chaos_netns_helper(pid_t pid)
{
    g_helper_pid = pid;
}

/* Children get the signal mask back that chaos_signals_start blocked for its signal thread. */
static void unblock_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
}

/* In a forked child: stdout and stderr to these files. */
static void redirect_output(const char *out, const char *err)
{
    int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o >= 0) dup2(o, 1), close(o);
    if (e >= 0) dup2(e, 2), close(e);
}

int chaos_run_cmd(const char *const *argv, bool quiet)
{
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        unblock_signals();
        if (quiet) redirect_output("/dev/null", "/dev/null");
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

void chaos_netns_cleanup(void)
{
    pid_t helper = g_helper_pid;
    if (helper > 0) { /* it lets its held packets go and exits */
        kill(helper, SIGTERM);
        for (int i = 0; i < 100 && waitpid(helper, NULL, WNOHANG) == 0; i++) km_sleep_ms(20);
        g_helper_pid = 0;
    }
    if (g_veth[0]) {
        const char *a[] = {"ip", "link", "del", g_veth, NULL};
        chaos_run_cmd(a, true);
        g_veth[0] = 0;
    }
    if (g_netns[0]) {
        const char *a[] = {"ip", "netns", "del", g_netns, NULL};
        chaos_run_cmd(a, true);
        g_netns[0] = 0;
    }
}

static void on_signal_noop(int sig)
{
    (void)sig;
}

/* Ctrl-C or SIGTERM: a thread of its own (the signals are blocked everywhere else and taken with
 * sigwait), so the cleanup runs in ordinary context: stop the cluster (`up` stops its daemons;
 * anything left in cluster.env is killed), remove the namespace, exit. */
static void *signal_main(void *arg)
{
    sigset_t *set = arg;
    int sig = 0;
    if (sigwait(set, &sig)) return NULL;
    fprintf(stderr, "\nkvmesh chaos: %s: stopping the cluster and cleaning up\n", strsignal(sig));
    pid_t up = g_up_pid;
    if (up > 0) {
        kill(up, SIGTERM);
        for (int i = 0; i < 300 && kill(up, 0) == 0; i++) {
            waitpid(up, NULL, WNOHANG);
            km_sleep_ms(50);
        }
        kill(up, SIGKILL);
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n =
            g_cluster_file[0] ? kvm_cluster_read(g_cluster_file, procs, KVM_CLUSTER_MAX, NULL) : 0;
        for (int i = 0; i < n; i++)
            if (procs[i].pid > 0) kill(procs[i].pid, SIGKILL);
    }
    chaos_netns_cleanup();
    if (g_cluster_file[0]) {
        char *slash = strrchr(g_cluster_file, '/');
        if (slash) *slash = 0;
        fprintf(stderr, "kvmesh chaos: the interrupted run's logs are in %s\n", g_cluster_file);
    }
    _exit(128 + sig);
}

void chaos_signals_start(void)
{
    /* SIGINT/SIGTERM go to the signal thread only (a handler is set first, as a signal still
     * ignored when blocked would be dropped) */
    static sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    struct sigaction sa = {.sa_handler = on_signal_noop};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    pthread_t sig_thread;
    pthread_create(&sig_thread, NULL, signal_main, &sigs);
    pthread_detach(sig_thread);
}

int chaos_read_cluster(chaos_run *r, kvm_cluster_proc *procs)
{
    km_errbuf err = {{0}};
    int n = kvm_cluster_read(r->cluster_file, procs, KVM_CLUSTER_MAX, &err);
    return n < 0 ? 0 : n;
}

int chaos_proc_pid(chaos_run *r, const char *id)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = chaos_read_cluster(r, procs);
    const kvm_cluster_proc *p = kvm_cluster_find(procs, n, id);
    return p ? p->pid : 0;
}

const char *chaos_proc_field(chaos_run *r, const char *id, const char *field, char *buf, size_t cap)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = chaos_read_cluster(r, procs);
    const kvm_cluster_proc *p = kvm_cluster_find(procs, n, id);
    buf[0] = 0;
    if (!p) return buf;
    const char *v = !strcmp(field, "requests") ? p->requests
                    : !strcmp(field, "admin")  ? p->admin
                    : !strcmp(field, "listen") ? p->listen
                    : !strcmp(field, "view")   ? p->view
                    : !strcmp(field, "http")   ? p->http
                                               : "";
    snprintf(buf, cap, "%s", v);
    return buf;
}

/* Waits until process id runs with a pid other than old (0: any); returns the pid or 0. */
int chaos_wait_new_pid(chaos_run *r, const char *id, int old, int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 50) {
        int pid = chaos_proc_pid(r, id);
        if (pid > 0 && pid != old) return pid;
        km_sleep_ms(50);
    }
    return 0;
}

/* Waits until a worker's own /readyz says 200. */
bool chaos_wait_worker_ready(chaos_run *r, const char *id, int timeout_ms)
{
    char admin[128], url[200];
    chaos_proc_field(r, id, "admin", admin, sizeof admin);
    snprintf(url, sizeof url, "%s/readyz", admin);
    for (int waited = 0; waited < timeout_ms; waited += 100) {
        km_buf b = {0};
        int st = 0;
        int rc = kvm_http_get(url, 1000, &b, &st, NULL);
        km_buf_free(&b);
        if (!rc && st == 200) return true;
        km_sleep_ms(100);
    }
    return false;
}

bool chaos_wait_restarted(chaos_run *r, const char *id, int old, int timeout_ms)
{
    uint64_t deadline = km_wall_ms() + (uint64_t)timeout_ms;
    int pid = chaos_wait_new_pid(r, id, old, timeout_ms);
    if (!pid) {
        snprintf(r->note, sizeof r->note, "kvmesh up did not restart %s within %d s", id,
                 timeout_ms / 1000);
        return false;
    }
    uint64_t now = km_wall_ms();
    if (now >= deadline || !chaos_wait_worker_ready(r, id, (int)(deadline - now))) {
        snprintf(r->note, sizeof r->note,
                 "%s (restarted, pid %d) did not answer /readyz within %d s", id, pid,
                 timeout_ms / 1000);
        return false;
    }
    /* the view all ready, and the router connected to the new process again */
    char up[96];
    snprintf(up, sizeof up, "kvmesh_router_worker_up{worker=\"%s\"}", id);
    bool ready = false, routed = false;
    while (!(ready && routed) && km_wall_ms() < deadline) {
        pthread_mutex_lock(&r->mu);
        ready = r->all_ready;
        pthread_mutex_unlock(&r->mu);
        routed = ready && chaos_metric(r, "router", up) == 1;
        if (!(ready && routed)) km_sleep_ms(50);
    }
    if (!ready || !routed)
        snprintf(r->note, sizeof r->note, "%s was restarted and ready, but %s within %d s", id,
                 !ready ? "the view was not all ready" : "the router did not connect to it",
                 timeout_ms / 1000);
    return ready && routed;
}

double chaos_metric(chaos_run *r, const char *id, const char *series)
{
    char base[128], url[200];
    chaos_proc_field(r, id, !strcmp(id, "router") ? "http" : "admin", base, sizeof base);
    if (!base[0]) return -1;
    snprintf(url, sizeof url, "%s/metrics", base);
    /* the router's HTTP port serves /metrics to operator API keys only (docs/security.md) */
    char key[256] = "", path[160];
    if (!strcmp(id, "router")) {
        snprintf(path, sizeof path, "%s/keys/private/api_key.admin", r->dir);
        FILE *f = fopen(path, "r");
        if (f) {
            if (!fgets(key, sizeof key, f)) key[0] = 0;
            fclose(f);
        }
        key[strcspn(key, " \r\n")] = 0;
    }
    km_buf b = {0};
    int st = 0;
    double v = -1;
    if (!kvm_http_get_bearer(url, key[0] ? key : NULL, 2000, &b, &st, NULL) && st == 200 &&
        b.data) {
        size_t n = strlen(series);
        const char *text = (const char *)b.data, *end = text + b.len;
        for (const char *line = text; line < end;) {
            const char *nl = memchr(line, '\n', (size_t)(end - line));
            if (!nl) nl = end;
            if ((size_t)(nl - line) > n && !memcmp(line, series, n) && line[n] == ' ') {
                v = strtod(line + n + 1, NULL);
                break;
            }
            line = nl + 1;
        }
    }
    km_buf_free(&b);
    return v;
}

/* Makes the namespace and veth pair of the partition scenario; 1 = not permitted here (skip). */
int chaos_netns_setup(chaos_run *r)
{
    int id = getpid();
    snprintf(r->netns, sizeof r->netns, "kvmesh-chaos-%d", id);
    snprintf(r->veth_host, sizeof r->veth_host, "kvc%dh", id % 10000000);
    snprintf(r->veth_ns, sizeof r->veth_ns, "kvc%dn", id % 10000000);
    int a = 200 + id % 50, b = (id / 50) % 256, c = 4 * ((id / 12800) % 64);
    snprintf(r->addr_host, sizeof r->addr_host, "10.%d.%d.%d", a, b, c + 1);
    snprintf(r->addr_ns, sizeof r->addr_ns, "10.%d.%d.%d", a, b, c + 2);
    const char *add[] = {"ip", "netns", "add", r->netns, NULL};
    if (chaos_run_cmd(add, true)) return 1;
    snprintf(g_netns, sizeof g_netns, "%s", r->netns);
    r->netns_made = true;
    char host_cidr[40], ns_cidr[40];
    snprintf(host_cidr, sizeof host_cidr, "%s/30", r->addr_host);
    snprintf(ns_cidr, sizeof ns_cidr, "%s/30", r->addr_ns);
    const char *veth[] = {"ip",   "link", "add",  r->veth_host, "type",
                          "veth", "peer", "name", r->veth_ns,   NULL};
    if (chaos_run_cmd(veth, false)) return -1;
    snprintf(g_veth, sizeof g_veth, "%s", r->veth_host);
    const char *steps[][10] = {
        {"ip", "link", "set", r->veth_ns, "netns", r->netns, NULL},
        {"ip", "addr", "add", host_cidr, "dev", r->veth_host, NULL},
        {"ip", "link", "set", r->veth_host, "up", NULL},
        {"ip", "netns", "exec", r->netns, "ip", "addr", "add", ns_cidr, "dev", r->veth_ns},
        {"ip", "netns", "exec", r->netns, "ip", "link", "set", r->veth_ns, "up", NULL},
        {"ip", "netns", "exec", r->netns, "ip", "link", "set", "lo", "up", NULL},
    };
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        const char *argv[12] = {0};
        for (int j = 0; j < 10 && steps[i][j]; j++) argv[j] = steps[i][j];
        if (chaos_run_cmd(argv, false)) return -1;
    }
    return 0;
}

int chaos_cluster_start(chaos_run *r)
{
    /* this binary (exec'd through /proc/self/exe, which still works when a rebuild has replaced
     * the file meanwhile) and the daemons next to it */
    char bin_dir[4096];
    ssize_t l = readlink("/proc/self/exe", bin_dir, sizeof bin_dir - 1);
    if (l <= 0) return -1;
    bin_dir[l] = 0;
    char *slash = strrchr(bin_dir, '/');
    if (!slash) return -1;
    *slash = 0;
    char bin_flag[4200];
    snprintf(bin_flag, sizeof bin_flag, "--bin-dir=%s", bin_dir);
    char logs[128], uplog[128], netns[256] = "", args_for[512];
    snprintf(args_for, sizeof args_for, "%s:--chaos", CHAOS_TARGET);
    if (r->netns_made && r->sc->peer_split) /* each transfer node on its own side of the veth */
        snprintf(args_for, sizeof args_for,
                 "%s:--chaos --peer-listen=%s:0 --peer-advertise=%s;w0:--peer-listen=%s:0 "
                 "--peer-advertise=%s",
                 CHAOS_TARGET, r->addr_ns, r->addr_ns, r->addr_host, r->addr_host);
    if (r->sc->wflags_for) { /* the scenario's own, after the target's --chaos */
        size_t n = strlen(args_for);
        snprintf(args_for + n, sizeof args_for - n, ";%s", r->sc->wflags_for);
    }
    snprintf(logs, sizeof logs, "%s/logs", r->dir);
    snprintf(uplog, sizeof uplog, "%s/up.log", r->dir);
    if (r->netns_made)
        snprintf(netns, sizeof netns, "%s=%s,%s,%s", CHAOS_TARGET, r->netns, r->addr_ns,
                 r->addr_host);
    const char *argv[40] = {"kvmesh",
                            "up",
                            "--run-dir",
                            r->dir,
                            "--log-dir",
                            logs,
                            "--base-port=0",
                            "--workers=2",
                            "--threads=1",
                            "--kv-bytes=32M",
                            "--worker-args",
                            r->k.wflags,
                            "--worker-args-for",
                            args_for,
                            "--controller-args",
                            r->k.ctl,
                            "--router-args",
                            r->k.rflags};
    int k = 18;
    argv[k++] = bin_flag;
    if (netns[0]) argv[k++] = "--netns", argv[k++] = netns;
    argv[k] = NULL;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        unblock_signals();
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        redirect_output("/dev/null", uplog);
        execv("/proc/self/exe", (char *const *)argv);
        _exit(127);
    }
    r->up_pid = g_up_pid = pid;
    snprintf(r->op_cert, sizeof r->op_cert, "%s/keys/private/admin.key", r->dir);
    snprintf(r->client_cert, sizeof r->client_cert, "%s/keys/private/client.key", r->dir);
    snprintf(g_cluster_file, sizeof g_cluster_file, "%s", r->cluster_file);
    /* every process running ... */
    for (int waited = 0;; waited += 100) {
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n = chaos_read_cluster(r, procs), running = 0;
        for (int i = 0; i < n; i++) running += procs[i].pid > 0;
        if (n >= CHAOS_WORKERS + 2 && running == n) {
            const kvm_cluster_proc *c = kvm_cluster_find(procs, n, "controller");
            const kvm_cluster_proc *rt = kvm_cluster_find(procs, n, "router");
            if (!c || !rt) return -1;
            snprintf(r->ctl_listen, sizeof r->ctl_listen, "%s", c->listen);
            snprintf(r->ctl_view, sizeof r->ctl_view, "%s", c->view);
            snprintf(r->router, sizeof r->router, "%s", rt->requests);
            break;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid || waited > 30000) return -1;
        km_sleep_ms(100);
    }
    /* ... and the controller's view all ready */
    atomic_store(&r->mon_stop, false);
    pthread_create(&r->mon, NULL, chaos_monitor_main, r);
    r->mon_started = true;
    for (int waited = 0; waited < 120000; waited += 100) {
        pthread_mutex_lock(&r->mu);
        bool ready = r->all_ready;
        pthread_mutex_unlock(&r->mu);
        if (ready) return 0;
        km_sleep_ms(100);
    }
    return -1;
}

void chaos_cluster_stop(chaos_run *r)
{
    if (r->mon_started) {
        atomic_store(&r->mon_stop, true);
        pthread_join(r->mon, NULL);
        r->mon_started = false;
    }
    if (r->up_pid > 0) {
        kill(r->up_pid, SIGTERM);
        int st;
        bool gone = false;
        for (int i = 0; i < 300 && !gone; i++) {
            gone = waitpid(r->up_pid, &st, WNOHANG) == r->up_pid;
            if (!gone) km_sleep_ms(50);
        }
        if (!gone) {
            kill(r->up_pid, SIGKILL);
            waitpid(r->up_pid, &st, 0);
        }
        /* nothing up started may outlive it */
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n = chaos_read_cluster(r, procs);
        for (int i = 0; i < n; i++)
            if (procs[i].pid > 0 && kill(procs[i].pid, 0) == 0) kill(procs[i].pid, SIGKILL);
        r->up_pid = g_up_pid = 0;
        g_cluster_file[0] = 0;
    }
}
