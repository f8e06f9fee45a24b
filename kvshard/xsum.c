/*
 * xsum.c — the page checksum both ends of a transfer compute (kv_xfer_checksum: identity, token
 * ids and payload, XXH3 with the CPU's fastest update), at once or a piece at a time as a page
 * lands, and a page's transfer description with its checksum cached in the page. A page's
 * content changes only by conversion or sealing, both of which change its format or the
 * conversion count, so the cache holds until then. A store with an arena (one a transfer node
 * serves from) fills it when a page is published (seq.c); otherwise the first export does
 * (xfer.c). Its own layer, below sequences, so that both can call it (docs/kvshard.md).
 */
#include <stdatomic.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvshard/internal.h"

/* ---------------------------------------------------------------- checksum */

static void kv_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void kv_put64(uint8_t *p, uint64_t v)
{
    kv_put32(p, (uint32_t)v);
    kv_put32(p + 4, (uint32_t)(v >> 32));
}

_Static_assert(sizeof(XXH3_state_t) <= sizeof(kv_xfer_sum), "kv_xfer_sum holds an XXH3 state");

/* The CPU's fastest XXH3 update (the same state, bit for bit, from every table). */
static void (*kv_xxh3_update(void))(void *, const void *, size_t)
{
    static void (*_Atomic fn)(void *, const void *, size_t);
    void (*f)(void *, const void *, size_t) = atomic_load_explicit(&fn, memory_order_relaxed);
    if (!f) {
        f = kn_ops_best()->xxh3_update;
        atomic_store_explicit(&fn, f, memory_order_relaxed);
    }
    return f;
}

void kv_xfer_sum_begin(kv_xfer_sum *s, const kv_xfer_page *p, int page_tokens)
{
    uint8_t h[56];
    kv_put32(h, (uint32_t)p->format);
    kv_put32(h + 4, (uint32_t)page_tokens);
    kv_put32(h + 8, (uint32_t)p->index);
    kv_put32(h + 12, 0);
    kv_put64(h + 16, p->hash.lo);
    kv_put64(h + 24, p->hash.hi);
    kv_put64(h + 32, p->parent.lo);
    kv_put64(h + 40, p->parent.hi);
    kv_put64(h + 48, (uint64_t)p->bytes);
    XXH3_state_t *st = (XXH3_state_t *)s->st;
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, h, sizeof h);
    /* token ids as little-endian int32, like the disk page (the store assumes a LE host) */
    XXH3_64bits_update(st, p->tokens, sizeof(int32_t) * (size_t)page_tokens);
}

void kv_xfer_sum_update(kv_xfer_sum *s, const void *part, size_t n)
{
    kv_xxh3_update()(s->st, part, n);
}

uint64_t kv_xfer_sum_end(kv_xfer_sum *s)
{
    return XXH3_64bits_digest((XXH3_state_t *)s->st);
}

uint64_t kv_xfer_checksum(const kv_xfer_page *p, int page_tokens, const void *payload)
{
    kv_xfer_sum s = {{0}}; /* (reset by begin; initialised for cppcheck) */
    kv_xfer_sum_begin(&s, p, page_tokens);
    kv_xfer_sum_update(&s, payload, p->bytes);
    return kv_xfer_sum_end(&s);
}

/* ---------------------------------------------------------------- descriptions */

void kv_page_xfer_describe(kv_store *s, kv_page *p, kv_xfer_page *o)
{
    *o = (kv_xfer_page){
        .format = p->format,
        .index = p->index,
        .hash = p->hash,
        .parent = p->parent,
        .tokens = p->tokens,
        .buf = p->buf,
        .bytes = s->lay[p->format].page_bytes,
        .region = kv_arena_region_of(s, p->buf),
    };
    if (p->xsum_fmt != (int)p->format + 1 || p->xsum_epoch != s->st.converted_pages) {
        p->xsum = kv_xfer_checksum(o, s->pt, p->buf);
        p->xsum_fmt = (int)p->format + 1;
        p->xsum_epoch = s->st.converted_pages;
    }
    o->checksum = p->xsum;
}
