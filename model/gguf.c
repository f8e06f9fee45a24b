/*
 * gguf.c — the GGUF reader: maps a model file read-only, validates all of it once, and indexes
 * it so that every later lookup is a bounds-free O(1) read.
 *
 * GGUF files come from outside (downloads, peers, users), so the reader treats every byte as
 * hostile. md_gguf_open walks the whole header once with a bounds-checked cursor and proves,
 * before anything else reads the file: every count fits in the bytes that remain (checked before
 * the allocation it sizes, so a forged count cannot ask for absurd memory), every string and
 * array lies inside the file, value types are known and arrays are not nested, keys and tensor
 * names are unique, and every tensor has a sane shape, a known type, an aligned offset and data
 * inside the file that overlaps no other tensor. After that, getters never re-check bounds.
 *
 * The index: one record per key (its value's position), a hash table over keys and one over
 * tensor names, and for each string array a table of element offsets so md_gguf_arr_str is O(1)
 * (the default model has a 49152-entry vocabulary and 48900 merges). Tensor data is never copied:
 * md_gguf_tensor.data points into the map. The lookups and typed getters over that index are
 * gguf_query.c; the parsed file's structure is gguf_internal.h. Format reference:
 * ggml/docs/gguf.md and gguf.cpp. What is validated and why: docs/gguf.md.
 */
#include "model/gguf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_HEADER_BYTES 24 /* magic, version, tensor_count, kv_count */
/* The fewest bytes one key/value can take: key length (8) + type (4) + a 1-byte value (the key
 * itself may not be empty, so this is a safe lower bound). */
#define GGUF_MIN_KV_BYTES 13
/* The fewest bytes one tensor info can take: name length (8) + n_dims (4) + one ne (8) + type
 * (4) + offset (8). */
#define GGUF_MIN_TENSOR_BYTES 32

/* ---------------------------------------------------------------- helpers */

/* The parse state: a cursor over the file plus where errors go and how they are prefixed. */
typedef struct gguf_rd {
    const uint8_t *p;
    size_t size;
    size_t pos;
    km_errbuf *err;
    const char *path; /* NULL for a memory buffer */
} gguf_rd;

static int gguf_fail(gguf_rd *r, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int gguf_fail(gguf_rd *r, int code, const char *fmt, ...)
{
    if (!r->err) return code;
    char *m = r->err->msg;
    size_t cap = sizeof r->err->msg;
    int n = r->path ? snprintf(m, cap, "gguf: %s: ", r->path) : snprintf(m, cap, "gguf: ");
    if (n < 0 || (size_t)n >= cap) return code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m + n, cap - (size_t)n, fmt, ap);
    va_end(ap);
    return code;
}

/* A printable, bounded copy of a name from the file for error messages: keys and tensor names
 * are untrusted bytes and must not put control characters or a megabyte into a one-line
 * message. */
typedef struct gguf_name {
    char s[80];
} gguf_name;

static gguf_name gguf_printable(const char *p, uint64_t len)
{
    gguf_name out;
    size_t max = sizeof out.s - 4, j = 0;
    for (uint64_t i = 0; i < len && j < max; i++) {
        unsigned char c = (unsigned char)p[i];
        out.s[j++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (len > max) memcpy(out.s + j, "...", 3), j += 3;
    out.s[j] = '\0';
    return out;
}

static uint64_t gguf_remaining(const gguf_rd *r)
{
    return r->size - r->pos;
}

/* Reads n bytes worth of fixed-size field, or fails saying what was being read and where. */
static int gguf_need(gguf_rd *r, uint64_t n, const char *ctx, const char *what)
{
    if (n <= gguf_remaining(r)) return 0;
    return gguf_fail(r, KM_EFORMAT, "%s: %s at offset %zu runs past end of file (size %zu)", ctx,
                     what, r->pos, r->size);
}

static int gguf_read_u32(gguf_rd *r, uint32_t *v, const char *ctx, const char *what)
{
    int rc = gguf_need(r, 4, ctx, what);
    if (rc) return rc;
    *v = gguf_le32(r->p + r->pos);
    r->pos += 4;
    return 0;
}

static int gguf_read_u64(gguf_rd *r, uint64_t *v, const char *ctx, const char *what)
{
    int rc = gguf_need(r, 8, ctx, what);
    if (rc) return rc;
    *v = gguf_le64(r->p + r->pos);
    r->pos += 8;
    return 0;
}

/* A GGUF string: u64 length, then that many bytes (no terminator). */
static int gguf_read_str(gguf_rd *r, km_str *s, const char *ctx, const char *what)
{
    size_t at = r->pos;
    uint64_t len;
    int rc = gguf_read_u64(r, &len, ctx, what);
    if (rc) return rc;
    if (len > gguf_remaining(r)) {
        return gguf_fail(r, KM_EFORMAT,
                         "%s: %s length %llu at offset %zu runs past end of file (size %zu)", ctx,
                         what, (unsigned long long)len, at, r->size);
    }
    s->ptr = (const char *)r->p + r->pos;
    s->len = len;
    r->pos += (size_t)len;
    return 0;
}

static const char *const gguf_type_names[] = {
    "uint8", "int8",   "uint16", "int16",  "uint32", "int32",   "float32",
    "bool",  "string", "array",  "uint64", "int64",  "float64",
};

static const char *gguf_type_name(uint32_t t)
{
    return t < sizeof gguf_type_names / sizeof gguf_type_names[0] ? gguf_type_names[t] : "unknown";
}

/* Allocates a table of at least 2n slots (a power of two), all -1. */
static int64_t *gguf_table_new(int64_t n, uint64_t *mask)
{
    uint64_t cap = 8;
    while (cap < (uint64_t)n * 2) cap *= 2;
    int64_t *t = malloc(cap * sizeof *t);
    if (!t) return NULL;
    memset(t, 0xff, cap * sizeof *t);
    *mask = cap - 1;
    return t;
}

/* ---------------------------------------------------------------- key/values */

/* Validates one value of type `type` at the cursor and advances past it. For a string array,
 * kv->str_pos receives the offset of every element. */
static int gguf_parse_value(gguf_rd *r, gguf_kv *kv, const char *ctx)
{
    uint32_t type = kv->type;
    if (type == MD_GGUF_STRING) {
        km_str s;
        kv->val = r->p + r->pos;
        return gguf_read_str(r, &s, ctx, "string value");
    }
    if (type == MD_GGUF_ARRAY) {
        uint32_t et;
        uint64_t n;
        int rc = gguf_read_u32(r, &et, ctx, "array element type");
        if (!rc) rc = gguf_read_u64(r, &n, ctx, "array length");
        if (rc) return rc;
        if (et == MD_GGUF_ARRAY)
            return gguf_fail(r, KM_EFORMAT,
                             "%s: nested array at offset %zu (arrays of arrays are not supported)",
                             ctx, r->pos - 12);
        kv->elem_type = et;
        kv->n = n;
        kv->val = r->p + r->pos;
        if (et == MD_GGUF_STRING) {
            /* Every element needs at least its 8-byte length: bound n before allocating. */
            if (n > gguf_remaining(r) / 8)
                return gguf_fail(r, KM_EFORMAT,
                                 "%s: array of %llu strings at offset %zu cannot fit in the %llu "
                                 "bytes left in the file",
                                 ctx, (unsigned long long)n, r->pos,
                                 (unsigned long long)gguf_remaining(r));
            kv->str_pos = malloc((n ? n : 1) * sizeof *kv->str_pos);
            if (!kv->str_pos)
                return gguf_fail(r, KM_ENOMEM, "%s: no memory for %llu string offsets", ctx,
                                 (unsigned long long)n);
            for (uint64_t i = 0; i < n; i++) {
                km_str s;
                kv->str_pos[i] = r->pos;
                rc = gguf_read_str(r, &s, ctx, "array string element");
                if (rc) return rc;
            }
            return 0;
        }
        uint64_t es = gguf_scalar_size(et);
        if (!es)
            return gguf_fail(r, KM_EFORMAT, "%s: unknown array element type %u at offset %zu", ctx,
                             et, r->pos - 12);
        if (n > gguf_remaining(r) / es)
            return gguf_fail(r, KM_EFORMAT,
                             "%s: array of %llu %s at offset %zu runs past end of file (size %zu)",
                             ctx, (unsigned long long)n, gguf_type_name(et), r->pos, r->size);
        if (et == MD_GGUF_BOOL) {
            for (uint64_t i = 0; i < n; i++)
                if (r->p[r->pos + i] > 1)
                    return gguf_fail(r, KM_EFORMAT, "%s: bool element %llu is %u, not 0 or 1", ctx,
                                     (unsigned long long)i, r->p[r->pos + i]);
        }
        r->pos += (size_t)(n * es);
        return 0;
    }
    uint64_t sz = gguf_scalar_size(type);
    if (!sz)
        return gguf_fail(r, KM_EFORMAT, "%s: unknown value type %u at offset %zu", ctx, type,
                         r->pos - 4);
    int rc = gguf_need(r, sz, ctx, gguf_type_name(type));
    if (rc) return rc;
    if (type == MD_GGUF_BOOL && r->p[r->pos] > 1)
        return gguf_fail(r, KM_EFORMAT, "%s: bool value is %u, not 0 or 1", ctx, r->p[r->pos]);
    kv->val = r->p + r->pos;
    r->pos += (size_t)sz;
    return 0;
}

static int gguf_parse_kvs(gguf_rd *r, md_gguf *g)
{
    for (int64_t i = 0; i < g->n_kv; i++) {
        gguf_kv *kv = &g->kvs[i];
        char ctx[128];
        snprintf(ctx, sizeof ctx, "kv %lld", (long long)i);
        int rc = gguf_read_str(r, &kv->key, ctx, "key");
        if (rc) return rc;
        if (kv->key.len == 0)
            return gguf_fail(r, KM_EFORMAT, "%s: empty key at offset %zu", ctx, r->pos - 8);
        snprintf(ctx, sizeof ctx, "kv %lld '%s'", (long long)i,
                 gguf_printable(kv->key.ptr, kv->key.len).s);
        rc = gguf_read_u32(r, &kv->type, ctx, "value type");
        if (!rc) rc = gguf_parse_value(r, kv, ctx);
        if (rc) return rc;
    }

    g->kv_index = gguf_table_new(g->n_kv, &g->kv_mask);
    if (!g->kv_index) return gguf_fail(r, KM_ENOMEM, "no memory for the key index");
    for (int64_t i = 0; i < g->n_kv; i++) {
        km_str k = g->kvs[i].key;
        uint64_t h = gguf_hash(k.ptr, k.len) & g->kv_mask;
        for (; g->kv_index[h] >= 0; h = (h + 1) & g->kv_mask) {
            int64_t j = g->kv_index[h];
            if (gguf_str_eq(g->kvs[j].key, k.ptr, k.len))
                return gguf_fail(r, KM_EFORMAT, "kv %lld: duplicate key '%s' (first at kv %lld)",
                                 (long long)i, gguf_printable(k.ptr, k.len).s, (long long)j);
        }
        g->kv_index[h] = i;
    }
    return 0;
}

/* ---------------------------------------------------------------- tensors */

static int gguf_parse_tensor_info(gguf_rd *r, md_gguf *g, int64_t i)
{
    md_gguf_tensor *t = &g->tensors[i];
    char ctx[128];
    snprintf(ctx, sizeof ctx, "tensor %lld", (long long)i);
    int rc = gguf_read_str(r, &t->name, ctx, "name");
    if (rc) return rc;
    if (t->name.len == 0 || t->name.len > GGUF_MAX_TENSOR_NAME)
        return gguf_fail(r, KM_EFORMAT, "%s: name length %llu at offset %zu is not in 1..%d", ctx,
                         (unsigned long long)t->name.len, r->pos - (size_t)t->name.len - 8,
                         GGUF_MAX_TENSOR_NAME);
    snprintf(ctx, sizeof ctx, "tensor %lld '%s'", (long long)i,
             gguf_printable(t->name.ptr, t->name.len).s);

    uint32_t n_dims;
    rc = gguf_read_u32(r, &n_dims, ctx, "n_dims");
    if (rc) return rc;
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return gguf_fail(r, KM_EFORMAT, "%s: n_dims %u at offset %zu is not in 1..%d", ctx, n_dims,
                         r->pos - 4, GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    int64_t nel = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t ne;
        rc = gguf_read_u64(r, &ne, ctx, "ne");
        if (rc) return rc;
        if (ne == 0 || ne > INT64_MAX)
            return gguf_fail(r, KM_EFORMAT, "%s: ne[%u] = %llu at offset %zu is not in 1..2^63-1",
                             ctx, d, (unsigned long long)ne, r->pos - 8);
        if (__builtin_mul_overflow(nel, (int64_t)ne, &nel))
            return gguf_fail(r, KM_EFORMAT, "%s: element count overflows int64 at ne[%u] = %llu",
                             ctx, d, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
    }
    rc = gguf_read_u32(r, &t->type, ctx, "type");
    if (!rc) rc = gguf_read_u64(r, &t->offset, ctx, "offset");
    if (rc) return rc;

    if (md_type_block_elems(t->type) == 0) {
        if (t->type < MD_TYPE_COUNT)
            return gguf_fail(r, KM_EUNSUPPORTED, "%s: ggml tensor type %u is not supported", ctx,
                             t->type);
        return gguf_fail(r, KM_EFORMAT, "%s: unknown tensor type %u", ctx, t->type);
    }
    size_t row = md_type_row_bytes(t->type, t->ne[0]);
    if (row == 0)
        return gguf_fail(r, KM_EFORMAT,
                         "%s: ne[0] = %lld is not a multiple of the %s block size %d", ctx,
                         (long long)t->ne[0], md_type_name(t->type), md_type_block_elems(t->type));
    uint64_t size;
    if (__builtin_mul_overflow((uint64_t)row, (uint64_t)(nel / t->ne[0]), &size) || size > SIZE_MAX)
        return gguf_fail(r, KM_EFORMAT, "%s: byte size of %lld %s elements overflows", ctx,
                         (long long)nel, md_type_name(t->type));
    t->size = size;
    if (t->offset % g->alignment != 0)
        return gguf_fail(r, KM_EFORMAT, "%s: data offset %llu is not a multiple of alignment %llu",
                         ctx, (unsigned long long)t->offset, (unsigned long long)g->alignment);
    return 0;
}

typedef struct gguf_span {
    uint64_t offset, size;
    int64_t idx;
} gguf_span;

static int gguf_span_cmp(const void *a, const void *b)
{
    const gguf_span *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* Places every tensor's data after the infos and checks that it lies inside the file and that no
 * two tensors share a byte (a forged file could otherwise alias one tensor's weights onto
 * another's, or onto the metadata). */
static int gguf_place_tensors(gguf_rd *r, md_gguf *g)
{
    for (int64_t i = 0; i < g->n_tensors; i++) {
        md_gguf_tensor *t = &g->tensors[i];
        uint64_t avail = g->data_start <= g->size ? g->size - g->data_start : 0;
        if (g->data_start > g->size || t->offset > avail || t->size > avail - t->offset)
            return gguf_fail(r, KM_EFORMAT,
                             "tensor %lld '%s': data [offset %llu, %llu bytes] runs past end of "
                             "file (data section at %llu, size %zu)",
                             (long long)i, gguf_printable(t->name.ptr, t->name.len).s,
                             (unsigned long long)t->offset, (unsigned long long)t->size,
                             (unsigned long long)g->data_start, g->size);
        t->data = g->base + g->data_start + t->offset;
    }
    if (g->n_tensors < 2) return 0;

    gguf_span *sp = malloc((size_t)g->n_tensors * sizeof *sp);
    if (!sp)
        return gguf_fail(r, KM_ENOMEM, "no memory to check %lld tensors", (long long)g->n_tensors);
    for (int64_t i = 0; i < g->n_tensors; i++)
        sp[i] = (gguf_span){g->tensors[i].offset, g->tensors[i].size, i};
    qsort(sp, (size_t)g->n_tensors, sizeof *sp, gguf_span_cmp);
    int rc = 0;
    for (int64_t i = 1; i < g->n_tensors && !rc; i++) {
        const gguf_span *a = &sp[i - 1], *b = &sp[i];
        if (a->offset + a->size > b->offset) {
            const md_gguf_tensor *ta = &g->tensors[a->idx], *tb = &g->tensors[b->idx];
            rc = gguf_fail(r, KM_EFORMAT,
                           "tensor %lld '%s' [offset %llu, %llu bytes] overlaps tensor %lld '%s' "
                           "[offset %llu, %llu bytes]",
                           (long long)b->idx, gguf_printable(tb->name.ptr, tb->name.len).s,
                           (unsigned long long)b->offset, (unsigned long long)b->size,
                           (long long)a->idx, gguf_printable(ta->name.ptr, ta->name.len).s,
                           (unsigned long long)a->offset, (unsigned long long)a->size);
        }
    }
    free(sp);
    return rc;
}

static int gguf_index_tensors(gguf_rd *r, md_gguf *g)
{
    g->tensor_index = gguf_table_new(g->n_tensors, &g->tensor_mask);
    if (!g->tensor_index) return gguf_fail(r, KM_ENOMEM, "no memory for the tensor index");
    for (int64_t i = 0; i < g->n_tensors; i++) {
        km_str k = g->tensors[i].name;
        uint64_t h = gguf_hash(k.ptr, k.len) & g->tensor_mask;
        for (; g->tensor_index[h] >= 0; h = (h + 1) & g->tensor_mask) {
            int64_t j = g->tensor_index[h];
            if (gguf_str_eq(g->tensors[j].name, k.ptr, k.len))
                return gguf_fail(r, KM_EFORMAT,
                                 "tensor %lld: duplicate name '%s' (first at tensor %lld)",
                                 (long long)i, gguf_printable(k.ptr, k.len).s, (long long)j);
        }
        g->tensor_index[h] = i;
    }
    return 0;
}

/* ---------------------------------------------------------------- open / close */

static int gguf_parse(gguf_rd *r, md_gguf *g)
{
    const uint8_t *p = r->p;
    if (r->size < 8)
        return gguf_fail(r, KM_EFORMAT, "file is %zu bytes, too small for a GGUF header", r->size);
    if (memcmp(p, "GGUF", 4) != 0) {
        if (memcmp(p, "FUGG", 4) == 0)
            return gguf_fail(r, KM_EUNSUPPORTED,
                             "big-endian GGUF (magic \"FUGG\") is not supported");
        return gguf_fail(r, KM_EFORMAT,
                         "bad magic %02x %02x %02x %02x at offset 0 (expected \"GGUF\"): not a "
                         "GGUF file",
                         p[0], p[1], p[2], p[3]);
    }
    uint32_t version = gguf_le32(p + 4);
    if ((version & 0xffff) == 0 && version != 0) {
        uint32_t swapped = __builtin_bswap32(version);
        if (swapped >= 1 && swapped <= 3)
            return gguf_fail(r, KM_EUNSUPPORTED,
                             "big-endian GGUF (version %u stored big-endian) is not supported; "
                             "convert the model on a little-endian machine",
                             swapped);
    }
    if (version == 1)
        return gguf_fail(r, KM_EUNSUPPORTED,
                         "GGUF version 1 is not supported (32-bit counts; re-convert the model "
                         "with a current llama.cpp)");
    if (version != 2 && version != 3)
        return gguf_fail(r, KM_EUNSUPPORTED, "GGUF version %u is not supported (only 2 and 3)",
                         version);
    g->version = version;
    r->pos = 8;

    uint64_t n_tensors, n_kv;
    int rc = gguf_read_u64(r, &n_tensors, "header", "tensor_count");
    if (!rc) rc = gguf_read_u64(r, &n_kv, "header", "kv_count");
    if (rc) return rc;
    /* Counts are bounded by the bytes left before anything is allocated from them. */
    uint64_t rem = gguf_remaining(r);
    if (n_kv > rem / GGUF_MIN_KV_BYTES)
        return gguf_fail(r, KM_EFORMAT,
                         "header: kv_count %llu cannot fit in the %llu bytes after the header "
                         "(each key/value takes at least %d)",
                         (unsigned long long)n_kv, (unsigned long long)rem, GGUF_MIN_KV_BYTES);
    rem -= n_kv * GGUF_MIN_KV_BYTES;
    if (n_tensors > rem / GGUF_MIN_TENSOR_BYTES)
        return gguf_fail(r, KM_EFORMAT,
                         "header: tensor_count %llu cannot fit in the %llu bytes left after %llu "
                         "key/values (each tensor info takes at least %d)",
                         (unsigned long long)n_tensors, (unsigned long long)rem,
                         (unsigned long long)n_kv, GGUF_MIN_TENSOR_BYTES);

    g->n_kv = (int64_t)n_kv;
    g->kvs = calloc(n_kv ? n_kv : 1, sizeof *g->kvs);
    if (!g->kvs)
        return gguf_fail(r, KM_ENOMEM, "no memory for %llu key/values", (unsigned long long)n_kv);
    rc = gguf_parse_kvs(r, g);
    if (rc) return rc;

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t ai = md_gguf_find(g, "general.alignment");
    if (ai >= 0) {
        uint32_t a;
        rc = md_gguf_get_u32(g, "general.alignment", &a);
        if (rc)
            return gguf_fail(r, KM_EFORMAT,
                             "kv %lld 'general.alignment': type %s is not an unsigned 32-bit "
                             "integer",
                             (long long)ai, gguf_type_name(g->kvs[ai].type));
        if (a == 0 || (a & (a - 1)) != 0)
            return gguf_fail(r, KM_EFORMAT,
                             "kv %lld 'general.alignment': %u is not a nonzero power of two",
                             (long long)ai, a);
        g->alignment = a;
    }

    g->n_tensors = (int64_t)n_tensors;
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    if (!g->tensors)
        return gguf_fail(r, KM_ENOMEM, "no memory for %llu tensors", (unsigned long long)n_tensors);
    for (int64_t i = 0; i < g->n_tensors; i++) {
        rc = gguf_parse_tensor_info(r, g, i);
        if (rc) return rc;
    }
    rc = gguf_index_tensors(r, g);
    if (rc) return rc;

    /* pos <= size and alignment <= 2^31, so this cannot overflow. */
    g->data_start = ((uint64_t)r->pos + g->alignment - 1) / g->alignment * g->alignment;
    return gguf_place_tensors(r, g);
}

static int gguf_open_impl(const uint8_t *data, size_t size, int mapped, const char *path,
                          md_gguf **out, km_errbuf *err)
{
    md_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        if (mapped) munmap((void *)data, size);
        return km_errf(err, KM_ENOMEM, "gguf: no memory");
    }
    g->base = data;
    g->size = size;
    g->mapped = mapped;
    gguf_rd r = {.p = data, .size = size, .pos = 0, .err = err, .path = path};
    int rc = gguf_parse(&r, g);
    if (rc) {
        md_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

int md_gguf_open(const char *path, md_gguf **out, km_errbuf *err)
{
    if (!path || !out) return km_errf(err, KM_EINVAL, "gguf: no path or no output handle");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return km_errf(err, KM_EIO, "gguf: open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return km_errf(err, KM_EIO, "gguf: stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return km_errf(err, KM_EIO, "gguf: '%s' is not a regular file", path);
    }
    if (st.st_size < 8) {
        close(fd);
        return km_errf(err, KM_EFORMAT, "gguf: %s: file is %lld bytes, too small for a GGUF header",
                       path, (long long)st.st_size);
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        return km_errf(err, KM_ERANGE, "gguf: '%s' is too large to map", path);
    }
    size_t size = (size_t)st.st_size;
    void *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) return km_errf(err, KM_EIO, "gguf: mmap '%s': %s", path, strerror(e));
    return gguf_open_impl(m, size, 1, path, out, err);
}

int md_gguf_open_memory(const void *data, size_t size, md_gguf **out, km_errbuf *err)
{
    if (!out || (!data && size))
        return km_errf(err, KM_EINVAL, "gguf: no buffer or no output handle");
    *out = NULL;
    static const uint8_t empty[1];
    return gguf_open_impl(data ? data : empty, size, 0, NULL, out, err);
}

void md_gguf_close(md_gguf *g)
{
    if (!g) return;
    if (g->kvs)
        for (int64_t i = 0; i < g->n_kv; i++) free(g->kvs[i].str_pos);
    free(g->kvs);
    free(g->tensors);
    free(g->kv_index);
    free(g->tensor_index);
    if (g->mapped) munmap((void *)g->base, g->size);
    free(g);
}
