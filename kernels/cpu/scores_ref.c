/*
 * scores_ref.c — the scalar reference of the page scores of sparse attention (kn_ops.page_scores,
 * kernels.h): the upper bound of q·k over a page's keys from their per-channel minimum and
 * maximum (Quest), the largest over the query heads of a kv head. The AVX2 and AVX-512 builds
 * are held to this one by tests/unit/test_kernels_sparse.c.
 */
#include <math.h>

#include "kernels/cpu/internal.h"

void kn_page_scores_ref(const float *const *sums, int n_pages, int head_dim, const float *q,
                        int n_q, float *score)
{
    for (int i = 0; i < n_pages; i++) {
        if (!sums[i]) {
            score[i] = INFINITY;
            continue;
        }
        const float *mn = sums[i], *mx = sums[i] + head_dim;
        float best = -INFINITY;
        for (int h = 0; h < n_q; h++) {
            const float *qh = q + (size_t)h * head_dim;
            float s = 0.0f;
            for (int c = 0; c < head_dim; c++) {
                const float a = qh[c] * mn[c], b = qh[c] * mx[c];
                s += a > b ? a : b;
            }
            best = s > best ? s : best;
        }
        score[i] = best;
    }
}
