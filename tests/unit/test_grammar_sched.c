/*
 * test_grammar_sched.c — constrained decoding through the scheduler on the default model: every
 * output of a batch of constrained requests (several schemas, a GBNF grammar and a regex, greedy
 * and sampled) is a complete value of its schema and ends by itself; speculative decoding gives
 * token for token the output without it; a request continued after a migration (its generated
 * tokens in the prompt, the grammar rebuilt from them) gives the output of one undisturbed.
 * Without the model every test skips.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define MAXG  160
#include "sched_fixture.h"

static en_model *g_model;

static void fini(void)
{
    en_model_free(g_model);
    g_model = NULL;
}

TestSuite(grammar_sched, .fini = fini, .timeout = 900);

static void need_model(void)
{
    if (access(MODEL, R_OK)) cr_skip_test("needs %s (make deps)", MODEL);
    km_errbuf err = {{0}};
    if (!g_model) cr_assert_eq(en_model_load(MODEL, &g_model, &err), 0, "%s", err.msg);
}

static const char *const g_schemas[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":24},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120}},\"required\":[\"name\",\"age\"]"
    "}",
    "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":20},"
    "\"weather\":{\"enum\":[\"sunny\",\"rainy\",\"cloudy\"]},\"temp_c\":{\"type\":\"number\","
    "\"minimum\":-50,\"maximum\":60}},\"required\":[\"city\",\"weather\",\"temp_c\"]}",
    "{\"type\":\"object\",\"properties\":{\"items\":{\"type\":\"array\",\"items\":{\"type\":"
    "\"object\",\"properties\":{\"fruit\":{\"type\":\"string\",\"maxLength\":12},\"qty\":{\"type\":"
    "\"integer\",\"minimum\":1,\"maximum\":9}},\"required\":[\"fruit\",\"qty\"]},\"minItems\":1,"
    "\"maxItems\":3}},\"required\":[\"items\"]}",
    "{\"type\":\"object\"}",
    /* the extensions (grammar_cfg.c): a GBNF grammar and a regex */
    "%gbnf\nroot ::= \"Name: \" [A-Z] [a-z]{1,12} \", age \" [0-9]{1,2} \".\"\n",
    "%regex\n(sunny|rainy|cloudy), -?[0-9]{1,2} C in [A-Z][a-z]{2,12}",
};
#define N_SCHEMAS (int)(sizeof g_schemas / sizeof *g_schemas)

static const char *const g_asks[] = {
    "Give a person's name and age as JSON.",
    "Describe today's weather in Paris as JSON.",
    "List a shopping list of fruits with quantities as JSON.",
    "Describe a cat as a JSON object.",
    "Give a person's name and age.",
    "Describe today's weather in Paris.",
};

static int chat_prompt(int i, int32_t *ids, int cap)
{
    char text[512];
    snprintf(text, sizeof text, "<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n",
             g_asks[i % N_SCHEMAS]);
    const md_tokenizer *tok = en_model_tokenizer(g_model);
    int n = md_tok_encode(tok, text, strlen(text), 1, 1, ids, cap);
    cr_assert(n > 0 && n <= cap);
    return n;
}

typedef struct rig {
    en_engine *e;
    en_sched *s;
    en_grammar *g[N_SCHEMAS];
} rig;

static rig make(int mode)
{
    rig r;
    km_errbuf err = {{0}};
    en_engine_opts eo = {.n_threads = 2, .max_batch_tokens = 256};
    cr_assert_eq(en_engine_create(g_model, &eo, &r.e, &err), 0, "%s", err.msg);
    en_sched_opts so = {.max_running = 16, .max_batch_tokens = 256, .spec.mode = mode};
    cr_assert_eq(en_sched_create(r.e, g_model, &so, &g_cb, &r.s, &err), 0, "%s", err.msg);
    for (int i = 0; i < N_SCHEMAS; i++)
        cr_assert_eq(en_grammar_compile(g_schemas[i], strlen(g_schemas[i]), &r.g[i], &err), 0, "%s",
                     err.msg);
    return r;
}

static void drop(rig r)
{
    en_sched_destroy(r.s);
    en_engine_destroy(r.e);
    for (int i = 0; i < N_SCHEMAS; i++) en_grammar_free(r.g[i]);
}

/* The output's text is a complete value of schema i (fed to a fresh matcher). */
static void expect_valid(rig *r, int i, const out *o)
{
    const md_tokenizer *tok = en_model_tokenizer(g_model);
    en_grammar_vocab *v;
    en_grammar_matcher *m;
    cr_assert_eq(en_grammar_vocab_create(tok, &v), 0);
    en_grammar *g;
    km_errbuf err = {{0}};
    cr_assert_eq(en_grammar_compile(g_schemas[i], strlen(g_schemas[i]), &g, &err), 0);
    cr_assert_eq(en_grammar_matcher_create(g, v, &m), 0);
    char text[4096];
    size_t len = 0;
    for (int k = 0; k < o->n && k < MAXG; k++) {
        cr_assert_eq(en_grammar_accept_token(m, o->tok[k]), 0, "schema %d token %d", i, k);
        int n = md_tok_piece(tok, o->tok[k], 0, text + len, (int)(sizeof text - len - 1));
        if (n > 0) len += (size_t)n;
    }
    text[len] = 0;
    cr_expect(en_grammar_complete(m), "schema %d: incomplete output '%s'", i, text);
    cr_expect_eq(o->finish, KM_FINISH_STOP, "schema %d: '%s' did not end by itself", i, text);
    en_grammar_matcher_destroy(m);
    en_grammar_free(g);
    en_grammar_vocab_destroy(v);
}

static void run_batch(int mode, float temperature, out *o, int n)
{
    rig r = make(mode);
    static int32_t ids[16][256];
    memset(o, 0, sizeof *o * (size_t)n);
    for (int i = 0; i < n; i++) {
        int np = chat_prompt(i, ids[i], 256);
        en_sched_req q = greedy_req(ids[i], np, MAXG, &o[i]);
        q.sample.temperature = temperature;
        q.sample.seed = 1234 + (uint64_t)i;
        q.grammar = r.g[i % N_SCHEMAS];
        cr_assert_eq(en_sched_submit(r.s, &q, NULL), 0);
    }
    run_all(r.s);
    for (int i = 0; i < n; i++) {
        cr_assert(o[i].ended && !o[i].code, "request %d: code %d", i, o[i].code);
        expect_valid(&r, i % N_SCHEMAS, &o[i]);
    }
    drop(r);
}

Test(grammar_sched, every_output_is_a_complete_value_greedy_and_sampled)
{
    need_model();
    out o[8];
    run_batch(EN_SPEC_OFF, 0, o, 8);
    run_batch(EN_SPEC_OFF, 0.8f, o, 8);
}

Test(grammar_sched, speculation_gives_the_output_without_it)
{
    need_model();
    out a[6], b[6];
    run_batch(EN_SPEC_OFF, 0, a, 6);
    run_batch(EN_SPEC_AUTO, 0, b, 6);
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(a[i].n, b[i].n, "request %d", i);
        cr_assert_arr_eq(a[i].tok, b[i].tok, sizeof(int32_t) * (size_t)a[i].n);
    }
}

/* Request i continued after a migration at half its output equals the undisturbed one. */
static void migrate(int i)
{
    out whole[N_SCHEMAS];
    run_batch(EN_SPEC_OFF, 0, whole, i + 1);
    cr_assert_gt(whole[i].n, 6);
    int cut = whole[i].n / 2;
    rig r = make(EN_SPEC_OFF);
    int32_t ids[256 + MAXG];
    int np = chat_prompt(i, ids, 256);
    memcpy(ids + np, whole[i].tok, sizeof(int32_t) * (size_t)cut);
    out rest = {0};
    en_sched_req q = greedy_req(ids, np + cut, MAXG - cut, &rest);
    q.n_generated = cut;
    q.grammar = r.g[i];
    cr_assert_eq(en_sched_submit(r.s, &q, NULL), 0);
    run_all(r.s);
    cr_assert_eq(rest.n, whole[i].n - cut, "grammar %d", i);
    cr_assert_arr_eq(rest.tok, whole[i].tok + cut, sizeof(int32_t) * (size_t)rest.n);
    /* tokens that do not fit the grammar are refused at submit */
    ids[np] = md_tok_find(en_model_tokenizer(g_model), "]");
    q.n_tokens = np + 1, q.n_generated = 1;
    cr_assert_eq(en_sched_submit(r.s, &q, NULL), KM_EINVAL);
    drop(r);
}

Test(grammar_sched, a_migrated_request_continues_its_grammar)
{
    need_model();
    migrate(0); /* a schema */
    migrate(4); /* a GBNF grammar */
}
