/*
 * pagehash.c — the chained XXH3-128 page hash that names KV pages across the cluster (km.h,
 * "page-hash chain"). Router and worker both call these functions, so a prefix hashed by the
 * router finds the pages the worker stored.
 *
 * xxHash is compiled inline (XXH_INLINE_ALL) so that everything linking common/ — the fuzz
 * targets too — needs no extra library for it. Every input is serialised explicitly
 * little-endian before hashing, so the chain is the same on any host.
 */
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/km.h"

static void km_put_u64le(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static km_pagehash km_pagehash_of(XXH128_hash_t x)
{
    return (km_pagehash){x.low64, x.high64};
}

km_pagehash km_pagehash_seed(const void *model_fp, size_t fp_len, uint64_t cluster_seed,
                             const char *salt, size_t salt_len)
{
    static const char tag[] = "kvmesh-pagehash-v1";
    XXH3_state_t st;
    uint8_t b[8];
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, tag, sizeof tag - 1);
    km_put_u64le(b, model_fp ? fp_len : 0);
    XXH3_128bits_update(&st, b, 8);
    if (model_fp && fp_len) XXH3_128bits_update(&st, model_fp, fp_len);
    km_put_u64le(b, cluster_seed);
    XXH3_128bits_update(&st, b, 8);
    km_put_u64le(b, salt ? salt_len : 0);
    XXH3_128bits_update(&st, b, 8);
    if (salt && salt_len) XXH3_128bits_update(&st, salt, salt_len);
    return km_pagehash_of(XXH3_128bits_digest(&st));
}

km_pagehash km_pagehash_chunk_seed(km_pagehash tenant_seed)
{
    const int32_t mark = -1;
    return km_pagehash_next(tenant_seed, &mark, 1);
}

km_pagehash km_pagehash_next(km_pagehash prev, const int32_t *tokens, int n)
{
    XXH3_state_t st;
    uint8_t c[16], buf[256];
    XXH3_128bits_reset(&st);
    km_pagehash_canonical(prev, c);
    XXH3_128bits_update(&st, c, 16);
    /* Tokens go through a small buffer in little-endian order, 64 at a time. */
    for (int i = 0; i < n;) {
        int m = n - i < 64 ? n - i : 64;
        for (int j = 0; j < m; j++) {
            uint32_t u = (uint32_t)tokens[i + j];
            buf[4 * j] = (uint8_t)u;
            buf[4 * j + 1] = (uint8_t)(u >> 8);
            buf[4 * j + 2] = (uint8_t)(u >> 16);
            buf[4 * j + 3] = (uint8_t)(u >> 24);
        }
        XXH3_128bits_update(&st, buf, (size_t)m * 4);
        i += m;
    }
    return km_pagehash_of(XXH3_128bits_digest(&st));
}

int km_pagehash_chain(km_pagehash seed, const int32_t *tokens, int n_tokens, int page_tokens,
                      km_pagehash *out, int max_out)
{
    if (page_tokens <= 0 || n_tokens < 0 || max_out < 0 || (n_tokens && !tokens)) return KM_EINVAL;
    int n = n_tokens / page_tokens;
    if (n > max_out) n = max_out;
    km_pagehash h = seed;
    for (int i = 0; i < n; i++) {
        h = km_pagehash_next(h, tokens + (size_t)i * page_tokens, page_tokens);
        out[i] = h;
    }
    return n;
}

int km_pagehash_eq(km_pagehash a, km_pagehash b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

void km_pagehash_canonical(km_pagehash h, uint8_t out[16])
{
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(h.hi >> (56 - 8 * i));
        out[8 + i] = (uint8_t)(h.lo >> (56 - 8 * i));
    }
}

km_pagehash km_pagehash_from_canonical(const uint8_t in[16])
{
    km_pagehash h = {0, 0};
    for (int i = 0; i < 8; i++) {
        h.hi = h.hi << 8 | in[i];
        h.lo = h.lo << 8 | in[8 + i];
    }
    return h;
}

void km_pagehash_hex(km_pagehash h, char out[33])
{
    static const char dig[] = "0123456789abcdef";
    uint8_t c[16];
    km_pagehash_canonical(h, c);
    for (int i = 0; i < 16; i++) {
        out[2 * i] = dig[c[i] >> 4];
        out[2 * i + 1] = dig[c[i] & 15];
    }
    out[32] = 0;
}
