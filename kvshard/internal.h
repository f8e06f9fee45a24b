/*
 * internal.h — the private structures of kvshard and the functions its files share. Nothing here
 * is visible outside kvshard/ (tests aside).
 *
 * The files are layers, and calls go one way, down this list (docs/kvshard.md, "Layers"; the
 * order is checked on the objects by `make check-layers`):
 *   store.c   top: create (every layer set up in order) and destroy
 *   xfer.c    page transfer support: exports (pinned for a reader), imports
 *   tier.c    top: attach (a prefix hit promoted), persist (RAM pages copied to disk on a drain)
 *   convert.c top: recovery level 2 (every page re-encoded, new pages in the new format)
 *   check.c   top: kv_store_check, every structural invariant over the whole store (tests)
 *   seq.c     sequences: page tables, reserve (copy-on-write, sealing), fork, truncate, lossy
 *             policies, publish, and the hot path (write, view, read)
 *   evict.c   pages no sequence holds: victims, demotion, room-making allocation, watermarks,
 *             recovery level 1
 *   disk.c    the disk tier's files: atomic write, verified read, unlink, re-index at open
 *   index.c   the prefix index: hash table and verified lookup
 *   promote.c the promoter thread (host -> hot, asynchronous, layer by layer)
 *   format.c  per-format encodings, quantizers, page conversion and int4 sealing
 *   xsum.c    the page checksum of transfers, and a page's transfer description (cached sum)
 *   page.c    page memory and accounting: buffers, budgets per (shard, tier), page objects and
 *             their references, cached lists, shard keys, statistics
 *   arena.c   the page-memory arena (kv_config.arena): one region, slabs per format
 *   events.c  the event ring                      (leaves: they call nothing in kvshard)
 *   diskfmt.c layouts and the page file format, pure (fuzzed; kvshard/diskfmt.h)
 * The structures below are shared by all layers; what may call what is the list above.
 */
#ifndef KVSHARD_INTERNAL_H
#define KVSHARD_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "kvshard/diskfmt.h"
#include "kvshard/kvshard.h"

#define KV_PAGE_INDEXED 1u  /* in the prefix index (immutable, has hash and tokens) */
#define KV_PAGE_SHARED  2u  /* has been used by two sequences at once: evicted last */
#define KV_PAGE_ON_DISK 4u  /* a verified page file exists */
#define KV_PAGE_MARK    8u  /* scratch of one call (kv_store_chains), clear outside it */
#define KV_PAGE_BAD     16u /* its disk copy failed verification while fetched: never served */
/* A chunk's page (docs/blend.md): KV cached by its own tokens, reused at any position after its
 * keys are re-rotated; set when indexed by a position-free sequence, cleared when unindexed. */
#define KV_PAGE_POSFREE 32u
#define KV_PAGE_SLICES  64u /* slice_sum holds its page file's layer checksums (kv_seq_fetch) */

typedef struct kv_page {
    uint8_t *buf;     /* the RAM copy (tier HOT or HOST); NULL when only on disk */
    kv_format format; /* format of buf (or of the disk file when buf is NULL) */
    kv_tier tier;     /* HOT, HOST, or DISK when only the file exists */
    uint32_t flags;
    int shard;
    int expert;            /* the dominant routed expert of its tokens (kv_seq_place); -1: none */
    int refs;              /* sequences that hold it; > 0 implies tier HOT */
    _Atomic uint32_t rows; /* (layer, row) writes seen; complete at n_layers * page_tokens */
    uint64_t last_use;     /* store clock at the last touch */
    uint64_t hits;
    km_pagehash hash;
    km_pagehash parent; /* hash of the previous page of its chain (index > 0) */
    uint64_t id;        /* unique per store */
    uint64_t parent_id; /* id of the page it was published after; 0 for the first page */
    int32_t index;      /* position in its chain */
    /* The chains as the index links them (index.c): `up` is the indexed page this one hangs
     * from (its parent, by hash and id; NULL for a chain's first page), `kid` the first of those
     * hanging from it (siblings through sib_prev/sib_next), kids[t] how many of them are on tier
     * t. Eviction takes a chain from its tail (evict.c). */
    struct kv_page *up, *kid, *sib_prev, *sib_next;
    uint32_t kids[KV_TIER_COUNT];
    uint64_t walk;   /* scratch of evict.c: the eviction walk that could not take it */
    int32_t *tokens; /* [page_tokens] once indexed */
    struct kv_page *lprev, *lnext; /* the shard's cached list of its tier (refs == 0) */
    int in_list;                   /* 1 while in that list */
    struct kv_page *hnext;         /* index bucket chain */
    int promoting;                 /* a promotion job is filling buf */
    /* kv_xfer_checksum, cached: valid while the format is xsum_fmt - 1 and no page has been
     * converted since (st.converted_pages == xsum_epoch), the only ways content changes */
    uint64_t xsum, xsum_epoch;
    int xsum_fmt;
    /* Key summary for sparse attention (kv_config.summaries; NULL until its sequence reserves
     * it): per (layer, head) min[head_dim] then max[head_dim] of the keys over its tokens, f16
     * rounded outward, in RAM whatever the tier, at sum + kv_sum_off(layer, head): a slot of a
     * summary slab (page.c); sum_ok[layer] says a layer's is current (cleared when the content
     * is re-encoded: sealing, conversion). */
    kn_f16 *sum;
    uint8_t *sum_ok;
    int32_t sum_slot; /* its slot among the store's slabs (slab * KV_SUM_SLAB + index) */
    /* kv_seq_touch: the holder's step (its sel_clock + 1) that last read it; 0: not seen yet */
    _Atomic uint64_t sel_at;
    /* [n_layers] XXH3 of each layer's bytes in its (unsealed) page file, set when the file is
     * written or re-indexed (valid while KV_PAGE_SLICES): a layer read alone is verified by it */
    uint64_t *slice_sum;
    int slice_reads; /* layer slices read while not hot, since it last came up (fetch_slices) */
} kv_page;

/* Key summaries are cut from slabs of KV_SUM_SLAB pages' summaries laid out [layer][kv head]
 * [slot][2 x head_dim] (f16), so that scoring for one (layer, kv head) the pages a sequence
 * reserved one after another reads adjacent memory, which the hardware prefetches. A freed slot
 * is reused by a later page; slabs go back only with the store. */
#define KV_SUM_SLAB 64
typedef struct kv_sum_slab {
    kn_f16 *base;
    uint8_t *ok; /* [KV_SUM_SLAB][n_layers]: sum_ok of each slot */
    int used;    /* slots handed out from the slab's start (later ones only from the free list) */
} kv_sum_slab;

typedef struct kv_tier_acct {
    size_t used, budget;
    uint64_t pages;
    kv_page *head, *tail; /* cached pages (refs == 0) of this tier, oldest first */
    uint64_t n_cached;
    size_t cached_bytes; /* RAM bytes of those pages (hot and host tiers; 0 for disk) */
} kv_tier_acct;

typedef struct kv_shard {
    kv_format format;
    kv_evict_policy evict;
    kv_tier_acct t[KV_TIER_COUNT];
    uint64_t allocs, alloc_failures, evictions, demotions, promotions, hits, misses;
} kv_shard;

/* One expert group (shard key `expert`: an expert's group is its id mod n_expert_groups): where
 * its pages are, and what happened to them. */
typedef struct kv_group {
    uint64_t pages[KV_TIER_COUNT]; /* pages tagged with the group's experts, by their tier */
    uint64_t placed, hits, demotions, evictions;
} kv_group;

/* A disk page's verified payload into dst, or (layer >= 0) that layer's slice of it (disk.c's,
 * given by tier.c: the promoter calls no layer above it); 0 or an error, nothing counted. */
typedef int (*kv_page_reader)(const kv_store *s, const kv_page *p, int layer, uint8_t *dst);

/* A promotion for a sequence's pages: the disk ones (src NULL) read first, then src -> dst
 * layer by layer from layer `first` up, wrapping round to the layers below it. */
typedef struct kv_promo {
    struct kv_promo *next;
    kv_seq *q;
    int n, first;
    uint8_t **src, **dst;
    size_t *bytes; /* page bytes of each pair */
    kv_format *fmt;
    kv_page **pages;
    int *rc;    /* disk reads: their result (a failed page's dst is zeroed) */
    int *layer; /* disk reads: -1 the whole page (it comes up), else that layer's slice alone */
    kv_page_reader read;
    int done;
} kv_promo;

struct kv_seq {
    uint64_t uid;
    int n_pages, cap;
    kv_page **pg;
    const uint8_t **ptrs;
    uint8_t *fmts;
    float *mass;   /* h2o: accumulated attention per page */
    int32_t *pidx; /* page index in the sequence's positions (differs once pages are dropped) */
    int fmt_count[KV_FORMAT_COUNT];
    int seal_from; /* pages below are sealed or need no sealing */
    int reserved;  /* positions below were reserved before (so written, by the contract) */
    int n_dropped; /* whole pages dropped by the lossy policy (all before the live tail) */
    kv_seq_policy policy;
    _Atomic int ready_layers; /* layers of a pending promotion already copied, from ready_first */
    int ready_first;
    int promo_pending;
    int n_cold; /* table pages not on the hot tier (kv_config.promote_selected) */
    /* Its pages' buffers are lent to a transfer (xfer.c: a NIC may be reading or writing them):
     * nothing may move them, so recovery level 2 leaves this sequence's pages as they are. */
    int lent;
    /* Pages below sum_from have every layer's key summary (kv_config.summaries); sum_at[i]
     * is page i's summary buffer for those, so that a step's scores read no page object. */
    int sum_from;
    const kn_f16 **sum_at;
    /* Layer slices of disk pages a step reads (kv_config.fetch_slices): slot j of slice_buf
     * (slice_slot bytes each) holds layer slice_layer of page slice_page[j], and ptrs[that
     * page] points slice_layer's offset before it, so views of that layer read it as a page. */
    uint8_t *slice_buf;
    int *slice_page, n_slices, slice_cap, slice_layer;
    uint64_t sel_clock;  /* kv_seq_demote_idle calls so far (the steps it ended) */
    int position_free;   /* the pages it publishes are KV_PAGE_POSFREE (kv_seq_set_position_free) */
    kv_seq *prev, *next; /* the store's list of sequences */
};

struct kv_store {
    kv_config cfg;
    kv_layout lay[KV_FORMAT_COUNT];
    size_t *view_offs; /* [n_layers * n_kv_heads][KV_FORMAT_COUNT][4] */
    int pt, n_layers, n_heads, hd;
    uint32_t rows_full; /* n_layers * page_tokens */
    int n_shards;
    kv_shard *shards;
    kv_group *groups; /* [cfg.n_expert_groups] under the `expert` shard key; NULL otherwise */
    float high_wm, low_wm;
    const kn_ops *ops;
    uint64_t clock, next_uid, next_page_id, walks;
    kv_seq *seqs;
    /* Key summaries (page.c): slabs of KV_SUM_SLAB pages' and the slots freed in them */
    kv_sum_slab *sum_slabs;
    int n_sum_slabs, cap_sum_slabs, n_sum_free;
    int32_t *sum_free;
    /* free page buffers per format, reused before asking malloc (they count in no budget) */
    uint8_t **free_bufs[KV_FORMAT_COUNT];
    int n_free_bufs[KV_FORMAT_COUNT];
    /* prefix index */
    kv_page **buckets;
    size_t n_buckets, n_indexed;
    float *fscratch; /* 2 * page_tokens * head_dim floats (conversion, sealing) */
    /* events */
    kv_event *ev;
    int ev_cap, ev_head, ev_len;
    uint64_t ev_next;
    uint64_t posfree[KV_TIER_COUNT]; /* indexed KV_PAGE_POSFREE pages per tier (events.c) */
    /* disk */
    char *disk_dir;
    uint64_t tmp_ctr;
    int disk_mac;              /* a cluster secret: page files are sealed, and must be */
    uint8_t disk_mac_key[32];  /* derived from kv_config.disk_secret (disk.c): older pages' MAC */
    uint8_t disk_seal_key[32]; /* and the key pages are sealed under */
    /* promoter */
    pthread_t promoter;
    int promoter_started, promoter_stop;
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done;
    kv_promo *jobs, *jobs_tail, *done_jobs;
    /* stats */
    kv_store_stats st;
    struct kv_arena *arena; /* NULL unless cfg.arena */
    /* Set while buffers are taken that their taker overwrites whole before anything reads them
     * (kv_import_reserve: pages a transfer lands): such a buffer is not zeroed first. */
    int buf_whole;
    struct kv_xfer *xfer; /* exports and imports; NULL until the first */
};

static inline int kv_format_valid(kv_format f)
{
    return (unsigned)f < KV_FORMAT_COUNT;
}

/* Bytes of one layer of a page of format f: [l * this, (l + 1) * this) of its buffer. */
static inline size_t kv_layer_bytes(const kv_store *s, kv_format f)
{
    return s->lay[f].unit * (size_t)s->n_heads;
}

/* Bytes of a slot of a sequence's slice buffer: a layer of any format, 64-byte aligned. */
static inline size_t kv_slice_slot(const kv_store *s)
{
    size_t m = 0;
    for (int f = 0; f < KV_FORMAT_COUNT; f++)
        if (kv_layer_bytes(s, (kv_format)f) > m) m = kv_layer_bytes(s, (kv_format)f);
    return (m + 63) & ~(size_t)63;
}

/* ---------------------------------------------------------------- events.c (leaf) */
void kv_event_emit(kv_store *s, kv_event_kind kind, const kv_page *p, kv_tier from, kv_tier to);
void kv_events_free(kv_store *s);

/* ---------------------------------------------------------------- arena.c */
int kv_arena_create(kv_store *s, km_errbuf *err);
void kv_arena_destroy(kv_store *s);
/* A zeroed-or-recycled buffer of format f from the arena, or NULL when it is full. */
uint8_t *kv_arena_get(kv_store *s, kv_format f);
/* 1 when buf came from the arena (and is now back in it), 0 when it is not the arena's. */
int kv_arena_put(kv_store *s, uint8_t *buf, kv_format f);
/* The region index holding buf, or -1. */
int kv_arena_region_of(const kv_store *s, const void *buf);

/* ---------------------------------------------------------------- seq.c */
/* kv_seq_publish, saying whether a store with an arena checksums the pages as they are
 * published (kv_seq_publish: yes; kv_import_commit: no, they were just checked against the
 * holder's checksum, and an export computes it if one is ever needed). */
int kv_seq_publish_sum(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                       int n_tokens, int checksum);

/* ---------------------------------------------------------------- xsum.c */
/* p's transfer description (kv_xfer_page), its checksum computed once and cached in the page
 * until its content can have changed (xsum_fmt, xsum_epoch). */
void kv_page_xfer_describe(kv_store *s, kv_page *p, kv_xfer_page *o);

/* ---------------------------------------------------------------- page.c */
uint8_t *kv_buf_get(kv_store *s, kv_format f);
void kv_buf_put(kv_store *s, uint8_t *buf, kv_format f);
size_t kv_format_bytes(const kv_store *s, kv_format f);
/* Accounts a page buffer of format f in (shard, tier); with force the budget may be exceeded. */
int kv_acct_add(kv_store *s, int shard, kv_tier t, kv_format f, int force);
void kv_acct_sub(kv_store *s, int shard, kv_tier t, kv_format f);
/* A hot buffer of format f in shard if it fits the budget as it is (KM_ENOSPC otherwise: making
 * room is evict.c's kv_hot_alloc). */
int kv_hot_take(kv_store *s, int shard, kv_format f, uint8_t **out);
kv_page *kv_page_new(kv_store *s);
/* Frees a page that is neither indexed nor on disk: its RAM buffer and accounting, the object. */
void kv_page_release(kv_store *s, kv_page *p);
void kv_page_ref(kv_store *s, kv_page *p);
/* The last reference gone: an indexed page joins its cached list, any other is released. */
void kv_page_unref(kv_store *s, kv_page *p);
/* Gives p its (invalid) key summary buffer if it has none; 0 or KM_ENOMEM. */
int kv_page_sum_alloc(kv_store *s, kv_page *p);
/* Marks every layer's key summary of p stale (its content was re-encoded). */
void kv_page_sum_clear(const kv_store *s, kv_page *p);
/* Gives p's summary slot back (the page goes away). */
void kv_page_sum_free(kv_store *s, kv_page *p);
/* Offset of (layer, head)'s summary from kv_page.sum (slab layout). */
static inline size_t kv_sum_off(int n_heads, int head_dim, int layer, int head)
{
    return ((size_t)layer * n_heads + head) * KV_SUM_SLAB * 2 * (size_t)head_dim;
}
void kv_list_push(kv_store *s, kv_page *p); /* into its shard/tier cached list by last_use */
/* A page tagged with an expert moves from tier `from` to tier `to` (-1: nowhere, it appears or
 * goes): its group's occupancy follows. Nothing for an untagged page. */
void kv_group_move(kv_store *s, const kv_page *p, int from, int to);
/* Its group, or NULL (untagged, or no groups). */
kv_group *kv_group_of(kv_store *s, const kv_page *p);
void kv_list_remove(kv_store *s, kv_page *p);
/* RAM bytes a cached page of format f counts in its tier's cached_bytes (0 on disk). */
size_t kv_list_bytes(const kv_store *s, kv_tier t, kv_format f);

/* ---------------------------------------------------------------- format.c */
uint8_t kv_fp8_from_f32(float x);
float kv_fp8_to_f32(uint8_t b);
/* Writes row `row` of (layer, head) of K and V into a page of a row-writable format. */
void kv_page_write_row(const kv_store *s, uint8_t *page, kv_format f, int layer, int head, int row,
                       const float *k, const float *v);
/* Dequantizes row `row` of (layer, head): k and v of head_dim floats. */
void kv_page_read_row(const kv_store *s, const uint8_t *page, kv_format f, int layer, int head,
                      int row, float *k, float *v);
/* Re-encodes a whole page from format a (in src) to format b (in dst). */
void kv_page_convert(kv_store *s, const uint8_t *src, kv_format a, uint8_t *dst, kv_format b);
/* Computes layer's key summary of p (all its rows written) from the page as attention reads it. */
void kv_page_summarize(const kv_store *s, kv_page *p, int layer);
/* Re-encodes a hot page as int4 in place (its buffer replaced); callers refresh the tables. */
int kv_page_seal(kv_store *s, kv_page *p);
/* The same without converting (convert 0): the page's payload is about to be overwritten whole. */
int kv_page_seal_as(kv_store *s, kv_page *p, int convert);
static inline int kv_format_row_writable(kv_format f)
{
    return f != KN_KV_INT4;
}

/* ---------------------------------------------------------------- promote.c */
int kv_promoter_start(kv_store *s);
void kv_promoter_stop(kv_store *s);
kv_promo *kv_promo_new(int n_pages); /* room for n_pages pairs; NULL when out of memory */
void kv_promo_free(kv_promo *job);
void kv_promo_submit(kv_store *s, kv_promo *job);
/* Frees the host copies of finished jobs and clears their pages' promoting marks. */
void kv_promo_reap(kv_store *s);
/* Blocks until q's pending promotion has finished, and reaps it. */
void kv_seq_wait_promo(kv_store *s, kv_seq *q);

/* ---------------------------------------------------------------- index.c */
kv_page *kv_index_find(const kv_store *s, km_pagehash h);
/* The page that may serve chain link h after the page parent_id: tokens and parent agree. */
kv_page *kv_index_verified(kv_store *s, km_pagehash h, const int32_t *tokens, uint64_t parent_id);
/* Indexes p and links it under its parent when that is indexed with p's parent_id. */
int kv_index_insert(kv_store *s, kv_page *p);
/* Unindexes a page nothing hangs from (asserted: its children would become unreachable). */
void kv_index_remove(kv_store *s, kv_page *p);
/* An indexed page moved from tier `from` to its current tier: its parent's counts follow. */
void kv_index_retier(kv_store *s, kv_page *p, kv_tier from);
/* Links every indexed page under its parent again (after the disk tier's re-index). */
void kv_index_relink(kv_store *s);
/* The indexed page p's parent must be, for p to be reachable (NULL for a first page or none). */
kv_page *kv_index_parent(const kv_store *s, const kv_page *p);
/* Pages hanging from p on tiers up to and including t (KV_TIER_DISK: all of them). */
static inline uint32_t kv_page_kids(const kv_page *p, kv_tier t)
{
    uint32_t n = 0;
    for (int u = KV_TIER_HOT; u <= (int)t; u++) n += p->kids[u];
    return n;
}
/* 1 when no lookup can reach the indexed page p: its parent is gone (an orphan). */
static inline int kv_page_orphan(const kv_page *p)
{
    return p->index > 0 ? p->up == NULL : p->parent_id != 0;
}

/* ---------------------------------------------------------------- disk.c */
int kv_disk_enabled(const kv_store *s);
/* Re-indexes the directory's page files (budgets are enforced after, by kv_disk_trim). */
int kv_disk_open(kv_store *s, km_errbuf *err);
int kv_disk_write(kv_store *s, kv_page *p);
int kv_disk_read(kv_store *s, kv_page *p, uint8_t *dst);
/* The same without counting or logging a failure (any thread: the promoter's reads). */
int kv_disk_fetch(const kv_store *s, const kv_page *p, int layer, uint8_t *dst);
/* Keeps the layer checksums of p's page file, written (or re-indexed) from payload; a sealed
 * file's slices cannot be read alone (KV_PAGE_SLICES stays clear). */
void kv_disk_slice_sums(kv_store *s, kv_page *p, const uint8_t *payload);
void kv_disk_unlink(kv_store *s, kv_page *p);

/* ---------------------------------------------------------------- evict.c */
/* A hot buffer of format f in shard, demoting or dropping cached pages for room. */
int kv_hot_alloc(kv_store *s, int shard, kv_format f, uint8_t **out);
/* Moves or drops cached pages of (shard, tier) until `need` more bytes fit under `limit`. */
int kv_make_room(kv_store *s, int shard, kv_tier t, size_t need, size_t limit);
/* Moves a cached page one tier down (or further), or drops it; 1 when dropped. */
int kv_demote(kv_store *s, kv_page *p);
/* A page no sequence holds and nothing hangs from leaves every tier: index (REMOVED event),
 * file, memory. */
void kv_page_drop(kv_store *s, kv_page *p);
/* Drops p (held by no sequence) and every indexed page hanging from it, which no lookup could
 * reach once p is gone; one a sequence still holds is only unindexed and stays that
 * sequence's. Returns the pages that left the index. */
int kv_page_drop_tree(kv_store *s, kv_page *p);
void kv_enforce_watermarks(kv_store *s, int shard);
/* After a re-index: stamps the disk pages deepest first (a chain's tail is the oldest), then
 * drops the oldest of every shard over its disk budget. */
void kv_disk_trim(kv_store *s);

/* ---------------------------------------------------------------- seq.c */
int kv_seq_grow(kv_seq *q, int need);
/* Points the sequence's tables (ptrs, fmts) at its pages' current buffers and formats (and its
 * disk pages read as layer slices at their slice). */
void kv_seq_refresh(kv_store *s, kv_seq *q);
/* Points each live layer slice's page at it (ptrs), the layer's offset before its slot. */
void kv_seq_slices_point(const kv_store *s, kv_seq *q);
void kv_refresh_all(kv_store *s);

/* ---------------------------------------------------------------- tier.c */
/* kv_seq_attach, lazy or not whatever kv_config.promote_selected says (an export or an import
 * pins its pages hot: lazy 0). */
int kv_seq_attach_mode(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                       int n_pages, int lazy);

/* ---------------------------------------------------------------- xfer.c */
void kv_xfer_free(kv_store *s); /* aborts every import and ends every export */

/* ---------------------------------------------------------------- check.c */
/* Every structural invariant of the store (refs, tiers, accounting, cached lists, index, the
 * sequences' tables): 0, or KM_ECORRUPT with the first broken one in err. Between calls only. */
int kv_store_check(const kv_store *s, km_errbuf *err);

#endif
