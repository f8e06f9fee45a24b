/*
 * fuzz_kvpage.c — libFuzzer target for the disk page reader (kvshard/diskfmt.c): whatever bytes
 * a page file holds, kv_disk_page_parse returns an error or a page whose every field and pointer
 * lies inside the buffer, and never reads outside it. A parsed page is re-encoded and must
 * round-trip byte for byte (a version 1 page: field for field, as it is re-encoded as version 2).
 * Each input is also tried with its checksum fixed up, so that mutated headers get past the
 * checksum and exercise the field checks behind it. A page that parses is also checked against a
 * MAC key (kv_disk_page_verify_mac), which must never read outside it either; the seeds with a
 * MAC were made under the key below, so mutations of them reach the MAC comparison. A sealed page
 * is opened (kv_disk_page_unseal, in place) under the seal key below, last, since it changes the
 * buffer: a mutated one must fail to open, never read outside it. Seeds:
 * tests/fuzz/corpus/fuzz_kvpage/ (valid pages of each format, two with a MAC, two sealed).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/sec.h"
#include "kvshard/diskfmt.h"

/* The keys of the *_mac and *_sealed seeds: derived from a secret of 1, 0, 0, ... */
static uint8_t mac_key[KV_DISK_MAC_BYTES], seal_key[KM_SECRET_BYTES];

static void parse_one(uint8_t *buf, size_t size)
{
    kv_disk_page p;
    if (kv_disk_page_parse(buf, size, &p) != 0) return;
    if (p.tokens < buf || p.payload + p.payload_bytes > buf + size) abort();
    if (p.mac && (p.mac < p.payload + p.payload_bytes || p.mac + KV_DISK_MAC_BYTES > buf + size))
        abort();
    if (p.seal && (p.mac || p.seal < p.payload + p.payload_bytes ||
                   p.seal + KV_DISK_SEAL_BYTES + 8 != buf + size))
        abort();
    (void)kv_disk_page_verify_mac(buf, size, &p, mac_key);
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < p.payload_bytes; i += 97) sink ^= p.payload[i];
    size_t n = kv_disk_page_size(p.payload_bytes, p.page_tokens) + (p.seal  ? KV_DISK_SEAL_BYTES
                                                                    : p.mac ? KV_DISK_MAC_BYTES
                                                                            : 0);
    uint8_t *out = malloc(n);
    if (out) {
        if (kv_disk_page_encode(&p, out, n) != n || n != size) abort();
        /* Version 1 pages (formats whose layout did not change) are read and re-encoded as the
         * current version: then the bytes differ in the version and checksum only, so compare
         * what the re-encoded page parses back to. */
        uint32_t version = (uint32_t)buf[8] | (uint32_t)buf[9] << 8 | (uint32_t)buf[10] << 16 |
                           (uint32_t)buf[11] << 24;
        if (version == 1) {
            kv_disk_page q;
            if (kv_disk_page_parse(out, n, &q) || q.format != p.format ||
                q.page_tokens != p.page_tokens || q.n_layers != p.n_layers ||
                q.n_kv_heads != p.n_kv_heads || q.head_dim != p.head_dim || q.index != p.index ||
                memcmp(&q.hash, &p.hash, sizeof q.hash) ||
                memcmp(&q.parent, &p.parent, sizeof q.parent) ||
                q.payload_bytes != p.payload_bytes ||
                memcmp(q.payload, p.payload, p.payload_bytes) ||
                memcmp(q.tokens, p.tokens, 4 * (size_t)p.page_tokens))
                abort();
        } else if (memcmp(out, buf, n)) {
            abort();
        }
        free(out);
    }
    (void)kv_disk_page_unseal(buf, size, &p, seal_key);
    (void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int keyed;
    if (!keyed) {
        const uint8_t secret[KM_SECRET_BYTES] = {1};
        km_secret_derive(secret, "kvmpage1", 1, mac_key);
        km_secret_derive(secret, "kvmseal1", 1, seal_key);
        keyed = 1;
    }
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
