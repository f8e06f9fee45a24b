/*
 * test_spec_sched.c — speculative decoding through the scheduler on the default model: greedy
 * and seeded-sampling outputs are token for token the outputs without speculation (the fixture
 * prompts and long repetitive ones, batched and alone); usage and statistics count drafted,
 * accepted and rejected tokens; a tenant's earlier outputs draft its later requests and nobody
 * else's; per-request off and max draft tokens are obeyed. Without the model every test skips.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"

#define MODEL   "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define FIXTURE "tests/fixtures/llamacpp/greedy_smollm2.txt"
/* Under the sanitizers the engine is an order of magnitude slower: fewer prompts, fewer tokens. */
#if defined(__SANITIZE_ADDRESS__)
enum { GEN = 16, FIXTURES = 2 };
#else
enum { GEN = 48, FIXTURES = 10 };
#endif
enum { MAXR = 16, MAXP = 1024 };

typedef struct out {
    int32_t tok[GEN];
    int n, ended, code;
    en_sched_usage u;
} out;

typedef struct prompt {
    int32_t ids[MAXP];
    int n;
} prompt;

static en_model *g_model;
static prompt g_p[MAXR];
static int g_np;

static void fini(void)
{
    en_model_free(g_model);
    g_model = NULL;
}

TestSuite(spec_sched, .fini = fini, .timeout = 900);

static void load_prompts(void)
{
    g_np = 0;
    FILE *f = fopen(FIXTURE, "r");
    cr_assert(f, "fixture %s missing", FIXTURE);
    static char line[1 << 16];
    while (fgets(line, sizeof line, f) && g_np < FIXTURES) {
        const char *s = strstr(line, "prompt_ids=");
        if (strncmp(line, "idx=", 4) || !s) continue;
        prompt *p = &g_p[g_np++];
        p->n = 0;
        for (s += 11; *s && *s != '\t' && *s != '\n' && p->n < MAXP;) {
            p->ids[p->n++] = (int32_t)strtol(s, (char **)&s, 10);
            if (*s == ',') s++;
        }
    }
    fclose(f);
    /* Two repetitive ones: copy a passage, and say an earlier answer again. */
    static const char *rep[] = {
        "<|im_start|>user\nCopy this paragraph exactly, word for word:\n\nThe cache keeps the keys "
        "and values of every token it has seen, page by page. When a request shares a prefix "
        "with an earlier one, its pages are found by their hash and reused, so only the new "
        "tokens are computed. When memory runs short, the oldest pages that nobody uses are "
        "moved to a slower tier or dropped.<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nWhat is a page table?<|im_end|>\n<|im_start|>assistant\nA page table "
        "maps the virtual pages of a process to the physical frames that hold them. Each entry "
        "records the frame number and a few flags: whether the page is present, writable, and "
        "recently used. When a page is not present, the processor raises a fault and the "
        "operating system loads it from disk.<|im_end|>\n<|im_start|>user\nPlease repeat your "
        "previous answer exactly.<|im_end|>\n<|im_start|>assistant\n"};
    const md_tokenizer *tok = en_model_tokenizer(g_model);
    for (int i = 0; i < 2; i++) {
        prompt *p = &g_p[g_np++];
        p->n = md_tok_encode(tok, rep[i], strlen(rep[i]), 1, 1, p->ids, MAXP);
        cr_assert(p->n > 0 && p->n <= MAXP);
    }
}

static bool need_model(void)
{
    if (access(MODEL, R_OK)) {
        cr_skip_test("needs %s (make deps)", MODEL);
        return false;
    }
    km_errbuf err = {{0}};
    if (!g_model) {
        cr_assert_eq(en_model_load(MODEL, &g_model, &err), 0, "%s", err.msg);
        load_prompts();
    }
    return true;
}

static int on_token(void *ctx, void *user, int index, int32_t token)
{
    out *o = user;
    cr_assert_eq(index, o->n);
    if (o->n < GEN) o->tok[o->n] = token;
    o->n++;
    return 0;
}

static void on_done(void *ctx, void *user, km_finish f, const en_sched_usage *u)
{
    out *o = user;
    o->ended = 1;
    o->u = *u;
}

static void on_error(void *ctx, void *user, int code, const char *msg, const en_sched_usage *u)
{
    out *o = user;
    o->ended = 1;
    o->code = code;
    o->u = *u;
}

typedef struct rig {
    en_engine *e, *d; /* d: the draft engine of EN_SPEC_SELF (int4 KV), else NULL */
    en_sched *s;
} rig;

static rig make(int max_running, int mode)
{
    rig g;
    km_errbuf err = {{0}};
    en_engine_opts eo = {.n_threads = 2, .max_batch_tokens = 256};
    cr_assert_eq(en_engine_create(g_model, &eo, &g.e, &err), 0, "%s", err.msg);
    en_sched_opts so = {.max_running = max_running, .max_batch_tokens = 256, .spec.mode = mode};
    en_sched_cb cb = {on_token, on_done, on_error, NULL, NULL};
    cr_assert_eq(en_sched_create(g.e, g_model, &so, &cb, &g.s, &err), 0, "%s", err.msg);
    g.d = NULL;
    if (mode == EN_SPEC_SELF) {
        en_engine_opts d = {.n_threads = 2, .max_batch_tokens = 64, .kv_format = KN_KV_INT4};
        cr_assert_eq(en_engine_create(g_model, &d, &g.d, &err), 0, "%s", err.msg);
        en_sched_set_draft(g.s, g.d);
    }
    return g;
}

static void drop(rig g)
{
    en_sched_destroy(g.s);
    en_engine_destroy(g.e);
    en_engine_destroy(g.d);
}

static void run_all(en_sched *s)
{
    for (int i = 0; i < 1000000 && en_sched_pending(s); i++) cr_assert_geq(en_sched_step(s), 0);
    cr_assert_eq(en_sched_pending(s), 0);
}

static en_sched_req req(int i, float temperature, uint64_t seed, out *o)
{
    en_sched_req r = {.tokens = g_p[i].ids, .n_tokens = g_p[i].n, .max_tokens = GEN, .user = o};
    en_sample_params_default(&r.sample);
    r.sample.temperature = temperature;
    r.sample.seed = seed;
    return r;
}

/* Every prompt once, all submitted together, in the worker mode given. */
static void run_set(int max_running, int mode, float temperature, out *o, en_sched_stats *st)
{
    rig g = make(max_running, mode);
    for (int i = 0; i < g_np; i++) {
        memset(&o[i], 0, sizeof o[i]);
        en_sched_req r = req(i, temperature, 1234 + i, &o[i]);
        cr_assert_eq(en_sched_submit(g.s, &r, NULL), 0);
    }
    run_all(g.s);
    if (st) en_sched_stats_get(g.s, st);
    drop(g);
}

static void same(const out *a, const out *b, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        cr_assert(a[i].ended && !a[i].code && b[i].ended && !b[i].code, "%s: request %d failed",
                  what, i);
        cr_assert_eq(a[i].n, b[i].n, "%s: request %d: %d tokens vs %d", what, i, a[i].n, b[i].n);
        int n_cmp = a[i].n < GEN ? a[i].n : GEN;
        for (int j = 0; j < n_cmp; j++)
            cr_assert_eq(a[i].tok[j], b[i].tok[j], "%s: request %d differs at token %d", what, i,
                         j);
    }
}

/* The prompts greedy without drafts (ref), then in `mode` batched (got, *st) and alone (one,
 * *st1): both must be ref token for token. */
static void greedy_three_ways(int mode, out *ref, out *got, out *one, en_sched_stats *st,
                              en_sched_stats *st1)
{
    run_set(MAXR, EN_SPEC_OFF, 0.0f, ref, NULL);
    run_set(MAXR, mode, 0.0f, got, st);
    same(ref, got, g_np, "batched");
    run_set(1, mode, 0.0f, one, st1);
    same(ref, one, g_np, "alone");
}

Test(spec_sched, greedy_output_is_token_for_token_the_output_without_speculation)
{
    if (!need_model()) return;
    static out ref[MAXR], got[MAXR], one[MAXR];
    en_sched_stats st, st1;
    greedy_three_ways(EN_SPEC_AUTO, ref, got, one, &st, &st1);
    /* Drafts were made, verified and mostly right on the repetitive prompts. How many the
     * compute-aware budget grants depends on the measured step costs (on KVMESH_ISA=scalar a
     * step is compute-bound and it grants fewer), so what is checked is that there were drafts
     * and that most of them were right, not their number. */
    cr_assert_gt(st1.spec_accepted, 0, "no draft accepted");
    cr_assert_gt(st.spec_verifies, 0);
    const char *what[2] = {"the copied paragraph", "the repeated answer"};
    for (int k = 0; k < 2; k++) {
        const en_sched_usage *u = &one[g_np - 2 + k].u;
        cr_assert_gt(u->draft_tokens, 0, "%s: no drafts", what[k]);
        cr_assert_geq(2 * u->accepted_draft_tokens, u->draft_tokens, "%s: %d of %d drafts kept",
                      what[k], u->accepted_draft_tokens, u->draft_tokens);
    }
    /* Usage and statistics agree. */
    uint64_t drafted = 0, accepted = 0;
    for (int i = 0; i < g_np; i++) {
        cr_assert_leq(one[i].u.accepted_draft_tokens, one[i].u.draft_tokens);
        cr_assert_leq(one[i].u.accepted_draft_tokens, one[i].u.completion_tokens);
        drafted += one[i].u.draft_tokens;
        accepted += one[i].u.accepted_draft_tokens;
    }
    cr_assert_eq(st1.spec_drafted, drafted);
    cr_assert_eq(st1.spec_accepted, accepted);
    cr_assert_eq(st1.spec_drafted, st1.spec_accepted + st1.spec_rejected);
}

Test(spec_sched, a_seed_fixes_the_sampled_output_with_or_without_speculation)
{
    if (!need_model()) return;
    static out ref[MAXR], one[MAXR];
    en_sched_stats st;
    run_set(MAXR, EN_SPEC_OFF, 0.8f, ref, NULL);
    run_set(1, EN_SPEC_AUTO, 0.8f, one, &st);
    same(ref, one, g_np, "sampled: batched without, alone with");
    cr_assert_gt(st.spec_accepted, 0);
}

/* Self-speculation (QuantSpec): the model drafts over a 4-bit copy of each request's KV and the
 * step verifies over the full pages: greedy and seeded outputs are the outputs without drafts,
 * batched and alone, and most greedy drafts are right (the int4 copy is close to the f16 KV). */
Test(spec_sched, self_speculation_output_is_token_for_token_the_output_without_speculation)
{
    if (!need_model()) return;
    static out ref[MAXR], got[MAXR], one[MAXR], sref[MAXR], sone[MAXR];
    en_sched_stats st, st1;
    greedy_three_ways(EN_SPEC_SELF, ref, got, one, &st, &st1);
    cr_log_info("self drafts alone: %llu drafted, %llu accepted in %llu verifications",
                (unsigned long long)st1.spec_drafted, (unsigned long long)st1.spec_accepted,
                (unsigned long long)st1.spec_verifies);
    cr_assert_gt(st.spec_verifies, 0);
    cr_assert_gt(st1.spec_drafted, 0);
    cr_assert_geq(2 * st1.spec_accepted, st1.spec_drafted, "%llu of %llu self drafts kept",
                  (unsigned long long)st1.spec_accepted, (unsigned long long)st1.spec_drafted);
    cr_assert_eq(st1.spec_drafted, st1.spec_accepted + st1.spec_rejected);
    run_set(MAXR, EN_SPEC_OFF, 0.8f, sref, NULL);
    run_set(1, EN_SPEC_SELF, 0.8f, sone, NULL);
    same(sref, sone, g_np, "self, sampled: batched without, alone with");
}

Test(spec_sched, a_tenants_outputs_draft_its_later_requests_and_nobody_elses)
{
    if (!need_model()) return;
    rig g = make(1, EN_SPEC_AUTO);
    /* An open-ended prompt with little repetition in the first GEN tokens. */
    int i = 1;
    out first = {0}, again = {0}, other = {0};
    en_sched_req r = req(i, 0.0f, 1, &first);
    r.cache_salt = "tenant-a";
    r.cache_salt_len = 8;
    cr_assert_eq(en_sched_submit(g.s, &r, NULL), 0);
    run_all(g.s);
    r.user = &again;
    cr_assert_eq(en_sched_submit(g.s, &r, NULL), 0);
    run_all(g.s);
    r.user = &other;
    r.cache_salt = "tenant-b";
    cr_assert_eq(en_sched_submit(g.s, &r, NULL), 0);
    run_all(g.s);
    same(&first, &again, 1, "tenant a twice");
    same(&first, &other, 1, "tenant b");
    /* The second request of tenant a follows the first's output; tenant b has only its own. */
    cr_assert_geq(again.u.accepted_draft_tokens, first.u.accepted_draft_tokens + again.n / 3,
                  "again: %d of %d, first %d", again.u.accepted_draft_tokens, again.n,
                  first.u.accepted_draft_tokens);
    cr_assert_eq(other.u.accepted_draft_tokens, first.u.accepted_draft_tokens,
                 "tenant b drafts exactly what tenant a's first request could (its own text)");
    drop(g);
}

Test(spec_sched, per_request_off_and_max_draft_are_obeyed)
{
    if (!need_model()) return;
    rig g = make(2, EN_SPEC_AUTO);
    int i = g_np - 1; /* the repeated answer: drafts all the way */
    out off = {0}, capped = {0};
    en_sched_req r = req(i, 0.0f, 1, &off);
    r.speculate = EN_SPEC_OFF;
    cr_assert_eq(en_sched_submit(g.s, &r, NULL), 0);
    run_all(g.s);
    cr_assert_eq(off.u.draft_tokens, 0);
    en_sched_stats s0, s1;
    en_sched_stats_get(g.s, &s0);
    r = req(i, 0.0f, 1, &capped);
    r.max_draft = 2;
    cr_assert_eq(en_sched_submit(g.s, &r, NULL), 0);
    run_all(g.s);
    en_sched_stats_get(g.s, &s1);
    cr_assert_gt(capped.u.draft_tokens, 0);
    cr_assert_leq(s1.spec_drafted - s0.spec_drafted, 2 * (s1.spec_verifies - s0.spec_verifies));
    same(&off, &capped, 1, "off vs max_draft 2");
    drop(g);
    /* A worker whose default is off drafts for a request that asks. */
    g = make(2, EN_SPEC_OFF);
    out asked = {0};
    r = req(i, 0.0f, 1, &asked);
    r.speculate = EN_SPEC_AUTO;
    cr_assert_eq(en_sched_submit(g.s, &r, NULL), 0);
    run_all(g.s);
    cr_assert_gt(asked.u.accepted_draft_tokens, 0);
    same(&off, &asked, 1, "off vs asked");
    drop(g);
}
