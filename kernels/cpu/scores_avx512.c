/*
 * scores_avx512.c — the page scores of sparse attention (kn_ops.page_scores) with AVX-512: 16
 * channels per instruction, the leftover channels as scores_ref.c does them. Held to the
 * reference by tests/unit/test_kernels_sparse.c.
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/internal.h"

void kn_page_scores_avx512(const float *const *sums, int n_pages, int head_dim, const float *q,
                           int n_q, float *score)
{
    const int n16 = head_dim & ~15;
    for (int i = 0; i < n_pages; i++) {
        if (!sums[i]) {
            score[i] = INFINITY;
            continue;
        }
        const float *mn = sums[i], *mx = sums[i] + head_dim;
        float best = -INFINITY;
        for (int h = 0; h < n_q; h++) {
            const float *qh = q + (size_t)h * head_dim;
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < n16; c += 16) {
                const __m512 qv = _mm512_loadu_ps(qh + c);
                acc = _mm512_add_ps(acc, _mm512_max_ps(_mm512_mul_ps(qv, _mm512_loadu_ps(mn + c)),
                                                       _mm512_mul_ps(qv, _mm512_loadu_ps(mx + c))));
            }
            float s = _mm512_reduce_add_ps(acc);
            for (int c = n16; c < head_dim; c++) {
                const float a = qh[c] * mn[c], b = qh[c] * mx[c];
                s += a > b ? a : b;
            }
            best = s > best ? s : best;
        }
        score[i] = best;
    }
}
