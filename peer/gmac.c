/*
 * gmac.c — GHASH, the authenticator of AES-GCM, with VPCLMULQDQ on 512-bit registers: 32 blocks
 * per round against the precomputed powers H^32..H^1 and one reduction per round. It
 * makes seal.c's GMAC (pages authenticated, not encrypted) cheaper on CPUs that have it (x86
 * with AVX-512 and VPCLMULQDQ), where OpenSSL 3.0's GCM hashes 16 bytes per carry-less multiply;
 * the tag is GCM's exactly (tested against OpenSSL's, test_xfer_peer), so ends of either kind
 * read each other. Elsewhere seal.c keeps OpenSSL's.
 *
 * The representation is the usual one for carry-less multiplication: each block byte-reversed,
 * H multiplied by x ("twisted"), and the 256-bit product reduced modulo the GCM polynomial with
 * two multiplications by 0xC2000000000000000000000000000001 (two halves of the reflected
 * polynomial), which leaves products of twisted values in the same representation.
 */
#include <string.h>

#include "peer/gmac.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define PR_GH_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,ssse3")))

PR_GH_TARGET static inline __m128i pr_gh_bswap(__m128i x)
{
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* lo ^ mid<<64, hi ^ mid>>64 reduced: the product's 128 bits in the twisted representation */
PR_GH_TARGET static inline __m128i pr_gh_reduce(__m128i lo, __m128i mid, __m128i hi)
{
    const __m128i poly = _mm_set_epi64x((long long)0xC200000000000000ull, 1);
    lo = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
    hi = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
    __m128i t = _mm_clmulepi64_si128(lo, poly, 0x10);
    lo = _mm_xor_si128(_mm_shuffle_epi32(lo, 0x4E), t);
    t = _mm_clmulepi64_si128(lo, poly, 0x10);
    lo = _mm_xor_si128(_mm_shuffle_epi32(lo, 0x4E), t);
    return _mm_xor_si128(lo, hi);
}

PR_GH_TARGET static inline __m128i pr_gh_mul(__m128i a, __m128i h)
{
    __m128i lo = _mm_clmulepi64_si128(a, h, 0x00), hi = _mm_clmulepi64_si128(a, h, 0x11);
    __m128i mid = _mm_xor_si128(_mm_clmulepi64_si128(a, h, 0x01), _mm_clmulepi64_si128(a, h, 0x10));
    return pr_gh_reduce(lo, mid, hi);
}

PR_GH_TARGET static void pr_gh_init(pr_gmac_key *k, const uint8_t h_block[16])
{
    /* twist: H (byte-reversed) times x, reduced */
    __m128i h = pr_gh_bswap(_mm_loadu_si128((const __m128i *)h_block));
    const __m128i top = _mm_srai_epi32(_mm_shuffle_epi32(h, 0xFF), 31);
    const __m128i carry = _mm_slli_si128(_mm_srli_epi32(h, 31), 4);
    h = _mm_xor_si128(_mm_or_si128(_mm_slli_epi32(h, 1), carry),
                      _mm_and_si128(top, _mm_set_epi64x((long long)0xC200000000000000ull, 1)));
    __m128i p = h;
    for (int i = 0; i < PR_GMAC_POWERS; i++) { /* pow[P - 1 - i] = H^(i+1): pow[0] is H^P */
        _mm_storeu_si128((__m128i *)k->pow[PR_GMAC_POWERS - 1 - i], p);
        p = pr_gh_mul(p, h);
    }
}

/* acc = (acc ^ X_0) H^n ^ X_1 H^(n-1) ^ ... over n whole blocks */
PR_GH_TARGET static void pr_gh_blocks(const pr_gmac_key *k, uint8_t acc_b[16], const uint8_t *in,
                                      size_t n)
{
    const __m512i bs =
        _mm512_broadcast_i32x4(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m128i acc = _mm_loadu_si128((const __m128i *)acc_b);
    for (; n >= PR_GMAC_POWERS; n -= PR_GMAC_POWERS, in += 16 * PR_GMAC_POWERS) {
        __m512i d = _mm512_shuffle_epi8(_mm512_loadu_si512(in), bs),
                h = _mm512_loadu_si512(k->pow[0]);
        d = _mm512_xor_si512(d, _mm512_zextsi128_si512(acc));
        __m512i lo = _mm512_clmulepi64_epi128(d, h, 0x00),
                hi = _mm512_clmulepi64_epi128(d, h, 0x11);
        __m512i mid = _mm512_xor_si512(_mm512_clmulepi64_epi128(d, h, 0x01),
                                       _mm512_clmulepi64_epi128(d, h, 0x10));
        for (int j = 1; j < PR_GMAC_POWERS / 4; j++) {
            d = _mm512_shuffle_epi8(_mm512_loadu_si512(in + 64 * j), bs);
            h = _mm512_loadu_si512(k->pow[4 * j]);
            lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(d, h, 0x00));
            hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(d, h, 0x11));
            mid = _mm512_ternarylogic_epi64(mid, _mm512_clmulepi64_epi128(d, h, 0x01),
                                            _mm512_clmulepi64_epi128(d, h, 0x10), 0x96);
        }
        /* the four lanes' sums, then one reduction */
        const __m256i lo2 =
            _mm256_xor_si256(_mm512_castsi512_si256(lo), _mm512_extracti64x4_epi64(lo, 1));
        const __m256i hi2 =
            _mm256_xor_si256(_mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1));
        const __m256i mid2 =
            _mm256_xor_si256(_mm512_castsi512_si256(mid), _mm512_extracti64x4_epi64(mid, 1));
        acc = pr_gh_reduce(
            _mm_xor_si128(_mm256_castsi256_si128(lo2), _mm256_extracti128_si256(lo2, 1)),
            _mm_xor_si128(_mm256_castsi256_si128(mid2), _mm256_extracti128_si256(mid2, 1)),
            _mm_xor_si128(_mm256_castsi256_si128(hi2), _mm256_extracti128_si256(hi2, 1)));
    }
    const __m128i h = _mm_loadu_si128((const __m128i *)k->pow[PR_GMAC_POWERS - 1]);
    for (; n; n--, in += 16)
        acc = pr_gh_mul(_mm_xor_si128(acc, pr_gh_bswap(_mm_loadu_si128((const __m128i *)in))), h);
    _mm_storeu_si128((__m128i *)acc_b, acc);
}

PR_GH_TARGET static void pr_gh_final(uint8_t acc_b[16], uint8_t out[16])
{
    _mm_storeu_si128((__m128i *)out, pr_gh_bswap(_mm_loadu_si128((const __m128i *)acc_b)));
}

int pr_gmac_fast(void)
{
    static int have = -1;
    if (have < 0)
        have = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq") &&
               __builtin_cpu_supports("pclmul");
    return have;
}
#else
int pr_gmac_fast(void)
{
    return 0;
}
static void pr_gh_init(pr_gmac_key *k, const uint8_t h_block[16]) {}
static void pr_gh_blocks(const pr_gmac_key *k, uint8_t acc[16], const uint8_t *in, size_t n) {}
static void pr_gh_final(uint8_t acc[16], uint8_t out[16]) {}
#endif

void pr_gmac_key_init(pr_gmac_key *k, const uint8_t h_block[16])
{
    pr_gh_init(k, h_block);
}

void pr_gmac_begin(pr_gmac *g)
{
    memset(g->acc, 0, sizeof g->acc);
    g->nbuf = 0;
    g->len = 0;
}

void pr_gmac_update(pr_gmac *g, const pr_gmac_key *k, const uint8_t *in, size_t len)
{
    g->len += len;
    if (g->nbuf) { /* a block begun by the last piece */
        const size_t take = len < 16 - g->nbuf ? len : 16 - g->nbuf;
        memcpy(g->buf + g->nbuf, in, take);
        g->nbuf += (unsigned)take;
        in += take;
        len -= take;
        if (g->nbuf < 16) return;
        pr_gh_blocks(k, g->acc, g->buf, 1);
        g->nbuf = 0;
    }
    pr_gh_blocks(k, g->acc, in, len / 16);
    memcpy(g->buf, in + (len & ~(size_t)15), len & 15);
    g->nbuf = (unsigned)(len & 15);
}

void pr_gmac_end(pr_gmac *g, const pr_gmac_key *k, uint8_t s[16])
{
    if (g->nbuf) {
        memset(g->buf + g->nbuf, 0, 16 - g->nbuf);
        pr_gh_blocks(k, g->acc, g->buf, 1);
    }
    /* the lengths block: the authenticated data's bits, then no ciphertext */
    uint8_t lb[16] = {0};
    const uint64_t bits = g->len * 8;
    for (int i = 0; i < 8; i++) lb[i] = (uint8_t)(bits >> (56 - 8 * i));
    pr_gh_blocks(k, g->acc, lb, 1);
    pr_gh_final(g->acc, s);
}
