/*
 * gguf_internal.h — private to the GGUF reader (model/gguf.c: parse, validate, index, open and
 * close; model/gguf_query.c: the lookups and typed getters). The parsed file and the small
 * helpers both halves use. Nothing outside those two files includes it.
 */
#ifndef MD_GGUF_INTERNAL_H
#define MD_GGUF_INTERNAL_H

#include <string.h>

#include "common/km.h"
#include "model/model.h"

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_TENSOR_NAME   256
#define GGUF_MAX_DIMS          4

typedef struct gguf_kv {
    km_str key;
    uint32_t type;      /* md_gguf_type */
    uint32_t elem_type; /* arrays: element type */
    uint64_t n;         /* arrays: element count */
    const uint8_t *val; /* the value; for arrays, the first element */
    uint64_t *str_pos;  /* string arrays: file offset of each element's length field */
} gguf_kv;

struct md_gguf {
    const uint8_t *base;
    size_t size;
    int mapped; /* base came from mmap and is unmapped at close */
    uint32_t version;
    uint64_t alignment;
    uint64_t data_start;
    int64_t n_kv;
    gguf_kv *kvs;
    int64_t n_tensors;
    md_gguf_tensor *tensors;
    int64_t *kv_index; /* open-addressing hash table over keys: kv index or -1 */
    uint64_t kv_mask;
    int64_t *tensor_index; /* same over tensor names */
    uint64_t tensor_mask;
};

static inline uint32_t gguf_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t gguf_le64(const uint8_t *p)
{
    return (uint64_t)gguf_le32(p) | (uint64_t)gguf_le32(p + 4) << 32;
}

/* Bytes of one scalar of type t; 0 for strings, arrays and unknown types. */
static inline uint64_t gguf_scalar_size(uint32_t t)
{
    switch (t) {
    case MD_GGUF_UINT8:
    case MD_GGUF_INT8:
    case MD_GGUF_BOOL:
        return 1;
    case MD_GGUF_UINT16:
    case MD_GGUF_INT16:
        return 2;
    case MD_GGUF_UINT32:
    case MD_GGUF_INT32:
    case MD_GGUF_FLOAT32:
        return 4;
    case MD_GGUF_UINT64:
    case MD_GGUF_INT64:
    case MD_GGUF_FLOAT64:
        return 8;
    }
    return 0;
}

/* FNV-1a over a key or tensor name: the index's hash tables. */
static inline uint64_t gguf_hash(const char *p, uint64_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (uint64_t i = 0; i < len; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h;
}

static inline int gguf_str_eq(km_str a, const char *p, uint64_t len)
{
    return a.len == len && memcmp(a.ptr, p, (size_t)len) == 0;
}

#endif
