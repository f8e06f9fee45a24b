/*
 * test_netns_cluster.c — a whole cluster across hosts (issue 14, "across hosts"): the controller,
 * the router and each worker run in a network namespace of their own, joined by a bridge
 * (harness.h, it_net), every endpoint bound to its namespace's own address and the workers' page
 * transfers on UCX over TCP (UCX_TLS=tcp), so heartbeats, views, KV events, requests and KV page
 * bytes all cross the bridge as they would cross a network between hosts. The test process is
 * the client, in a namespace of its own on the same bridge: its requests go through the router's
 * front (libkvmesh), its operator command through `kvmesh recover`, and it reads every daemon's
 * /metrics.
 *
 * One cluster, three acts, each driven by the controller's view as in production:
 *  1. prefix pull: a prompt computed on wa; while wa is busy (the router sends a worker at most
 *     --max-inflight 1 request), the same prompt through the router goes to wb with a hint to
 *     pull its pages from wa; wb pulls them across the namespaces and its greedy output is wa's;
 *  2. a holder killed mid-pull: wa busy and then stopped (SIGSTOP), a prompt it holds goes to wb
 *     with a hint naming wa; once wb's pull has started wa is SIGKILLed: the request completes
 *     on wb with wa's output (the pages recomputed), and wa's stream migrates and completes;
 *  3. drain handoff: a new worker wc joins; the controller drains wb (recovery level 3, asked
 *     with `kvmesh recover`); wb hands its cached chains to wc, which pulls them, and wb exits;
 *     the prompts wb held are then cache hits on wc with the same output.
 *
 * Every wait has a deadline; children are killed by their own pid and the namespaces deleted
 * (it_kill_all), and a run that died is cleaned up by the next. Skipped where `ip netns add` is
 * not permitted, or without the model and binaries (make deps, make build). About a minute.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "client/kvmesh.h"
#include "common/svc.h"
#include "tests/integration/harness.h"

#define KVMESH "build/bin/kvmesh"

enum { H_CTL, H_RTR, H_WA, H_WB, H_WC, N_HOSTS };
enum {
    NP = 200,        /* prompt tokens: 12 full pages */
    PAGES = NP / 16, /* of 16 tokens */
    GEN = 12,        /* tokens generated per compared request */
    BUSY = 96,       /* tokens of the request that keeps a worker busy */
    WAIT_MS = 60000, /* any one wait for a state */
    REQ_MS = 120000, /* any one request */
};

static it_host g_h[N_HOSTS];
static it_proc g_ctl, g_rtr, g_wa, g_wb, g_wc;

static void suite_init(void)
{
    setenv("UCX_TLS", "tcp", 1); /* the workers' transfers: TCP, as between hosts */
}

TestSuite(netns_cluster, .init = suite_init, .fini = it_kill_all, .timeout = 400);

/* ---------------------------------------------------------------- the daemons */

/* A daemon's own endpoints: tcp://ADDR:* (ZeroMQ picks the port), ADDR its namespace's. */
static void url_on(char *out, size_t cap, const it_host *h)
{
    snprintf(out, cap, "tcp://%s:*", h->ip);
}

static void start_controller(void)
{
    it_proc *c = &g_ctl;
    it_proc_dir(c, "nsctl");
    snprintf(c->ns, sizeof c->ns, "%s", g_h[H_CTL].ns);
    char ports[128], url[64];
    snprintf(ports, sizeof ports, "%.63s/ports", c->dir);
    url_on(url, sizeof url, &g_h[H_CTL]);
    /* heartbeats every 250 ms (the workers'), dead after 3 s of silence; a view every 200 ms,
     * so every measured prefill rate a heartbeat carries reaches the router */
    const char *argv[] = {
        IT_CONTROLLER, "--listen",        url,     "--view",       url,     "--admin-host",
        g_h[H_CTL].ip, "--admin-port",    "0",     "--heartbeat",  "250ms", "--dead-after",
        "12",          "--view-interval", "200ms", "--ports-file", ports,   NULL};
    it_spawn(c, argv, NULL, "controller.log");
    cr_assert(c->listen[0] && c->view[0], "the controller's ports file names no endpoints");
}

static void start_worker(it_proc *w, const char *id, const it_host *h)
{
    it_proc_dir(w, "nswk");
    snprintf(w->ns, sizeof w->ns, "%s", h->ns);
    char ports[128], url[64], peer[64];
    snprintf(ports, sizeof ports, "%.63s/ports", w->dir);
    url_on(url, sizeof url, h);
    snprintf(peer, sizeof peer, "%s:0", h->ip);
    /* debug: the test waits for wb's pull_start line in act 2; no warm-up, so that pages reach a
     * worker only by the pulls each act is about */
    const char *argv[] = {
        IT_WORKER,    "--listen",     url,        "--events",          url,   "--admin-host",
        h->ip,        "--admin-port", "0",        "--ports-file",      ports, "--threads",
        "1",          "--log-level",  "debug",    "--worker-id",       id,    "--controller",
        g_ctl.listen, "--heartbeat",  "250ms",    "--peer-listen",     peer,  "--peer-advertise",
        h->ip,        "--peer-view",  g_ctl.view, "--peer-warm-pages", "0",   NULL};
    it_spawn(w, argv, NULL, "worker.log");
}

static void start_router(void)
{
    it_proc *r = &g_rtr;
    it_proc_dir(r, "nsrtr");
    snprintf(r->ns, sizeof r->ns, "%s", g_h[H_RTR].ns);
    char ports[128], url[64], ctl[600];
    snprintf(ports, sizeof ports, "%.63s/ports", r->dir);
    url_on(url, sizeof url, &g_h[H_RTR]);
    snprintf(ctl, sizeof ctl, "--controller=%s", g_ctl.view);
    /* the workers from the controller's view only; one request at a time per worker, so a busy
     * worker gets no more and a prefix it holds goes elsewhere with a pull hint; a pull rate
     * assumed until one is measured (as `kvmesh up` does) */
    const char *argv[] = {IT_ROUTER,
                          "--front",
                          url,
                          "--http-host",
                          g_h[H_RTR].ip,
                          "--http-port=0",
                          ctl,
                          "--max-inflight=1",
                          "--pull-default-rate=1e9",
                          "--log-level=debug",
                          "--ports-file",
                          ports,
                          NULL};
    it_spawn(r, argv, NULL, "router.log");
    cr_assert(r->front[0] && r->http_port > 0, "the router's ports file names no front");
}

static double wk_metric(const it_proc *w, const it_host *h, const char *series)
{
    return it_metric_at(h->ip, w->admin_port, series);
}

static double rt_metric(const char *series)
{
    return it_metric_at(g_h[H_RTR].ip, g_rtr.http_port, series);
}

static double ctl_metric(const char *series)
{
    return it_metric_at(g_h[H_CTL].ip, g_ctl.admin_port, series);
}

/* Waits until the router's series is at least min. */
static void rt_wait(const char *series, double min, const char *what)
{
    double v = -1;
    for (int i = 0; i < WAIT_MS / 100; i++) {
        v = rt_metric(series);
        if (v >= min) return;
        usleep(100000);
    }
    cr_assert_fail("%s: the router's %s stayed %g (< %g) for %d s", what, series, v, min,
                   WAIT_MS / 1000);
}

static void rt_wait_worker(const char *id, const char *what)
{
    char up[128], member[128];
    snprintf(up, sizeof up, "kvmesh_router_worker_up{worker=\"%s\"}", id);
    snprintf(member, sizeof member, "kvmesh_router_worker_member_state{worker=\"%s\"}", id);
    rt_wait(up, 1, what);
    rt_wait(member, 1, what); /* 1: ready in the controller's view */
}

/* Pages of worker id in the router's prefix index (its KV events crossed the bridge). */
static double rt_pages(const char *id)
{
    char s[128];
    snprintf(s, sizeof s, "kvmesh_router_worker_kv_pages{worker=\"%s\",tier=\"hot\"}", id);
    return rt_metric(s);
}

/* Every endpoint the view carries for w is on its namespace's address: the cluster does not
 * work only because everything shares a loopback. */
static void expect_own_address(const km_view_worker *w, const char *ip)
{
    char want[40];
    snprintf(want, sizeof want, "tcp://%s:", ip);
    cr_assert(w->requests && !strncmp(w->requests, want, strlen(want)), "%s: requests %s", w->id,
              w->requests);
    cr_assert(w->events && !strncmp(w->events, want, strlen(want)), "%s: events %s", w->id,
              w->events);
    cr_assert(w->admin && strstr(w->admin, ip), "%s: admin %s", w->id, w->admin);
    /* the transfer address (peer/addr.c): "KVMPEER1", version, port, host length, host */
    const uint8_t *a = w->peer_addr;
    cr_assert(a && w->peer_addr_len > 20, "%s advertises no transfer address", w->id);
    uint32_t hl =
        (uint32_t)a[16] | (uint32_t)a[17] << 8 | (uint32_t)a[18] << 16 | (uint32_t)a[19] << 24;
    cr_assert(hl == strlen(ip) && 20 + hl <= w->peer_addr_len && !memcmp(a + 20, ip, hl),
              "%s: its transfer address names another host than %s", w->id, ip);
}

/* The worker id in view v, or NULL. */
static const km_view_worker *view_worker(const km_msg_view *v, const char *id)
{
    for (uint32_t k = 0; k < v->n_workers; k++)
        if (!strcmp(v->workers[k].id, id)) return &v->workers[k];
    return NULL;
}

/* The controller's view (asked on its --listen, across the bridge) until it shows every worker
 * of ids (NULL-terminated) in state st; into v (km_msg_clear it). */
static void wait_state(const char *const *ids, km_member_state st, km_msg *v)
{
    km_errbuf err = {{0}};
    bool there = false;
    for (int i = 0; i < WAIT_MS / 200 && !there; i++) {
        if (i) usleep(200000);
        if (kvm_view_get(g_ctl.listen, NULL, 2000, v, &err)) continue;
        there = v->type == KM_MSG_VIEW;
        for (int k = 0; ids[k] && there; k++) {
            const km_view_worker *w = view_worker(&v->view, ids[k]);
            there = w && w->state == st;
        }
        if (!there) km_msg_clear(v);
    }
    cr_assert(there, "the controller's view did not show %s%s in state %d in %d s (%s)", ids[0],
              ids[1] ? " and the others" : "", (int)st, WAIT_MS / 1000, err.msg);
}

/* wait_state ready, then each worker's endpoints are checked against its host. */
static void wait_ready(const char *const *ids, const it_host *const *hosts)
{
    km_msg v;
    wait_state(ids, KM_MEMBER_READY, &v);
    for (int k = 0; ids[k]; k++) expect_own_address(view_worker(&v.view, ids[k]), hosts[k]->ip);
    km_msg_clear(&v);
}

/* True when the controller's view carries a measured prefill rate of worker id: its heartbeats
 * carry the rate of their last half second, so it shows while a prompt is being computed and
 * for a moment after. */
static bool prefill_seen(const char *id)
{
    km_msg v = {0};
    if (kvm_view_get(g_ctl.listen, NULL, 2000, &v, NULL)) return false;
    const km_view_worker *w = v.type == KM_MSG_VIEW ? view_worker(&v.view, id) : NULL;
    bool yes = w && w->prefill_tps > 0;
    km_msg_clear(&v);
    return yes;
}

/* ---------------------------------------------------------------- requests */

typedef struct answer {
    int32_t tok[BUSY];
    int n;
    uint32_t cached, migrations;
    char worker[KM_PROTO_MAX_NAME + 1];
    km_finish finish;
    double total_ms;
} answer;

/* NP token ids from seed (ids 200..40199 of the model's 49152). */
static void make_prompt(int32_t *p, uint64_t seed)
{
    for (uint64_t i = 0; i < NP; i++) p[i] = 200 + (int32_t)(XXH64(&i, sizeof i, seed) % 40000);
}

/* Sends a greedy request for prompt (n tokens) on a new client to ep; the client its answers
 * come on (collect closes it). */
static kvm_client *submit(const char *ep, uint64_t id, const int32_t *prompt, int n, int max_tok)
{
    kvm_client *c = NULL;
    km_errbuf err = {{0}};
    kvm_opts o = {.timeout_ms = REQ_MS};
    cr_assert_eq(kvm_open(ep, &o, &c, &err), 0, "%s: %s", ep, err.msg);
    km_msg_request q;
    kvm_request_init(&q);
    q.id = id;
    q.tokens = prompt;
    q.n_tokens = (uint32_t)n;
    q.temperature = 0;
    q.max_tokens = (uint32_t)max_tok;
    q.stream = true;
    q.deadline_ms = REQ_MS;
    cr_assert_eq(kvm_submit(c, &q, &err), 0, "%s: %s", ep, err.msg);
    return c;
}

/* Request id's tokens and its done on c, within REQ_MS (an error frame fails the test). */
static answer collect(kvm_client *c, uint64_t id, const char *what)
{
    answer a = {0};
    km_errbuf err = {{0}};
    uint64_t t0 = km_now_ns();
    bool done = false;
    while (!done && km_now_ns() - t0 < (uint64_t)REQ_MS * 1000000u) {
        km_msg m;
        if (kvm_next(c, 200, &m, NULL, NULL, &err)) continue;
        if (m.type == KM_MSG_TOKEN && m.tok.id == id && m.tok.index == (uint32_t)a.n &&
            a.n < BUSY) {
            a.tok[a.n++] = m.tok.token;
        } else if (m.type == KM_MSG_DONE && m.done.id == id) {
            done = true;
            a.cached = m.done.cached_tokens;
            a.migrations = m.done.migrations;
            a.finish = m.done.finish;
            a.total_ms = m.done.total_ms;
            if (m.done.worker) snprintf(a.worker, sizeof a.worker, "%s", m.done.worker);
        } else if (m.type == KM_MSG_ERROR) {
            cr_assert_fail("%s: request %llu failed: %d %s", what, (unsigned long long)id,
                           m.error.code, m.error.message);
        }
        km_msg_clear(&m);
    }
    kvm_close(c);
    cr_assert(done, "%s: request %llu did not end within %d s", what, (unsigned long long)id,
              REQ_MS / 1000);
    return a;
}

static answer ask(const char *ep, uint64_t id, const int32_t *prompt, const char *what)
{
    return collect(submit(ep, id, prompt, NP, GEN), id, what);
}

static void expect_same(const answer *ref, const answer *got, const char *what)
{
    cr_assert_eq(got->n, ref->n, "%s: %d tokens, reference %d", what, got->n, ref->n);
    for (int i = 0; i < ref->n; i++)
        cr_assert_eq(got->tok[i], ref->tok[i], "%s: token %d is %d, reference %d", what, i,
                     got->tok[i], ref->tok[i]);
}

/* The router's pull rule weighs measured figures only: prompts computed on w until the view
 * has carried its prefill rate (watched while each runs: on a slow machine, a sanitizer build,
 * the decode after the prompt outlasts the rate's half second), and the router has had a view or
 * two since. */
static void warm_until_measured(const it_proc *w, const char *id)
{
    for (uint64_t k = 1; k <= 5; k++) {
        int32_t p[NP];
        make_prompt(p, k);
        kvm_client *c = submit(w->req, k, p, NP, GEN);
        bool seen = false, done = false;
        uint64_t t0 = km_now_ns();
        while (!seen && !done && km_now_ns() - t0 < (uint64_t)REQ_MS * 1000000u) {
            seen = prefill_seen(id);
            km_msg m;
            if (!seen && !kvm_next(c, 100, &m, NULL, NULL, NULL)) {
                done = (m.type == KM_MSG_DONE && m.done.id == k) || m.type == KM_MSG_ERROR;
                km_msg_clear(&m);
            }
        }
        if (done)
            kvm_close(c);
        else
            collect(c, k, "warming");
        for (int i = 0; i < 20 && !seen; i++) { /* the heartbeat after the last step */
            usleep(100000);
            seen = prefill_seen(id);
        }
        if (seen) {
            const double views = rt_metric("kvmesh_router_views_total");
            rt_wait("kvmesh_router_views_total", views + 2, "views after the prefill rate");
            return;
        }
    }
    cr_assert_fail("the controller's view never carried %s's prefill rate", id);
}

/* A request that keeps wa busy: its prompt is p with 16 more tokens (wa holds p, so the router
 * sends it there), BUSY tokens long; returns once the router has it in flight at wa. */
static kvm_client *keep_wa_busy(uint64_t id, const int32_t *p, int32_t *buf)
{
    memcpy(buf, p, sizeof *p * NP);
    for (int i = 0; i < 16; i++) buf[NP + i] = 300 + i;
    kvm_client *c = submit(g_rtr.front, id, buf, NP + 16, BUSY);
    rt_wait("kvmesh_router_worker_inflight{worker=\"wa\"}", 1, "the busy request at wa");
    return c;
}

/* Lines of a log that hold both needles. */
static int log_lines(const it_proc *p, const char *log, const char *a, const char *b)
{
    char path[128], line[2048];
    snprintf(path, sizeof path, "%s/%s", p->dir, log);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0;
    while (fgets(line, sizeof line, f)) n += strstr(line, a) && strstr(line, b);
    fclose(f);
    return n;
}

/* ---------------------------------------------------------------- the acts */

static const char *const IN_BYTES = "kvmesh_kv_transfer_bytes_total{direction=\"in\"}";
static const char *const OUT_BYTES = "kvmesh_kv_transfer_bytes_total{direction=\"out\"}";
static const char *const PULLS_OK = "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}";
static const char *const PULLS_FAILED = "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}";
static const char *const ROUTER_PULLS = "kvmesh_router_pulls_total{decision=\"pull\"}";

/* Computes prompt p on wa (its answer into ref) and waits until the router's index holds its
 * pages at wa: then a longer prompt with p's prefix goes to wa (keep_wa_busy). */
static void compute_on_wa(const int32_t p[NP], uint64_t id, answer *ref)
{
    /* what wa holds before: settled (the last request's KV events may still be on their way) */
    double pages0 = -1, last = -2;
    for (int i = 0; i < WAIT_MS / 300 && pages0 != last; i++) {
        if (i) usleep(300000);
        last = pages0;
        pages0 = rt_pages("wa");
    }
    *ref = ask(g_wa.req, id, p, "computed on wa");
    cr_assert_eq(ref->cached, 0, "wa computed the prompt");
    rt_wait("kvmesh_router_worker_kv_pages{worker=\"wa\",tier=\"hot\"}", pages0 + PAGES,
            "wa's pages in the router's index");
}

/* Act 1: p computed on wa; through the router while wa is busy it goes to wb, which pulls its
 * pages from wa across the bridge: the same greedy output, served from pulled pages. */
static void act_prefix_pull(const int32_t p[NP], answer *ref)
{
    double in0 = wk_metric(&g_wb, &g_h[H_WB], IN_BYTES);
    double out0 = wk_metric(&g_wa, &g_h[H_WA], OUT_BYTES);
    compute_on_wa(p, 10, ref);
    int32_t busy_p[NP + 16];
    kvm_client *busy = keep_wa_busy(11, p, busy_p);
    answer got = ask(g_rtr.front, 12, p, "through the router");
    answer b = collect(busy, 11, "the busy request");
    cr_assert_str_eq(b.worker, "wa", "the busy request ran on %s", b.worker);
    cr_assert_str_eq(got.worker, "wb", "the router sent the prompt to %s; wa was busy", got.worker);
    expect_same(ref, &got, "served on wb");
    cr_assert_geq(got.cached, 16 * (PAGES - 1),
                  "wb served %u prompt tokens from cache: it did not pull wa's pages (router pull "
                  "decisions: %g)",
                  got.cached, rt_metric(ROUTER_PULLS));
    double in1 = wk_metric(&g_wb, &g_h[H_WB], IN_BYTES);
    cr_assert_gt(in1, in0, "wb counts no bytes pulled (%g -> %g)", in0, in1);
    cr_assert_gt(wk_metric(&g_wa, &g_h[H_WA], OUT_BYTES), out0, "wa counts no bytes read");
    cr_assert_geq(rt_metric(ROUTER_PULLS), 1);
    cr_log_info("prefix pull: wb served %u of %d prompt tokens from %.0f bytes pulled from wa "
                "across the bridge (request %.0f ms)",
                got.cached, NP, in1 - in0, got.total_ms);
}

/* Act 2: wa, holding p2, busy and then stopped; p2 through the router goes to wb with a hint
 * naming wa; once wb's pull has started, wa is killed. p2 completes on wb with wa's output,
 * recomputed, and wa's busy stream migrates and completes. */
static void act_killed_holder(void)
{
    int32_t p2[NP], busy_p[NP + 16];
    make_prompt(p2, 200);
    answer ref;
    compute_on_wa(p2, 40, &ref);
    kvm_client *busy = keep_wa_busy(41, p2, busy_p);
    double failed0 = wk_metric(&g_wb, &g_h[H_WB], PULLS_FAILED);
    double router0 = rt_metric(ROUTER_PULLS);
    int starts0 = log_lines(&g_wb, "worker.log", "pull_start", "from=wa");
    cr_assert_eq(kill(g_wa.pid, SIGSTOP), 0);
    /* the view names wa ready for 3 s more (its missed heartbeats): the router still counts it a
     * holder, and busy */
    kvm_client *c = submit(g_rtr.front, 42, p2, NP, GEN);
    int starts = starts0;
    for (int i = 0; i < WAIT_MS / 20 && starts == starts0; i++) {
        usleep(20000);
        starts = log_lines(&g_wb, "worker.log", "pull_start", "from=wa");
    }
    cr_assert_gt(starts, starts0, "wb never started a pull from wa (router pull decisions: %g)",
                 rt_metric(ROUTER_PULLS) - router0);
    cr_assert_eq(kill(g_wa.pid, SIGKILL), 0); /* mid-pull: wb asked, wa never offered */
    it_wait_exit(&g_wa, 5000);
    answer got = collect(c, 42, "the request whose holder was killed");
    cr_assert_str_eq(got.worker, "wb");
    cr_assert_neq(got.finish, KM_FINISH_DEADLINE);
    expect_same(&ref, &got, "recomputed after the holder was killed");
    cr_assert_lt(got.cached, 16 * (PAGES - 1), "wb cannot have pulled from a stopped holder");
    cr_assert_gt(wk_metric(&g_wb, &g_h[H_WB], PULLS_FAILED), failed0,
                 "wb's pull from the killed holder is not counted failed");
    cr_log_info("killed holder: the request completed on wb in %.0f ms", got.total_ms);
    answer b = collect(busy, 41, "the stream of the killed worker");
    cr_assert_neq(b.finish, KM_FINISH_DEADLINE);
    cr_assert_geq(b.migrations, 1, "the killed worker's stream did not migrate");
    /* and the controller, across the bridge, finds wa's heartbeats missing: dead */
    km_msg v;
    wait_state((const char *const[]){"wa", NULL}, KM_MEMBER_DEAD, &v);
    km_msg_clear(&v);
}

/* Runs cmd; its exit status, and its output into out. */
static int run_cmd(const char *cmd, char *out, size_t cap)
{
    char full[1024];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *f = popen(full, "r");
    cr_assert_not_null(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Act 3: wc joins; the controller drains wb (level 3, `kvmesh recover`); wb hands its chains to
 * wc and exits; the prompts wb held (p, p2: those of acts 1 and 2) are hits on wc. */
static void act_drain_handoff(const int32_t *p, const answer *ref)
{
    start_worker(&g_wc, "wc", &g_h[H_WC]);
    rt_wait_worker("wc", "wc joining");
    wait_ready((const char *const[]){"wb", "wc", NULL},
               (const it_host *const[]){&g_h[H_WB], &g_h[H_WC]});
    /* two more views: wb's own subscription has one naming wc too */
    const double views = ctl_metric("kvmesh_controller_views_total");
    IT_WAIT(ctl_metric("kvmesh_controller_views_total") >= views + 2, WAIT_MS,
            "the controller published no two views in %d s", WAIT_MS / 1000);
    char cmd[700], out[4096];
    snprintf(cmd, sizeof cmd, KVMESH " recover --controller %s --worker wb --level 3",
             g_ctl.listen);
    int rc = run_cmd(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "%s: exit %d:\n%s", cmd, rc, out);
    rc = it_wait_exit(&g_wb, WAIT_MS);
    cr_assert_eq(rc, 75, "the drained worker exited %d, not 75 (restart me)", rc);
    double taken =
        wk_metric(&g_wc, &g_h[H_WC], "kvmesh_kv_handoff_chains_total{outcome=\"taken\"}");
    cr_assert_geq(taken, 2, "wc took %g of wb's chains", taken);
    double in = wk_metric(&g_wc, &g_h[H_WC], IN_BYTES);
    cr_assert_gt(in, 0, "no page bytes crossed the bridge into wc");
    cr_assert_geq(wk_metric(&g_wc, &g_h[H_WC], PULLS_OK), 1);
    cr_log_info("drain handoff: wc took %g chains, %.0f bytes", taken, in);
    answer got = ask(g_rtr.front, 50, p, "after the handoff");
    cr_assert_str_eq(got.worker, "wc");
    expect_same(ref, &got, "served from the pages handed over");
    cr_assert_geq(got.cached, 16 * (PAGES - 1), "wc served %u prompt tokens from cache",
                  got.cached);
    int32_t p2[NP];
    make_prompt(p2, 200);
    answer ref2 = ask(g_wc.req, 51, p2, "the killed holder's prompt on wc");
    cr_assert_geq(ref2.cached, 16 * (PAGES - 1), "wc served %u of p2's tokens from cache",
                  ref2.cached);
}

Test(netns_cluster, a_cluster_across_namespaces_pulls_hands_over_and_survives_a_killed_holder)
{
    if (!it_have(
            (const char *const[]){IT_MODEL, IT_WORKER, IT_ROUTER, IT_CONTROLLER, KVMESH, NULL}))
        return;
    if (!it_net_create((const char *const[]){"ctl", "rtr", "wa", "wb", "wc", NULL}, g_h)) return;
    for (int h = H_WA; h <= H_WC; h++) it_net_decoy(&g_h[h]); /* hosts have other interfaces */
    start_controller();
    start_worker(&g_wa, "wa", &g_h[H_WA]);
    start_worker(&g_wb, "wb", &g_h[H_WB]);
    wait_ready((const char *const[]){"wa", "wb", NULL},
               (const it_host *const[]){&g_h[H_WA], &g_h[H_WB]});
    start_router();
    rt_wait_worker("wa", "the router's workers from the view");
    rt_wait_worker("wb", "the router's workers from the view");
    warm_until_measured(&g_wb, "wb");

    int32_t p[NP];
    answer ref;
    make_prompt(p, 100);
    act_prefix_pull(p, &ref);
    act_killed_holder();
    act_drain_handoff(p, &ref);
    it_kill_all();
}
