/*
 * scores_ref.c — the scalar reference of the page scores of sparse attention (kn_ops.page_scores,
 * kernels.h): from a page's per-channel key minimum and maximum (f16, rounded outward),
 * q·centre + radius * |q|·spread (radius 1: Quest's upper bound of q·k over the page's keys), the
 * largest over the query heads of a kv head. The AVX2 and AVX-512 builds are held to this one by
 * tests/unit/test_sparse.c.
 */
#include <math.h>

#include "kernels/cpu/internal.h"

void kn_page_scores_ref(const kn_f16 *const *sums, int n_pages, int head_dim, const float *q,
                        int n_q, float radius, float *score)
{
    for (int i = 0; i < n_pages; i++) {
        if (!sums[i]) {
            score[i] = INFINITY;
            continue;
        }
        const kn_f16 *mn = sums[i], *mx = sums[i] + head_dim;
        float best = -INFINITY;
        for (int h = 0; h < n_q; h++) {
            const float *qh = q + (size_t)h * head_dim;
            float mid = 0.0f, half = 0.0f;
            for (int c = 0; c < head_dim; c++) {
                const float lo = kn_f16_to_f32(mn[c]), hi = kn_f16_to_f32(mx[c]);
                mid += qh[c] * (lo + hi), half += fabsf(qh[c]) * (hi - lo);
            }
            const float s = 0.5f * (mid + radius * half);
            best = s > best ? s : best;
        }
        score[i] = best;
    }
}
