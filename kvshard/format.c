/*
 * format.c — how a page is laid out and encoded in each KV format, and the conversions between
 * formats (writing a token, sealing an int4 page, converting a live page in place).
 *
 * A page is n_layers * n_kv_heads units, unit (l, h) at (l * n_kv_heads + h) * unit bytes, each
 * unit [K data][V data][K scales][V scales]. f16/bf16 units have no scales, so an f16 page is
 * byte for byte the layout the engine always had. The element encodings are the ones
 * kernels/cpu/attn_kv.h decodes (tests/unit/test_kvshard_format.c holds the two together):
 *
 *   fp8  E4M3 (bias 7, max 448, no infinities), one f16 scale per 16 channels of a token row:
 *        x ~= e4m3(q) * scale, scale = absmax(group) / 448.
 *   int8 symmetric, one f16 scale per 16 channels of a token row: x ~= q * scale,
 *        scale = absmax(group) / 127.
 *        For both, a key's outlier channel (RoPE'd keys have a few) then sets the step of its own
 *        group only. fp8 had one scale per row up to disk page version 1 (+2.7% perplexity on
 *        one text against f16; the figures per group are in docs/kvshard.md).
 *   int4 KIVI: keys are grouped per channel over the page's tokens (f16 scale[hd] then min[hd]),
 *        values per token in groups of 32 channels (f16 (scale, min) pairs per group);
 *        x ~= n * scale + min, n in [0, 15], two channels per byte (low nibble = even channel).
 *
 * Why per-row scales for fp8/int8: a page fills one token at a time while the engine runs, and
 * a row's scales are final the moment the row is written, so quantization happens on
 * kv_seq_write with nothing to revisit. It costs 2 bytes per 16 values (12.5%). Keys of int4 need
 * the whole page (per-channel statistics), so int4 pages are written in f16 and sealed into int4
 * when they are complete (seq.c); the open page stays f16, which is also KIVI's full-precision
 * residual.
 *
 * Layer: encodings are pure functions of the store's layouts; kv_page_seal (a page re-encoded in
 * place) also takes a buffer and moves the page's bytes in the accounting, so this file sits on
 * page.c and nothing else.
 */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "kvshard/internal.h"

const char *kv_format_name(kv_format f)
{
    switch (f) {
    case KN_KV_F16:
        return "f16";
    case KN_KV_BF16:
        return "bf16";
    case KN_KV_FP8:
        return "fp8";
    case KN_KV_INT8:
        return "int8";
    case KN_KV_INT4:
        return "int4";
    }
    return "unknown";
}

int kv_format_parse(const char *s, kv_format *out)
{
    static const char *names[] = {"f16", "bf16", "fp8", "int8", "int4"};
    for (int i = 0; i < KV_FORMAT_COUNT; i++)
        if (s && !strcmp(s, names[i])) {
            *out = (kv_format)i;
            return 0;
        }
    return KM_EINVAL;
}

static int kv_int4_vgroup(int hd)
{
    return hd % 32 == 0 ? 32 : hd;
}

/* ---------------------------------------------------------------- fp8 E4M3 */

uint8_t kv_fp8_from_f32(float x)
{
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (isnan(a) || a >= 464.0f) return sign | 0x7e; /* saturate to 448: E4M3 has no inf */
    if (a < 0.015625f) {                             /* below 2^-6: subnormal steps of 2^-9 */
        int q = (int)nearbyintf(a * 512.0f);         /* 8 carries into the smallest normal */
        return sign | (uint8_t)q;
    }
    uint32_t u;
    memcpy(&u, &a, 4);
    u += 0x7ffffu + ((u >> 20) & 1); /* round the mantissa to 3 bits, nearest even */
    int e = (int)(u >> 23) - 127;
    uint32_t m = (u >> 20) & 7;
    if (e > 8 || (e == 8 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)((e + 7) << 3) | (uint8_t)m;
}

float kv_fp8_to_f32(uint8_t b)
{
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
    return b & 0x80 ? -v : v;
}

/* ---------------------------------------------------------------- rows */

static inline uint8_t *kv_unit(const kv_store *s, const uint8_t *page, kv_format f, int layer,
                               int head)
{
    return (uint8_t *)page + ((size_t)layer * s->n_heads + head) * s->lay[f].unit;
}

static float kv_get_f16(const uint8_t *p)
{
    kn_f16 h;
    memcpy(&h, p, 2);
    return kn_f16_to_f32(h);
}

/* Channels per scale of an fp8 or int8 row (kn_kv_group of attn_kv.h). */
static int kv_row_group(int hd)
{
    return hd % 16 == 0 ? 16 : hd;
}

/* n values of fp8 or int8 with their one scale. */
static void kv_quant_group(const float *x, int hd, kv_format f, uint8_t *q, uint8_t *scale)
{
    float amax = 0.0f;
    for (int c = 0; c < hd; c++) {
        float a = fabsf(x[c]);
        if (a > amax) amax = a; /* NaN never wins: the comparison is false */
    }
    const float qmax = f == KN_KV_FP8 ? 448.0f : 127.0f;
    kn_f16 sh = kn_f32_to_f16(amax / qmax);
    float sc = kn_f16_to_f32(sh);
    if (!(sc > 0.0f) || isinf(sc)) { /* all zero, underflow or overflow: store exact zeros */
        sh = kn_f32_to_f16(sc > 0.0f ? 65504.0f : 0.0f);
        sc = kn_f16_to_f32(sh);
    }
    memcpy(scale, &sh, 2);
    const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
    if (f == KN_KV_FP8) {
        for (int c = 0; c < hd; c++) q[c] = kv_fp8_from_f32(x[c] * inv);
    } else {
        for (int c = 0; c < hd; c++) {
            float r = nearbyintf(x[c] * inv);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[c] = (uint8_t)(int8_t)(isnan(r) ? 0 : r);
        }
    }
}

/* One row of fp8 or int8, one scale per group of 16 channels (so that an outlier channel of a
 * key, which RoPE'd keys have, costs precision only to its own group). */
static void kv_quant_row(const float *x, int hd, kv_format f, uint8_t *q, uint8_t *scales)
{
    const int g = kv_row_group(hd);
    for (int c = 0; c < hd; c += g) kv_quant_group(x + c, g, f, q + c, scales + (c / g) * 2);
}

void kv_page_write_row(const kv_store *s, uint8_t *page, kv_format f, int layer, int head, int row,
                       const float *k, const float *v)
{
    const kv_layout *L = &s->lay[f];
    const int hd = s->hd;
    uint8_t *u = kv_unit(s, page, f, layer, head);
    switch (f) {
    case KN_KV_F16:
        s->ops->f32_to_f16(k, (kn_f16 *)(u + (size_t)row * hd * 2), hd);
        s->ops->f32_to_f16(v, (kn_f16 *)(u + L->kd + (size_t)row * hd * 2), hd);
        break;
    case KN_KV_BF16:
        for (int c = 0; c < hd; c++) {
            kn_bf16 a = kn_f32_to_bf16(k[c]), b = kn_f32_to_bf16(v[c]);
            memcpy(u + ((size_t)row * hd + c) * 2, &a, 2);
            memcpy(u + L->kd + ((size_t)row * hd + c) * 2, &b, 2);
        }
        break;
    case KN_KV_FP8:
    case KN_KV_INT8: {
        const size_t ns = (size_t)(hd / kv_row_group(hd));
        kv_quant_row(k, hd, f, u + (size_t)row * hd, u + L->kd + L->vd + row * ns * 2);
        kv_quant_row(v, hd, f, u + L->kd + (size_t)row * hd,
                     u + L->kd + L->vd + L->ks + row * ns * 2);
    } break;
    case KN_KV_INT4:
        break; /* never written by row: sealed from f16 (kv_page_convert) */
    }
}

void kv_page_read_row(const kv_store *s, const uint8_t *page, kv_format f, int layer, int head,
                      int row, float *k, float *v)
{
    const kv_layout *L = &s->lay[f];
    const int hd = s->hd;
    const uint8_t *u = kv_unit(s, page, f, layer, head);
    switch (f) {
    case KN_KV_F16:
        for (int c = 0; c < hd; c++) {
            k[c] = kv_get_f16(u + ((size_t)row * hd + c) * 2);
            v[c] = kv_get_f16(u + L->kd + ((size_t)row * hd + c) * 2);
        }
        break;
    case KN_KV_BF16:
        for (int c = 0; c < hd; c++) {
            kn_bf16 a, b;
            memcpy(&a, u + ((size_t)row * hd + c) * 2, 2);
            memcpy(&b, u + L->kd + ((size_t)row * hd + c) * 2, 2);
            k[c] = kn_bf16_to_f32(a);
            v[c] = kn_bf16_to_f32(b);
        }
        break;
    case KN_KV_FP8:
    case KN_KV_INT8: {
        const int g = kv_row_group(hd);
        const size_t ns = (size_t)(hd / g);
        const uint8_t *kq = u + (size_t)row * hd, *vq = u + L->kd + (size_t)row * hd;
        for (int c = 0; c < hd; c++) {
            float ks = kv_get_f16(u + L->kd + L->vd + (row * ns + c / g) * 2);
            float vs = kv_get_f16(u + L->kd + L->vd + L->ks + (row * ns + c / g) * 2);
            if (f == KN_KV_FP8) {
                k[c] = kv_fp8_to_f32(kq[c]) * ks;
                v[c] = kv_fp8_to_f32(vq[c]) * vs;
            } else {
                k[c] = (float)(int8_t)kq[c] * ks;
                v[c] = (float)(int8_t)vq[c] * vs;
            }
        }
        break;
    }
    case KN_KV_INT4: {
        const int vg = kv_int4_vgroup(hd), ng = hd / vg;
        const uint8_t *kq = u + (size_t)row * (hd / 2), *vq = u + L->kd + (size_t)row * (hd / 2);
        const uint8_t *ksc = u + L->kd + L->vd, *vsc = ksc + L->ks + (size_t)row * ng * 4;
        for (int c = 0; c < hd; c++) {
            int nk = c & 1 ? kq[c / 2] >> 4 : kq[c / 2] & 15;
            int nv = c & 1 ? vq[c / 2] >> 4 : vq[c / 2] & 15;
            k[c] = nk * kv_get_f16(ksc + (size_t)c * 2) + kv_get_f16(ksc + (size_t)(hd + c) * 2);
            int g = c / vg;
            v[c] = nv * kv_get_f16(vsc + (size_t)g * 4) + kv_get_f16(vsc + (size_t)g * 4 + 2);
        }
        break;
    }
    }
}

/* ---------------------------------------------------------------- values that are numbers */

/* Whether any lane (16-bit lanes: lane_lo 0x0001..., 8-bit: 0x01...) of the n bytes at p has
 * every bit of `mask` (the mask replicated per lane) set: an f16/bf16 exponent all ones (an
 * infinity or a NaN), or an E4M3 NaN (S.1111.111). Eight bytes at a time: a lane of
 * x = (w & mask) ^ mask is zero exactly then, and (x - lo) & ~x & high is non-zero iff a lane of
 * x is zero. It runs over every page a peer sends, so it must keep up with the network. */
static int kv_any_lane_all_ones(const uint8_t *p, size_t n, uint64_t mask, uint64_t lane_lo)
{
    const uint64_t lane_hi = lane_lo << (lane_lo == 0x0101010101010101ull ? 7 : 15);
    uint64_t bad = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        uint64_t x = (w & mask) ^ mask;
        bad |= (x - lane_lo) & ~x & lane_hi;
    }
    if (i < n) { /* the tail, zero-padded: a padding lane of x is the mask, never zero */
        uint64_t w = 0;
        memcpy(&w, p + i, n - i);
        uint64_t x = (w & mask) ^ mask;
        bad |= (x - lane_lo) & ~x & lane_hi;
    }
    return bad != 0;
}

#define KV_LANES16(v) (0x0001000100010001ull * (uint64_t)(v))
#define KV_LANES8(v)  (0x0101010101010101ull * (uint64_t)(v))

int kv_page_finite(const kv_store *s, const uint8_t *page, kv_format f)
{
    const kv_layout *L = &s->lay[f];
    if (f == KN_KV_F16 || f == KN_KV_BF16)
        return !kv_any_lane_all_ones(page, L->page_bytes,
                                     KV_LANES16(f == KN_KV_F16 ? 0x7c00 : 0x7f80), KV_LANES16(1));
    size_t units = L->unit ? L->page_bytes / L->unit : 0;
    for (size_t i = 0; i < units; i++) {
        const uint8_t *u = page + i * L->unit;
        /* the scales (and int4's minimums) are f16 */
        if (kv_any_lane_all_ones(u + L->kd + L->vd, L->ks + L->vs, KV_LANES16(0x7c00),
                                 KV_LANES16(1)))
            return 0;
        /* E4M3 has no infinity; S.1111.111 is its NaN */
        if (f == KN_KV_FP8 && kv_any_lane_all_ones(u, L->kd + L->vd, KV_LANES8(0x7f), KV_LANES8(1)))
            return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- int4 */

/* Asymmetric 4-bit parameters of values x[i*stride], i < n: f16 scale and min, rounded first
 * so that quantization uses exactly what the kernel will multiply by. */
static void kv_int4_params(const float *x, int n, size_t stride, float *scale, float *mn,
                           uint8_t out[4])
{
    float lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < n; i++) {
        float a = x[(size_t)i * stride];
        if (isnan(a)) continue;
        lo = a < lo ? a : lo;
        hi = a > hi ? a : hi;
    }
    if (!(lo <= hi)) lo = hi = 0.0f;
    kn_f16 mh = kn_f32_to_f16(lo);
    float m = kn_f16_to_f32(mh);
    if (isinf(m)) {
        mh = kn_f32_to_f16(lo < 0 ? -65504.0f : 65504.0f);
        m = kn_f16_to_f32(mh);
    }
    kn_f16 sh = kn_f32_to_f16((hi - m) / 15.0f);
    float sc = kn_f16_to_f32(sh);
    if (isinf(sc) || !(sc >= 0.0f)) {
        sh = kn_f32_to_f16(65504.0f);
        sc = kn_f16_to_f32(sh);
    }
    memcpy(out, &sh, 2);
    memcpy(out + 2, &mh, 2);
    *scale = sc;
    *mn = m;
}

static inline uint8_t kv_int4_q(float x, float sc, float mn)
{
    if (!(sc > 0.0f)) return 0;
    float r = nearbyintf((x - mn) / sc);
    return (uint8_t)(r > 15.0f ? 15 : r < 0.0f || isnan(r) ? 0 : (int)r);
}

/* K and V [pt][hd] floats of one (layer, head) into an int4 unit. */
static void kv_int4_encode_unit(const kv_store *s, const float *K, const float *V, uint8_t *u)
{
    const kv_layout *L = &s->lay[KN_KV_INT4];
    const int pt = s->pt, hd = s->hd, vg = kv_int4_vgroup(hd), ng = hd / vg;
    uint8_t *kq = u, *vq = u + L->kd, *ksc = u + L->kd + L->vd, *vsc = ksc + L->ks;
    memset(kq, 0, L->kd);
    memset(vq, 0, L->vd);
    for (int c = 0; c < hd; c++) {
        uint8_t p[4];
        float sc, mn;
        kv_int4_params(K + c, pt, hd, &sc, &mn, p);
        memcpy(ksc + (size_t)c * 2, p, 2);
        memcpy(ksc + (size_t)(hd + c) * 2, p + 2, 2);
        for (int t = 0; t < pt; t++) {
            uint8_t n = kv_int4_q(K[(size_t)t * hd + c], sc, mn);
            kq[(size_t)t * (hd / 2) + c / 2] |= c & 1 ? n << 4 : n;
        }
    }
    for (int t = 0; t < pt; t++) {
        for (int g = 0; g < ng; g++) {
            float sc, mn;
            const float *x = V + (size_t)t * hd + (size_t)g * vg;
            kv_int4_params(x, vg, 1, &sc, &mn, vsc + ((size_t)t * ng + g) * 4);
            for (int i = 0; i < vg; i++) {
                int c = g * vg + i;
                uint8_t n = kv_int4_q(x[i], sc, mn);
                vq[(size_t)t * (hd / 2) + c / 2] |= c & 1 ? n << 4 : n;
            }
        }
    }
}

void kv_page_convert(kv_store *s, const uint8_t *src, kv_format a, uint8_t *dst, kv_format b)
{
    const int pt = s->pt, hd = s->hd;
    float *K = s->fscratch, *V = s->fscratch + (size_t)pt * hd;
    for (int l = 0; l < s->n_layers; l++)
        for (int h = 0; h < s->n_heads; h++) {
            for (int t = 0; t < pt; t++)
                kv_page_read_row(s, src, a, l, h, t, K + (size_t)t * hd, V + (size_t)t * hd);
            if (b == KN_KV_INT4) {
                kv_int4_encode_unit(s, K, V, kv_unit(s, dst, b, l, h));
            } else {
                for (int t = 0; t < pt; t++)
                    kv_page_write_row(s, dst, b, l, h, t, K + (size_t)t * hd, V + (size_t)t * hd);
            }
        }
}

/* Re-encodes a hot page as int4 (its shard's format). Sealing shrinks the page, so it may pass
 * the budget for the moment it takes. The caller refreshes the tables that point at it. */
#define KV_SUM_MAX_HD 1024 /* the largest head_dim a store takes (store.c) */

/* x as f16 rounded toward -inf (down) or +inf (up): a bound in f32 stays one in f16. */
static kn_f16 kv_f16_outward(float x, int up)
{
    kn_f16 h = kn_f32_to_f16(x);
    const float y = kn_f16_to_f32(h);
    if (y != y || (up ? y >= x : y <= x)) return h;
    /* one step further out: magnitude up on the side moved to, down on the other */
    const int neg = (h & 0x8000) != 0;
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001; /* +-0: the smallest subnormal */
    return (kn_f16)(neg == !up ? h + 1 : h - 1);
}

void kv_page_summarize(const kv_store *s, kv_page *p, int layer)
{
    float k[KV_SUM_MAX_HD], v[KV_SUM_MAX_HD], mn[KV_SUM_MAX_HD], mx[KV_SUM_MAX_HD];
    const int hd = s->hd;
    if (!p->sum || !p->buf || hd > KV_SUM_MAX_HD) return;
    for (int h = 0; h < s->n_heads; h++) {
        for (int r = 0; r < s->pt; r++) {
            kv_page_read_row(s, p->buf, p->format, layer, h, r, k, v);
            for (int c = 0; c < hd; c++) {
                mn[c] = r && mn[c] < k[c] ? mn[c] : k[c];
                mx[c] = r && mx[c] > k[c] ? mx[c] : k[c];
            }
        }
        kn_f16 *out = p->sum + kv_sum_off(s->n_heads, hd, layer, h);
        for (int c = 0; c < hd; c++) {
            out[c] = kv_f16_outward(mn[c], 0);
            out[hd + c] = kv_f16_outward(mx[c], 1);
        }
    }
    p->sum_ok[layer] = 1;
}

int kv_page_seal(kv_store *s, kv_page *p)
{
    return kv_page_seal_as(s, p, 1);
}

int kv_page_seal_as(kv_store *s, kv_page *p, int convert)
{
    assert(p->tier == KV_TIER_HOT && p->buf && p->format != KN_KV_INT4);
    uint8_t *nb = kv_buf_get(s, KN_KV_INT4);
    if (!nb) return KM_ENOMEM;
    kv_acct_add(s, p->shard, KV_TIER_HOT, KN_KV_INT4, 1);
    if (convert) kv_page_convert(s, p->buf, p->format, nb, KN_KV_INT4);
    kv_acct_sub(s, p->shard, KV_TIER_HOT, p->format);
    kv_buf_put(s, p->buf, p->format);
    p->buf = nb;
    p->format = KN_KV_INT4;
    kv_page_sum_clear(s, p);
    s->st.sealed_pages++;
    return 0;
}
