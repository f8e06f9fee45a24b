/*
 * matvec.cu — kn_cuda_matvec: Y = X · Wᵀ for a few activation rows (decode), weights read in
 * place in their GGUF blocks and dequantized in registers.
 *
 * The numerics are kn_matmul_ref's: X arrives in the weight type's dot type (Q8_0 for Q8_0 and
 * Q4_0 weights, Q8_K for Q4_K, F16/BF16 for F16/BF16), quantized blocks are dotted with integer
 * arithmetic (dp4a) and scaled in float, 16-bit float products are exact in float. Only the
 * order of the float sums differs from the reference.
 *
 * Layout: one warp per weight row, four rows per block; the lanes of a warp walk the row
 * together, each reading 4 bytes of quants (two 2-byte loads: 34- and 18-byte blocks keep only
 * 2-byte alignment) or 16 bytes of f16/bf16, so a warp's loads cover consecutive bytes. Each weight
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

/* Each block type's share of a warp: `lanes` lanes per weight block of `elems` weights and
 * `bytes` bytes, met by an activation block of `x_bytes`; dot() is one lane's part of the block's
 * dot product, scales applied. Q8_0: 8 lanes per 34-byte block, 4 quants each. */
struct kn_q8_0_lanes {
    static constexpr int lanes = 8, elems = 32, bytes = 34, x_bytes = 34;
    static __device__ __forceinline__ float dot(const uint8_t *wb, const uint8_t *xb, int part)
    {
        const int isum =
            __dp4a(kn_ld_i32_a2(wb + 2 + part * 4), kn_ld_i32_a2(xb + 2 + part * 4), 0);
        return (float)isum * (kn_ld_half(wb) * kn_ld_half(xb));
    }
};

/* Q4_0: 4 lanes per 18-byte block; lane part holds quants 4*part.. (low nibbles) and 16+4*part..
 * (high nibbles), stored plus 8. */
struct kn_q4_0_lanes {
    static constexpr int lanes = 4, elems = 32, bytes = 18, x_bytes = 34;
    static __device__ __forceinline__ float dot(const uint8_t *wb, const uint8_t *xb, int part)
    {
        const int wq = kn_ld_i32_a2(wb + 2 + part * 4);
        const int lo = wq & 0x0f0f0f0f, hi = (wq >> 4) & 0x0f0f0f0f;
        const int xl = kn_ld_i32_a2(xb + 2 + part * 4), xh = kn_ld_i32_a2(xb + 18 + part * 4);
        const int raw = __dp4a(hi, xh, __dp4a(lo, xl, 0));
        const int isum = raw - 8 * __dp4a(0x01010101, xh, __dp4a(0x01010101, xl, 0));
        return (float)isum * (kn_ld_half(wb) * kn_ld_half(xb));
    }
};

/* Q4_K x Q8_K: the whole warp on one 144-byte super-block (d, dmin, 12 bytes of 6-bit scales and
 * mins, 128 bytes of nibbles). Lane part reads nibble bytes 4*part..: group g = part / 8 of 64
 * weights, low nibbles in sub-block 2g, high ones in 2g+1 (kn_ref_scale_min_k4's layout). The
 * Q8_K activation block is float d, 256 int8, 16 int16 sums. */
struct kn_q4_K_lanes {
    static constexpr int lanes = 32, elems = 256, bytes = 144, x_bytes = 292;
    static __device__ __forceinline__ void scale_min(int j, const uint8_t *q, int *d, int *m)
    {
        if (j < 4) {
            *d = __ldg(q + j) & 63;
            *m = __ldg(q + j + 4) & 63;
        } else {
            *d = (__ldg(q + j + 4) & 0xF) | ((__ldg(q + j - 4) >> 6) << 4);
            *m = (__ldg(q + j + 4) >> 4) | ((__ldg(q + j) >> 6) << 4);
        }
    }
    static __device__ __forceinline__ float dot(const uint8_t *wb, const uint8_t *xb, int part)
    {
        const int g = part >> 3, off = (part & 7) * 4;
        const int wq = kn_ld_i32_a2(wb + 16 + 32 * g + off);
        const int lo = wq & 0x0f0f0f0f, hi = (wq >> 4) & 0x0f0f0f0f;
        const int xl = kn_ld_i32_a2(xb + 4 + 64 * g + off);
        const int xh = kn_ld_i32_a2(xb + 4 + 64 * g + 32 + off);
        int sc0, m0, sc1, m1;
        scale_min(2 * g, wb + 4, &sc0, &m0);
        scale_min(2 * g + 1, wb + 4, &sc1, &m1);
        const int isum = sc0 * __dp4a(lo, xl, 0) + sc1 * __dp4a(hi, xh, 0);
        const int msum = m0 * __dp4a(0x01010101, xl, 0) + m1 * __dp4a(0x01010101, xh, 0);
        const float dx = __ldg((const float *)xb);
        return kn_ld_half(wb) * dx * (float)isum - kn_ld_half(wb + 2) * dx * (float)msum;
    }
};

/* Quantized weights x quantized activations: the warp covers 32 / lanes blocks per step. */
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
#pragma unroll
        for (int i = 0; i < KN_CUDA_MAX_M; i++) {
            if (i >= m) break;
            acc[i] += B::dot(wb, x + i * x_stride + b * B::x_bytes, part);
        }
    }
#pragma unroll
    for (int i = 0; i < KN_CUDA_MAX_M; i++) {
        if (i >= m) break;
        const float s = kn_warp_sum(acc[i]);
        if (lane == 0) y[i * y_stride + r] = s;
    }
}

/* 16-bit float weights x the same activations (F16, BF16): VEC elements per lane per step (8:
 * 16-byte loads; 1: any 2-byte alignment). Products of two 16-bit floats are exact in float. */
__device__ __forceinline__ float kn_to_f32(__half h)
{
    return __half2float(h);
}

__device__ __forceinline__ float kn_to_f32(__nv_bfloat16 h)
{
    return __bfloat162float(h);
}

template <typename T, int VEC>
__global__ void kn_mv_16_k(const uint8_t *w, size_t w_stride, int64_t rows, int64_t k,
                           const uint8_t *x, size_t x_stride, int m, float *y, size_t y_stride)
{
    const int64_t r = blockIdx.x * (int64_t)KN_MV_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    const T *wr = (const T *)(w + r * w_stride);
    float acc[KN_CUDA_MAX_M] = {0};
    for (int64_t j = (int64_t)lane * VEC; j < k; j += 32 * VEC) {
        T wv[VEC];
        if (VEC == 8)
            *(uint4 *)wv = __ldg((const uint4 *)(wr + j));
        else
            wv[0] = wr[j];
#pragma unroll
        for (int i = 0; i < KN_CUDA_MAX_M; i++) {
            if (i >= m) break;
            const T *xr = (const T *)(x + i * x_stride);
            T xv[VEC];
            if (VEC == 8)
                *(uint4 *)xv = __ldg((const uint4 *)(xr + j));
            else
                xv[0] = xr[j];
#pragma unroll
            for (int v = 0; v < VEC; v++) acc[i] = fmaf(kn_to_f32(wv[v]), kn_to_f32(xv[v]), acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < KN_CUDA_MAX_M; i++) {
        if (i >= m) break;
        const float s = kn_warp_sum(acc[i]);
        if (lane == 0) y[i * y_stride + r] = s;
    }
}

template <typename T>
static void kn_mv_16(const uint8_t *w, size_t w_stride, int64_t rows, int64_t k, const uint8_t *x,
                     size_t x_stride, int m, float *y, size_t y_stride, unsigned blocks,
                     cudaStream_t s)
{
    if (((uintptr_t)w | w_stride | (uintptr_t)x | x_stride) % 16 == 0)
        kn_mv_16_k<T, 8>
            <<<blocks, 32 * KN_MV_WARPS, 0, s>>>(w, w_stride, rows, k, x, x_stride, m, y, y_stride);
    else
        kn_mv_16_k<T, 1>
            <<<blocks, 32 * KN_MV_WARPS, 0, s>>>(w, w_stride, rows, k, x, x_stride, m, y, y_stride);
}

template <typename B>
static void kn_mv_q(const uint8_t *w, size_t w_stride, int64_t rows, int64_t k, const uint8_t *x,
                    size_t x_stride, int m, float *y, size_t y_stride, unsigned blocks,
                    cudaStream_t s)
{
    kn_mv_q_k<B><<<blocks, 32 * KN_MV_WARPS, 0, s>>>(w, w_stride, rows, k / B::elems, x, x_stride,
                                                     m, y, y_stride);
}

typedef void (*kn_mv_launch)(const uint8_t *, size_t, int64_t, int64_t, const uint8_t *, size_t,
                             int, float *, size_t, unsigned, cudaStream_t);

static const struct {
    md_type type;
    kn_mv_launch launch;
} kn_mv_types[] = {
    {MD_TYPE_F16, kn_mv_16<__half>},        {MD_TYPE_BF16, kn_mv_16<__nv_bfloat16>},
    {MD_TYPE_Q8_0, kn_mv_q<kn_q8_0_lanes>}, {MD_TYPE_Q4_0, kn_mv_q<kn_q4_0_lanes>},
    {MD_TYPE_Q4_K, kn_mv_q<kn_q4_K_lanes>},
};

static kn_mv_launch kn_mv_find(md_type wt)
{
    for (size_t i = 0; i < sizeof kn_mv_types / sizeof kn_mv_types[0]; i++)
        if (kn_mv_types[i].type == wt) return kn_mv_types[i].launch;
    return NULL;
}

int kn_cuda_matvec_supported(md_type wt)
{
    return kn_mv_find(wt) != NULL;
}

int kn_cuda_matvec(md_type wt, const void *w, size_t w_stride, int64_t rows, int64_t k,
                   const void *x, size_t x_stride, int m, float *y, size_t y_stride, void *stream)
{
    const kn_mv_launch launch = kn_mv_find(wt);
    if (!launch || rows < 0 || k <= 0 || k % md_type_block_elems(wt) || k % 32 || m < 0 ||
        m > KN_CUDA_MAX_M ||
        ((uintptr_t)w | w_stride | (uintptr_t)x | x_stride) % (wt == MD_TYPE_Q4_K ? 4 : 2))
        return KM_EINVAL;
    if (rows == 0 || m == 0) return 0;
    const unsigned blocks = (unsigned)((rows + KN_MV_WARPS - 1) / KN_MV_WARPS);
    launch((const uint8_t *)w, w_stride, rows, k, (const uint8_t *)x, x_stride, m, y, y_stride,
           blocks, kn_cuda_stream(stream));
    return kn_cuda_launched("matvec");
}
