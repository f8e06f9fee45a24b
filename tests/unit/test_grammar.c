/*
 * test_grammar.c — constrained decoding (engine/grammar.c): schemas compiled and held to sample
 * JSON, refusals that name the keyword, and the per-step mask over SmolLM2's real vocabulary
 * compared, token by token, with feeding each token's bytes to the automaton.
 */
#include "engine/engine.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tests/unit/grammar_fixture.h"

/* Whether text is a whole value of the schema (1), a valid prefix only (0), or refused (-1). */
static int judge(const char *schema, const char *text)
{
    load_vocab();
    en_grammar *g = compile_ok(schema);
    en_grammar_matcher *m;
    cr_assert_eq(en_grammar_matcher_create(g, g_vocab, &m), 0);
    int r = en_grammar_accept_bytes(m, text, strlen(text)) ? -1 : en_grammar_complete(m);
    en_grammar_matcher_destroy(m);
    en_grammar_free(g);
    return r;
}

#define PERSON                                                                                     \
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":8},"         \
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"                                \
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\"]},\"maxItems\":2},"             \
    "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"age\"]}"

Test(grammar, schema_accepts_and_refuses)
{
    cr_expect_eq(judge(PERSON, "{\"name\":\"Ann\",\"age\":31}"), 1);
    cr_expect_eq(judge(PERSON, "{\"name\": \"Ann\", \"age\": 31, \"tags\": [\"a\", \"b\"]}"), 1);
    cr_expect_eq(judge(PERSON, "{\"name\":\"Ann\",\"age\":31,\"ok\":true}"), 1);
    cr_expect_eq(judge(PERSON, "{\"name\":\"Ann\",\"age\":3"), 0);
    cr_expect_eq(judge(PERSON, "{\"name\":\"Ann\"}"), -1);             /* age required */
    cr_expect_eq(judge(PERSON, "{\"age\":3}"), -1);                    /* order: name first */
    cr_expect_eq(judge(PERSON, "{\"name\":\"Ann\",\"age\":151}"), -1); /* maximum */
    cr_expect_eq(judge(PERSON, "{\"name\":\"Ann\",\"age\":-1}"), -1);  /* minimum */
    cr_expect_eq(judge(PERSON, "{\"name\":\"Ann\",\"age\":1.5}"), -1); /* integer */
    cr_expect_eq(judge(PERSON, "{\"name\":\"Annabelle\""), -1);        /* maxLength */
    cr_expect_eq(judge(PERSON, "{\"name\":\"A\",\"age\":1,\"tags\":[\"c\"]}"), -1);
    cr_expect_eq(judge(PERSON, "{\"name\":\"A\",\"age\":1,\"tags\":[\"a\",\"a\",\"a\"]}"), -1);
    cr_expect_eq(judge(PERSON, "{\"name\":\"A\",\"age\":01}"), -1);
    cr_expect_eq(judge("{\"type\":\"number\",\"exclusiveMinimum\":0.5,\"maximum\":2}", "0.51"), 1);
    cr_expect_eq(judge("{\"type\":\"number\",\"exclusiveMinimum\":0.5,\"maximum\":2}", "0.5"), 0);
    cr_expect_eq(judge("{\"type\":\"number\",\"exclusiveMinimum\":0.5,\"maximum\":2}", "2.1"), -1);
    cr_expect_eq(judge("{\"type\":\"object\"}", "{\"x\":[1,{\"y\":null}],\"z\":\"\\u00e9\"}"), 1);
    cr_expect_eq(judge("{\"type\":\"object\"}", "[1]"), -1);
    cr_expect_eq(judge("{\"type\":[\"string\",\"null\"]}", "null"), 1);
    cr_expect_eq(judge("{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\"}]}", "\"7\""), 1);
    cr_expect_eq(judge("{\"enum\":[1,12,\"x\"]}", "1"), 1);
    cr_expect_eq(judge("{\"enum\":[1,12,\"x\"]}", "12"), 1);
    cr_expect_eq(judge("{\"enum\":[1,12,\"x\"]}", "13"), -1);
    cr_expect_eq(judge("{\"$defs\":{\"P\":{\"type\":\"integer\"}},\"type\":\"array\","
                       "\"items\":{\"$ref\":\"#/$defs/P\"},\"minItems\":1}",
                       "[1,2]"),
                 1);
    cr_expect_eq(judge("{\"type\":\"array\",\"minItems\":1}", "[]"), -1);
    /* patterns: anchored, or found anywhere */
    const char *date = "{\"type\":\"string\",\"pattern\":\"^\\\\d{4}-\\\\d{2}-\\\\d{2}$\"}";
    cr_expect_eq(judge(date, "\"2024-01-31\""), 1);
    cr_expect_eq(judge(date, "\"2024-01-3"), 0);
    cr_expect_eq(judge(date, "\"2024-01-3\""), -1);
    cr_expect_eq(judge(date, "\"2024-01-311"), -1);
    cr_expect_eq(judge(date, "\"24-"), -1);
    const char *any = "{\"type\":\"string\",\"pattern\":\"(cat|dog)s?\"}";
    cr_expect_eq(judge(any, "\"hot dogs!\""), 1);
    cr_expect_eq(judge(any, "\"a cow"), 0); /* a prefix: may still meet one */
    cr_expect_eq(judge(any, "\"a cow\""), -1);
    cr_expect_eq(judge(any, "\"caf\u00e9"), -1); /* printable ASCII only */
    cr_expect_eq(judge("{\"type\":\"string\",\"pattern\":\"^[A-Z][a-z]+$\"}", "\"Ann\""), 1);
    cr_expect_eq(judge("{\"type\":\"string\",\"pattern\":\"^[A-Z][a-z]+$\"}", "\"ann"), -1);
    /* a discriminated union: the constant first property picks the branch */
    const char *calls =
        "{\"oneOf\":[{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"a\"},"
        "\"arguments\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"}},"
        "\"required\":[\"x\"]}},\"required\":[\"name\",\"arguments\"]},{\"type\":\"object\","
        "\"properties\":{\"name\":{\"const\":\"b\"},\"arguments\":{\"type\":\"object\","
        "\"properties\":{\"y\":{\"type\":\"string\"}},\"required\":[\"y\"]}},\"required\":"
        "[\"name\",\"arguments\"]}]}";
    cr_expect_eq(judge(calls, "{\"name\":\"a\",\"arguments\":{\"x\":1}}"), 1);
    cr_expect_eq(judge(calls, "{\"name\": \"b\", \"arguments\": {\"y\": \"q\"}}"), 1);
    cr_expect_eq(judge(calls, "{\"name\":\"a\",\"arguments\":{\"y\""), -1);
    cr_expect_eq(judge(calls, "{\"name\":\"b\",\"arguments\":{\"x\""), -1);
    cr_expect_eq(judge(calls, "{\"name\":\"c\""), -1);
    cr_expect_eq(judge(calls, "{\"name\":\"a\"}"), -1);
    /* values of no listed shape close: at most 16 members an object, 32 items an array */
    char many[512] = "{";
    for (int i = 0; i < 16; i++) sprintf(many + strlen(many), "%s\"k%d\":%d", i ? "," : "", i, i);
    cr_expect_eq(judge("{\"type\":\"object\"}", strcat(many, "}")), 1);
    many[strlen(many) - 1] = ',';
    cr_expect_eq(judge("{\"type\":\"object\"}", many), -1);
}

Test(grammar, unsupported_schemas_are_named)
{
    refused("{\"type\":\"string\",\"pattern\":\"(?=a)b\"}", "lookarounds");
    refused("{\"type\":\"string\",\"pattern\":\"a{1,99}\"}", "repetition");
    refused("{\"type\":\"string\",\"pattern\":\"(a\"}", "'('");
    refused("{\"type\":\"string\",\"pattern\":\"a^b\"}", "ends");
    refused("{\"allOf\":[{}]}", "'allOf'");
    refused("{\"anyOf\":[{\"type\":\"object\"},{\"type\":\"object\"}]}", "first character");
    refused("{\"type\":\"object\",\"properties\":{},\"required\":[\"x\"]}", "'x'");
    refused("{\"type\":\"strin\"}", "unknown type");
    refused("{\"type\":", "invalid JSON");
    refused("{\"$ref\":\"http://x\"}", "$ref");
    refused("{\"$defs\":{\"T\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/T\"}}},"
            "\"$ref\":\"#/$defs/T\"}",
            "recursive");
    refused("{\"enum\":[{\"a\":1}]}", "enum");
}

Test(grammar, mask_is_exactly_the_valid_tokens, .timeout = 600)
{
    mask_matches(PERSON, "");
    mask_matches(PERSON, "{\"na");
    mask_matches(PERSON, "{\"name\": \"Jo");
    mask_matches(PERSON, "{\"name\":\"Jo\",\"age\":1");
    mask_matches(PERSON, "{\"name\":\"Jo\",\"age\":12,\"tags\":[");
    mask_matches("{\"type\":\"object\"}", "{\"k\":[1,");
    mask_matches("{\"type\":\"number\",\"minimum\":-5,\"maximum\":5}", "-");
    mask_matches("{\"enum\":[\"red\",\"green\",12]}", "");
    mask_matches("{\"type\":\"string\",\"pattern\":\"^[a-z]+@[a-z]+\\\\.(com|org)$\"}", "\"bo");
    mask_matches("{\"type\":\"string\",\"pattern\":\"^[a-z]+@[a-z]+\\\\.(com|org)$\"}", "\"bo@x.");
    mask_matches(PERSON, "{\"name\":\"Jo\",\"age\":12}"); /* only the end */
    mask_matches("{\"anyOf\":[{\"type\":\"object\",\"properties\":{\"t\":{\"const\":\"a\"},"
                 "\"v\":{\"type\":\"integer\"}},\"required\":[\"t\",\"v\"]},{\"type\":\"object\","
                 "\"properties\":{\"t\":{\"const\":\"b\"},\"w\":{\"type\":\"boolean\"}},"
                 "\"required\":[\"t\",\"w\"]}]}",
                 "{\"t\":\"b\",");
}

Test(grammar, end_only_when_complete)
{
    load_vocab();
    en_grammar *g = compile_ok("{\"type\":\"integer\"}");
    en_grammar_matcher *m;
    cr_assert_eq(en_grammar_matcher_create(g, g_vocab, &m), 0);
    int32_t eos = md_tok_eos(g_tok);
    cr_expect_neq(en_grammar_accept_token(m, eos), 0);
    cr_assert_eq(en_grammar_accept_bytes(m, "42", 2), 0);
    cr_expect(en_grammar_complete(m));
    cr_expect(!en_grammar_done(m)); /* more digits may follow */
    cr_expect_eq(en_grammar_accept_token(m, eos), 0);
    en_grammar_matcher_destroy(m);
    en_grammar_free(g);
}
