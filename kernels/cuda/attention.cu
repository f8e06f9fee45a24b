/*
 * attention.cu — kn_cuda_attention: one token's decode attention over f16 KV pages read in place
 * (kn_ops.attention for KN_KV_F16 views; kvshard's page layout, kernels.h's kn_kv_view).
 *
 * One block of KN_ATT_THREADS per query head. Tokens go KN_ATT_THREADS at a time: each thread
 * scores one token (q·k over head_dim, K read from its page), the block takes the chunk's
 * maximum, rescales what it has accumulated (online softmax, as kn_attention_ref does over its
 * chunks), and then each thread accumulates V for its own output channels over the chunk, so V
 * rows are read across the block in consecutive halves. A first version: no split over the
 * context, no tensor cores, one query head per block; docs/gpu.md.
 */
#include "kernels/cuda/internal.cuh"

#define KN_ATT_THREADS 128
#define KN_ATT_MAX_HD  256

__global__ void kn_attention_f16_k(const uint8_t *const *pages, size_t k_off, size_t v_off,
                                   int page_tokens, int n_ctx, int hd, const float *q, float scale,
                                   float *out)
{
    __shared__ float qs[KN_ATT_MAX_HD], p[KN_ATT_THREADS], red[32];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int d = tid; d < hd; d += KN_ATT_THREADS) qs[d] = q[(size_t)h * hd + d];
    float o[KN_ATT_MAX_HD / KN_ATT_THREADS] = {0};
    float m = -INFINITY, l = 0.0f;
    __syncthreads();
    for (int t0 = 0; t0 < n_ctx; t0 += KN_ATT_THREADS) {
        const int t = t0 + tid;
        float s = -INFINITY;
        if (t < n_ctx) {
            const __half *k =
                (const __half *)(pages[t / page_tokens] + k_off) + (size_t)(t % page_tokens) * hd;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += qs[d] * __half2float(k[d]);
            s = scale * dot;
        }
        float cm = kn_warp_max(s);
        if (lane == 0) red[warp] = cm;
        __syncthreads();
        cm = red[0];
        for (int w = 1; w < KN_ATT_THREADS / 32; w++) cm = fmaxf(cm, red[w]);
        __syncthreads(); /* red is reused below */
        const float mn = fmaxf(m, cm);
        const float corr = expf(m - mn); /* 0 on the first chunk (m = -inf) */
        const float pt = t < n_ctx ? expf(s - mn) : 0.0f;
        p[tid] = pt;
        float ps = kn_warp_sum(pt);
        if (lane == 0) red[warp] = ps;
        __syncthreads();
        ps = 0.0f;
        for (int w = 0; w < KN_ATT_THREADS / 32; w++) ps += red[w];
        l = l * corr + ps;
        m = mn;
        const int nc = n_ctx - t0 < KN_ATT_THREADS ? n_ctx - t0 : KN_ATT_THREADS;
#pragma unroll
        for (int j = 0; j < KN_ATT_MAX_HD / KN_ATT_THREADS; j++) {
            const int d = tid + j * KN_ATT_THREADS;
            if (d >= hd) break;
            float acc = o[j] * corr;
            for (int c = 0; c < nc; c++) {
                const int tt = t0 + c;
                const __half *v = (const __half *)(pages[tt / page_tokens] + v_off) +
                                  (size_t)(tt % page_tokens) * hd;
                acc += p[c] * __half2float(v[d]);
            }
            o[j] = acc;
        }
        __syncthreads(); /* p and red are rewritten by the next chunk */
    }
#pragma unroll
    for (int j = 0; j < KN_ATT_MAX_HD / KN_ATT_THREADS; j++) {
        const int d = tid + j * KN_ATT_THREADS;
        if (d < hd) out[(size_t)h * hd + d] = n_ctx > 0 ? o[j] / l : 0.0f;
    }
}

int kn_cuda_attention_f16(const uint8_t *const *pages, size_t k_off, size_t v_off, int page_tokens,
                          int n_ctx, int head_dim, const float *q, int n_q, float scale, float *out,
                          void *stream)
{
    if (page_tokens <= 0 || n_ctx < 0 || head_dim <= 0 || head_dim > KN_ATT_MAX_HD || n_q <= 0 ||
        (k_off | v_off) % 2)
        return KM_EINVAL;
    kn_attention_f16_k<<<n_q, KN_ATT_THREADS, 0, kn_cuda_stream(stream)>>>(
        pages, k_off, v_off, page_tokens, n_ctx, head_dim, q, scale, out);
    return kn_cuda_launched("attention f16");
}
