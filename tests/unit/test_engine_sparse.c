/*
 * test_engine_sparse.c — sparse decode attention in the engine (docs/sparse.md) with the real
 * model: positions whose context fits the budget get the dense engine's logits bit for bit; past
 * it they stay finite (their quality is bench/bench_long.sh's business); and a token gets the same
 * logits whether it is decoded alone (lane mode) or inside a prefill chunk (every token picks its
 * own pages), as perplexity assumes.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"

#define MODEL  "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define N      160
#define BUDGET 64

static en_model *g_model;

static void setup(void)
{
    if (access(MODEL, R_OK)) return;
    km_errbuf err = {{0}};
    cr_assert_eq(en_model_load(MODEL, &g_model, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    en_model_free(g_model);
    g_model = NULL;
}

/* Logits of every position of ids, n_chunk tokens per step: [N][n_vocab]. */
static float *run(int sparse, int n_chunk, const int32_t *ids)
{
    const int nv = en_model_hparams(g_model)->n_vocab;
    en_engine_opts o = {
        .n_threads = 2, .max_batch_tokens = N, .sparse_attn = sparse, .sparse_dense_layers = -1};
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(en_engine_kv(e), &q), 0);
    float *out = malloc(sizeof(float) * N * nv);
    int32_t pos[N];
    kv_seq *seqs[N];
    uint8_t want[N];
    for (int s = 0; s < N; s += n_chunk) {
        const int n = N - s < n_chunk ? N - s : n_chunk;
        for (int i = 0; i < n; i++) pos[i] = s + i, seqs[i] = q, want[i] = 1;
        en_batch b = {.n_tokens = n, .tokens = ids + s, .pos = pos, .seqs = seqs, .logits = want};
        const float *lg;
        cr_assert_eq(en_engine_step(e, &b, &lg), n);
        memcpy(out + (size_t)s * nv, lg, sizeof(float) * n * nv);
    }
    kv_seq_destroy(en_engine_kv(e), q);
    en_engine_destroy(e);
    return out;
}

Test(engine_sparse, fits_the_budget_dense_past_it_close_and_decode_equals_prefill, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const int nv = en_model_hparams(g_model)->n_vocab;
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 7919u + 13u) % 20000u) + 100;
    int changed = 0;
    float *dense = run(0, N, ids), *pre = run(BUDGET, N, ids), *dec = run(BUDGET, 1, ids);
    for (int t = 0; t < N; t++) {
        const float *d = dense + (size_t)t * nv, *p = pre + (size_t)t * nv,
                    *g = dec + (size_t)t * nv;
        if (t < BUDGET)
            cr_assert_arr_eq(p, d, sizeof(float) * nv, "position %d fits the budget", t);
        double diff = 0;
        for (int v = 0; v < nv; v++) {
            cr_assert(isfinite(p[v]));
            cr_assert_float_eq(g[v], p[v], 1e-3f, "position %d: decode and prefill agree", t);
            diff += fabs((double)p[v] - d[v]);
        }
        if (t >= BUDGET + 2 * 16) changed += diff > 0;
    }
    cr_assert_gt(changed, 0, "past the budget, attention left pages out");
    free(dense);
    free(pre);
    free(dec);
}
