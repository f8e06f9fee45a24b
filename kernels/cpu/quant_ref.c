/*
 * quant_ref.c — the scalar reference for activation quantization, dequantization and the
 * quantized matrix multiply (kn_quantize_row_ref, kn_dequantize_row_ref, kn_matmul_ref), plus
 * kn_dot_type and kn_weight_type_supported.
 *
 * This file is the definition of the numerics; quant_avx2.c and quant_avx512.c are held to it by
 * tests/unit/test_kernels_quant.c. It follows llama.cpp's CPU back end as it runs on x86:
 *
 *  - Q8_0 / Q8_1 activations: d = amax/127, id = 127/amax (0 for an all-zero block), q =
 *    round-half-even(x*id), Q8_1's s = fp16(d * sum(q)). These are ggml's x86 quantize_row_q8_0
 *    and quantize_row_q8_1 (the AVX2 code that llama.cpp runs on every x86-64 build with AVX),
 *    not the portable quantize_row_q8_0_ref, which computes id = 1/d and rounds half away from
 *    zero; the two differ in rare ties and in the last bit of id, and llama.cpp on this hardware
 *    uses the former.
 *  - Q8_K activations: ggml's quantize_row_q8_K_ref exactly (iscale = -127/max with max the
 *    signed element of largest magnitude, first one wins; nearest_int rounding; d = 1/iscale;
 *    bsums over 16).
 *  - F16 / BF16 activations: round to nearest even (F16C's vcvtps2ph with imm 0; ggml's
 *    GGML_FP32_TO_BF16).
 *  - Dot products: the integer part of every block is exact (as in ggml); the float part follows
 *    ggml's generic ggml_vec_dot_* order: per block sumf += (d_w*d_x)*isum (+ m_w*s_x for Q4_1),
 *    K-quants with ggml's 8-lane partial sums. SIMD builds accumulate in another order and agree
 *    to float rounding.
 *
 * Half-precision scalars go through kn_f16_to_f32 / kn_f32_to_f16 (ops_ref.c), which are
 * bit-identical to F16C's vcvtph2ps / vcvtps2ph with round-to-nearest-even.
 *
 * Pointers to blocks, rows and activations need only their C alignment (2 bytes for fp16 and the
 * 32-element blocks, 4 for f32 and Q8_K), which any array of the block structs has.
 */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"

/* ------------------------------------------------------------------ scalar conversions */

/* ggml's nearest_int: round half to even through the float adder. */
static inline int kn_ref_nearest_int(float fval)
{
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* x86 float -> int8 as ggml's AVX2 quantizer does it: round half to even (vcvtps2dq), values
 * outside int32 and NaN become INT32_MIN, then saturating packs to int8. Only an all-subnormal
 * block (id = inf) reaches the out-of-range cases. */
static inline int8_t kn_ref_cvt_i8(float v)
{
    const float r = nearbyintf(v);
    if (!(r >= -2147483648.f && r < 2147483648.f)) return -128;
    return (int8_t)(r < -128.f ? -128 : r > 127.f ? 127 : (int)r);
}

/* ------------------------------------------------------------------ dot types */

md_type kn_dot_type(md_type wt)
{
    switch (wt) {
    case MD_TYPE_Q4_0:
    case MD_TYPE_Q8_0:
        return MD_TYPE_Q8_0;
    case MD_TYPE_Q4_1:
        return MD_TYPE_Q8_1;
    case MD_TYPE_Q4_K:
    case MD_TYPE_Q6_K:
        return MD_TYPE_Q8_K;
    case MD_TYPE_F16:
        return MD_TYPE_F16;
    case MD_TYPE_BF16:
        return MD_TYPE_BF16;
    case MD_TYPE_F32:
        return MD_TYPE_F32;
    default:
        return MD_TYPE_COUNT;
    }
}

int kn_weight_type_supported(md_type t)
{
    return kn_dot_type(t) != MD_TYPE_COUNT;
}

/* ------------------------------------------------------------------ activation quantization */

static void kn_ref_quantize_q8_0(const float *x, kn_block_q8_0 *y, int64_t n)
{
    assert(n % KN_QK8_0 == 0);
    for (int64_t i = 0; i < n / KN_QK8_0; i++, x += KN_QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < KN_QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        y[i].d = kn_f32_to_f16(d);
        for (int j = 0; j < KN_QK8_0; j++) y[i].qs[j] = kn_ref_cvt_i8(x[j] * id);
    }
}

static void kn_ref_quantize_q8_1(const float *x, kn_block_q8_1 *y, int64_t n)
{
    assert(n % KN_QK8_1 == 0);
    for (int64_t i = 0; i < n / KN_QK8_1; i++, x += KN_QK8_1) {
        float amax = 0.0f;
        for (int j = 0; j < KN_QK8_1; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < KN_QK8_1; j++) {
            y[i].qs[j] = kn_ref_cvt_i8(x[j] * id);
            sum += y[i].qs[j];
        }
        y[i].d = kn_f32_to_f16(d);
        y[i].s = kn_f32_to_f16(d * (float)sum);
    }
}

static void kn_ref_quantize_q8_K(const float *x, kn_block_q8_K *y, int64_t n)
{
    assert(n % KN_QK_K == 0);
    for (int64_t i = 0; i < n / KN_QK_K; i++, x += KN_QK_K) {
        float max = 0, amax = 0;
        for (int j = 0; j < KN_QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (!amax) {
            y[i].d = 0;
            memset(y[i].qs, 0, sizeof y[i].qs);
            memset(y[i].bsums, 0, sizeof y[i].bsums);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < KN_QK_K; j++) {
            int v = kn_ref_nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < KN_QK_K / 16; j++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += y[i].qs[j * 16 + l];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}

void kn_quantize_row_ref(md_type t, const float *x, void *y, int64_t n)
{
    switch (t) {
    case MD_TYPE_Q8_0:
        kn_ref_quantize_q8_0(x, y, n);
        break;
    case MD_TYPE_Q8_1:
        kn_ref_quantize_q8_1(x, y, n);
        break;
    case MD_TYPE_Q8_K:
        kn_ref_quantize_q8_K(x, y, n);
        break;
    case MD_TYPE_F16:
        for (int64_t i = 0; i < n; i++) ((kn_f16 *)y)[i] = kn_f32_to_f16(x[i]);
        break;
    case MD_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) ((kn_bf16 *)y)[i] = kn_f32_to_bf16(x[i]);
        break;
    case MD_TYPE_F32:
        memmove(y, x, (size_t)n * sizeof(float));
        break;
    default:
        assert(!"kn_quantize_row: unsupported type");
    }
}

/* ------------------------------------------------------------------ dequantization */

/* The 6-bit scale and min of sub-block j of a Q4_K super-block (ggml's get_scale_min_k4). */
static inline void kn_ref_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m)
{
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

void kn_dequantize_row_ref(md_type t, const void *vx, float *y, int64_t n)
{
    switch (t) {
    case MD_TYPE_F32:
        memmove(y, vx, (size_t)n * sizeof(float));
        break;
    case MD_TYPE_F16:
        for (int64_t i = 0; i < n; i++) y[i] = kn_f16_to_f32(((const kn_f16 *)vx)[i]);
        break;
    case MD_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) y[i] = kn_bf16_to_f32(((const kn_bf16 *)vx)[i]);
        break;
    case MD_TYPE_Q4_0: {
        const kn_block_q4_0 *x = vx;
        for (int64_t i = 0; i < n / KN_QK4_0; i++, y += KN_QK4_0) {
            const float d = kn_f16_to_f32(x[i].d);
            for (int j = 0; j < KN_QK4_0 / 2; j++) {
                y[j] = (float)((x[i].qs[j] & 0x0F) - 8) * d;
                y[j + KN_QK4_0 / 2] = (float)((x[i].qs[j] >> 4) - 8) * d;
            }
        }
        break;
    }
    case MD_TYPE_Q4_1: {
        const kn_block_q4_1 *x = vx;
        for (int64_t i = 0; i < n / KN_QK4_1; i++, y += KN_QK4_1) {
            const float d = kn_f16_to_f32(x[i].d), m = kn_f16_to_f32(x[i].m);
            for (int j = 0; j < KN_QK4_1 / 2; j++) {
                y[j] = (float)(x[i].qs[j] & 0x0F) * d + m;
                y[j + KN_QK4_1 / 2] = (float)(x[i].qs[j] >> 4) * d + m;
            }
        }
        break;
    }
    case MD_TYPE_Q8_0: {
        const kn_block_q8_0 *x = vx;
        for (int64_t i = 0; i < n / KN_QK8_0; i++, y += KN_QK8_0) {
            const float d = kn_f16_to_f32(x[i].d);
            for (int j = 0; j < KN_QK8_0; j++) y[j] = (float)x[i].qs[j] * d;
        }
        break;
    }
    case MD_TYPE_Q8_1: {
        const kn_block_q8_1 *x = vx;
        for (int64_t i = 0; i < n / KN_QK8_1; i++, y += KN_QK8_1) {
            const float d = kn_f16_to_f32(x[i].d);
            for (int j = 0; j < KN_QK8_1; j++) y[j] = (float)x[i].qs[j] * d;
        }
        break;
    }
    case MD_TYPE_Q8_K: {
        const kn_block_q8_K *x = vx;
        for (int64_t i = 0; i < n / KN_QK_K; i++, y += KN_QK_K)
            for (int j = 0; j < KN_QK_K; j++) y[j] = x[i].d * (float)x[i].qs[j];
        break;
    }
    case MD_TYPE_Q4_K: {
        const kn_block_q4_K *x = vx;
        for (int64_t i = 0; i < n / KN_QK_K; i++) {
            const uint8_t *q = x[i].qs;
            const float d = kn_f16_to_f32(x[i].d), min = kn_f16_to_f32(x[i].dmin);
            uint8_t sc, m;
            for (int j = 0, is = 0; j < KN_QK_K; j += 64, is += 2, q += 32) {
                kn_ref_scale_min_k4(is + 0, x[i].scales, &sc, &m);
                const float d1 = d * sc, m1 = min * m;
                kn_ref_scale_min_k4(is + 1, x[i].scales, &sc, &m);
                const float d2 = d * sc, m2 = min * m;
                for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
                for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
            }
        }
        break;
    }
    case MD_TYPE_Q6_K: {
        const kn_block_q6_K *x = vx;
        for (int64_t i = 0; i < n / KN_QK_K; i++) {
            const float d = kn_f16_to_f32(x[i].d);
            const uint8_t *ql = x[i].ql, *qh = x[i].qh;
            const int8_t *sc = x[i].scales;
            for (int h = 0; h < KN_QK_K; h += 128, y += 128, ql += 64, qh += 32, sc += 8) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    const int q1 = ((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l + 0] = d * sc[is + 0] * (float)q1;
                    y[l + 32] = d * sc[is + 2] * (float)q2;
                    y[l + 64] = d * sc[is + 4] * (float)q3;
                    y[l + 96] = d * sc[is + 6] * (float)q4;
                }
            }
        }
        break;
    }
    default:
        assert(!"kn_dequantize_row: unsupported type");
    }
}

/* ------------------------------------------------------------------ dot products */

static float kn_ref_dot_f32(const float *w, const float *x, int64_t k)
{
    float s = 0;
    for (int64_t j = 0; j < k; j++) s += w[j] * x[j];
    return s;
}

static float kn_ref_dot_f16(const kn_f16 *w, const kn_f16 *x, int64_t k)
{
    float s = 0;
    for (int64_t j = 0; j < k; j++) s += kn_f16_to_f32(w[j]) * kn_f16_to_f32(x[j]);
    return s;
}

static float kn_ref_dot_bf16(const kn_bf16 *w, const kn_bf16 *x, int64_t k)
{
    float s = 0;
    for (int64_t j = 0; j < k; j++) s += kn_bf16_to_f32(w[j]) * kn_bf16_to_f32(x[j]);
    return s;
}

static float kn_ref_dot_q4_0(const kn_block_q4_0 *w, const kn_block_q8_0 *x, int64_t k)
{
    float s = 0;
    for (int64_t b = 0; b < k / KN_QK4_0; b++) {
        int isum = 0;
        for (int j = 0; j < KN_QK4_0 / 2; j++) {
            isum += ((w[b].qs[j] & 0x0F) - 8) * x[b].qs[j];
            isum += ((w[b].qs[j] >> 4) - 8) * x[b].qs[j + KN_QK4_0 / 2];
        }
        s += (float)isum * kn_f16_to_f32(w[b].d) * kn_f16_to_f32(x[b].d);
    }
    return s;
}

static float kn_ref_dot_q4_1(const kn_block_q4_1 *w, const kn_block_q8_1 *x, int64_t k)
{
    float s = 0;
    for (int64_t b = 0; b < k / KN_QK4_1; b++) {
        int isum = 0;
        for (int j = 0; j < KN_QK4_1 / 2; j++) {
            isum += (w[b].qs[j] & 0x0F) * x[b].qs[j];
            isum += (w[b].qs[j] >> 4) * x[b].qs[j + KN_QK4_1 / 2];
        }
        s += (kn_f16_to_f32(w[b].d) * kn_f16_to_f32(x[b].d)) * (float)isum +
             kn_f16_to_f32(w[b].m) * kn_f16_to_f32(x[b].s);
    }
    return s;
}

static float kn_ref_dot_q8_0(const kn_block_q8_0 *w, const kn_block_q8_0 *x, int64_t k)
{
    float s = 0;
    for (int64_t b = 0; b < k / KN_QK8_0; b++) {
        int isum = 0;
        for (int j = 0; j < KN_QK8_0; j++) isum += w[b].qs[j] * x[b].qs[j];
        s += (float)isum * (kn_f16_to_f32(w[b].d) * kn_f16_to_f32(x[b].d));
    }
    return s;
}

static float kn_ref_dot_q4_K(const kn_block_q4_K *w, const kn_block_q8_K *x, int64_t k)
{
    float sums[8] = {0}, sumf = 0;
    for (int64_t b = 0; b < k / KN_QK_K; b++) {
        int32_t aux32[8] = {0};
        int sumi = 0;
        const int8_t *q8 = x[b].qs;
        for (int j = 0; j < KN_QK_K / 32; j++) {
            uint8_t sc, m;
            kn_ref_scale_min_k4(j, w[b].scales, &sc, &m);
            sumi += (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]) * m;
            const uint8_t *q4 = w[b].qs + (j / 2) * 32;
            const int shift = (j & 1) * 4;
            for (int l = 0; l < 32; l++) aux32[l % 8] += sc * (((q4[l] >> shift) & 0xF) * q8[l]);
            q8 += 32;
        }
        const float d = kn_f16_to_f32(w[b].d) * x[b].d;
        for (int l = 0; l < 8; l++) sums[l] += d * (float)aux32[l];
        const float dmin = kn_f16_to_f32(w[b].dmin) * x[b].d;
        sumf -= dmin * (float)sumi;
    }
    for (int l = 0; l < 8; l++) sumf += sums[l];
    return sumf;
}

static float kn_ref_dot_q6_K(const kn_block_q6_K *w, const kn_block_q8_K *x, int64_t k)
{
    float sums[8] = {0}, sumf = 0;
    int8_t a[KN_QK_K];
    for (int64_t b = 0; b < k / KN_QK_K; b++) {
        const uint8_t *ql = w[b].ql, *qh = w[b].qh;
        for (int h = 0; h < KN_QK_K; h += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; l++) {
                a[h + l + 0] = (int8_t)(((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                a[h + l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                a[h + l + 64] = (int8_t)(((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                a[h + l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        int32_t aux32[8] = {0};
        for (int j = 0; j < KN_QK_K / 16; j++) {
            const int scale = w[b].scales[j];
            for (int l = 0; l < 16; l++)
                aux32[l % 8] += scale * (a[16 * j + l] * x[b].qs[16 * j + l]);
        }
        const float d = kn_f16_to_f32(w[b].d) * x[b].d;
        for (int l = 0; l < 8; l++) sums[l] += d * (float)aux32[l];
    }
    for (int l = 0; l < 8; l++) sumf += sums[l];
    return sumf;
}

void kn_matmul_ref(md_type wt, const void *w, size_t w_stride, const void *x, size_t x_stride,
                   int64_t k, int m, float *y, size_t y_stride, int64_t r0, int64_t r1)
{
    const uint8_t *wb = w, *xb = x;
    for (int64_t r = r0; r < r1; r++) {
        const void *wr = wb + (size_t)r * w_stride;
        for (int i = 0; i < m; i++) {
            const void *xi = xb + (size_t)i * x_stride;
            float s;
            switch (wt) {
            case MD_TYPE_F32:
                s = kn_ref_dot_f32(wr, xi, k);
                break;
            case MD_TYPE_F16:
                s = kn_ref_dot_f16(wr, xi, k);
                break;
            case MD_TYPE_BF16:
                s = kn_ref_dot_bf16(wr, xi, k);
                break;
            case MD_TYPE_Q4_0:
                s = kn_ref_dot_q4_0(wr, xi, k);
                break;
            case MD_TYPE_Q4_1:
                s = kn_ref_dot_q4_1(wr, xi, k);
                break;
            case MD_TYPE_Q8_0:
                s = kn_ref_dot_q8_0(wr, xi, k);
                break;
            case MD_TYPE_Q4_K:
                s = kn_ref_dot_q4_K(wr, xi, k);
                break;
            case MD_TYPE_Q6_K:
                s = kn_ref_dot_q6_K(wr, xi, k);
                break;
            default:
                assert(!"kn_matmul: unsupported weight type");
                s = 0;
            }
            y[(size_t)i * y_stride + (size_t)r] = s;
        }
    }
}

/* The reference reads GGUF rows only: it repacks nothing (pack_size 0), so pack and matmul_packed
 * are never called on it. */
size_t kn_pack_size_ref(md_type wt, int64_t rows, int64_t k)
{
    (void)wt, (void)rows, (void)k;
    return 0;
}

void kn_pack_ref(md_type wt, const void *w, size_t w_stride, int64_t rows, int64_t k, void *out)
{
    (void)wt, (void)w, (void)w_stride, (void)rows, (void)k, (void)out;
    assert(!"kn_pack: the scalar table packs nothing (pack_size is 0)");
}

void kn_matmul_packed_ref(md_type wt, const void *packed, int64_t rows, const void *x,
                          size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0,
                          int64_t r1)
{
    (void)wt, (void)packed, (void)rows, (void)x, (void)x_stride, (void)k, (void)m, (void)y;
    (void)y_stride, (void)r0, (void)r1;
    assert(!"kn_matmul_packed: the scalar table packs nothing (pack_size is 0)");
}
