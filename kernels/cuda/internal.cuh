/*
 * internal.cuh — what the CUDA kernel files share: the launch check every host wrapper ends with
 * and the warp reductions. Private to kernels/cuda/.
 */
#ifndef KN_CUDA_INTERNAL_CUH
#define KN_CUDA_INTERNAL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>

#include "kernels/cuda/kn_cuda.h"

/* Records a failed CUDA call's message for kn_cuda_last_error; returns KM_EIO. */
int kn_cuda_fail(const char *what, cudaError_t e);

/* After a launch: the launch's own error (bad configuration, no device), as kn_cuda_fail. */
static inline int kn_cuda_launched(const char *what)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : kn_cuda_fail(what, e);
}

static inline cudaStream_t kn_cuda_stream(void *s)
{
    return (cudaStream_t)s;
}

__device__ __forceinline__ float kn_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float kn_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#endif
