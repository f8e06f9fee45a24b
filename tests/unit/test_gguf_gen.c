/*
 * test_gguf_gen.c — the random-model writer (md_gguf_gen, model/gguf_gen.c): every weight type
 * it writes loads into the CPU engine, which runs a prompt and greedy steps to finite logits;
 * the same seed gives the same file and the same logits bit for bit, another seed other ones;
 * its tokenizer round-trips text; shapes the type cannot hold are refused with a message.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"

static char g_dir[64];

static void setup(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/kvmesh-gguf-gen-XXXXXX");
    cr_assert(mkdtemp(g_dir), "mkdtemp");
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(gguf_gen, .init = setup, .fini = teardown);

static md_gguf_gen_cfg tiny(md_type t, uint64_t seed)
{
    return (md_gguf_gen_cfg){.n_layers = 2,
                             .n_embd = 256,
                             .n_head = 4,
                             .n_head_kv = 2,
                             .n_ff = 512,
                             .n_vocab = 512,
                             .type = t,
                             .seed = seed};
}

static void gen(const md_gguf_gen_cfg *c, const char *name, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", g_dir, name);
    km_errbuf err = {{0}};
    cr_assert_eq(md_gguf_gen(c, path, &err), 0, "%s", err.msg);
}

#define N_PROMPT 6
#define N_GEN    3

/* Loads the model, runs a prompt then N_GEN greedy steps on one thread of the scalar-free best
 * table; copies the last row of logits of every step into out[(N_GEN + 1) * n_vocab]. */
static void run(const char *path, float *out, int32_t *ids)
{
    km_errbuf err = {{0}};
    en_model *m;
    cr_assert_eq(en_model_load(path, &m, &err), 0, "%s", err.msg);
    en_engine_opts o = {.n_threads = 1, .max_batch_tokens = 64, .kv_bytes = 4 << 20};
    en_engine *e;
    cr_assert_eq(en_engine_create(m, &o, &e, &err), 0, "%s", err.msg);
    const int V = en_model_hparams(m)->n_vocab;
    kv_store *kv = en_engine_kv(e);
    kv_seq *seq;
    cr_assert_eq(kv_seq_create(kv, &seq), 0);
    int32_t prompt[N_PROMPT] = {1, 300, 301, 400, 17, 42}, pos[N_PROMPT];
    kv_seq *seqs[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) pos[i] = i, seqs[i] = seq;
    en_batch b = {.n_tokens = N_PROMPT, .tokens = prompt, .pos = pos, .seqs = seqs};
    const float *lg;
    cr_assert_eq(en_engine_step(e, &b, &lg), 1);
    for (int g = 0; g <= N_GEN; g++) {
        memcpy(out + (size_t)g * V, lg, sizeof(float) * V);
        for (int i = 0; i < V; i++)
            cr_assert(isfinite(lg[i]), "logit %d of step %d: %g", i, g, lg[i]);
        if (g == N_GEN) break;
        ids[g] = en_argmax(lg, V);
        int32_t p = N_PROMPT + g;
        en_batch d = {.n_tokens = 1, .tokens = &ids[g], .pos = &p, .seqs = &seq};
        cr_assert_eq(en_engine_step(e, &d, &lg), 1);
    }
    kv_seq_destroy(kv, seq);
    en_engine_destroy(e);
    en_model_free(m);
}

static int same_file(const char *a, const char *b)
{
    char cmd[320];
    snprintf(cmd, sizeof cmd, "cmp -s %s %s", a, b);
    return system(cmd) == 0;
}

static void check_type(md_type t)
{
    const int V = 512;
    float *l1 = malloc(sizeof(float) * V * (N_GEN + 1)),
          *l2 = malloc(sizeof(float) * V * (N_GEN + 1));
    float *l3 = malloc(sizeof(float) * V * (N_GEN + 1));
    int32_t i1[N_GEN], i2[N_GEN], i3[N_GEN];
    char p1[128], p2[128], p3[128];
    md_gguf_gen_cfg c = tiny(t, 7);
    gen(&c, "a.gguf", p1, sizeof p1);
    gen(&c, "b.gguf", p2, sizeof p2);
    c.seed = 8;
    gen(&c, "c.gguf", p3, sizeof p3);
    cr_assert(same_file(p1, p2), "%s: one seed gave two files", md_type_name(t));
    cr_assert(!same_file(p1, p3), "%s: two seeds gave one file", md_type_name(t));
    run(p1, l1, i1);
    run(p2, l2, i2);
    run(p3, l3, i3);
    cr_assert_eq(memcmp(l1, l2, sizeof(float) * V * (N_GEN + 1)), 0, "%s: logits differ",
                 md_type_name(t));
    cr_assert_eq(memcmp(i1, i2, sizeof i1), 0);
    cr_assert_neq(memcmp(l1, l3, sizeof(float) * V), 0, "%s: seed ignored", md_type_name(t));
    /* random weights still give logits that vary across the vocabulary */
    float lo = l1[0], hi = l1[0];
    for (int i = 1; i < V; i++) lo = fminf(lo, l1[i]), hi = fmaxf(hi, l1[i]);
    cr_assert_gt(hi - lo, 0.1f, "%s: flat logits %g..%g", md_type_name(t), lo, hi);
    free(l1), free(l2), free(l3);
}

Test(gguf_gen, q8_0_loads_runs_and_repeats)
{
    check_type(MD_TYPE_Q8_0);
}
Test(gguf_gen, f16_loads_runs_and_repeats)
{
    check_type(MD_TYPE_F16);
}
Test(gguf_gen, q4_0_loads_runs_and_repeats)
{
    check_type(MD_TYPE_Q4_0);
}
Test(gguf_gen, q4_k_loads_runs_and_repeats)
{
    check_type(MD_TYPE_Q4_K);
}
Test(gguf_gen, q6_k_loads_runs_and_repeats)
{
    check_type(MD_TYPE_Q6_K);
}
Test(gguf_gen, bf16_q4_1_f32_load_and_run)
{
    const md_type ts[] = {MD_TYPE_BF16, MD_TYPE_Q4_1, MD_TYPE_F32};
    for (size_t i = 0; i < 3; i++) {
        float *l = malloc(sizeof(float) * 512 * (N_GEN + 1));
        int32_t ids[N_GEN];
        char p[128];
        md_gguf_gen_cfg c = tiny(ts[i], 3);
        c.tied_output = 1;
        gen(&c, md_type_name(ts[i]), p, sizeof p);
        run(p, l, ids);
        free(l);
    }
}

Test(gguf_gen, tokenizer_round_trips_text)
{
    char p[128];
    md_gguf_gen_cfg c = tiny(MD_TYPE_Q8_0, 1);
    gen(&c, "t.gguf", p, sizeof p);
    km_errbuf err = {{0}};
    md_gguf *g;
    cr_assert_eq(md_gguf_open(p, &g, &err), 0, "%s", err.msg);
    md_tokenizer *t;
    cr_assert_eq(md_tok_create(g, &t, &err), 0, "%s", err.msg);
    const char *text = "Hello, world! caf\xc3\xa9 {\"x\": 1}";
    int32_t ids[128];
    int n = md_tok_encode(t, text, strlen(text), 1, 0, ids, 128);
    cr_assert(n > 2 && n < 128, "%d tokens", n);
    cr_assert_eq(ids[0], md_tok_bos(t));
    char out[256] = {0};
    int len = 0;
    for (int i = 1; i < n; i++) len += md_tok_piece(t, ids[i], 0, out + len, (int)sizeof out - len);
    /* SentencePiece adds a leading space (U+2581) that decodes to ' ' */
    cr_assert_str_eq(out[0] == ' ' ? out + 1 : out, text);
    cr_assert(md_tok_is_eog(t, 2));
    md_tok_destroy(t);
    md_gguf_close(g);
}

Test(gguf_gen, shapes_the_type_cannot_hold_are_refused)
{
    char p[128];
    snprintf(p, sizeof p, "%s/bad.gguf", g_dir);
    km_errbuf err = {{0}};
    md_gguf_gen_cfg c = tiny(MD_TYPE_Q4_K, 1);
    c.n_embd = 320, c.n_head = 5,
    c.n_head_kv = 5; /* 320 is not a whole number of 256-element blocks */
    cr_assert_eq(md_gguf_gen(&c, p, &err), KM_EINVAL);
    cr_assert(strstr(err.msg, "Q4_K"), "%s", err.msg);
    c = tiny(MD_TYPE_Q8_0, 1);
    c.n_vocab = 100;
    cr_assert_eq(md_gguf_gen(&c, p, &err), KM_EINVAL);
    cr_assert_eq(access(p, F_OK), -1, "a refused shape left a file");
}
