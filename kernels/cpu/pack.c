/*
 * pack.c — writes the panel layout of packed.h: the whole matrix once at model load
 * (kn_pack_matrix, through kn_ops.pack), and one panel's k-chunk at a time when a SIMD matmul is
 * handed unpacked rows (quant_simd.h packs into a per-thread buffer and runs the same kernels).
 *
 * Plain C: a packed byte is a copied byte, so there is nothing for SIMD to compute here, and one
 * copy serves every instruction set (PR is a parameter).
 */
#include <assert.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/packed.h"

static const kn_pfmt kn_pfmt_q4_0 = {KN_QK4_0, sizeof(kn_block_q4_0), 4, 1, 1, {{2, 4}}, {{0, 1}}};
static const kn_pfmt kn_pfmt_q4_1 = {KN_QK4_1, sizeof(kn_block_q4_1), 4, 2, 1,
                                     {{4, 4}}, {{0, 1}, {2, 1}}};
static const kn_pfmt kn_pfmt_q8_0 = {KN_QK8_0, sizeof(kn_block_q8_0), 8, 1, 1, {{2, 8}}, {{0, 1}}};
static const kn_pfmt kn_pfmt_q4_K = {
    KN_QK_K,
    sizeof(kn_block_q4_K),
    35,
    2,
    2,
    {{offsetof(kn_block_q4_K, qs), 32}, {offsetof(kn_block_q4_K, scales), 3}},
    {{0, 1}, {2, 1}}};
static const kn_pfmt kn_pfmt_q6_K = {KN_QK_K,
                                     sizeof(kn_block_q6_K),
                                     52,
                                     1,
                                     3,
                                     {{offsetof(kn_block_q6_K, ql), 32},
                                      {offsetof(kn_block_q6_K, qh), 16},
                                      {offsetof(kn_block_q6_K, scales), 4}},
                                     {{offsetof(kn_block_q6_K, d), 1}}};

const kn_pfmt *kn_pfmt_of(md_type t)
{
    switch (t) {
    case MD_TYPE_Q4_0:
        return &kn_pfmt_q4_0;
    case MD_TYPE_Q4_1:
        return &kn_pfmt_q4_1;
    case MD_TYPE_Q8_0:
        return &kn_pfmt_q8_0;
    case MD_TYPE_Q4_K:
        return &kn_pfmt_q4_K;
    case MD_TYPE_Q6_K:
        return &kn_pfmt_q6_K;
    default:
        return NULL;
    }
}

size_t kn_packed_panel_bytes(const kn_pfmt *f, int pr, int64_t k)
{
    const size_t nb = (size_t)(k / f->blk_elems);
    const size_t bytes = nb * (size_t)pr * (4 * (size_t)f->G + 2 * (size_t)f->F);
    return (bytes + 63) & ~(size_t)63;
}

void kn_pack_panel(const kn_pfmt *f, int pr, const uint8_t *w, size_t w_stride, int64_t r0, int nr,
                   int64_t b0, int nb, uint8_t *groups, uint8_t *halves)
{
    assert(nr >= 1 && nr <= pr);
    for (int b = 0; b < nb; b++) {
        const size_t boff = (size_t)(b0 + b) * (size_t)f->blk_bytes;
        uint8_t *g = groups + (size_t)b * (size_t)f->G * 4 * (size_t)pr;
        for (int fi = 0; fi < f->n_groups_fields; fi++)
            for (int u = 0; u < f->groups[fi].n; u++, g += 4 * (size_t)pr) {
                const size_t off = boff + f->groups[fi].off + 4 * (size_t)u;
                for (int r = 0; r < nr; r++)
                    memcpy(g + 4 * (size_t)r, w + (size_t)(r0 + r) * w_stride + off, 4);
                memset(g + 4 * (size_t)nr, 0, 4 * (size_t)(pr - nr));
            }
        uint8_t *h = halves + (size_t)b * (size_t)f->F * 2 * (size_t)pr;
        for (int fi = 0; fi < f->F; fi++, h += 2 * (size_t)pr) {
            const size_t off = boff + f->halves[fi].off;
            for (int r = 0; r < nr; r++)
                memcpy(h + 2 * (size_t)r, w + (size_t)(r0 + r) * w_stride + off, 2);
            memset(h + 2 * (size_t)nr, 0, 2 * (size_t)(pr - nr));
        }
    }
}

size_t kn_packed_size(md_type t, int pr, int64_t rows, int64_t k)
{
    const kn_pfmt *f = kn_pfmt_of(t);
    if (!f || rows <= 0 || k <= 0 || k % f->blk_elems) return 0;
    return (size_t)((rows + pr - 1) / pr) * kn_packed_panel_bytes(f, pr, k);
}

void kn_pack_matrix(md_type t, int pr, const void *w, size_t w_stride, int64_t rows, int64_t k,
                    void *out)
{
    const kn_pfmt *f = kn_pfmt_of(t);
    assert(f && k % f->blk_elems == 0);
    const size_t pb = kn_packed_panel_bytes(f, pr, k);
    const int nb = (int)(k / f->blk_elems);
    uint8_t *o = out;
    for (int64_t p0 = 0; p0 < rows; p0 += pr, o += pb) {
        const int nr = rows - p0 < pr ? (int)(rows - p0) : pr;
        uint8_t *halves = o + (size_t)nb * (size_t)f->G * 4 * (size_t)pr;
        kn_pack_panel(f, pr, w, w_stride, p0, nr, 0, nb, o, halves);
        const size_t used = (size_t)(halves - o) + (size_t)nb * (size_t)f->F * 2 * (size_t)pr;
        memset(o + used, 0, pb - used);
    }
}
