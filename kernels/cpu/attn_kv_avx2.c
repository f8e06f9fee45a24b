/*
 * attn_kv_avx2.c — attention over quantized and mixed-format KV pages with AVX2 + FMA + F16C.
 *
 * Views whose pages are all f16, bf16, fp8, int8 (head_dim % 16 == 0) or int4 (head_dim % 32 ==
 * 0), in one format or mixed, without attn_mass, go back to the blocked body of the f16 kernel
 * (kn_att_fast_avx2, attn_simd.h), which decodes their rows in registers.
 *
 * Everything else (attn_mass, other head sizes) decodes one row at a time, 8 channels per
 * instruction sequence, into attn_kv.h's body shared with the reference.
 */
#include <immintrin.h>

#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx2.h"

static inline __m256 kn_kv_fp8x8(const uint8_t *p)
{
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void kn_kv_row_avx2(kn_kv_format f, const kn_kv_blk *b,
                                                                 int t, int hd, int v, float *row)
{
    int c = 0;
    const int n8 = hd & ~7;
    switch (f) {
    case KN_KV_F16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n8; c += 8)
            _mm256_store_ps(row + c,
                            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * c))));
        break;
    }
    case KN_KV_BF16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n8; c += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * c)));
            _mm256_store_ps(row + c, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        break;
    }
    case KN_KV_FP8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n8; c += 8) { /* 8 lanes never straddle two scale groups */
            const __m256 sc = _mm256_set1_ps(kn_kv_group_scale(scs, t, hd, c) * 256.0f);
            _mm256_store_ps(row + c, _mm256_mul_ps(kn_kv_fp8x8(src + c), sc));
        }
        break;
    }
    case KN_KV_INT8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n8; c += 8) { /* 8 lanes never straddle two scale groups */
            const __m256 sc = _mm256_set1_ps(kn_kv_group_scale(scs, t, hd, c));
            __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + c)));
            _mm256_store_ps(row + c, _mm256_mul_ps(_mm256_cvtepi32_ps(w), sc));
        }
        break;
    }
    case KN_KV_INT4: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * (hd / 2);
        if (!v) {
            for (; c < n8; c += 8) {
                __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b->ks + 2 * c)));
                __m256 m =
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b->ks + 2 * (hd + c))));
                _mm256_store_ps(row + c, _mm256_fmadd_ps(kn_kv_int4x8(src + c / 2), s, m));
            }
        } else if (hd % 32 == 0) {
            const uint8_t *g = b->vs + (size_t)t * (hd / 32) * 4;
            for (; c < hd; c += 8) {
                const uint8_t *gp = g + (size_t)(c / 32) * 4;
                __m256 s = _mm256_set1_ps(kn_kv_h2f(gp)), m = _mm256_set1_ps(kn_kv_h2f(gp + 2));
                _mm256_store_ps(row + c, _mm256_fmadd_ps(kn_kv_int4x8(src + c / 2), s, m));
            }
        }
        break;
    }
    }
    if (c < hd) kn_kv_row_tail(f, b, t, hd, v, c, row);
}

static inline __attribute__((always_inline)) float kn_kv_dot_avx2(const float *a, const float *b,
                                                                  int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    float s = _mm_cvtss_f32(r);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void kn_kv_axpy_avx2(float *y, float a, const float *x,
                                                                  int n)
{
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

void kn_attention_kv_avx2(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                          float *out)
{
    if (kn_att_fast_avx2(kv, head_dim, q, n_q, scale, out)) return; /* attn_simd.h */
    kn_attn_kv_body(kv, head_dim, q, n_q, scale, out, kn_kv_row_avx2, kn_kv_dot_avx2,
                    kn_kv_axpy_avx2);
}
