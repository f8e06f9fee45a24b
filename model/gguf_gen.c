/*
 * gguf_gen.c — writes a Llama-family GGUF of a chosen shape with random weights (md_gguf_gen).
 *
 * Why: the GPU work (docs/gpu.md) needs models of 1B- and 8B-class shapes in every weight type
 * on a machine that takes at most 64 MiB of working tree and reaches no download site, so the
 * models are made there, from a seed, in seconds. Speed does not depend on the weights' values;
 * agreement tests (CPU vs GPU on one file) do not need meaningful ones.
 *
 * How: one pass, streamed through a small buffer, so an 8B-class file never sits in memory. Each
 * tensor draws from its own splitmix64 stream seeded by (seed, tensor index), so a file is a pure
 * function of its configuration. Quantized blocks are random bytes whose scale fields are then
 * overwritten with a scale that gives the weights about the spread of a float matrix
 * initialised uniformly with standard deviation 1/sqrt(row length); norms are 1 +- 5%. The
 * tokenizer is SentencePiece-style ("llama"): <unk>, <s>, </s>, the 256 byte tokens <0xXX>, the
 * printable ASCII characters with and without a leading U+2581, then <unused_N> fillers up to the
 * vocabulary size, so any text encodes (into characters and bytes) and every id decodes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

#define GEN_ALIGN 32
#define GEN_BUF   (1u << 20)

/* ---------------------------------------------------------------- output with a sticky error */

typedef struct gen_out {
    FILE *f;
    int failed;
    uint64_t off; /* bytes written */
} gen_out;

static void gen_put(gen_out *o, const void *p, size_t n)
{
    if (!o->failed && n && fwrite(p, 1, n, o->f) != n) o->failed = 1;
    o->off += n;
}

static void gen_u32(gen_out *o, uint32_t v)
{
    gen_put(o, &v, 4); /* GGUF is little-endian, as is every machine kvmesh builds for */
}

static void gen_u64(gen_out *o, uint64_t v)
{
    gen_put(o, &v, 8);
}

static void gen_str(gen_out *o, const char *s)
{
    gen_u64(o, strlen(s));
    gen_put(o, s, strlen(s));
}

static void gen_key(gen_out *o, const char *key, md_gguf_type t)
{
    gen_str(o, key);
    gen_u32(o, (uint32_t)t);
}

static void gen_kv_u32(gen_out *o, const char *key, uint32_t v)
{
    gen_key(o, key, MD_GGUF_UINT32);
    gen_u32(o, v);
}

static void gen_kv_f32(gen_out *o, const char *key, float v)
{
    gen_key(o, key, MD_GGUF_FLOAT32);
    gen_put(o, &v, 4);
}

static void gen_kv_str(gen_out *o, const char *key, const char *v)
{
    gen_key(o, key, MD_GGUF_STRING);
    gen_str(o, v);
}

static void gen_kv_bool(gen_out *o, const char *key, int v)
{
    gen_key(o, key, MD_GGUF_BOOL);
    uint8_t b = v != 0;
    gen_put(o, &b, 1);
}

static void gen_pad(gen_out *o)
{
    static const uint8_t zeros[GEN_ALIGN];
    gen_put(o, zeros, (GEN_ALIGN - o->off % GEN_ALIGN) % GEN_ALIGN);
}

/* ---------------------------------------------------------------- random numbers */

static uint64_t gen_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float gen_unit(uint64_t *s)
{
    return (float)(gen_next(s) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* Round to nearest even; finite values only, clamped to the largest half (the weights and scales
 * written here are far inside it). Subnormal halves are multiples of 2^-24. */
static uint16_t gen_f16(float f)
{
    uint32_t u;
    const float a = fabsf(f);
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    if (a >= 65504.0f) return sign | 0x7bff;
    if (a < 6.103515625e-05f) return sign | (uint16_t)nearbyintf(a * 16777216.0f);
    memcpy(&u, &a, 4);
    u += 0xfff + ((u >> 13) & 1);
    return sign | (uint16_t)((u >> 13) - (112u << 10));
}

static uint16_t gen_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); /* finite values only */
}

/* ---------------------------------------------------------------- tensors */

typedef struct gen_tensor {
    char name[64];
    int64_t ne0, ne1; /* ne1 = 0: a vector */
    md_type type;
} gen_tensor;

/* Where each quantized type keeps its f16 scale(s) in a block, and the spread of the integer
 * part the scale multiplies (random bytes: int8 std 73.9, nibble std 4.61; Q4_K adds its 6-bit
 * sub-scales, mean 31.5; Q6_K its int8 ones), so that scale * spread = the wanted deviation. */
static void gen_fix_block(md_type t, uint8_t *b, float sd, uint64_t *s)
{
    const float j = 0.75f + 0.25f * (gen_unit(s) + 1.0f); /* scales vary by +-25% */
    uint16_t h;
    switch (t) {
    case MD_TYPE_Q8_0:
        h = gen_f16(j * sd / 73.9f);
        memcpy(b, &h, 2);
        break;
    case MD_TYPE_Q4_0:
        h = gen_f16(j * sd / 4.61f);
        memcpy(b, &h, 2);
        break;
    case MD_TYPE_Q4_1: {
        const float d = j * sd / 4.61f;
        h = gen_f16(d);
        memcpy(b, &h, 2);
        h = gen_f16(-7.5f * d); /* centres the nibbles */
        memcpy(b + 2, &h, 2);
        break;
    }
    case MD_TYPE_Q4_K: {
        const float d = j * sd / (31.5f * 4.61f);
        h = gen_f16(d);
        memcpy(b, &h, 2);
        h = gen_f16(7.5f * d); /* dmin: mins of mean 31.5 offset the mean nibble */
        memcpy(b + 2, &h, 2);
        break;
    }
    case MD_TYPE_Q6_K:
        h = gen_f16(j * sd / (73.9f * 18.5f));
        memcpy(b + 208, &h, 2);
        break;
    default:
        break;
    }
}

/* Writes one tensor's data from its own stream. */
static void gen_tensor_data(gen_out *o, const gen_tensor *t, uint64_t seed, int index, void *buf)
{
    uint64_t s = seed ^ (0x6a09e667f3bcc909ULL * (uint64_t)(index + 1));
    gen_next(&s);
    const int64_t rows = t->ne1 ? t->ne1 : 1, k = t->ne0;
    const size_t row_bytes = md_type_row_bytes(t->type, k);
    const size_t per_buf = row_bytes >= GEN_BUF ? 1 : GEN_BUF / row_bytes;
    /* token_embd rows are looked up, not multiplied: unit spread, as real embeddings are after
     * the first norm; a vector is a norm weight */
    const int is_embd = !strcmp(t->name, "token_embd.weight");
    const float sd = !t->ne1 ? 0.05f : is_embd ? 1.0f : 1.0f / sqrtf((float)k);
    for (int64_t r0 = 0; r0 < rows; r0 += (int64_t)per_buf) {
        const int64_t nr = rows - r0 < (int64_t)per_buf ? rows - r0 : (int64_t)per_buf;
        const size_t n = (size_t)nr * row_bytes;
        uint8_t *p = buf;
        if (t->type == MD_TYPE_F32 || t->type == MD_TYPE_F16 || t->type == MD_TYPE_BF16) {
            const int64_t ne = nr * k;
            const float a = sd * 1.7320508f; /* uniform on [-a, a] has deviation sd */
            for (int64_t i = 0; i < ne; i++) {
                const float v = (t->ne1 ? 0.0f : 1.0f) + a * gen_unit(&s);
                if (t->type == MD_TYPE_F32) {
                    memcpy(p + 4 * i, &v, 4);
                } else {
                    const uint16_t h = t->type == MD_TYPE_F16 ? gen_f16(v) : gen_bf16(v);
                    memcpy(p + 2 * i, &h, 2);
                }
            }
        } else {
            for (size_t i = 0; i < n; i += 8) {
                const uint64_t v = gen_next(&s);
                memcpy(p + i, &v, n - i < 8 ? n - i : 8);
            }
            const size_t bb = (size_t)md_type_block_bytes(t->type);
            for (size_t i = 0; i < n; i += bb) gen_fix_block(t->type, p + i, sd, &s);
        }
        gen_put(o, p, n);
    }
}

static size_t gen_tensor_bytes(const gen_tensor *t)
{
    return md_type_row_bytes(t->type, t->ne0) * (size_t)(t->ne1 ? t->ne1 : 1);
}

/* ---------------------------------------------------------------- tokenizer */

#define GEN_N_SPECIAL 3
#define GEN_N_BYTES   256
#define GEN_N_CHARS   95 /* ' ' .. '~' */

int md_gguf_gen_min_vocab(void)
{
    return GEN_N_SPECIAL + GEN_N_BYTES + 2 * GEN_N_CHARS;
}

/* Token i's text and type (1 normal, 2 unknown, 3 control, 5 unused, 6 byte) into buf. */
static int gen_token(int i, char *buf, size_t cap)
{
    static const char *const special[GEN_N_SPECIAL] = {"<unk>", "<s>", "</s>"};
    if (i < GEN_N_SPECIAL) {
        snprintf(buf, cap, "%s", special[i]);
        return i == 0 ? 2 : 3;
    }
    i -= GEN_N_SPECIAL;
    if (i < GEN_N_BYTES) {
        snprintf(buf, cap, "<0x%02X>", i);
        return 6;
    }
    i -= GEN_N_BYTES;
    if (i < GEN_N_CHARS) {
        snprintf(buf, cap, "%c", ' ' + i);
        return 1;
    }
    i -= GEN_N_CHARS;
    if (i < GEN_N_CHARS) {
        snprintf(buf, cap, "\xe2\x96\x81%c", ' ' + i);
        return 1;
    }
    snprintf(buf, cap, "<unused_%d>", i - GEN_N_CHARS);
    return 5;
}

static void gen_tokenizer(gen_out *o, int n_vocab)
{
    char tok[32];
    gen_kv_str(o, "tokenizer.ggml.model", "llama");
    gen_key(o, "tokenizer.ggml.tokens", MD_GGUF_ARRAY);
    gen_u32(o, MD_GGUF_STRING);
    gen_u64(o, (uint64_t)n_vocab);
    for (int i = 0; i < n_vocab; i++) {
        gen_token(i, tok, sizeof tok);
        gen_str(o, tok);
    }
    /* Scores: longer pieces first where SentencePiece merges (only "▁c" pairs merge here). */
    gen_key(o, "tokenizer.ggml.scores", MD_GGUF_ARRAY);
    gen_u32(o, MD_GGUF_FLOAT32);
    gen_u64(o, (uint64_t)n_vocab);
    for (int i = 0; i < n_vocab; i++) {
        const float sc = -(float)i;
        gen_put(o, &sc, 4);
    }
    gen_key(o, "tokenizer.ggml.token_type", MD_GGUF_ARRAY);
    gen_u32(o, MD_GGUF_INT32);
    gen_u64(o, (uint64_t)n_vocab);
    for (int i = 0; i < n_vocab; i++) {
        const int32_t ty = gen_token(i, tok, sizeof tok);
        gen_put(o, &ty, 4);
    }
    gen_kv_u32(o, "tokenizer.ggml.unknown_token_id", 0);
    gen_kv_u32(o, "tokenizer.ggml.bos_token_id", 1);
    gen_kv_u32(o, "tokenizer.ggml.eos_token_id", 2);
    gen_kv_bool(o, "tokenizer.ggml.add_bos_token", 1);
}

/* ---------------------------------------------------------------- the file */

static int gen_check(const md_gguf_gen_cfg *c, km_errbuf *err)
{
    if (c->n_layers < 1 || c->n_layers > 1024 || c->n_embd < 1 || c->n_head < 1 ||
        c->n_head_kv < 1 || c->n_ff < 1 || c->n_embd % c->n_head || c->n_head % c->n_head_kv ||
        (c->n_embd / c->n_head) % 2)
        return km_errf(err, KM_EINVAL,
                       "gguf-gen: inconsistent shape layers=%d dim=%d heads=%d kv_heads=%d ff=%d "
                       "(dim a multiple of heads, heads of kv_heads, an even head size)",
                       c->n_layers, c->n_embd, c->n_head, c->n_head_kv, c->n_ff);
    if (c->n_vocab < md_gguf_gen_min_vocab())
        return km_errf(err, KM_EINVAL, "gguf-gen: vocab %d is under the tokenizer's %d tokens",
                       c->n_vocab, md_gguf_gen_min_vocab());
    const md_type t = c->type;
    if (t != MD_TYPE_F32 && t != MD_TYPE_F16 && t != MD_TYPE_BF16 && t != MD_TYPE_Q4_0 &&
        t != MD_TYPE_Q4_1 && t != MD_TYPE_Q8_0 && t != MD_TYPE_Q4_K && t != MD_TYPE_Q6_K)
        return km_errf(err, KM_EUNSUPPORTED, "gguf-gen: weight type %s is not written",
                       md_type_name(t));
    const int be = md_type_block_elems(t);
    const int ks[] = {c->n_embd, c->n_ff};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++)
        if (ks[i] % be)
            return km_errf(err, KM_EINVAL,
                           "gguf-gen: %s needs rows a multiple of %d elements; dim %d, ff %d",
                           md_type_name(t), be, c->n_embd, c->n_ff);
    return 0;
}

/* The tensor list, in llama.cpp's order; returns the count (out has room for 3 + 9 per layer). */
static int gen_tensors(const md_gguf_gen_cfg *c, gen_tensor *out)
{
    const int64_t hd = c->n_embd / c->n_head, qd = c->n_embd, kvd = hd * c->n_head_kv;
    int n = 0;
#define GEN_T(nm, a, b, ty)                                                                        \
    out[n++] = (gen_tensor){.ne0 = (a), .ne1 = (b), .type = (ty)},                                 \
    snprintf(out[n - 1].name, sizeof out[n - 1].name, "%s", nm)
    GEN_T("token_embd.weight", c->n_embd, c->n_vocab, c->type);
    GEN_T("output_norm.weight", c->n_embd, 0, MD_TYPE_F32);
    if (!c->tied_output) GEN_T("output.weight", c->n_embd, c->n_vocab, c->type);
    for (int l = 0; l < c->n_layers; l++) {
        static const char *const sfx[9] = {
            "attn_norm.weight", "attn_q.weight",      "attn_k.weight",
            "attn_v.weight",    "attn_output.weight", "ffn_norm.weight",
            "ffn_gate.weight",  "ffn_up.weight",      "ffn_down.weight"};
        const int64_t shape[9][2] = {
            {c->n_embd, 0},       {c->n_embd, qd},      {c->n_embd, kvd},
            {c->n_embd, kvd},     {qd, c->n_embd},      {c->n_embd, 0},
            {c->n_embd, c->n_ff}, {c->n_embd, c->n_ff}, {c->n_ff, c->n_embd}};
        for (int i = 0; i < 9; i++) {
            char nm[64];
            snprintf(nm, sizeof nm, "blk.%d.%s", l, sfx[i]);
            GEN_T(nm, shape[i][0], shape[i][1], shape[i][1] ? c->type : MD_TYPE_F32);
        }
    }
#undef GEN_T
    return n;
}

int md_gguf_gen(const md_gguf_gen_cfg *c, const char *path, km_errbuf *err)
{
    int rc = gen_check(c, err);
    if (rc) return rc;
    gen_tensor *ts = calloc(3 + 9 * (size_t)c->n_layers, sizeof *ts);
    void *buf = malloc(GEN_BUF);
    if (!ts || !buf) {
        free(ts), free(buf);
        return km_errf(err, KM_ENOMEM, "gguf-gen: out of memory");
    }
    const int nt = gen_tensors(c, ts);
    /* one row larger than the buffer (a huge vocabulary row) gets a buffer of its own */
    size_t max_row = 0;
    for (int i = 0; i < nt; i++) {
        size_t rb = md_type_row_bytes(ts[i].type, ts[i].ne0);
        if (rb > max_row) max_row = rb;
    }
    if (max_row > GEN_BUF) {
        void *big = realloc(buf, max_row);
        if (!big) {
            free(ts), free(buf);
            return km_errf(err, KM_ENOMEM, "gguf-gen: out of memory");
        }
        buf = big;
    }
    gen_out o = {.f = fopen(path, "wb")};
    if (!o.f) {
        free(ts), free(buf);
        return km_errf(err, KM_EIO, "gguf-gen: cannot create %s", path);
    }
    const int n_kv = 13 + 8;
    gen_put(&o, "GGUF", 4);
    gen_u32(&o, 3);
    gen_u64(&o, (uint64_t)nt);
    gen_u64(&o, (uint64_t)n_kv);
    char desc[160];
    snprintf(desc, sizeof desc,
             "random weights from seed %llu, written by kvmesh's gguf-gen: not a trained model",
             (unsigned long long)c->seed);
    gen_kv_str(&o, "general.architecture", "llama");
    gen_kv_str(&o, "general.name", "kvmesh-gguf-gen");
    gen_kv_str(&o, "general.description", desc);
    gen_kv_u32(&o, "general.alignment", GEN_ALIGN);
    gen_kv_u32(&o, "llama.block_count", (uint32_t)c->n_layers);
    gen_kv_u32(&o, "llama.context_length", (uint32_t)(c->n_ctx ? c->n_ctx : 4096));
    gen_kv_u32(&o, "llama.embedding_length", (uint32_t)c->n_embd);
    gen_kv_u32(&o, "llama.feed_forward_length", (uint32_t)c->n_ff);
    gen_kv_u32(&o, "llama.attention.head_count", (uint32_t)c->n_head);
    gen_kv_u32(&o, "llama.attention.head_count_kv", (uint32_t)c->n_head_kv);
    gen_kv_u32(&o, "llama.vocab_size", (uint32_t)c->n_vocab);
    gen_kv_f32(&o, "llama.rope.freq_base", c->rope_base > 0 ? c->rope_base : 10000.0f);
    gen_kv_f32(&o, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    gen_tokenizer(&o, c->n_vocab); /* 8 keys */

    uint64_t off = 0;
    for (int i = 0; i < nt; i++) {
        gen_str(&o, ts[i].name);
        gen_u32(&o, ts[i].ne1 ? 2 : 1);
        gen_u64(&o, (uint64_t)ts[i].ne0);
        if (ts[i].ne1) gen_u64(&o, (uint64_t)ts[i].ne1);
        gen_u32(&o, (uint32_t)ts[i].type);
        gen_u64(&o, off);
        off += (gen_tensor_bytes(&ts[i]) + GEN_ALIGN - 1) / GEN_ALIGN * GEN_ALIGN;
    }
    gen_pad(&o);
    for (int i = 0; i < nt && !o.failed; i++) {
        gen_tensor_data(&o, &ts[i], c->seed, i, buf);
        gen_pad(&o);
    }
    free(ts), free(buf);
    if (fclose(o.f) != 0) o.failed = 1;
    if (o.failed) {
        remove(path);
        return km_errf(err, KM_EIO, "gguf-gen: writing %s failed (disk full?)", path);
    }
    return 0;
}
