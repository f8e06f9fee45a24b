/*
 * fuzz_kvpage.c — libFuzzer target for the disk page reader (kvshard/diskfmt.c): whatever bytes
 * a page file holds, kv_disk_page_parse returns an error or a page whose every field and pointer
 * lies inside the buffer, and never reads outside it. A parsed page is re-encoded and must
 * round-trip byte for byte. Each input is also tried with its checksum fixed up, so that mutated
 * headers get past the checksum and exercise the field checks behind it. Seeds:
 * tests/fuzz/corpus/fuzz_kvpage/ (valid pages of each format).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvshard/kvshard.h"

static void parse_one(uint8_t *buf, size_t size)
{
    kv_disk_page p;
    if (kv_disk_page_parse(buf, size, &p) != 0) return;
    if (p.tokens < buf || p.payload + p.payload_bytes > buf + size) abort();
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < p.payload_bytes; i += 97) sink ^= p.payload[i];
    size_t n = kv_disk_page_size(p.payload_bytes, p.page_tokens);
    uint8_t *out = malloc(n);
    if (out) {
        if (kv_disk_page_encode(&p, out, n) != n || n != size || memcmp(out, buf, n)) abort();
        free(out);
    }
    (void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* A private copy, exactly sized, so ASan sees any read past the end. */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    parse_one(buf, size);
    /* The same bytes with a valid checksum, so mutations reach every check behind it. */
    if (size >= 8) {
        uint64_t h = XXH3_64bits(buf, size - 8);
        for (int i = 0; i < 8; i++) buf[size - 8 + i] = (uint8_t)(h >> (8 * i));
        parse_one(buf, size);
    }
    free(buf);
    return 0;
}
