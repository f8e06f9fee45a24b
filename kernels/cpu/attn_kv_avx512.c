/*
 * attn_kv_avx512.c — attention over quantized and mixed-format KV pages with AVX-512.
 *
 * Views whose pages are all f16, bf16, fp8, int8 (head_dim % 16 == 0) or int4 (head_dim % 32 ==
 * 0), in one format or mixed, without attn_mass, go back to the blocked body of the f16 kernel
 * (kn_att_fast_avx512, attn_simd.h), which decodes their rows in registers.
 *
 * Everything else (attn_mass, other head sizes) decodes one row at a time, 16 channels per
 * instruction sequence, into attn_kv.h's body shared with the reference.
 */
#include <immintrin.h>

#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx512.h"

static inline __m512 kn_kv_fp8x16(const uint8_t *p)
{
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void
kn_kv_row_avx512(kn_kv_format f, const kn_kv_blk *b, int t, int hd, int v, float *row)
{
    int c = 0;
    const int n16 = hd & ~15;
    switch (f) {
    case KN_KV_F16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n16; c += 16)
            _mm512_store_ps(row + c,
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * c))));
        break;
    }
    case KN_KV_BF16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n16; c += 16) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * c)));
            _mm512_store_ps(row + c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
        break;
    }
    case KN_KV_FP8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n16; c += 16) { /* 16 lanes never straddle two scale groups */
            const __m512 sc = _mm512_set1_ps(kn_kv_group_scale(scs, t, hd, c) * 256.0f);
            _mm512_store_ps(row + c, _mm512_mul_ps(kn_kv_fp8x16(src + c), sc));
        }
        break;
    }
    case KN_KV_INT8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n16; c += 16) { /* 16 lanes never straddle two scale groups */
            const __m512 sc = _mm512_set1_ps(kn_kv_group_scale(scs, t, hd, c));
            __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + c)));
            _mm512_store_ps(row + c, _mm512_mul_ps(_mm512_cvtepi32_ps(w), sc));
        }
        break;
    }
    case KN_KV_INT4: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * (hd / 2);
        if (!v) {
            for (; c < n16; c += 16) {
                __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b->ks + 2 * c)));
                __m512 m =
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b->ks + 2 * (hd + c))));
                _mm512_store_ps(row + c, _mm512_fmadd_ps(kn_kv_int4x16(src + c / 2), s, m));
            }
        } else if (hd % 32 == 0) {
            const uint8_t *g = b->vs + (size_t)t * (hd / 32) * 4;
            for (; c < hd; c += 16) {
                const uint8_t *gp = g + (size_t)(c / 32) * 4;
                __m512 s = _mm512_set1_ps(kn_kv_h2f(gp)), m = _mm512_set1_ps(kn_kv_h2f(gp + 2));
                _mm512_store_ps(row + c, _mm512_fmadd_ps(kn_kv_int4x16(src + c / 2), s, m));
            }
        }
        break;
    }
    }
    if (c < hd) kn_kv_row_tail(f, b, t, hd, v, c, row);
}

static inline __attribute__((always_inline)) float kn_kv_dot_avx512(const float *a, const float *b,
                                                                    int n)
{
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void kn_kv_axpy_avx512(float *y, float a,
                                                                    const float *x, int n)
{
    const __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i,
                         _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

void kn_attention_kv_avx512(const kn_kv_view *kv, int head_dim, const float *q, int n_q,
                            float scale, float *out)
{
    if (kn_att_fast_avx512(kv, head_dim, q, n_q, scale, out)) return; /* attn_simd.h */
    kn_attn_kv_body(kv, head_dim, q, n_q, scale, out, kn_kv_row_avx512, kn_kv_dot_avx512,
                    kn_kv_axpy_avx512);
}
