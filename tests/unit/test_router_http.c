/*
 * test_router_http.c — the router's OpenAI layer (request parsing, response and SSE shapes,
 * errors, UTF-8 sanitising) and its HTTP/1.1 server over real loopback sockets (whole and
 * streamed responses, Content-Length and chunked bodies, 100-continue, pipelining, malformed and
 * oversized requests, a client leaving mid-stream), the same over TLS (--tls-cert/--tls-key:
 * a certificate made here, an OpenSSL client that verifies it; plaintext and half-done
 * handshakes refused and counted; unusable files refused at start), and the router's status
 * document (valid JSON whatever its names hold).
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <limits.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "client/kvmesh.h"
#include "common/http.h"
#include "router/openai.h"
#include "router/router.h"
#include "tests/unit/http_fixture.h"

/* ---------------------------------------------------------------- OpenAI layer */

static json_t *parse_json(const km_buf *b, size_t skip)
{
    json_error_t e;
    json_t *o = json_loadb((const char *)b->data + skip, b->len - skip, JSON_DISABLE_EOF_CHECK, &e);
    cr_assert_not_null(o, "bad JSON: %s in %.*s", e.text, (int)b->len, (const char *)b->data);
    return o;
}

Test(router_openai, completion_requests_parse_with_defaults_and_extensions)
{
    const char *body = "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":7,\"temperature\":0,"
                       "\"stop\":[\"\\n\",\"END\"],\"seed\":5,\"stream\":true,"
                       "\"stream_options\":{\"include_usage\":true},\"cache_salt\":\"t1\","
                       "\"top_k\":3,\"unknown_field\":{\"x\":1}}";
    rt_oai_req r;
    rt_oai_err e;
    cr_assert_eq(rt_oai_parse(body, strlen(body), false, &r, &e), 0, "%s", e.message);
    cr_assert_str_eq(r.prompts[0].text, "hi");
    cr_assert_str_eq(r.model, "m");
    cr_assert_eq(r.max_tokens, 7);
    cr_assert_float_eq(r.temperature, 0, 1e-9);
    cr_assert_float_eq(r.top_p, 1, 1e-9);
    cr_assert_eq(r.n_stop, 2);
    cr_assert_str_eq(r.stop[1], "END");
    cr_assert(r.has_seed && r.seed == 5);
    cr_assert(r.stream && r.include_usage);
    cr_assert_str_eq(r.cache_salt, "t1");
    cr_assert_eq(r.top_k, 3);
    rt_oai_req_free(&r);
}

Test(router_openai, max_tokens_zero_is_refused_like_openai_and_text_format_is_accepted)
{
    rt_oai_req r;
    rt_oai_err e;
    const char *zero = "{\"prompt\":\"x\",\"max_tokens\":0}";
    cr_assert_neq(rt_oai_parse(zero, strlen(zero), false, &r, &e), 0, "0 used to mean 256 tokens");
    cr_assert_str_eq(e.code, "integer_below_min_value");
    const char *text =
        "{\"prompt\":\"x\",\"max_tokens\":1,\"response_format\":{\"type\":\"text\"}}";
    cr_assert_eq(rt_oai_parse(text, strlen(text), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.max_tokens, 1);
    rt_oai_req_free(&r);
}

Test(router_openai, chat_messages_accept_text_parts_and_developer_role)
{
    const char *body = "{\"messages\":[{\"role\":\"developer\",\"content\":\"be brief\"},"
                       "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                       "{\"type\":\"text\",\"text\":\"b\"}]}],\"max_completion_tokens\":3}";
    rt_oai_req r;
    rt_oai_err e;
    cr_assert_eq(rt_oai_parse(body, strlen(body), true, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.n_msgs, 2);
    cr_assert_str_eq(r.msgs[0].role, "system");
    cr_assert_str_eq(r.msgs[1].content, "ab");
    cr_assert_eq(r.max_tokens, 3);
    rt_oai_req_free(&r);
}

Test(router_openai, prompts_as_strings_token_ids_and_lists_parse_into_choices)
{
    rt_oai_req r;
    rt_oai_err e;
    const char *one = "{\"prompt\":[\"only\"]}";
    cr_assert_eq(rt_oai_parse(one, strlen(one), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.n_prompts, 1);
    cr_assert_str_eq(r.prompts[0].text, "only");
    cr_assert_eq(r.n, 1);
    rt_oai_req_free(&r);
    const char *ids = "{\"prompt\":[1,2,3],\"n\":3,\"echo\":true,\"logit_bias\":{\"7\":-100,"
                      "\"9\":2.5}}";
    cr_assert_eq(rt_oai_parse(ids, strlen(ids), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.n_prompts, 1);
    cr_assert_null(r.prompts[0].text);
    cr_assert_eq(r.prompts[0].n_ids, 3);
    cr_assert_eq(r.prompts[0].ids[2], 3);
    cr_assert_eq(r.n, 3);
    cr_assert(r.echo);
    cr_assert_eq(r.n_logit_bias, 2);
    float sum = r.logit_bias[0].value + r.logit_bias[1].value;
    cr_assert_float_eq(sum, -97.5f, 1e-6);
    rt_oai_req_free(&r);
    const char *lists = "{\"prompt\":[[1,2],[3]]}";
    cr_assert_eq(rt_oai_parse(lists, strlen(lists), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.n_prompts, 2);
    cr_assert_eq(r.prompts[1].n_ids, 1);
    rt_oai_req_free(&r);
    const char *strs = "{\"prompt\":[\"a\",\"b\",\"c\"],\"logprobs\":0,\"suffix\":\"\"}";
    cr_assert_eq(rt_oai_parse(strs, strlen(strs), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.n_prompts, 3);
    cr_assert_str_eq(r.prompts[2].text, "c");
    cr_assert(r.logprobs);
    cr_assert_eq(r.top_logprobs, 0);
    rt_oai_req_free(&r);
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
                       "\"top_logprobs\":20}";
    cr_assert_eq(rt_oai_parse(chat, strlen(chat), true, &r, &e), 0, "%s", e.message);
    cr_assert(r.logprobs);
    cr_assert_eq(r.top_logprobs, 20);
    rt_oai_req_free(&r);
}

static int test_piece(void *ctx, int32_t id, char *buf, int cap)
{
    return snprintf(buf, (size_t)cap, "t%d", id);
}

Test(router_openai, logprobs_take_openai_shapes_for_chat_and_completions)
{
    rt_oai_lp lp[2] = {{.token = 5, .logprob = -0.25f, .n_top = 2, .top = {{5, -0.25f}, {6, -2}}},
                       {.token = 7, .logprob = -INFINITY}};
    rt_oai_meta m = {
        .chat = true, .id = "c", .model = "m", .lp = lp, .n_lp = 2, .piece = test_piece};
    rt_oai_usage u = {0};
    km_buf b = {0};
    cr_assert_eq(rt_oai_response(&b, &m, "t5t7", 4, "stop", &u), 0);
    json_t *o = json_loadb((const char *)b.data, b.len, 0, NULL);
    cr_assert_not_null(o);
    json_t *c = json_object_get(
        json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs"), "content");
    cr_assert_eq(json_array_size(c), 2);
    json_t *c0 = json_array_get(c, 0);
    cr_assert_str_eq(json_string_value(json_object_get(c0, "token")), "t5");
    cr_assert_float_eq(json_real_value(json_object_get(c0, "logprob")), -0.25, 1e-9);
    cr_assert_eq(json_array_size(json_object_get(c0, "bytes")), 2);
    cr_assert_eq(json_array_size(json_object_get(c0, "top_logprobs")), 2);
    cr_assert_float_eq(json_real_value(json_object_get(json_array_get(c, 1), "logprob")), -9999.0,
                       1e-9, "a zero probability is OpenAI's -9999");
    json_decref(o);
    km_buf_reset(&b);
    m.chat = false;
    m.text_offset = 3; /* echo: the prompt's 3 bytes come first */
    cr_assert_eq(rt_oai_response(&b, &m, "abct5t7", 7, "stop", &u), 0);
    o = json_loadb((const char *)b.data, b.len, 0, NULL);
    json_t *l = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    cr_assert_str_eq(json_string_value(json_array_get(json_object_get(l, "tokens"), 1)), "t7");
    cr_assert_eq(json_integer_value(json_array_get(json_object_get(l, "text_offset"), 1)), 5);
    json_t *top0 = json_array_get(json_object_get(l, "top_logprobs"), 0);
    cr_assert_float_eq(json_real_value(json_object_get(top0, "t6")), -2.0, 1e-9);
    json_decref(o);
    km_buf_free(&b);
}

Test(router_openai, tokenize_and_detokenize_bodies)
{
    rt_oai_tokreq t;
    rt_oai_err e;
    const char *p = "{\"prompt\":\"hi\",\"return_token_strs\":true}";
    cr_assert_eq(rt_oai_parse_tokenize(p, strlen(p), &t, &e), 0, "%s", e.message);
    cr_assert(!t.q.chat && t.add_special && t.return_token_strs);
    cr_assert_str_eq(t.q.prompts[0].text, "hi");
    rt_oai_req_free(&t.q);
    const char *c = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                    "\"add_generation_prompt\":false}";
    cr_assert_eq(rt_oai_parse_tokenize(c, strlen(c), &t, &e), 0, "%s", e.message);
    cr_assert(t.q.chat && !t.add_special && !t.add_generation_prompt);
    rt_oai_req_free(&t.q);
    const char *ids = "{\"prompt\":[1,2]}";
    cr_assert_neq(rt_oai_parse_tokenize(ids, strlen(ids), &t, &e), 0);
    cr_assert_str_eq(e.param, "prompt");
    int32_t *v;
    int n;
    const char *d = "{\"tokens\":[3,4]}";
    cr_assert_eq(rt_oai_parse_detokenize(d, strlen(d), 10, &v, &n, &e), 0, "%s", e.message);
    cr_assert_eq(n, 2);
    cr_assert_eq(v[1], 4);
    free(v);
    const char *bad = "{\"tokens\":[3,10]}";
    cr_assert_neq(rt_oai_parse_detokenize(bad, strlen(bad), 10, &v, &n, &e), 0);
    cr_assert_str_eq(e.param, "tokens");
    km_buf b = {0};
    char *strs[] = {"a", "\xe2"};
    cr_assert_eq(rt_oai_tokenize_response(&b, (int32_t[]){3, 4}, 2, 4096, strs), 0);
    cr_assert_not_null(strstr((const char *)b.data, "\"count\":2"));
    cr_assert_not_null(strstr((const char *)b.data, "\"token_strs\":[\"a\",\"\xef\xbf\xbd\"]"));
    km_buf_free(&b);
}

Test(router_openai, response_format_becomes_the_schema_the_worker_compiles)
{
    rt_oai_req r;
    rt_oai_err e;
    const char *obj = "{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_object\"}}";
    cr_assert_eq(rt_oai_parse(obj, strlen(obj), false, &r, &e), 0, "%s", e.message);
    cr_assert_str_eq(r.grammar, "{\"type\":\"object\"}");
    rt_oai_req_free(&r);
    const char *js = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":"
                     "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p-1\",\"strict\":true,"
                     "\"schema\":{\"type\": \"object\", \"properties\": {\"b\": {}, \"a\": {}}}}}}";
    cr_assert_eq(rt_oai_parse(js, strlen(js), true, &r, &e), 0, "%s", e.message);
    /* compact, in the request's key order (properties are generated in that order) */
    cr_assert_str_eq(r.grammar, "{\"type\":\"object\",\"properties\":{\"b\":{},\"a\":{}}}");
    rt_oai_req_free(&r);
    const char *text = "{\"prompt\":\"x\",\"response_format\":{\"type\":\"text\"}}";
    cr_assert_eq(rt_oai_parse(text, strlen(text), false, &r, &e), 0, "%s", e.message);
    cr_assert_null(r.grammar);
    rt_oai_req_free(&r);
}

Test(router_openai, tools_are_told_to_the_model_and_a_forced_call_is_a_grammar)
{
    rt_oai_req r;
    rt_oai_err e;
    const char *fn = "{\"type\":\"function\",\"function\":{\"name\":\"get_w\",\"parameters\":"
                     "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}}";
    char body[1024];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"tool\","
             "\"tool_call_id\":\"c\",\"content\":\"21\"}],\"tools\":[%s],\"tool_choice\":"
             "\"required\"}",
             fn);
    cr_assert_eq(rt_oai_parse(body, strlen(body), true, &r, &e), 0, "%s", e.message);
    cr_assert_str_eq(r.tool_names, "get_w\n");
    cr_assert(r.tool_several); /* parallel_tool_calls by default */
    cr_assert_str_eq(r.grammar, "{\"type\":\"object\",\"properties\":{\"name\":{\"enum\":"
                                "[\"get_w\"]},\"arguments\":{\"type\":\"object\",\"properties\":"
                                "{\"city\":{\"type\":\"string\"}}}},\"required\":[\"name\","
                                "\"arguments\"]}");
    cr_assert_eq(r.n_msgs, 3); /* the functions' system turn first */
    cr_assert_str_eq(r.msgs[0].role, "system");
    cr_assert(strstr(r.msgs[0].content, "get_w"));
    cr_assert_str_eq(r.msgs[2].role, "user"); /* the tool turn, as text */
    cr_assert(strstr(r.msgs[2].content, "21"));
    rt_oai_req_free(&r);
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[%s]}", fn);
    cr_assert_eq(rt_oai_parse(body, strlen(body), true, &r, &e), 0, "%s", e.message);
    cr_assert_not_null(r.tool_names); /* auto: free text, read as a call when it is one */
    cr_assert_null(r.grammar);
    rt_oai_req_free(&r);
    const char *out = "{\"name\":\"get_w\",\"arguments\":{\"city\":\"L\"}}";
    json_t *calls = rt_oai_tool_calls(out, strlen(out), "get_w\n", false, "x1");
    cr_assert_not_null(calls);
    char *s = json_dumps(calls, JSON_COMPACT);
    cr_assert_str_eq(s, "[{\"id\":\"call_x1_0\",\"type\":\"function\",\"function\":{\"name\":"
                        "\"get_w\",\"arguments\":\"{\\\"city\\\":\\\"L\\\"}\"}}]");
    free(s);
    json_decref(calls);
    out = "{\"name\":\"get\",\"arguments\":{}}"; /* a prefix of a name is not the name */
    cr_assert_null(rt_oai_tool_calls(out, strlen(out), "get_w\n", false, "x"));
    cr_assert_null(rt_oai_tool_calls("hello", 5, "get_w\n", false, "x"));

    /* several calls: an array, when parallel_tool_calls is not false; all calls or none */
    out = "[{\"name\":\"get_w\",\"arguments\":{\"city\":\"L\"}},"
          "{\"name\":\"get_w\",\"arguments\":{\"city\":\"P\"}}]";
    calls = rt_oai_tool_calls(out, strlen(out), "get_w\n", true, "x2");
    cr_assert_eq(json_array_size(calls), 2);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(calls, 1), "id")),
                     "call_x2_1");
    json_decref(calls);
    cr_assert_null(rt_oai_tool_calls(out, strlen(out), "get_w\n", false, "x"), "parallel off");
    out = "[{\"name\":\"get_w\",\"arguments\":{}},{\"name\":\"nope\",\"arguments\":{}}]";
    cr_assert_null(rt_oai_tool_calls(out, strlen(out), "get_w\n", true, "x"));
    cr_assert_null(rt_oai_tool_calls("[]", 2, "get_w\n", true, "x"));
}

Test(router_openai, parallel_tool_calls_true_tells_the_model_and_forces_an_array)
{
    rt_oai_req r;
    rt_oai_err e;
    const char *body =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\","
        "\"tool_calls\":[{\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"f\","
        "\"arguments\":\"{}\"}},{\"id\":\"b\",\"type\":\"function\",\"function\":"
        "{\"name\":\"f\",\"arguments\":\"{\\\"k\\\":1}\"}}]}],\"tools\":[{\"type\":"
        "\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"required\","
        "\"parallel_tool_calls\":true}";
    cr_assert_eq(rt_oai_parse(body, strlen(body), true, &r, &e), 0, "%s", e.message);
    cr_assert(strstr(r.msgs[0].content, "JSON array"), "%s", r.msgs[0].content);
    const char *arr = "{\"type\":\"array\",\"items\":";
    cr_assert(!strncmp(r.grammar, arr, strlen(arr)), "%s", r.grammar);
    cr_assert(strstr(r.grammar, "\"minItems\":1,\"maxItems\":8"), "%s", r.grammar);
    /* the assistant's two calls are its turn's text, as the array the model would write */
    cr_assert_str_eq(
        r.msgs[2].content,
        "[{\"name\":\"f\",\"arguments\":{}},{\"name\":\"f\",\"arguments\":{\"k\":1}}]");
    rt_oai_req_free(&r);
    const char *off = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":"
                      "[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                      "\"parallel_tool_calls\":false}";
    cr_assert_eq(rt_oai_parse(off, strlen(off), true, &r, &e), 0, "%s", e.message);
    cr_assert_str_eq(r.tool_names, "f\n");
    cr_assert_null(strstr(r.msgs[0].content, "JSON array"));
    rt_oai_req_free(&r);
}

Test(router_openai, bad_requests_name_the_field)
{
    struct {
        const char *body, *param;
        bool chat;
    } cases[] = {
        {"{\"prompt\":1}", "prompt", false},
        {"{\"prompt\":\"x\",\"temperature\":-1}", "temperature", false},
        {"{\"prompt\":\"x\",\"n\":0}", "n", false},
        {"{\"prompt\":\"x\",\"logprobs\":21}", "logprobs", false},
        {"{\"prompt\":\"x\",\"logprobs\":true}", "logprobs", false},
        {"{\"prompt\":\"x\",\"suffix\":\"end\"}", "suffix", false},
        {"{\"prompt\":\"x\",\"best_of\":2}", "best_of", false},
        {"{\"prompt\":\"x\",\"logit_bias\":{\"12\":101}}", "logit_bias", false},
        {"{\"prompt\":\"x\",\"logit_bias\":{\"x\":1}}", "logit_bias", false},
        {"{\"prompt\":\"x\",\"logit_bias\":[1]}", "logit_bias", false},
        {"{\"prompt\":[]}", "prompt", false},
        {"{\"prompt\":[1,\"a\"]}", "prompt", false},
        {"{\"prompt\":[\"a\",[1]]}", "prompt", false},
        {"{\"prompt\":[-1]}", "prompt", false},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}",
         "top_logprobs", true},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
         "\"top_logprobs\":21}",
         "top_logprobs", true},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":1}", "logprobs", true},
        {"{\"prompt\":\"x\",\"stop\":[1]}", "stop", false},
        {"{\"messages\":[]}", "messages", true},
        {"{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", "messages", true},
        {"{\"prompt\":\"x\",\"max_tokens\":-5}", "max_tokens", false},
        {"{\"prompt\":\"x\",\"max_tokens\":0}", "max_tokens", false},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":0}",
         "max_completion_tokens", true},
        {"{\"prompt\":\"x\",\"response_format\":{\"type\":\"xml\"}}", "response_format", false},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":"
         "\"json_schema\",\"json_schema\":{}}}",
         "response_format.json_schema.name", true},
        {"{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
         "\"name\":\"a\",\"schema\":[1]}}}",
         "response_format.json_schema.schema", false},
        {"{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
         "\"name\":\"a b\"}}}",
         "response_format.json_schema.name", false},
        {"{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
         "\"name\":\"a\",\"strict\":1}}}",
         "response_format.json_schema.strict", false},
        {"{\"prompt\":\"x\",\"response_format\":\"text\"}", "response_format", false},
        {"{\"prompt\":\"x\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}",
         "tools", false},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{"
         "\"name\":\"g\"}}}",
         "tool_choice", true},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"web\"}]}",
         "tools", true},
        {"[1,2]", NULL, false},
        {"{\"prompt\":\"x\",", NULL, false},
        {"{\"prompt\":\"a\",\"prompt\":\"b\"}", NULL, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        rt_oai_req r;
        rt_oai_err e;
        cr_assert_neq(rt_oai_parse(cases[i].body, strlen(cases[i].body), cases[i].chat, &r, &e), 0,
                      "case %zu accepted", i);
        cr_assert_eq(e.status, 400);
        cr_assert_str_eq(e.type, "invalid_request_error");
        if (cases[i].param) cr_assert_str_eq(e.param, cases[i].param, "case %zu", i);
        cr_assert(strlen(e.message) > 5);
    }
}

Test(router_openai, responses_carry_usage_with_cached_tokens)
{
    rt_oai_meta m = {
        .chat = true, .id = "chatcmpl-1", .model = "smol", .created = 100, .worker = "w3"};
    rt_oai_usage u = {.prompt_tokens = 1000, .completion_tokens = 8, .cached_tokens = 992};
    km_buf b = {0};
    cr_assert_eq(rt_oai_response(&b, &m, "hello", 5, "stop", &u), 0);
    json_t *o = parse_json(&b, 0);
    cr_assert_str_eq(json_string_value(json_object_get(o, "object")), "chat.completion");
    json_t *c0 = json_array_get(json_object_get(o, "choices"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(c0, "message"), "content")),
                     "hello");
    cr_assert_str_eq(json_string_value(json_object_get(c0, "finish_reason")), "stop");
    json_t *us = json_object_get(o, "usage");
    cr_assert_eq(json_integer_value(json_object_get(us, "total_tokens")), 1008);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(us, "prompt_tokens_details"),
                                                    "cached_tokens")),
                 992);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(o, "kvmesh"), "worker")),
                     "w3");
    json_decref(o);
    km_buf_free(&b);
}

Test(router_openai, speculation_extension_parses_and_usage_reports_predictions)
{
    const char *body = "{\"prompt\":\"hi\",\"speculate\":\"off\",\"max_draft_tokens\":4}";
    rt_oai_req r;
    rt_oai_err e;
    cr_assert_eq(rt_oai_parse(body, strlen(body), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.speculate, KM_SPECULATE_OFF);
    cr_assert_eq(r.max_draft_tokens, 4);
    rt_oai_req_free(&r);
    body = "{\"prompt\":\"hi\",\"speculate\":\"self\"}";
    cr_assert_eq(rt_oai_parse(body, strlen(body), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.speculate, KM_SPECULATE_SELF);
    rt_oai_req_free(&r);
    body = "{\"prompt\":\"hi\",\"speculate\":\"auto\"}";
    cr_assert_eq(rt_oai_parse(body, strlen(body), false, &r, &e), 0, "%s", e.message);
    cr_assert_eq(r.speculate, KM_SPECULATE_AUTO);
    rt_oai_req_free(&r);
    const char *bad[] = {"{\"prompt\":\"hi\",\"speculate\":\"always\"}",
                         "{\"prompt\":\"hi\",\"speculate\":true}",
                         "{\"prompt\":\"hi\",\"max_draft_tokens\":1000}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_neq(rt_oai_parse(bad[i], strlen(bad[i]), false, &r, &e), 0, "%s", bad[i]);
        cr_assert_eq(e.status, 400);
        cr_assert_str_eq(e.param, i < 2 ? "speculate" : "max_draft_tokens");
    }
    /* Drafts in usage: OpenAI's predicted-output fields; absent when nothing was drafted. */
    rt_oai_meta m = {.chat = false, .id = "cmpl-1", .model = "smol", .created = 1};
    rt_oai_usage u = {.prompt_tokens = 10,
                      .completion_tokens = 40,
                      .draft_tokens = 36,
                      .accepted_draft_tokens = 30};
    km_buf b = {0};
    cr_assert_eq(rt_oai_response(&b, &m, "x", 1, "length", &u), 0);
    json_t *o = parse_json(&b, 0);
    json_t *d = json_object_get(json_object_get(o, "usage"), "completion_tokens_details");
    cr_assert_eq(json_integer_value(json_object_get(d, "accepted_prediction_tokens")), 30);
    cr_assert_eq(json_integer_value(json_object_get(d, "rejected_prediction_tokens")), 6);
    json_decref(o);
    km_buf_reset(&b);
    u.draft_tokens = u.accepted_draft_tokens = 0;
    cr_assert_eq(rt_oai_response(&b, &m, "x", 1, "length", &u), 0);
    o = parse_json(&b, 0);
    cr_assert_null(json_object_get(json_object_get(o, "usage"), "completion_tokens_details"));
    json_decref(o);
    km_buf_free(&b);
}

Test(router_openai, sse_chunks_are_data_lines_and_invalid_utf8_is_replaced)
{
    rt_oai_meta m = {.chat = false, .id = "cmpl-1", .model = "smol", .created = 1};
    km_buf b = {0};
    cr_assert_eq(rt_oai_sse_chunk(&b, &m, "a\xe2\x82", 3, NULL), 0); /* cut inside a char */
    cr_assert_eq(strncmp((char *)b.data, "data: ", 6), 0);
    cr_assert_eq(memcmp(b.data + b.len - 2, "\n\n", 2), 0);
    json_t *o = parse_json(&b, 6);
    json_t *c0 = json_array_get(json_object_get(o, "choices"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(c0, "text")), "a\xef\xbf\xbd\xef\xbf\xbd",
                     "each invalid byte becomes U+FFFD");
    cr_assert(json_is_null(json_object_get(c0, "finish_reason")));
    json_decref(o);
    km_buf_reset(&b);
    m.chat = true;
    cr_assert_eq(rt_oai_sse_chunk(&b, &m, NULL, 0, NULL), 0); /* role announcement */
    o = parse_json(&b, 6);
    c0 = json_array_get(json_object_get(o, "choices"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(c0, "delta"), "role")),
                     "assistant");
    json_decref(o);
    km_buf_reset(&b);
    rt_oai_sse_done(&b);
    cr_assert_eq(memcmp(b.data, "data: [DONE]\n\n", 14), 0);
    km_buf_free(&b);
}

Test(router_openai, protocol_codes_map_to_http_errors)
{
    rt_oai_err e;
    rt_oai_err_from_code(KM_CODE_OVERLOADED, "queue full", &e);
    cr_assert_eq(e.status, 503);
    cr_assert_str_eq(e.code, "overloaded");
    rt_oai_err_from_code(KM_CODE_RATE_LIMIT, "over this key's share", &e); /* fair.c */
    cr_assert_eq(e.status, 429);
    cr_assert_str_eq(e.type, "rate_limit_exceeded");
    cr_assert_str_eq(e.code, "rate_limit_exceeded");
    rt_oai_err_from_code(KM_CODE_TOO_LARGE, "too long", &e);
    cr_assert_eq(e.status, 400);
    cr_assert_str_eq(e.code, "context_length_exceeded");
    rt_oai_err_from_code(KM_CODE_NOT_FOUND, "no", &e);
    cr_assert_eq(e.status, 404);
    km_buf b = {0};
    rt_oai_error_json(&b, &e);
    json_t *o = parse_json(&b, 0);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(o, "error"), "message")),
                     "no");
    json_decref(o);
    km_buf_free(&b);
}

/* ---------------------------------------------------------------- HTTP server */

Test(router_http, whole_responses_keep_alive_and_pipeline_in_order)
{
    server *s = start();
    int fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
            "GET /header HTTP/1.1\r\nHost: x\r\nX-Test: yes\r\n\r\n");
    char *r = hear(fd, "\r\n\r\nyes");
    char *first = strstr(r, "hello"), *second = strstr(r, "yes");
    cr_assert(first && second && first < second, "got: %s", r);
    cr_assert(strstr(r, "Connection: keep-alive"));
    close(fd);
    stop(s);
}

Test(router_http, chunked_bodies_and_100_continue)
{
    server *s = start();
    int fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            "3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n");
    char *r = hear(fd, "abcdefg");
    cr_assert(strstr(r, "Content-Length: 7"), "got: %s", r);
    say(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n");
    r = hear(fd, "100 Continue\r\n\r\n");
    cr_assert(strstr(r, "HTTP/1.1 100 Continue"), "got: %s", r);
    say(fd, "xyz");
    r = hear(fd, "xyz");
    cr_assert(strstr(r, "200 OK"), "got: %s", r);
    close(fd);
    stop(s);
}

Test(router_http, streamed_responses_are_chunked)
{
    server *s = start();
    int fd = dial(s->port);
    say(fd, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
    char *r = hear(fd, "0\r\n\r\n");
    cr_assert(strstr(r, "Transfer-Encoding: chunked"), "got: %s", r);
    cr_assert(strstr(r, "data: 3\n\n") && strstr(r, "data: 1\n\n"), "got: %s", r);
    cr_assert(strstr(r, "\r\n0\r\n\r\n"));
    /* the connection serves the next request after the stream */
    say(fd, "GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n");
    r = hear(fd, "nope");
    cr_assert(strstr(r, "404"), "got: %s", r);
    close(fd);
    stop(s);
}

Test(router_http, malformed_and_oversized_requests_get_errors_and_the_server_keeps_serving)
{
    server *s = start();
    const char *bad[] = {
        "GARBAGE\r\n\r\n",
        "POST /echo HTTP/1.1\r\nContent-Length: 99999\r\n\r\n",
        "POST /echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        "POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    };
    const char *want[] = {"400", "413", "400", "501", "400"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int fd = dial(s->port);
        say(fd, bad[i]);
        char *r = hear(fd, NULL);
        cr_assert(strstr(r, want[i]), "case %zu got: %s", i, r);
        cr_assert(strstr(r, "\"error\""), "case %zu: not an error object", i);
        close(fd);
    }
    int fd = dial(s->port);
    say(fd, "GET /header HTTP/1.1\r\nX-Test: ok\r\n\r\n");
    cr_assert(strstr(hear(fd, "ok"), "200 OK"));
    close(fd);
    stop(s);
}

Test(router_http, a_client_leaving_mid_stream_aborts_the_request)
{
    server *s = start();
    int fd = dial(s->port);
    say(fd, "GET /forever HTTP/1.1\r\nHost: x\r\n\r\n");
    hear(fd, "data:");
    close(fd);
    for (int i = 0; i < 100 && !__atomic_load_n(&s->aborts, __ATOMIC_SEQ_CST); i++) usleep(20000);
    cr_assert_eq(__atomic_load_n(&s->aborts, __ATOMIC_SEQ_CST), 1);
    stop(s);
}

/* Sends s one byte at a time, pause_ms apart, until the server answers or closes (returns what
 * it said, "" if it closed silently) or everything was sent (NULL). */
static char *trickle(int fd, const char *s, int pause_ms)
{
    static char buf[4096];
    for (size_t i = 0; s[i]; i++) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, pause_ms) > 0) {
            ssize_t k = recv(fd, buf, sizeof buf - 1, 0);
            buf[k > 0 ? k : 0] = 0;
            return buf;
        }
        if (send(fd, s + i, 1, MSG_NOSIGNAL) != 1) return "";
    }
    return NULL;
}

Test(router_http, a_head_or_body_trickling_in_gets_408_at_its_deadline_not_one_per_byte)
{
    /* a byte every 50 ms would re-arm any idle timer forever; the deadlines are 400 ms */
    server *s = start_with(400, 400, 0);
    char slow_head[512], slow_body[512];
    snprintf(slow_head, sizeof slow_head, "GET /header HTTP/1.1\r\nX-Test: %0400d\r\n\r\n", 0);
    snprintf(slow_body, sizeof slow_body, "%0400d", 0);
    int fd = dial(s->port);
    char *got = trickle(fd, slow_head, 50);
    cr_assert_not_null(got, "the whole head trickled in and was served");
    cr_assert(strstr(got, "408"), "got: %s", got);
    close(fd);
    fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nContent-Length: 400\r\n\r\n");
    got = trickle(fd, slow_body, 50);
    cr_assert_not_null(got, "the whole body trickled in and was served");
    cr_assert(strstr(got, "408"), "got: %s", got);
    close(fd);
    fd = dial(s->port); /* in time: served */
    say(fd, "GET /header HTTP/1.1\r\nX-Test: ok\r\n\r\n");
    cr_assert(strstr(hear(fd, "ok"), "200 OK"));
    close(fd);
    stop_only(s);
    cr_assert_eq(s->timeouts, 2);
    free(s);
}

Test(router_http, slowloris_connections_cannot_lock_new_clients_out)
{
    /* 64 connections holding partial heads on a server of 16; deadlines long enough that only
     * eviction can make room */
    server *s = start_with(60000, 60000, 16);
    enum { N = 64 };
    int slow[N];
    for (int i = 0; i < N; i++) {
        slow[i] = dial(s->port);
        say(slow[i], "GET /header HTTP/1.1\r\nX-Slow: ");
    }
    for (int round = 0; round < 3; round++) {
        int fd = dial(s->port);
        say(fd, "GET /header HTTP/1.1\r\nX-Test: served\r\n\r\n");
        char *got = hear(fd, "served");
        cr_assert(strstr(got, "200 OK") && strstr(got, "served"), "round %d got: %s", round, got);
        close(fd);
    }
    /* a connection with its request in progress is never the one evicted */
    int busy = dial(s->port);
    say(busy, "GET /forever HTTP/1.1\r\n\r\n");
    hear(busy, "data:");
    for (int i = 0; i < 20; i++) {
        int fd = dial(s->port);
        say(fd, "GET /header HTTP/1.1\r\nX-Slow: ");
        close(fd);
    }
    cr_assert(strstr(hear(busy, "data:"), "data:"), "the streaming client was evicted");
    close(busy);
    for (int i = 0; i < N; i++) close(slow[i]);
    stop_only(s);
    cr_assert_geq(s->evictions, N - 16 + 3, "evictions %lu", (unsigned long)s->evictions);
    free(s);
}

/* ---------------------------------------------------------------- HTTPS */

Test(router_http, https_answers_whole_pipelined_and_streamed_responses)
{
    tls_fx f = {0};
    tls_up(&f, 0);
    SSL_CTX *ctx;
    SSL *ssl = tls_dial(&f, &ctx);
    tls_say(ssl, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                 "GET /header HTTP/1.1\r\nHost: x\r\nX-Test: yes\r\n\r\n");
    char *r = tls_hear(ssl, "\r\n\r\nyes");
    char *first = strstr(r, "hello"), *second = strstr(r, "yes");
    cr_assert(first && second && first < second, "got: %s", r);
    tls_say(ssl, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
    r = tls_hear(ssl, "0\r\n\r\n");
    cr_assert(strstr(r, "data: 3\n\n") && strstr(r, "data: 1\n\n"), "got: %s", r);
    /* a body larger than one TLS record (16 KiB) arrives whole */
    enum { BIG = 40000 };
    char *big = malloc(BIG + 128);
    int h = snprintf(big, 128, "POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n", 1000);
    memset(big + h, 'k', 1000);
    big[h + 1000] = 0;
    tls_say(ssl, big);
    r = tls_hear(ssl, "kkkkkkkkkk");
    cr_assert(strstr(r, "200 OK"), "got: %.200s", r);
    free(big);
    tls_hangup(ssl, ctx);
    tls_down(&f);
    cr_assert_eq(f.s->tls_failures, 0);
    free(f.s);
}

Test(router_http, https_refuses_plaintext_and_unfinished_handshakes_and_counts_them)
{
    tls_fx f = {0};
    tls_up(&f, 300); /* the handshake must be done within the head deadline */
    /* plain HTTP to an HTTPS port: nothing comes back in clear, the connection closes */
    int fd = dial(f.s->port);
    say(fd, "GET /header HTTP/1.1\r\nX-Test: leaked\r\n\r\n");
    char *r = hear(fd, NULL);
    cr_assert_null(strstr(r, "leaked"), "got: %s", r);
    cr_assert_null(strstr(r, "HTTP/1.1"), "got: %s", r);
    close(fd);
    /* a client that connects and says nothing is closed at the deadline */
    fd = dial(f.s->port);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 5000), 1, "still open after 5 s");
    char c;
    cr_assert_leq(recv(fd, &c, 1, 0), 0);
    close(fd);
    /* and a real client is still served */
    SSL_CTX *ctx;
    SSL *ssl = tls_dial(&f, &ctx);
    tls_say(ssl, "GET /header HTTP/1.1\r\nX-Test: fine\r\n\r\n");
    cr_assert(strstr(tls_hear(ssl, "fine"), "fine"));
    tls_hangup(ssl, ctx);
    tls_down(&f);
    cr_assert_eq(f.s->tls_failures, 1, "failures %lu", (unsigned long)f.s->tls_failures);
    free(f.s);
}

Test(router_http, https_with_files_it_cannot_use_does_not_start_and_says_which)
{
    tls_fx f = {0};
    snprintf(f.dir, sizeof f.dir, "/tmp/kvmesh-tls-XXXXXX");
    cr_assert(mkdtemp(f.dir));
    make_cert(f.dir, f.cert, f.key, sizeof f.cert);
    char other_dir[64] = "/tmp/kvmesh-tls-XXXXXX", ocert[128], okey[128];
    cr_assert(mkdtemp(other_dir));
    make_cert(other_dir, ocert, okey, sizeof ocert);
    uv_loop_t loop;
    uv_loop_init(&loop);
    static const km_http_route none[] = {{NULL, 0, handler}};
    struct {
        const char *cert, *key, *says;
    } cases[] = {
        {"/nonexistent/cert.pem", f.key, "/nonexistent/cert.pem"},
        {f.cert, "/nonexistent/key.pem", "/nonexistent/key.pem"},
        {f.cert, okey, "does not match"},
        {f.key, f.key, f.key}, /* a key where the certificate should be */
        {f.cert, NULL, "both"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        km_http_opts o = {
            .routes = none, .n_routes = 1, .tls_cert = cases[i].cert, .tls_key = cases[i].key};
        km_http_server *h = NULL;
        km_errbuf err = {{0}};
        cr_assert_lt(km_http_server_start(&loop, &o, &h, &err), 0, "case %zu started", i);
        cr_assert_null(h);
        cr_assert(strstr(err.msg, cases[i].says), "case %zu: %s", i, err.msg);
    }
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_loop_close(&loop);
    const char *files[] = {f.cert, f.key, ocert, okey};
    for (int i = 0; i < 4; i++) unlink(files[i]);
    rmdir(f.dir);
    rmdir(other_dir);
}

/* ---------------------------------------------------------------- the router's front */

static void *run_router(void *arg)
{
    rt_router_run(arg);
    return NULL;
}

/* A router on ephemeral ports in front of one worker that is not there, its model file named
 * with a quote and a backslash (the model's name is the file's), its worker id too. */
typedef struct router_fx {
    rt_router *r;
    pthread_t th;
    char dir[32], link[PATH_MAX + 64];
} router_fx;

static void router_up(router_fx *f)
{
    const char *model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (access(model, R_OK)) cr_skip_test("%s missing (make deps fetches it)", model);
    char abs[PATH_MAX];
    snprintf(f->dir, sizeof f->dir, "/tmp/kvm_front_XXXXXX");
    cr_assert_not_null(mkdtemp(f->dir));
    cr_assert_not_null(realpath(model, abs));
    snprintf(f->link, sizeof f->link, "%s/smol\"q\\uote.gguf", f->dir);
    cr_assert_eq(symlink(abs, f->link), 0);
    rt_config c;
    rt_config_default(&c);
    c.model_path = f->link;
    c.front_url = "tcp://127.0.0.1:*";
    c.http_host = "127.0.0.1";
    c.http_port = 0;
    c.admin_port = -1;
    rt_worker_cfg w = {"w\"0\\", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9"}; /* nobody there */
    c.workers = &w;
    c.n_workers = 1;
    km_errbuf err = {{0}};
    cr_assert_eq(rt_router_create(&c, &f->r, &err), 0, "%s", err.msg);
    pthread_create(&f->th, NULL, run_router, f->r);
}

static void router_down(router_fx *f)
{
    rt_router_stop(f->r);
    pthread_join(f->th, NULL);
    rt_router_destroy(f->r);
    unlink(f->link);
    rmdir(f->dir);
}

Test(router_status, names_with_quotes_and_backslashes_give_valid_json)
{
    /* the regression: the document was printed with %s, so a quote in a name broke it */
    router_fx f = {0};
    router_up(&f);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/status", rt_router_http_port(f.r));
    km_buf body = {0};
    int status = 0;
    km_errbuf err = {{0}};
    int rc = kvm_http_get(url, 10000, &body, &status, &err);
    router_down(&f);
    cr_assert_eq(rc, 0, "%s", err.msg);
    cr_assert_eq(status, 200);
    json_t *o = parse_json(&body, 0);
    cr_assert_str_eq(json_string_value(json_object_get(o, "model")), "smol\"q\\uote");
    json_t *w0 = json_array_get(json_object_get(o, "workers"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(w0, "id")), "w\"0\\");
    cr_assert_str_eq(json_string_value(json_object_get(w0, "requests")), "tcp://127.0.0.1:9");
    cr_assert(json_is_false(json_object_get(w0, "up")));
    cr_assert(json_is_null(json_object_get(o, "controller")));
    json_decref(o);
    km_buf_free(&body);
}

Test(router_front, the_route_table_answers_other_paths_and_methods_with_openai_errors)
{
    router_fx f = {0};
    router_up(&f);
    int fd = dial(rt_router_http_port(f.r));
    say(fd, "GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n");
    char *r = hear(fd, "}\n");
    cr_assert(strstr(r, "HTTP/1.1 405 Method Not Allowed\r\n"), "got: %s", r);
    cr_assert(strstr(r, "Allow: POST\r\n"), "got: %s", r);
    cr_assert(strstr(r, "\"type\":\"invalid_request_error\""), "got: %s", r);
    say(fd, "GET /v2/nothing HTTP/1.1\r\nHost: x\r\n\r\n");
    r = hear(fd, "}\n");
    cr_assert(strstr(r, "HTTP/1.1 404 Not Found\r\n") && strstr(r, "\"error\""), "got: %s", r);
    say(fd, "POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
    r = hear(fd, "}\n");
    cr_assert(strstr(r, "405") && strstr(r, "Allow: GET, HEAD\r\n"), "got: %s", r);
    say(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    r = hear(fd, NULL);
    cr_assert(strstr(r, "HTTP/1.1 200 OK\r\n") && strstr(r, "\r\n\r\nok\n"), "got: %s", r);
    close(fd);
    router_down(&f);
}

/* GET path on fd (keep-alive); the response up to the end of its JSON body. */
static char *get_json(int fd, const char *path)
{
    char req[256];
    snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path);
    say(fd, req);
    return hear(fd, "}\n");
}

Test(router_front, models_retrieve_answers_the_served_model_and_404_for_others)
{
    router_fx f = {0};
    router_up(&f);
    int fd = dial(rt_router_http_port(f.r));
    /* the model is named after its file, here smol"q\uote: percent-encoded in the path */
    char *r = get_json(fd, "/v1/models/smol%22q%5Cuote");
    cr_assert(strstr(r, "HTTP/1.1 200 OK\r\n"), "got: %s", r);
    cr_assert(strstr(r, "{\"id\":\"smol\\\"q\\\\uote\",\"object\":\"model\""), "got: %s", r);
    r = get_json(fd, "/v1/models/default");
    cr_assert(strstr(r, "HTTP/1.1 200 OK\r\n") && strstr(r, "\"object\":\"model\""), "got: %s", r);
    r = get_json(fd, "/v1/models/gpt-9");
    cr_assert(strstr(r, "HTTP/1.1 404 Not Found\r\n") && strstr(r, "\"model_not_found\""),
              "got: %s", r);
    close(fd);
    router_down(&f);
}

/* POSTs body to path and returns the response (static buffer). */
static char *post(int port, const char *path, const char *body)
{
    int fd = dial(port);
    char head[256];
    snprintf(head, sizeof head, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n", path,
             strlen(body));
    say(fd, head);
    say(fd, body);
    char *r = hear(fd, "}\n");
    close(fd);
    return r;
}

Test(router_front, a_request_over_the_context_is_400_with_its_counts_like_openai)
{
    router_fx f = {0};
    router_up(&f); /* --max-ctx 4096, as the workers' default */
    int port = rt_router_http_port(f.r);
    char *r = post(port, "/v1/completions", "{\"prompt\":\"Hello\",\"max_tokens\":4096}");
    cr_assert(strstr(r, "HTTP/1.1 400 "), "got: %s", r);
    cr_assert(strstr(r, "\"code\":\"context_length_exceeded\"") &&
                  strstr(r, "\"param\":\"prompt\""),
              "got: %s", r);
    cr_assert(strstr(r, "maximum context length is 4096 tokens") &&
                  strstr(r, "in the prompt, 4096 in the completion"),
              "got: %s", r);
    km_buf big = {0};
    km_buf_printf(&big, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (int i = 0; i < 5000; i++) km_buf_printf(&big, "word ");
    km_buf_printf(&big, "\"}]}");
    km_buf_append(&big, "", 1);
    r = post(port, "/v1/chat/completions", (const char *)big.data);
    km_buf_free(&big);
    cr_assert(strstr(r, "HTTP/1.1 400 ") && strstr(r, "\"param\":\"messages\""), "got: %s", r);
    cr_assert(strstr(r, "However, your messages resulted in "), "got: %s", r);
    router_down(&f);
}
