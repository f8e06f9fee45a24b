/*
 * kernel_bounds.c — under SAN=1 only: the bounds of every buffer the engine hands a SIMD kernel,
 * checked by AddressSanitizer at the call.
 *
 * The SAN tree builds the SIMD arithmetic (KERNELS_HOT_SRC in the Makefile: matmul,
 * quantization, the element-wise kernels, attention) without ASan's instrumentation, since its
 * shadow checks on every vector load were most of the model-running suites' time; the kernel
 * suites (KERNEL_SUITES) still run an instrumented build of them against their references. What
 * that leaves unchecked is the caller's side: a buffer the engine sized too small, which only the
 * kernel's own accesses would touch. So the SAN link wraps those entry points (ld --wrap, the
 * list in the Makefile's KERNELS_WRAP), and each wrapper asks ASan, before calling the kernel,
 * whether every byte the kernel's contract (kernels/kernels.h) lets it read or write is
 * addressable. A byte that is not is read here, in instrumented code, so that ASan reports it as
 * it reports any overflow: where the buffer was allocated, and the call that overran it.
 */
#include <sanitizer/asan_interface.h>
#include <stdio.h>

#include "kernels/cpu/internal.h"

/* [p, p + n) must be addressable; else an ASan report naming the kernel and its argument. */
static void kb_check(const char *kernel, const char *arg, const void *p, size_t n)
{
    if (n == 0 || p == NULL) return;
    const volatile char *bad = __asan_region_is_poisoned((void *)p, n);
    if (bad == NULL) return;
    fprintf(stderr, "kernel_bounds: %s: %s spans %zu bytes from %p; byte %td is not addressable\n",
            kernel, arg, n, p, (const char *)bad - (const char *)p);
    (void)*bad;
}

/* m rows of `bytes` bytes, `stride` bytes apart. */
static void kb_rows(const char *kernel, const char *arg, const void *p, size_t stride, int m,
                    size_t bytes)
{
    for (int i = 0; i < m; i++) kb_check(kernel, arg, (const char *)p + (size_t)i * stride, bytes);
}

/* What attention reads of a view: its page list and, for f16/bf16 pages, the K and V block rows
 * of the positions it attends to (quantized and mixed-format layouts are attn_kv.h's, left to the
 * kernel suites). */
static void kb_view(const char *kernel, const kn_kv_view *kv, int head_dim)
{
    kb_check(kernel, "kv", kv, sizeof *kv);
    if (kv->page_tokens <= 0 || kv->n_ctx <= 0) return;
    const int n_pages = (kv->n_ctx + kv->page_tokens - 1) / kv->page_tokens;
    kb_check(kernel, "kv->pages", kv->pages, (size_t)n_pages * sizeof *kv->pages);
    if (kv->attn_mass) kb_check(kernel, "kv->attn_mass", kv->attn_mass, (size_t)n_pages * 4);
    if (kv->page_formats || (kv->format != KN_KV_F16 && kv->format != KN_KV_BF16)) return;
    for (int p = 0; p < n_pages; p++) {
        const int left = kv->n_ctx - p * kv->page_tokens;
        const size_t bytes = (size_t)(left < kv->page_tokens ? left : kv->page_tokens) *
                             (size_t)head_dim * sizeof(kn_f16);
        if (kv->pages[p] == NULL) continue;
        kb_check(kernel, "K block", kv->pages[p] + kv->k_off, bytes);
        kb_check(kernel, "V block", kv->pages[p] + kv->v_off, bytes);
    }
}

/* One wrapper per entry point of an instruction set's table; sfx is avx2 or avx512. */
#define KB_WRAP_ISA(sfx)                                                                           \
    void __real_kn_quantize_row_##sfx(md_type t, const float *x, void *y, int64_t n);              \
    void __wrap_kn_quantize_row_##sfx(md_type t, const float *x, void *y, int64_t n);              \
    void __wrap_kn_quantize_row_##sfx(md_type t, const float *x, void *y, int64_t n)               \
    {                                                                                              \
        kb_check("quantize_row_" #sfx, "x", x, (size_t)n * sizeof(float));                         \
        kb_check("quantize_row_" #sfx, "y", y, md_type_row_bytes(t, n));                           \
        __real_kn_quantize_row_##sfx(t, x, y, n);                                                  \
    }                                                                                              \
    void __real_kn_dequantize_row_##sfx(md_type t, const void *x, float *y, int64_t n);            \
    void __wrap_kn_dequantize_row_##sfx(md_type t, const void *x, float *y, int64_t n);            \
    void __wrap_kn_dequantize_row_##sfx(md_type t, const void *x, float *y, int64_t n)             \
    {                                                                                              \
        kb_check("dequantize_row_" #sfx, "x", x, md_type_row_bytes(t, n));                         \
        kb_check("dequantize_row_" #sfx, "y", y, (size_t)n * sizeof(float));                       \
        __real_kn_dequantize_row_##sfx(t, x, y, n);                                                \
    }                                                                                              \
    void __real_kn_matmul_##sfx(md_type wt, const void *w, size_t w_stride, const void *x,         \
                                size_t x_stride, int64_t k, int m, float *y, size_t y_stride,      \
                                int64_t r0, int64_t r1);                                           \
    void __wrap_kn_matmul_##sfx(md_type wt, const void *w, size_t w_stride, const void *x,         \
                                size_t x_stride, int64_t k, int m, float *y, size_t y_stride,      \
                                int64_t r0, int64_t r1);                                           \
    void __wrap_kn_matmul_##sfx(md_type wt, const void *w, size_t w_stride, const void *x,         \
                                size_t x_stride, int64_t k, int m, float *y, size_t y_stride,      \
                                int64_t r0, int64_t r1)                                            \
    {                                                                                              \
        const char *fn = "matmul_" #sfx;                                                           \
        if (r1 > r0) {                                                                             \
            kb_rows(fn, "w", (const char *)w + (size_t)r0 * w_stride, w_stride, (int)(r1 - r0),    \
                    md_type_row_bytes(wt, k));                                                     \
            kb_rows(fn, "y", y + r0, y_stride * sizeof(float), m, (size_t)(r1 - r0) * 4);          \
        }                                                                                          \
        kb_rows(fn, "x", x, x_stride, m, md_type_row_bytes(kn_dot_type(wt), k));                   \
        __real_kn_matmul_##sfx(wt, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);           \
    }                                                                                              \
    void __real_kn_matmul_packed_##sfx(md_type wt, const void *packed, int64_t rows,               \
                                       const void *x, size_t x_stride, int64_t k, int m, float *y, \
                                       size_t y_stride, int64_t r0, int64_t r1);                   \
    void __wrap_kn_matmul_packed_##sfx(md_type wt, const void *packed, int64_t rows,               \
                                       const void *x, size_t x_stride, int64_t k, int m, float *y, \
                                       size_t y_stride, int64_t r0, int64_t r1);                   \
    void __wrap_kn_matmul_packed_##sfx(md_type wt, const void *packed, int64_t rows,               \
                                       const void *x, size_t x_stride, int64_t k, int m, float *y, \
                                       size_t y_stride, int64_t r0, int64_t r1)                    \
    {                                                                                              \
        const char *fn = "matmul_packed_" #sfx;                                                    \
        kb_check(fn, "packed", packed, kn_pack_size_##sfx(wt, rows, k));                           \
        kb_rows(fn, "x", x, x_stride, m, md_type_row_bytes(kn_dot_type(wt), k));                   \
        if (r1 > r0) kb_rows(fn, "y", y + r0, y_stride * sizeof(float), m, (size_t)(r1 - r0) * 4); \
        __real_kn_matmul_packed_##sfx(wt, packed, rows, x, x_stride, k, m, y, y_stride, r0, r1);   \
    }                                                                                              \
    void __real_kn_rmsnorm_##sfx(float *y, const float *x, const float *w, int n, float eps);      \
    void __wrap_kn_rmsnorm_##sfx(float *y, const float *x, const float *w, int n, float eps);      \
    void __wrap_kn_rmsnorm_##sfx(float *y, const float *x, const float *w, int n, float eps)       \
    {                                                                                              \
        kb_check("rmsnorm_" #sfx, "x", x, (size_t)n * 4);                                          \
        kb_check("rmsnorm_" #sfx, "w", w, (size_t)n * 4);                                          \
        kb_check("rmsnorm_" #sfx, "y", y, (size_t)n * 4);                                          \
        __real_kn_rmsnorm_##sfx(y, x, w, n, eps);                                                  \
    }                                                                                              \
    void __real_kn_rope_##sfx(float *x, int n_heads, int head_dim, int n_rot, const float *cs,     \
                              int neox);                                                           \
    void __wrap_kn_rope_##sfx(float *x, int n_heads, int head_dim, int n_rot, const float *cs,     \
                              int neox);                                                           \
    void __wrap_kn_rope_##sfx(float *x, int n_heads, int head_dim, int n_rot, const float *cs,     \
                              int neox)                                                            \
    {                                                                                              \
        kb_check("rope_" #sfx, "x", x, (size_t)n_heads *(size_t)head_dim * 4);                     \
        kb_check("rope_" #sfx, "cs", cs, (size_t)n_rot * 4);                                       \
        __real_kn_rope_##sfx(x, n_heads, head_dim, n_rot, cs, neox);                               \
    }                                                                                              \
    void __real_kn_silu_mul_##sfx(float *y, const float *g, const float *u, int n);                \
    void __wrap_kn_silu_mul_##sfx(float *y, const float *g, const float *u, int n);                \
    void __wrap_kn_silu_mul_##sfx(float *y, const float *g, const float *u, int n)                 \
    {                                                                                              \
        kb_check("silu_mul_" #sfx, "g", g, (size_t)n * 4);                                         \
        kb_check("silu_mul_" #sfx, "u", u, (size_t)n * 4);                                         \
        kb_check("silu_mul_" #sfx, "y", y, (size_t)n * 4);                                         \
        __real_kn_silu_mul_##sfx(y, g, u, n);                                                      \
    }                                                                                              \
    void __real_kn_add_##sfx(float *y, const float *x, int n);                                     \
    void __wrap_kn_add_##sfx(float *y, const float *x, int n);                                     \
    void __wrap_kn_add_##sfx(float *y, const float *x, int n)                                      \
    {                                                                                              \
        kb_check("add_" #sfx, "x", x, (size_t)n * 4);                                              \
        kb_check("add_" #sfx, "y", y, (size_t)n * 4);                                              \
        __real_kn_add_##sfx(y, x, n);                                                              \
    }                                                                                              \
    void __real_kn_f32_to_f16_##sfx(const float *x, kn_f16 *y, int64_t n);                         \
    void __wrap_kn_f32_to_f16_##sfx(const float *x, kn_f16 *y, int64_t n);                         \
    void __wrap_kn_f32_to_f16_##sfx(const float *x, kn_f16 *y, int64_t n)                          \
    {                                                                                              \
        kb_check("f32_to_f16_" #sfx, "x", x, (size_t)n * 4);                                       \
        kb_check("f32_to_f16_" #sfx, "y", y, (size_t)n * 2);                                       \
        __real_kn_f32_to_f16_##sfx(x, y, n);                                                       \
    }                                                                                              \
    void __real_kn_f16_to_f32_##sfx(const kn_f16 *x, float *y, int64_t n);                         \
    void __wrap_kn_f16_to_f32_##sfx(const kn_f16 *x, float *y, int64_t n);                         \
    void __wrap_kn_f16_to_f32_##sfx(const kn_f16 *x, float *y, int64_t n)                          \
    {                                                                                              \
        kb_check("f16_to_f32_" #sfx, "x", x, (size_t)n * 2);                                       \
        kb_check("f16_to_f32_" #sfx, "y", y, (size_t)n * 4);                                       \
        __real_kn_f16_to_f32_##sfx(x, y, n);                                                       \
    }                                                                                              \
    void __real_kn_attention_##sfx(const kn_kv_view *kv, int head_dim, const float *q, int n_q,    \
                                   float scale, float *out);                                       \
    void __wrap_kn_attention_##sfx(const kn_kv_view *kv, int head_dim, const float *q, int n_q,    \
                                   float scale, float *out);                                       \
    void __wrap_kn_attention_##sfx(const kn_kv_view *kv, int head_dim, const float *q, int n_q,    \
                                   float scale, float *out)                                        \
    {                                                                                              \
        const size_t row = (size_t)n_q * (size_t)head_dim * 4;                                     \
        kb_view("attention_" #sfx, kv, head_dim);                                                  \
        kb_check("attention_" #sfx, "q", q, row);                                                  \
        kb_check("attention_" #sfx, "out", out, row);                                              \
        __real_kn_attention_##sfx(kv, head_dim, q, n_q, scale, out);                               \
    }                                                                                              \
    void __real_kn_attention_multi_##sfx(const kn_kv_view *kv, int head_dim, const float *q,       \
                                         size_t q_stride, int n_tok, int n_q, float scale,         \
                                         float *out, size_t out_stride);                           \
    void __wrap_kn_attention_multi_##sfx(const kn_kv_view *kv, int head_dim, const float *q,       \
                                         size_t q_stride, int n_tok, int n_q, float scale,         \
                                         float *out, size_t out_stride);                           \
    void __wrap_kn_attention_multi_##sfx(const kn_kv_view *kv, int head_dim, const float *q,       \
                                         size_t q_stride, int n_tok, int n_q, float scale,         \
                                         float *out, size_t out_stride)                            \
    {                                                                                              \
        const size_t row = (size_t)n_q * (size_t)head_dim * 4;                                     \
        kb_view("attention_multi_" #sfx, kv, head_dim);                                            \
        kb_rows("attention_multi_" #sfx, "q", q, q_stride * 4, n_tok, row);                        \
        kb_rows("attention_multi_" #sfx, "out", out, out_stride * 4, n_tok, row);                  \
        __real_kn_attention_multi_##sfx(kv, head_dim, q, q_stride, n_tok, n_q, scale, out,         \
                                        out_stride);                                               \
    }

KB_WRAP_ISA(avx2)
KB_WRAP_ISA(avx512)
