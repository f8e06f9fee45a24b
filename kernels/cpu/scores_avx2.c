/*
 * scores_avx2.c — the page scores of sparse attention (kn_ops.page_scores) with AVX2 and F16C: 8
 * channels per instruction, the f16 minimum and maximum widened once per (page, head) and the
 * centre and spread summed in one vector; the leftover channels as scores_ref.c does them. The
 * summaries of the pages ahead are prefetched: they lie side by side only for pages reserved in
 * turn (kvshard's summary slabs). Held to the reference by tests/unit/test_sparse.c (the same
 * pages selected; sums differ only in rounding).
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/internal.h"

/* Pages ahead whose summaries are prefetched. */
#define KN_SCORE_AHEAD 8

static float kn_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void kn_page_scores_avx2(const kn_f16 *const *sums, int n_pages, int head_dim, const float *q,
                         int n_q, float radius, float *score)
{
    const int n8 = head_dim & ~7;
    const size_t bytes = (size_t)head_dim * 2 * sizeof(kn_f16);
    const __m256 rv = _mm256_set1_ps(radius);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < n_pages; i++) {
        if (i + KN_SCORE_AHEAD < n_pages && sums[i + KN_SCORE_AHEAD])
            for (size_t b = 0; b < bytes; b += 64)
                _mm_prefetch((const char *)sums[i + KN_SCORE_AHEAD] + b, _MM_HINT_T0);
        if (!sums[i]) {
            score[i] = INFINITY;
            continue;
        }
        const kn_f16 *mn = sums[i], *mx = sums[i] + head_dim;
        float best = -INFINITY;
        for (int h = 0; h < n_q; h++) {
            const float *qh = q + (size_t)h * head_dim;
            __m256 am = _mm256_setzero_ps(), ah = _mm256_setzero_ps();
            for (int c = 0; c < n8; c += 8) {
                const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + c)));
                const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mx + c)));
                const __m256 qv = _mm256_loadu_ps(qh + c);
                am = _mm256_fmadd_ps(qv, _mm256_add_ps(lo, hi), am);
                ah = _mm256_fmadd_ps(_mm256_and_ps(qv, absm), _mm256_sub_ps(hi, lo), ah);
            }
            float mid = kn_hsum8(_mm256_fmadd_ps(ah, rv, am)), half = 0.0f;
            for (int c = n8; c < head_dim; c++) {
                const float lo = kn_f16_to_f32(mn[c]), hi = kn_f16_to_f32(mx[c]);
                mid += qh[c] * (lo + hi), half += fabsf(qh[c]) * (hi - lo);
            }
            const float s = 0.5f * (mid + radius * half);
            best = s > best ? s : best;
        }
        score[i] = best;
    }
}
