/*
 * bench_blend_step.c — `make bench-blend-step`: what a prompt with reused chunks costs the
 * sequences already decoding (docs/blend.md "Serving"), in the scheduler, no sockets.
 *
 * Documents: a slice of ~2,400 bytes from the middle of six texts of /usr/share/common-licenses.
 * A first prompt carries them as chunks and is run to its end, its chunks stored; then a
 * sequence starts decoding (no drafts), and a second prompt with the six documents in another
 * order (all reused, the question its last chunk) is submitted. Until the second prompt's first
 * token: the steps taken, its TTFT, the decoder's tokens meanwhile and its longest wait between
 * two of them (wall), and the process CPU time of those steps and of the longest one (CPU time
 * is what the load of a shared machine moves least). Per --chunks value (the scheduler's
 * prefill_chunk, which sizes each blend piece), --repeat times; --budget-ms sets the scheduler's
 * step_budget_ms, which cuts the pieces further by their price. Nothing is asserted about time.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "engine/engine.h"

enum { N_DOCS = 6, DOC_IDS = 700, MAX_IDS = 6000 };

/* Tokens per request (user: 0 the decoder, 1 the prompts), and the decoder's longest gap. */
static int g_tok[2];
static uint64_t g_last_ns, g_gap_ns;
static int g_track;

static int on_token(void *ctx, void *user, int index, int32_t token)
{
    const int u = (int)(intptr_t)user;
    const uint64_t now = km_now_ns();
    if (!u && g_track && g_last_ns && now - g_last_ns > g_gap_ns) g_gap_ns = now - g_last_ns;
    if (!u) g_last_ns = now;
    g_tok[u]++;
    return 0;
}

static void on_done(void *ctx, void *user, km_finish f, const en_sched_usage *u) {}

static void on_error(void *ctx, void *user, int code, const char *msg, const en_sched_usage *u)
{
    fprintf(stderr, "request failed: %d %s\n", code, msg);
}

/* A slice from the middle of a text file, tokenized; 0 when it cannot be read. */
static int read_doc(const md_tokenizer *tok, const char *path, int32_t *out, int max)
{
    static char buf[1 << 18];
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    size_t off = n / 3, len = off + 2400 <= n ? 2400 : n - off;
    int k = md_tok_encode(tok, buf + off, len, 0, 0, out, max);
    return k < 0 ? 0 : k < max ? k : max;
}

static void submit(en_sched *s, const int32_t *ids, int n, int max_tokens, const en_blend_seg *seg,
                   int n_seg, int user)
{
    en_sched_req q = {.tokens = ids,
                      .n_tokens = n,
                      .max_tokens = max_tokens,
                      .ignore_eos = !user,
                      .speculate = EN_SPEC_OFF,
                      .chunks = seg,
                      .n_chunks = n_seg,
                      .user = (void *)(intptr_t)user};
    en_sample_params_default(&q.sample);
    q.sample.temperature = 0;
    if (en_sched_submit(s, &q, NULL)) fprintf(stderr, "submit refused\n"), exit(1);
}

/* One run at prefill_chunk `chunk`: the figures of the second prompt. */
static void run(const en_model *m, int threads, int chunk, int budget_ms, int32_t (*p)[MAX_IDS],
                const int *n, en_blend_seg (*seg)[N_DOCS + 1])
{
    km_errbuf err = {{0}};
    en_engine *e;
    en_engine_opts eo = {.n_threads = threads, .max_batch_tokens = 256};
    en_sched *s;
    en_sched_opts so = {.max_batch_tokens = 256,
                        .prefill_chunk = chunk,
                        .step_budget_ms = budget_ms,
                        .cluster_seed = 7};
    so.spec.cost_fixed = true;
    en_sched_cb cb = {.on_token = on_token, .on_done = on_done, .on_error = on_error};
    if (en_engine_create(m, &eo, &e, &err) || en_sched_create(e, m, &so, &cb, &s, &err))
        fprintf(stderr, "%s\n", err.msg), exit(1);
    memset(g_tok, 0, sizeof g_tok);
    g_track = 0, g_last_ns = 0, g_gap_ns = 0;
    submit(s, p[0], n[0], 1, seg[0], N_DOCS + 1, 1);
    while (en_sched_pending(s) || en_sched_chunks_waiting(s)) en_sched_step(s);
    int32_t dp[16];
    const char *count = "Count from one to a thousand:";
    int nd = md_tok_encode(en_model_tokenizer(m), count, strlen(count), 0, 1, dp, 16);
    submit(s, dp, nd, 4000, NULL, 0, 0);
    while (g_tok[0] < 3) en_sched_step(s);
    const int before = g_tok[1], d0 = g_tok[0];
    g_track = 1;
    const uint64_t t0 = km_now_ns();
    submit(s, p[1], n[1], 1, seg[1], N_DOCS + 1, 1);
    int steps = 0;
    double sum = 0, longest = 0;
    while (g_tok[1] == before) {
        const double c0 = bench_cpu_ms();
        en_sched_step(s);
        const double c = bench_cpu_ms() - c0;
        sum += c, longest = c > longest ? c : longest, steps++;
    }
    const double ttft = (km_now_ns() - t0) / 1e6;
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    printf("%5d %9llu %6d %9.0f %9d %12.0f %10.0f %12.0f %6.2f\n", chunk,
           (unsigned long long)st.chunk_tokens, steps, ttft, g_tok[0] - d0, g_gap_ns / 1e6, sum,
           longest, bench_load1());
    en_sched_destroy(s);
    en_engine_destroy(e);
}

int main(int argc, char **argv)
{
    const char *model = bench_arg(argc, argv, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    const int threads = atoi(bench_arg(argc, argv, "--threads", "1"));
    const int repeat = atoi(bench_arg(argc, argv, "--repeat", "2"));
    char chunks[128];
    snprintf(chunks, sizeof chunks, "%s", bench_arg(argc, argv, "--chunks", "256,64,32"));
    const int budget_ms = atoi(bench_arg(argc, argv, "--budget-ms", "0"));
    bench_args_end(argc, argv, "bench_blend_step", 1);
    en_model *m;
    km_errbuf err = {{0}};
    if (en_model_load(model, &m, &err)) return fprintf(stderr, "%s\n", err.msg), 1;
    const md_tokenizer *tok = en_model_tokenizer(m);
    static const char *const files[N_DOCS] = {"GPL-3",    "Apache-2.0", "MPL-2.0",
                                              "GFDL-1.3", "LGPL-2.1",   "Artistic"};
    static int32_t d[N_DOCS][DOC_IDS], p[2][MAX_IDS];
    int nd[N_DOCS], n[2];
    for (int i = 0; i < N_DOCS; i++) {
        char path[128];
        snprintf(path, sizeof path, "/usr/share/common-licenses/%s", files[i]);
        if (!(nd[i] = read_doc(tok, path, d[i], DOC_IDS)))
            return fprintf(stderr, "cannot read %s\n", path), 1;
    }
    static const int order[2][N_DOCS] = {{0, 1, 2, 3, 4, 5}, {3, 0, 5, 1, 4, 2}};
    static const char *const lead[2] = {"Read the documents below and answer.",
                                        "Here are six texts; a question follows."};
    const char *question = " Question: which of these texts speaks of patents? Answer:";
    en_blend_seg seg[2][N_DOCS + 1];
    for (int k = 0; k < 2; k++) {
        n[k] = md_tok_encode(tok, lead[k], strlen(lead[k]), 0, 1, p[k], 64);
        for (int i = 0; i < N_DOCS; i++) {
            const int j = order[k][i];
            memcpy(p[k] + n[k], d[j], sizeof(int32_t) * nd[j]);
            seg[k][i] = (en_blend_seg){n[k], nd[j]};
            n[k] += nd[j];
        }
        const int nq = md_tok_encode(tok, question, strlen(question), 0, 0, p[k] + n[k], 64);
        seg[k][N_DOCS] = (en_blend_seg){n[k], nq};
        n[k] += nq;
    }
    printf("a prompt of %d tokens, %d documents reused, while a sequence decodes; %d thread(s), "
           "step budget %d ms\n",
           n[1], N_DOCS, threads, budget_ms);
    printf(
        "chunk    reused  steps   TTFT_ms  decoded  max_gap_ms  cpu_ms_sum  cpu_ms_step  load1\n");
    for (int r = 0; r < repeat; r++)
        for (char *c = chunks, *next; c && *c; c = next) {
            next = strchr(c, ',');
            if (next) *next++ = 0;
            run(m, threads, atoi(c), budget_ms, p, n, seg);
            if (next) next[-1] = ',';
        }
    en_model_free(m);
    return 0;
}
