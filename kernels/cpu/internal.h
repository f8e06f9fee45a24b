/*
 * internal.h — the per-instruction-set kernel functions that kernels/cpu/dispatch.c assembles into
 * kn_ops tables. Private to kernels/. Every function exists in three builds:
 *   _ref    plain C, the reference every other build is tested against (quant_ref.c, ops_ref.c)
 *   _avx2   compiled with -mavx2 -mfma -mf16c (quant_avx2.c, ops_avx2.c)
 *   _avx512 compiled with AVX-512 F/BW/VL/DQ/VNNI/BF16 (quant_avx512.c, ops_avx512.c)
 * A build may forward to another where it gains nothing; it must then say so in a comment. The
 * SIMD builds' matmul and quantization drivers are one body, quant_simd.h, over per-build
 * primitives.
 */
#ifndef KN_CPU_INTERNAL_H
#define KN_CPU_INTERNAL_H

#include "kernels/kernels.h"

/* ggml-identical block layouts. */
typedef struct {
    kn_f16 d;
    uint8_t qs[KN_QK4_0 / 2];
} kn_block_q4_0;
typedef struct {
    kn_f16 d, m;
    uint8_t qs[KN_QK4_1 / 2];
} kn_block_q4_1;
typedef struct {
    kn_f16 d;
    int8_t qs[KN_QK8_0];
} kn_block_q8_0;
typedef struct {
    kn_f16 d, s;
    int8_t qs[KN_QK8_1];
} kn_block_q8_1; /* s = d * sum(qs) */
typedef struct {
    kn_f16 d, dmin;
    uint8_t scales[12];
    uint8_t qs[KN_QK_K / 2];
} kn_block_q4_K;
typedef struct {
    uint8_t ql[KN_QK_K / 2];
    uint8_t qh[KN_QK_K / 4];
    int8_t scales[KN_QK_K / 16];
    kn_f16 d;
} kn_block_q6_K;
typedef struct {
    float d;
    int8_t qs[KN_QK_K];
    int16_t bsums[KN_QK_K / 16];
} kn_block_q8_K;

#define KN_DECLARE_ISA(sfx)                                                                        \
    void kn_quantize_row_##sfx(md_type t, const float *x, void *y, int64_t n);                     \
    void kn_dequantize_row_##sfx(md_type t, const void *x, float *y, int64_t n);                   \
    void kn_matmul_##sfx(md_type wt, const void *w, size_t w_stride, const void *x,                \
                         size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0, \
                         int64_t r1);                                                              \
    size_t kn_pack_size_##sfx(md_type wt, int64_t rows, int64_t k);                                \
    void kn_pack_##sfx(md_type wt, const void *w, size_t w_stride, int64_t rows, int64_t k,        \
                       void *out);                                                                 \
    void kn_matmul_packed_##sfx(md_type wt, const void *packed, int64_t rows, const void *x,       \
                                size_t x_stride, int64_t k, int m, float *y, size_t y_stride,      \
                                int64_t r0, int64_t r1);                                           \
    void kn_rmsnorm_##sfx(float *y, const float *x, const float *w, int n, float eps);             \
    void kn_rope_##sfx(float *x, int n_heads, int head_dim, int n_rot, const float *cs, int neox); \
    void kn_silu_mul_##sfx(float *y, const float *g, const float *u, int n);                       \
    void kn_add_##sfx(float *y, const float *x, int n);                                            \
    void kn_f32_to_f16_##sfx(const float *x, kn_f16 *y, int64_t n);                                \
    void kn_f16_to_f32_##sfx(const kn_f16 *x, float *y, int64_t n);                                \
    void kn_attention_##sfx(const kn_kv_view *kv, int head_dim, const float *q, int n_q,           \
                            float scale, float *out);                                              \
    void kn_attention_multi_##sfx(const kn_kv_view *kv, int head_dim, const float *q,              \
                                  size_t q_stride, int n_tok, int n_q, float scale, float *out,    \
                                  size_t out_stride);                                              \
    void kn_xxh3_update_##sfx(void *state, const void *p, size_t n);                               \
    void kn_page_scores_##sfx(const kn_f16 *const *sums, int n_pages, int head_dim,                \
                              const float *q, int n_q, float radius, float *score);

KN_DECLARE_ISA(ref)
KN_DECLARE_ISA(avx2)
KN_DECLARE_ISA(avx512)

#endif
