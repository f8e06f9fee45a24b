/*
 * scores_avx512.c — the page scores of sparse attention (kn_ops.page_scores) with AVX-512: 16
 * channels per instruction, the f16 minimum and maximum widened once per (page, head) and the
 * centre and spread summed in one vector; the leftover channels as scores_ref.c does them. The
 * summaries of the pages ahead are prefetched: they lie side by side only for pages reserved in
 * turn (kvshard's summary slabs). Held to the reference by tests/unit/test_sparse.c.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/internal.h"

/* Pages ahead whose summaries are prefetched. */
#define KN_SCORE_AHEAD 8

void kn_page_scores_avx512(const kn_f16 *const *sums, int n_pages, int head_dim, const float *q,
                           int n_q, float radius, float *score)
{
    const int n16 = head_dim & ~15;
    const size_t bytes = (size_t)head_dim * 2 * sizeof(kn_f16);
    const __m512 rv = _mm512_set1_ps(radius);
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
            __m512 am = _mm512_setzero_ps(), ah = _mm512_setzero_ps();
            for (int c = 0; c < n16; c += 16) {
                const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + c)));
                const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mx + c)));
                const __m512 qv = _mm512_loadu_ps(qh + c);
                am = _mm512_fmadd_ps(qv, _mm512_add_ps(lo, hi), am);
                ah = _mm512_fmadd_ps(_mm512_abs_ps(qv), _mm512_sub_ps(hi, lo), ah);
            }
            float mid = _mm512_reduce_add_ps(_mm512_fmadd_ps(ah, rv, am)), half = 0.0f;
            for (int c = n16; c < head_dim; c++) {
                const float lo = kn_f16_to_f32(mn[c]), hi = kn_f16_to_f32(mx[c]);
                mid += qh[c] * (lo + hi), half += fabsf(qh[c]) * (hi - lo);
            }
            const float s = 0.5f * (mid + radius * half);
            best = s > best ? s : best;
        }
        score[i] = best;
    }
}
