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
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/svc.h"
#include "tests/integration/harness.h"

/* The holder's network namespace in the tests across namespaces (harness.h, it_net). */
static it_host g_ns;

/* False (and the test skipped) where `ip netns` is not permitted. */
static bool netns_setup(void)
{
    if (!it_net_create((const char *const[]){"wa", NULL}, &g_ns)) return false;
    /* A host has other interfaces (a second NIC, a container bridge): UCX must not open a lane
     * from one the peer has no route back to (it timed the whole endpoint out). */
    it_net_decoy(NULL);
    return true;
}

static void suite_init(void)
{
    setenv("UCX_TLS", "tcp", 1); /* the workers' transfers: TCP, as between hosts */
}

TestSuite(worker_pull, .init = suite_init, .fini = it_kill_all, .timeout = 300);

static bool have_model(void)
{
    return it_have((const char *const[]){IT_MODEL, IT_WORKER, IT_ROUTER, NULL});
}

/* A worker on host (its requests endpoint, transfer node and advertised address), inside network
 * namespace ns when ns is not NULL. */
static void start_worker_on(it_proc *w, const char *id, const char *controller, const char *ns,
                            const char *host, const char *const *extra)
{
    memset(w, 0, sizeof *w);
    it_proc_dir(w, "pull");
    if (ns) snprintf(w->ns, sizeof w->ns, "%s", ns);
    char ports[128], listen[96], peer[96];
    snprintf(ports, sizeof ports, "%s/ports", w->dir);
    snprintf(listen, sizeof listen, "tcp://%s:*", host);
    snprintf(peer, sizeof peer, "%s:0", host);
    const char *argv[] = {
        IT_WORKER, "--listen",      listen, "--events",         listen,     "--admin-port",
        "0",       "--ports-file",  ports,  "--threads",        "1",        "--log-level",
        "info",    "--worker-id",   id,     "--controller",     controller, "--heartbeat",
        "100",     "--peer-listen", peer,   "--peer-advertise", host,       NULL};
    it_spawn(w, argv, extra, "worker.log");
}

/* A ZeroMQ socket of type bound to url; its endpoint (the port chosen) into ep. */
static void *bound(int type, const char *url, char *ep, size_t cap)
{
    void *s = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_open(it_zctx(), type, NULL, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_bind(s, url, &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_last_endpoint(s, ep, cap, &err), 0, "%s", err.msg);
    return s;
}

/* The next heartbeat from worker id on ctl (into m; the caller clears it), waiting until
 * deadline (km_now_ns); false at the deadline. */
static bool next_hb(void *ctl, const char *id, uint64_t deadline, km_msg *m)
{
    while (km_now_ns() < deadline) {
        km_zmsg z = {0};
        bool got = false;
        if (!km_zrecv(ctl, &z, 200, NULL)) {
            const km_zframe *b = km_zmsg_body(&z);
            if (b && !km_msg_decode(b->data, b->len, NULL, m, NULL)) {
                got = m->type == KM_MSG_HEARTBEAT && !strcmp(m->hb.worker, id);
                if (!got) km_msg_clear(m);
            }
        }
        km_zmsg_clear(&z);
        if (got) return true;
    }
    return false;
}

/* Reads heartbeats on ctl until worker id has sent one with a transfer address (30 s). */
static char g_fp[129]; /* the workers' model fingerprint, from their heartbeats */

static uint32_t peer_addr_of(void *ctl, const char *id, uint8_t *addr, size_t cap)
{
    uint64_t until = km_now_ns() + 30000000000ull;
    km_msg m;
    while (next_hb(ctl, id, until, &m)) {
        uint32_t n = 0;
        if (m.hb.peer_addr && m.hb.peer_addr_len <= cap) {
            n = m.hb.peer_addr_len;
            memcpy(addr, m.hb.peer_addr, n);
            if (m.hb.fingerprint) snprintf(g_fp, sizeof g_fp, "%s", m.hb.fingerprint);
        }
        km_msg_clear(&m);
        if (n) return n;
    }
    cr_assert_fail("no heartbeat with a peer address from %s in 30 s", id);
    return 0;
}

/* The rate worker id reports in its heartbeats (hb.xfer.pairs) for its pulls from holder, read
 * on ctl for up to 10 s; 0 when no heartbeat names that pair. */
static double pair_rate_of(void *ctl, const char *id, const char *holder)
{
    double rate = 0;
    uint64_t until = km_now_ns() + 10000000000ull;
    km_msg m;
    while (!rate && next_hb(ctl, id, until, &m)) {
        for (uint32_t i = 0; m.hb.has_xfer && i < m.hb.xfer.n_pairs; i++)
            if (!strcmp(m.hb.xfer.pairs[i].from, holder)) rate = m.hb.xfer.pairs[i].rate_bps;
        km_msg_clear(&m);
    }
    return rate;
}

typedef struct hint {
    const char *from, *endpoint;
    const uint8_t *addr;
    uint32_t addr_len, pages, ms;
} hint;

typedef struct result {
    int32_t tok[256];
    int n;
    bool done;
    int err_code;
    km_finish finish;
    uint32_t cached;
    double total_ms;
} result;

/* A request of the default model for prompt (n ids), up to max_tokens answered. */
static void request_of(km_msg *m, uint64_t id, const int32_t *prompt, int n, int max_tokens)
{
    km_msg_init(m, KM_MSG_REQUEST);
    m->req.id = id;
    m->req.model = "SmolLM2-135M-Instruct";
    m->req.tokens = prompt;
    m->req.n_tokens = (uint32_t)n;
    m->req.max_tokens = (uint32_t)max_tokens;
}

/* Sends one greedy request on a fresh DEALER to ep; returns the socket its answers come on. */
static void *submit(const char *ep, uint64_t id, const int32_t *prompt, int n, int max_tokens,
                    const hint *h)
{
    void *s = it_dealer(ep);
    km_msg m;
    request_of(&m, id, prompt, n, max_tokens);
    m.req.temperature = 0;
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
    it_send_msg(s, &m);
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
        if (a.type == KM_MSG_TOKEN && r.n < 256) {
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

/* Two workers, wa (the holder) and wb, sending heartbeats to a ROUTER the test binds (it plays
 * the controller), and wa's transfer address from its heartbeats. With ns, wa runs inside the
 * namespace and both advertise their address on the namespaces' network (it_net). */
typedef struct pair {
    void *ctl;
    char ctl_ep[256];
    it_proc a, b;
    uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t addr_len;
} pair;

static pair g_pair; /* 4 KiB of address: not on the stack */

static pair *pair_start(const it_host *ns, const char *const *extra)
{
    pair *p = &g_pair;
    memset(p, 0, sizeof *p);
    char url[96];
    snprintf(url, sizeof url, "tcp://%s:*", ns ? it_net_self() : "127.0.0.1");
    p->ctl = bound(KM_ZROUTER, url, p->ctl_ep, sizeof p->ctl_ep);
    start_worker_on(&p->a, "wa", p->ctl_ep, ns ? ns->ns : NULL, ns ? ns->ip : "127.0.0.1", extra);
    start_worker_on(&p->b, "wb", p->ctl_ep, NULL, ns ? it_net_self() : "127.0.0.1", extra);
    p->addr_len = peer_addr_of(p->ctl, "wa", p->addr, sizeof p->addr);
    return p;
}

static void pair_stop(pair *p)
{
    it_kill_all();
    km_zsock_close(p->ctl);
}

/* The view a controller would publish for wa (holder) and wb (puller), with wb's measured
 * figures making a pull of 12 pages far cheaper than computing them; and wc like wb when c is
 * not NULL. */
static km_member_state g_a_state = KM_MEMBER_READY; /* wa's state in the views published */
static km_member_state g_c_state = KM_MEMBER_READY; /* wc's */
static double g_tps = 100; /* the workers' prefill rate in the views published (tokens/s) */

static void publish_view3(void *pub, uint64_t seq, const it_proc *a, const it_proc *b,
                          const it_proc *c, const uint8_t *addr_a, uint32_t la,
                          const uint8_t *addr_b, uint32_t lb, const uint8_t *addr_c, uint32_t lc)
{
    km_view_worker vw[3] = {{.id = "wa",
                             .state = g_a_state,
                             .requests = a->req,
                             .events = a->ev,
                             .peer_addr = addr_a,
                             .peer_addr_len = la,
                             .prefill_tps = g_tps,
                             .fingerprint = g_fp,
                             .page_bytes = 368640},
                            {.id = "wb",
                             .state = KM_MEMBER_READY,
                             .requests = b->req,
                             .events = b->ev,
                             .peer_addr = addr_b,
                             .peer_addr_len = lb,
                             .prefill_tps = g_tps, /* 16 prompt pages: 2.6 s to compute */
                             .xfer_rate_bps = 1e9, /* and 6 ms to pull */
                             .xfer_lat_ms = 1,
                             .fingerprint = g_fp,
                             .page_bytes = 368640}};
    if (c) {
        vw[2] = vw[1];
        vw[2].id = "wc";
        vw[2].state = g_c_state;
        vw[2].requests = c->req;
        vw[2].events = c->ev;
        vw[2].peer_addr = addr_c;
        vw[2].peer_addr_len = lc;
    }
    km_msg m;
    km_msg_init(&m, KM_MSG_VIEW);
    m.view.controller = "test-ctl";
    m.view.epoch = 1700000000000ull;
    m.view.seq = seq;
    m.view.workers = vw;
    m.view.n_workers = c ? 3 : 2;
    km_buf buf = {0};
    cr_assert_eq(km_msg_encode(&m, NULL, &buf, NULL), 0);
    km_zframe parts[2] = {{"view", 4}, {buf.data, buf.len}};
    km_zsend(pub, parts, 2, KM_ZDONTWAIT, NULL);
    km_buf_free(&buf);
}

static void publish_view(void *pub, uint64_t seq, const it_proc *a, const it_proc *b,
                         const uint8_t *addr_a, uint32_t la, const uint8_t *addr_b, uint32_t lb)
{
    publish_view3(pub, seq, a, b, NULL, addr_a, la, addr_b, lb, NULL, 0);
}

/* A pull hint names a holder the puller finds in the controller's view (--peer-view), never
 * an endpoint or address of its own: the test stands in for the controller with a PUB, which the
 * pair's workers get as their view (no warm-up: the pulls are the test's). */
typedef struct viewpub {
    void *pub;
    char ep[256];
    const char *flags[5];
    uint8_t addr_b[KM_PROTO_MAX_PEER_ADDR];
    uint32_t lb;
    uint64_t seq;
} viewpub;

static viewpub g_vp;

static const char *const *viewpub_open(void)
{
    viewpub *v = &g_vp;
    memset(v, 0, sizeof *v);
    v->pub = it_xpub("tcp://127.0.0.1:*", v->ep, sizeof v->ep);
    const char *f[] = {"--peer-view", v->ep, "--peer-warm-pages", "0", NULL};
    memcpy(v->flags, f, sizeof f);
    return v->flags;
}

/* Publishes the view naming wa and wb until `who` has it (its kvmesh_kv_peer_view_workers), 30 s
 * at most. */
static void viewpub_until_known(pair *w, const it_proc *who)
{
    viewpub *v = &g_vp;
    if (!v->lb) v->lb = peer_addr_of(w->ctl, "wb", v->addr_b, sizeof v->addr_b);
    uint64_t until = km_now_ns() + 30000000000ull;
    while (it_metric(who->admin_port, "kvmesh_kv_peer_view_workers") < 1) {
        cr_assert_lt(km_now_ns(), until, "the view never reached the worker");
        publish_view(v->pub, ++v->seq, &w->a, &w->b, w->addr, w->addr_len, v->addr_b, v->lb);
        km_zmsg z = {0};
        km_zrecv(w->ctl, &z, 100, NULL); /* the heartbeats meanwhile, and a pause between views */
        km_zmsg_clear(&z);
    }
    /* the subscriptions that came with it, so that it_wait_subscribed counts only later ones */
    uint8_t sub[256];
    while (zmq_recv(v->pub, sub, sizeof sub, ZMQ_DONTWAIT) >= 0) {
    }
}

/* Issue 31: a worker started with no transfer flag runs a transfer node on its --listen host
 * (port 0, the bound one in its heartbeats), advertising that host; --no-peer runs none. */
Test(worker_pull, a_worker_runs_a_transfer_node_by_default_and_none_with_no_peer)
{
    if (!have_model()) return;
    char ep[256];
    void *ctl = bound(KM_ZROUTER, "tcp://127.0.0.1:*", ep, sizeof ep);
    it_proc on, off;
    memset(&on, 0, sizeof on);
    memset(&off, 0, sizeof off);
    const char *const common[] = {
        "--admin-port=0", "--threads=1", "--heartbeat=100", "--controller", ep, NULL};
    const char *f_on[8], *f_off[8];
    int n = 0;
    for (; common[n]; n++) f_on[n] = f_off[n] = common[n];
    f_on[n] = "--worker-id=won";
    f_off[n] = "--worker-id=woff";
    f_off[n + 1] = "--no-peer";
    f_on[n + 1] = f_off[n + 2] = NULL;
    it_start_worker(&on, "default", f_on, NULL);
    it_start_worker(&off, "nopeer", f_off, NULL);

    uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    cr_assert_gt(peer_addr_of(ctl, "won", addr, sizeof addr), 0);
    cr_assert_geq(it_metric(on.admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}"), 0);
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "grep -q 'event=peer_ready.*listen=127.0.0.1:0 advertise=127.0.0.1 ' %s/worker.log",
             on.dir);
    cr_assert_eq(it_sh("%s", cmd), 0, "no peer_ready line on 127.0.0.1:0 in %s/worker.log", on.dir);

    km_msg m;
    for (int i = 0; i < 3; i++) { /* a few heartbeats, none with a transfer address */
        cr_assert(next_hb(ctl, "woff", km_now_ns() + 30000000000ull, &m), "no heartbeat");
        cr_assert(!m.hb.peer_addr_len, "--no-peer: the heartbeat carries a transfer address");
        km_msg_clear(&m);
    }
    cr_assert_eq(it_metric(off.admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}"), -1,
                 "--no-peer: transfer metrics are exported");
    it_kill_all();
    km_zsock_close(ctl);
}

Test(worker_pull, a_prefix_pulled_from_a_peer_is_served_and_equals_computing_it)
{
    if (!have_model()) return;
    pair *w = pair_start(NULL, viewpub_open());
    const it_proc *a = &w->a, *b = &w->b;
    viewpub_until_known(w, b);

    int32_t prompt[NP];
    make_prompt(prompt, NP, 42);
    result ref = run(a->req, 1, prompt, NP, GEN, NULL, 120000);
    cr_assert_gt(ref.n, 0);
    cr_assert_eq(ref.cached, 0, "A computed the prompt");

    double in0 = it_metric(b->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}");
    hint h = {"wa", a->req, w->addr, w->addr_len, PAGES, 20000};
    result got = run(b->req, 2, prompt, NP, GEN, &h, 120000);
    cr_assert_geq(got.cached, 16 * (PAGES - 1),
                  "B served %u prompt tokens from cached KV: the pages were not pulled",
                  got.cached);
    expect_same(&ref, &got, "pulled prefix");
    double in1 = it_metric(b->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}");
    cr_assert_gt(in1, in0, "B counts the pulled bytes (%g -> %g)", in0, in1);
    cr_assert_gt(it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}"), 0);
    cr_assert_gt(it_metric(a->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"out\"}"), 0);
    /* B's heartbeats now carry what it measured pulling from A (the routers price that pair by
     * it) */
    cr_assert_gt(pair_rate_of(w->ctl, "wb", "wa"), 0, "no hb.xfer.pairs entry for wa from wb");

    /* a hint for pages B already holds costs nothing: no second pull */
    result again = run(b->req, 3, prompt, NP, GEN, &h, 120000);
    expect_same(&ref, &again, "held prefix");
    cr_assert_eq(it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}"), 1);
    pair_stop(w);
}

Test(worker_pull, a_stopped_or_killed_holder_costs_the_budget_and_the_request_recomputes)
{
    if (!have_model()) return;
    pair *w = pair_start(NULL, viewpub_open());
    const it_proc *a = &w->a, *b = &w->b;
    viewpub_until_known(w, b);
    int32_t p1[NP], p2[NP];
    make_prompt(p1, NP, 7);
    make_prompt(p2, NP, 8);
    result r1 = run(a->req, 1, p1, NP, GEN, NULL, 120000);
    result r2 = run(a->req, 2, p2, NP, GEN, NULL, 120000);

    /* stopped: nothing answers; the pull ends at its 1.5 s budget and B computes */
    cr_assert_eq(kill(a->pid, SIGSTOP), 0);
    hint h = {"wa", a->req, w->addr, w->addr_len, PAGES, 1500};
    result g1 = run(b->req, 3, p1, NP, GEN, &h, 120000);
    cr_assert_eq(g1.cached, 0, "nothing could be pulled from a stopped holder");
    cr_assert_neq(g1.finish, KM_FINISH_DEADLINE);
    expect_same(&r1, &g1, "recomputed after a stopped holder");
    double failed = it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}");
    cr_assert_geq(failed, 1);
    cr_assert_geq(
        it_metric(b->admin_port, "kvmesh_kv_transfer_failures_total{reason=\"no_offer\"}"), 1,
        "the holder never answered");

    /* killed: the connection is gone; the pull fails (at the latest at its budget) */
    cr_assert_eq(kill(a->pid, SIGKILL), 0);
    it_wait_exit(&w->a, 5000);
    result g2 = run(b->req, 4, p2, NP, GEN, &h, 120000);
    cr_assert_eq(g2.cached, 0);
    expect_same(&r2, &g2, "recomputed after a killed holder");
    cr_assert_geq(it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}"),
                  failed + 1);
    pair_stop(w);
}

/* Across network namespaces (issue 14, "across hosts"): the holder runs in its own namespace,
 * joined to the puller's by a bridge (it_net), both advertising their address on it, UCX on TCP:
 * the page bytes cross the bridge. Then the link goes down (a partition: the pull costs its budget
 * and the request recomputes), comes back, and a holder killed while a pull may be running costs at
 * most the budget too. */
Test(worker_pull, pages_cross_network_namespaces_and_partitions_or_kills_only_cost_the_budget)
{
    if (!have_model()) return;
    if (!netns_setup()) return;
    pair *w = pair_start(&g_ns, viewpub_open());
    const it_proc *a = &w->a, *b = &w->b;
    viewpub_until_known(w, b);
    int32_t p1[NP], p2[NP], p3[NP];
    make_prompt(p1, NP, 21);
    make_prompt(p2, NP, 22);
    make_prompt(p3, NP, 23);
    result r1 = run(a->req, 1, p1, NP, GEN, NULL, 120000);
    result r2 = run(a->req, 2, p2, NP, GEN, NULL, 120000);
    result r3 = run(a->req, 3, p3, NP, GEN, NULL, 120000);

    hint h = {"wa", a->req, w->addr, w->addr_len, PAGES, 20000};
    result g1 = run(b->req, 4, p1, NP, GEN, &h, 120000);
    cr_assert_geq(g1.cached, 16 * (PAGES - 1), "B pulled across the namespaces (cached %u)",
                  g1.cached);
    expect_same(&r1, &g1, "pulled across namespaces");
    cr_assert_gt(it_metric(b->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}"), 0);

    /* partition: nothing crosses the bridge; the pull ends at its budget, B computes */
    it_net_self_link(false);
    h.ms = 1500;
    result g2 = run(b->req, 5, p2, NP, GEN, &h, 120000);
    cr_assert_eq(g2.cached, 0);
    expect_same(&r2, &g2, "recomputed during a partition");
    it_net_self_link(true);

    /* the holder killed just after the puller got the request: wherever the pull was, the
     * request completes with the same tokens */
    void *s = submit(b->req, 6, p3, NP, GEN, &h);
    usleep(20000); /* not a wait for anything: a moment inside the pull, whichever it is */
    cr_assert_eq(kill(a->pid, SIGKILL), 0);
    result g3 = collect(s, 6, 120000);
    expect_same(&r3, &g3, "holder killed during the pull");
    pair_stop(w);
}

/* ---------------------------------------------------------------- through a router */

/* The pages the router's index (from worker id's KV events) has at id, hot tier. */
static double router_pages(int http_port, const char *id)
{
    char series[128];
    snprintf(series, sizeof series, "kvmesh_router_worker_kv_pages{worker=\"%s\",tier=\"hot\"}",
             id);
    return it_metric(http_port, series);
}

/* A kvmesh-router for the pair's workers, its view from the test's PUB at pub_ep (the test
 * stands in for the controller), with one more flag (or NULL). */
static void start_router3(it_proc *r, const pair *w, const it_proc *c, const char *pub_ep,
                          const char *flag)
{
    it_proc_dir(r, "pull");
    char ports[128], workers[4200], ctl_flag[300];
    snprintf(ports, sizeof ports, "%s/ports", r->dir);
    int n = snprintf(workers, sizeof workers, "--workers=wa=%s+%s,wb=%s+%s", w->a.req, w->a.ev,
                     w->b.req, w->b.ev);
    if (c) snprintf(workers + n, sizeof workers - (size_t)n, ",wc=%s+%s", c->req, c->ev);
    snprintf(ctl_flag, sizeof ctl_flag, "--controller=%s", pub_ep);
    const char *argv[] = {IT_ROUTER,
                          "--front=tcp://127.0.0.1:*",
                          "--http-port=0",
                          "--log-level=debug",
                          workers,
                          ctl_flag,
                          "--view-timeout=120s",
                          "--ports-file",
                          ports,
                          flag,
                          NULL};
    it_spawn(r, argv, NULL, "router.log");
    cr_assert(r->front[0], "the router's ports file names no front endpoint");
}

static void start_router(it_proc *r, const pair *w, const char *pub_ep, const char *flag)
{
    start_router3(r, w, NULL, pub_ep, flag);
}

/* The router (kvmesh-router, the test standing in for the controller's view with measured
 * figures) sends a request to wb while wa holds its prefix: wb is told to pull, pulls, and the
 * tokens are those wa computed. Which worker the router picks is its rendezvous hash's choice
 * (--w-prefill=0 makes the prefix weigh nothing in the pick), so the test tries prompts until
 * one lands on wb, and checks every one that lands on wa is served from wa's cache. The pulled
 * pages reach the router's index through wb's own KV events, as computed ones do. */
Test(worker_pull, the_router_tells_the_chosen_worker_to_pull_a_prefix_another_holds)
{
    if (!have_model()) return;
    pair *w = pair_start(NULL, viewpub_open()); /* the workers' view is the router's */
    const it_proc *a = &w->a, *b = &w->b;
    viewpub_until_known(w, a);
    viewpub_until_known(w, b);
    void *pub = g_vp.pub;
    const char *pub_ep = g_vp.ep;
    const uint8_t *addr_a = w->addr;
    uint32_t la = w->addr_len;
    const uint8_t *addr_b = g_vp.addr_b;
    uint32_t lb = g_vp.lb;

    /* the router, its workers given, its view from us */
    it_proc r = {0};
    start_router(&r, w, pub_ep, "--w-prefill=0");
    const char *front = r.front;
    int http = r.http_port;
    /* a view, once the router has subscribed, and applied by it */
    it_wait_subscribed(pub, 1, 30000);
    uint64_t seq = g_vp.seq; /* on from the views the workers have */
    publish_view(pub, ++seq, a, b, addr_a, la, addr_b, lb);
    IT_WAIT(it_metric(http, "kvmesh_router_views_total") >= 1, 30000, "the router applied no view");
    bool pulled = false;
    for (int k = 0; k < 8 && !pulled; k++) {
        int32_t p[NP];
        make_prompt(p, NP, 100 + (uint64_t)k);
        const double held = router_pages(http, "wa");
        result ref = run(a->req, 10 + (uint64_t)k, p, NP, GEN, NULL, 120000);
        /* wa's stored events reach the router's index; the view stays fresh meanwhile */
        publish_view(pub, ++seq, a, b, addr_a, la, addr_b, lb);
        IT_WAIT(router_pages(http, "wa") >= held + PAGES, 30000,
                "prompt %d: the router's index has %g of wa's pages, want %g", k,
                router_pages(http, "wa"), held + PAGES);
        void *s = submit(front, 100 + (uint64_t)k, p, NP, GEN, NULL);
        result got = collect(s, 100 + (uint64_t)k, 120000);
        expect_same(&ref, &got, "through the router");
        cr_assert_geq(got.cached, 16 * (PAGES - 1), "prompt %d: cached %u (router index: %g pages)",
                      k, got.cached, it_metric(http, "kvmesh_router_index_pages"));
        pulled = it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}") > 0;
    }
    cr_assert(pulled, "in 8 prompts the router never chose wb while wa held the prefix");
    cr_assert_geq(it_metric(http, "kvmesh_router_pulls_total{decision=\"pull\"}"), 1);
    /* the pulled pages are wb's now, and its KV events say so to every router */
    double wb_pages = 0;
    for (int i = 0; i < 50 && wb_pages < PAGES; i++) {
        wb_pages = it_metric(http, "kvmesh_router_worker_kv_pages{worker=\"wb\",tier=\"hot\"}");
        if (wb_pages < PAGES) usleep(100000);
    }
    cr_assert_geq(wb_pages, PAGES, "the router's index has %g of wb's pages", wb_pages);
    km_zsock_close(pub);
    pair_stop(w);
}

/* A request with chunks (docs/blend.md) through the router's ZeroMQ front: its usage's
 * chunk_tokens (answers until done, 120 s). */
static uint32_t run_chunks(const char *ep, uint64_t id, const int32_t *prompt, int n,
                           const km_chunk_seg *seg, int n_seg)
{
    void *s = it_dealer(ep);
    km_msg m;
    request_of(&m, id, prompt, n, 1);
    m.req.chunks = seg;
    m.req.n_chunks = (uint32_t)n_seg;
    it_send_msg(s, &m);
    uint32_t got = 0;
    for (bool done = false; !done;) {
        km_msg a;
        cr_assert(it_recv_msg(s, &a, 120000), "request %llu: no answer", (unsigned long long)id);
        cr_assert_neq(a.type, KM_MSG_ERROR, "%s", a.type == KM_MSG_ERROR ? a.error.message : "");
        done = a.type == KM_MSG_DONE;
        if (done) got = a.done.chunk_tokens;
        km_msg_clear(&a);
    }
    km_zsock_close(s);
    return got;
}

/* A prompt of 200 ids: its own lead line (from seed) up to `at`, the document doc[64] there (a
 * chunk of 4 pages), then a last chunk of 40 ids and a question (the rest of the lead's ids);
 * seg gets the two chunks. */
static void chunk_prompt(int32_t *p, uint64_t seed, const int32_t *doc, uint32_t at,
                         km_chunk_seg seg[2])
{
    make_prompt(p, 200, seed);
    memcpy(p + at, doc, sizeof *doc * 64);
    seg[0] = (km_chunk_seg){at, 64};
    seg[1] = (km_chunk_seg){at + 64, 40};
}

/* Issue 33, item 4: with the mesh on, pulls move chunks too. wa computes a document (a chunk)
 * and caches it; then wa drains (the test's view says so: it takes no request but still serves
 * its pages), and a prompt with the document at another position goes to wb, which the router
 * tells to pull the chunk's pages from wa (pull_chunks: priced by the measured rule, the saving
 * discounted by --chunk-credit). wb reuses them as its own: chunk_tokens > 0, its chunk pull
 * counters grow, and both count the chunk's pages as position-free (kvshard's flag). */
Test(worker_pull, the_router_tells_the_chosen_worker_to_pull_a_chunk_another_holds)
{
    if (!have_model()) return;
    pair *w = pair_start(NULL, viewpub_open());
    const it_proc *a = &w->a, *b = &w->b;
    viewpub_until_known(w, a);
    viewpub_until_known(w, b);
    void *pub = g_vp.pub;
    it_proc r = {0};
    start_router(&r, w, g_vp.ep, "--chunk-credit=0.5");
    it_wait_subscribed(pub, 1, 30000);
    uint64_t seq = g_vp.seq;
    g_a_state = KM_MEMBER_READY;
    /* the pull's budget is the computation it saves: a slow prefill rate in the view gives it
     * room for a first connection on a loaded machine or under a sanitizer */
    g_tps = 10;
    publish_view(pub, ++seq, a, b, w->addr, w->addr_len, g_vp.addr_b, g_vp.lb);
    IT_WAIT(it_metric(r.http_port, "kvmesh_router_views_total") >= 1, 30000,
            "the router applied no view");

    int32_t doc[64], p[200];
    make_prompt(doc, 64, 777);
    km_chunk_seg seg[2];
    /* wa computes the document, then caches it alone (between requests): until a prompt with it
     * elsewhere reuses it there, sent to wa itself (nothing reaches wb) */
    chunk_prompt(p, 1, doc, 40, seg);
    run_chunks(a->req, 1, p, 200, seg, 2);
    uint32_t here = 0;
    uint64_t until = it_deadline(120000);
    for (uint64_t id = 2; !here && it_poll(until); id++) {
        chunk_prompt(p, id, doc, 56, seg);
        here = run_chunks(a->req, id, p, 200, seg, 2);
    }
    cr_assert_gt(here, 0, "wa never cached the document");
    /* kvshard flags the chunk's pages position-free: the preamble page and the 4 of the document */
    const char *chunk_hot = "kvmesh_worker_kv_chunk_pages{tier=\"hot\"}";
    IT_WAIT(it_metric(a->admin_port, chunk_hot) >= 5, 30000, "wa counts %g chunk pages",
            it_metric(a->admin_port, chunk_hot));
    /* the router's index has every page of wa's (its KV events), the chunk's among them */
    char hot[160];
    snprintf(hot, sizeof hot, "kvmesh_worker_kv_pages{tier=\"hot\",shard=\"0\",format=\"f16\"}");
    IT_WAIT(router_pages(r.http_port, "wa") >= it_metric(a->admin_port, hot), 30000,
            "the router's index has %g of wa's %g pages", router_pages(r.http_port, "wa"),
            it_metric(a->admin_port, hot));

    g_a_state = KM_MEMBER_DRAINING; /* wa takes no request, serves its pages */
    publish_view(pub, ++seq, a, b, w->addr, w->addr_len, g_vp.addr_b, g_vp.lb);
    IT_WAIT(it_metric(r.http_port, "kvmesh_router_views_total") >= 2, 30000,
            "the router applied no second view");
    chunk_prompt(p, 99, doc, 88, seg);
    uint32_t got = run_chunks(r.front, 100, p, 200, seg, 2);
    g_a_state = KM_MEMBER_READY;
    g_tps = 100;
    cr_assert_eq(it_metric(r.http_port, "kvmesh_router_chunk_pulls_total{decision=\"pull\"}"), 1,
                 "the router did not tell wb to pull the chunk");
    cr_assert_geq(it_metric(b->admin_port, "kvmesh_kv_transfer_chunk_pages_total"), 4,
                  "wb pulled no chunk page");
    cr_assert_gt(it_metric(b->admin_port, "kvmesh_kv_transfer_chunk_bytes_total"), 0);
    cr_assert_eq(got, 64, "wb reused %u of the document's 64 tokens", got);
    /* the pulled pages are flagged position-free on wb too (the import of a chunk pull) */
    IT_WAIT(it_metric(b->admin_port, chunk_hot) >= 5, 30000, "wb counts %g chunk pages",
            it_metric(b->admin_port, chunk_hot));
    km_zsock_close(pub);
    pair_stop(w);
}

/* Until worker w (its requests endpoint) reuses a document (a chunk) it has computed: the first
 * prompt carries it at 40, then prompts with it at 56 until one reuses it (120 s). */
static void cache_document(const char *ep, const int32_t *doc, uint64_t seed)
{
    int32_t p[200];
    km_chunk_seg seg[2];
    chunk_prompt(p, seed, doc, 40, seg);
    run_chunks(ep, seed, p, 200, seg, 2);
    uint32_t here = 0;
    uint64_t until = it_deadline(120000);
    for (uint64_t id = seed + 1; !here && it_poll(until); id++) {
        chunk_prompt(p, id, doc, 56, seg);
        here = run_chunks(ep, id, p, 200, seg, 2);
    }
    cr_assert_gt(here, 0, "the worker at %s never cached the document", ep);
}

/* Issue 33: chunk pulls from more than one holder. wa caches one document, wc another; both
 * drain (they take no request, serve their pages); a prompt carrying both documents elsewhere
 * goes to wb, which the router tells to pull one document from each (the hint's pull_from and
 * pull_more): wb reuses both, 64 tokens each, its chunk pages pulled through two links. */
Test(worker_pull, the_router_tells_the_chosen_worker_to_pull_chunks_from_two_holders)
{
    if (!have_model()) return;
    pair *w = pair_start(NULL, viewpub_open());
    const it_proc *a = &w->a, *b = &w->b;
    static it_proc c;
    start_worker_on(&c, "wc", w->ctl_ep, NULL, "127.0.0.1", g_vp.flags);
    static uint8_t addr_c[KM_PROTO_MAX_PEER_ADDR];
    const uint32_t lc = peer_addr_of(w->ctl, "wc", addr_c, sizeof addr_c);
    viewpub_until_known(w, a);
    viewpub_until_known(w, b);
    void *pub = g_vp.pub;
    uint64_t seq = g_vp.seq;
    g_a_state = g_c_state = KM_MEMBER_READY;
    g_tps = 10; /* room in the pull's budget for first connections on a loaded machine */
    uint64_t until = it_deadline(30000);
    const char *peers = "kvmesh_kv_peer_view_workers"; /* the others in its view */
    while (it_metric(c.admin_port, peers) < 2 || it_metric(b->admin_port, peers) < 2) {
        cr_assert(it_poll(until), "the view of three workers never reached wb and wc");
        publish_view3(pub, ++seq, a, b, &c, w->addr, w->addr_len, g_vp.addr_b, g_vp.lb, addr_c, lc);
        usleep(100000);
    }
    it_proc r = {0};
    start_router3(&r, w, &c, g_vp.ep, "--chunk-credit=0.5");
    it_wait_subscribed(pub, 1, 30000);
    publish_view3(pub, ++seq, a, b, &c, w->addr, w->addr_len, g_vp.addr_b, g_vp.lb, addr_c, lc);
    IT_WAIT(it_metric(r.http_port, "kvmesh_router_views_total") >= 1, 30000,
            "the router applied no view");

    int32_t doc[2][64], p[264];
    make_prompt(doc[0], 64, 777);
    make_prompt(doc[1], 64, 888);
    cache_document(a->req, doc[0], 1);
    cache_document(c.req, doc[1], 1001);
    const char *chunk_hot = "kvmesh_worker_kv_chunk_pages{tier=\"hot\"}";
    char hot[160];
    snprintf(hot, sizeof hot, "kvmesh_worker_kv_pages{tier=\"hot\",shard=\"0\",format=\"f16\"}");
    IT_WAIT(router_pages(r.http_port, "wa") >= it_metric(a->admin_port, hot) &&
                router_pages(r.http_port, "wc") >= it_metric(c.admin_port, hot),
            30000, "the router's index lacks pages of wa's or wc's");

    g_a_state = g_c_state = KM_MEMBER_DRAINING; /* they take no request, serve their pages */
    publish_view3(pub, ++seq, a, b, &c, w->addr, w->addr_len, g_vp.addr_b, g_vp.lb, addr_c, lc);
    IT_WAIT(it_metric(r.http_port, "kvmesh_router_views_total") >= 2, 30000,
            "the router applied no second view");
    /* a lead line, doc[1], doc[0], then a last chunk (computed in full) and the question */
    make_prompt(p, 264, 99);
    memcpy(p + 30, doc[1], sizeof doc[1]);
    memcpy(p + 100, doc[0], sizeof doc[0]);
    const km_chunk_seg seg[3] = {{30, 64}, {100, 64}, {170, 40}};
    const uint32_t got = run_chunks(r.front, 5000, p, 264, seg, 3);
    g_a_state = g_c_state = KM_MEMBER_READY;
    g_tps = 100;
    cr_assert_eq(it_metric(r.http_port, "kvmesh_router_chunk_pulls_total{decision=\"pull\"}"), 2,
                 "the router did not tell wb to pull both documents");
    cr_assert_geq(it_metric(b->admin_port, "kvmesh_kv_transfer_chunk_pages_total"), 8,
                  "wb pulled %g chunk pages of the 8 documents' pages",
                  it_metric(b->admin_port, "kvmesh_kv_transfer_chunk_pages_total"));
    cr_assert_eq(got, 128, "wb reused %u of the two documents' 128 tokens", got);
    IT_WAIT(it_metric(b->admin_port, chunk_hot) >= 9, 30000, "wb counts %g chunk pages",
            it_metric(b->admin_port, chunk_hot));
    km_zsock_close(pub);
    pair_stop(w);
}

/* Migration with KV (issue 14): a request streaming on a worker that drains (SIGTERM, a short
 * --drain-timeout) is handed back and migrated; the router tells the next worker to pull the
 * prompt's pages from the draining one, which lingers to serve them, so the request continues
 * without recomputing its prompt, and its greedy output is the undisturbed one. */
Test(worker_pull, a_request_migrated_off_a_draining_worker_pulls_its_prompt_from_it)
{
    if (!have_model()) return;
    const char *const *view = viewpub_open(); /* the workers' view is the router's */
    const char *const slow_drain[] = {"--drain-timeout", "300ms", "--speculate", "off", view[0],
                                      view[1],           view[2], view[3],       NULL};
    pair *w = pair_start(NULL, slow_drain);
    it_proc *a = &w->a, *b = &w->b;
    viewpub_until_known(w, b);
    viewpub_until_known(w, a);
    void *pub = g_vp.pub;
    const char *pub_ep = g_vp.ep;
    const uint8_t *addr_b = g_vp.addr_b;
    uint32_t lb = g_vp.lb;
    it_proc r = {0};
    start_router(&r, w, pub_ep, NULL);
    enum { LONG = 240 };
    int32_t p[NP];
    make_prompt(p, NP, 300);
    /* the reference, computed on wa, which then holds the prompt's pages: the router sends the
     * request there (its prefix credit), and its index learns them from wa's KV events */
    result ref = run(a->req, 1, p, NP, LONG, NULL, 120000);
    cr_assert_eq(ref.n, LONG, "the reference stream stopped early (%d tokens)", ref.n);
    it_wait_subscribed(pub, 1, 30000);
    uint64_t seq = g_vp.seq; /* on from the views the workers have */
    publish_view(pub, ++seq, a, b, w->addr, w->addr_len, addr_b, lb);
    IT_WAIT(it_metric(r.http_port, "kvmesh_router_views_total") >= 1 &&
                router_pages(r.http_port, "wa") >= PAGES,
            30000, "the router has no view, or %g of wa's pages", router_pages(r.http_port, "wa"));
    void *s = submit(r.front, 2, p, NP, LONG, NULL);
    /* the worker streaming it (the router's in-flight gauge), then SIGTERM: it drains */
    it_proc *from = NULL;
    for (int i = 0; i < 400 && !from; i++) {
        if (it_metric(r.http_port, "kvmesh_router_worker_inflight{worker=\"wa\"}") > 0) from = a;
        if (it_metric(r.http_port, "kvmesh_router_worker_inflight{worker=\"wb\"}") > 0) from = b;
        if (!from) usleep(5000);
    }
    cr_assert_not_null(from, "the request never showed in flight at a worker");
    /* and running there: sent is not yet taken, and a holder that drains with nothing in flight
     * exits at once, in the middle of the next worker's pull (docs/transfer.md, Known gaps) */
    IT_WAIT(it_metric(from->admin_port, "kvmesh_worker_running") >= 1, 30000,
            "the request never ran at the worker the router sent it to");
    const it_proc *to = from == a ? b : a;
    cr_assert_eq(kill(from->pid, SIGTERM), 0);
    /* the view goes on naming both (the test is the controller) */
    publish_view(pub, ++seq, a, b, w->addr, w->addr_len, addr_b, lb);
    result got = collect(s, 2, 120000);
    expect_same(&ref, &got, "migrated off a draining worker");
    double migrations = it_metric(r.http_port, "kvmesh_router_migrations_total");
    if (migrations < 1) { /* the stream ended inside the drain's grace: nothing to show */
        cr_log_warn("the request finished before its worker's drain handed it back");
        km_zsock_close(pub);
        pair_stop(w);
        return;
    }
    cr_assert_geq(it_metric(r.http_port, "kvmesh_router_pulls_total{decision=\"pull\"}"), 1,
                  "the router did not tell the next worker to pull from the draining one");
    cr_assert_geq(
        it_metric(to->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}") +
            it_metric(to->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"partial\"}"),
        1, "the next worker pulled nothing from the draining one");
    cr_assert_geq(got.cached, 16 * (PAGES - 1),
                  "the migrated request recomputed its prompt (cached %u)", got.cached);
    /* and the drained worker exits by itself once nothing is left to pull */
    int rc = it_wait_exit(from, 15000);
    cr_assert_neq(rc, -1, "the drained worker did not exit by itself");
    km_zsock_close(pub);
    pair_stop(w);
}

enum { K = 3 }; /* prompts a handoff or a warm-up moves */

/* K prompts (from seed) served on w: their pages are cached there; ref gets the tokens. */
static void serve_prompts(const it_proc *w, int32_t p[K][NP], result ref[K], uint64_t seed)
{
    for (int k = 0; k < K; k++) {
        make_prompt(p[k], NP, seed + (uint64_t)k);
        ref[k] = run(w->req, 1 + (uint64_t)k, p[k], NP, GEN, NULL, 120000);
    }
}

/* The K prompts are cache hits on w (their prompt pages), with the reference tokens. */
static void expect_hits(const it_proc *w, int32_t p[K][NP], const result ref[K], const char *what)
{
    for (int k = 0; k < K; k++) {
        result got = run(w->req, 10 + (uint64_t)k, p[k], NP, GEN, NULL, 120000);
        expect_same(&ref[k], &got, what);
        cr_assert_geq(got.cached, 16 * (PAGES - 1), "%s, prompt %d: cached %u", what, k,
                      got.cached);
    }
}

/* wa and wb with a view the test publishes on a PUB of its own (an XPUB with xpub, to wait for
 * their subscriptions; warm_pages: their --peer-warm-pages, NULL for the default). */
typedef struct warmset {
    void *pub;
    pair *w;
    uint8_t addr_b[KM_PROTO_MAX_PEER_ADDR];
    uint32_t lb;
    uint64_t seq;
} warmset;

static warmset g_ws;

static warmset *warm_start(const char *warm_pages, bool xpub)
{
    warmset *ws = &g_ws;
    memset(ws, 0, sizeof *ws);
    char pub_ep[256];
    ws->pub = xpub ? it_xpub("tcp://127.0.0.1:*", pub_ep, sizeof pub_ep)
                   : bound(KM_ZPUB, "tcp://127.0.0.1:*", pub_ep, sizeof pub_ep);
    const char *const view[] = {"--peer-view", pub_ep, warm_pages ? "--peer-warm-pages" : NULL,
                                warm_pages, NULL};
    ws->w = pair_start(NULL, view);
    ws->lb = peer_addr_of(ws->w->ctl, "wb", ws->addr_b, sizeof ws->addr_b);
    return ws;
}

/* wb's warm-up starts on the first view it sees: the view published every 100 ms until wb's
 * series is above floor (10 s at most); its value. */
static double warm_until(warmset *ws, const char *series, double floor)
{
    pair *w = ws->w;
    double v = 0;
    for (int i = 0; i < 100 && v <= floor; i++) {
        publish_view(ws->pub, ++ws->seq, &w->a, &w->b, w->addr, w->addr_len, ws->addr_b, ws->lb);
        usleep(100000);
        v = it_metric(w->b.admin_port, series);
    }
    return v;
}

/* Drains wa (SIGTERM) once the view reaches both (an XPUB's warm_start), and waits for it to
 * exit by itself. */
static void drain_wa(warmset *ws)
{
    pair *w = ws->w;
    it_wait_subscribed(ws->pub, 2, 30000); /* wa's and wb's --peer-view: one view reaches both */
    publish_view(ws->pub, ++ws->seq, &w->a, &w->b, w->addr, w->addr_len, ws->addr_b, ws->lb);
    cr_assert_eq(kill(w->a.pid, SIGTERM), 0);
    cr_assert_neq(it_wait_exit(&w->a, 30000), -1, "the drained worker did not exit by itself");
}

/* Drain handoff (issue 14): a worker drained with no request in flight pushes its cached chains
 * to the ready peer the controller's view names (--peer-view; the test publishes the view), the
 * peer pulls them in the background, the drained worker lingers while it does and then exits by
 * itself, and the prompts it had served are now cache hits on the peer, with the same tokens. */
Test(worker_pull, a_drained_worker_hands_its_cached_chains_to_a_peer)
{
    if (!have_model()) return;
    warmset *ws = warm_start("0", true); /* no warm-up: the pages reach wb by the handoff alone */
    pair *w = ws->w;
    it_proc *a = &w->a, *b = &w->b;
    void *pub = ws->pub;
    cr_assert(g_fp[0], "the heartbeats name no model fingerprint");
    int32_t p[K][NP];
    result ref[K];
    serve_prompts(a, p, ref, 500);
    drain_wa(ws);
    double taken = it_metric(b->admin_port, "kvmesh_kv_handoff_chains_total{outcome=\"taken\"}");
    cr_assert_geq(taken, K, "wb took %g chains of wa's %d", taken, K);
    cr_assert_geq(it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}"), K);
    expect_hits(b, p, ref, "served from pages handed over");
    km_zsock_close(pub);
    pair_stop(w);
}

/* The first line of w's worker.log naming what (into out); false when there is none. */
static bool log_line(const it_proc *w, const char *what, char *out, size_t cap)
{
    char path[sizeof w->dir + 16];
    snprintf(path, sizeof path, "%s/worker.log", w->dir);
    FILE *f = fopen(path, "r");
    bool found = false;
    char buf[1024];
    while (f && !found && fgets(buf, sizeof buf, f))
        if (strstr(buf, what)) {
            size_t n = strcspn(buf, "\n");
            if (n >= cap) n = cap - 1;
            memcpy(out, buf, n);
            out[n] = 0;
            found = true;
        }
    if (f) fclose(f);
    return found;
}

/* A peer the view still calls ready but that cannot pull (stopped here; one that died within
 * the controller's dead-after window is the same to the drain) gets its round-robin share of the
 * handoff and never pulls it: half a second into its linger the drained worker pushes those
 * chains again to the peer that did pull, so every prompt it had served is a hit there. */
Test(worker_pull, chains_a_silent_peer_never_pulled_are_handed_to_one_that_pulls)
{
    if (!have_model()) return;
    char pub_ep[256];
    void *pub = it_xpub("tcp://127.0.0.1:*", pub_ep, sizeof pub_ep);
    const char *const view[] = {"--peer-view", pub_ep, "--peer-warm-pages", "0", NULL};
    pair *w = pair_start(NULL, view);
    it_proc *a = &w->a, *b = &w->b;
    static it_proc c;
    start_worker_on(&c, "wc", w->ctl_ep, NULL, "127.0.0.1", view);
    static uint8_t addr_b[KM_PROTO_MAX_PEER_ADDR], addr_c[KM_PROTO_MAX_PEER_ADDR];
    uint32_t lb = peer_addr_of(w->ctl, "wb", addr_b, sizeof addr_b);
    uint32_t lc = peer_addr_of(w->ctl, "wc", addr_c, sizeof addr_c);
    int32_t p[K][NP];
    result ref[K];
    serve_prompts(a, p, ref, 700);
    it_wait_subscribed(pub, 3, 30000); /* wa's, wb's and wc's --peer-view */
    publish_view3(pub, 1, a, b, &c, w->addr, w->addr_len, addr_b, lb, addr_c, lc);
    cr_assert_eq(kill(c.pid, SIGSTOP), 0);
    cr_assert_eq(kill(a->pid, SIGTERM), 0);
    cr_assert_neq(it_wait_exit(a, 20000), -1, "the drained worker did not exit by itself");
    char line[256];
    cr_assert(log_line(a, "handoff_again", line, sizeof line), "wa did not push wc's chains again");
    double taken = it_metric(b->admin_port, "kvmesh_kv_handoff_chains_total{outcome=\"taken\"}");
    cr_assert_geq(taken, K, "wb took %g chains of wa's %d (%s)", taken, K, line);
    expect_hits(b, p, ref, "served from pages handed over twice");
    km_zsock_close(pub);
    pair_stop(w);
}

/* Warm-up on scale-out (issue 14): a worker that becomes ready next to a peer holding served
 * prompts asks it for its most recently used chains (kv_warm, --peer-warm-pages) and pulls them
 * in the background, so those prompts are hits on it before it has served anything. */
Test(worker_pull, a_new_worker_warms_up_from_a_peer)
{
    if (!have_model()) return;
    warmset *ws = warm_start(NULL, false);
    pair *w = ws->w;
    it_proc *a = &w->a, *b = &w->b;
    void *pub = ws->pub;
    int32_t p[K][NP];
    result ref[K];
    serve_prompts(a, p, ref, 700); /* on wa, before any view names a peer */
    double taken = warm_until(ws, "kvmesh_kv_handoff_chains_total{outcome=\"taken\"}", K - 1);
    cr_assert_geq(taken, K, "wb took %g of wa's %d chains", taken, K);
    for (int i = 0; i < 100; i++) { /* the pulls end */
        if (it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}") >= K) break;
        usleep(100000);
    }
    expect_hits(b, p, ref, "served from warm-up pages");
    /* a background pull has no request id: its log line names the pull (issue 39: id=0 only) */
    char line[512];
    cr_assert(log_line(b, "event=pull_done", line, sizeof line), "wb logged no pull_done");
    const char *pull = strstr(line, " pull=");
    cr_assert(pull && strtoull(pull + 6, NULL, 10) > 0, "%s", line);
    km_zsock_close(pub);
    pair_stop(w);
}

/* Ten prompts over one shared 100-page prefix (a system prompt), each with its own 2-page tail
 * (issue 39): what a handoff or a warm-up should move once, plus the tails. */
enum { NS = 10, SHARED = 100 * 16, TAIL = 40, NST = SHARED + TAIL, GEN_S = 4 };
enum { DISTINCT = SHARED / 16 + NS * (NST / 16 - SHARED / 16) }; /* pages of the ten chains */

static int32_t g_sp[NS][NST];
static result g_sref[NS];

static void serve_shared(const it_proc *w, uint64_t seed)
{
    for (int k = 0; k < NS; k++) {
        make_prompt(g_sp[k], SHARED, seed);
        make_prompt(g_sp[k] + SHARED, TAIL, seed + 1 + (uint64_t)k);
        g_sref[k] = run(w->req, 1 + (uint64_t)k, g_sp[k], NST, GEN_S, NULL, 120000);
    }
}

/* The payload bytes of one page, from w's heartbeats on ctl. */
static double page_bytes_of(void *ctl, const char *id)
{
    km_msg m;
    double pb = 0;
    uint64_t until = km_now_ns() + 10000000000ull;
    while (!pb && next_hb(ctl, id, until, &m)) {
        if (m.hb.has_xfer) pb = (double)m.hb.xfer.page_bytes;
        km_msg_clear(&m);
    }
    cr_assert_gt(pb, 0, "no heartbeat of %s gave its page size", id);
    return pb;
}

/* Waits (60 s at most) until w's background pulls have ended: no chain waiting or pulling, seen
 * as the pull outcomes and chain outcomes settling for a second. */
static void wait_pulls_settled(const it_proc *w)
{
    double last = -1;
    int still = 0;
    for (int i = 0; i < 600 && still < 10; i++) {
        double now =
            it_metric(w->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}") +
            it_metric(w->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}") +
            it_metric(w->admin_port, "kvmesh_kv_handoff_chains_total{outcome=\"present\"}");
        still = now == last && now > 0 ? still + 1 : 0;
        last = now;
        usleep(100000);
    }
}

/* Handoff of chains that share a prefix (issue 39): the receiver pulls the shared prefix once,
 * then only each chain's tail. Before, up to four chains were pulled at once, each moving the
 * whole prefix, and the later ones imported nothing (the prefix had arrived meanwhile) and were
 * counted failed while their log said status=ok. */
Test(worker_pull, a_handoff_moves_a_shared_prefix_once)
{
    if (!have_model()) return;
    warmset *ws = warm_start("0", true);
    pair *w = ws->w;
    it_proc *b = &w->b;
    void *pub = ws->pub;
    double pb = page_bytes_of(w->ctl, "wb");
    serve_shared(&w->a, 1100);
    drain_wa(ws);
    wait_pulls_settled(b);
    double in = it_metric(b->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}");
    double failed = it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}");
    double dropped =
        it_metric(b->admin_port, "kvmesh_kv_handoff_chains_total{outcome=\"dropped\"}");
    cr_log_info("handoff of %d chains over a shared prefix: %.0f bytes in, %.2f x the %d distinct "
                "pages (%.0f bytes each)",
                NS, in, in / (DISTINCT * pb), DISTINCT, pb);
    cr_assert_lt(in, 1.5 * DISTINCT * pb, "wb pulled %.0f bytes for %d distinct pages of %.0f", in,
                 DISTINCT, pb);
    cr_assert_eq(failed, 0, "wb counted %g pulls failed", failed);
    cr_assert_eq(dropped, 0, "wb dropped %g chains", dropped);
    for (int k = 0; k < NS; k++) {
        result got = run(b->req, 20 + (uint64_t)k, g_sp[k], NST, GEN_S, NULL, 120000);
        expect_same(&g_sref[k], &got, "a handed-over chain over a shared prefix");
        cr_assert_geq(got.cached, SHARED + 16, "prompt %d: cached %u", k, got.cached);
    }
    km_zsock_close(pub);
    pair_stop(w);
}

/* The warm-up budget (issue 39): a new worker pulls at most --peer-warm-pages pages, whatever
 * the chains its peer answers with hold, each page once. wa answers its three most recent chains
 * of the ten (106 distinct pages, the most recent first); a budget of 105 is the first chain's
 * 102 pages, the second's 2-page tail and 1 page of the third's. Before, up to four chains were
 * pulled at once, each moving the shared prefix, past the budget. */
Test(worker_pull, a_warm_up_pulls_a_shared_prefix_once_within_its_page_budget)
{
    if (!have_model()) return;
    enum { BUDGET = 105 };
    warmset *ws = warm_start("105", false);
    pair *w = ws->w;
    it_proc *a = &w->a, *b = &w->b;
    void *pub = ws->pub;
    double pb = page_bytes_of(w->ctl, "wb");
    serve_shared(a, 1300);
    double in = warm_until(ws, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}", 0);
    cr_assert_gt(in, 0, "wb pulled nothing in its warm-up");
    wait_pulls_settled(b);
    in = it_metric(b->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}");
    cr_log_info("warm-up with a budget of %d pages: %.0f bytes in (%.1f pages of %.0f bytes)",
                BUDGET, in, in / pb, pb);
    cr_assert_leq(in, BUDGET * pb, "wb pulled %.0f bytes, over its %d pages of %.0f", in, BUDGET,
                  pb);
    cr_assert_gt(in, (NST / 16) * pb, "wb pulled no tail beyond the first chain");
    cr_assert_eq(it_metric(b->admin_port, "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}"), 0);
    /* the three chains wa answered with, the third up to the budget: hits past the prefix */
    for (int k = NS - 1; k >= NS - 3; k--) {
        result got = run(b->req, 40 + (uint64_t)k, g_sp[k], NST, GEN_S, NULL, 120000);
        expect_same(&g_sref[k], &got, "served from a warm-up within its budget");
        cr_assert_geq(got.cached, SHARED + 16, "prompt %d: cached %u", k, got.cached);
    }
    km_zsock_close(pub);
    pair_stop(w);
}

/* The drain handoff across network namespaces: wa in its own namespace (a bridge, UCX on TCP,
 * the view from the test's PUB in the test's namespace) hands its chains to wb in the test's
 * namespace; the pages cross the bridge, and the prompts are then hits on wb. */
Test(worker_pull, a_drain_hands_pages_over_across_network_namespaces)
{
    if (!have_model()) return;
    if (!netns_setup()) return;
    char url[96], pub_ep[256];
    snprintf(url, sizeof url, "tcp://%s:*", it_net_self());
    void *pub = it_xpub(url, pub_ep, sizeof pub_ep);
    const char *const view[] = {"--peer-view", pub_ep, "--peer-warm-pages", "0", NULL};
    pair *w = pair_start(&g_ns, view);
    it_proc *a = &w->a, *b = &w->b;
    static uint8_t addr_b[KM_PROTO_MAX_PEER_ADDR];
    uint32_t lb = peer_addr_of(w->ctl, "wb", addr_b, sizeof addr_b);
    int32_t p[K][NP];
    result ref[K];
    serve_prompts(a, p, ref, 900);
    it_wait_subscribed(pub, 2, 30000); /* wa's and wb's --peer-view */
    publish_view(pub, 1, a, b, w->addr, w->addr_len, addr_b, lb);
    double in0 = it_metric(b->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}");
    cr_assert_eq(kill(a->pid, SIGTERM), 0);
    cr_assert_neq(it_wait_exit(a, 20000), -1, "the drained worker did not exit by itself");
    cr_assert_geq(it_metric(b->admin_port, "kvmesh_kv_handoff_chains_total{outcome=\"taken\"}"), K);
    cr_assert_gt(it_metric(b->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"in\"}"), in0,
                 "no page bytes crossed the bridge");
    expect_hits(b, p, ref, "handed over across namespaces");
    km_zsock_close(pub);
    pair_stop(w);
}
