/*
 * test_spec_engine.c — the engine side of speculative decoding, on the default model: a step
 * that carries a token and its drafts gives, at every position up to the first wrong draft, the
 * logits that decoding one token at a time gives, bit for bit; and truncating the sequence past
 * the rejected drafts leaves no trace in later steps. In f16, fp8 (per-row scales) and int4 (whose
 * pages change representation when they fill, so a verification stays inside one page).
 * Without the model every test skips and says so.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/worker.h"

#define MODEL   "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define FIXTURE "tests/fixtures/llamacpp/greedy_smollm2.txt"

enum { GEN = 40, MAXP = 512 };

static en_model *g_model;

static void fini(void)
{
    en_model_free(g_model);
    g_model = NULL;
}

TestSuite(spec_engine, .fini = fini, .timeout = 600);

static bool need_model(void)
{
    if (access(MODEL, R_OK)) {
        cr_skip_test("needs %s (make deps)", MODEL);
        return false;
    }
    km_errbuf err = {{0}};
    if (!g_model) cr_assert_eq(en_model_load(MODEL, &g_model, &err), 0, "%s", err.msg);
    return true;
}

/* prompt_ids of fixture record idx. */
static int fixture_prompt(int idx, int32_t *ids, int max)
{
    FILE *f = fopen(FIXTURE, "r");
    cr_assert(f, "fixture %s missing", FIXTURE);
    static char line[1 << 16];
    int n = 0;
    char want[32];
    snprintf(want, sizeof want, "idx=%d\t", idx);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, want, strlen(want))) {
            const char *s = strstr(line, "prompt_ids=");
            cr_assert(s);
            s += 11;
            while (*s && *s != '\t' && *s != '\n' && n < max) {
                ids[n++] = (int32_t)strtol(s, (char **)&s, 10);
                if (*s == ',') s++;
            }
            break;
        }
    fclose(f);
    cr_assert_gt(n, 0, "fixture record %d", idx);
    return n;
}

static en_engine *engine(kv_format fmt)
{
    en_engine *e;
    km_errbuf err = {{0}};
    en_engine_opts o = {.n_threads = 2, .max_batch_tokens = MAXP, .kv_format = fmt};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    return e;
}

/* Runs tokens at positions pos0.. of seq with logits at every position. */
static const float *run(en_engine *e, kv_seq *seq, const int32_t *tok, int n, int pos0, int all)
{
    int32_t pos[MAXP];
    kv_seq *seqs[MAXP];
    uint8_t want[MAXP];
    for (int i = 0; i < n; i++) pos[i] = pos0 + i, seqs[i] = seq, want[i] = all || i == n - 1;
    en_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seqs = seqs, .logits = want};
    const float *lg;
    cr_assert_eq(en_engine_step(e, &b, &lg), all ? n : 1);
    return lg;
}

static void check_format(kv_format fmt, int idx)
{
    int32_t prompt[MAXP];
    int np = fixture_prompt(idx, prompt, 200);
    int V = en_model_hparams(g_model)->n_vocab;
    en_engine *e = engine(fmt);
    kv_store *kv = en_engine_kv(e);
    int pt = kv_store_page_tokens(kv);

    /* The reference: the prompt in one step, then one token at a time. */
    float *ref = malloc(sizeof(float) * (size_t)V * (GEN + 1));
    int32_t tok[GEN + 1];
    kv_seq *a;
    cr_assert_eq(kv_seq_create(kv, &a), 0);
    const float *lg = run(e, a, prompt, np, 0, 0);
    for (int i = 0; i <= GEN; i++) {
        memcpy(ref + (size_t)i * V, lg, sizeof(float) * V);
        tok[i] = en_argmax(lg, V);
        if (i < GEN) lg = run(e, a, &tok[i], 1, np + i, 0);
    }
    kv_seq_destroy(kv, a);

    /* Verification steps with drafts right for a while, then wrong. */
    kv_seq *b;
    cr_assert_eq(kv_seq_create(kv, &b), 0);
    lg = run(e, b, prompt, np, 0, 0);
    cr_assert_eq(memcmp(lg, ref, sizeof(float) * V), 0);
    int done = 0, steps = 0, rejected = 0; /* tokens of the output whose KV is in b */
    while (done < GEN) {
        int k = 1 + (steps * 5) % 7, good = (steps * 3) % (k + 1);
        if (fmt == KN_KV_INT4) { /* stay inside the page holding the step's first position */
            int left = pt - 1 - (np + done) % pt;
            if (k > left) k = left;
            if (good > k) good = k;
        }
        if (done + k + 1 > GEN) k = GEN - done - 1, good = good < k ? good : k;
        int32_t in[16];
        in[0] = tok[done];
        for (int j = 1; j <= k; j++)
            in[j] = j <= good ? tok[done + j] : (tok[done + j] + 1 + steps) % V;
        lg = run(e, b, in, k + 1, np + done, 1);
        /* Rows 0..good follow a context that is all correct. */
        int acc = 0;
        for (int j = 0; j <= k; j++) {
            const float *want = ref + (size_t)(done + j + 1) * V;
            cr_assert_eq(memcmp(lg + (size_t)j * V, want, sizeof(float) * V), 0,
                         "%s: step %d position %d: logits differ from one token at a time",
                         kv_format_name(fmt), steps, j);
            int32_t t = en_argmax(lg + (size_t)j * V, V);
            cr_assert_eq(t, tok[done + j + 1]);
            if (j == k || t != in[j + 1]) break;
            acc++;
        }
        cr_assert_eq(acc, good);
        rejected += k - acc;
        done += 1 + acc;
        kv_seq_truncate(kv, b, np + done);
        steps++;
    }
    cr_assert_gt(rejected, 10, "rejections were exercised");
    kv_seq_destroy(kv, b);
    free(ref);
    en_engine_destroy(e);
}

Test(spec_engine, verification_steps_and_rollback_give_the_logits_of_one_token_at_a_time_f16)
{
    if (!need_model()) return;
    check_format(KN_KV_F16, 2);
    check_format(KN_KV_F16, 7);
}

Test(spec_engine, verification_steps_and_rollback_give_the_logits_of_one_token_at_a_time_fp8)
{
    if (!need_model()) return;
    check_format(KN_KV_FP8, 1);
}

Test(spec_engine, verification_steps_and_rollback_give_the_logits_of_one_token_at_a_time_int4)
{
    if (!need_model()) return;
    check_format(KN_KV_INT4, 0);
    check_format(KN_KV_INT4, 7);
}
