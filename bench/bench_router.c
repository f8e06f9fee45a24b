/*
 * bench_router.c — the figures of `make bench-router` (docs/router.md, docs/benchmarks.md):
 *   bench_router micro                      routing decisions per second (index match + cost
 *                                           model + rendezvous), in process
 *   bench_router latency  --router EP --worker EP [-n N]
 *                                           what the router adds: the same cached one-token
 *                                           request sent to a worker directly and through the
 *                                           router, p50/p99 of each and the difference
 *   bench_router curve --router EP --worker EP --curve-router EP --curve-worker EP --keydir K
 *                                           the cost of CURVE (issue 13): a plain and a CURVE
 *                                           pair (instant worker + router) side by side, one-token
 *                                           requests alternating between them (p50/p99, direct and
 *                                           through the router), then pipelined throughput
 *                                           (requests/s with 64 in flight) in alternating rounds
 *   bench_router instant --listen EP [--keydir K]   the instant worker (CURVE with a key
 *                                           directory: its certificate is K/private/instant.key)
 *   bench_router workload --router EP [--tenants 16 --per-tenant 8 --prefix-tokens 1000 ...]
 *                                           a shared-prefix workload: every tenant has a long
 *                                           system prompt (its own cache_salt) and asks short
 *                                           questions; prints the prefix hit ratio (cached over
 *                                           prompt tokens, as the workers report), its ceiling
 *                                           (each tenant's prefix computed once), TTFT p50/p90
 *                                           as the client sees it and requests per worker.
 *                                           --skew S --requests N: tenant t gets a share of the
 *                                           N requests proportional to 1/(t+1)^S; --trace FILE:
 *                                           a line per finished request (wall-clock ms, prompt
 *                                           and cached tokens, worker, TTFT ms, tenant)
 * bench/bench_router.sh runs all three against `kvmesh up` clusters, one per routing mode.
 * A benchmark prints figures; it asserts nothing about time.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "client/kvmesh.h"
#include "common/sec.h"
#include "router/route.h"

static double now_ms(void)
{
    return km_now_ns() / 1e6;
}

/* ---------------------------------------------------------------- micro */

static int micro(void)
{
    enum { W = 4, TENANTS = 16, PAGES = 64, N = 200000 };
    rt_index *x;
    if (rt_index_create(1 << 16, 30000, &x)) return 1;
    km_pagehash chains[TENANTS][PAGES + 4];
    int32_t toks[(PAGES + 4) * 16];
    for (int t = 0; t < TENANTS; t++) {
        for (int i = 0; i < (PAGES + 4) * 16; i++) toks[i] = (i * 31 + t) % 49152;
        char salt[16];
        snprintf(salt, sizeof salt, "t%d", t);
        km_pagehash seed = km_pagehash_seed("fp", 2, 0, salt, strlen(salt));
        km_pagehash_chain(seed, toks, (PAGES + 4) * 16, 16, chains[t], PAGES + 4);
        rt_index_apply(x, t % W, KM_KV_STORED, KM_TIER_HOT, KM_TIER_HOT, chains[t], PAGES);
    }
    rt_policy p;
    rt_policy_default(&p);
    const char *ids[W] = {"w0", "w1", "w2", "w3"};
    uint64_t st = 0, sink = 0;
    double t0 = now_ms();
    for (int k = 0; k < N; k++) {
        int t = k % TENANTS;
        rt_match m;
        rt_index_match(x, chains[t], PAGES + 4, (1u << W) - 1, p.tier_credit, 16, 0, &m);
        rt_candidate c[W];
        for (int i = 0; i < W; i++)
            c[i] = (rt_candidate){.id = ids[i],
                                  .usable = true,
                                  .inflight = k % 7,
                                  .slots = 8,
                                  .max_inflight = 64,
                                  .cached_tokens = m.credit[i]};
        sink += (uint64_t)rt_pick(&p, c, W, (PAGES + 4) * 16, chains[t][0], &st);
    }
    double ms = now_ms() - t0;
    printf("routing decisions: %.0f /s (%.2f us each; %d workers, prompts of %d pages, %d "
           "tenants; checksum %llu)\n",
           N / (ms / 1e3), ms * 1e3 / N, W, PAGES + 4, TENANTS, (unsigned long long)sink % 7);
    rt_index_destroy(x);
    return 0;
}

/* ---------------------------------------------------------------- latency */

static const char *g_model = "SmolLM2-135M-Instruct";

static int one(kvm_client *c, const char *prompt, kvm_result *res)
{
    km_msg_request q;
    kvm_request_init(&q);
    q.model = g_model; /* a worker does not know the router's "default" */
    q.prompt = prompt;
    q.temperature = 0;
    q.max_tokens = 1;
    q.stream = true;
    km_errbuf err = {{0}};
    int rc = kvm_generate(c, &q, NULL, NULL, res, &err);
    if (rc) fprintf(stderr, "bench_router: %s\n", err.msg);
    return rc;
}

static int latency(int argc, char **argv)
{
    const char *rep = bench_arg(argc, argv, "--router", "tcp://127.0.0.1:7000");
    const char *wep = bench_arg(argc, argv, "--worker", "tcp://127.0.0.1:7100");
    int n = atoi(bench_arg(argc, argv, "-n", "200"));
    g_model = bench_arg(argc, argv, "--model", g_model);
    const char *prompt = "The quick brown fox jumps over the lazy dog. The capital of France is";
    kvm_client *cr = NULL, *cw = NULL;
    km_errbuf err = {{0}};
    if (kvm_open(rep, NULL, &cr, &err) || kvm_open(wep, NULL, &cw, &err)) {
        fprintf(stderr, "bench_router: %s\n", err.msg);
        return 1;
    }
    double *d = calloc((size_t)n, sizeof *d), *r = calloc((size_t)n, sizeof *r);
    kvm_result res;
    for (int i = 0; i < 5; i++) { /* warm: the prompt's pages get cached on the worker */
        one(cw, prompt, &res);
        kvm_result_free(&res);
        one(cr, prompt, &res);
        kvm_result_free(&res);
    }
    for (int i = 0; i < n; i++) { /* interleaved, so drift hits both alike */
        if (one(cw, prompt, &res)) return 1;
        d[i] = res.client_total_ms;
        kvm_result_free(&res);
        if (one(cr, prompt, &res)) return 1;
        r[i] = res.client_total_ms;
        kvm_result_free(&res);
    }
    double d50 = bench_pct(d, n, 0.5), d99 = bench_pct(d, n, 0.99), r50 = bench_pct(r, n, 0.5),
           r99 = bench_pct(r, n, 0.99);
    printf("  %d one-token requests, alternating:\n", n);
    printf("    worker directly: p50 %8.3f ms  p99 %8.3f ms\n", d50, d99);
    printf("    through router : p50 %8.3f ms  p99 %8.3f ms\n", r50, r99);
    printf("    added by router: p50 %8.3f ms  p99 %8.3f ms\n", r50 - d50, r99 - d99);
    free(d);
    free(r);
    kvm_close(cr);
    kvm_close(cw);
    return 0;
}

/* ---------------------------------------------------------------- the cost of CURVE */

/* n one-token requests with `depth` in flight on c: requests per second. */
static double pipelined(kvm_client *c, const char *prompt, int n, int depth, uint64_t *next_id)
{
    km_msg_request q;
    kvm_request_init(&q);
    q.model = g_model;
    q.prompt = prompt;
    q.temperature = 0;
    q.max_tokens = 1;
    int sent = 0, done = 0;
    double t0 = now_ms();
    while (done < n) {
        while (sent < n && sent - done < depth) {
            q.id = ++*next_id;
            if (kvm_submit(c, &q, NULL)) return 0;
            sent++;
        }
        km_msg m;
        if (kvm_next(c, 10000, &m, NULL, NULL, NULL)) return 0;
        if (m.type == KM_MSG_DONE || m.type == KM_MSG_ERROR) done++;
        km_msg_clear(&m);
    }
    return n / ((now_ms() - t0) / 1e3);
}

static int curve(int argc, char **argv)
{
    const char *keydir = bench_arg(argc, argv, "--keydir", NULL);
    int n = atoi(bench_arg(argc, argv, "-n", "2000"));
    if (!keydir) {
        fprintf(stderr, "bench_router curve: --keydir is required\n");
        return 2;
    }
    char client_cert[4200], member_cert[4200];
    snprintf(client_cert, sizeof client_cert, "%s/private/client.key", keydir);
    snprintf(member_cert, sizeof member_cert, "%s/private/router.key", keydir);
    /* 0: plain router, 1: plain worker, 2: CURVE router (a client key), 3: CURVE worker (a
     * member key, as a router connects) */
    const char *ep[4] = {bench_arg(argc, argv, "--router", "tcp://127.0.0.1:7000"),
                         bench_arg(argc, argv, "--worker", "tcp://127.0.0.1:7100"),
                         bench_arg(argc, argv, "--curve-router", "tcp://127.0.0.1:7001"),
                         bench_arg(argc, argv, "--curve-worker", "tcp://127.0.0.1:7101")};
    kvm_opts o[4] = {{0}, {0}, {.sec = {client_cert, "router"}}, {.sec = {member_cert, "instant"}}};
    kvm_client *c[4] = {0};
    km_errbuf err = {{0}};
    for (int i = 0; i < 4; i++)
        if (kvm_open(ep[i], &o[i], &c[i], &err)) {
            fprintf(stderr, "bench_router curve: %s: %s\n", ep[i], err.msg);
            return 1;
        }
    const char *prompt = "The quick brown fox jumps over the lazy dog. The capital of France is";
    double *v[4];
    for (int i = 0; i < 4; i++) v[i] = calloc((size_t)n, sizeof *v[i]);
    kvm_result res;
    for (int k = 0; k < 20; k++) /* warm: connections, handshakes */
        for (int i = 0; i < 4; i++) {
            if (one(c[i], prompt, &res)) return 1;
            kvm_result_free(&res);
        }
    for (int k = 0; k < n; k++) /* alternating, so drift and load hit all four alike */
        for (int i = 0; i < 4; i++) {
            if (one(c[i], prompt, &res)) return 1;
            v[i][k] = res.client_total_ms;
            kvm_result_free(&res);
        }
    double p50[4], p99[4];
    for (int i = 0; i < 4; i++) {
        p50[i] = bench_pct(v[i], n, 0.5);
        p99[i] = bench_pct(v[i], n, 0.99);
        free(v[i]);
    }
    printf("  %d one-token requests to an instant worker, the four paths alternating:\n", n);
    printf("    %-26s %10s %10s %10s %10s\n", "", "p50 ms", "p99 ms", "CURVE p50", "CURVE p99");
    printf("    %-26s %10.3f %10.3f %10.3f %10.3f\n", "worker directly (1 hop)", p50[1], p99[1],
           p50[3], p99[3]);
    printf("    %-26s %10.3f %10.3f %10.3f %10.3f\n", "through the router (2 hops)", p50[0], p99[0],
           p50[2], p99[2]);
    printf("    CURVE adds, p50: %.3f ms directly, %.3f ms through the router\n", p50[3] - p50[1],
           p50[2] - p50[0]);
    /* throughput: rounds alternate between the plain and the CURVE router; the median round
     * of each (a loaded machine makes single rounds swing) */
    enum { ROUNDS = 9, DEPTH = 64 };
    double rps[2][ROUNDS];
    uint64_t next_id = 1u << 20;
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < 2; i++) {
            rps[i][r] = pipelined(c[2 * i], prompt, n / 2, DEPTH, &next_id);
            if (rps[i][r] <= 0) {
                fprintf(stderr, "bench_router curve: a pipelined round failed\n");
                return 1;
            }
        }
    double m0 = bench_pct(rps[0], ROUNDS, 0.5), m1 = bench_pct(rps[1], ROUNDS, 0.5);
    printf(
        "  throughput through the router, %d in flight, median of %d alternating rounds of %d:\n",
        DEPTH, ROUNDS, n / 2);
    printf("    plain %.0f req/s, CURVE %.0f req/s: CURVE costs %.1f%%\n", m0, m1,
           100.0 * (m0 - m1) / m0);
    for (int i = 0; i < 4; i++) kvm_close(c[i]);
    return 0;
}

/* ---------------------------------------------------------------- instant worker
 * Answers every `req` at once with one `tok` and a `done`, and every `admin` with an ok reply:
 * a worker that costs nothing, so that latency measured through the router is the router's. */

static int instant_worker(int argc, char **argv)
{
    const char *ep = bench_arg(argc, argv, "--listen", "tcp://127.0.0.1:7499");
    const char *keydir = bench_arg(argc, argv, "--keydir", NULL);
    void *ctx = km_zctx_create(), *s = NULL;
    km_errbuf err = {{0}};
    km_sec_args sa = {.keydir = keydir, .insecure = keydir == NULL};
    km_zsec *sec = NULL;
    km_zap *zap = NULL;
    if (km_sec_daemon_open(&sa, "bench_router instant", "instant", &sec, &err) ||
        km_zap_start(ctx, sec, NULL, &zap, &err) ||
        km_zsock_open(ctx, KM_ZROUTER, NULL, &s, &err) ||
        km_zsec_server(sec, s, KM_ROLE_MEMBER | KM_ROLE_OPERATOR, &err) ||
        km_zsock_bind(s, ep, &err)) {
        fprintf(stderr, "bench_router instant: %s\n", err.msg);
        return 1;
    }
    km_zmsg z = {0};
    km_buf out = {0};
    for (;;) {
        if (km_zrecv(s, &z, -1, NULL)) continue;
        const km_zframe *b = km_zmsg_body(&z);
        km_msg in, m;
        if (!b || km_msg_decode(b->data, b->len, NULL, &in, NULL)) continue;
        km_zframe parts[2] = {z.part[0], {NULL, 0}};
        if (in.type == KM_MSG_REQUEST) {
            km_msg_init(&m, KM_MSG_TOKEN);
            m.tok.id = in.req.id;
            m.tok.token = 42;
            m.tok.text = "x";
            km_msg_encode(&m, NULL, &out, NULL);
            parts[1] = (km_zframe){out.data, out.len};
            km_zsend(s, parts, 2, 0, NULL);
            km_msg_init(&m, KM_MSG_DONE);
            m.done.id = in.req.id;
            m.done.finish = KM_FINISH_LENGTH;
            m.done.prompt_tokens = in.req.n_tokens;
            m.done.completion_tokens = 1;
            km_msg_encode(&m, NULL, &out, NULL);
        } else if (in.type == KM_MSG_ADMIN) {
            km_msg_init(&m, KM_MSG_ADMIN_REPLY);
            m.admin_reply.id = in.admin.id;
            m.admin_reply.cmd = in.admin.cmd;
            m.admin_reply.ok = true;
            m.admin_reply.state = KM_STATE_READY;
            km_msg_encode(&m, NULL, &out, NULL);
        } else {
            km_msg_clear(&in);
            continue;
        }
        parts[1] = (km_zframe){out.data, out.len};
        km_zsend(s, parts, 2, 0, NULL);
        km_msg_clear(&in);
    }
}

/* ---------------------------------------------------------------- workload */

typedef struct job {
    int tenant;
    char *prompt;
    double t0, ttft;
    uint32_t prompt_tokens, cached;
    char worker[64];
    bool done;
} job;

static char *system_prompt(int tenant, int approx_tokens)
{
    static const char *words[] = {"orbit",  "valve",  "ledger",  "harbor", "cobalt",  "meadow",
                                  "signal", "quartz", "lantern", "ferry",  "granite", "velvet",
                                  "pixel",  "summit", "tundra",  "violet", "walnut",  "zephyr"};
    km_buf b = {0};
    km_buf_printf(&b, "You are the assistant of company number %d. Its handbook follows.", tenant);
    uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(tenant + 1);
    for (int i = 0; i < approx_tokens * 4 / 5; i++) { /* ~1.25 tokens a word */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        km_buf_printf(&b, " %s", words[(s >> 33) % (sizeof words / sizeof *words)]);
        if (i % 12 == 11) km_buf_printf(&b, ".");
    }
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

/* The ceiling of the hit ratio (each tenant's shared prefix computed once in the cluster: the
 * longest cached count any of its requests saw, in every other request of it) and the requests
 * each worker served, the most over the mean. */
static void workload_shares(const job *jobs, int n, int tenants, uint64_t pt, uint64_t ct,
                            int workers, const char *label)
{
    double can = 0;
    for (int t = 0; t < tenants; t++) {
        uint32_t shared = 0;
        int nt = 0;
        for (int i = 0; i < n; i++)
            if (jobs[i].tenant == t && jobs[i].prompt_tokens) {
                nt++;
                if (jobs[i].cached > shared) shared = jobs[i].cached;
            }
        if (nt > 1) can += (double)(nt - 1) * shared;
    }
    char names[RT_MAX_WORKERS][64];
    int served[RT_MAX_WORKERS] = {0}, nw = 0, most = 0, done = 0;
    for (int i = 0; i < n; i++) {
        if (!jobs[i].worker[0]) continue;
        int w = 0;
        while (w < nw && strcmp(names[w], jobs[i].worker)) w++;
        if (w == nw && nw < RT_MAX_WORKERS)
            snprintf(names[nw++], sizeof names[0], "%s", jobs[i].worker);
        if (w < nw) served[w]++;
        done++;
    }
    printf("%-12s ceiling %5.1f%%  hit/ceiling %5.1f%%  requests per worker", label,
           pt ? 100.0 * can / pt : 0, can > 0 ? 100.0 * (double)ct / can : 0);
    for (int w = 0; w < nw; w++) {
        printf(" %s:%d", names[w], served[w]);
        if (served[w] > most) most = served[w];
    }
    if (workers < nw) workers = nw; /* a worker that served nothing still counts in the mean */
    printf("  most/mean %.2f\n", workers && done ? most * (double)workers / done : 0);
}

static int workload(int argc, char **argv)
{
    const char *ep = bench_arg(argc, argv, "--router", "tcp://127.0.0.1:7000");
    int tenants = atoi(bench_arg(argc, argv, "--tenants", "16"));
    int per = atoi(bench_arg(argc, argv, "--per-tenant", "8"));
    int ptok = atoi(bench_arg(argc, argv, "--prefix-tokens", "1000"));
    int conc = atoi(bench_arg(argc, argv, "--concurrency", "8"));
    int max_tokens = atoi(bench_arg(argc, argv, "--max-tokens", "8"));
    const char *label = bench_arg(argc, argv, "--label", "");
    double skew = atof(bench_arg(argc, argv, "--skew", "0"));
    int n = atoi(bench_arg(argc, argv, "--requests", "0"));
    const char *trace_path = bench_arg(argc, argv, "--trace", "");
    if (tenants < 1 || tenants > 64) tenants = tenants < 1 ? 1 : 64;
    if (n <= 0) n = tenants * per;
    job *jobs = calloc((size_t)n, sizeof *jobs);
    char **sys = calloc((size_t)tenants, sizeof *sys);
    for (int t = 0; t < tenants; t++) sys[t] = system_prompt(t, ptok);
    /* each tenant's count: n x its share (1/(t+1)^skew over the sum), by largest remainder */
    int count[64] = {0}, k0 = 0;
    double wsum = 0, rem[64];
    for (int t = 0; t < tenants; t++) wsum += pow(t + 1, -skew);
    for (int t = 0; t < tenants; t++) {
        double want = n * pow(t + 1, -skew) / wsum;
        count[t] = (int)want;
        rem[t] = want - count[t];
        k0 += count[t];
    }
    for (; k0 < n; k0++) {
        int b = 0;
        for (int t = 1; t < tenants; t++)
            if (rem[t] > rem[b]) b = t;
        count[b]++;
        rem[b] = -1;
    }
    for (int t = 0, i = 0; t < tenants; t++)
        for (int c = 0; c < count[t]; c++) jobs[i++].tenant = t;
    /* a fixed, shuffled order: every routing mode sees the same sequence */
    uint64_t s = 42;
    for (int i = n - 1; i > 0; i--) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int j = (int)((s >> 33) % (uint64_t)(i + 1));
        int t = jobs[i].tenant;
        jobs[i].tenant = jobs[j].tenant;
        jobs[j].tenant = t;
    }
    kvm_client *c = NULL;
    km_errbuf err = {{0}};
    if (kvm_open(ep, NULL, &c, &err)) {
        fprintf(stderr, "bench_router: %s\n", err.msg);
        return 1;
    }
    char salts[64][32];
    for (int t = 0; t < tenants && t < 64; t++) snprintf(salts[t], sizeof salts[t], "tenant-%d", t);
    FILE *trace = trace_path[0] ? fopen(trace_path, "w") : NULL;
    int next = 0, inflight = 0, finished = 0, failed = 0;
    double t_start = now_ms();
    while (finished < n) {
        while (inflight < conc && next < n) {
            km_msg_request q;
            kvm_request_init(&q);
            km_buf b = {0}; /* built as it is sent: a long run holds only those in flight */
            km_buf_printf(&b, "%s\nQuestion %d: what does word %d of the handbook mean?\nAnswer:",
                          sys[jobs[next].tenant], next, next % 97);
            km_buf_append(&b, "", 1);
            jobs[next].prompt = (char *)b.data;
            q.id = (uint64_t)next + 1;
            q.prompt = jobs[next].prompt;
            q.temperature = 0;
            q.max_tokens = (uint32_t)max_tokens;
            q.stream = true;
            q.cache_salt = salts[jobs[next].tenant % 64];
            jobs[next].t0 = now_ms();
            if (kvm_submit(c, &q, &err)) {
                fprintf(stderr, "bench_router: %s\n", err.msg);
                return 1;
            }
            next++;
            inflight++;
        }
        km_msg m;
        if (kvm_next(c, 300000, &m, NULL, NULL, &err)) {
            fprintf(stderr, "bench_router: %s\n", err.msg);
            return 1;
        }
        uint64_t id = m.type == KM_MSG_TOKEN  ? m.tok.id
                      : m.type == KM_MSG_DONE ? m.done.id
                                              : m.error.id;
        if (id >= 1 && id <= (uint64_t)n) {
            job *j = &jobs[id - 1];
            if (m.type == KM_MSG_TOKEN && j->ttft == 0) j->ttft = now_ms() - j->t0;
            if (m.type == KM_MSG_DONE || m.type == KM_MSG_ERROR) {
                if (m.type == KM_MSG_DONE) {
                    j->prompt_tokens = m.done.prompt_tokens;
                    j->cached = m.done.cached_tokens;
                    snprintf(j->worker, sizeof j->worker, "%s", m.done.worker ? m.done.worker : "");
                    if (j->ttft == 0) j->ttft = now_ms() - j->t0;
                    if (trace) {
                        struct timespec ts;
                        clock_gettime(CLOCK_REALTIME, &ts);
                        fprintf(trace, "%.0f %u %u %s %.1f %d\n",
                                ts.tv_sec * 1e3 + ts.tv_nsec / 1e6, j->prompt_tokens, j->cached,
                                j->worker, j->ttft, j->tenant);
                        fflush(trace);
                    }
                } else {
                    failed++;
                    fprintf(stderr, "bench_router: request %llu: %d %s\n", (unsigned long long)id,
                            m.error.code, m.error.message);
                }
                j->done = true;
                free(j->prompt);
                j->prompt = NULL;
                finished++;
                inflight--;
            }
        }
        km_msg_clear(&m);
    }
    double wall = now_ms() - t_start;
    uint64_t pt = 0, ct = 0;
    double *tt = calloc((size_t)n, sizeof *tt);
    int k = 0;
    for (int i = 0; i < n; i++) {
        pt += jobs[i].prompt_tokens;
        ct += jobs[i].cached;
        if (jobs[i].prompt_tokens) tt[k++] = jobs[i].ttft;
    }
    /* tenants whose requests all went to one worker */
    int sticky = 0;
    for (int t = 0; t < tenants; t++) {
        const char *w = NULL;
        bool one = true;
        for (int i = 0; i < n; i++)
            if (jobs[i].tenant == t && jobs[i].worker[0]) {
                if (!w)
                    w = jobs[i].worker;
                else if (strcmp(w, jobs[i].worker))
                    one = false;
            }
        sticky += one;
    }
    printf("%-12s requests %d (failed %d)  prompt tokens %llu  hit ratio %5.1f%%  TTFT p50 %8.1f "
           "ms  p90 %8.1f ms  tenants on one worker %d/%d  wall %.1f s\n",
           label, n, failed, (unsigned long long)pt, pt ? 100.0 * ct / pt : 0,
           bench_pct(tt, k, 0.5), bench_pct(tt, k, 0.9), sticky, tenants, wall / 1e3);
    workload_shares(jobs, n, tenants, pt, ct, atoi(bench_arg(argc, argv, "--workers", "0")), label);
    if (trace) fclose(trace);
    for (int i = 0; i < n; i++) free(jobs[i].prompt);
    for (int t = 0; t < tenants; t++) free(sys[t]);
    free(sys);
    free(jobs);
    free(tt);
    kvm_close(c);
    return failed ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_router micro | latency [...] | workload [...]\n");
        return 2;
    }
    if (!strcmp(argv[1], "micro")) return micro();
    if (!strcmp(argv[1], "latency")) return latency(argc, argv);
    if (!strcmp(argv[1], "workload")) return workload(argc, argv);
    if (!strcmp(argv[1], "instant")) return instant_worker(argc, argv);
    if (!strcmp(argv[1], "curve")) return curve(argc, argv);
    fprintf(stderr, "bench_router: unknown mode %s\n", argv[1]);
    return 2;
}
