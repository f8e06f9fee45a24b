/*
 * test_worker_pull.c — KV pages pulled between two kvmesh-worker processes (issue 14, phase 2):
 * worker A computes a prompt; the same prompt sent to worker B with a pull hint naming A is
 * served from pages B pulled from A over UCX (done.cached_tokens > 0, B's
 * kvmesh_kv_transfer_bytes_total{direction="in"} grows), and its greedy tokens are those A
 * computed. A holder that is stopped (SIGSTOP) or killed costs at most the pull's budget: B
 * computes the prompt itself and the request completes, with the same tokens.
 *
 * The test plays the controller (a ROUTER the workers send heartbeats to), which is where it
 * learns A's transfer node address (hb.peer_addr), as a router would from the view. Workers run
 * on ephemeral ports with UCX_TLS=tcp; every wait has a deadline. Run from the repository root
 * after `make build` (make integration); without the default model the tests skip.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/svc.h"

#define MODEL  "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define WORKER "build/bin/kvmesh-worker"

typedef struct wproc {
    pid_t pid;
    char dir[64], id[32];
    char req[512], ev[512];
    int admin_port;
} wproc;

static void *g_ctx;
static pid_t g_pids[4];
static int g_npids;

/* A network namespace joined to this one by a veth pair (host side hip, namespace side nip). */
typedef struct netns {
    char ns[32], vh[16], vn[16], hip[24], nip[24];
    bool made;
} netns;
static netns g_ns;

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void netns_cleanup(void)
{
    if (!g_ns.made) return;
    sh("ip link del %s 2>/dev/null", g_ns.vh);
    sh("ip netns del %s 2>/dev/null", g_ns.ns);
    g_ns.made = false;
}

/* False (and the test skipped) where `ip netns` is not permitted. */
static bool netns_setup(netns *n)
{
    int id = getpid();
    snprintf(n->ns, sizeof n->ns, "kvmesh-pull-%d", id);
    snprintf(n->vh, sizeof n->vh, "kvp%dh", id % 10000000);
    snprintf(n->vn, sizeof n->vn, "kvp%dn", id % 10000000);
    int a = 200 + id % 50, b = (id / 50) % 256, c = 4 * ((id / 12800) % 64);
    snprintf(n->hip, sizeof n->hip, "10.%d.%d.%d", a, b, c + 1);
    snprintf(n->nip, sizeof n->nip, "10.%d.%d.%d", a, b, c + 2);
    if (sh("ip netns add %s 2>/dev/null", n->ns)) {
        cr_skip_test("`ip netns add` is not permitted here (needs root or CAP_SYS_ADMIN)");
        return false;
    }
    n->made = true;
    cr_assert_eq(sh("ip link add %s type veth peer name %s", n->vh, n->vn), 0);
    cr_assert_eq(sh("ip link set %s netns %s", n->vn, n->ns), 0);
    cr_assert_eq(sh("ip addr add %s/30 dev %s && ip link set %s up", n->hip, n->vh, n->vh), 0);
    cr_assert_eq(sh("ip netns exec %s sh -c 'ip addr add %s/30 dev %s && ip link set %s up && "
                    "ip link set lo up'",
                    n->ns, n->nip, n->vn, n->vn),
                 0);
    return true;
}

static void kill_all(void)
{
    for (int i = 0; i < g_npids; i++) {
        int st;
        kill(g_pids[i], SIGCONT);
        if (waitpid(g_pids[i], &st, WNOHANG) == 0) {
            kill(g_pids[i], SIGKILL);
            waitpid(g_pids[i], &st, 0);
        }
    }
    g_npids = 0;
    netns_cleanup();
}

TestSuite(worker_pull, .fini = kill_all, .timeout = 300);

static bool have_model(void)
{
    if (access(MODEL, R_OK) || access(WORKER, X_OK)) {
        cr_skip_test("needs %s (make deps) and %s (make build)", MODEL, WORKER);
        return false;
    }
    return true;
}

/* A worker on host (its requests endpoint, transfer node and advertised address), inside network
 * namespace ns when ns is not NULL. */
static void start_worker_on(wproc *w, const char *id, const char *controller, const char *ns,
                            const char *host)
{
    memset(w, 0, sizeof *w);
    snprintf(w->id, sizeof w->id, "%s", id);
    snprintf(w->dir, sizeof w->dir, "/tmp/kvmesh-pull-XXXXXX");
    cr_assert(mkdtemp(w->dir));
    char ports[128], log[128];
    snprintf(ports, sizeof ports, "%s/ports", w->dir);
    snprintf(log, sizeof log, "%s/worker.log", w->dir);
    char listen[96], peer[96];
    snprintf(listen, sizeof listen, "tcp://%s:*", host);
    snprintf(peer, sizeof peer, "%s:0", host);
    const char *argv[] = {"ip",       "netns",
                          "exec",     ns ? ns : "",
                          WORKER,     "--listen",
                          listen,     "--events",
                          listen,     "--admin-port",
                          "0",        "--ports-file",
                          ports,      "--threads",
                          "1",        "--log-level",
                          "info",     "--worker-id",
                          id,         "--controller",
                          controller, "--heartbeat",
                          "100",      "--peer-listen",
                          peer,       "--peer-advertise",
                          host,       "--insecure",
                          NULL};
    const char *const *args = ns ? argv : argv + 4; /* ip netns exec NS, or the worker alone */
    w->pid = fork();
    cr_assert(w->pid >= 0);
    if (w->pid > 0 && g_npids < 4) g_pids[g_npids++] = w->pid;
    if (w->pid == 0) {
        FILE *f = freopen(log, "w", stderr);
        (void)f;
        setenv("UCX_TLS", "tcp", 1);
        execvp(args[0], (char *const *)args);
        _exit(127);
    }
    for (int i = 0; i < 1200; i++) {
        FILE *f = fopen(ports, "r");
        if (f) {
            char line[512];
            while (fgets(line, sizeof line, f)) {
                line[strcspn(line, "\n")] = 0;
                if (!strncmp(line, "requests=", 9)) snprintf(w->req, sizeof w->req, "%s", line + 9);
                if (!strncmp(line, "events=", 7)) snprintf(w->ev, sizeof w->ev, "%s", line + 7);
                if (!strncmp(line, "admin=", 6)) {
                    const char *c = strrchr(line, ':');
                    w->admin_port = c ? atoi(c + 1) : 0;
                }
            }
            fclose(f);
            return;
        }
        int st;
        if (waitpid(w->pid, &st, WNOHANG) == w->pid)
            cr_assert_fail("worker %s exited at start", id);
        usleep(50000);
    }
    cr_assert_fail("worker %s did not start in 60 s", id);
}

static void start_worker(wproc *w, const char *id, const char *controller)
{
    start_worker_on(w, id, controller, NULL, "127.0.0.1");
}

static void *sock_open(int type, const char *ep, bool bind)
{
    void *s = NULL;
    km_errbuf err = {{0}};
    if (!g_ctx) g_ctx = km_zctx_create();
    cr_assert_eq(km_zsock_open(g_ctx, type, NULL, &s, &err), 0, "%s", err.msg);
    if (bind)
        cr_assert_eq(km_zsock_bind(s, ep, &err), 0, "%s", err.msg);
    else
        cr_assert_eq(km_zsock_connect(s, ep, &err), 0, "%s", err.msg);
    return s;
}

/* Reads heartbeats on ctl until worker id has sent one with a transfer address (30 s). */
static uint32_t peer_addr_of(void *ctl, const char *id, uint8_t *addr, size_t cap)
{
    uint64_t t0 = km_now_ns();
    while (km_now_ns() - t0 < 30000000000ull) {
        km_zmsg z = {0};
        if (km_zrecv(ctl, &z, 200, NULL)) {
            km_zmsg_clear(&z);
            continue;
        }
        const km_zframe *b = km_zmsg_body(&z);
        km_msg m;
        uint32_t n = 0;
        if (b && !km_msg_decode(b->data, b->len, NULL, &m, NULL)) {
            if (m.type == KM_MSG_HEARTBEAT && !strcmp(m.hb.worker, id) && m.hb.peer_addr &&
                m.hb.peer_addr_len <= cap) {
                n = m.hb.peer_addr_len;
                memcpy(addr, m.hb.peer_addr, n);
            }
            km_msg_clear(&m);
        }
        km_zmsg_clear(&z);
        if (n) return n;
    }
    cr_assert_fail("no heartbeat with a peer address from %s in 30 s", id);
    return 0;
}

typedef struct hint {
    const char *from, *endpoint;
    const uint8_t *addr;
    uint32_t addr_len, pages, ms;
} hint;

typedef struct result {
    int32_t tok[64];
    int n;
    bool done;
    int err_code;
    km_finish finish;
    uint32_t cached;
    double total_ms;
} result;

/* One greedy request on a fresh DEALER to ep; waits for its end (timeout_ms). */
/* Sends one greedy request on a fresh DEALER to ep; returns the socket its answers come on. */
static void *submit(const char *ep, uint64_t id, const int32_t *prompt, int n, int max_tokens,
                    const hint *h)
{
    void *s = sock_open(KM_ZDEALER, ep, false);
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    m.req.id = id;
    m.req.model = "SmolLM2-135M-Instruct";
    m.req.tokens = prompt;
    m.req.n_tokens = (uint32_t)n;
    m.req.temperature = 0;
    m.req.max_tokens = (uint32_t)max_tokens;
    m.req.stream = true;
    m.req.deadline_ms = 120000;
    if (h) {
        m.req.pull_from = h->from;
        m.req.pull_endpoint = h->endpoint;
        m.req.pull_addr = h->addr;
        m.req.pull_addr_len = h->addr_len;
        m.req.pull_pages = h->pages;
        m.req.pull_ms = h->ms;
    }
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(&m, NULL, &b, &err), 0, "%s", err.msg);
    km_zframe f = {b.data, b.len};
    cr_assert_eq(km_zsend(s, &f, 1, 0, NULL), 0);
    km_buf_free(&b);
    return s;
}

/* The answers to request id on s until its end (timeout_ms); closes s. */
static result collect(void *s, uint64_t id, int timeout_ms)
{
    km_errbuf err = {{0}};
    result r = {0};
    uint64_t t0 = km_now_ns();
    while (!r.done && !r.err_code && (km_now_ns() - t0) / 1000000 < (uint64_t)timeout_ms) {
        km_zmsg z = {0};
        if (km_zrecv(s, &z, 200, NULL)) {
            km_zmsg_clear(&z);
            continue;
        }
        const km_zframe *body = km_zmsg_body(&z);
        km_msg a;
        cr_assert_eq(km_msg_decode(body->data, body->len, NULL, &a, &err), 0, "%s", err.msg);
        km_zmsg_clear(&z);
        if (a.type == KM_MSG_TOKEN && r.n < 64) {
            r.tok[r.n++] = a.tok.token;
        } else if (a.type == KM_MSG_DONE) {
            r.done = true;
            r.finish = a.done.finish;
            r.cached = a.done.cached_tokens;
            r.total_ms = a.done.total_ms;
        } else if (a.type == KM_MSG_ERROR) {
            r.err_code = a.error.code;
            cr_log_error("request %llu failed: %d %s", (unsigned long long)id, a.error.code,
                         a.error.message);
        }
        km_msg_clear(&a);
    }
    km_zsock_close(s);
    cr_assert(r.done, "request %llu did not end with done within %d ms (err %d)",
              (unsigned long long)id, timeout_ms, r.err_code);
    return r;
}

static result run(const char *ep, uint64_t id, const int32_t *prompt, int n, int max_tokens,
                  const hint *h, int timeout_ms)
{
    return collect(submit(ep, id, prompt, n, max_tokens, h), id, timeout_ms);
}

/* A counter from the admin port's /metrics (-1 when absent). */
static double metric(int port, const char *series)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    const char *q = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    cr_assert_eq(write(fd, q, strlen(q)), (ssize_t)strlen(q));
    static char buf[1 << 18];
    size_t len = 0;
    ssize_t k;
    while (len < sizeof buf - 1 && (k = read(fd, buf + len, sizeof buf - 1 - len)) > 0)
        len += (size_t)k;
    buf[len] = 0;
    close(fd);
    const char *p = buf;
    size_t sl = strlen(series);
    while ((p = strstr(p, series))) {
        if ((p == buf || p[-1] == '\n') && p[sl] == ' ') return atof(p + sl + 1);
        p += sl;
    }
    return -1;
}

static void make_prompt(int32_t *p, int n, uint64_t seed)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = 200 + (int32_t)((seed >> 33) % 40000);
    }
}

static void expect_same(const result *a, const result *b, const char *what)
{
    cr_assert_eq(a->n, b->n, "%s: %d tokens, reference %d", what, b->n, a->n);
    for (int i = 0; i < a->n; i++)
        cr_assert_eq(a->tok[i], b->tok[i], "%s: token %d is %d, reference %d", what, i, b->tok[i],
                     a->tok[i]);
}

enum { NP = 200, GEN = 12, PAGES = NP / 16 };

Test(worker_pull, a_prefix_pulled_from_a_peer_is_served_and_equals_computing_it)
{
    if (!have_model()) return;
    void *ctl = sock_open(KM_ZROUTER, "tcp://127.0.0.1:*", true);
    char ctl_ep[256];
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_last_endpoint(ctl, ctl_ep, sizeof ctl_ep, &err), 0, "%s", err.msg);
    wproc a, b;
    start_worker(&a, "wa", ctl_ep);
    start_worker(&b, "wb", ctl_ep);
    static uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t addr_len = peer_addr_of(ctl, "wa", addr, sizeof addr);

    int32_t prompt[NP];
    make_prompt(prompt, NP, 42);
    result ref = run(a.req, 1, prompt, NP, GEN, NULL, 120000);
    cr_assert_gt(ref.n, 0);
    cr_assert_eq(ref.cached, 0, "A computed the prompt");

    double in0 = metric(b.admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}");
    hint h = {"wa", a.req, addr, addr_len, PAGES, 20000};
    result got = run(b.req, 2, prompt, NP, GEN, &h, 120000);
    cr_assert_geq(got.cached, 16 * (PAGES - 1),
                  "B served %u prompt tokens from cached KV: the pages were not pulled",
                  got.cached);
    expect_same(&ref, &got, "pulled prefix");
    double in1 = metric(b.admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}");
    cr_assert_gt(in1, in0, "B counts the pulled bytes (%g -> %g)", in0, in1);
    cr_assert_gt(metric(b.admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}"), 0);
    cr_assert_gt(metric(a.admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"out\"}"), 0);

    /* a hint for pages B already holds costs nothing: no second pull */
    result again = run(b.req, 3, prompt, NP, GEN, &h, 120000);
    expect_same(&ref, &again, "held prefix");
    cr_assert_eq(metric(b.admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}"), 1);
    kill_all();
    km_zsock_close(ctl);
}

Test(worker_pull, a_stopped_or_killed_holder_costs_the_budget_and_the_request_recomputes)
{
    if (!have_model()) return;
    void *ctl = sock_open(KM_ZROUTER, "tcp://127.0.0.1:*", true);
    char ctl_ep[256];
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_last_endpoint(ctl, ctl_ep, sizeof ctl_ep, &err), 0, "%s", err.msg);
    wproc a, b;
    start_worker(&a, "wa", ctl_ep);
    start_worker(&b, "wb", ctl_ep);
    static uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t addr_len = peer_addr_of(ctl, "wa", addr, sizeof addr);
    int32_t p1[NP], p2[NP];
    make_prompt(p1, NP, 7);
    make_prompt(p2, NP, 8);
    result r1 = run(a.req, 1, p1, NP, GEN, NULL, 120000);
    result r2 = run(a.req, 2, p2, NP, GEN, NULL, 120000);

    /* stopped: nothing answers; the pull ends at its 1.5 s budget and B computes */
    cr_assert_eq(kill(a.pid, SIGSTOP), 0);
    hint h = {"wa", a.req, addr, addr_len, PAGES, 1500};
    result g1 = run(b.req, 3, p1, NP, GEN, &h, 120000);
    cr_assert_eq(g1.cached, 0, "nothing could be pulled from a stopped holder");
    cr_assert_neq(g1.finish, KM_FINISH_DEADLINE);
    expect_same(&r1, &g1, "recomputed after a stopped holder");
    double failed = metric(b.admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}");
    cr_assert_geq(failed, 1);
    cr_assert_geq(metric(b.admin_port, "kvmesh_kv_transfer_failures_total{reason=\"no_offer\"}"), 1,
                  "the holder never answered");

    /* killed: the connection is gone; the pull fails (at the latest at its budget) */
    cr_assert_eq(kill(a.pid, SIGKILL), 0);
    int st;
    waitpid(a.pid, &st, 0);
    result g2 = run(b.req, 4, p2, NP, GEN, &h, 120000);
    cr_assert_eq(g2.cached, 0);
    expect_same(&r2, &g2, "recomputed after a killed holder");
    cr_assert_geq(metric(b.admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}"),
                  failed + 1);
    kill_all();
    km_zsock_close(ctl);
}

/* Across network namespaces (issue 14, "across hosts"): the holder runs in its own namespace,
 * joined to the puller's by a veth pair, both advertising their veth address, UCX on TCP: the
 * page bytes cross the veth. Then the link goes down (a partition: the pull costs its budget and
 * the request recomputes), comes back, and a holder killed while a pull may be running costs at
 * most the budget too. */
Test(worker_pull, pages_cross_network_namespaces_and_partitions_or_kills_only_cost_the_budget)
{
    if (!have_model()) return;
    if (!netns_setup(&g_ns)) return;
    char ctl_url[96];
    snprintf(ctl_url, sizeof ctl_url, "tcp://%s:*", g_ns.hip);
    void *ctl = sock_open(KM_ZROUTER, ctl_url, true);
    char ctl_ep[256];
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_last_endpoint(ctl, ctl_ep, sizeof ctl_ep, &err), 0, "%s", err.msg);
    wproc a, b;
    start_worker_on(&a, "wa", ctl_ep, g_ns.ns, g_ns.nip);
    start_worker_on(&b, "wb", ctl_ep, NULL, g_ns.hip);
    static uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t addr_len = peer_addr_of(ctl, "wa", addr, sizeof addr);
    int32_t p1[NP], p2[NP], p3[NP];
    make_prompt(p1, NP, 21);
    make_prompt(p2, NP, 22);
    make_prompt(p3, NP, 23);
    result r1 = run(a.req, 1, p1, NP, GEN, NULL, 120000);
    result r2 = run(a.req, 2, p2, NP, GEN, NULL, 120000);
    result r3 = run(a.req, 3, p3, NP, GEN, NULL, 120000);

    hint h = {"wa", a.req, addr, addr_len, PAGES, 20000};
    result g1 = run(b.req, 4, p1, NP, GEN, &h, 120000);
    cr_assert_geq(g1.cached, 16 * (PAGES - 1), "B pulled across the namespaces (cached %u)",
                  g1.cached);
    expect_same(&r1, &g1, "pulled across namespaces");
    cr_assert_gt(metric(b.admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}"), 0);

    /* partition: nothing crosses the veth; the pull ends at its budget, B computes */
    cr_assert_eq(sh("ip link set %s down", g_ns.vh), 0);
    h.ms = 1500;
    result g2 = run(b.req, 5, p2, NP, GEN, &h, 120000);
    cr_assert_eq(g2.cached, 0);
    expect_same(&r2, &g2, "recomputed during a partition");
    cr_assert_eq(sh("ip link set %s up", g_ns.vh), 0);

    /* the holder killed just after the puller got the request: wherever the pull was, the
     * request completes with the same tokens */
    void *s = submit(b.req, 6, p3, NP, GEN, &h);
    usleep(20000);
    cr_assert_eq(kill(a.pid, SIGKILL), 0);
    result g3 = collect(s, 6, 120000);
    expect_same(&r3, &g3, "holder killed during the pull");
    kill_all();
    km_zsock_close(ctl);
}

/* ---------------------------------------------------------------- through a router */

/* The view a controller would publish for wa (holder) and wb (puller), with wb's measured
 * figures making a pull of 12 pages far cheaper than computing them. */
static void publish_view(void *pub, uint64_t seq, const wproc *a, const wproc *b,
                         const uint8_t *addr_a, uint32_t la, const uint8_t *addr_b, uint32_t lb)
{
    km_view_worker vw[2] = {{.id = "wa",
                             .state = KM_MEMBER_READY,
                             .requests = a->req,
                             .events = a->ev,
                             .peer_addr = addr_a,
                             .peer_addr_len = la,
                             .prefill_tps = 100,
                             .page_bytes = 368640},
                            {.id = "wb",
                             .state = KM_MEMBER_READY,
                             .requests = b->req,
                             .events = b->ev,
                             .peer_addr = addr_b,
                             .peer_addr_len = lb,
                             .prefill_tps = 100,   /* 16 prompt pages: 2.6 s to compute */
                             .xfer_rate_bps = 1e9, /* and 6 ms to pull */
                             .xfer_lat_ms = 1,
                             .page_bytes = 368640}};
    km_msg m;
    km_msg_init(&m, KM_MSG_VIEW);
    m.view.controller = "test-ctl";
    m.view.epoch = 1700000000000ull;
    m.view.seq = seq;
    m.view.workers = vw;
    m.view.n_workers = 2;
    km_buf buf = {0};
    cr_assert_eq(km_msg_encode(&m, NULL, &buf, NULL), 0);
    km_zframe parts[2] = {{"view", 4}, {buf.data, buf.len}};
    km_zsend(pub, parts, 2, KM_ZDONTWAIT, NULL);
    km_buf_free(&buf);
}

/* The router (kvmesh-router, the test standing in for the controller's view with measured
 * figures) sends a request to wb while wa holds its prefix: wb is told to pull, pulls, and the
 * tokens are those wa computed. Which worker the router picks is its rendezvous hash's choice
 * (--w-prefill=0 makes the prefix weigh nothing in the pick), so the test tries prompts until
 * one lands on wb, and checks every one that lands on wa is served from wa's cache. The pulled
 * pages reach the router's index through wb's own KV events, as computed ones do. */
Test(worker_pull, the_router_tells_the_chosen_worker_to_pull_a_prefix_another_holds)
{
    if (!have_model() || access("build/bin/kvmesh-router", X_OK)) return;
    void *ctl = sock_open(KM_ZROUTER, "tcp://127.0.0.1:*", true);
    void *pub = sock_open(KM_ZPUB, "tcp://127.0.0.1:*", true);
    char ctl_ep[256], pub_ep[256];
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_last_endpoint(ctl, ctl_ep, sizeof ctl_ep, &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_last_endpoint(pub, pub_ep, sizeof pub_ep, &err), 0, "%s", err.msg);
    wproc a, b, r;
    start_worker(&a, "wa", ctl_ep);
    start_worker(&b, "wb", ctl_ep);
    static uint8_t addr_a[KM_PROTO_MAX_PEER_ADDR], addr_b[KM_PROTO_MAX_PEER_ADDR];
    uint32_t la = peer_addr_of(ctl, "wa", addr_a, sizeof addr_a);
    uint32_t lb = peer_addr_of(ctl, "wb", addr_b, sizeof addr_b);

    /* the router, its workers given, its view from us */
    memset(&r, 0, sizeof r);
    snprintf(r.dir, sizeof r.dir, "/tmp/kvmesh-pull-XXXXXX");
    cr_assert(mkdtemp(r.dir));
    char ports[128], log[128], workers[4200], ctl_flag[300];
    snprintf(ports, sizeof ports, "%s/ports", r.dir);
    snprintf(log, sizeof log, "%s/router.log", r.dir);
    snprintf(workers, sizeof workers, "--workers=wa=%s+%s,wb=%s+%s", a.req, a.ev, b.req, b.ev);
    snprintf(ctl_flag, sizeof ctl_flag, "--controller=%s", pub_ep);
    const char *argv[] = {"build/bin/kvmesh-router",
                          "--front=tcp://127.0.0.1:*",
                          "--http-port=0",
                          "--log-level=debug",
                          workers,
                          ctl_flag,
                          "--view-timeout=120s",
                          "--w-prefill=0",
                          "--insecure",
                          "--ports-file",
                          ports,
                          NULL};
    r.pid = fork();
    cr_assert(r.pid >= 0);
    if (r.pid > 0 && g_npids < 4) g_pids[g_npids++] = r.pid;
    if (r.pid == 0) {
        FILE *f = freopen(log, "w", stderr);
        (void)f;
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    char front[512] = "";
    int http = 0;
    for (int i = 0; i < 1200 && !front[0]; i++) {
        FILE *f = fopen(ports, "r");
        if (f) {
            char line[512];
            while (fgets(line, sizeof line, f)) {
                line[strcspn(line, "\n")] = 0;
                if (!strncmp(line, "front=", 6)) snprintf(front, sizeof front, "%s", line + 6);
                if (!strncmp(line, "http=", 5)) http = atoi(line + 5);
            }
            fclose(f);
        }
        if (!front[0]) usleep(50000);
    }
    cr_assert(front[0], "the router did not start");
    /* views until the router has surely subscribed and applied one */
    uint64_t seq = 0;
    for (int i = 0; i < 20; i++) {
        publish_view(pub, ++seq, &a, &b, addr_a, la, addr_b, lb);
        usleep(100000);
    }
    bool pulled = false;
    for (int k = 0; k < 8 && !pulled; k++) {
        int32_t p[NP];
        make_prompt(p, NP, 100 + (uint64_t)k);
        result ref = run(a.req, 10 + (uint64_t)k, p, NP, GEN, NULL, 120000);
        /* wa's stored events reach the router's index; the view stays fresh meanwhile */
        for (int i = 0; i < 20; i++) {
            publish_view(pub, ++seq, &a, &b, addr_a, la, addr_b, lb);
            usleep(100000);
        }
        void *s = submit(front, 100 + (uint64_t)k, p, NP, GEN, NULL);
        result got = collect(s, 100 + (uint64_t)k, 120000);
        expect_same(&ref, &got, "through the router");
        cr_assert_geq(got.cached, 16 * (PAGES - 1), "prompt %d: cached %u (router index: %g pages)",
                      k, got.cached, metric(http, "kvmesh_router_index_pages"));
        pulled = metric(b.admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}") > 0;
    }
    cr_assert(pulled, "in 8 prompts the router never chose wb while wa held the prefix");
    cr_assert_geq(metric(http, "kvmesh_router_pulls_total{decision=\"pull\"}"), 1);
    /* the pulled pages are wb's now, and its KV events say so to every router */
    double wb_pages = 0;
    for (int i = 0; i < 50 && wb_pages < PAGES; i++) {
        wb_pages = metric(http, "kvmesh_router_worker_kv_pages{worker=\"wb\",tier=\"hot\"}");
        if (wb_pages < PAGES) usleep(100000);
    }
    cr_assert_geq(wb_pages, PAGES, "the router's index has %g of wb's pages", wb_pages);
    kill_all();
    km_zsock_close(pub);
    km_zsock_close(ctl);
}
