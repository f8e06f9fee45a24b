/*
 * diskfmt.h — private to kvshard (and its tests and fuzz target): the page layout of each format
 * and the disk tier's page file format. Pure functions over memory (diskfmt.c): no I/O, no
 * store, so tests/fuzz/fuzz_kvpage.c exercises exactly the code that reads files at run time.
 */
#ifndef KVSHARD_DISKFMT_H
#define KVSHARD_DISKFMT_H

#include <stddef.h>
#include <stdint.h>

#include "common/sec.h"
#include "kvshard/kvshard.h"

/* Page layout of one format: per (layer, head) a unit of [K data][V data][K scales][V scales]. */
typedef struct kv_layout {
    size_t kd, vd, ks, vs; /* bytes of each part */
    size_t unit;           /* kd + vd + ks + vs; 0 when the format cannot hold this shape */
    size_t page_bytes;     /* unit * n_layers * n_kv_heads */
} kv_layout;

void kv_layout_init(kv_layout *lay, kv_format f, int pt, int hd, int n_layers, int n_heads);

#define KV_DISK_MAC_BYTES  32
#define KV_DISK_SEAL_BYTES (KM_SEAL_NONCE_BYTES + KM_SEAL_TAG_BYTES)

/* A disk page file: header, token ids, payload, an optional MAC or seal, trailing checksum
 * (docs/kvshard.md). A sealed page's token ids and payload are encrypted where they lie, until
 * kv_disk_page_unseal decrypts them. */
typedef struct kv_disk_page {
    kv_format format;
    int page_tokens, n_layers, n_kv_heads, head_dim;
    km_pagehash hash, parent; /* the page's chain link and the previous one */
    int index;                /* position of the page in its chain */
    const uint8_t *tokens;    /* page_tokens little-endian int32, into the buffer */
    const uint8_t *payload;   /* into the buffer */
    size_t payload_bytes;
    const uint8_t *mac; /* KV_DISK_MAC_BYTES into the buffer when the page carries a MAC, or NULL */
    const uint8_t *seal; /* nonce then tag (KV_DISK_SEAL_BYTES) into the buffer when sealed */
    int position_free;   /* a chunk's page (kvshard's KV_PAGE_POSFREE): flags bit 2 */
} kv_disk_page;

/* Validates a whole page file held in memory (header fields, sizes, checksum, that the hash
 * matches its tokens' chain link is NOT checkable here). 0, KM_EFORMAT or KM_ECORRUPT; never
 * reads outside [buf, buf+len). */
int kv_disk_page_parse(const void *buf, size_t len, kv_disk_page *out);
/* Serialises a page into buf (size from kv_disk_page_size, + KV_DISK_MAC_BYTES when p->mac is
 * set, + KV_DISK_SEAL_BYTES when p->seal is: those bytes, and tokens and payload, are copied as
 * they are); returns bytes written, 0 when cap is too small. */
size_t kv_disk_page_size(size_t payload_bytes, int page_tokens);
/* Where the payload starts in a page file (every version, sealed or not). */
size_t kv_disk_page_payload_offset(int page_tokens);
size_t kv_disk_page_encode(const kv_disk_page *p, void *buf, size_t cap);
/* The same with a MAC computed under key (a key derived from the cluster secret): keyed
 * BLAKE2b-256 of every byte before it; cap >= kv_disk_page_size + KV_DISK_MAC_BYTES. */
size_t kv_disk_page_encode_mac(const kv_disk_page *p, const uint8_t key[KV_DISK_MAC_BYTES],
                               void *buf, size_t cap);
/* The same sealed under key (a key derived from the cluster secret, its own context): token ids
 * and payload encrypted and, with the header, authenticated (km_seal: XChaCha20-Poly1305, a
 * random nonce per file); cap >= kv_disk_page_size + KV_DISK_SEAL_BYTES. */
size_t kv_disk_page_encode_sealed(const kv_disk_page *p, const uint8_t key[KM_SECRET_BYTES],
                                  void *buf, size_t cap);
/* For a sealed page parse accepted from [buf, buf+len): decrypts its token ids and payload in
 * place (p->tokens and p->payload then read plaintext) and returns 0 when the seal verifies under
 * key; KM_ECORRUPT, the buffer unchanged, when it is not sealed or does not verify. */
int kv_disk_page_unseal(void *buf, size_t len, const kv_disk_page *p,
                        const uint8_t key[KM_SECRET_BYTES]);
/* For a page parse accepted from [buf, buf+len): 0 when it carries a MAC and the MAC verifies
 * under key (constant-time compare), KM_ECORRUPT otherwise (no MAC, or a wrong one). */
int kv_disk_page_verify_mac(const void *buf, size_t len, const kv_disk_page *p,
                            const uint8_t key[KV_DISK_MAC_BYTES]);

#endif
