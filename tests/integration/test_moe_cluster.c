/*
 * test_moe_cluster.c — the MoE test model served end to end by a whole local cluster (issue 16
 * point 5, docs/moe.md): `kvmesh up --model <MoE8-top4>` with two workers whose KV pages are
 * placed by the experts the model routes their tokens to (--kv-shards 4 --kv-shard-key expert),
 * a controller and a router, exactly as for the dense model:
 *  - a greedy prompt sent twice through the router gives the tokens a single MoE worker started
 *    directly gives; the second request finds its prefix in cached pages of the worker that
 *    served the first (kv-aware routing), and that worker placed pages by expert
 *    (kvmesh_kv_placements_total{result="moved"} > 0, a shard hit counted);
 *  - recovery: that worker is SIGKILLed, `kvmesh up` restarts it, and the prompt sent again still
 *    gives the same tokens, with no request failing.
 * One engine thread per worker, and one for the direct worker: the top-4 model's routing flips on
 * rounding differences (docs/moe.md), so every side computes alike. Nothing asserts on time; every
 * wait has a deadline. Run from the repository root after `make build` and `make moe-model`
 * (make integration); without the MoE model the test skips and says so.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "tests/integration/harness.h"

#define MOE_MODEL "models/SmolLM2-135M-Instruct-MoE8-top4.Q4_1.gguf"

enum { MAX_TOKENS = 16 };

/* ~180 tokens: eleven full 16-token pages to place and to find again. */
static const char *const PROMPT =
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home at "
    "night. The ancient Pharos of Alexandria, built in the third century before the common era, "
    "stood more than one hundred metres tall and used a mirror to reflect the light of its fire "
    "far out to sea. Medieval harbours kept smaller towers burning wood or coal, and in the "
    "eighteenth century oil lamps with reflectors replaced open flames. The Fresnel lens, "
    "invented in 1822, bent the light of a single lamp into a narrow beam visible for many "
    "kilometres, and every coastal nation soon fitted its towers with one. Keepers trimmed the "
    "wicks, wound the clockwork that turned the lens, and kept logs of passing ships and the "
    "weather. Question: what did the Fresnel lens change? Answer:";

static it_up g_up;

/* Stops what the test started, each by its own pid: the cluster, then the direct worker. */
static void stop_all(void)
{
    it_up_stop(&g_up);
    it_kill_all();
}

TestSuite(moe_cluster, .fini = stop_all, .timeout = 300);

/* The greedy completion of PROMPT from endpoint ep (a worker or a router). */
static void ask(const char *ep, kvm_result *res, const char *what)
{
    kvm_client *c;
    km_errbuf err = {{0}};
    kvm_opts o = {.timeout_ms = 120000};
    cr_assert_eq(kvm_open(ep, &o, &c, &err), 0, "%s: %s", what, err.msg);
    km_msg_request q;
    kvm_request_init(&q);
    q.prompt = PROMPT;
    q.temperature = 0;
    q.max_tokens = MAX_TOKENS;
    int rc = kvm_generate(c, &q, NULL, NULL, res, &err);
    kvm_close(c);
    cr_assert_eq(rc, 0, "%s: rc=%d code=%d %s %s", what, rc, res->error_code, res->error, err.msg);
    cr_assert_gt(res->completion_tokens, 0, "%s: no tokens", what);
}

/* The completion texts of x and ref are the same bytes. */
static void expect_same(const kvm_result *x, const kvm_result *ref, const char *what)
{
    cr_assert(x->text.len == ref->text.len && !memcmp(x->text.data, ref->text.data, x->text.len),
              "%s: \"%.*s\", the direct worker: \"%.*s\"", what, (int)x->text.len,
              (const char *)x->text.data, (int)ref->text.len, (const char *)ref->text.data);
}

/* The port of an "http://127.0.0.1:PORT" endpoint. */
static int port_of(const char *url)
{
    const char *c = strrchr(url, ':');
    return c ? atoi(c + 1) : -1;
}

/* cluster.env once the router has its endpoint and both workers run; fails after 60 s. */
static int read_cluster(const char *path, kvm_cluster_proc *procs)
{
    for (int i = 0; i < 1200; i++) {
        int n = kvm_cluster_read(path, procs, KVM_CLUSTER_MAX, NULL);
        const kvm_cluster_proc *r = n > 0 ? kvm_cluster_find(procs, n, "router") : NULL;
        const kvm_cluster_proc *w0 = n > 0 ? kvm_cluster_find(procs, n, "w0") : NULL;
        const kvm_cluster_proc *w1 = n > 0 ? kvm_cluster_find(procs, n, "w1") : NULL;
        if (r && r->pid && r->requests[0] && w0 && w0->pid && w0->admin[0] && w1 && w1->pid &&
            w1->admin[0])
            return n;
        cr_assert_eq(waitpid(g_up.pid, NULL, WNOHANG), 0, "kvmesh up exited (%s/up.log)", g_up.dir);
        usleep(50000);
    }
    cr_assert_fail("the cluster did not come up in 60 s (%s/up.log)", g_up.dir);
    return 0;
}

/* Waits up to 60 s until the controller's view (at its endpoint ctl) has both workers ready. */
static void wait_ready(const char *ctl)
{
    for (int i = 0; i < 240; i++) {
        km_msg v;
        bool ready = false;
        if (kvm_view_get(ctl, NULL, 2000, &v, NULL) == 0) {
            ready = v.type == KM_MSG_VIEW && kvm_view_all_ready(&v.view, 2);
            km_msg_clear(&v);
        }
        if (ready) return;
        usleep(250000);
    }
    cr_assert_fail("two workers ready in the controller's view (%s/logs)", g_up.dir);
}

Test(moe_cluster, kvmesh_up_serves_the_moe_model_with_expert_shards_cached_and_recovered)
{
    if (!it_have((const char *const[]){MOE_MODEL, IT_WORKER, IT_KVMESH, NULL})) return;

    /* the reference: one MoE worker on its own */
    it_proc direct = {0};
    it_start_worker(&direct, "moe-w",
                    (const char *const[]){"--model=" MOE_MODEL, "--threads=1", "--admin-port=-1",
                                          "--log-level=warn", NULL},
                    NULL);
    kvm_result ref;
    ask(direct.req, &ref, "the direct worker");
    it_stop(&direct);

    /* the cluster (--insecure: test_security covers keys) */
    it_up_start(&g_up, "moe-up",
                (const char *const[]){"--workers=2", "--threads=1", "--insecure",
                                      "--model=" MOE_MODEL,
                                      "--worker-args=--kv-shards=4 --kv-shard-key=expert", NULL});
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = read_cluster(g_up.cluster, procs);
    const kvm_cluster_proc *cp = kvm_cluster_find(procs, n, "controller");
    cr_assert(cp && cp->listen[0], "no controller in %s", g_up.cluster);
    char ctl[128], router[128];
    snprintf(ctl, sizeof ctl, "%s", cp->listen);
    snprintf(router, sizeof router, "%s", kvm_cluster_find(procs, n, "router")->requests);
    wait_ready(ctl);

    /* the same prompt twice through the router: the direct worker's tokens both times, the
     * second from the first one's cached pages */
    kvm_result a, b;
    ask(router, &a, "first request through the router");
    ask(router, &b, "second request through the router");
    expect_same(&a, &ref, "the cluster's answer");
    expect_same(&b, &ref, "the cached answer");
    cr_assert_eq(a.cached_tokens, 0, "the first request found %u tokens cached", a.cached_tokens);
    cr_assert_geq(b.cached_tokens, 10 * 16, "the second request hit %u tokens of %u",
                  b.cached_tokens, b.prompt_tokens);
    cr_assert_str_eq(b.worker, a.worker, "kv-aware routing sent the repeat elsewhere");

    /* the serving worker placed its pages by expert and counted the hit on a shard */
    const kvm_cluster_proc *w = kvm_cluster_find(procs, n, a.worker);
    cr_assert(w, "worker %s is not in %s", a.worker, g_up.cluster);
    const int admin = port_of(w->admin);
    double moved = -1, hits = 0;
    for (int i = 0; i < 40 && (moved <= 0 || hits <= 0); i++) { /* series refresh every 250 ms */
        usleep(100000);
        moved = it_metric(admin, "kvmesh_kv_placements_total{result=\"moved\"}");
        hits = 0;
        for (int s = 0; s < 4; s++) {
            char series[96];
            snprintf(series, sizeof series,
                     "kvmesh_kv_shard_events_total{shard=\"%d\",event=\"hit\"}", s);
            double v = it_metric(admin, series);
            hits += v > 0 ? v : 0;
        }
    }
    cr_assert_gt(moved, 0, "no page placed by expert on %s (kvmesh_kv_placements_total)", a.worker);
    cr_assert_geq(hits, 10, "%.0f shard hits on %s", hits, a.worker);

    /* recovery: the serving worker dies; the cluster answers the same, `kvmesh up` restarts it */
    const int dead_pid = w->pid;
    char dead_id[64];
    snprintf(dead_id, sizeof dead_id, "%s", w->id);
    cr_assert_eq(kill(dead_pid, SIGKILL), 0);
    kvm_result c;
    ask(router, &c, "the request after a worker died");
    expect_same(&c, &ref, "the answer after a worker died");
    bool restarted = false;
    for (int i = 0; i < 600 && !restarted; i++) {
        n = kvm_cluster_read(g_up.cluster, procs, KVM_CLUSTER_MAX, NULL);
        const kvm_cluster_proc *r = n > 0 ? kvm_cluster_find(procs, n, dead_id) : NULL;
        restarted = r && r->pid > 0 && r->pid != dead_pid && r->restarts >= 1;
        if (!restarted) usleep(100000);
    }
    cr_assert(restarted, "kvmesh up did not restart %s (%s/up.log)", dead_id, g_up.dir);
    wait_ready(ctl);

    kvm_result_free(&ref);
    kvm_result_free(&a);
    kvm_result_free(&b);
    kvm_result_free(&c);
}
