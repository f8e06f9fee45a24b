/*
 * scores_avx512.c — the page scores of sparse attention (kn_ops.page_scores) with AVX-512: 16
 * channels per instruction (centre and spread summed in one vector), the leftover channels as
 * scores_ref.c does them; the next pages' summaries prefetched. Held to the reference by
 * tests/unit/test_sparse.c.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/internal.h"

/* Pages ahead whose summaries are prefetched: each page's lie in its own allocation. */
#define KN_SCORE_AHEAD 4

void kn_page_scores_avx512(const float *const *sums, int n_pages, int head_dim, const float *q,
                           int n_q, float radius, float *score)
{
    const int n16 = head_dim & ~15;
    const __m512 rv = _mm512_set1_ps(radius);
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int i = 0; i < n_pages; i++) {
        if (!sums[i]) {
            score[i] = INFINITY;
            continue;
        }
        const float *mn = sums[i], *mx = sums[i] + head_dim;
        if (i + KN_SCORE_AHEAD < n_pages && sums[i + KN_SCORE_AHEAD]) /* pages lie apart */
            for (int c = 0; c < 2 * head_dim; c += 16)
                _mm_prefetch((const char *)(sums[i + KN_SCORE_AHEAD] + c), _MM_HINT_T0);
        float best = -INFINITY;
        for (int h = 0; h < n_q; h++) {
            const float *qh = q + (size_t)h * head_dim;
            __m512 am = _mm512_setzero_ps(), ah = _mm512_setzero_ps();
            for (int c = 0; c < n16; c += 16) {
                const __m512 qv = _mm512_loadu_ps(qh + c);
                const __m512 a = _mm512_mul_ps(qv, _mm512_loadu_ps(mn + c));
                const __m512 b = _mm512_mul_ps(qv, _mm512_loadu_ps(mx + c));
                am = _mm512_add_ps(am, _mm512_add_ps(a, b));
                ah = _mm512_add_ps(ah, _mm512_and_ps(_mm512_sub_ps(a, b), absm));
            }
            float mid = _mm512_reduce_add_ps(_mm512_fmadd_ps(ah, rv, am)), half = 0.0f;
            for (int c = n16; c < head_dim; c++) {
                const float a = qh[c] * mn[c], b = qh[c] * mx[c];
                mid += a + b, half += fabsf(a - b);
            }
            const float s = 0.5f * (mid + radius * half);
            best = s > best ? s : best;
        }
        score[i] = best;
    }
}
