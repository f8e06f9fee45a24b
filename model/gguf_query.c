/*
 * gguf_query.c — the GGUF reader's lookups: keys, typed values, string arrays and tensors of a
 * file that md_gguf_open (gguf.c) has already validated and indexed. Nothing here re-checks
 * bounds: every position it reads was proven inside the file at open. Lookups are O(1): the
 * hash tables over keys and tensor names, and the per-element offsets of string arrays, were
 * built there too. An integer getter takes any integer type whose value fits (KM_EFORMAT
 * otherwise), never a bool or a float; md_gguf_get_f32 takes float32 and in-range float64.
 */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf_internal.h"

uint32_t md_gguf_version(const md_gguf *g)
{
    return g->version;
}

int64_t md_gguf_n_kv(const md_gguf *g)
{
    return g->n_kv;
}

km_str md_gguf_key_at(const md_gguf *g, int64_t i)
{
    if (i < 0 || i >= g->n_kv) return (km_str){NULL, 0};
    return g->kvs[i].key;
}

int64_t md_gguf_find(const md_gguf *g, const char *key)
{
    if (!key || !g->kv_index) return -1;
    uint64_t len = strlen(key);
    for (uint64_t h = gguf_hash(key, len) & g->kv_mask; g->kv_index[h] >= 0;
         h = (h + 1) & g->kv_mask) {
        if (gguf_str_eq(g->kvs[g->kv_index[h]].key, key, len)) return g->kv_index[h];
    }
    return -1;
}

md_gguf_type md_gguf_kv_type(const md_gguf *g, int64_t i)
{
    if (i < 0 || i >= g->n_kv) return (md_gguf_type)-1;
    return (md_gguf_type)g->kvs[i].type;
}

static const gguf_kv *gguf_lookup(const md_gguf *g, const char *key)
{
    int64_t i = md_gguf_find(g, key);
    return i < 0 ? NULL : &g->kvs[i];
}

/* Reads any integer value. *is_neg tells whether it is negative; *u holds it when it is not
 * (0 otherwise) and *s holds it as an int64, saturated at INT64_MAX. KM_EFORMAT for
 * non-integers (bool included: it is not a number). */
static int gguf_int_value(const gguf_kv *kv, int *is_neg, uint64_t *u, int64_t *s)
{
    const uint8_t *v = kv->val;
    int64_t sv = 0;
    uint64_t uv = 0;
    int is_signed = 0;
    switch (kv->type) {
    case MD_GGUF_UINT8:
        uv = v[0];
        break;
    case MD_GGUF_UINT16:
        uv = (uint64_t)v[0] | (uint64_t)v[1] << 8;
        break;
    case MD_GGUF_UINT32:
        uv = gguf_le32(v);
        break;
    case MD_GGUF_UINT64:
        uv = gguf_le64(v);
        break;
    case MD_GGUF_INT8:
        sv = (int8_t)v[0], is_signed = 1;
        break;
    case MD_GGUF_INT16:
        sv = (int16_t)(uint16_t)(v[0] | v[1] << 8), is_signed = 1;
        break;
    case MD_GGUF_INT32:
        sv = (int32_t)gguf_le32(v), is_signed = 1;
        break;
    case MD_GGUF_INT64:
        sv = (int64_t)gguf_le64(v), is_signed = 1;
        break;
    default:
        return KM_EFORMAT;
    }
    if (is_signed) {
        *is_neg = sv < 0;
        *s = sv;
        *u = sv < 0 ? 0 : (uint64_t)sv;
    } else {
        *is_neg = 0;
        *u = uv;
        *s = uv > INT64_MAX ? INT64_MAX : (int64_t)uv;
    }
    return 0;
}

/* The value of key as an integer (gguf_int_value): KM_ENOTFOUND without the key. */
static int gguf_int_of(const md_gguf *g, const char *key, int *is_neg, uint64_t *u, int64_t *s)
{
    const gguf_kv *kv = gguf_lookup(g, key);
    return kv ? gguf_int_value(kv, is_neg, u, s) : KM_ENOTFOUND;
}

/* key's entry when it has type t: KM_ENOTFOUND without the key, KM_EFORMAT with another type. */
static int gguf_typed(const md_gguf *g, const char *key, md_gguf_type t, const gguf_kv **kv)
{
    *kv = gguf_lookup(g, key);
    if (!*kv) return KM_ENOTFOUND;
    return (*kv)->type == (uint32_t)t ? 0 : KM_EFORMAT;
}

int md_gguf_get_u32(const md_gguf *g, const char *key, uint32_t *out)
{
    int neg;
    uint64_t u;
    int64_t s;
    int rc = gguf_int_of(g, key, &neg, &u, &s);
    if (rc) return rc;
    if (neg || u > UINT32_MAX) return KM_EFORMAT;
    *out = (uint32_t)u;
    return 0;
}

int md_gguf_get_i64(const md_gguf *g, const char *key, int64_t *out)
{
    int neg;
    uint64_t u;
    int64_t s;
    int rc = gguf_int_of(g, key, &neg, &u, &s);
    if (rc) return rc;
    if (!neg && u > INT64_MAX) return KM_EFORMAT;
    *out = s;
    return 0;
}

int md_gguf_get_f32(const md_gguf *g, const char *key, float *out)
{
    const gguf_kv *kv = gguf_lookup(g, key);
    if (!kv) return KM_ENOTFOUND;
    if (kv->type == MD_GGUF_FLOAT32) {
        uint32_t bits = gguf_le32(kv->val);
        memcpy(out, &bits, 4);
        return 0;
    }
    if (kv->type == MD_GGUF_FLOAT64) {
        uint64_t bits = gguf_le64(kv->val);
        double d;
        memcpy(&d, &bits, 8);
        /* Converting a finite double beyond float's range is undefined behaviour in C. */
        if (d == d && (d > FLT_MAX || d < -FLT_MAX) && d - d == 0) return KM_EFORMAT;
        *out = (float)d;
        return 0;
    }
    return KM_EFORMAT;
}

int md_gguf_get_bool(const md_gguf *g, const char *key, int *out)
{
    const gguf_kv *kv;
    int rc = gguf_typed(g, key, MD_GGUF_BOOL, &kv);
    if (!rc) *out = kv->val[0] != 0;
    return rc;
}

/* A GGUF string at p: its 8-byte little-endian length, then its bytes. */
static km_str gguf_str_at(const uint8_t *p)
{
    return (km_str){(const char *)p + 8, gguf_le64(p)};
}

int md_gguf_get_str(const md_gguf *g, const char *key, km_str *out)
{
    const gguf_kv *kv;
    int rc = gguf_typed(g, key, MD_GGUF_STRING, &kv);
    if (!rc) *out = gguf_str_at(kv->val);
    return rc;
}

int md_gguf_get_arr(const md_gguf *g, const char *key, md_gguf_type *elem, uint64_t *n)
{
    const gguf_kv *kv;
    int rc = gguf_typed(g, key, MD_GGUF_ARRAY, &kv);
    if (rc) return rc;
    if (elem) *elem = (md_gguf_type)kv->elem_type;
    if (n) *n = kv->n;
    return 0;
}

int md_gguf_arr_str(const md_gguf *g, const char *key, uint64_t i, km_str *out)
{
    const gguf_kv *kv;
    int rc = gguf_typed(g, key, MD_GGUF_ARRAY, &kv);
    if (rc) return rc;
    if (kv->elem_type != MD_GGUF_STRING) return KM_EFORMAT;
    if (i >= kv->n) return KM_ERANGE;
    *out = gguf_str_at(g->base + kv->str_pos[i]);
    return 0;
}

const void *md_gguf_arr_data(const md_gguf *g, const char *key)
{
    const gguf_kv *kv = gguf_lookup(g, key);
    if (!kv || kv->type != MD_GGUF_ARRAY || !gguf_scalar_size(kv->elem_type)) return NULL;
    return kv->val;
}

int64_t md_gguf_n_tensors(const md_gguf *g)
{
    return g->n_tensors;
}

const md_gguf_tensor *md_gguf_tensor_at(const md_gguf *g, int64_t i)
{
    if (i < 0 || i >= g->n_tensors) return NULL;
    return &g->tensors[i];
}

const md_gguf_tensor *md_gguf_find_tensor(const md_gguf *g, const char *name)
{
    if (!name || !g->tensor_index) return NULL;
    uint64_t len = strlen(name);
    for (uint64_t h = gguf_hash(name, len) & g->tensor_mask; g->tensor_index[h] >= 0;
         h = (h + 1) & g->tensor_mask) {
        const md_gguf_tensor *t = &g->tensors[g->tensor_index[h]];
        if (gguf_str_eq(t->name, name, len)) return t;
    }
    return NULL;
}

const void *md_gguf_file_data(const md_gguf *g, size_t *size)
{
    if (size) *size = g->size;
    return g->base;
}
