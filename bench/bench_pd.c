/*
 * bench_pd.c — the mixed workload of `make bench-pd` (issue 32 point 4) against one router:
 *
 *   bench_pd --router tcp://127.0.0.1:P [--seconds 40] [--streams 4] [--stream-tokens 48]
 *            [--long-every-ms 6000] [--long-min 2000] [--long-max 4000] [--long-tokens 8]
 *            [--seed 1] [--label NAME]
 *
 * - streams: --streams clients in a closed loop, each sending short chat prompts (about 30
 *   tokens, each request its own) for --stream-tokens greedy tokens, streamed, without speculative
 *   drafts (so every token is a decode step of its own);
 * - long prompts: one every --long-every-ms, each a fresh prompt of between --long-min and
 *   --long-max token ids (its first ids are the request's number, so no two share a page and
 *   nothing is cached), for --long-tokens tokens, each in a thread of its own (open loop).
 *
 * Measured over the --seconds window as the client sees it: the inter-token gaps of the stream
 * requests (ITL p50/p99: the time between one token and the next of one request), the TTFT of
 * short and of long requests (sent -> first token; p50/p90), and the generated tokens of every
 * request received inside the window per second. Once the window ends the streams stop and the
 * long prompts still running are waited for (each has a deadline), so every TTFT is counted.
 * Prints one `result` line; the script (bench_pd.sh) adds the cluster's own counters.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "client/kvmesh.h"

#define BP_MAX_LONG 256
#define BP_TIMEOUT  300000 /* a request's longest silence */

typedef struct bp_vec {
    double *v;
    size_t n, cap;
} bp_vec;

static void bp_push(bp_vec *x, double d)
{
    if (x->n == x->cap) {
        size_t cap = x->cap ? 2 * x->cap : 1024;
        double *nv = realloc(x->v, cap * sizeof *nv);
        if (!nv) return;
        x->v = nv, x->cap = cap;
    }
    x->v[x->n++] = d;
}

typedef struct bp_run {
    const char *router;
    int seconds, streams, stream_tokens, long_every_ms, long_min, long_max, long_tokens, seed;
    uint64_t t0, t_end; /* the window, wall ms */
    atomic_bool stop;
    atomic_long tokens_in_window;
    pthread_mutex_t mu;
    bp_vec itl, ttft_short, ttft_long;
    int short_done, short_failed, long_sent, long_done, long_failed;
    char first_error[200];
} bp_run;

/* One request as its client sees it. */
typedef struct bp_req {
    bp_run *run;
    uint64_t t_sent_us, t_last_us;
    double ttft_ms;
    bool is_short, first;
    bp_vec gaps;
} bp_req;

static uint64_t bp_now_us(void)
{
    return km_now_ns() / 1000;
}

static int bp_on_token(void *user, uint32_t index, int32_t token, const char *text, size_t len)
{
    bp_req *q = user;
    uint64_t t = bp_now_us();
    if (!q->first) {
        q->first = true;
        q->ttft_ms = (double)(t - q->t_sent_us) / 1e3;
    } else if (q->is_short && km_wall_ms() < q->run->t_end) {
        bp_push(&q->gaps, (double)(t - q->t_last_us) / 1e3);
    }
    q->t_last_us = t;
    if (km_wall_ms() < q->run->t_end) atomic_fetch_add(&q->run->tokens_in_window, 1);
    return 0;
}

/* Sends one request on c and files its figures; false when it failed. */
static bool bp_send(bp_run *run, kvm_client *c, km_msg_request *m, bool is_short)
{
    bp_req q = {.run = run, .is_short = is_short, .t_sent_us = bp_now_us()};
    kvm_result res;
    km_errbuf err = {{0}};
    int rc = kvm_generate(c, m, bp_on_token, &q, &res, &err);
    bool ok = !rc && !res.error_code && q.first;
    pthread_mutex_lock(&run->mu);
    if (ok) {
        /* a request sent inside the window counts whole; its gaps were taken inside it */
        bp_push(is_short ? &run->ttft_short : &run->ttft_long, q.ttft_ms);
        for (size_t i = 0; i < q.gaps.n; i++) bp_push(&run->itl, q.gaps.v[i]);
        *(is_short ? &run->short_done : &run->long_done) += 1;
    } else {
        *(is_short ? &run->short_failed : &run->long_failed) += 1;
        if (!run->first_error[0])
            snprintf(run->first_error, sizeof run->first_error,
                     "rc %d, code %d, %u tokens, finish %d: %.80s %.80s", rc, res.error_code,
                     res.n_tokens, (int)res.finish, res.error, err.msg);
    }
    pthread_mutex_unlock(&run->mu);
    free(q.gaps.v);
    kvm_result_free(&res);
    return ok;
}

static kvm_client *bp_open(bp_run *run)
{
    kvm_client *c = NULL;
    kvm_opts o = {.timeout_ms = BP_TIMEOUT};
    return kvm_open(run->router, &o, &c, NULL) ? NULL : c;
}

typedef struct bp_stream {
    bp_run *run;
    int index;
    pthread_t th;
} bp_stream;

static void *bp_stream_main(void *arg)
{
    bp_stream *s = arg;
    bp_run *run = s->run;
    kvm_client *c = bp_open(run);
    static const char *const topics[] = {
        "the sea",         "a lighthouse", "winter bread", "old maps",    "a red kite",
        "the night train", "bees",         "a quiet town", "copper pans", "rain in May"};
    for (int n = 0; c && !atomic_load(&run->stop); n++) {
        char prompt[256];
        snprintf(prompt, sizeof prompt,
                 "<|im_start|>user\nStream %d, request %d. Tell me a short story about %s and "
                 "%s.<|im_end|>\n<|im_start|>assistant\n",
                 s->index, n, topics[(n + s->index) % 10], topics[(3 * n + s->index + 1) % 10]);
        km_msg_request m;
        kvm_request_init(&m);
        m.prompt = prompt;
        m.temperature = 0;
        m.max_tokens = (uint32_t)run->stream_tokens;
        m.stream = true;
        m.speculate = KM_SPECULATE_OFF;
        if (!bp_send(run, c, &m, true)) km_sleep_ms(100);
    }
    kvm_close(c);
    return NULL;
}

typedef struct bp_long {
    bp_run *run;
    int index, n_tokens;
    pthread_t th;
} bp_long;

static void *bp_long_main(void *arg)
{
    bp_long *l = arg;
    kvm_client *c = bp_open(l->run);
    int32_t *toks = malloc(sizeof *toks * (size_t)l->n_tokens);
    if (c && toks) {
        uint32_t x = 2654435761u * (uint32_t)(l->index + 1) + (uint32_t)l->run->seed * 40503u;
        toks[0] = 1000 + l->index; /* the first page is this request's own */
        for (int i = 1; i < l->n_tokens; i++) {
            x = x * 1664525u + 1013904223u;
            toks[i] = 300 + (int32_t)((x >> 8) % 30000);
        }
        km_msg_request m;
        kvm_request_init(&m);
        m.tokens = toks;
        m.n_tokens = (uint32_t)l->n_tokens;
        m.temperature = 0;
        m.max_tokens = (uint32_t)l->run->long_tokens;
        m.stream = true;
        m.speculate = KM_SPECULATE_OFF;
        bp_send(l->run, c, &m, false);
    } else {
        pthread_mutex_lock(&l->run->mu);
        l->run->long_failed++;
        pthread_mutex_unlock(&l->run->mu);
    }
    free(toks);
    kvm_close(c);
    return NULL;
}

int main(int argc, char **argv)
{
    static bp_run run;
    run.router = bench_arg(argc, argv, "--router", NULL);
    run.seconds = atoi(bench_arg(argc, argv, "--seconds", "40"));
    run.streams = atoi(bench_arg(argc, argv, "--streams", "4"));
    run.stream_tokens = atoi(bench_arg(argc, argv, "--stream-tokens", "48"));
    run.long_every_ms = atoi(bench_arg(argc, argv, "--long-every-ms", "6000"));
    run.long_min = atoi(bench_arg(argc, argv, "--long-min", "2000"));
    run.long_max = atoi(bench_arg(argc, argv, "--long-max", "4000"));
    run.long_tokens = atoi(bench_arg(argc, argv, "--long-tokens", "8"));
    run.seed = atoi(bench_arg(argc, argv, "--seed", "1"));
    const char *label = bench_arg(argc, argv, "--label", "run");
    bench_args_end(argc, argv, "bench_pd", 1);
    if (!run.router) {
        fprintf(stderr, "bench_pd: --router tcp://HOST:PORT is required\n");
        return 2;
    }
    if (run.streams < 0 || run.streams > 64 || run.long_every_ms <= 0 || run.seconds <= 0 ||
        run.long_min < 1 || run.long_max < run.long_min) {
        fprintf(stderr, "bench_pd: bad arguments\n");
        return 2;
    }
    pthread_mutex_init(&run.mu, NULL);
    run.t0 = km_wall_ms();
    run.t_end = run.t0 + (uint64_t)run.seconds * 1000;
    bp_stream st[64];
    for (int i = 0; i < run.streams; i++) {
        st[i] = (bp_stream){.run = &run, .index = i};
        pthread_create(&st[i].th, NULL, bp_stream_main, &st[i]);
    }
    static bp_long lg[BP_MAX_LONG];
    int n_long = 0;
    /* the first long prompt after one period, so the streams are running when it comes */
    for (uint64_t next = run.t0 + (uint64_t)run.long_every_ms;
         next < run.t_end && n_long < BP_MAX_LONG; next += (uint64_t)run.long_every_ms) {
        while (km_wall_ms() < next) km_sleep_ms(5);
        int span = run.long_max - run.long_min + 1;
        lg[n_long] = (bp_long){.run = &run,
                               .index = run.seed * 1000 + n_long,
                               .n_tokens = run.long_min + (n_long * 7919 + run.seed * 31) % span};
        pthread_create(&lg[n_long].th, NULL, bp_long_main, &lg[n_long]);
        n_long++;
    }
    while (km_wall_ms() < run.t_end) km_sleep_ms(20);
    atomic_store(&run.stop, true);
    for (int i = 0; i < run.streams; i++) pthread_join(st[i].th, NULL);
    for (int i = 0; i < n_long; i++) pthread_join(lg[i].th, NULL);
    run.long_sent = n_long;
    double tok_s = (double)atomic_load(&run.tokens_in_window) / run.seconds;
    printf("result label=%s streams=%d itl_n=%zu itl_p50=%.1f itl_p99=%.1f itl_max=%.1f "
           "ttft_short_p50=%.0f ttft_short_p90=%.0f ttft_long_p50=%.0f ttft_long_p90=%.0f "
           "tok_s=%.1f short_done=%d short_failed=%d long_sent=%d long_done=%d long_failed=%d "
           "load1=%.2f\n",
           label, run.streams, run.itl.n, bench_pct(run.itl.v, run.itl.n, 0.5),
           bench_pct(run.itl.v, run.itl.n, 0.99), bench_pct(run.itl.v, run.itl.n, 1.0),
           bench_pct(run.ttft_short.v, run.ttft_short.n, 0.5),
           bench_pct(run.ttft_short.v, run.ttft_short.n, 0.9),
           bench_pct(run.ttft_long.v, run.ttft_long.n, 0.5),
           bench_pct(run.ttft_long.v, run.ttft_long.n, 0.9), tok_s, run.short_done,
           run.short_failed, run.long_sent, run.long_done, run.long_failed, bench_load1());
    if (run.first_error[0]) printf("first_error %s\n", run.first_error);
    free(run.itl.v);
    free(run.ttft_short.v);
    free(run.ttft_long.v);
    return run.short_failed || run.long_failed ? 1 : 0;
}
