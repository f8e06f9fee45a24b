/*
 * ops.cu — the element-wise and row kernels of kn_cuda.h: RMS norm, RoPE, SwiGLU, softmax,
 * argmax and activation quantization, plus the device query and the error message.
 *
 * Each follows its scalar reference in kernels/cpu/ops_ref.c and quant_ref.c: RMS norm sums the
 * squares in double as the reference does, RoPE advances theta by repeated float multiplication
 * as kn_rope_cache does, Q8_0 quantization divides and rounds exactly as the reference (IEEE
 * division and round-half-even conversions: nvcc's defaults, never --use_fast_math), so its
 * output is the reference's bit for bit. Row kernels run one block of KN_ROW_THREADS per row.
 */
#include <math.h>
#include <stdio.h>

#include "kernels/cuda/internal.cuh"

#define KN_ROW_THREADS 256

static __thread char kn_cuda_msg[256];

int kn_cuda_fail(const char *what, cudaError_t e)
{
    snprintf(kn_cuda_msg, sizeof kn_cuda_msg, "%s: %s (%s)", what, cudaGetErrorString(e),
             cudaGetErrorName(e));
    return KM_EIO;
}

const char *kn_cuda_last_error(void)
{
    return kn_cuda_msg;
}

int kn_cuda_devices(char *desc, size_t cap)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        int rc = kn_cuda_fail("cudaGetDeviceCount", e);
        snprintf(desc, cap, "no CUDA device: %s", kn_cuda_msg);
        return rc;
    }
    cudaDeviceProp p;
    if (n > 0 && (e = cudaGetDeviceProperties(&p, 0)) == cudaSuccess)
        snprintf(desc, cap, "%s, compute capability %d.%d, %d multiprocessors, %.1f GiB, L2 %d MiB",
                 p.name, p.major, p.minor, p.multiProcessorCount,
                 (double)p.totalGlobalMem / (1 << 30), p.l2CacheSize >> 20);
    else
        snprintf(desc, cap, "no CUDA device (%d found)", n);
    return n;
}

/* ---------------------------------------------------------------- block reductions */

/* Sum (or max) over the block; every thread gets the result. sh has room for 32 values. */
template <typename T, bool MAX> __device__ T kn_block_reduce(T v, T *sh)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        T u = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? (u > v ? u : v) : v + u;
    }
    __syncthreads(); /* sh may still be read from an earlier reduction */
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = sh[0];
    for (int i = 1; i < nw; i++) v = MAX ? (sh[i] > v ? sh[i] : v) : v + sh[i];
    return v;
}

/* ---------------------------------------------------------------- RMS norm */

__global__ void kn_rmsnorm_k(float *y, const float *x, const float *w, int n, float eps)
{
    __shared__ double sh[32];
    const float *xr = x + (size_t)blockIdx.x * n;
    float *yr = y + (size_t)blockIdx.x * n;
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += (double)(xr[i] * xr[i]);
    s = kn_block_reduce<double, false>(s, sh);
    const float mean = (float)(s / n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

int kn_cuda_rmsnorm(float *y, const float *x, const float *w, int rows, int n, float eps,
                    void *stream)
{
    if (rows < 0 || n <= 0) return KM_EINVAL;
    if (rows == 0) return 0;
    kn_rmsnorm_k<<<rows, KN_ROW_THREADS, 0, kn_cuda_stream(stream)>>>(y, x, w, n, eps);
    return kn_cuda_launched("rmsnorm");
}

/* ---------------------------------------------------------------- RoPE */

/* One thread per rotated pair: blockIdx.y is the token, x covers n_heads * n_rot/2 pairs. */
__global__ void kn_rope_k(float *x, int n_heads, int head_dim, int n_rot, const int32_t *pos,
                          float theta_scale, int neox)
{
    const int half = n_rot / 2, t = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n_heads * half) return;
    const int h = j / half, i = j % half;
    float theta = (float)pos[t];
    for (int s = 0; s < i; s++) theta *= theta_scale; /* as kn_rope_cache, not powf */
    float sn, c;
    sincosf(theta, &sn, &c);
    float *v = x + ((size_t)t * n_heads + h) * head_dim;
    float *a = neox ? &v[i] : &v[2 * i];
    float *b = neox ? &v[i + half] : &v[2 * i + 1];
    const float x0 = *a, x1 = *b;
    *a = x0 * c - x1 * sn;
    *b = x0 * sn + x1 * c;
}

int kn_cuda_rope(float *x, int n_tok, int n_heads, int head_dim, int n_rot, const int32_t *pos,
                 float freq_base, int neox, void *stream)
{
    if (n_tok < 0 || n_heads <= 0 || n_rot <= 0 || n_rot % 2 || n_rot > head_dim || n_tok > 65535)
        return KM_EINVAL;
    if (n_tok == 0) return 0;
    const float theta_scale = powf(freq_base, -2.0f / (float)n_rot); /* the host's powf */
    const int pairs = n_heads * (n_rot / 2);
    dim3 grid((pairs + 127) / 128, n_tok);
    kn_rope_k<<<grid, 128, 0, kn_cuda_stream(stream)>>>(x, n_heads, head_dim, n_rot, pos,
                                                        theta_scale, neox);
    return kn_cuda_launched("rope");
}

/* ---------------------------------------------------------------- SwiGLU */

__global__ void kn_silu_mul_k(float *y, const float *g, const float *u, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

int kn_cuda_silu_mul(float *y, const float *g, const float *u, int64_t n, void *stream)
{
    if (n < 0) return KM_EINVAL;
    if (n == 0) return 0;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    kn_silu_mul_k<<<(unsigned)blocks, 256, 0, kn_cuda_stream(stream)>>>(y, g, u, n);
    return kn_cuda_launched("silu_mul");
}

/* ---------------------------------------------------------------- softmax, argmax */

__global__ void kn_softmax_k(float *y, const float *x, int n, float inv_temp)
{
    __shared__ float sh[32];
    const float *xr = x + (size_t)blockIdx.x * n;
    float *yr = y + (size_t)blockIdx.x * n;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, xr[i] * inv_temp);
    m = kn_block_reduce<float, true>(m, sh);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += expf(xr[i] * inv_temp - m);
    s = kn_block_reduce<float, false>(s, sh);
    const float inv = 1.0f / s;
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = expf(xr[i] * inv_temp - m) * inv;
}

int kn_cuda_softmax(float *y, const float *x, int rows, int n, float temp, void *stream)
{
    if (rows < 0 || n <= 0 || !(temp > 0)) return KM_EINVAL;
    if (rows == 0) return 0;
    kn_softmax_k<<<rows, KN_ROW_THREADS, 0, kn_cuda_stream(stream)>>>(y, x, n, 1.0f / temp);
    return kn_cuda_launched("softmax");
}

__global__ void kn_argmax_k(int32_t *idx, const float *x, int n)
{
    __shared__ float shv[KN_ROW_THREADS];
    __shared__ int shi[KN_ROW_THREADS];
    const float *xr = x + (size_t)blockIdx.x * n;
    float bv = -INFINITY;
    int bi = n; /* NaN and -inf rows still answer index 0 below */
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (xr[i] > bv || bi == n) bv = xr[i], bi = i;
    shv[threadIdx.x] = bv, shi[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = shv[threadIdx.x + s];
            const int oi = shi[threadIdx.x + s];
            if (ov > shv[threadIdx.x] || (ov == shv[threadIdx.x] && oi < shi[threadIdx.x]))
                shv[threadIdx.x] = ov, shi[threadIdx.x] = oi;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) idx[blockIdx.x] = shi[0] < n ? shi[0] : 0;
}

int kn_cuda_argmax(int32_t *idx, const float *x, int rows, int n, void *stream)
{
    if (rows < 0 || n <= 0) return KM_EINVAL;
    if (rows == 0) return 0;
    kn_argmax_k<<<rows, KN_ROW_THREADS, 0, kn_cuda_stream(stream)>>>(idx, x, n);
    return kn_cuda_launched("argmax");
}

/* ---------------------------------------------------------------- activation quantization */

/* One warp per 32-element block: lane j quantizes element j. */
__global__ void kn_quantize_q8_0_k(const float *x, size_t x_stride, uint8_t *y, size_t y_stride,
                                   int64_t nb)
{
    const int64_t b = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31, row = blockIdx.y;
    if (b >= nb) return; /* whole warps leave together: nb is per row */
    const float v = x[row * x_stride + b * 32 + lane];
    const float amax = kn_warp_max(fabsf(v));
    const float d = amax / 127.f;
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    /* round half to even, saturate: kn_ref_cvt_i8 for every finite input */
    int q = __float2int_rn(v * id);
    q = q < -128 ? -128 : q > 127 ? 127 : q;
    uint8_t *blk = y + row * y_stride + b * 34;
    blk[2 + lane] = (uint8_t)(int8_t)q;
    if (lane == 0) {
        const __half h = __float2half_rn(d);
        memcpy(blk, &h, 2);
    }
}

/* Q8_K (kn_ref_quantize_q8_K): one warp per 256-element block, lane l on elements 8l..8l+7. The
 * scale comes from the signed element of largest magnitude, the first one on a tie. */
__global__ void kn_quantize_q8_K_k(const float *x, size_t x_stride, uint8_t *y, size_t y_stride,
                                   int64_t nb)
{
    const int64_t b = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31, row = blockIdx.y;
    if (b >= nb) return;
    const float *xb = x + row * x_stride + b * 256 + lane * 8;
    float v[8], amax = 0.0f, max = 0.0f;
    int at = lane * 8;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        v[j] = xb[j];
        if (fabsf(v[j]) > amax) amax = fabsf(v[j]), max = v[j], at = lane * 8 + j;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float oa = __shfl_xor_sync(0xffffffffu, amax, o);
        const float om = __shfl_xor_sync(0xffffffffu, max, o);
        const int oat = __shfl_xor_sync(0xffffffffu, at, o);
        if (oa > amax || (oa == amax && oat < at)) amax = oa, max = om, at = oat;
    }
    uint8_t *yb = y + row * y_stride + b * 292; /* float d, int8 qs[256], int16 bsums[16] */
    const float iscale = amax != 0.0f ? -127.f / max : 0.0f;
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int q = __float2int_rn(__fmul_rn(iscale, v[j])); /* nearest_int: round half to even */
        q = q < 127 ? q : 127;
        yb[4 + lane * 8 + j] = (uint8_t)(int8_t)q;
        sum += q;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (!(lane & 1)) {
        const int16_t s16 = (int16_t)sum;
        memcpy(yb + 260 + lane, &s16, 2);
    }
    if (lane == 0) *(float *)yb = amax != 0.0f ? 1 / iscale : 0.0f;
}

__device__ __forceinline__ void kn_from_f32(float v, __half *out)
{
    *out = __float2half_rn(v);
}

__device__ __forceinline__ void kn_from_f32(float v, __nv_bfloat16 *out)
{
    *out = __float2bfloat16_rn(v);
}

/* F16 / BF16 activations: round to nearest even, as kn_f32_to_f16 and kn_f32_to_bf16. */
template <typename T>
__global__ void kn_to_16_k(const float *x, size_t x_stride, T *y, size_t y_stride, int64_t n)
{
    const int row = blockIdx.y;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        kn_from_f32(x[row * x_stride + i], &y[row * y_stride / 2 + i]);
}

int kn_cuda_quantize(md_type t, const float *x, size_t x_stride, void *y, size_t y_stride,
                     int64_t n, int m, void *stream)
{
    if (n <= 0 || m < 0 || m > 65535) return KM_EINVAL;
    if (m == 0) return 0;
    cudaStream_t s = kn_cuda_stream(stream);
    uint8_t *yb = (uint8_t *)y;
    if (t == MD_TYPE_Q8_0 || t == MD_TYPE_Q8_K) {
        const int qk = t == MD_TYPE_Q8_0 ? 32 : 256;
        if (n % qk || (t == MD_TYPE_Q8_K && ((uintptr_t)y | y_stride) % 4)) return KM_EINVAL;
        const int64_t nb = n / qk;
        dim3 grid((unsigned)((nb + 7) / 8), m); /* 8 warps of 256 threads, a block each */
        if (t == MD_TYPE_Q8_0)
            kn_quantize_q8_0_k<<<grid, 256, 0, s>>>(x, x_stride, yb, y_stride, nb);
        else
            kn_quantize_q8_K_k<<<grid, 256, 0, s>>>(x, x_stride, yb, y_stride, nb);
        return kn_cuda_launched(t == MD_TYPE_Q8_0 ? "quantize q8_0" : "quantize q8_K");
    }
    if (t != MD_TYPE_F16 && t != MD_TYPE_BF16) return KM_EINVAL;
    if (((uintptr_t)y | y_stride) % 2) return KM_EINVAL;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 4096) blocks = 4096;
    dim3 grid((unsigned)blocks, m);
    if (t == MD_TYPE_F16)
        kn_to_16_k<<<grid, 256, 0, s>>>(x, x_stride, (__half *)y, y_stride, n);
    else
        kn_to_16_k<<<grid, 256, 0, s>>>(x, x_stride, (__nv_bfloat16 *)y, y_stride, n);
    return kn_cuda_launched("quantize 16-bit");
}
