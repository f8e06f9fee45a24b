/*
 * simd_avx2.h — AVX2 helpers shared by ops_avx2.c (f16/bf16 attention, norms, activations)
 * and attn_kv_avx2.c (quantized attention): the vector expf, the shuffle trees that fold
 * per-row partial sums and the int4 channel decoder. Private to kernels/cpu; include only from
 * files built with the AVX2 flags, after <immintrin.h>.
 */
#ifndef KN_SIMD_AVX2_H
#define KN_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#ifndef KN_AI
#define KN_AI static inline __attribute__((always_inline))
#endif

/* e^x for x in [-104, 89] (outside, 0 or inf as expf gives); NaN propagates. */
KN_AI __m256 kn_exp256(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x); /* min/max return x when it is NaN */
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* n is in [-150, 129]: 2^n = 2^n1 * 2^n2 with both halves representable. */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

KN_AI float kn_hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KN_AI float kn_hmax256(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* All-ones in the first n lanes. */
KN_AI __m256 kn_valid8(int n)
{
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* Two vectors of 8 partial sums -> one whose 128-bit lane j holds 4 partials of a_j. */
KN_AI __m256 kn_fold2(__m256 a0, __m256 a1)
{
    return _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20),
                         _mm256_permute2f128_ps(a0, a1, 0x31));
}

/* Four kn_fold2 results (rows 0-1, 2-3, 4-5, 6-7) -> the 8 row sums in row order. */
KN_AI __m256 kn_fold8(__m256 c01, __m256 c23, __m256 c45, __m256 c67)
{
    const __m256 e0 =
        _mm256_add_ps(_mm256_shuffle_ps(c01, c23, 0x44), _mm256_shuffle_ps(c01, c23, 0xEE));
    const __m256 e1 =
        _mm256_add_ps(_mm256_shuffle_ps(c45, c67, 0x44), _mm256_shuffle_ps(c45, c67, 0xEE));
    /* lane j now holds rows j, j+2, j+4, j+6: element 4j+k is row j+2k */
    const __m256 f =
        _mm256_add_ps(_mm256_shuffle_ps(e0, e1, 0x88), _mm256_shuffle_ps(e0, e1, 0xDD));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 8 int4 channels (4 bytes, low nibble first) as floats 0..15, in channel order: channel i is
 * bits [4i, 4i+4) of the little-endian word, so one broadcast, one variable shift per lane and
 * a mask put every nibble in its lane. */
static inline __m256 kn_kv_int4x8(const uint8_t *p)
{
    int32_t x;
    memcpy(&x, p, 4);
    const __m256i w =
        _mm256_srlv_epi32(_mm256_set1_epi32(x), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
}

#endif /* KN_SIMD_AVX2_H */
