/*
 * kn_cuda.h — the first CUDA kernels of kvmesh (docs/gpu.md): element-wise operations, softmax and
 * argmax, activation quantization, matrix-vector products and decode attention over f16 pages,
 * each with a host wrapper that C calls. Built into build/lib/libkmcuda.a only where nvcc exists
 * (the Makefile detects it); the rest of kvmesh never needs it.
 *
 * Contract:
 *  - Every pointer argument is device memory; every call is asynchronous on `stream` (a
 *    cudaStream_t; NULL is the default stream) and returns 0 when the launch was accepted,
 *    KM_EINVAL for a shape it does not take (nothing launched) or KM_EIO when CUDA refused
 *    (kn_cuda_last_error says what, on the calling thread). Errors inside a kernel surface at
 *    the caller's next synchronisation.
 *  - Each kernel computes the function of its scalar reference (kernels/cpu/ops_ref.c,
 * quant_ref.c), with the same rounding where that is cheap (activation quantization is bit for bit
 * the reference's; dot products sum in another order) and is held to it by
 * tests/gpu/test_cuda_kernels.c.
 *  - Weights are read in place in their GGUF block layout; nothing here allocates.
 *  - Includes no CUDA header: C files call it without the CUDA toolkit's headers.
 */
#ifndef KN_CUDA_H
#define KN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most activation rows one matvec call takes (decode of a small batch, a short draft). */
#define KN_CUDA_MAX_M 8

/* Number of CUDA devices (>= 0), or KM_EIO when the driver cannot be reached; a line naming
 * device 0 (or why there is none) goes to desc. */
int kn_cuda_devices(char *desc, size_t cap);
/* The message of the last failure on this thread ("" when none). */
const char *kn_cuda_last_error(void);

/* y = x / rms(x) * w for each of `rows` rows of n floats (kn_ops.rmsnorm). y may alias x. */
int kn_cuda_rmsnorm(float *y, const float *x, const float *w, int rows, int n, float eps,
                    void *stream);
/* Rotates, in place, n_tok tokens of n_heads heads of head_dim floats (a token's heads are
 * contiguous, tokens n_heads * head_dim apart) by their positions pos[n_tok], with
 * kn_rope_cache's angles (theta_i = pos * base^(-2i/n_rot), advanced by repeated float
 * multiplication) and kn_ops.rope's pairs (neox: (i, i + n_rot/2), else (2i, 2i+1)). */
int kn_cuda_rope(float *x, int n_tok, int n_heads, int head_dim, int n_rot, const int32_t *pos,
                 float freq_base, int neox, void *stream);
/* y[i] = silu(g[i]) * u[i] for i < n (kn_ops.silu_mul). */
int kn_cuda_silu_mul(float *y, const float *g, const float *u, int64_t n, void *stream);
/* Each of `rows` rows of n floats: y = softmax(x / temp); y may alias x. temp > 0. */
int kn_cuda_softmax(float *y, const float *x, int rows, int n, float temp, void *stream);
/* idx[r] = the first index of the largest of row r's n floats (en_argmax). */
int kn_cuda_argmax(int32_t *idx, const float *x, int rows, int n, void *stream);

/* Rows of n floats to the dot type t of a weight type (kn_dot_type): Q8_0 (n a multiple of 32),
 * Q8_K (of 256; y and y_stride 4-byte aligned), F16 or BF16, bit for bit kn_ops.quantize_row
 * for finite inputs; m rows, x_stride floats and y_stride bytes apart. */
int kn_cuda_quantize(md_type t, const float *x, size_t x_stride, void *y, size_t y_stride,
                     int64_t n, int m, void *stream);
/* Y[i * y_stride + r] = dot(W row r, X row i) for r < rows, i < m <= KN_CUDA_MAX_M: X already in
 * kn_dot_type(wt) (kn_cuda_quantize), strides in bytes for W and X, in floats for Y. Weight
 * types: F16, BF16, Q8_0, Q4_0, Q4_K; k whole blocks (and a multiple of 32), W and X 2-byte
 * aligned (4 for Q4_K). (kn_ops.matmul) */
int kn_cuda_matvec(md_type wt, const void *w, size_t w_stride, int64_t rows, int64_t k,
                   const void *x, size_t x_stride, int m, float *y, size_t y_stride, void *stream);
/* 1 when kn_cuda_matvec takes the weight type. */
int kn_cuda_matvec_supported(md_type wt);

/* Decode attention of n_q query heads sharing one kv head over n_ctx positions of f16 pages
 * (kn_ops.attention on a KN_KV_F16 kn_kv_view): pages is a device array of device page
 * pointers, each page's K block at k_off and V block at v_off, [page_tokens][head_dim] halves;
 * q and out are [n_q][head_dim] floats, head_dim <= 256. */
int kn_cuda_attention_f16(const uint8_t *const *pages, size_t k_off, size_t v_off, int page_tokens,
                          int n_ctx, int head_dim, const float *q, int n_q, float scale, float *out,
                          void *stream);

#ifdef __cplusplus
}
#endif
#endif /* KN_CUDA_H */
