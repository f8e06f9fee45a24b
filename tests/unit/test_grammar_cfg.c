/*
 * test_grammar_cfg.c — the grammar extensions (engine/grammar_cfg.c): GBNF grammars and regexes
 * compiled and held to sample outputs, refusals that say what is wrong, and the per-step mask
 * over SmolLM2's real vocabulary compared, token by token, with feeding each token's bytes.
 */
#include "engine/engine.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/unit/grammar_fixture.h"

/* Whether text is a whole output of the grammar (1), a valid prefix only (0), or refused (-1);
 * 2: whole, and nothing may follow. Bytes only, no vocabulary. */
static int judge(const char *src, const char *text)
{
    en_grammar *g = compile_ok(src);
    en_grammar_matcher *m;
    cr_assert_eq(en_grammar_matcher_create(g, NULL, &m), 0);
    int r = en_grammar_accept_bytes(m, text, strlen(text)) ? -1 : en_grammar_complete(m);
    if (r == 1 && en_grammar_done(m)) r = 2;
    en_grammar_matcher_destroy(m);
    en_grammar_free(g);
    return r;
}

#define ANSWER "%gbnf\nroot ::= \"answer: \" (\"yes\" | \"no\") \".\"\n"
#define LIST                                                                                       \
    "%gbnf\n# a list of small words\nroot ::= \"[\" ws item (\",\" ws item)* \"]\"\n"              \
    "item ::= [a-z]+ | num\nnum ::= \"-\"? [0-9]{1,3}\nws ::= [ ]?\n"
#define NEST                                                                                       \
    "%gbnf\nroot ::= expr\nexpr ::= term (\"+\" term)*\nterm ::= [0-9] | \"(\" expr \")\"\n"

Test(grammar_cfg, gbnf_accepts_and_refuses)
{
    cr_expect_eq(judge(ANSWER, "answer: yes."), 2);
    cr_expect_eq(judge(ANSWER, "answer: n"), 0);
    cr_expect_eq(judge(ANSWER, "answer: maybe"), -1);
    cr_expect_eq(judge(LIST, "[abc, -12,x]"), 2);
    cr_expect_eq(judge(LIST, "[abc, 1234"), -1); /* {1,3} */
    cr_expect_eq(judge(LIST, "[abc"), 0);
    cr_expect_eq(judge(LIST, "[]"), -1);
    cr_expect_eq(judge(NEST, "(1+(2+3))+4"), 1); /* more may follow */
    cr_expect_eq(judge(NEST, "(1+(2+3)"), 0);
    cr_expect_eq(judge(NEST, "(1+)"), -1);
    /* shared prefixes, empty alternatives, escapes, Unicode classes, rules over lines */
    cr_expect_eq(judge("%gbnf\nroot ::= \"ab\" \"c\" | \"ab\" \"d\" | \"\"\n", "abd"), 2);
    cr_expect_eq(judge("%gbnf\nroot ::= \"\\x41\\u00e9\\n\" [^\"]*\n", "A\xc3\xa9\nfr\xc3\xa8re"),
                 1);
    cr_expect_eq(judge("%gbnf\nroot ::= [α-ω]+\n", "\xce\xbb\xce\xbc"), 1);
    cr_expect_eq(judge("%gbnf\nroot ::= [α-ω]+\n", "\xce\x91"), -1); /* capital alpha */
    cr_expect_eq(judge("%gbnf\nroot ::= [α-ω]+\n", "\xce"), 0);      /* a character begun */
    /* a character's first bytes only when they can still be a character the grammar takes */
    cr_expect_eq(judge("%regex\nb", "\xe0"), -1);
    cr_expect_eq(judge("%regex\nb", "\xf0"), -1);
    cr_expect_eq(judge("%gbnf\nroot ::= [\\u0800-\\uffff]\n", "\xe0\x80"), -1); /* overlong */
    cr_expect_eq(judge("%gbnf\nroot ::= [\\u0800-\\uffff]\n", "\xe0\xa0"), 0);
    cr_expect_eq(judge("%gbnf\nroot ::= .\n", "\xed\xa0\x80"), -1); /* a surrogate */
    cr_expect_eq(judge("%gbnf\nroot ::=\n  \"a\"\n  | \"b\" # comment\n", "b"), 2);
    cr_expect_eq(judge("%gbnf\nroot ::= (\n  \"a\"\n  \"b\"\n)\n", "ab"), 2);
    cr_expect_eq(judge("%gbnf\nroot ::= x{2,}\nx ::= \"ab\"\n", "abab"), 1);
    cr_expect_eq(judge("%gbnf\nroot ::= \"ab\"{2}\n", "abab"), 2);
}

Test(grammar_cfg, regex_accepts_and_refuses)
{
    const char *mail = "%regex\n[a-z]+@[a-z]+\\.(com|org)";
    cr_expect_eq(judge(mail, "bob@example.org"), 2);
    cr_expect_eq(judge(mail, "bob@example.co"), 0);
    cr_expect_eq(judge(mail, "Bob@"), -1);
    cr_expect_eq(judge("%regex\n^\\d{3}-\\d{4}$", "555-1234"), 2);
    cr_expect_eq(judge("%regex\n^\\d{3}-\\d{4}$", "555-12345"), -1);
    cr_expect_eq(judge("%regex\n(?:ab|a)c*", "acc"), 1);
    cr_expect_eq(judge("%regex\n.+", "x\n"), -1); /* '.' is not a newline */
    cr_expect_eq(judge("%regex\n[^0-9]+", "é!"), 1);
    cr_expect_eq(judge("%regex\n\\w+\\s\\W", "a_1 !"), 2);
    cr_expect_eq(judge("%regex\n(a|b)+?c", "abc"), 2); /* lazy: the same outputs */
    cr_expect_eq(judge("%regex\nx{0,2}y", "xxy"), 2);
    cr_expect_eq(judge("%regex\nx{0,2}y", "xxx"), -1);
}

Test(grammar_cfg, bad_grammars_are_explained)
{
    refused("%gbnf\nroot ::= a\na ::= a \"x\" | \"y\"\n", "left recursion through rule 'a'");
    refused("%gbnf\nroot ::= b \"x\"\nb ::= \"\" | root\n", "left recursion");
    refused("%gbnf\nroot ::= thing\n", "rule 'thing' is used but not defined");
    refused("%gbnf\nstart ::= \"x\"\n", "no rule 'root'");
    refused("%gbnf\nroot ::= \"x\"\nroot ::= \"y\"\n", "line 2: a rule defined twice");
    refused("%gbnf\nroot ::= (\"x\"\n", "not closed");
    refused("%gbnf\nroot ::= \"x\n", "not closed");
    refused("%gbnf\nroot = \"x\"\n", "expected '::='");
    refused("%gbnf\nroot ::= [z-a]\n", "out of order");
    refused("%gbnf\nroot ::= \"x\"{3,1}\n", "n < m");
    refused("%gbnf\nroot ::= \"x\"{1,999}\n", "over 256");
    refused("%gbnf\nroot ::= \"\\q\"\n", "unknown escape");
    refused("%regex\n(?=a)b", "lookaround");
    refused("%regex\n(a)\\1", "backreferences");
    refused("%regex\na++", "possessive");
    refused("%regex\n*a", "nothing before it");
    refused("%regex\na)", "')' without '('");
    refused("%regex\na^b", "anchor");
    refused("%regex\n[\\W]", "negated class");
}

/* The mask after prefix equals, token for token, what feeding each token's bytes allows. */

Test(grammar_cfg, mask_is_exactly_the_valid_tokens, .timeout = 600)
{
    mask_matches(LIST, "");
    mask_matches(LIST, "[ab");
    mask_matches(LIST, "[ab, -1");
    mask_matches(NEST, "(1+");
    mask_matches("%gbnf\nroot ::= [α-ω]+ \"!\"\n", "\xce");
    mask_matches("%regex\n[a-z]+@[a-z]+\\.(com|org)", "bo@x.");
    mask_matches("%regex\n[^0-9]{0,40}", "");
    mask_matches(ANSWER, "answer: yes."); /* only the end */
    mask_matches("%regex\n(yes|no), because [a-z ]{1,30}\\.", "no, ");
}

Test(grammar_cfg, end_only_when_complete)
{
    load_vocab();
    en_grammar *g = compile_ok("%regex\n\\d+(\\.\\d+)?");
    en_grammar_matcher *m;
    cr_assert_eq(en_grammar_matcher_create(g, g_vocab, &m), 0);
    int32_t eos = md_tok_eos(g_tok);
    cr_expect_neq(en_grammar_accept_token(m, eos), 0);
    cr_assert_eq(en_grammar_accept_bytes(m, "4.", 2), 0);
    cr_expect(!en_grammar_complete(m));
    cr_expect_neq(en_grammar_accept_bytes(m, "x", 1), 0); /* refused: the state unchanged */
    cr_assert_eq(en_grammar_accept_bytes(m, "25", 2), 0);
    cr_expect(en_grammar_complete(m));
    cr_expect(!en_grammar_done(m));
    cr_expect_eq(en_grammar_accept_token(m, eos), 0);
    en_grammar_matcher_destroy(m);
    en_grammar_free(g);
}
