/*
 * scores_avx2.c — the page scores of sparse attention (kn_ops.page_scores) with AVX2: 8 channels
 * per instruction, the leftover channels as scores_ref.c does them. Held to the reference by
 * tests/unit/test_kernels_sparse.c (the same pages selected; sums differ only in rounding).
 */
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/internal.h"

static float kn_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void kn_page_scores_avx2(const float *const *sums, int n_pages, int head_dim, const float *q,
                         int n_q, float *score)
{
    const int n8 = head_dim & ~7;
    for (int i = 0; i < n_pages; i++) {
        if (!sums[i]) {
            score[i] = INFINITY;
            continue;
        }
        const float *mn = sums[i], *mx = sums[i] + head_dim;
        float best = -INFINITY;
        for (int h = 0; h < n_q; h++) {
            const float *qh = q + (size_t)h * head_dim;
            __m256 acc = _mm256_setzero_ps();
            for (int c = 0; c < n8; c += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + c);
                acc = _mm256_add_ps(acc, _mm256_max_ps(_mm256_mul_ps(qv, _mm256_loadu_ps(mn + c)),
                                                       _mm256_mul_ps(qv, _mm256_loadu_ps(mx + c))));
            }
            float s = kn_hsum8(acc);
            for (int c = n8; c < head_dim; c++) {
                const float a = qh[c] * mn[c], b = qh[c] * mx[c];
                s += a > b ? a : b;
            }
            best = s > best ? s : best;
        }
        score[i] = best;
    }
}
