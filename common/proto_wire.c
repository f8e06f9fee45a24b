/*
 * proto_wire.c — the helpers every message file of the protocol is written with
 * (proto_internal.h): value checks for validation, key/value writers for encoding, typed key
 * readers for decoding. They keep the message files to one line per field.
 *
 * Why it is built this way:
 *  - Each encoder runs twice, once counting its map's keys and once writing them, so optional
 *    keys are simply not written when absent and the map header is always exact (no patching
 *    of a map's size after the fact).
 *  - Wire types are checked while reading the decoded tree (integers must fit their C field, a
 *    nil is an absent key); value ranges are checked afterwards by the message's validate
 *    function, which the encoder also runs.
 *  - Every error names the field by its path ("hb.kv[3].format"), kept in km_dec.path.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/proto_internal.h"

/* ---------------------------------------------------------------- validation */

size_t km_text_len(const char *s, size_t len)
{
    return s && len == 0 ? strlen(s) : len;
}

int km_val_name(const char *what, const char *s, bool required, size_t min, size_t max,
                km_errbuf *err)
{
    if (!s) {
        if (required) VFAIL("%s: required", what);
        return 0;
    }
    size_t n = strlen(s);
    if (n < min || n > max) VFAIL("%s: length %zu outside [%zu, %zu] bytes", what, n, min, max);
    return 0;
}

int km_val_range(const char *what, double x, double lo, double hi, km_errbuf *err)
{
    if (!(x >= lo && x <= hi)) VFAIL("%s: %g outside [%g, %g]", what, x, lo, hi);
    return 0;
}

int km_val_nonneg(const char *what, double x, km_errbuf *err)
{
    if (!(x >= 0 && isfinite(x))) VFAIL("%s: %g must be finite and >= 0", what, x);
    return 0;
}

/* ---------------------------------------------------------------- encoding */

void km_enc_key(km_enc *e, const char *k)
{
    size_t n = strlen(k);
    e->rc |= msgpack_pack_str(&e->pk, n);
    e->rc |= msgpack_pack_str_body(&e->pk, k, n);
}

void km_enc_text(km_enc *e, const char *s, size_t n)
{
    e->rc |= msgpack_pack_str(&e->pk, n);
    e->rc |= msgpack_pack_str_body(&e->pk, s, n);
}

void km_enc_u64(km_enc *e, const char *k, uint64_t v)
{
    if (km_enc_begin(e, k)) e->rc |= msgpack_pack_uint64(&e->pk, v);
}

void km_enc_i64(km_enc *e, const char *k, int64_t v)
{
    if (km_enc_begin(e, k)) e->rc |= msgpack_pack_int64(&e->pk, v);
}

void km_enc_f32(km_enc *e, const char *k, float v)
{
    if (km_enc_begin(e, k)) e->rc |= msgpack_pack_float(&e->pk, v);
}

void km_enc_f64(km_enc *e, const char *k, double v)
{
    if (km_enc_begin(e, k)) e->rc |= msgpack_pack_double(&e->pk, v);
}

void km_enc_bool(km_enc *e, const char *k, bool v)
{
    if (km_enc_begin(e, k)) e->rc |= v ? msgpack_pack_true(&e->pk) : msgpack_pack_false(&e->pk);
}

void km_enc_strn(km_enc *e, const char *k, const char *s, size_t len)
{
    if (s && km_enc_begin(e, k)) km_enc_text(e, s, km_text_len(s, len));
}

void km_enc_str(km_enc *e, const char *k, const char *s)
{
    km_enc_strn(e, k, s, 0);
}

void km_enc_bin(km_enc *e, const char *k, const uint8_t *p, size_t len)
{
    if (p && km_enc_begin(e, k)) {
        e->rc |= msgpack_pack_bin(&e->pk, len);
        e->rc |= msgpack_pack_bin_body(&e->pk, p, len);
    }
}

void km_enc_map(km_enc *e, void (*body)(km_enc *, const void *), const void *arg)
{
    km_enc sub = {.pk = e->pk, .counting = true};
    body(&sub, arg);
    sub.counting = false;
    sub.rc |= msgpack_pack_map(&sub.pk, sub.n);
    body(&sub, arg);
    e->rc |= sub.rc;
}

/* ---------------------------------------------------------------- decoding */

const char *km_dec_type_name(msgpack_object_type t)
{
    switch (t) {
    case MSGPACK_OBJECT_NIL:
        return "nil";
    case MSGPACK_OBJECT_BOOLEAN:
        return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return "integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return "float";
    case MSGPACK_OBJECT_STR:
        return "string";
    case MSGPACK_OBJECT_BIN:
        return "binary";
    case MSGPACK_OBJECT_ARRAY:
        return "array";
    case MSGPACK_OBJECT_MAP:
        return "map";
    case MSGPACK_OBJECT_EXT:
        return "ext";
    }
    return "?";
}

static bool key_is(const msgpack_object *k, const char *s, size_t n)
{
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
           memcmp(k->via.str.ptr, s, n) == 0;
}

int km_dec_check_map(km_dec *d, const msgpack_object_map *mp)
{
    for (uint32_t i = 0; i < mp->size; i++) {
        const msgpack_object *k = &mp->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return DFAIL(d, KM_EFORMAT, "%s: map key %u has type %s; keys must be strings", d->path,
                         i, km_dec_type_name(k->type));
        for (uint32_t j = 0; j < i; j++) {
            const msgpack_object *o = &mp->ptr[j].key;
            if (o->via.str.size == k->via.str.size &&
                memcmp(o->via.str.ptr, k->via.str.ptr, k->via.str.size) == 0)
                return DFAIL(d, KM_EFORMAT, "%s: key '%.*s' appears twice", d->path,
                             (int)k->via.str.size, k->via.str.ptr);
        }
    }
    return 0;
}

const msgpack_object *km_dec_find(const msgpack_object_map *mp, const char *key)
{
    size_t n = strlen(key);
    for (uint32_t i = 0; i < mp->size; i++)
        if (key_is(&mp->ptr[i].key, key, n))
            return mp->ptr[i].val.type == MSGPACK_OBJECT_NIL ? NULL : &mp->ptr[i].val;
    return NULL;
}

int km_dec_absent(km_dec *d, const char *key, bool required)
{
    if (required) return DFAIL(d, KM_EFORMAT, "%s.%s: required field missing", d->path, key);
    return 0;
}

int km_dec_wrong_type(km_dec *d, const char *key, const char *want, const msgpack_object *o)
{
    return DFAIL(d, KM_EFORMAT, "%s.%s: expected %s, got %s", d->path, key, want,
                 km_dec_type_name(o->type));
}

int km_dec_uint(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                uint64_t max, uint64_t *out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, required);
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return DFAIL(d, KM_EFORMAT, "%s.%s: negative value %lld", d->path, key,
                     (long long)o->via.i64);
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return km_dec_wrong_type(d, key, "an unsigned integer", o);
    if (o->via.u64 > max)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %llu exceeds %llu", d->path, key,
                     (unsigned long long)o->via.u64, (unsigned long long)max);
    *out = o->via.u64;
    return 0;
}

int km_dec_u32(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               uint32_t *out)
{
    uint64_t v = *out;
    int rc = km_dec_uint(d, mp, key, required, UINT32_MAX, &v);
    if (rc == 0) *out = (uint32_t)v;
    return rc;
}

int km_dec_i32(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               int32_t *out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, required);
    int64_t v;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > INT32_MAX)
            return DFAIL(d, KM_EFORMAT, "%s.%s: %llu exceeds %d", d->path, key,
                         (unsigned long long)o->via.u64, INT32_MAX);
        v = (int64_t)o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        if (o->via.i64 < INT32_MIN)
            return DFAIL(d, KM_EFORMAT, "%s.%s: %lld below %d", d->path, key, (long long)o->via.i64,
                         INT32_MIN);
        v = o->via.i64;
    } else {
        return km_dec_wrong_type(d, key, "an integer", o);
    }
    *out = (int32_t)v;
    return 0;
}

int km_dec_num(km_dec *d, const msgpack_object_map *mp, const char *key, bool required, double *out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, required);
    double v;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        v = o->via.f64;
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        v = (double)o->via.u64;
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        v = (double)o->via.i64;
        break;
    default:
        return km_dec_wrong_type(d, key, "a number", o);
    }
    if (!isfinite(v)) return DFAIL(d, KM_EFORMAT, "%s.%s: not a finite number", d->path, key);
    *out = v;
    return 0;
}

int km_dec_f32(km_dec *d, const msgpack_object_map *mp, const char *key, float *out)
{
    double v = *out;
    int rc = km_dec_num(d, mp, key, false, &v);
    if (rc) return rc;
    if (fabs(v) > 1e30) return DFAIL(d, KM_EFORMAT, "%s.%s: %g is out of range", d->path, key, v);
    *out = (float)v;
    return 0;
}

int km_dec_bool(km_dec *d, const msgpack_object_map *mp, const char *key, bool required, bool *out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, required);
    if (o->type != MSGPACK_OBJECT_BOOLEAN) return km_dec_wrong_type(d, key, "a bool", o);
    *out = o->via.boolean;
    return 0;
}

int km_dec_flag(km_dec *d, const msgpack_object_map *mp, const char *key, bool *out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return 0;
    if (o->type == MSGPACK_OBJECT_BOOLEAN)
        *out = o->via.boolean;
    else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        *out = o->via.u64 != 0;
    else
        return km_dec_wrong_type(d, key, "a bool or an unsigned integer", o);
    return 0;
}

int km_dec_copy_str(km_dec *d, const char *what, const msgpack_object *o, size_t max,
                    bool binary_ok, const char **out, size_t *len)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return DFAIL(d, KM_EFORMAT, "%s: expected a string, got %s", what,
                     km_dec_type_name(o->type));
    size_t n = o->via.str.size;
    if (n > max) return DFAIL(d, KM_EFORMAT, "%s: %zu bytes, limit %zu", what, n, max);
    if (!binary_ok && memchr(o->via.str.ptr, 0, n))
        return DFAIL(d, KM_EFORMAT, "%s: contains a NUL byte", what);
    char *s = km_msg_alloc(d->m, n + 1);
    if (!s) return DFAIL(d, KM_ENOMEM, "%s: out of memory", what);
    memcpy(s, o->via.str.ptr, n);
    s[n] = '\0';
    *out = s;
    if (len) *len = n;
    return 0;
}

int km_dec_str(km_dec *d, const msgpack_object_map *mp, const char *key, bool required, size_t max,
               bool binary_ok, const char **out, size_t *len)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, required);
    char what[96];
    snprintf(what, sizeof what, "%s.%s", d->path, key);
    return km_dec_copy_str(d, what, o, max, binary_ok, out, len);
}

int km_dec_bin(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               uint32_t max, const uint8_t **out, uint32_t *len)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, required);
    if (o->type != MSGPACK_OBJECT_BIN) return km_dec_wrong_type(d, key, "binary", o);
    uint32_t n = o->via.bin.size;
    if (n == 0 || n > max)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %u bytes outside [1, %u]", d->path, key, n, max);
    uint8_t *p = km_msg_alloc(d->m, n);
    if (!p) return DFAIL(d, KM_ENOMEM, "%s.%s: out of memory", d->path, key);
    memcpy(p, o->via.bin.ptr, n);
    *out = p;
    *len = n;
    return 0;
}

int km_dec_enum(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                const char *const *names, int n, int *out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, required);
    if (o->type != MSGPACK_OBJECT_STR) return km_dec_wrong_type(d, key, "a string", o);
    int i = km_proto_name_index(names, n, o->via.str.ptr, o->via.str.size);
    if (i < 0) {
        int shown = o->via.str.size > 32 ? 32 : (int)o->via.str.size;
        return DFAIL(d, KM_EFORMAT, "%s.%s: unknown value '%.*s'", d->path, key, shown,
                     o->via.str.ptr);
    }
    *out = i;
    return 0;
}

int km_dec_tier(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                km_tier *out)
{
    uint64_t v = (uint64_t)*out;
    int rc = km_dec_uint(d, mp, key, required, KM_TIER_COUNT - 1, &v);
    if (rc == 0) *out = (km_tier)v;
    return rc;
}

int km_dec_obj(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               msgpack_object_type type, const msgpack_object **out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    *out = NULL;
    if (!o) return km_dec_absent(d, key, required);
    if (o->type != type)
        return km_dec_wrong_type(d, key, type == MSGPACK_OBJECT_MAP ? "a map" : "an array", o);
    *out = o;
    return 0;
}

int km_dec_array_map(km_dec *d, const msgpack_object_array *a, uint32_t i, size_t n0,
                     const char *what, const msgpack_object_map **out)
{
    km_dec_path_set(d, n0);
    km_dec_path_push(d, "%s[%u]", what, i);
    if (a->ptr[i].type != MSGPACK_OBJECT_MAP)
        return DFAIL(d, KM_EFORMAT, "%s: expected a map, got %s", d->path,
                     km_dec_type_name(a->ptr[i].type));
    *out = &a->ptr[i].via.map;
    return km_dec_check_map(d, *out);
}

int km_dec_array(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                 uint32_t max, size_t elem_size, const msgpack_object_array **a, void **out)
{
    const msgpack_object *o;
    *a = NULL;
    *out = NULL;
    CK(km_dec_obj(d, mp, key, required, MSGPACK_OBJECT_ARRAY, &o));
    if (!o || !o->via.array.size) return 0;
    const msgpack_object_array *arr = &o->via.array;
    if (arr->size > max)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %u entries, limit %u", d->path, key, arr->size, max);
    void *p = km_msg_alloc(d->m, arr->size * elem_size);
    if (!p) return DFAIL(d, KM_ENOMEM, "%s.%s: out of memory", d->path, key);
    memset(p, 0, arr->size * elem_size);
    *a = arr;
    *out = p;
    return 0;
}

int km_dec_named_map(km_dec *d, const msgpack_object_map *mp, const char *key, uint32_t max,
                     size_t elem_size, const msgpack_object_map **em, void **out)
{
    const msgpack_object *o;
    *em = NULL;
    *out = NULL;
    CK(km_dec_obj(d, mp, key, false, MSGPACK_OBJECT_MAP, &o));
    if (!o || !o->via.map.size) return 0;
    const msgpack_object_map *m = &o->via.map;
    km_dec_path_push(d, ".%s", key);
    CK(km_dec_check_map(d, m));
    if (m->size > max)
        return DFAIL(d, KM_EFORMAT, "%s: %u entries, limit %u", d->path, m->size, max);
    void *p = km_msg_alloc(d->m, m->size * elem_size);
    if (!p) return DFAIL(d, KM_ENOMEM, "%s: out of memory", d->path);
    memset(p, 0, m->size * elem_size);
    *em = m;
    *out = p;
    return 0;
}

void km_dec_path_push(km_dec *d, const char *fmt, ...)
{
    size_t n = strlen(d->path);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->path + n, sizeof d->path - n, fmt, ap);
    va_end(ap);
}

void km_dec_path_set(km_dec *d, size_t n)
{
    d->path[n] = '\0';
}
