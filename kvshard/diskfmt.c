/*
 * diskfmt.c — the page file format of the disk tier, and the page layout sizes it checks
 * against. Pure functions over memory, with no I/O and no dependency beyond xxHash, so the fuzz
 * target (tests/fuzz/fuzz_kvpage.c) exercises exactly the code that reads files at run time.
 *
 * A file is, little-endian:
 *   0   "KVMPAGE1"                 8   u32 version (2)
 *   12  u32 format                 16  u32 page_tokens   20 u32 n_layers
 *   24  u32 n_kv_heads             28  u32 head_dim
 *   32  u64 hash.lo, hash.hi       48  u64 parent.lo, parent.hi
 *   64  u32 index in the chain     68  u32 flags (bit 0: a MAC follows the payload; bit 1:
 *                                              sealed; not both; bit 2: position-free)
 *   72  u64 payload_bytes
 *   80  i32 tokens[page_tokens]    then the payload (the page as it sits in RAM)
 *   [32 bytes: keyed BLAKE2b-256 of every byte before it, when flags bit 0 is set]
 *   [24 bytes nonce, 16 bytes tag, when flags bit 1 is set: tokens and payload are encrypted]
 *   end u64 XXH3_64 of every byte before it
 * The checksum covers the header, so a torn or bit-flipped file of any kind fails it. It guards
 * against accidents, not against someone who rewrites a page and recomputes it: with a cluster
 * secret, pages carry the MAC (key derived from the secret, common/secret.c), and the disk tier
 * serves only pages whose MAC verifies (kv_disk_page_verify_mac). Pages without a MAC are the
 * same bytes as before flags existed (the field was a reserved 0).
 *
 * Sealed pages (flags bit 1, what a store with a cluster secret writes) hide what a MAC only
 * vouches for: token ids and payload are encrypted in place with XChaCha20-Poly1305 under a key
 * derived from the secret for this alone (context "kvmseal1"), a random nonce per file, and the
 * 80-byte header as associated data, so the tag authenticates header, tokens and payload. The
 * hashes in the header (and the file's name) stay readable: the store must find pages by them.
 *
 * Versions: 2 gave fp8 pages one scale per 16 channels of a row (version 1: one per row). The
 * other formats' layouts are the same in both, so version 1 files of those are still read;
 * a version 1 fp8 file is refused (KM_EFORMAT) even where its size would match (head_dim 16).
 * Flags bit 2 (a chunk's page) came within version 2: files without it read as before, and a
 * reader that predates it refuses a file with it (KM_EFORMAT: dropped like a corrupt page).
 */
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/sec.h"
#include "kvshard/diskfmt.h"

#define KV_DISK_HDR       80
#define KV_DISK_MAGIC     "KVMPAGE1"
#define KV_DISK_VERSION   2
#define KV_DISK_FLAG_MAC  1u
#define KV_DISK_FLAG_SEAL 2u
#define KV_DISK_FLAG_FREE 4u /* a chunk's page: position-free (docs/blend.md) */

static size_t kv_round16(size_t n)
{
    return (n + 15) & ~(size_t)15;
}

void kv_layout_init(kv_layout *lay, kv_format f, int pt, int hd, int n_layers, int n_heads)
{
    memset(lay, 0, sizeof *lay);
    size_t n = (size_t)pt * hd;
    switch (f) {
    case KN_KV_F16:
    case KN_KV_BF16:
        lay->kd = lay->vd = n * 2;
        break;
    case KN_KV_FP8:
    case KN_KV_INT8: /* one scale per 16 channels of a row */
        lay->kd = lay->vd = kv_round16(n);
        lay->ks = lay->vs = kv_round16((size_t)pt * (hd % 16 ? 1 : hd / 16) * 2);
        break;
    case KN_KV_INT4: {
        if (hd % 2) return; /* unsupported: unit stays 0 */
        int vg = hd % 32 == 0 ? 32 : hd;
        lay->kd = lay->vd = kv_round16(n / 2);
        lay->ks = kv_round16((size_t)hd * 4);
        lay->vs = kv_round16((size_t)pt * (hd / vg) * 4);
        break;
    }
    default:
        return;
    }
    lay->unit = lay->kd + lay->vd + lay->ks + lay->vs;
    lay->page_bytes = lay->unit * n_layers * n_heads;
}

static uint32_t kv_get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t kv_get64(const uint8_t *p)
{
    return kv_get32(p) | (uint64_t)kv_get32(p + 4) << 32;
}

static void kv_set32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void kv_set64(uint8_t *p, uint64_t v)
{
    kv_set32(p, (uint32_t)v);
    kv_set32(p + 4, (uint32_t)(v >> 32));
}

size_t kv_disk_page_size(size_t payload_bytes, int page_tokens)
{
    return KV_DISK_HDR + (size_t)page_tokens * 4 + payload_bytes + 8;
}

size_t kv_disk_page_payload_offset(int page_tokens)
{
    return KV_DISK_HDR + (size_t)page_tokens * 4;
}

/* Bytes after the payload, before the checksum. */
static size_t kv_disk_trailer(const kv_disk_page *p)
{
    return p->seal ? KV_DISK_SEAL_BYTES : p->mac ? KV_DISK_MAC_BYTES : 0;
}

size_t kv_disk_page_encode(const kv_disk_page *p, void *buf, size_t cap)
{
    size_t n = kv_disk_page_size(p->payload_bytes, p->page_tokens) + kv_disk_trailer(p);
    if (cap < n) return 0;
    uint8_t *b = buf;
    memset(b, 0, KV_DISK_HDR);
    memcpy(b, KV_DISK_MAGIC, 8);
    kv_set32(b + 8, KV_DISK_VERSION);
    kv_set32(b + 12, (uint32_t)p->format);
    kv_set32(b + 16, (uint32_t)p->page_tokens);
    kv_set32(b + 20, (uint32_t)p->n_layers);
    kv_set32(b + 24, (uint32_t)p->n_kv_heads);
    kv_set32(b + 28, (uint32_t)p->head_dim);
    kv_set64(b + 32, p->hash.lo);
    kv_set64(b + 40, p->hash.hi);
    kv_set64(b + 48, p->parent.lo);
    kv_set64(b + 56, p->parent.hi);
    kv_set32(b + 64, (uint32_t)p->index);
    kv_set32(b + 68, (p->seal  ? KV_DISK_FLAG_SEAL
                      : p->mac ? KV_DISK_FLAG_MAC
                               : 0) |
                         (p->position_free ? KV_DISK_FLAG_FREE : 0));
    kv_set64(b + 72, p->payload_bytes);
    memcpy(b + KV_DISK_HDR, p->tokens, (size_t)p->page_tokens * 4);
    memcpy(b + KV_DISK_HDR + (size_t)p->page_tokens * 4, p->payload, p->payload_bytes);
    if (p->seal)
        memcpy(b + n - 8 - KV_DISK_SEAL_BYTES, p->seal, KV_DISK_SEAL_BYTES);
    else if (p->mac)
        memcpy(b + n - 8 - KV_DISK_MAC_BYTES, p->mac, KV_DISK_MAC_BYTES);
    kv_set64(b + n - 8, XXH3_64bits(b, n - 8));
    return n;
}

size_t kv_disk_page_encode_mac(const kv_disk_page *p, const uint8_t key[KV_DISK_MAC_BYTES],
                               void *buf, size_t cap)
{
    /* Encoded with a zero MAC first, so the layout (and the bytes the MAC covers, all before it)
     * is fixed; the real MAC is then computed over them and written in its place. */
    static const uint8_t zero_mac[KV_DISK_MAC_BYTES];
    kv_disk_page q = *p;
    q.mac = zero_mac;
    q.seal = NULL;
    size_t n = kv_disk_page_encode(&q, buf, cap);
    if (!n) return 0;
    uint8_t *b = buf, *mac = b + n - 8 - KV_DISK_MAC_BYTES;
    km_mac(key, b, (size_t)(mac - b), mac);
    kv_set64(b + n - 8, XXH3_64bits(b, n - 8));
    return n;
}

size_t kv_disk_page_encode_sealed(const kv_disk_page *p, const uint8_t key[KM_SECRET_BYTES],
                                  void *buf, size_t cap)
{
    static const uint8_t zero_seal[KV_DISK_SEAL_BYTES];
    kv_disk_page q = *p;
    q.mac = NULL;
    q.seal = zero_seal;
    size_t n = kv_disk_page_encode(&q, buf, cap);
    if (!n) return 0;
    uint8_t *b = buf, *nonce = b + n - 8 - KV_DISK_SEAL_BYTES;
    km_seal(key, b, KV_DISK_HDR, b + KV_DISK_HDR, (size_t)p->page_tokens * 4 + p->payload_bytes,
            nonce, nonce + KM_SEAL_NONCE_BYTES);
    kv_set64(b + n - 8, XXH3_64bits(b, n - 8));
    return n;
}

int kv_disk_page_unseal(void *buf, size_t len, const kv_disk_page *p,
                        const uint8_t key[KM_SECRET_BYTES])
{
    uint8_t *b = buf;
    if (!p->seal || p->seal < b || p->seal + KV_DISK_SEAL_BYTES + 8 != b + len) return KM_ECORRUPT;
    size_t sealed = (size_t)p->page_tokens * 4 + p->payload_bytes;
    if (KV_DISK_HDR + sealed + KV_DISK_SEAL_BYTES + 8 != len) return KM_ECORRUPT;
    return km_unseal(key, b, KV_DISK_HDR, b + KV_DISK_HDR, sealed, p->seal,
                     p->seal + KM_SEAL_NONCE_BYTES);
}

int kv_disk_page_verify_mac(const void *buf, size_t len, const kv_disk_page *p,
                            const uint8_t key[KV_DISK_MAC_BYTES])
{
    const uint8_t *b = buf;
    if (!p->mac || p->mac < b || p->mac + KV_DISK_MAC_BYTES + 8 != b + len) return KM_ECORRUPT;
    return km_mac_verify(key, b, (size_t)(p->mac - b), p->mac);
}

int kv_disk_page_parse(const void *buf, size_t len, kv_disk_page *out)
{
    const uint8_t *b = buf;
    memset(out, 0, sizeof *out);
    if (!b || len < KV_DISK_HDR + 8 || memcmp(b, KV_DISK_MAGIC, 8)) return KM_EFORMAT;
    const uint32_t version = kv_get32(b + 8);
    uint32_t f = kv_get32(b + 12), pt = kv_get32(b + 16), nl = kv_get32(b + 20);
    if (version != KV_DISK_VERSION && !(version == 1 && f != KN_KV_FP8)) return KM_EFORMAT;
    uint32_t nh = kv_get32(b + 24), hd = kv_get32(b + 28), idx = kv_get32(b + 64);
    uint32_t flags = kv_get32(b + 68);
    uint64_t payload = kv_get64(b + 72);
    if (f >= KV_FORMAT_COUNT || pt < 1 || pt > 4096 || (pt & (pt - 1)) || nl < 1 || nl > 4096 ||
        nh < 1 || nh > 4096 || hd < 1 || hd > 1024 || idx > INT32_MAX ||
        (flags & ~(KV_DISK_FLAG_MAC | KV_DISK_FLAG_SEAL | KV_DISK_FLAG_FREE)) ||
        (flags & (KV_DISK_FLAG_MAC | KV_DISK_FLAG_SEAL)) ==
            (KV_DISK_FLAG_MAC | KV_DISK_FLAG_SEAL) ||
        (flags && version < 2))
        return KM_EFORMAT;
    const size_t trailer = (flags & KV_DISK_FLAG_MAC)    ? KV_DISK_MAC_BYTES
                           : (flags & KV_DISK_FLAG_SEAL) ? KV_DISK_SEAL_BYTES
                                                         : 0;
    kv_layout lay;
    kv_layout_init(&lay, (kv_format)f, (int)pt, (int)hd, (int)nl, (int)nh);
    if (!lay.unit || payload != lay.page_bytes) return KM_EFORMAT;
    /* Sizes are bounded above (4096 * 4096 * ...) well inside size_t, so this cannot wrap. */
    if (len != kv_disk_page_size(payload, (int)pt) + trailer) return KM_EFORMAT;
    if (XXH3_64bits(b, len - 8) != kv_get64(b + len - 8)) return KM_ECORRUPT;
    out->format = (kv_format)f;
    out->page_tokens = (int)pt;
    out->n_layers = (int)nl;
    out->n_kv_heads = (int)nh;
    out->head_dim = (int)hd;
    out->hash = (km_pagehash){kv_get64(b + 32), kv_get64(b + 40)};
    out->parent = (km_pagehash){kv_get64(b + 48), kv_get64(b + 56)};
    out->index = (int)idx;
    out->tokens = b + KV_DISK_HDR;
    out->payload = b + KV_DISK_HDR + (size_t)pt * 4;
    out->payload_bytes = payload;
    out->mac = (flags & KV_DISK_FLAG_MAC) ? b + len - 8 - trailer : NULL;
    out->seal = (flags & KV_DISK_FLAG_SEAL) ? b + len - 8 - trailer : NULL;
    out->position_free = (flags & KV_DISK_FLAG_FREE) != 0;
    return 0;
}
