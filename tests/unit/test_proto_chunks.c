/*
 * test_proto_chunks.c — req.chunks (docs/protocol.md, docs/blend.md): segments of a token prompt
 * marked as reusable chunks travel as [start, length] pairs, are absent unless given, and bad
 * boundaries (empty, overlapping, out of order, past the prompt, without tokens) are refused
 * with a message naming the segment, whether the sender or the receiver finds them.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/proto.h"

static const int32_t k_ids[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};

static void request(km_msg *m, const km_chunk_seg *c, uint32_t n)
{
    km_msg_init(m, KM_MSG_REQUEST);
    m->req.id = 7;
    m->req.model = "smol";
    m->req.tokens = k_ids;
    m->req.n_tokens = 12;
    m->req.chunks = c;
    m->req.n_chunks = n;
}

Test(proto_chunks, segments_roundtrip_and_are_absent_by_default)
{
    const km_chunk_seg c[2] = {{1, 4}, {5, 6}};
    km_msg in, out;
    request(&in, c, 2);
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), 0, "%s", err.msg);
    cr_assert_eq(km_msg_decode(b.data, b.len, NULL, &out, &err), 0, "%s", err.msg);
    cr_assert_eq(out.req.n_chunks, 2u);
    cr_assert_eq(out.req.chunks[0].start, 1u);
    cr_assert_eq(out.req.chunks[1].n, 6u);
    km_msg_clear(&out);
    /* the fuzz seed of this frame (tests/fuzz/corpus/fuzz_proto/req_chunks.msgpack) */
    const char *dir = getenv("KVMESH_WRITE_SEEDS");
    if (dir) {
        char path[512];
        snprintf(path, sizeof path, "%s/req_chunks.msgpack", dir);
        FILE *f = fopen(path, "wb");
        cr_assert_not_null(f);
        fwrite(b.data, 1, b.len, f);
        fclose(f);
    }
    request(&in, NULL, 0);
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), 0, "%s", err.msg);
    cr_assert_null(memmem(b.data, b.len, "chunks", 6));
    cr_assert_eq(km_msg_decode(b.data, b.len, NULL, &out, &err), 0, "%s", err.msg);
    cr_assert_eq(out.req.n_chunks, 0u);
    km_msg_clear(&out);
    km_buf_free(&b);
}

static const struct {
    km_chunk_seg c[2];
    uint32_t n;
    const char *why;
} k_bad[] = {
    {{{0, 4}, {4, 0}}, 2, "req.chunks[1]: empty"},
    {{{0, 6}, {4, 2}}, 2, "req.chunks[1]: starts at 4, inside or before the segment before it"},
    {{{6, 2}, {0, 2}}, 2, "req.chunks[1]: starts at 0, inside or before the segment before it"},
    {{{8, 5}, {0, 0}}, 1, "req.chunks[0]: [8, 13) past the prompt's 12 tokens"},
};

Test(proto_chunks, bad_boundaries_are_refused_by_sender_and_receiver)
{
    km_msg in, out;
    km_buf b = {0};
    for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
        km_errbuf err = {{0}};
        request(&in, k_bad[i].c, k_bad[i].n);
        cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), KM_EFORMAT, "case %zu", i);
        cr_assert(strstr(err.msg, k_bad[i].why), "'%s' lacks '%s'", err.msg, k_bad[i].why);
        /* the same frame written by hand reaches a receiver, which says the same */
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 6);
        msgpack_pack_str_with_body(&pk, "v", 1);
        msgpack_pack_uint32(&pk, 1);
        msgpack_pack_str_with_body(&pk, "t", 1);
        msgpack_pack_str_with_body(&pk, "req", 3);
        msgpack_pack_str_with_body(&pk, "id", 2);
        msgpack_pack_uint32(&pk, 7);
        msgpack_pack_str_with_body(&pk, "model", 5);
        msgpack_pack_str_with_body(&pk, "smol", 4);
        msgpack_pack_str_with_body(&pk, "tokens", 6);
        msgpack_pack_array(&pk, 12);
        for (int t = 0; t < 12; t++) msgpack_pack_uint32(&pk, (uint32_t)k_ids[t]);
        msgpack_pack_str_with_body(&pk, "chunks", 6);
        msgpack_pack_array(&pk, k_bad[i].n);
        for (uint32_t s = 0; s < k_bad[i].n; s++) {
            msgpack_pack_array(&pk, 2);
            msgpack_pack_uint32(&pk, k_bad[i].c[s].start);
            msgpack_pack_uint32(&pk, k_bad[i].c[s].n);
        }
        cr_assert_eq(km_msg_decode((const uint8_t *)sb.data, sb.size, NULL, &out, &err), KM_EFORMAT,
                     "case %zu: %s", i, err.msg);
        cr_assert(strstr(err.msg, k_bad[i].why), "'%s' lacks '%s'", err.msg, k_bad[i].why);
        km_msg_clear(&out);
        msgpack_sbuffer_destroy(&sb);
    }
    /* segments are token positions: a text prompt has none */
    km_errbuf err = {{0}};
    const km_chunk_seg c = {0, 1};
    request(&in, &c, 1);
    in.req.tokens = NULL, in.req.n_tokens = 0, in.req.prompt = "hi";
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), KM_EFORMAT);
    cr_assert(strstr(err.msg, "req.chunks: needs tokens"), "%s", err.msg);
    km_buf_free(&b);
}
