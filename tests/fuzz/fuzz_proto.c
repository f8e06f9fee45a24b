/*
 * fuzz_proto.c — libFuzzer target for the wire protocol decoder (common/proto.c).
 *
 * Feeds arbitrary bytes to km_msg_decode under two sets of limits (the defaults and tight ones,
 * so the limit paths are reached too). Whatever decodes must re-encode, and the re-encoded frame
 * must decode and encode again to the same bytes: the decoder and encoder agree on every field.
 * ASan/UBSan catch the rest (out-of-bounds reads, leaks, overflows).
 */
#include "common/svc.h"

#include <stdlib.h>
#include <string.h>

static void check_roundtrip(const km_msg *m)
{
    km_proto_limits big;
    km_proto_limits_default(&big);
    big.max_frame = 64u << 20; /* re-encoding may be larger (ints sent for floats widen) */
    km_buf a = {0}, b = {0};
    km_errbuf err;
    if (km_msg_encode(m, &big, &a, &err) != 0) abort(); /* decoded but not encodable */
    km_msg again;
    if (km_msg_decode(a.data, a.len, &big, &again, &err) != 0) abort();
    if (km_msg_encode(&again, &big, &b, &err) != 0) abort();
    if (a.len != b.len || memcmp(a.data, b.data, a.len) != 0) abort(); /* not a fixed point */
    km_msg_clear(&again);
    km_buf_free(&a);
    km_buf_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    km_errbuf err;
    km_msg m;
    if (km_msg_decode(data, size, NULL, &m, &err) == 0) {
        check_roundtrip(&m);
        km_msg_clear(&m);
    }
    km_proto_limits tight = {.max_frame = 512, .max_prompt_tok = 8, .max_event_hashes = 2};
    if (km_msg_decode(data, size, &tight, &m, &err) == 0) km_msg_clear(&m);
    return 0;
}
