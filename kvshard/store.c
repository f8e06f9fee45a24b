/*
 * store.c — the page pool and sequence page tables of kvshard.h.
 *
 * The pool is one arena of equal pages carved at creation (hot_bytes / page_bytes of them), with
 * a free stack of page indices and a reference count per page. A sequence is a growable array of
 * page indices plus a parallel array of page base pointers, which is exactly what the attention
 * kernel walks, so a view costs nothing to build.
 */
#include <stdlib.h>
#include <string.h>

#include "kvshard/kvshard.h"

struct kv_store {
    kv_config cfg;
    size_t block_bytes; /* one K or V block: page_tokens * head_dim elements */
    size_t page_bytes;
    int n_pages;
    uint8_t *arena;
    int32_t *free_stack;
    int n_free;
    uint16_t *refs;
    const kn_ops *ops;
};

struct kv_seq {
    int n_pages, cap_pages;
    int32_t *page_ids;
    const uint8_t **page_ptrs;
};

static size_t kv_elem_bytes(kv_format f) { return f == KN_KV_F16 || f == KN_KV_BF16 ? 2 : 0; }

const char *kv_format_name(kv_format f)
{
    switch (f) {
    case KN_KV_F16: return "f16";
    case KN_KV_BF16: return "bf16";
    case KN_KV_FP8: return "fp8";
    case KN_KV_INT8: return "int8";
    case KN_KV_INT4: return "int4";
    }
    return "unknown";
}

int kv_format_parse(const char *s, kv_format *out)
{
    static const char *names[] = {"f16", "bf16", "fp8", "int8", "int4"};
    for (int i = 0; i < 5; i++)
        if (s && !strcmp(s, names[i])) {
            *out = (kv_format)i;
            return 0;
        }
    return KM_EINVAL;
}

int kv_store_create(const kv_config *cfg, kv_store **out, km_errbuf *err)
{
    *out = NULL;
    kv_config c = *cfg;
    if (c.page_tokens == 0) c.page_tokens = 16;
    if (c.page_tokens < 1 || (c.page_tokens & (c.page_tokens - 1)) || c.page_tokens > 4096)
        return km_errf(err, KM_EINVAL, "page_tokens=%d must be a power of two <= 4096",
                       c.page_tokens);
    if (c.n_layers <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0)
        return km_errf(err, KM_EINVAL, "bad model shape layers=%d kv_heads=%d head_dim=%d",
                       c.n_layers, c.n_kv_heads, c.head_dim);
    size_t eb = kv_elem_bytes(c.format);
    if (!eb)
        return km_errf(err, KM_EUNSUPPORTED, "kv format %s is not supported by this store yet",
                       kv_format_name(c.format));
    kv_store *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "kv store: out of memory");
    s->cfg = c;
    s->block_bytes = (size_t)c.page_tokens * c.head_dim * eb;
    s->page_bytes = s->block_bytes * 2 * c.n_kv_heads * c.n_layers;
    size_t n = c.hot_bytes / s->page_bytes;
    if (n < 1 || n > INT32_MAX / 2) {
        size_t pb = s->page_bytes;
        free(s);
        return km_errf(err, KM_EINVAL, "hot_bytes=%zu gives %zu pages of %zu bytes", c.hot_bytes,
                       n, pb);
    }
    s->n_pages = (int)n;
    s->arena = aligned_alloc(64, s->page_bytes * n);
    s->free_stack = malloc(sizeof(int32_t) * n);
    s->refs = calloc(n, sizeof(uint16_t));
    if (!s->arena || !s->free_stack || !s->refs) {
        size_t pb = s->page_bytes;
        kv_store_destroy(s);
        return km_errf(err, KM_ENOMEM, "kv store: cannot allocate %zu pages of %zu bytes", n, pb);
    }
    for (int i = 0; i < s->n_pages; i++) s->free_stack[i] = s->n_pages - 1 - i;
    s->n_free = s->n_pages;
    s->ops = kn_ops_best();
    *out = s;
    return 0;
}

void kv_store_destroy(kv_store *s)
{
    if (!s) return;
    free(s->arena);
    free(s->free_stack);
    free(s->refs);
    free(s);
}

size_t kv_store_page_bytes(const kv_store *s) { return s->page_bytes; }
int kv_store_page_tokens(const kv_store *s) { return s->cfg.page_tokens; }
int kv_store_pages_total(const kv_store *s) { return s->n_pages; }
int kv_store_pages_free(const kv_store *s) { return s->n_free; }

int kv_seq_create(kv_store *s, kv_seq **out)
{
    (void)s;
    *out = calloc(1, sizeof(kv_seq));
    return *out ? 0 : KM_ENOMEM;
}

static void kv_page_unref(kv_store *s, int32_t id)
{
    if (--s->refs[id] == 0) s->free_stack[s->n_free++] = id;
}

void kv_seq_destroy(kv_store *s, kv_seq *q)
{
    if (!q) return;
    for (int i = 0; i < q->n_pages; i++) kv_page_unref(s, q->page_ids[i]);
    free(q->page_ids);
    free(q->page_ptrs);
    free(q);
}

int kv_seq_capacity(const kv_seq *q) { return q->n_pages; }

int kv_seq_reserve(kv_store *s, kv_seq *q, int n_tokens)
{
    int pt = s->cfg.page_tokens;
    int need = (n_tokens + pt - 1) / pt;
    if (need <= q->n_pages) return 0;
    if (need - q->n_pages > s->n_free) return KM_ENOSPC;
    if (need > q->cap_pages) {
        int cap = q->cap_pages ? q->cap_pages : 8;
        while (cap < need) cap *= 2;
        int32_t *ids = realloc(q->page_ids, sizeof(int32_t) * cap);
        if (!ids) return KM_ENOMEM;
        q->page_ids = ids;
        const uint8_t **ptrs = realloc(q->page_ptrs, sizeof(uint8_t *) * cap);
        if (!ptrs) return KM_ENOMEM;
        q->page_ptrs = ptrs;
        q->cap_pages = cap;
    }
    while (q->n_pages < need) {
        int32_t id = s->free_stack[--s->n_free];
        s->refs[id] = 1;
        q->page_ids[q->n_pages] = id;
        q->page_ptrs[q->n_pages] = s->arena + (size_t)id * s->page_bytes;
        q->n_pages++;
    }
    return 0;
}

void kv_seq_truncate(kv_store *s, kv_seq *q, int n_tokens)
{
    int pt = s->cfg.page_tokens;
    int keep = (n_tokens + pt - 1) / pt;
    while (q->n_pages > keep) kv_page_unref(s, q->page_ids[--q->n_pages]);
}

static inline size_t kv_block_off(const kv_store *s, int layer, int head, int v)
{
    return (((size_t)layer * s->cfg.n_kv_heads + head) * 2 + v) * s->block_bytes;
}

void kv_seq_write(kv_store *s, kv_seq *q, int layer, int pos, const float *k, const float *v)
{
    int pt = s->cfg.page_tokens, hd = s->cfg.head_dim;
    uint8_t *page = (uint8_t *)q->page_ptrs[pos / pt];
    size_t row = (size_t)(pos % pt) * hd * 2;
    for (int h = 0; h < s->cfg.n_kv_heads; h++) {
        kn_f16 *kd = (kn_f16 *)(page + kv_block_off(s, layer, h, 0) + row);
        kn_f16 *vd = (kn_f16 *)(page + kv_block_off(s, layer, h, 1) + row);
        s->ops->f32_to_f16(k + (size_t)h * hd, kd, hd);
        s->ops->f32_to_f16(v + (size_t)h * hd, vd, hd);
    }
}

void kv_seq_view(const kv_store *s, const kv_seq *q, int layer, int kv_head, int n_ctx,
                 kn_kv_view *out)
{
    memset(out, 0, sizeof *out);
    out->pages = q->page_ptrs;
    out->k_off = kv_block_off(s, layer, kv_head, 0);
    out->v_off = kv_block_off(s, layer, kv_head, 1);
    out->page_tokens = s->cfg.page_tokens;
    out->n_ctx = n_ctx;
    out->format = s->cfg.format;
}
