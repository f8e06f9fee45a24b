/*
 * test_engine_moe.c — the engine on Mixtral-layout MoE models (docs/moe.md).
 *
 * The models come from `make moe-model` (called by `make deps`), made from the default dense
 * model by scripts/moe_from_dense.py, the Q4_1 blocks as they are:
 *  - MoE1-top1 (the whole FFN as one expert): must compute the dense model bit for bit, through
 *    the router, the grouping of tokens per expert and the weighted sum;
 *  - MoE8-top8 (8 experts of 192 neurons, all used, uniform router, down projections scaled by 8
 *    on their f16 block scales): the dense FFN up to the order of the down projection's float
 *    sums; held to test_engine's rule for llama.cpp (no top-1 miss where the dense model leads by
 *    >= NEAR_TIE logits), the rates logged;
 *  - MoE8-top4 (router from the experts' gate rows): a sparse MoE; the engine's batch invariance
 *    (one step = token by token, bit for bit) with tokens grouped per expert;
 *  - Qwen2MoE8-top8 (qwen2moe: a shared expert of 512 neurons gated by sigmoid(~0) = 1/2, 8
 *    routed experts of 128 all used with unrenormalized weights 1/8, NeoX rope on permuted q/k
 *    rows): the dense model up to float summation order, held like MoE8-top8;
 *  - GraniteMoE8-top8 (granitemoe: MoE8-top8 with Granite's four multipliers compensated on the
 *    block scales by powers of two): MoE8-top8's logits bit for bit;
 *  - MoE8-top4-mirror and Qwen2MoE8-top4-mirror (top 4 of 8 over 4 slices of the FFN written
 *    twice, router rows +r/-r: each token runs one copy of every slice, which one following the
 *    text, weighted by the softmax of |r . x|, so a copy flipped by rounding changes nothing):
 *    sparse routing, renormalized weights (llama) and not (qwen2moe) where they change the
 *    output;
 *  - each against llama.cpp running the same file (greedy_<model>.txt fixtures, made by
 *    tests/fixtures/llamacpp/gen_moe_llamacpp.sh), with test_engine's rule.
 * Prompts: the dense model's llama.cpp fixture. Without the model files these tests skip.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/worker.h"

#define DENSE    "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define TOP1     "models/SmolLM2-135M-Instruct-MoE1-top1.Q4_1.gguf"
#define TOP8     "models/SmolLM2-135M-Instruct-MoE8-top8.Q4_1.gguf"
#define TOP4     "models/SmolLM2-135M-Instruct-MoE8-top4.Q4_1.gguf"
#define QWEN     "models/SmolLM2-135M-Instruct-Qwen2MoE8-top8.Q4_1.gguf"
#define GRANITE  "models/SmolLM2-135M-Instruct-GraniteMoE8-top8.Q4_1.gguf"
#define FIX_QWEN "tests/fixtures/llamacpp/greedy_Qwen2MoE8-top8.txt"
#define FIX_GRAN "tests/fixtures/llamacpp/greedy_GraniteMoE8-top8.txt"
#define OLMOE    "models/SmolLM2-135M-Instruct-OLMoE8-top8.Q4_1.gguf"
#define FIX_OLMO "tests/fixtures/llamacpp/greedy_OLMoE8-top8.txt"
#define MIRROR   "models/SmolLM2-135M-Instruct-MoE8-top4-mirror.Q4_1.gguf"
#define FIX_MIRR "tests/fixtures/llamacpp/greedy_MoE8-top4-mirror.txt"
#define QMIRROR  "models/SmolLM2-135M-Instruct-Qwen2MoE8-top4-mirror.Q4_1.gguf"
#define FIX_QMIR "tests/fixtures/llamacpp/greedy_Qwen2MoE8-top4-mirror.txt"
#define PROMPTS  "tests/fixtures/llamacpp/greedy_smollm2.txt" /* the dense model's fixture */
#define NEAR_TIE 0.5f /* as test_engine.c: llama.cpp's own configurations disagree below it */
#define MAX_REC  16
/* Under the sanitizers the engine is an order of magnitude slower: fewer prompts there. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define N_PROMPTS 3
#else
#define N_PROMPTS 10
#endif
#define MAXP 512

typedef struct mrec {
    int n_prompt, n_gen;
    int32_t ids[1024]; /* prompt then llama.cpp's greedy tokens */
    float margins[128];
} mrec;

typedef struct eng {
    en_model *m;
    en_engine *e;
} eng;

static mrec g_rec[MAX_REC];
static int g_n_rec;

static int ints_at(const char *s, int32_t *out, int max)
{
    int n = 0;
    while (*s && *s != '\t' && *s != '\n' && n < max) {
        out[n++] = (int32_t)strtol(s, (char **)&s, 10);
        if (*s == ',') s++;
    }
    return n;
}

static void read_fixture(const char *path)
{
    g_n_rec = 0;
    FILE *f = fopen(path, "r");
    cr_assert(f, "fixture %s missing", path);
    static char line[1 << 16];
    while (fgets(line, sizeof line, f) && g_n_rec < MAX_REC) {
        if (strncmp(line, "idx=", 4)) continue;
        mrec *r = &g_rec[g_n_rec++];
        const char *pi = strstr(line, "prompt_ids="), *gi = strstr(line, "gen_ids=");
        const char *mg = strstr(line, "margins=");
        cr_assert(pi && gi && mg, "bad fixture line");
        r->n_prompt = ints_at(pi + 11, r->ids, 900);
        r->n_gen = ints_at(gi + 8, r->ids + r->n_prompt, 128);
        const char *s = mg + 8;
        for (int i = 0; i < r->n_gen; i++) {
            r->margins[i] = strtof(s, (char **)&s);
            if (*s == ',') s++;
        }
    }
    fclose(f);
    cr_assert_geq(g_n_rec, 10, "fixture has %d records", g_n_rec);
    g_n_rec = N_PROMPTS;
}

/* Loads path (which must exist: NEED it first), failing the test with the loader's message. */
static en_model *load_model(const char *path)
{
    km_errbuf err = {{0}};
    en_model *m = NULL;
    cr_assert_eq(en_model_load(path, &m, &err), 0, "%s: %s", path, err.msg);
    return m;
}

static int open_eng(const char *path, eng *out)
{
    memset(out, 0, sizeof *out);
    if (access(path, R_OK)) return 0;
    km_errbuf err = {{0}};
    out->m = load_model(path);
    en_engine_opts o = {.n_threads = 2, .max_batch_tokens = MAXP};
    cr_assert_eq(en_engine_create(out->m, &o, &out->e, &err), 0, "%s: %s", path, err.msg);
    return 1;
}

static void close_eng(eng *x)
{
    en_engine_destroy(x->e);
    en_model_free(x->m);
    memset(x, 0, sizeof *x);
}

#define NEED(path)                                                                                 \
    do {                                                                                           \
        if (access(path, R_OK)) cr_skip_test("model %s absent: run `make moe-model`", path);       \
    } while (0)

/* Runs ids[0..n) (n <= MAXP) of a fresh sequence in one step; logits of positions >= from into
 * out[(i - from) * n_vocab], each token's dominant expert into route (may be NULL); returns the
 * number of rows. */
static int run_prompt(eng *x, const int32_t *ids, int n, int from, float *out, int16_t *route)
{
    kv_store *kv = en_engine_kv(x->e);
    kv_seq *seq;
    cr_assert_eq(kv_seq_create(kv, &seq), 0);
    int32_t pos[MAXP];
    kv_seq *seqs[MAXP];
    uint8_t want[MAXP];
    cr_assert_leq(n, MAXP);
    for (int i = 0; i < n; i++) pos[i] = i, seqs[i] = seq, want[i] = i >= from;
    en_batch b = {
        .n_tokens = n, .tokens = ids, .pos = pos, .seqs = seqs, .logits = want, .route = route};
    const float *lg;
    const int rows = en_engine_step(x->e, &b, &lg);
    cr_assert_eq(rows, n - from, "step: %d", rows);
    memcpy(out, lg, sizeof(float) * rows * en_model_hparams(x->m)->n_vocab);
    kv_seq_destroy(kv, seq);
    return rows;
}

/* Greedy: the prompt in one step, then n tokens one step each; the prompt's last logits in
 * first (may be NULL). */
static void greedy_run(eng *x, const int32_t *prompt, int n_prompt, int n, int32_t *out,
                       float *first)
{
    kv_store *kv = en_engine_kv(x->e);
    const int n_vocab = en_model_hparams(x->m)->n_vocab;
    kv_seq *seq;
    cr_assert_eq(kv_seq_create(kv, &seq), 0);
    int32_t pos[MAXP];
    kv_seq *seqs[MAXP];
    for (int i = 0; i < n_prompt; i++) pos[i] = i, seqs[i] = seq;
    en_batch b = {.n_tokens = n_prompt, .tokens = prompt, .pos = pos, .seqs = seqs};
    const float *lg;
    cr_assert_eq(en_engine_step(x->e, &b, &lg), 1);
    if (first) memcpy(first, lg, sizeof(float) * n_vocab);
    for (int g = 0; g < n; g++) {
        out[g] = en_argmax(lg, n_vocab);
        int32_t p = n_prompt + g;
        en_batch d = {.n_tokens = 1, .tokens = &out[g], .pos = &p, .seqs = &seq};
        cr_assert_eq(en_engine_step(x->e, &d, &lg), 1);
    }
    kv_seq_destroy(kv, seq);
}

Test(moe, the_gguf_declares_its_experts)
{
    NEED(TOP4);
    NEED(DENSE);
    km_errbuf err = {{0}};
    en_model *m, *d;
    cr_assert_eq(en_model_load(TOP4, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(en_model_load(DENSE, &d, &err), 0, "%s", err.msg);
    const en_hparams *hm = en_model_hparams(m), *hd = en_model_hparams(d);
    cr_expect_eq(hm->n_expert, 8);
    cr_expect_eq(hm->n_expert_used, 4);
    cr_expect_eq(hm->n_ff * hm->n_expert, hd->n_ff, "expert width %d x %d, dense %d", hm->n_ff,
                 hm->n_expert, hd->n_ff);
    cr_expect_eq(hd->n_expert, 0);
    cr_expect_eq(hd->n_expert_used, 0);
    en_model_free(m);
    en_model_free(d);
}

/* The dense model's greedy tokens (G after each prompt) and the margin of each (top-1 minus top-2
 * logit); the prompt's last logits in first. */
enum { G = 32 };
static float margin_of(const float *lg, int n_vocab)
{
    float a = -INFINITY, b = -INFINITY;
    for (int v = 0; v < n_vocab; v++)
        if (lg[v] > a)
            b = a, a = lg[v];
        else if (lg[v] > b)
            b = lg[v];
    return a - b;
}

/* The dense model and a MoE one, the dense fixture's prompts; returns n_vocab. */
static int open_pair(const char *moe, eng *d, eng *x)
{
    NEED(moe);
    NEED(DENSE);
    read_fixture(PROMPTS);
    open_eng(DENSE, d);
    open_eng(moe, x);
    return en_model_hparams(d->m)->n_vocab;
}

/* Two models that must compute the same bits: the logits after each fixture prompt and G greedy
 * tokens after it; closes both. */
static void expect_bit_identical(eng *d, eng *x)
{
    const int n_vocab = en_model_hparams(d->m)->n_vocab;
    float *ld = malloc(sizeof(float) * n_vocab), *lx = malloc(sizeof(float) * n_vocab);
    cr_assert(ld && lx);
    for (int r = 0; r < g_n_rec; r++) {
        int32_t td[G], tx[G];
        const int np = g_rec[r].n_prompt < MAXP - G ? g_rec[r].n_prompt : MAXP - G;
        greedy_run(d, g_rec[r].ids, np, G, td, ld);
        greedy_run(x, g_rec[r].ids, np, G, tx, lx);
        cr_expect_arr_eq(ld, lx, sizeof(float) * n_vocab, "prompt %d: logits differ", r);
        cr_expect_arr_eq(td, tx, sizeof td, "prompt %d: greedy tokens differ", r);
    }
    free(ld);
    free(lx);
    close_eng(d);
    close_eng(x);
}

Test(moe, one_expert_computes_the_dense_model_bit_for_bit, .timeout = 900)
{
    eng d, x;
    open_pair(TOP1, &d, &x);
    expect_bit_identical(&d, &x);
}

/* A MoE model that computes the dense FFN up to float summation order, against the dense model
 * on the same tokens: teacher-forced (no top-1 miss where the dense model leads by >= NEAR_TIE)
 * and free-running greedy (logged). */
static void agrees_with_the_dense_model(const char *moe)
{
    eng d, x;
    const int n_vocab = open_pair(moe, &d, &x);
    float *lg = malloc(sizeof(float) * (G + 1) * n_vocab), *ld = malloc(sizeof(float) * n_vocab);
    cr_assert(lg && ld);
    int agree = 0, total = 0, hard_miss = 0, same = 0;
    double worst = 0;
    for (int r = 0; r < g_n_rec; r++) {
        mrec *c = &g_rec[r];
        const int np = c->n_prompt < MAXP - G ? c->n_prompt : MAXP - G;
        int32_t td[G], tx[G];
        /* the dense model's greedy run, with its margins (teacher-forced, one step) */
        greedy_run(&d, c->ids, np, G, td, ld);
        memcpy(c->ids + np, td, sizeof td);
        int16_t route[MAXP];
        run_prompt(&d, c->ids, np + G - 1, np - 1, lg, route);
        cr_assert_eq(route[0], -1, "a dense model routes nothing");
        for (int g = 0; g < G; g++) c->margins[g] = margin_of(lg + (size_t)g * n_vocab, n_vocab);
        /* the MoE model on the same tokens */
        run_prompt(&x, c->ids, np + G - 1, np - 1, lg, NULL);
        for (int v = 0; v < n_vocab; v++) {
            const double diff = fabs((double)ld[v] - lg[v]);
            if (diff > worst) worst = diff;
        }
        for (int g = 0; g < G; g++) {
            total++;
            if (en_argmax(lg + (size_t)g * n_vocab, n_vocab) == td[g])
                agree++;
            else if (c->margins[g] >= NEAR_TIE)
                hard_miss++;
        }
        greedy_run(&x, c->ids, np, G, tx, NULL);
        same += !memcmp(td, tx, sizeof td);
    }
    cr_log_info("%s vs dense: teacher-forced top-1 agreement %d/%d = %.2f%%; free-running greedy "
                "identical for %d tokens on %d of %d prompts; largest logit difference after a "
                "prompt %.3g",
                moe, agree, total, 100.0 * agree / total, G, same, g_n_rec, worst);
    /* Only the order of the down projection's float sums differs (8 partial sums of 192 neurons);
     * activations are quantized to 8 bits before every product, so a last-bit difference can move
     * a value by one quantization step and grow from there: test_engine's rule for llama.cpp. */
    cr_expect_eq(hard_miss, 0, "%d misses where the dense model leads by >= %.1f", hard_miss,
                 NEAR_TIE);
    free(lg);
    free(ld);
    close_eng(&d);
    close_eng(&x);
}

Test(moe, eight_experts_all_used_agree_with_the_dense_model, .timeout = 900)
{
    agrees_with_the_dense_model(TOP8);
}

Test(moe, qwen2moe_with_a_shared_expert_agrees_with_the_dense_model, .timeout = 900)
{
    NEED(QWEN);
    en_model *m = load_model(QWEN);
    const en_hparams *hp = en_model_hparams(m);
    cr_expect_str_eq(hp->arch, "qwen2moe");
    cr_expect_eq(hp->n_expert, 8);
    cr_expect_eq(hp->n_expert_used, 8);
    cr_expect_eq(hp->n_ff, 128, "expert width from expert_feed_forward_length: %d", hp->n_ff);
    cr_expect_eq(hp->n_ff_shexp, 512);
    cr_expect_eq(hp->moe_norm_w, 0, "qwen2moe keeps the softmax weights as they are");
    cr_expect_eq(hp->rope_neox, 1);
    en_model_free(m);
    agrees_with_the_dense_model(QWEN);
}

Test(moe, granitemoe_multipliers_cancel_bit_for_bit, .timeout = 900)
{
    NEED(GRANITE);
    NEED(TOP8);
    read_fixture(PROMPTS);
    eng g, x;
    open_eng(TOP8, &x);
    open_eng(GRANITE, &g);
    const en_hparams *hp = en_model_hparams(g.m);
    cr_expect_str_eq(hp->arch, "granitemoe");
    cr_expect_eq(hp->f_embedding_scale, 0.5f);
    cr_expect_eq(hp->f_residual_scale, 0.25f);
    cr_expect_eq(hp->f_attention_scale, 0.0625f);
    cr_expect_eq(hp->f_logit_scale, 2.0f);
    cr_expect_eq(hp->moe_norm_w, 1);
    cr_expect_eq(hp->rope_neox, 0);
    expect_bit_identical(&x, &g);
}

/* The engine on a model of another architecture against llama.cpp on the same file: its greedy
 * fixture's tokens teacher-forced, test_engine's rule (no miss where llama.cpp led by >= NEAR_TIE,
 * agreement at least test_engine's floor). With dominant != NULL, dominant[e] counts the tokens
 * whose dominant routed expert is e ([EN_MAX_EXPERTS], zeroed here). */
static void agrees_with_llamacpp_routes(const char *path, const char *fixture, int *dominant)
{
    NEED(path);
    if (access(fixture, R_OK))
        cr_skip_test("fixture %s absent: tests/fixtures/llamacpp/gen_moe_llamacpp.sh", fixture);
    read_fixture(fixture);
    eng x;
    open_eng(path, &x);
    const int n_vocab = en_model_hparams(x.m)->n_vocab;
    int agree = 0, total = 0, hard_miss = 0;
    float *lg = malloc(sizeof(float) * 128 * n_vocab);
    cr_assert(lg);
    if (dominant) memset(dominant, 0, sizeof(int) * EN_MAX_EXPERTS);
    for (int r = 0; r < g_n_rec; r++) {
        const mrec *c = &g_rec[r];
        const int ng = c->n_prompt + c->n_gen - 1 <= MAXP ? c->n_gen : MAXP + 1 - c->n_prompt;
        cr_assert_gt(ng, 0);
        int16_t route[MAXP];
        run_prompt(&x, c->ids, c->n_prompt + ng - 1, c->n_prompt - 1, lg, route);
        for (int i = 0; dominant && i < c->n_prompt + ng - 1; i++) {
            cr_assert(route[i] >= 0 && route[i] < EN_MAX_EXPERTS, "route %d", route[i]);
            dominant[route[i]]++;
        }
        for (int j = 0; j < ng; j++) {
            total++;
            if (en_argmax(lg + (size_t)j * n_vocab, n_vocab) == c->ids[c->n_prompt + j])
                agree++;
            else if (c->margins[j] >= NEAR_TIE)
                hard_miss++;
        }
    }
    cr_log_info("%s vs llama.cpp on the same file: teacher-forced top-1 agreement %d/%d = %.2f%%",
                path, agree, total, 100.0 * agree / total);
    cr_expect_eq(hard_miss, 0, "%d misses where llama.cpp led by >= %.1f", hard_miss, NEAR_TIE);
    cr_expect_geq((double)agree / total, 0.95, "agreement %d/%d", agree, total);
    free(lg);
    close_eng(&x);
}

static void agrees_with_llamacpp(const char *path, const char *fixture)
{
    agrees_with_llamacpp_routes(path, fixture, NULL);
}

/* The mirror router (scripts/moe_from_dense.py): top 4 of 8, expert e and e + 4 the same slice
 * of the FFN with router rows +r and -r. The engine must agree with llama.cpp as on the dense
 * model, and the routing must follow the text: tokens' dominant experts fall on both copies. */
static void mirror_agrees_with_llamacpp(const char *path, const char *fixture, int norm_w)
{
    NEED(path);
    en_model *m = load_model(path);
    const en_hparams *hp = en_model_hparams(m);
    cr_expect_eq(hp->n_expert, 8);
    cr_expect_eq(hp->n_expert_used, 4);
    cr_expect_eq(hp->moe_norm_w, norm_w);
    en_model_free(m);
    int dominant[EN_MAX_EXPERTS];
    agrees_with_llamacpp_routes(path, fixture, dominant);
    int lo = 0, hi = 0, all = 0;
    for (int e = 0; e < 8; e++) {
        *(e < 4 ? &lo : &hi) += dominant[e];
        all += dominant[e];
    }
    cr_log_info("%s: tokens by dominant expert %d %d %d %d | %d %d %d %d", path, dominant[0],
                dominant[1], dominant[2], dominant[3], dominant[4], dominant[5], dominant[6],
                dominant[7]);
    cr_expect_gt(all, 0);
    cr_expect(lo >= all / 20 && hi >= all / 20,
              "routing does not follow the text: %d tokens on experts 0-3, %d on 4-7", lo, hi);
}

Test(moe, top4_of_8_mirror_router_agrees_with_llamacpp_on_the_same_file, .timeout = 900)
{
    mirror_agrees_with_llamacpp(MIRROR, FIX_MIRR, 1);
}

Test(moe, qwen2moe_top4_unrenormalized_weights_agree_with_llamacpp_on_the_same_file, .timeout = 900)
{
    mirror_agrees_with_llamacpp(QMIRROR, FIX_QMIR, 0);
}

Test(moe, qwen2moe_agrees_with_llamacpp_on_the_same_file, .timeout = 900)
{
    agrees_with_llamacpp(QWEN, FIX_QWEN);
}

Test(moe, granitemoe_agrees_with_llamacpp_on_the_same_file, .timeout = 900)
{
    agrees_with_llamacpp(GRANITE, FIX_GRAN);
}

/* OLMoE's q/k norms change the attention, so its test model is not the dense one: only
 * llama.cpp on the same file is a reference. */
Test(moe, olmoe_with_qk_norms_agrees_with_llamacpp_on_the_same_file, .timeout = 900)
{
    NEED(OLMOE);
    en_model *m = load_model(OLMOE);
    const en_hparams *hp = en_model_hparams(m);
    cr_expect_str_eq(hp->arch, "olmoe");
    cr_expect_eq(hp->qk_norm, 1);
    cr_expect_eq(hp->moe_norm_w, 0);
    cr_expect_eq(hp->rope_neox, 1);
    cr_expect_eq(hp->n_head_kv, hp->n_head, "llama.cpp's olmoe norms n_embd-wide k");
    en_model_free(m);
    agrees_with_llamacpp(OLMOE, FIX_OLMO);
}

Test(moe, logits_are_bit_identical_in_one_step_token_by_token_and_beside_another_sequence)
{
    NEED(TOP4);
    read_fixture(PROMPTS);
    eng x;
    open_eng(TOP4, &x);
    const int n_vocab = en_model_hparams(x.m)->n_vocab;
    const mrec *c = &g_rec[7];
    const int n = c->n_prompt < 200 ? c->n_prompt : 200;
    float *one = malloc(sizeof(float) * n_vocab), *all = malloc(sizeof(float) * n_vocab);
    cr_assert(one && all);
    kv_store *kv = en_engine_kv(x.e);
    kv_seq *a, *b;
    kv_seq_create(kv, &a);
    kv_seq_create(kv, &b);
    const float *lg;
    /* token by token (one token per step: lanes), sequence b beside a from its 10th token on
     * (two per step) */
    for (int i = 0; i < n; i++) {
        int32_t tok[2] = {c->ids[i], g_rec[3].ids[i - 10 >= 0 ? i - 10 : 0]}, pos[2] = {i, i - 10};
        kv_seq *seqs[2] = {a, b};
        uint8_t want[2] = {1, 0}; /* a's logits */
        en_batch bb = {.n_tokens = i >= 10 && i - 10 < g_rec[3].n_prompt ? 2 : 1,
                       .tokens = tok,
                       .pos = pos,
                       .seqs = seqs,
                       .logits = want};
        cr_assert_eq(en_engine_step(x.e, &bb, &lg), 1);
    }
    memcpy(one, lg, sizeof(float) * n_vocab);
    int16_t route_one[MAXP], route_all[MAXP];
    run_prompt(&x, c->ids, n, n - 1, all, route_all);
    int diff = 0;
    for (int v = 0; v < n_vocab; v++) diff += memcmp(&one[v], &all[v], sizeof(float)) != 0;
    cr_expect_eq(diff, 0, "%d of %d logits differ between one step and token by token", diff,
                 n_vocab);
    /* the routing report (what places a KV page) is batch-invariant too, and follows the text:
     * not one expert for every token */
    int seen[8] = {0}, kinds = 0;
    for (int i = 0; i < n; i++) {
        cr_assert(route_all[i] >= 0 && route_all[i] < 8, "token %d: expert %d", i, route_all[i]);
        kinds += !seen[route_all[i]]++;
    }
    kv_seq_destroy(kv, a);
    kv_seq_create(kv, &a);
    for (int i = 0; i < n; i++) {
        int16_t r[1] = {-2};
        kv_seq *seqs[1] = {a};
        int32_t pos[1] = {i};
        en_batch bb = {.n_tokens = 1, .tokens = c->ids + i, .pos = pos, .seqs = seqs, .route = r};
        cr_assert_eq(en_engine_step(x.e, &bb, &lg), 1);
        route_one[i] = r[0];
    }
    cr_expect_eq(memcmp(route_one, route_all, sizeof(int16_t) * n), 0,
                 "dominant experts differ between one step and token by token");
    cr_expect_geq(kinds, 2, "%d tokens all routed to one expert", n);
    kv_seq_destroy(kv, a);
    kv_seq_destroy(kv, b);
    free(one);
    free(all);
    close_eng(&x);
}

/* Expert-aware shards fed by the model's routing: a scheduler over the top-4 model with the
 * `expert` shard key places every full page by its tokens' dominant expert (kv_seq_place) before
 * publishing it; the store's bookkeeping holds, pages land in more than one group, a repeated
 * prompt hits them, and the tokens are those of the same engine with the `hash` key. */
#define MAXG 16
#include "kvshard/internal.h" /* kv_store_check */
#include "sched_fixture.h"

static void sched_run(const char *path, en_engine_opts *eo, out *o, int n_req, kv_store_stats *st)
{
    en_model *m;
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_model_load(path, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_create(m, eo, &e, &err), 0, "%s", err.msg);
    en_sched_opts so = {.max_batch_tokens = MAXP, .prefill_chunk = 64, .max_ctx = 1024};
    en_sched *s;
    cr_assert_eq(en_sched_create(e, m, &so, &g_cb, &s, &err), 0, "%s", err.msg);
    for (int i = 0; i < n_req; i++) {
        /* a fixture's prompt and llama.cpp's continuation as one prompt; requests 3.. repeat
         * 0..2 (prefix hits) */
        const mrec *c = &g_rec[i % 3];
        int n = c->n_prompt + c->n_gen;
        en_sched_req q = greedy_req(c->ids, n, MAXG, &o[i]);
        cr_assert_eq(en_sched_submit(s, &q, NULL), 0);
        if (i == 2) run_all(s);
    }
    run_all(s);
    kv_store_stats_get(en_engine_kv(e), st);
    cr_assert_eq(kv_store_check(en_engine_kv(e), &err), 0, "%s", err.msg);
    if (eo->kv_shard_key == KV_SHARD_KEY_EXPERT) {
        int groups = 0;
        for (int g = 0; g < kv_store_n_expert_groups(en_engine_kv(e)); g++) {
            kv_group_stats gs;
            kv_store_group_stats(en_engine_kv(e), g, &gs);
            groups += gs.placed > 0;
        }
        cr_expect_geq(groups, 2, "pages of %d expert group(s) only", groups);
    }
    en_sched_destroy(s);
    en_engine_destroy(e);
    en_model_free(m);
}

Test(moe, pages_are_placed_by_their_dominant_expert_without_changing_a_token, .timeout = 900)
{
    NEED(TOP4);
    read_fixture(PROMPTS);
    enum { N = 5 };
    out by_hash[N] = {0}, by_expert[N] = {0};
    kv_store_stats sh, se;
    en_engine_opts eo = {.n_threads = 2, .max_batch_tokens = MAXP, .kv_shards = 4};
    sched_run(TOP4, &eo, by_hash, N, &sh);
    cr_assert_eq(sh.placed_pages, 0, "the hash key places nothing");
    eo.kv_shard_key = KV_SHARD_KEY_EXPERT;
    eo.kv_tok_groups = 1;
    sched_run(TOP4, &eo, by_expert, N, &se);
    cr_assert_gt(se.placed_pages, 10, "placed %llu", (unsigned long long)se.placed_pages);
    cr_assert_eq(se.place_fallbacks, 0);
    cr_assert_gt(se.hits, 0, "the repeated prompts hit their placed pages");
    for (int i = 0; i < N; i++) {
        cr_assert_eq(by_expert[i].code, 0);
        cr_assert_eq(by_expert[i].n, by_hash[i].n);
        cr_expect_arr_eq(by_expert[i].tok, by_hash[i].tok, sizeof(int32_t) * MAXG,
                         "request %d: tokens differ with the expert key", i);
        if (i >= 3) cr_assert_gt(by_expert[i].u.cached_tokens, 0);
    }

    /* a dense model refuses the expert key */
    en_model *m;
    en_engine *e;
    km_errbuf err = {{0}};
    NEED(DENSE);
    cr_assert_eq(en_model_load(DENSE, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_create(m, &eo, &e, &err), KM_EINVAL);
    cr_assert(strstr(err.msg, "needs an MoE model"), "%s", err.msg);
    en_model_free(m);
}
