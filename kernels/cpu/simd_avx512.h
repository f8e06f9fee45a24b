/*
 * simd_avx512.h — AVX-512 helpers shared by ops_avx512.c (f16/bf16 attention, norms, activations)
 * and attn_kv_avx512.c (quantized attention): the vector expf, the shuffle trees that fold
 * per-row partial sums and the int4 channel decoder. Private to kernels/cpu; include only from
 * files built with the AVX-512 flags, after <immintrin.h>.
 */
#ifndef KN_SIMD_AVX512_H
#define KN_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#ifndef KN_AI
#define KN_AI static inline __attribute__((always_inline))
#endif

/* The first n lanes (n may be <= 0 or >= 16). */
static inline __mmask16 kn_mask16(int n)
{
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* e^x for x in [-104, 89] (outside, 0 or inf as expf gives); NaN propagates. Cephes expf: x =
 * n*ln2 + r, |r| <= ln2/2, e^r by a degree-7 polynomial, 2^n applied with scalef (which also
 * produces the subnormal and overflow results). */
KN_AI __m512 kn_exp512(__m512 x)
{
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x); /* min/max return x when it is NaN */
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Four vectors of 16 partial sums -> one vector whose 128-bit lane j holds 4 partials of a_j. */
KN_AI __m512 kn_fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
    const __m512 c01 =
        _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 c23 =
        _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88),
                         _mm512_shuffle_f32x4(c01, c23, 0xDD));
}

/* Four kn_fold4 results (rows 0-3, 4-7, 8-11, 12-15) -> the 16 row sums in row order. */
KN_AI __m512 kn_fold16(__m512 d0, __m512 d1, __m512 d2, __m512 d3)
{
    const __m512 e01 =
        _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xEE));
    const __m512 e23 =
        _mm512_add_ps(_mm512_shuffle_ps(d2, d3, 0x44), _mm512_shuffle_ps(d2, d3, 0xEE));
    /* lane j now holds rows j, j+4, j+8, j+12: element 4j+k is row j+4k */
    const __m512 f =
        _mm512_add_ps(_mm512_shuffle_ps(e01, e23, 0x88), _mm512_shuffle_ps(e01, e23, 0xDD));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, f);
}

/* 16 int4 channels (8 bytes, low nibble first) as floats 0..15, in channel order: the two
 * 32-bit words spread over lanes 0-7 and 8-15, then one variable shift per lane and a mask
 * (as simd_avx2.h's kn_kv_int4x8; faster over int4 pages than widening bytes to words:
 * docs/benchmarks.md, "Figures behind code comments"). */
KN_AI __m512 kn_kv_int4x16(const uint8_t *p)
{
    const __m512i w =
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)p)));
    const __m512i n = _mm512_srlv_epi32(
        w, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
    return _mm512_cvtepi32_ps(_mm512_and_si512(n, _mm512_set1_epi32(15)));
}

#endif /* KN_SIMD_AVX512_H */
