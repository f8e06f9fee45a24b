/*
 * test_blend.c — chunks served end to end (docs/blend.md "Serving", docs/openai.md "Chunks"):
 * kvmesh-router in front of a real kvmesh-worker on 127.0.0.1, driven by curl and a ZeroMQ
 * client. A document marked as a chunk in one request is reused by the next request that carries
 * it at another position, on completions (text, byte spans), chat (a message flagged
 * kvmesh_chunk) and ZeroMQ (token spans), reported as usage chunk_tokens; bad spans are 400s that
 * say what is wrong.
 *
 * Run from the repository root after `make build`; without the default model or curl every test
 * skips and says so. The worker runs one thread: the machine is small and shared.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/integration/harness.h"

static it_proc g_w[2], g_r;
static int g_nw;
static char g_base[64], g_body[128];

/* nw workers (w0, w1) and a router in front of them (extra router flags NULL-terminated). */
static bool cluster_of(int nw, const char *const *extra)
{
    if (!it_have_curl() || !it_router_http_start(&g_r, g_w, nw, 1, "blend", extra)) return false;
    g_nw = nw;
    snprintf(g_base, sizeof g_base, "http://127.0.0.1:%d", g_r.http_port);
    snprintf(g_body, sizeof g_body, "%s/body.json", g_r.dir);
    return true;
}

static bool cluster(void)
{
    return cluster_of(1, NULL);
}

static void stop_cluster(void)
{
    it_stop(&g_r);
    for (int i = 0; i < g_nw; i++) it_stop(&g_w[i]);
}

/* POSTs a JSON object to path: the parsed answer, *status its HTTP status. */
static json_t *post(const char *path, json_t *body, int *status)
{
    cr_assert_eq(json_dump_file(body, g_body, 0), 0);
    char url[256];
    snprintf(url, sizeof url, "%s%s", g_base, path);
    char *out = it_curl_post(url, g_body, 300, status);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert_not_null(o, "%s", out);
    free(out);
    return o;
}

static const char *k_doc[2] = {
    "The quick brown fox jumps over the lazy dog near the river bank, where the old miller keeps "
    "his wheel turning through the long summer days and the children watch the water run. In the "
    "evening the fox comes back along the same path, past the mill and the sleeping dog, and "
    "nobody in the village has ever seen where it goes after that.",
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software "
    "and associated documentation files, to deal in the software without restriction at all, "
    "including the rights to use, copy, modify, merge, publish, distribute, sublicense, and sell "
    "copies of the software, subject to the conditions that follow this paragraph."};

/* A completions body: lead, the documents in this order (each a chunk by its bytes), question
 * (a chunk too: the last chunk is computed in full, docs/blend.md "Quality"). */
static json_t *completion(const char *lead, int first, const char *question)
{
    char text[2048];
    json_t *chunks = json_array();
    int n = snprintf(text, sizeof text, "%s", lead);
    for (int i = 0; i < 2; i++) {
        const char *d = k_doc[(first + i) % 2];
        json_array_append_new(chunks, json_pack("[i,i]", n, (int)strlen(d)));
        n += snprintf(text + n, sizeof text - n, "%s\n", d);
    }
    json_array_append_new(chunks, json_pack("[i,i]", n, (int)strlen(question)));
    snprintf(text + n, sizeof text - n, "%s", question);
    return json_pack("{s:s,s:i,s:f,s:{s:o}}", "prompt", text, "max_tokens", 2, "temperature", 0.0,
                     "kvmesh", "chunks", chunks);
}

/* usage.prompt_tokens_details.chunk_tokens of a 200 answer (0 when absent). */
static long long chunk_tokens(json_t *o)
{
    json_t *d = json_object_get(json_object_get(o, "usage"), "prompt_tokens_details");
    return json_integer_value(json_object_get(d, "chunk_tokens"));
}

/* Posts make(1), make(2) ... until an answer reports reused chunk tokens (the worker stores a
 * chunk after the request that brought it, between requests): their count. Each attempt differs
 * before its chunks: one computed in full publishes all its pages, and the same prompt again
 * would find its chunks inside a cached prefix (the prefix wins) and never reuse them. */
static long long until_reused(const char *path, json_t *(*make)(int k))
{
    long long got = 0;
    uint64_t end = it_deadline(120000);
    for (int k = 1; !got && it_poll(end); k++) {
        int st;
        json_t *body = make(k), *o = post(path, body, &st);
        cr_assert_eq(st, 200, "%s", json_dumps(o, 0));
        got = chunk_tokens(o);
        json_decref(o);
        json_decref(body);
    }
    return got;
}

static json_t *completion_k(int k)
{
    char lead[128];
    snprintf(lead, sizeof lead, "Two documents follow (attempt %d); answer after them.\n", k);
    return completion(lead, 1, "What is granted?");
}

static json_t *chat_k(int k)
{
    char sys[128];
    snprintf(sys, sizeof sys, "Be brief (attempt %d). You answer about the document below.", k);
    return json_pack("{s:[{s:s,s:s},{s:s,s:s,s:b},{s:s,s:s,s:b}],s:i,s:f}", "messages", "role",
                     "system", "content", k ? sys : "You answer questions about a document.",
                     "role", "user", "content", k_doc[1], "kvmesh_chunk", 1, "role", "user",
                     "content", "Is it free?", "kvmesh_chunk", 1, "max_tokens", 2, "temperature",
                     0.0);
}

Test(blend, a_document_in_one_completion_is_reused_by_the_next, .timeout = 600)
{
    if (!cluster()) return;
    json_t *a = completion("Read the texts below.\n", 0, "Which animal jumps?");
    int st;
    json_t *o = post("/v1/completions", a, &st);
    cr_assert_eq(st, 200, "%s", json_dumps(o, 0));
    cr_assert_eq(chunk_tokens(o), 0, "nothing cached yet");
    json_decref(o);
    cr_assert_gt(until_reused("/v1/completions", completion_k), 16,
                 "the documents were reused elsewhere");
    json_decref(a);

    /* chat: the flagged message's content is the chunk; another system turn moves it */
    json_t *c = chat_k(0);
    o = post("/v1/chat/completions", c, &st);
    cr_assert_eq(st, 200, "%s", json_dumps(o, 0));
    json_decref(o);
    json_decref(c);
    cr_assert_gt(until_reused("/v1/chat/completions", chat_k), 16, "the chat message was reused");
    stop_cluster();
}

Test(blend, zeromq_chunks_reach_the_worker, .timeout = 600)
{
    if (!cluster()) return;
    void *s = it_dealer(g_r.front);
    int32_t ids[200];
    for (int i = 0; i < 200; i++) ids[i] = 1000 + (i * 37) % 900;
    long long got = 0;
    uint64_t end = it_deadline(120000);
    for (uint64_t id = 1; !got && it_poll(end); id++) {
        /* the same ids, first at 40, then at 72; then the rest, the last chunk (computed in
         * full, docs/blend.md "Quality") */
        km_chunk_seg seg[2] = {{id == 1 ? 40u : 72u, 64}, {id == 1 ? 104u : 136u, 0}};
        seg[1].n = 180 - seg[1].start;
        int32_t prompt[200];
        memcpy(prompt, ids, sizeof prompt);
        memcpy(prompt + seg[0].start, ids + 100, sizeof(int32_t) * 64);
        prompt[20] = 500 + (int32_t)id; /* no attempt's prefix covers the next one's chunk */
        km_msg m;
        km_msg_init(&m, KM_MSG_REQUEST);
        m.req.id = id;
        m.req.model = "default";
        m.req.tokens = prompt;
        m.req.n_tokens = 180;
        m.req.max_tokens = 1;
        m.req.chunks = seg;
        m.req.n_chunks = 2;
        it_send_msg(s, &m);
        for (;;) {
            km_msg a;
            cr_assert(it_recv_msg(s, &a, 120000), "no answer");
            cr_assert_neq(a.type, KM_MSG_ERROR, "%s",
                          a.type == KM_MSG_ERROR ? a.error.message : "");
            bool done = a.type == KM_MSG_DONE;
            if (done) got = a.done.chunk_tokens;
            km_msg_clear(&a);
            if (done) break;
        }
    }
    cr_assert_eq(got, 64, "the chunk's 4 pages were reused");
    km_zsock_close(s);
    stop_cluster();
}

/* The worker that served a 200 answer ("kvmesh": {"worker"}), copied to out. */
static void served_by(json_t *o, char *out, size_t cap)
{
    const char *w = json_string_value(json_object_get(json_object_get(o, "kvmesh"), "worker"));
    cr_assert_not_null(w, "%s", json_dumps(o, 0));
    snprintf(out, cap, "%s", w);
}

Test(blend, the_router_sends_a_document_where_its_chunk_is_cached, .timeout = 900)
{
    /* every prompt starts with its own line: without chunk credit, rendezvous spreads them */
    const char *extra[] = {"--chunk-credit=0.5", NULL};
    if (!cluster_of(2, extra)) return;
    /* a lead of several pages: the requests that wait for the chunks to be stored follow it
     * home by their prefix, so only home ever stores the documents */
    const char *lead0 = "You are a careful assistant. Read the two texts below, which were "
                        "retrieved for the question after them, then answer it in one short "
                        "sentence without repeating the texts.\n";
    json_t *a = completion(lead0, 0, "Which animal jumps?");
    int st;
    json_t *o = post("/v1/completions", a, &st);
    cr_assert_eq(st, 200, "%s", json_dumps(o, 0));
    char home[64], w[64];
    served_by(o, home, sizeof home);
    json_decref(o);
    json_decref(a);
    /* once the chunks are stored and their events indexed, every prompt carrying them goes home */
    long long got = 0;
    uint64_t end = it_deadline(180000);
    /* both chunks whole (each over 4 pages): a hit on one alone may be within the tie band */
    for (int k = 1; got < 128 && it_poll(end); k++) {
        /* a line of its own after the lead: a full prefix hit on an earlier attempt would
         * cover the chunks (the prefix wins), and no chunk would be reused */
        char lead[512];
        snprintf(lead, sizeof lead, "%sAttempt %d.\n", lead0, k);
        json_t *b = completion(lead, 1, "What is granted?");
        o = post("/v1/completions", b, &st);
        cr_assert_eq(st, 200);
        served_by(o, w, sizeof w);
        cr_assert_str_eq(w, home, "a prefix hit went elsewhere");
        got = chunk_tokens(o);
        json_decref(o);
        json_decref(b);
    }
    cr_assert_geq(got, 128, "the chunks were never both reused");
    for (int k = 1; k <= 6; k++) {
        char lead[64];
        snprintf(lead, sizeof lead, "Lead %d: here are two documents.\n", k);
        json_t *b = completion(lead, k % 2, "What do they say?");
        o = post("/v1/completions", b, &st);
        cr_assert_eq(st, 200);
        served_by(o, w, sizeof w);
        cr_assert_str_eq(w, home, "prompt %d went to %s, its chunks are on %s", k, w, home);
        cr_assert_gt(chunk_tokens(o), 16, "prompt %d reused its chunks", k);
        json_decref(o);
        json_decref(b);
    }
    stop_cluster();
}

/* Posts body; expects a 400 whose message contains says. */
static void expect_400(const char *path, const char *body, const char *says)
{
    json_t *b = json_loads(body, 0, NULL);
    cr_assert_not_null(b, "%s", body);
    int st;
    json_t *o = post(path, b, &st);
    const char *m = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    cr_assert_eq(st, 400, "%s: %d", body, st);
    cr_assert(m && strstr(m, says), "%s: '%s' does not say '%s'", body, m ? m : "", says);
    json_decref(o);
    json_decref(b);
}

Test(blend, bad_chunks_are_400s_that_say_why, .timeout = 300)
{
    if (!cluster()) return;
    const char *c = "/v1/completions";
    expect_400(c, "{\"prompt\":\"abcdef\",\"kvmesh\":{\"chunks\":[[0,0]]}}", "chunk 0 is empty");
    expect_400(c, "{\"prompt\":\"abcdef\",\"kvmesh\":{\"chunks\":[[0,4],[2,2]]}}", "overlap");
    expect_400(c, "{\"prompt\":\"abcdef\",\"kvmesh\":{\"chunks\":[[4,4]]}}", "past the prompt");
    expect_400(c, "{\"prompt\":[1,2,3],\"kvmesh\":{\"chunks\":[[1,3]]}}", "3 tokens");
    expect_400(c, "{\"prompt\":\"caf\\u00e9!\",\"kvmesh\":{\"chunks\":[[4,1]]}}", "UTF-8");
    expect_400(c, "{\"prompt\":[\"a\",\"b\"],\"kvmesh\":{\"chunks\":[[0,1]]}}", "one prompt");
    expect_400(c, "{\"prompt\":\"ab\",\"kvmesh\":{\"chunks\":[[0,\"x\"]]}}", "[start, length]");
    char many[2048] = "{\"prompt\":\"";
    for (int i = 0; i < 70; i++) strcat(many, "ab");
    strcat(many, "\",\"kvmesh\":{\"chunks\":[");
    for (int i = 0; i < 70; i++) sprintf(many + strlen(many), "%s[%d,1]", i ? "," : "", 2 * i);
    strcat(many, "]}}");
    expect_400(c, many, "at most 64");
    expect_400("/v1/chat/completions",
               "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"kvmesh\":{\"chunks\":[[0,"
               "1]]}}",
               "kvmesh_chunk");
    stop_cluster();
}
