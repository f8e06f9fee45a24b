/*
 * fuzz_oai.c — libFuzzer target for the router's OpenAI request parser (rt_oai_parse,
 * router/openai.c): the body of /v1/completions and /v1/chat/completions, straight from any HTTP
 * client.
 *
 * Feeds arbitrary bytes as both kinds of body. ASan/UBSan catch memory errors and leaks (every
 * accepted request is freed with rt_oai_req_free); the checks hold the promises the router relies
 * on: an accepted request has its prompt (or at least one message) and at most
 * KM_PROTO_MAX_STOP stop strings, its prompts each text or token ids, its logprobs and logit bias
 * within their limits; a refusal is a 400 invalid_request_error (or a 500 when memory ran out)
 * with a message. /tokenize and /detokenize bodies go through their parsers too.
 */
#include <stdlib.h>
#include <string.h>

#include "router/openai.h"

static void check(const char *body, size_t len, bool chat)
{
    rt_oai_req r;
    rt_oai_err e;
    if (rt_oai_parse(body, len, chat, &r, &e) != 0) {
        bool bad_request = e.status == 400 && e.type && !strcmp(e.type, "invalid_request_error");
        bool no_memory = e.status == 500 && e.type && !strcmp(e.type, "server_error");
        if (!(bad_request || no_memory) || !e.message[0]) abort();
        return;
    }
    if (chat ? (r.n_msgs < 1 || !r.msgs) : (r.n_prompts < 1 || !r.prompts)) abort();
    if (r.n_stop < 0 || r.n_stop > KM_PROTO_MAX_STOP) abort();
    if (r.n_prompts > RT_OAI_MAX_PROMPTS || r.n < 1 || r.n > RT_OAI_MAX_PROMPTS) abort();
    for (int i = 0; i < r.n_prompts; i++)
        if (!r.prompts[i].text == !r.prompts[i].ids || (r.prompts[i].ids && r.prompts[i].n_ids < 1))
            abort();
    if (r.top_logprobs > RT_OAI_MAX_TOP || (r.top_logprobs && !r.logprobs) ||
        r.n_logit_bias > KM_PROTO_MAX_BIAS)
        abort();
    for (int i = 0; i < r.n_logit_bias; i++)
        if (r.logit_bias[i].token < 0 ||
            !(r.logit_bias[i].value >= -100 && r.logit_bias[i].value <= 100))
            abort();
    for (int i = 0; i < r.n_msgs; i++)
        if (!r.msgs[i].role || !r.msgs[i].content) abort();
    rt_oai_req_free(&r);
}

/* /tokenize and /detokenize bodies: the same promises, and a token list within the vocabulary. */
static void check_tokenize(const char *body, size_t len)
{
    rt_oai_tokreq t;
    rt_oai_err e;
    if (rt_oai_parse_tokenize(body, len, &t, &e) == 0) {
        if (!t.q.chat && (t.q.n_prompts != 1 || !t.q.prompts[0].text)) abort();
        rt_oai_req_free(&t.q);
    } else if (!e.message[0]) {
        abort();
    }
    int32_t *ids;
    int n;
    if (rt_oai_parse_detokenize(body, len, 1000, &ids, &n, &e) == 0) {
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= 1000) abort();
        free(ids);
    } else if (!e.message[0]) {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check((const char *)data, size, false);
    check((const char *)data, size, true);
    check_tokenize((const char *)data, size);
    return 0;
}
