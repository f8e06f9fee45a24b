/*
 * packed.h — the panel layout of a repacked weight matrix: what kn_ops.pack writes once at model
 * load and what the SIMD matmul (quant_simd.h) streams. Private to kernels/; pack.c writes it.
 *
 * The SIMD kernels compute PR weight rows at once (PR = 8 for AVX2, 16 for AVX-512), one row per
 * 32-bit lane: a 4-byte group of quants of each of the PR rows side by side in one vector, times
 * one activation group broadcast to every lane. In GGUF's row-major blocks those PR groups are PR
 * row strides apart, so an unpacked matmul must transpose them on every call; the packed layout
 * stores them transposed, so that a panel is one contiguous stream read front to back.
 *
 * A packed matrix is ceil(rows / PR) panels of kn_packed_panel_bytes each (a multiple of 64;
 * the buffer is 64-byte aligned). Panel p holds rows [p*PR, p*PR + PR), missing rows as zeros:
 *
 *   groups   block b (0 <= b < nb, nb = k / block elements), dword group g (0 <= g < G):
 *            PR x 4 bytes at panel + (b*G + g) * 4*PR; lane r = bytes of group g of row r's block
 *   halves   block b, f16 field h (0 <= h < F): PR x 2 bytes at panel + nb*G*4*PR + (b*F + h) *
 * 2*PR
 *
 * The groups of a block are its dword fields in the order below (each is a run of whole dwords
 * of the GGUF block, so the values of every byte are unchanged); the f16 fields are its scales:
 *
 *   type   GGUF bytes  groups (G)                                  halves (F)
 *   Q4_0   18          qs[16] (4)                                  d
 *   Q4_1   20          qs[16] (4)                                  d, m
 *   Q8_0   34          qs[32] (8)                                  d
 *   Q4_K   144         qs[128] (32), scales[12] (3)                d, dmin
 *   Q6_K   210         ql[128] (32), qh[64] (16), scales[16] (4)   d
 *
 * A packed matrix has exactly the bytes of the GGUF rows (padding aside) in another order, so a
 * decode step streams the same number of bytes, from one sequential stream per thread instead of
 * PR interleaved ones.
 */
#ifndef KN_CPU_PACKED_H
#define KN_CPU_PACKED_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"

typedef struct kn_pfield {
    uint16_t off, n; /* byte offset in the GGUF block; dwords (groups) or 1 (an f16) */
} kn_pfield;

typedef struct kn_pfmt {
    int blk_elems, blk_bytes;
    int G, F; /* groups and f16 fields per block */
    int n_groups_fields;
    kn_pfield groups[3]; /* in packed order */
    kn_pfield halves[2];
} kn_pfmt;

/* The layout of a weight type, or NULL when it is not packed (float types). */
const kn_pfmt *kn_pfmt_of(md_type t);

/* Bytes of one panel of PR rows with k elements each (a multiple of 64). */
size_t kn_packed_panel_bytes(const kn_pfmt *f, int pr, int64_t k);

/* Packs blocks [b0, b0+nb) of rows [r0, r0+nr) (nr <= pr; the other lanes get zeros) of the
 * row-major matrix w: the groups of those blocks to *groups (block-major, as in a panel), their
 * f16 fields to *halves. With b0 = 0 and nb = all blocks, groups = panel start and halves = panel
 * start + nb*G*4*PR, this writes one whole panel. */
void kn_pack_panel(const kn_pfmt *f, int pr, const uint8_t *w, size_t w_stride, int64_t r0, int nr,
                   int64_t b0, int nb, uint8_t *groups, uint8_t *halves);

/* Bytes of a whole packed matrix; 0 when the type is not packed. */
size_t kn_packed_size(md_type t, int pr, int64_t rows, int64_t k);
/* Packs the whole matrix into out (kn_packed_size bytes, 64-byte aligned). */
void kn_pack_matrix(md_type t, int pr, const void *w, size_t w_stride, int64_t rows, int64_t k,
                    void *out);

#endif
