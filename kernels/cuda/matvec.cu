/*
 * matvec.cu — kn_cuda_matvec: Y = X · Wᵀ for a few activation rows (decode), weights read in
 * place in their GGUF blocks and dequantized in registers.
 *
 * The numerics are kn_matmul_ref's: X arrives in the weight type's dot type (Q8_0 for Q8_0 and
 * Q4_0 weights, F16 for F16), quantized blocks are dotted with integer arithmetic (dp4a) and
 * scaled by d_w * d_x in float, f16 products are exact in float. Only the order of the float sums
 * differs from the reference.
 *
 * Layout: one warp per weight row, four rows per block; the lanes of a warp walk the row
 * together, each reading 4 bytes of quants (two 2-byte loads: 34- and 18-byte blocks keep only
 * 2-byte alignment) or 16 bytes of f16, so a warp's loads cover consecutive bytes. Each weight
 * load serves all m activation rows. A first version, correct before fast: docs/gpu.md lists
 * what it leaves on the table.
 */
#include "kernels/cuda/internal.cuh"

#define KN_MV_WARPS 4

/* 4 bytes at a 2-byte aligned address. */
__device__ __forceinline__ int kn_ld_i32_a2(const uint8_t *p)
{
    const uint16_t *q = (const uint16_t *)p;
    return (int)((uint32_t)__ldg(q) | (uint32_t)__ldg(q + 1) << 16);
}

__device__ __forceinline__ float kn_ld_half(const uint8_t *p)
{
    return __half2float(__ushort_as_half(__ldg((const unsigned short *)p)));
}

/* The integer dot of one lane's share of a weight block with the activation block (Q8_0) it
 * meets, and the geometry that share implies. Q8_0: 8 lanes per 34-byte block, 4 quants each. */
struct kn_q8_0_lanes {
    static constexpr int lanes = 8, bytes = 34;
    static __device__ __forceinline__ int dot(const uint8_t *wb, const uint8_t *xb, int part)
    {
        return __dp4a(kn_ld_i32_a2(wb + 2 + part * 4), kn_ld_i32_a2(xb + 2 + part * 4), 0);
    }
};

/* Q4_0: 4 lanes per 18-byte block; lane part holds quants 4*part.. (low nibbles) and 16+4*part..
 * (high nibbles), stored plus 8. */
struct kn_q4_0_lanes {
    static constexpr int lanes = 4, bytes = 18;
    static __device__ __forceinline__ int dot(const uint8_t *wb, const uint8_t *xb, int part)
    {
        const int wq = kn_ld_i32_a2(wb + 2 + part * 4);
        const int lo = wq & 0x0f0f0f0f, hi = (wq >> 4) & 0x0f0f0f0f;
        const int xl = kn_ld_i32_a2(xb + 2 + part * 4), xh = kn_ld_i32_a2(xb + 18 + part * 4);
        const int raw = __dp4a(hi, xh, __dp4a(lo, xl, 0));
        return raw - 8 * __dp4a(0x01010101, xh, __dp4a(0x01010101, xl, 0));
    }
};

/* 32-element blocks x Q8_0 activations: the warp covers 32 / lanes blocks per step. */
template <typename B>
__global__ void kn_mv_q_k(const uint8_t *w, size_t w_stride, int64_t rows, int64_t nb,
                          const uint8_t *x, size_t x_stride, int m, float *y, size_t y_stride)
{
    const int64_t r = blockIdx.x * (int64_t)KN_MV_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31, sub = lane / B::lanes, part = lane % B::lanes;
    const uint8_t *wr = w + r * w_stride;
    float acc[KN_CUDA_MAX_M] = {0};
    for (int64_t b = sub; b < nb; b += 32 / B::lanes) {
        const uint8_t *wb = wr + b * B::bytes;
        const float dw = kn_ld_half(wb);
#pragma unroll
        for (int i = 0; i < KN_CUDA_MAX_M; i++) {
            if (i >= m) break;
            const uint8_t *xb = x + i * x_stride + b * 34;
            acc[i] += (float)B::dot(wb, xb, part) * (dw * kn_ld_half(xb));
        }
    }
#pragma unroll
    for (int i = 0; i < KN_CUDA_MAX_M; i++) {
        if (i >= m) break;
        const float s = kn_warp_sum(acc[i]);
        if (lane == 0) y[i * y_stride + r] = s;
    }
}

/* F16 weights x F16 activations: VEC halves per lane per step (8: 16-byte loads; 1: any 2-byte
 * alignment). */
template <int VEC>
__global__ void kn_mv_f16_k(const uint8_t *w, size_t w_stride, int64_t rows, int64_t k,
                            const uint8_t *x, size_t x_stride, int m, float *y, size_t y_stride)
{
    const int64_t r = blockIdx.x * (int64_t)KN_MV_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    const __half *wr = (const __half *)(w + r * w_stride);
    float acc[KN_CUDA_MAX_M] = {0};
    for (int64_t j = (int64_t)lane * VEC; j < k; j += 32 * VEC) {
        __half wv[VEC];
        if (VEC == 8)
            *(uint4 *)wv = __ldg((const uint4 *)(wr + j));
        else
            wv[0] = wr[j];
#pragma unroll
        for (int i = 0; i < KN_CUDA_MAX_M; i++) {
            if (i >= m) break;
            const __half *xr = (const __half *)(x + i * x_stride);
            __half xv[VEC];
            if (VEC == 8)
                *(uint4 *)xv = __ldg((const uint4 *)(xr + j));
            else
                xv[0] = xr[j];
#pragma unroll
            for (int v = 0; v < VEC; v++)
                acc[i] = fmaf(__half2float(wv[v]), __half2float(xv[v]), acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < KN_CUDA_MAX_M; i++) {
        if (i >= m) break;
        const float s = kn_warp_sum(acc[i]);
        if (lane == 0) y[i * y_stride + r] = s;
    }
}

int kn_cuda_matvec_supported(md_type wt)
{
    return wt == MD_TYPE_F16 || wt == MD_TYPE_Q8_0 || wt == MD_TYPE_Q4_0;
}

int kn_cuda_matvec(md_type wt, const void *w, size_t w_stride, int64_t rows, int64_t k,
                   const void *x, size_t x_stride, int m, float *y, size_t y_stride, void *stream)
{
    if (!kn_cuda_matvec_supported(wt) || rows < 0 || k <= 0 || k % 32 || m < 0 ||
        m > KN_CUDA_MAX_M || ((uintptr_t)w | w_stride | (uintptr_t)x | x_stride) % 2)
        return KM_EINVAL;
    if (rows == 0 || m == 0) return 0;
    const uint8_t *wb = (const uint8_t *)w, *xb = (const uint8_t *)x;
    const unsigned blocks = (unsigned)((rows + KN_MV_WARPS - 1) / KN_MV_WARPS);
    cudaStream_t s = kn_cuda_stream(stream);
    if (wt == MD_TYPE_Q8_0) {
        kn_mv_q_k<kn_q8_0_lanes><<<blocks, 32 * KN_MV_WARPS, 0, s>>>(wb, w_stride, rows, k / 32, xb,
                                                                     x_stride, m, y, y_stride);
    } else if (wt == MD_TYPE_Q4_0) {
        kn_mv_q_k<kn_q4_0_lanes><<<blocks, 32 * KN_MV_WARPS, 0, s>>>(wb, w_stride, rows, k / 32, xb,
                                                                     x_stride, m, y, y_stride);
    } else if (((uintptr_t)w | w_stride | (uintptr_t)x | x_stride) % 16 == 0) {
        kn_mv_f16_k<8><<<blocks, 32 * KN_MV_WARPS, 0, s>>>(wb, w_stride, rows, k, xb, x_stride, m,
                                                           y, y_stride);
    } else {
        kn_mv_f16_k<1><<<blocks, 32 * KN_MV_WARPS, 0, s>>>(wb, w_stride, rows, k, xb, x_stride, m,
                                                           y, y_stride);
    }
    return kn_cuda_launched("matvec");
}
