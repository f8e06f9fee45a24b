/*
 * fuzz_oai.c — libFuzzer target for the router's OpenAI request parser (rt_oai_parse,
 * router/openai.c): the body of /v1/completions and /v1/chat/completions, straight from any HTTP
 * client.
 *
 * Feeds arbitrary bytes as both kinds of body. ASan/UBSan catch memory errors and leaks (every
 * accepted request is freed with rt_oai_req_free); the checks hold the promises the router relies
 * on: an accepted request has its prompt (or at least one message) and at most
 * KM_PROTO_MAX_STOP stop strings; a refusal is a 400 invalid_request_error (or a 500 when memory
 * ran out) with a message.
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
    if (chat ? (r.n_msgs < 1 || !r.msgs) : !r.prompt) abort();
    if (r.n_stop < 0 || r.n_stop > KM_PROTO_MAX_STOP) abort();
    for (int i = 0; i < r.n_msgs; i++)
        if (!r.msgs[i].role || !r.msgs[i].content) abort();
    rt_oai_req_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check((const char *)data, size, false);
    check((const char *)data, size, true);
    return 0;
}
