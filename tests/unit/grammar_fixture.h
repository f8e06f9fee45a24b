/*
 * grammar_fixture.h — what test_grammar (JSON Schema) and test_grammar_cfg (GBNF, regex) share:
 * SmolLM2's vocabulary for masks, compiling a grammar that must compile, a refusal that must
 * name what is wrong, and the mask held, token for token, to feeding each token's bytes.
 */
#ifndef KM_TEST_GRAMMAR_FIXTURE_H
#define KM_TEST_GRAMMAR_FIXTURE_H

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"

#define SMOLLM2 "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static en_grammar_vocab *g_vocab;
static md_gguf *g_gguf;
static md_tokenizer *g_tok;

static void load_vocab(void)
{
    if (g_vocab) return;
    if (access(SMOLLM2, R_OK) != 0) cr_skip_test("%s absent (make deps)", SMOLLM2);
    km_errbuf e = {{0}};
    cr_assert_eq(md_gguf_open(SMOLLM2, &g_gguf, &e), 0, "%s", e.msg);
    cr_assert_eq(md_tok_create(g_gguf, &g_tok, &e), 0, "%s", e.msg);
    cr_assert_eq(en_grammar_vocab_create(g_tok, &g_vocab), 0);
}

static en_grammar *compile_ok(const char *src)
{
    en_grammar *g = NULL;
    km_errbuf e = {{0}};
    cr_assert_eq(en_grammar_compile(src, strlen(src), &g, &e), 0, "%s: %s", src, e.msg);
    return g;
}

static void refused(const char *src, const char *needle)
{
    en_grammar *g = NULL;
    km_errbuf e = {{0}};
    cr_expect_lt(en_grammar_compile(src, strlen(src), &g, &e), 0, "%s", src);
    cr_expect(strstr(e.msg, needle) != NULL, "%s: '%s' lacks '%s'", src, e.msg, needle);
    cr_expect_null(g);
}

/* The mask after prefix equals, token for token, what feeding each token's bytes allows. */
static void mask_matches(const char *src, const char *prefix)
{
    load_vocab();
    en_grammar *g = compile_ok(src);
    en_grammar_matcher *m;
    cr_assert_eq(en_grammar_matcher_create(g, g_vocab, &m), 0);
    cr_assert_eq(en_grammar_accept_bytes(m, prefix, strlen(prefix)), 0, "%s", prefix);
    int n = md_tok_n_vocab(g_tok), allowed = 0;
    uint32_t *bits = calloc((size_t)(n + 31) / 32, 4);
    for (int pass = 0; pass < 2; pass++) { /* the second from the cache */
        en_grammar_mask(m, bits);
        allowed = 0;
        for (int id = 0; id < n; id++) {
            en_grammar_matcher *t;
            cr_assert_eq(en_grammar_matcher_create(g, g_vocab, &t), 0);
            en_grammar_accept_bytes(t, prefix, strlen(prefix));
            int ok = en_grammar_accept_token(t, id) == 0, got = bits[id >> 5] >> (id & 31) & 1;
            en_grammar_matcher_destroy(t);
            allowed += got;
            cr_assert_eq(got, ok, "%s after '%s': token %d mask %d, bytes %d", src, prefix, id, got,
                         ok);
        }
    }
    cr_expect_gt(allowed, 0);
    free(bits);
    en_grammar_matcher_destroy(m);
    en_grammar_free(g);
}

#endif /* KM_TEST_GRAMMAR_FIXTURE_H */
