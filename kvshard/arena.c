/*
 * arena.c — the page-memory arena (kv_config.arena): one region reserved when the store is
 * created, from which every RAM page buffer of the hot and host tiers is cut, so that a transfer
 * layer registers the store's page memory once at start (ucp_mem_map) instead of per transfer,
 * and so that a device hot tier (a single allocation) can later follow the same scheme.
 *
 * Slabs: the region is split into slabs of equal size. A slab serves one format at a time and is
 * cut into slots of that format's page size (rounded up to 64 bytes); a freed slot goes back to
 * its slab, and a slab whose slots are all free returns to the empty pool, from which any format
 * may take it. A slot handed out for the first time since its slab was taken is zero, like a fresh
 * buffer: zeroed when it is handed out (not the whole slab when the slab is taken), and not at
 * all when the store says the buffer will be overwritten whole before it is read (s->buf_whole:
 * the destination of a page transfer, which would otherwise be written twice). A live conversion
 * f16 -> fp8 therefore frees whole f16 slabs that the fp8 pages then reuse: the arena never holds
 * more than the peak.
 *
 * Why the bookkeeping lives outside the region: a peer may read the region (and a late
 * transfer may write into a buffer being given back), so a free list threaded through the
 * slots could be corrupted from outside. The region is reserved with MAP_NORESERVE (untouched
 * slabs cost address space, not memory) and is unmapped only by kv_store_destroy: a reader that
 * raced a page's release reads stale bytes, which its checksum rejects, never unmapped memory.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvshard/internal.h"

#define KV_SLAB_MIN   ((size_t)256 << 10) /* smallest slab */
#define KV_SLAB_PAGES 8                   /* f16 pages per slab at least */

typedef struct kv_slab {
    int format; /* -1 while empty */
    int used;   /* slots handed out */
    int n_free; /* entries on the free stack */
    int prev, next, in_partial;
    int dirty; /* has served a format before: its slots are zeroed as they are handed out */
    int32_t *free;
    uint8_t *unzeroed; /* per slot of the current format: not yet zeroed since the slab was taken */
} kv_slab;

typedef struct kv_arena {
    uint8_t *base;
    size_t bytes, slab_bytes;
    int n_slabs, max_slots;
    kv_slab *slabs;
    int32_t *slot_idx; /* n_slabs * max_slots: each slab's free stack */
    uint8_t *unzeroed; /* n_slabs * max_slots: each slab's slots still to be zeroed */
    int *empty, n_empty;
    int partial[KV_FORMAT_COUNT]; /* slabs of a format with a free slot (list head, -1) */
    size_t slot_bytes[KV_FORMAT_COUNT];
} kv_arena;

static size_t kv_round_up(size_t n, size_t a)
{
    return (n + a - 1) / a * a;
}

int kv_arena_create(kv_store *s, km_errbuf *err)
{
    kv_arena *a = calloc(1, sizeof *a);
    if (!a) return km_errf(err, KM_ENOMEM, "kv arena: out of memory");
    size_t max_slot = 0, min_slot = SIZE_MAX, budget = 0;
    for (int f = 0; f < KV_FORMAT_COUNT; f++) {
        a->partial[f] = -1;
        if (!s->lay[f].unit) continue;
        a->slot_bytes[f] = kv_round_up(s->lay[f].page_bytes, 64);
        if (a->slot_bytes[f] > max_slot) max_slot = a->slot_bytes[f];
        if (a->slot_bytes[f] < min_slot) min_slot = a->slot_bytes[f];
    }
    a->slab_bytes = kv_round_up(max_slot * KV_SLAB_PAGES, 4096);
    if (a->slab_bytes < KV_SLAB_MIN) a->slab_bytes = KV_SLAB_MIN;
    a->max_slots = (int)(a->slab_bytes / min_slot);
    for (int i = 0; i < s->n_shards; i++)
        budget += s->shards[i].t[KV_TIER_HOT].budget + s->shards[i].t[KV_TIER_HOST].budget;
    /* Budgets may be passed for a moment (sealing, conversion, promotion) and a slab may be
     * partly used by a format that has few pages: a quarter more, and a slab per format and
     * shard. */
    size_t want =
        s->cfg.arena_bytes
            ? s->cfg.arena_bytes
            : budget + budget / 4 + (size_t)(KV_FORMAT_COUNT + 2 + s->n_shards) * a->slab_bytes;
    a->n_slabs = (int)((want + a->slab_bytes - 1) / a->slab_bytes);
    if (a->n_slabs < 1) a->n_slabs = 1;
    a->bytes = (size_t)a->n_slabs * a->slab_bytes;
    a->slabs = calloc((size_t)a->n_slabs, sizeof *a->slabs);
    a->slot_idx = malloc(sizeof(int32_t) * (size_t)a->n_slabs * a->max_slots);
    a->empty = malloc(sizeof(int) * (size_t)a->n_slabs);
    a->unzeroed = calloc((size_t)a->n_slabs * a->max_slots, 1);
    void *m = mmap(NULL, a->bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED || !a->slabs || !a->slot_idx || !a->empty || !a->unzeroed) {
        size_t bytes = a->bytes;
        if (m != MAP_FAILED) munmap(m, bytes);
        free(a->slabs);
        free(a->slot_idx);
        free(a->empty);
        free(a->unzeroed);
        free(a);
        return km_errf(err, KM_ENOMEM, "kv arena: cannot reserve %zu bytes", bytes);
    }
    a->base = m;
    for (int i = 0; i < a->n_slabs; i++) {
        kv_slab *sl = &a->slabs[i];
        sl->format = -1;
        sl->prev = sl->next = -1;
        sl->free = a->slot_idx + (size_t)i * a->max_slots;
        sl->unzeroed = a->unzeroed + (size_t)i * a->max_slots;
        a->empty[i] = a->n_slabs - 1 - i; /* low addresses first */
    }
    a->n_empty = a->n_slabs;
    s->arena = a;
    return 0;
}

void kv_arena_destroy(kv_store *s)
{
    kv_arena *a = s->arena;
    if (!a) return;
    munmap(a->base, a->bytes);
    free(a->slabs);
    free(a->slot_idx);
    free(a->empty);
    free(a->unzeroed);
    free(a);
    s->arena = NULL;
}

static void kv_partial_link(kv_arena *a, int i)
{
    kv_slab *sl = &a->slabs[i];
    assert(!sl->in_partial && sl->format >= 0);
    sl->prev = -1;
    sl->next = a->partial[sl->format];
    if (sl->next >= 0) a->slabs[sl->next].prev = i;
    a->partial[sl->format] = i;
    sl->in_partial = 1;
}

static void kv_partial_unlink(kv_arena *a, int i)
{
    kv_slab *sl = &a->slabs[i];
    assert(sl->in_partial);
    if (sl->prev >= 0)
        a->slabs[sl->prev].next = sl->next;
    else
        a->partial[sl->format] = sl->next;
    if (sl->next >= 0) a->slabs[sl->next].prev = sl->prev;
    sl->prev = sl->next = -1;
    sl->in_partial = 0;
}

uint8_t *kv_arena_get(kv_store *s, kv_format f)
{
    kv_arena *a = s->arena;
    if (!a->slot_bytes[f]) return NULL;
    int i = a->partial[f];
    if (i < 0) {
        if (!a->n_empty) return NULL;
        i = a->empty[--a->n_empty];
        kv_slab *sl = &a->slabs[i];
        sl->format = (int)f;
        sl->used = 0;
        sl->n_free = (int)(a->slab_bytes / a->slot_bytes[f]);
        for (int k = 0; k < sl->n_free; k++) sl->free[k] = sl->n_free - 1 - k;
        /* never touched: the mapping's own zeros; else each slot is zeroed as it goes out */
        memset(sl->unzeroed, sl->dirty, (size_t)sl->n_free);
        sl->dirty = 1;
        kv_partial_link(a, i);
    }
    kv_slab *sl = &a->slabs[i];
    assert(sl->format == (int)f && sl->n_free > 0);
    int32_t slot = sl->free[--sl->n_free];
    sl->used++;
    if (!sl->n_free) kv_partial_unlink(a, i);
    uint8_t *buf = a->base + (size_t)i * a->slab_bytes + (size_t)slot * a->slot_bytes[f];
    if (sl->unzeroed[slot]) {
        if (!s->buf_whole) memset(buf, 0, a->slot_bytes[f]);
        sl->unzeroed[slot] = 0;
    }
    return buf;
}

int kv_arena_put(kv_store *s, uint8_t *buf, kv_format f)
{
    kv_arena *a = s->arena;
    if (buf < a->base || buf >= a->base + a->bytes) return 0;
    size_t off = (size_t)(buf - a->base);
    int i = (int)(off / a->slab_bytes);
    kv_slab *sl = &a->slabs[i];
    assert(sl->format == (int)f && sl->used > 0);
    assert((off % a->slab_bytes) % a->slot_bytes[f] == 0);
    sl->free[sl->n_free++] = (int32_t)((off % a->slab_bytes) / a->slot_bytes[f]);
    sl->used--;
    if (sl->n_free == 1) kv_partial_link(a, i);
    if (!sl->used) {
        kv_partial_unlink(a, i);
        sl->format = -1;
        sl->n_free = 0;
        a->empty[a->n_empty++] = i;
    }
    return 1;
}

int kv_arena_region_of(const kv_store *s, const void *buf)
{
    const kv_arena *a = s->arena;
    const uint8_t *b = buf;
    return a && b >= a->base && b < a->base + a->bytes ? 0 : -1;
}

int kv_store_mem_regions(const kv_store *s, kv_mem_region *out, int max)
{
    if (!s->arena) return 0;
    if (max >= 1 && out) out[0] = (kv_mem_region){s->arena->base, s->arena->bytes};
    return 1;
}
