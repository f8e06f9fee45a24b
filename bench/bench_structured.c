/*
 * bench_structured.c — `make bench-structured` (docs/structured.md): decode throughput of a batch
 * of constrained requests against the same batch unconstrained, in one process over the engine
 * and its scheduler (what a worker runs; the router and sockets are the same either way).
 *
 *   bench_structured [--model PATH] [--threads 2] [--batch 32] [--max-tokens 96] [--rounds 2]
 *                    [--temperature 0.8]
 *
 * Every phase submits --batch chat requests at once (distinct prompts, seeded sampling) and runs
 * the scheduler; the figure is decode tokens per second over the steps where every request of
 * the batch was decoding and nothing was prefilled (the steps the grammar's masks weigh on).
 * Unconstrained requests ignore end-of-generation so the batch stays full; constrained ones use
 * a schema whose value takes about --max-tokens tokens (an array of 12 objects), and a second
 * constrained phase uses json_object (any JSON object: more distinct automaton states, so more
 * masks built by walking the vocabulary rather than found in the cache). Phases alternate
 * (free, schema, json_object, then the same list as a GBNF grammar and as a regex) --rounds
 * times, after one free phase not counted; each line gives the
 * phase, its steps and tok/s, and the ratio to the free phase of the same round. Also printed: the
 * CPU, the load average, and the time one mask takes cold (a new grammar, its cache empty) and
 * warm. It asserts nothing.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "engine/engine.h"

#define MAXB 64

static const char *g_schema =
    "{\"type\":\"object\",\"properties\":{\"items\":{\"type\":\"array\",\"items\":{\"type\":"
    "\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":16},\"qty\":{\"type\":"
    "\"integer\",\"minimum\":0,\"maximum\":99},\"kind\":{\"enum\":[\"fruit\",\"tool\",\"book\"]}},"
    "\"required\":[\"name\",\"qty\",\"kind\"]},\"minItems\":12,\"maxItems\":12}},\"required\":"
    "[\"items\"]}";

/* The same list as a GBNF grammar and as a regex (the grammar extensions, grammar_cfg.c): one
 * line per item, not JSON. */
static const char *g_gbnf = "%gbnf\nroot ::= item{12}\nitem ::= \"- \" [A-Za-z ]{1,16} \": \" "
                            "[0-9]{1,2} \" (\" (\"fruit\" | \"tool\" | \"book\") \")\\n\"\n";
static const char *g_regex =
    "%regex\n(- [A-Za-z ]{1,16}: [0-9]{1,2} \\((fruit|tool|book)\\)\n){12}";

#define MAXT 512

typedef struct bs_out {
    int n, ended;
    int32_t tok[MAXT];
} bs_out;

static bs_out g_out[MAXB];

static int on_token(void *ctx, void *user, int index, int32_t token)
{
    bs_out *o = user;
    if (o->n < MAXT) o->tok[o->n] = token;
    o->n++;
    return 0;
}

static void on_done(void *ctx, void *user, km_finish f, const en_sched_usage *u)
{
    ((bs_out *)user)->ended = 1;
}

static void on_error(void *ctx, void *user, int code, const char *msg, const en_sched_usage *u)
{
    ((bs_out *)user)->ended = 1;
    fprintf(stderr, "request failed: %d %s\n", code, msg);
}

typedef struct bs_args {
    const char *model;
    int threads, batch, max_tokens, rounds;
    float temperature;
} bs_args;

/* One phase: tok/s over full-batch decode-only steps (*steps of them). */
static double phase(en_model *m, const bs_args *a, en_grammar *g, int *steps)
{
    km_errbuf err = {{0}};
    en_engine *e;
    en_engine_opts eo = {.n_threads = a->threads, .max_batch_tokens = 512};
    en_sched *s;
    en_sched_opts so = {.max_running = a->batch, .max_batch_tokens = 512, .spec.mode = EN_SPEC_OFF};
    en_sched_cb cb = {on_token, on_done, on_error, NULL, NULL};
    if (en_engine_create(m, &eo, &e, &err) || en_sched_create(e, m, &so, &cb, &s, &err)) {
        fprintf(stderr, "bench_structured: %s\n", err.msg);
        exit(1);
    }
    static int32_t ids[MAXB][256];
    bs_out *out = g_out;
    static const char *const things[] = {"a picnic", "a workshop", "a library",      "a kitchen",
                                         "a garden", "a school",   "a camping trip", "an office"};
    for (int i = 0; i < a->batch; i++) {
        char text[256];
        snprintf(text, sizeof text,
                 "<|im_start|>user\nList twelve things for %s (#%d) with quantities as "
                 "JSON.<|im_end|>\n<|im_start|>assistant\n",
                 things[i % 8], i);
        int n = md_tok_encode(en_model_tokenizer(m), text, strlen(text), 1, 1, ids[i], 256);
        out[i] = (bs_out){0};
        en_sched_req q = {.tokens = ids[i],
                          .n_tokens = n,
                          .max_tokens = a->max_tokens,
                          .user = &out[i],
                          .grammar = g,
                          .ignore_eos = !g};
        en_sample_params_default(&q.sample);
        q.sample.temperature = a->temperature;
        q.sample.seed = 1000 + (uint64_t)i;
        if (en_sched_submit(s, &q, NULL)) {
            fprintf(stderr, "bench_structured: submit failed\n");
            exit(1);
        }
    }
    double t = 0;
    uint64_t toks = 0;
    *steps = 0;
    while (en_sched_pending(s)) {
        en_sched_stats st0, st1;
        en_sched_stats_get(s, &st0);
        uint64_t t0 = km_now_ns();
        if (en_sched_step(s) < 0) break;
        uint64_t dt = km_now_ns() - t0;
        en_sched_stats_get(s, &st1);
        int full = st0.running == a->batch && st1.prefill_tokens == st0.prefill_tokens &&
                   st1.decode_tokens - st0.decode_tokens == (uint64_t)a->batch;
        if (full) t += dt / 1e9, toks += (uint64_t)a->batch, ++*steps;
    }
    en_sched_destroy(s);
    en_engine_destroy(e);
    return t > 0 ? toks / t : 0;
}

/* The grammar's own work per token of the phase just run: its outputs replayed through matchers
 * of a freshly compiled grammar (its mask cache cold, as the run's was), a mask and an accept per
 * token, in microseconds. This is the cost the phase's tok/s carries, measured alone. */
static double replay_us(en_model *m, const bs_args *a, const char *schema)
{
    en_grammar_vocab *v;
    en_grammar *g;
    km_errbuf err = {{0}};
    en_grammar_vocab_create(en_model_tokenizer(m), &v);
    en_grammar_compile(schema, strlen(schema), &g, &err);
    int n = md_tok_n_vocab(en_model_tokenizer(m)), toks = 0;
    uint32_t *bits = calloc((size_t)(n + 31) / 32, 4);
    en_grammar_matcher *mt[MAXB];
    for (int i = 0; i < a->batch; i++) en_grammar_matcher_create(g, v, &mt[i]);
    uint64_t t0 = km_now_ns();
    for (int k = 0; k < MAXT; k++) /* interleaved, as the steps were */
        for (int i = 0; i < a->batch; i++) {
            if (k >= g_out[i].n || k >= MAXT) continue;
            en_grammar_mask(mt[i], bits);
            en_grammar_accept_token(mt[i], g_out[i].tok[k]);
            toks++;
        }
    double us = (km_now_ns() - t0) / 1e3 / (toks ? toks : 1);
    for (int i = 0; i < a->batch; i++) en_grammar_matcher_destroy(mt[i]);
    en_grammar_free(g);
    en_grammar_vocab_destroy(v);
    free(bits);
    return us;
}

/* The time of one mask, cold (a new grammar: the vocabulary walked) and warm (from the cache). */
static void mask_times(en_model *m, const char *schema, const char *prefix, const char *what)
{
    en_grammar_vocab *v;
    en_grammar_vocab_create(en_model_tokenizer(m), &v);
    int n = md_tok_n_vocab(en_model_tokenizer(m));
    uint32_t *bits = calloc((size_t)(n + 31) / 32, 4);
    double cold = 0, warm = 0;
    enum { REPS = 20 };
    for (int r = 0; r < REPS; r++) {
        en_grammar *g;
        en_grammar_matcher *mt;
        km_errbuf err = {{0}};
        en_grammar_compile(schema, strlen(schema), &g, &err);
        en_grammar_matcher_create(g, v, &mt);
        en_grammar_accept_bytes(mt, prefix, strlen(prefix));
        uint64_t t0 = km_now_ns();
        en_grammar_mask(mt, bits);
        uint64_t t1 = km_now_ns();
        en_grammar_mask(mt, bits);
        uint64_t t2 = km_now_ns();
        cold += (t1 - t0) / 1e6 / REPS;
        warm += (t2 - t1) / 1e6 / REPS;
        en_grammar_matcher_destroy(mt);
        en_grammar_free(g);
    }
    printf("mask %-24s cold_ms=%.3f warm_ms=%.4f\n", what, cold, warm);
    free(bits);
    en_grammar_vocab_destroy(v);
}

int main(int argc, char **argv)
{
    bs_args a = {.model = en_default_model_path(),
                 .threads = 2,
                 .batch = 32,
                 .max_tokens = 96,
                 .rounds = 2,
                 .temperature = 0.8f};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model"))
            a.model = argv[i + 1];
        else if (!strcmp(argv[i], "--threads"))
            a.threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch"))
            a.batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--max-tokens"))
            a.max_tokens = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds"))
            a.rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--temperature"))
            a.temperature = (float)atof(argv[i + 1]);
        else {
            fprintf(stderr, "bench_structured: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (a.batch < 1 || a.batch > MAXB) a.batch = 32;
    en_model *m;
    km_errbuf err = {{0}};
    if (en_model_load(a.model, &m, &err)) {
        fprintf(stderr, "bench_structured: %s\n", err.msg);
        return 1;
    }
    printf("model=%s threads=%d batch=%d max_tokens=%d temperature=%g load1=%.2f\n",
           en_model_name(m), a.threads, a.batch, a.max_tokens, a.temperature, bench_load1());
    mask_times(m, g_schema, "{\"items\":[{\"name\":\"", "in a string");
    mask_times(m, g_schema, "{\"items\":[{\"name\":\"x\",\"qty\":1", "after a digit");
    mask_times(m, "{\"type\":\"object\"}", "{\"a\":[1,{\"b\":", "json_object, a value");
    mask_times(m, g_gbnf, "- Ap", "gbnf, in a word");
    mask_times(m, g_regex, "- Ap", "regex, in a word");
    int warm_steps; /* the first phase pays for page faults and first allocations: not counted */
    phase(m, &a, NULL, &warm_steps);
    enum { PHASES = 5 };
    const char *what[PHASES] = {"free", "schema", "json_object", "gbnf", "regex"};
    const char *srcs[PHASES] = {NULL, g_schema, "{\"type\":\"object\"}", g_gbnf, g_regex};
    for (int r = 0; r < a.rounds; r++) {
        double base = 0;
        for (int p = 0; p < PHASES; p++) {
            en_grammar *g = NULL;
            const char *src = srcs[p];
            if (p && en_grammar_compile(src, strlen(src), &g, &err)) {
                fprintf(stderr, "bench_structured: %s\n", err.msg);
                return 1;
            }
            int steps;
            double tps = phase(m, &a, g, &steps), us = p ? replay_us(m, &a, src) : 0;
            if (!p) base = tps;
            /* mask_share: the grammar's time per token over the free phase's time per token */
            printf("result round=%d phase=%s full_steps=%d decode_tok_s=%.1f ratio=%.3f "
                   "grammar_us_per_token=%.1f mask_share=%.4f load1=%.2f\n",
                   r, what[p], steps, tps, base > 0 ? tps / base : 0, us, us * base / 1e6,
                   bench_load1());
            fflush(stdout);
            en_grammar_free(g);
        }
    }
    en_model_free(m);
    return 0;
}
