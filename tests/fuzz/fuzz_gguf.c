/*
 * fuzz_gguf.c — libFuzzer target for the GGUF reader.
 *
 * md_gguf_open_memory must turn any byte string into either a handle or an error, never a crash,
 * an out-of-bounds read or an absurd allocation. When a file is accepted, every key is read
 * through every getter, every array element is touched and every tensor's data is read at its
 * first and last byte, so that a validation gap in md_gguf_open shows up as an ASan report here
 * rather than later in the engine. Seeds: tests/fuzz/corpus/fuzz_gguf (make_gguf_seeds.py).
 */
#include "common/km.h"
#include "model/model.h"

#include <stdlib.h>
#include <string.h>

static volatile uint8_t fuzz_sink;

static void fuzz_touch(const void *p, uint64_t n)
{
    if (n == 0) return;
    const uint8_t *b = p;
    fuzz_sink ^= b[0];
    fuzz_sink ^= b[n - 1];
}

static void fuzz_walk(const md_gguf *g, const uint8_t *data, size_t size)
{
    size_t fsize;
    if (md_gguf_file_data(g, &fsize) != data || fsize != size) abort();
    (void)md_gguf_version(g);

    int64_t n_kv = md_gguf_n_kv(g);
    for (int64_t i = 0; i < n_kv; i++) {
        km_str k = md_gguf_key_at(g, i);
        fuzz_touch(k.ptr, k.len);
        /* Keys are looked up by C string; one with a NUL inside cannot be found that way. */
        char key[512];
        if (k.len >= sizeof key || memchr(k.ptr, 0, k.len)) continue;
        memcpy(key, k.ptr, k.len);
        key[k.len] = '\0';
        if (md_gguf_find(g, key) != i) abort(); /* keys are unique */

        uint32_t u32;
        int64_t i64;
        float f;
        int b;
        km_str s;
        md_gguf_type et;
        uint64_t n;
        (void)md_gguf_get_u32(g, key, &u32);
        (void)md_gguf_get_i64(g, key, &i64);
        (void)md_gguf_get_f32(g, key, &f);
        (void)md_gguf_get_bool(g, key, &b);
        if (md_gguf_get_str(g, key, &s) == 0) fuzz_touch(s.ptr, s.len);
        if (md_gguf_get_arr(g, key, &et, &n) == 0) {
            const void *raw = md_gguf_arr_data(g, key);
            if (et == MD_GGUF_STRING) {
                if (raw) abort();
                for (uint64_t j = 0; j < n; j++) {
                    if (md_gguf_arr_str(g, key, j, &s) != 0) abort();
                    fuzz_touch(s.ptr, s.len);
                }
                if (md_gguf_arr_str(g, key, n, &s) != KM_ERANGE) abort();
            } else if (raw && n) {
                int es = et == MD_GGUF_UINT8 || et == MD_GGUF_INT8 || et == MD_GGUF_BOOL        ? 1
                         : et == MD_GGUF_UINT16 || et == MD_GGUF_INT16                          ? 2
                         : et == MD_GGUF_UINT64 || et == MD_GGUF_INT64 || et == MD_GGUF_FLOAT64 ? 8
                                                                                                : 4;
                fuzz_touch(raw, n * (uint64_t)es);
            }
        }
        (void)md_gguf_kv_type(g, i);
    }

    int64_t n_t = md_gguf_n_tensors(g);
    for (int64_t i = 0; i < n_t; i++) {
        const md_gguf_tensor *t = md_gguf_tensor_at(g, i);
        if (!t || t->n_dims < 1 || t->n_dims > 4) abort();
        const uint8_t *d = t->data;
        if (d < data || d + t->size > data + size) abort();
        fuzz_touch(t->data, t->size);
        fuzz_touch(t->name.ptr, t->name.len);
        char name[300];
        if (t->name.len < sizeof name && !memchr(t->name.ptr, 0, t->name.len)) {
            memcpy(name, t->name.ptr, t->name.len);
            name[t->name.len] = '\0';
            if (md_gguf_find_tensor(g, name) != t) abort(); /* names are unique */
        }
    }
    if (md_gguf_tensor_at(g, n_t) != NULL) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    md_gguf *g = NULL;
    km_errbuf err;
    if (md_gguf_open_memory(data, size, &g, &err) == 0) {
        fuzz_walk(g, data, size);
        md_gguf_close(g);
    } else if (g != NULL || memchr(err.msg, 0, sizeof err.msg) == NULL) {
        abort(); /* failure leaves no handle and a terminated message */
    }
    return 0;
}
