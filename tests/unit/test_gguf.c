/*
 * test_gguf.c — the GGUF reader against files built byte by byte in memory, and against the
 * default model.
 *
 * A small writer (gw_*) assembles GGUF files from a spec (header, key/values, tensor infos,
 * data); each test breaks exactly one thing in an otherwise valid file and asserts the error code
 * and that the message says what and where. Every open goes through a heap copy of exactly the
 * file's size, so under ASan a single byte read past the end is caught.
 */
#include "common/km.h"
#include "model/model.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* ---------------------------------------------------------------- a tiny GGUF writer */

typedef struct gw {
    uint8_t *p;
    size_t len, cap;
} gw;

static void gw_put(gw *w, const void *src, size_t n)
{
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 256;
        while (cap < w->len + n) cap *= 2;
        w->p = realloc(w->p, cap);
        cr_assert_not_null(w->p);
        w->cap = cap;
    }
    memcpy(w->p + w->len, src, n);
    w->len += n;
}

static void gw_u8(gw *w, uint8_t v)
{
    gw_put(w, &v, 1);
}
static void gw_u16(gw *w, uint16_t v)
{
    gw_put(w, &v, 2);
} /* the test host is little-endian */
static void gw_u32(gw *w, uint32_t v)
{
    gw_put(w, &v, 4);
}
static void gw_u64(gw *w, uint64_t v)
{
    gw_put(w, &v, 8);
}
static void gw_f32(gw *w, float v)
{
    gw_put(w, &v, 4);
}
static void gw_f64(gw *w, double v)
{
    gw_put(w, &v, 8);
}

static void gw_str(gw *w, const char *s)
{
    gw_u64(w, strlen(s));
    gw_put(w, s, strlen(s));
}

static void gw_key(gw *w, const char *key, uint32_t type)
{
    gw_str(w, key);
    gw_u32(w, type);
}

typedef struct tspec {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[5];
    uint32_t type;
    uint64_t offset;
    uint64_t size; /* bytes of data the writer reserves for it */
} tspec;

typedef struct gspec {
    char magic[4];
    uint32_t version;
    int std_kvs;        /* write the standard key/values below */
    uint32_t alignment; /* nonzero: write general.alignment (u32) */
    int n_t;
    tspec t[4];
    int n_extra;
    void (*extra_kv[4])(gw *); /* each writes one more key/value */
    int override_counts;       /* write n_tensors/n_kv below instead of the real counts */
    uint64_t n_tensors, n_kv;
    int64_t data_extra; /* added to the data section's length (negative: cut short) */
    int no_padding;     /* stop right after the tensor infos (only sensible without tensors) */
} gspec;

#define STD_KVS 15

static void gw_std_kvs(gw *w)
{
    gw_key(w, "general.architecture", MD_GGUF_STRING);
    gw_str(w, "llama");
    gw_key(w, "llama.block_count", MD_GGUF_UINT32);
    gw_u32(w, 2);
    gw_key(w, "t.u8", MD_GGUF_UINT8);
    gw_u8(w, 200);
    gw_key(w, "t.i8", MD_GGUF_INT8);
    gw_u8(w, (uint8_t)-5);
    gw_key(w, "t.u16", MD_GGUF_UINT16);
    gw_u16(w, 60000);
    gw_key(w, "t.i16", MD_GGUF_INT16);
    gw_u16(w, (uint16_t)-300);
    gw_key(w, "t.i32", MD_GGUF_INT32);
    gw_u32(w, (uint32_t)-7);
    gw_key(w, "t.u64", MD_GGUF_UINT64);
    gw_u64(w, 0xffffffffffffff00ull);
    gw_key(w, "t.i64", MD_GGUF_INT64);
    gw_u64(w, (uint64_t)(int64_t)-1234567890123ll);
    gw_key(w, "t.f32", MD_GGUF_FLOAT32);
    gw_f32(w, 1.5f);
    gw_key(w, "t.f64", MD_GGUF_FLOAT64);
    gw_f64(w, 2.25);
    gw_key(w, "t.bool", MD_GGUF_BOOL);
    gw_u8(w, 1);
    gw_key(w, "t.strs", MD_GGUF_ARRAY);
    gw_u32(w, MD_GGUF_STRING);
    gw_u64(w, 3);
    gw_str(w, "<|endoftext|>");
    gw_str(w, "bc");
    gw_str(w, "");
    gw_key(w, "t.ints", MD_GGUF_ARRAY);
    gw_u32(w, MD_GGUF_INT32);
    gw_u64(w, 4);
    for (int32_t i = 1; i <= 4; i++) gw_u32(w, (uint32_t)(i * 10));
    gw_key(w, "t.empty", MD_GGUF_ARRAY);
    gw_u32(w, MD_GGUF_FLOAT32);
    gw_u64(w, 0);
}

/* The standard three tensors: F32 [8,2], Q4_0 [64], Q8_0 [32,1,2] (4 dims). */
static gspec spec_valid(void)
{
    gspec s = {.magic = {'G', 'G', 'U', 'F'}, .version = 3, .std_kvs = 1, .n_t = 3};
    s.t[0] = (tspec){"a", 2, {8, 2}, MD_TYPE_F32, 0, 64};
    s.t[1] = (tspec){"blk.0.b", 1, {64}, MD_TYPE_Q4_0, 64, 36};
    s.t[2] = (tspec){"c", 4, {32, 1, 2, 1}, MD_TYPE_Q8_0, 128, 68};
    return s;
}

/* Writes the file the spec describes; *data_start receives where the data section begins. */
static gw gw_build(const gspec *s, size_t *data_start)
{
    gw w = {0};
    gw_put(&w, s->magic, 4);
    gw_u32(&w, s->version);
    uint64_t n_kv = (s->std_kvs ? STD_KVS : 0) + (s->alignment ? 1 : 0) + (uint64_t)s->n_extra;
    gw_u64(&w, s->override_counts ? s->n_tensors : (uint64_t)s->n_t);
    gw_u64(&w, s->override_counts ? s->n_kv : n_kv);
    if (s->std_kvs) gw_std_kvs(&w);
    if (s->alignment) {
        gw_key(&w, "general.alignment", MD_GGUF_UINT32);
        gw_u32(&w, s->alignment);
    }
    for (int i = 0; i < s->n_extra; i++) s->extra_kv[i](&w);
    uint64_t end = 0;
    for (int i = 0; i < s->n_t; i++) {
        const tspec *t = &s->t[i];
        gw_str(&w, t->name);
        gw_u32(&w, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims && d < 5; d++) gw_u64(&w, t->ne[d]);
        gw_u32(&w, t->type);
        gw_u64(&w, t->offset);
        /* Forged offsets far past the end get no data written for them. */
        if (t->offset < (1u << 20) && t->offset + t->size > end) end = t->offset + t->size;
    }
    uint32_t align = s->alignment ? s->alignment : 32;
    while (!s->no_padding && w.len % align) gw_u8(&w, 0);
    if (data_start) *data_start = w.len;
    int64_t n = (int64_t)end + s->data_extra;
    for (int64_t i = 0; i < n; i++) gw_u8(&w, (uint8_t)(i * 7 + 1));
    if (n < 0) w.len = (size_t)((int64_t)w.len + n);
    return w;
}

/* Opens a heap copy of exactly len bytes (so ASan sees any over-read); the copy is returned in
 * *copy and must outlive the handle. */
static int open_copy(const uint8_t *p, size_t len, md_gguf **g, km_errbuf *err, uint8_t **copy)
{
    *copy = malloc(len ? len : 1);
    cr_assert_not_null(*copy);
    if (len) memcpy(*copy, p, len);
    memset(err->msg, 0, sizeof err->msg);
    return md_gguf_open_memory(*copy, len, g, err);
}

/* Builds, opens, and expects failure with `code` and every substring in `want` in the message. */
static void expect_fail(const gspec *s, int code, const char *want1, const char *want2)
{
    gw w = gw_build(s, NULL);
    md_gguf *g = (md_gguf *)0x1;
    km_errbuf err;
    uint8_t *copy;
    int rc = open_copy(w.p, w.len, &g, &err, &copy);
    cr_expect_eq(rc, code, "rc %d (%s), want %d; msg: %s", rc, km_strerror(rc), code, err.msg);
    cr_expect_null(g, "handle must be NULL on failure");
    cr_expect(strncmp(err.msg, "gguf: ", 6) == 0, "msg: %s", err.msg);
    if (want1) cr_expect(strstr(err.msg, want1) != NULL, "'%s' not in: %s", want1, err.msg);
    if (want2) cr_expect(strstr(err.msg, want2) != NULL, "'%s' not in: %s", want2, err.msg);
    if (rc == 0) md_gguf_close(g);
    free(copy);
    free(w.p);
}

static int str_eq(km_str a, const char *b)
{
    return a.len == strlen(b) && memcmp(a.ptr, b, a.len) == 0;
}

/* ---------------------------------------------------------------- valid files */

Test(gguf, valid_file_round_trips_keys_arrays_and_tensors)
{
    gspec s = spec_valid();
    size_t data_start;
    gw w = gw_build(&s, &data_start);
    md_gguf *g;
    km_errbuf err;
    uint8_t *buf;
    int rc = open_copy(w.p, w.len, &g, &err, &buf);
    cr_assert_eq(rc, 0, "open: %s", err.msg);

    cr_expect_eq(md_gguf_version(g), 3);
    cr_expect_eq(md_gguf_n_kv(g), STD_KVS);
    cr_expect(str_eq(md_gguf_key_at(g, 0), "general.architecture"));
    cr_expect(str_eq(md_gguf_key_at(g, 14), "t.empty"));
    cr_expect_null(md_gguf_key_at(g, 15).ptr);
    cr_expect_null(md_gguf_key_at(g, -1).ptr);
    cr_expect_eq(md_gguf_find(g, "t.f32"), 9);
    cr_expect_eq(md_gguf_find(g, "t.f3"), -1);
    cr_expect_eq(md_gguf_find(g, "absent"), -1);
    cr_expect_eq(md_gguf_kv_type(g, 9), MD_GGUF_FLOAT32);
    cr_expect_eq(md_gguf_kv_type(g, 12), MD_GGUF_ARRAY);

    km_str str;
    cr_assert_eq(md_gguf_get_str(g, "general.architecture", &str), 0);
    cr_expect(str_eq(str, "llama"));
    cr_expect_eq(md_gguf_get_str(g, "llama.block_count", &str), KM_EFORMAT);
    cr_expect_eq(md_gguf_get_str(g, "nope", &str), KM_ENOTFOUND);

    uint32_t u32 = 0;
    int64_t i64 = 0;
    cr_expect_eq(md_gguf_get_u32(g, "llama.block_count", &u32), 0);
    cr_expect_eq(u32, 2);
    cr_expect_eq(md_gguf_get_u32(g, "t.u8", &u32), 0);
    cr_expect_eq(u32, 200);
    cr_expect_eq(md_gguf_get_u32(g, "t.u16", &u32), 0);
    cr_expect_eq(u32, 60000);
    cr_expect_eq(md_gguf_get_u32(g, "t.i8", &u32), KM_EFORMAT, "negative does not fit u32");
    cr_expect_eq(md_gguf_get_u32(g, "t.u64", &u32), KM_EFORMAT, "2^64-256 does not fit u32");
    cr_expect_eq(md_gguf_get_u32(g, "t.f32", &u32), KM_EFORMAT);
    cr_expect_eq(md_gguf_get_u32(g, "t.bool", &u32), KM_EFORMAT);
    cr_expect_eq(md_gguf_get_u32(g, "nope", &u32), KM_ENOTFOUND);
    cr_expect_eq(md_gguf_get_i64(g, "t.i8", &i64), 0);
    cr_expect_eq(i64, -5);
    cr_expect_eq(md_gguf_get_i64(g, "t.i16", &i64), 0);
    cr_expect_eq(i64, -300);
    cr_expect_eq(md_gguf_get_i64(g, "t.i32", &i64), 0);
    cr_expect_eq(i64, -7);
    cr_expect_eq(md_gguf_get_i64(g, "t.i64", &i64), 0);
    cr_expect_eq(i64, -1234567890123ll);
    cr_expect_eq(md_gguf_get_i64(g, "llama.block_count", &i64), 0);
    cr_expect_eq(i64, 2);
    cr_expect_eq(md_gguf_get_i64(g, "t.u64", &i64), KM_EFORMAT, "2^64-256 does not fit i64");
    cr_expect_eq(md_gguf_get_i64(g, "t.strs", &i64), KM_EFORMAT);

    float f = 0;
    cr_expect_eq(md_gguf_get_f32(g, "t.f32", &f), 0);
    cr_expect_float_eq(f, 1.5f, 0);
    cr_expect_eq(md_gguf_get_f32(g, "t.f64", &f), 0);
    cr_expect_float_eq(f, 2.25f, 0);
    cr_expect_eq(md_gguf_get_f32(g, "t.i32", &f), KM_EFORMAT);

    int b = 0;
    cr_expect_eq(md_gguf_get_bool(g, "t.bool", &b), 0);
    cr_expect_eq(b, 1);
    cr_expect_eq(md_gguf_get_bool(g, "t.u8", &b), KM_EFORMAT, "bool accepts only bool");

    md_gguf_type et;
    uint64_t n;
    cr_expect_eq(md_gguf_get_arr(g, "t.strs", &et, &n), 0);
    cr_expect_eq(et, MD_GGUF_STRING);
    cr_expect_eq(n, 3);
    cr_expect_eq(md_gguf_arr_str(g, "t.strs", 0, &str), 0);
    cr_expect(str_eq(str, "<|endoftext|>"));
    cr_expect_eq(md_gguf_arr_str(g, "t.strs", 1, &str), 0);
    cr_expect(str_eq(str, "bc"));
    cr_expect_eq(md_gguf_arr_str(g, "t.strs", 2, &str), 0);
    cr_expect_eq(str.len, 0);
    cr_expect_eq(md_gguf_arr_str(g, "t.strs", 3, &str), KM_ERANGE);
    cr_expect_eq(md_gguf_arr_str(g, "t.ints", 0, &str), KM_EFORMAT);
    cr_expect_eq(md_gguf_arr_str(g, "t.u8", 0, &str), KM_EFORMAT);
    cr_expect_null(md_gguf_arr_data(g, "t.strs"));
    cr_expect_null(md_gguf_arr_data(g, "t.u8"));
    cr_expect_eq(md_gguf_get_arr(g, "t.ints", &et, &n), 0);
    cr_expect_eq(et, MD_GGUF_INT32);
    cr_expect_eq(n, 4);
    const uint8_t *ints = md_gguf_arr_data(g, "t.ints");
    cr_assert_not_null(ints);
    for (int i = 0; i < 4; i++) {
        int32_t v;
        memcpy(&v, ints + 4 * i, 4);
        cr_expect_eq(v, (i + 1) * 10);
    }
    cr_expect_eq(md_gguf_get_arr(g, "t.empty", &et, &n), 0);
    cr_expect_eq(n, 0);
    cr_expect_eq(md_gguf_get_arr(g, "t.u8", &et, &n), KM_EFORMAT);

    cr_assert_eq(md_gguf_n_tensors(g), 3);
    const int64_t want_ne[3][4] = {{8, 2, 1, 1}, {64, 1, 1, 1}, {32, 1, 2, 1}};
    const uint64_t want_size[3] = {64, 36, 68};
    for (int i = 0; i < 3; i++) {
        const md_gguf_tensor *t = md_gguf_tensor_at(g, i);
        cr_assert_not_null(t);
        cr_expect(str_eq(t->name, s.t[i].name));
        cr_expect_eq(t->n_dims, (int)s.t[i].n_dims);
        for (int d = 0; d < 4; d++) cr_expect_eq(t->ne[d], want_ne[i][d], "t%d ne[%d]", i, d);
        cr_expect_eq(t->type, s.t[i].type);
        cr_expect_eq(t->offset, s.t[i].offset);
        cr_expect_eq(t->size, want_size[i]);
        cr_expect_eq((const uint8_t *)t->data, buf + data_start + s.t[i].offset);
        cr_expect_eq(((const uint8_t *)t->data)[0], (uint8_t)(s.t[i].offset * 7 + 1));
        cr_expect_eq(md_gguf_find_tensor(g, s.t[i].name), t);
    }
    cr_expect_null(md_gguf_tensor_at(g, 3));
    cr_expect_null(md_gguf_tensor_at(g, -1));
    cr_expect_null(md_gguf_find_tensor(g, "blk.0"));
    cr_expect_null(md_gguf_find_tensor(g, "missing"));
    size_t size;
    cr_expect_eq(md_gguf_file_data(g, &size), buf);
    cr_expect_eq(size, w.len);

    md_gguf_close(g);
    free(buf);
    free(w.p);
}

Test(gguf, version_2_is_accepted)
{
    gspec s = spec_valid();
    s.version = 2;
    gw w = gw_build(&s, NULL);
    md_gguf *g;
    km_errbuf err;
    uint8_t *buf;
    cr_assert_eq(open_copy(w.p, w.len, &g, &err, &buf), 0, "%s", err.msg);
    cr_expect_eq(md_gguf_version(g), 2);
    md_gguf_close(g);
    free(buf);
    free(w.p);
}

Test(gguf, metadata_only_file_without_tensors_or_padding_opens)
{
    gspec s = spec_valid();
    s.n_t = 0;
    /* No trailing padding: the data section would start past the end, which is fine without
     * tensors (vocabulary-only files look like this). */
    s.no_padding = 1;
    gw w = gw_build(&s, NULL);
    md_gguf *g;
    km_errbuf err;
    uint8_t *buf;
    cr_expect_neq(w.len % 32, 0, "the test needs an unpadded length");
    cr_assert_eq(open_copy(w.p, w.len, &g, &err, &buf), 0, "%s", err.msg);
    cr_expect_eq(md_gguf_n_tensors(g), 0);
    cr_expect_null(md_gguf_find_tensor(g, "a"));
    md_gguf_close(g);
    free(buf);
    free(w.p);
}

Test(gguf, empty_file_with_no_keys_and_no_tensors_opens)
{
    gspec s = spec_valid();
    s.n_t = 0;
    s.std_kvs = 0;
    gw w = gw_build(&s, NULL);
    md_gguf *g;
    km_errbuf err;
    uint8_t *buf;
    cr_assert_eq(open_copy(w.p, 24, &g, &err, &buf), 0, "%s", err.msg);
    cr_expect_eq(md_gguf_n_kv(g), 0);
    cr_expect_eq(md_gguf_find(g, "general.architecture"), -1);
    uint32_t u;
    cr_expect_eq(md_gguf_get_u32(g, "x", &u), KM_ENOTFOUND);
    md_gguf_close(g);
    free(buf);
    free(w.p);
}

Test(gguf, custom_alignment_places_data_on_its_boundary)
{
    gspec s = spec_valid();
    s.alignment = 256;
    s.t[1].offset = 256;
    s.t[2].offset = 512;
    size_t data_start;
    gw w = gw_build(&s, &data_start);
    md_gguf *g;
    km_errbuf err;
    uint8_t *buf;
    cr_assert_eq(open_copy(w.p, w.len, &g, &err, &buf), 0, "%s", err.msg);
    cr_expect_eq(data_start % 256, 0);
    for (int i = 0; i < 3; i++) {
        const md_gguf_tensor *t = md_gguf_tensor_at(g, i);
        cr_expect_eq((const uint8_t *)t->data - buf, (ptrdiff_t)(data_start + s.t[i].offset));
    }
    uint32_t a;
    cr_expect_eq(md_gguf_get_u32(g, "general.alignment", &a), 0);
    cr_expect_eq(a, 256);
    md_gguf_close(g);
    free(buf);
    free(w.p);
}

Test(gguf, tensor_name_of_256_bytes_is_accepted_and_257_rejected)
{
    char name[258];
    memset(name, 'n', 257);
    name[256] = '\0';
    gspec s = spec_valid();
    s.t[0].name = name;
    gw w = gw_build(&s, NULL);
    md_gguf *g;
    km_errbuf err;
    uint8_t *buf;
    cr_assert_eq(open_copy(w.p, w.len, &g, &err, &buf), 0, "%s", err.msg);
    cr_expect_not_null(md_gguf_find_tensor(g, name));
    md_gguf_close(g);
    free(buf);
    free(w.p);
    name[256] = 'n';
    name[257] = '\0';
    expect_fail(&s, KM_EFORMAT, "tensor 0", "name length 257");
}

/* ---------------------------------------------------------------- truncation */

Test(gguf, truncation_at_every_byte_offset_is_an_error)
{
    gspec s = spec_valid();
    gw w = gw_build(&s, NULL);
    for (size_t len = 0; len < w.len; len++) {
        md_gguf *g = NULL;
        km_errbuf err;
        uint8_t *buf;
        int rc = open_copy(w.p, len, &g, &err, &buf);
        cr_expect_lt(rc, 0, "truncated at %zu of %zu opened", len, w.len);
        cr_expect_null(g);
        cr_expect_gt(strlen(err.msg), 6, "no message at %zu", len);
        if (rc == 0) md_gguf_close(g);
        free(buf);
    }
    free(w.p);
}

Test(gguf, open_memory_rejects_null_arguments)
{
    md_gguf *g;
    km_errbuf err;
    cr_expect_eq(md_gguf_open_memory(NULL, 10, &g, &err), KM_EINVAL);
    cr_expect_eq(md_gguf_open_memory("GGUF", 4, NULL, &err), KM_EINVAL);
    cr_expect_eq(md_gguf_open_memory(NULL, 0, &g, NULL), KM_EFORMAT);
}

/* ---------------------------------------------------------------- header */

Test(gguf, bad_magic_is_rejected)
{
    gspec s = spec_valid();
    memcpy(s.magic, "GGML", 4);
    expect_fail(&s, KM_EFORMAT, "bad magic", "not a GGUF file");
}

Test(gguf, version_1_is_rejected_with_a_clear_message)
{
    gspec s = spec_valid();
    s.version = 1;
    expect_fail(&s, KM_EUNSUPPORTED, "version 1", NULL);
}

Test(gguf, unknown_future_version_is_rejected)
{
    gspec s = spec_valid();
    s.version = 4;
    expect_fail(&s, KM_EUNSUPPORTED, "version 4", NULL);
}

Test(gguf, big_endian_file_is_detected)
{
    gspec s = spec_valid();
    s.version = 0x03000000; /* 3, stored big-endian */
    expect_fail(&s, KM_EUNSUPPORTED, "big-endian", NULL);
    memcpy(s.magic, "FUGG", 4);
    expect_fail(&s, KM_EUNSUPPORTED, "big-endian", NULL);
}

Test(gguf, huge_kv_count_fails_before_allocating)
{
    gspec s = spec_valid();
    s.override_counts = 1;
    s.n_tensors = 3;
    s.n_kv = UINT64_MAX / 2;
    expect_fail(&s, KM_EFORMAT, "kv_count", "cannot fit");
    s.n_kv = STD_KVS + 1000; /* plausible-looking but larger than the file can hold */
    expect_fail(&s, KM_EFORMAT, "kv_count", "cannot fit");
}

Test(gguf, huge_tensor_count_fails_before_allocating)
{
    gspec s = spec_valid();
    s.override_counts = 1;
    s.n_kv = STD_KVS;
    s.n_tensors = UINT64_MAX;
    expect_fail(&s, KM_EFORMAT, "tensor_count", "cannot fit");
    s.n_tensors = 1u << 20;
    expect_fail(&s, KM_EFORMAT, "tensor_count", "cannot fit");
}

/* ---------------------------------------------------------------- key/values */

static void kv_huge_string(gw *w)
{
    gw_key(w, "x.huge", MD_GGUF_STRING);
    gw_u64(w, UINT64_MAX - 3);
}

static void kv_huge_key(gw *w)
{
    gw_u64(w, 1ull << 40);
    gw_put(w, "abc", 3);
}

static void kv_unknown_type(gw *w)
{
    gw_key(w, "x.weird", 13);
    gw_u32(w, 0);
}

static void kv_unknown_elem_type(gw *w)
{
    gw_key(w, "x.arr", MD_GGUF_ARRAY);
    gw_u32(w, 77);
    gw_u64(w, 1);
    gw_u32(w, 0);
}

static void kv_nested_array(gw *w)
{
    gw_key(w, "x.nested", MD_GGUF_ARRAY);
    gw_u32(w, MD_GGUF_ARRAY);
    gw_u64(w, 1);
    gw_u32(w, MD_GGUF_UINT8);
    gw_u64(w, 1);
    gw_u8(w, 1);
}

static void kv_huge_array(gw *w)
{
    gw_key(w, "x.big", MD_GGUF_ARRAY);
    gw_u32(w, MD_GGUF_UINT64);
    gw_u64(w, 1ull << 61);
}

static void kv_huge_string_array(gw *w)
{
    gw_key(w, "x.strs", MD_GGUF_ARRAY);
    gw_u32(w, MD_GGUF_STRING);
    gw_u64(w, 1ull << 62);
}

static void kv_string_array_bad_element(gw *w)
{
    gw_key(w, "x.strs", MD_GGUF_ARRAY);
    gw_u32(w, MD_GGUF_STRING);
    gw_u64(w, 2);
    gw_str(w, "ok");
    gw_u64(w, 1ull << 50);
}

static void kv_duplicate(gw *w)
{
    gw_key(w, "llama.block_count", MD_GGUF_UINT32);
    gw_u32(w, 3);
}

static void kv_bool_two(gw *w)
{
    gw_key(w, "x.flag", MD_GGUF_BOOL);
    gw_u8(w, 2);
}

static void kv_empty_key(gw *w)
{
    gw_key(w, "", MD_GGUF_UINT8);
    gw_u8(w, 1);
}

static void kv_big_u32(gw *w)
{
    gw_key(w, "x.u64", MD_GGUF_UINT64);
    gw_u64(w, 7);
}

static void expect_kv_fail(void (*fn)(gw *), int code, const char *w1, const char *w2)
{
    gspec s = spec_valid();
    s.n_extra = 1;
    s.extra_kv[0] = fn;
    expect_fail(&s, code, w1, w2);
}

Test(gguf, huge_string_length_is_rejected)
{
    expect_kv_fail(kv_huge_string, KM_EFORMAT, "kv 15 'x.huge'", "runs past end of file");
    expect_kv_fail(kv_huge_key, KM_EFORMAT, "kv 15", "key length");
}

Test(gguf, unknown_value_type_is_rejected)
{
    expect_kv_fail(kv_unknown_type, KM_EFORMAT, "kv 15 'x.weird'", "unknown value type 13");
    expect_kv_fail(kv_unknown_elem_type, KM_EFORMAT, "'x.arr'", "unknown array element type 77");
}

Test(gguf, nested_arrays_are_rejected)
{
    expect_kv_fail(kv_nested_array, KM_EFORMAT, "'x.nested'", "nested array");
}

Test(gguf, array_longer_than_the_file_is_rejected)
{
    expect_kv_fail(kv_huge_array, KM_EFORMAT, "'x.big'", "runs past end of file");
    expect_kv_fail(kv_huge_string_array, KM_EFORMAT, "'x.strs'", "cannot fit");
    expect_kv_fail(kv_string_array_bad_element, KM_EFORMAT, "'x.strs'", "array string element");
}

Test(gguf, duplicate_key_is_rejected)
{
    expect_kv_fail(kv_duplicate, KM_EFORMAT, "duplicate key 'llama.block_count'", "kv 1");
}

Test(gguf, bool_other_than_0_or_1_is_rejected)
{
    expect_kv_fail(kv_bool_two, KM_EFORMAT, "'x.flag'", "not 0 or 1");
}

Test(gguf, empty_key_is_rejected)
{
    expect_kv_fail(kv_empty_key, KM_EFORMAT, "kv 15", "empty key");
}

Test(gguf, integer_getters_convert_between_widths)
{
    gspec s = spec_valid();
    s.n_extra = 1;
    s.extra_kv[0] = kv_big_u32;
    gw w = gw_build(&s, NULL);
    md_gguf *g;
    km_errbuf err;
    uint8_t *buf;
    cr_assert_eq(open_copy(w.p, w.len, &g, &err, &buf), 0, "%s", err.msg);
    uint32_t u;
    cr_expect_eq(md_gguf_get_u32(g, "x.u64", &u), 0);
    cr_expect_eq(u, 7);
    md_gguf_close(g);
    free(buf);
    free(w.p);
}

static void kv_align_zero(gw *w)
{
    gw_key(w, "general.alignment", MD_GGUF_UINT32);
    gw_u32(w, 0);
}

static void kv_align_three(gw *w)
{
    gw_key(w, "general.alignment", MD_GGUF_UINT32);
    gw_u32(w, 48);
}

static void kv_align_string(gw *w)
{
    gw_key(w, "general.alignment", MD_GGUF_STRING);
    gw_str(w, "32");
}

Test(gguf, bad_alignment_value_is_rejected)
{
    expect_kv_fail(kv_align_zero, KM_EFORMAT, "general.alignment", "power of two");
    expect_kv_fail(kv_align_three, KM_EFORMAT, "general.alignment", "48 is not");
    expect_kv_fail(kv_align_string, KM_EFORMAT, "general.alignment", "string");
}

/* ---------------------------------------------------------------- tensors */

Test(gguf, unknown_tensor_type_is_rejected)
{
    gspec s = spec_valid();
    s.t[1].type = 99;
    expect_fail(&s, KM_EFORMAT, "tensor 1 'blk.0.b'", "unknown tensor type 99");
    s.t[1].type = 20; /* a ggml type kvmesh does not compute with (IQ4_NL) */
    expect_fail(&s, KM_EUNSUPPORTED, "tensor 1 'blk.0.b'", "type 20 is not supported");
}

Test(gguf, n_dims_outside_1_to_4_is_rejected)
{
    gspec s = spec_valid();
    s.t[0].n_dims = 0;
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "n_dims 0");
    s = spec_valid();
    s.t[0].n_dims = 5;
    s.t[0].ne[2] = s.t[0].ne[3] = s.t[0].ne[4] = 1;
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "n_dims 5");
}

Test(gguf, zero_or_overflowing_dimensions_are_rejected)
{
    gspec s = spec_valid();
    s.t[0].ne[1] = 0;
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "ne[1] = 0");
    s = spec_valid();
    s.t[0].ne[1] = 1ull << 63;
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "ne[1]");
    s = spec_valid();
    s.t[2].ne[1] = 1ull << 40;
    s.t[2].ne[2] = 1ull << 40;
    expect_fail(&s, KM_EFORMAT, "tensor 2 'c'", "overflows int64");
    s = spec_valid();
    s.t[0].ne[1] = 1ull << 62; /* 8 * 2^62 elements overflow int64 too */
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "overflows");
    s = spec_valid();
    s.t[0].ne[0] = 1;
    s.t[0].ne[1] = 1ull << 62; /* fits int64, but 4 * 2^62 bytes overflow */
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "overflows");
}

Test(gguf, row_length_not_a_multiple_of_the_block_size_is_rejected)
{
    gspec s = spec_valid();
    s.t[1].ne[0] = 48;
    expect_fail(&s, KM_EFORMAT, "tensor 1 'blk.0.b'", "ne[0] = 48 is not a multiple of the Q4_0");
}

Test(gguf, misaligned_offset_is_rejected)
{
    gspec s = spec_valid();
    s.t[1].offset = 72;
    expect_fail(&s, KM_EFORMAT, "tensor 1 'blk.0.b'",
                "offset 72 is not a multiple of alignment 32");
}

Test(gguf, data_past_end_of_file_is_rejected)
{
    gspec s = spec_valid();
    s.data_extra = -1;
    expect_fail(&s, KM_EFORMAT, "tensor 2 'c': data [offset 128, 68 bytes]",
                "runs past end of file");
    s = spec_valid();
    s.t[0].offset = 1ull << 62;
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "runs past end of file");
    s = spec_valid();
    s.t[0].offset = UINT64_MAX - 31; /* offset + size wraps around */
    expect_fail(&s, KM_EFORMAT, "tensor 0 'a'", "runs past end of file");
}

Test(gguf, overlapping_tensors_are_rejected)
{
    gspec s = spec_valid();
    s.t[2].offset = 96; /* inside blk.0.b [64, 100) */
    expect_fail(&s, KM_EFORMAT, "tensor 2 'c' [offset 96, 68 bytes] overlaps tensor 1 'blk.0.b'",
                NULL);
    s = spec_valid();
    s.t[2].offset = 0; /* same start as a */
    expect_fail(&s, KM_EFORMAT, "overlaps", NULL);
}

Test(gguf, duplicate_tensor_name_is_rejected)
{
    gspec s = spec_valid();
    s.t[2].name = "a";
    expect_fail(&s, KM_EFORMAT, "tensor 2: duplicate name 'a'", "tensor 0");
}

Test(gguf, names_in_messages_are_made_printable)
{
    gspec s = spec_valid();
    s.t[1].name = "bad\nname";
    s.t[1].type = 99;
    expect_fail(&s, KM_EFORMAT, "tensor 1 'bad?name'", NULL);
}

/* ---------------------------------------------------------------- files */

Test(gguf, open_reads_a_file_through_mmap)
{
    gspec s = spec_valid();
    gw w = gw_build(&s, NULL);
    char path[] = "/tmp/km_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, w.p, w.len), (ssize_t)w.len);
    close(fd);
    md_gguf *g;
    km_errbuf err;
    int rc = md_gguf_open(path, &g, &err);
    cr_assert_eq(rc, 0, "%s", err.msg);
    const md_gguf_tensor *t = md_gguf_find_tensor(g, "c");
    cr_assert_not_null(t);
    cr_expect_eq(memcmp(t->data, w.p + (w.len - 68), 68), 0);
    md_gguf_close(g);

    /* Messages from a file name the file. */
    fd = open(path, O_WRONLY | O_TRUNC);
    cr_assert_eq(write(fd, w.p, w.len - 1), (ssize_t)w.len - 1);
    close(fd);
    rc = md_gguf_open(path, &g, &err);
    cr_expect_eq(rc, KM_EFORMAT);
    cr_expect(strstr(err.msg, path) != NULL, "%s", err.msg);
    unlink(path);
    free(w.p);
}

Test(gguf, open_of_a_missing_or_empty_file_is_an_error)
{
    md_gguf *g;
    km_errbuf err;
    cr_expect_eq(md_gguf_open("/nonexistent/model.gguf", &g, &err), KM_EIO);
    cr_expect(strstr(err.msg, "/nonexistent/model.gguf") != NULL, "%s", err.msg);
    cr_expect_eq(md_gguf_open("/tmp", &g, &err), KM_EIO);
    char path[] = "/tmp/km_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_expect_eq(md_gguf_open(path, &g, &err), KM_EFORMAT);
    unlink(path);
}

/* Every committed fuzz seed must open without crashing; those named valid_* must open. */
Test(gguf, fuzz_seed_corpus_replays)
{
    DIR *dir = opendir("tests/fuzz/corpus/fuzz_gguf");
    if (!dir) cr_skip_test("no fuzz corpus at tests/fuzz/corpus/fuzz_gguf");
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        const char *name = de->d_name;
        if (name[0] == '.') continue;
        char path[512];
        snprintf(path, sizeof path, "tests/fuzz/corpus/fuzz_gguf/%s", name);
        md_gguf *g;
        km_errbuf err;
        int rc = md_gguf_open(path, &g, &err);
        if (strncmp(name, "valid_", 6) == 0) cr_expect_eq(rc, 0, "%s: %s", name, err.msg);
        if (rc == 0) md_gguf_close(g);
        n++;
    }
    closedir(dir);
    cr_expect_gt(n, 0, "the seed corpus is empty");
}

/* ---------------------------------------------------------------- the default model */

Test(gguf, default_model_opens_with_expected_shape)
{
    if (access(MODEL_PATH, R_OK) != 0) cr_skip_test("%s absent: run `make deps`", MODEL_PATH);
    md_gguf *g;
    km_errbuf err;
    uint64_t t0 = km_now_ns();
    int rc = md_gguf_open(MODEL_PATH, &g, &err);
    uint64_t t1 = km_now_ns();
    cr_assert_eq(rc, 0, "%s", err.msg);
    cr_log_info("opened %s in %.2f ms", MODEL_PATH, (double)(t1 - t0) / 1e6);

    cr_expect_eq(md_gguf_version(g), 3);
    uint32_t blocks = 0;
    cr_expect_eq(md_gguf_get_u32(g, "llama.block_count", &blocks), 0);
    cr_expect_eq(blocks, 30);
    km_str arch;
    cr_expect_eq(md_gguf_get_str(g, "general.architecture", &arch), 0);
    cr_expect(str_eq(arch, "llama"));
    cr_expect_eq(md_gguf_n_tensors(g), 272);

    const md_gguf_tensor *t = md_gguf_find_tensor(g, "token_embd.weight");
    cr_assert_not_null(t);
    cr_expect_eq(t->type, MD_TYPE_Q8_0);
    cr_expect_eq(t->n_dims, 2);
    cr_expect_eq(t->ne[0], 576);
    cr_expect_eq(t->ne[1], 49152);
    cr_expect_eq(t->size, (uint64_t)576 / 32 * 34 * 49152);
    size_t fsize;
    const uint8_t *base = md_gguf_file_data(g, &fsize);
    for (int64_t i = 0; i < md_gguf_n_tensors(g); i++) {
        const md_gguf_tensor *ti = md_gguf_tensor_at(g, i);
        cr_expect_eq(((uintptr_t)ti->data) % 32, 0, "tensor %lld misaligned", (long long)i);
        cr_expect_leq((const uint8_t *)ti->data + ti->size, base + fsize);
    }

    md_gguf_type et;
    uint64_t n;
    cr_expect_eq(md_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n), 0);
    cr_expect_eq(et, MD_GGUF_STRING);
    cr_expect_eq(n, 49152);
    km_str tok;
    cr_expect_eq(md_gguf_arr_str(g, "tokenizer.ggml.tokens", 0, &tok), 0);
    cr_expect(str_eq(tok, "<|endoftext|>"), "token 0 is '%.*s'", (int)tok.len, tok.ptr);
    cr_expect_eq(md_gguf_arr_str(g, "tokenizer.ggml.tokens", 49151, &tok), 0);
    cr_expect_eq(md_gguf_arr_str(g, "tokenizer.ggml.tokens", 49152, &tok), KM_ERANGE);
    cr_expect_eq(md_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n), 0);
    cr_expect_eq(et, MD_GGUF_STRING);
    cr_expect_eq(n, 48900);
    md_gguf_close(g);
}
