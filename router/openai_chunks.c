/*
 * openai_chunks.c — the chunk extension of the OpenAI API (docs/openai.md "Chunks"): segments of
 * a prompt whose KV a worker may cache and reuse by content wherever they appear (docs/blend.md).
 *
 * Completions: "kvmesh": {"chunks": [[start, length], ...]} on a request with one prompt. Over a
 * prompt of token ids the spans count tokens; over a text prompt they count bytes of the UTF-8
 * text, and the router then tokenizes the prompt piece by piece, cut at every span's edges
 * (prompt.c), so a document's token ids never depend on the text around it: tokenized whole, a
 * merge across the edge would give the same document other ids in every prompt, and it would
 * never be found again. Chat: "kvmesh_chunk": true on a message makes its content a chunk, found
 * in the rendered template as it was written (front.c).
 *
 * Bad spans are 400s with a message that names the segment: empty, overlapping or out of order,
 * past the prompt, inside a UTF-8 character, or more than KM_PROTO_MAX_CHUNKS.
 */
#define _GNU_SOURCE /* memmem */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/openai.h"

static int bad(rt_oai_err *e, const char *param, const char *m)
{
    e->status = 400;
    e->type = "invalid_request_error";
    e->param = param;
    snprintf(e->message, sizeof e->message, "%s", m);
    return KM_EINVAL;
}

/* The segments checked against a prompt of `size` units (bytes of text, or token ids). */
int rt_oai_chunks_check(const km_chunk_seg *c, int n, size_t size, const char *text,
                        const char *param, rt_oai_err *e)
{
    char m[200];
    if (n > KM_PROTO_MAX_CHUNKS) {
        snprintf(m, sizeof m, "%d chunks, at most %d", n, KM_PROTO_MAX_CHUNKS);
        return bad(e, param, m);
    }
    const char *unit = text ? "bytes" : "tokens";
    for (int i = 0; i < n; i++) {
        uint64_t end = (uint64_t)c[i].start + c[i].n;
        if (!c[i].n)
            snprintf(m, sizeof m, "chunk %d is empty", i);
        else if (end > size)
            snprintf(m, sizeof m, "chunk %d ([%u, %llu)) is past the prompt's %zu %s", i,
                     c[i].start, (unsigned long long)end, size, unit);
        else if (i && c[i].start < c[i - 1].start + c[i - 1].n)
            snprintf(m, sizeof m,
                     "chunk %d starts at %u, before chunk %d ends (%u): chunks are "
                     "in order and do not overlap",
                     i, c[i].start, i - 1, c[i - 1].start + c[i - 1].n);
        else if (text && (((unsigned char)text[c[i].start] & 0xC0) == 0x80 ||
                          (end < size && ((unsigned char)text[end] & 0xC0) == 0x80)))
            snprintf(m, sizeof m, "chunk %d cuts a UTF-8 character", i);
        else
            continue;
        return bad(e, param, m);
    }
    return 0;
}

int rt_oai_chunks(json_t *body, rt_oai_req *r, rt_oai_err *e)
{
    const char *param = "kvmesh.chunks";
    json_t *k = json_object_get(body, "kvmesh"), *v = k ? json_object_get(k, "chunks") : NULL;
    if (k && !json_is_object(k) && !json_is_null(k))
        return bad(e, "kvmesh", "'kvmesh' must be an object");
    if (r->chat) {
        if (v)
            return bad(e, param, "chat requests mark chunks per message: \"kvmesh_chunk\": true");
        return 0;
    }
    if (!v || json_is_null(v)) return 0;
    if (!json_is_array(v))
        return bad(e, param, "'kvmesh.chunks' must be an array of [start, length] pairs");
    if (r->n_prompts != 1) return bad(e, param, "chunks need a request with one prompt");
    size_t n = json_array_size(v);
    if (n > KM_PROTO_MAX_CHUNKS) {
        char m[100];
        snprintf(m, sizeof m, "%zu chunks, at most %d", n, KM_PROTO_MAX_CHUNKS);
        return bad(e, param, m);
    }
    if (!n) return 0;
    if (!(r->chunks = calloc(n, sizeof *r->chunks))) return KM_ENOMEM;
    r->n_chunks = (int)n;
    for (size_t i = 0; i < n; i++) {
        json_t *p = json_array_get(v, i), *a = json_array_get(p, 0), *b = json_array_get(p, 1);
        if (!json_is_array(p) || json_array_size(p) != 2 || !json_is_integer(a) ||
            !json_is_integer(b) || json_integer_value(a) < 0 || json_integer_value(b) < 0 ||
            json_integer_value(a) > UINT32_MAX || json_integer_value(b) > UINT32_MAX)
            return bad(e, param, "every chunk is a [start, length] pair of integers >= 0");
        r->chunks[i] =
            (km_chunk_seg){(uint32_t)json_integer_value(a), (uint32_t)json_integer_value(b)};
    }
    const rt_oai_prompt *p = &r->prompts[0];
    return p->ids ? rt_oai_chunks_check(r->chunks, r->n_chunks, (size_t)p->n_ids, NULL, param, e)
                  : rt_oai_chunks_check(r->chunks, r->n_chunks, strlen(p->text), p->text, param, e);
}

int rt_oai_chat_chunks(const rt_oai_req *r, const char *text, size_t len, km_chunk_seg **out,
                       int *n_out)
{
    int n = 0;
    *out = NULL;
    *n_out = 0;
    for (int i = 0; i < r->n_msgs; i++) n += r->msgs[i].chunk && r->msgs[i].content[0];
    if (!n) return 0;
    if (n > KM_PROTO_MAX_CHUNKS) return KM_ERANGE;
    if (!(*out = calloc((size_t)n, sizeof **out))) return KM_ENOMEM;
    /* each message's content where the template put it, after the one before */
    size_t at = 0;
    for (int i = 0; i < r->n_msgs; i++) {
        const char *c = r->msgs[i].content;
        size_t cl = strlen(c);
        const char *hit = cl ? memmem(text + at, len - at, c, cl) : NULL;
        if (!hit) continue;
        at = (size_t)(hit - text) + cl;
        if (r->msgs[i].chunk) (*out)[(*n_out)++] = (km_chunk_seg){(uint32_t)(hit - text), cl};
    }
    return 0;
}
