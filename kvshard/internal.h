/*
 * internal.h — the private structures of kvshard, shared by its files:
 *   format.c  page layouts per format, quantizers, int4 sealing, page conversion
 *   store.c   the store, shards, byte accounting per tier, page objects, shard keys, stats
 *   seq.c     sequences: page tables, reserve (copy-on-write, sealing), write, view, policies
 *   index.c   the prefix index: publish, verified lookup, attach (promotion)
 *   evict.c   victim scoring, demotion between tiers, watermarks, evict_oldest_fraction
 *   tier.c    the promoter thread (asynchronous, layer by layer)
 *   disk.c    the disk tier: atomic page files, re-index at open
 *   diskfmt.c the page file format (pure, fuzzed)
 *   events.c  the event ring
 * Nothing here is visible outside kvshard/.
 */
#ifndef KVSHARD_INTERNAL_H
#define KVSHARD_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "kvshard/kvshard.h"

#define KV_PAGE_INDEXED 1u /* in the prefix index (immutable, has hash and tokens) */
#define KV_PAGE_SHARED  2u /* has been used by two sequences at once: evicted last */
#define KV_PAGE_ON_DISK 4u /* a verified page file exists */

typedef struct kv_page {
    uint8_t *buf;     /* the RAM copy (tier HOT or HOST); NULL when only on disk */
    kv_format format; /* format of buf (or of the disk file when buf is NULL) */
    kv_tier tier;     /* HOT, HOST, or DISK when only the file exists */
    uint32_t flags;
    int shard;
    int refs;              /* sequences that hold it; > 0 implies tier HOT */
    _Atomic uint32_t rows; /* (layer, row) writes seen; complete at n_layers * page_tokens */
    uint64_t last_use;     /* store clock at the last touch */
    uint64_t hits;
    km_pagehash hash;
    km_pagehash parent;            /* hash of the previous page of its chain (index > 0) */
    uint64_t id;                   /* unique per store */
    uint64_t parent_id;            /* id of the page it was published after; 0 for the first page */
    int32_t index;                 /* position in its chain */
    int32_t *tokens;               /* [page_tokens] once indexed */
    struct kv_page *lprev, *lnext; /* the shard's cached list of its tier (refs == 0) */
    int in_list;                   /* 1 while in that list */
    struct kv_page *hnext;         /* index bucket chain */
    int promoting;                 /* a promotion job is filling buf */
} kv_page;

/* Page layout of one format: per (layer, head) a unit of [K data][V data][K scales][V scales]. */
typedef struct kv_layout {
    size_t kd, vd, ks, vs; /* bytes of each part */
    size_t unit;           /* kd + vd + ks + vs */
    size_t page_bytes;     /* unit * n_layers * n_kv_heads */
} kv_layout;

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

/* A promotion: copy src -> dst (layer by layer) for a sequence's pages. */
typedef struct kv_promo {
    struct kv_promo *next;
    kv_seq *q;
    int n;
    uint8_t **src, **dst;
    size_t *bytes; /* page bytes of each pair */
    kv_format *fmt;
    kv_page **pages;
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
    _Atomic int ready_layers; /* layers of a pending promotion already copied */
    int promo_pending;
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
    float high_wm, low_wm;
    const kn_ops *ops;
    uint64_t clock, next_uid, next_page_id;
    kv_seq *seqs;
    /* free page buffers per format, reused before asking malloc (they count in no budget) */
    uint8_t **free_bufs[KV_FORMAT_COUNT];
    int n_free_bufs[KV_FORMAT_COUNT];
    /* prefix index */
    kv_page **buckets;
    size_t n_buckets, n_indexed;
    /* scratch for victim selection */
    kv_page **cand;
    size_t cand_cap;
    float *fscratch; /* 2 * page_tokens * head_dim floats (conversion, sealing) */
    /* events */
    kv_event *ev;
    int ev_cap, ev_head, ev_len;
    uint64_t ev_next;
    /* disk */
    char *disk_dir;
    uint64_t tmp_ctr;
    /* promoter */
    pthread_t promoter;
    int promoter_started, promoter_stop;
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done;
    kv_promo *jobs, *jobs_tail, *done_jobs;
    /* stats */
    kv_store_stats st;
};

/* format.c */
void kv_layout_init(kv_layout *lay, kv_format f, int pt, int hd, int n_layers, int n_heads);
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
static inline int kv_format_row_writable(kv_format f)
{
    return f != KN_KV_INT4;
}

/* store.c */
uint8_t *kv_buf_get(kv_store *s, kv_format f);
void kv_buf_put(kv_store *s, uint8_t *buf, kv_format f);
/* Accounts a page buffer of format f in (shard, tier); with force the budget may be exceeded. */
int kv_acct_add(kv_store *s, int shard, kv_tier t, kv_format f, int force);
void kv_acct_sub(kv_store *s, int shard, kv_tier t, kv_format f);
/* A hot buffer of format f in shard, evicting (demoting) cached pages for room. */
int kv_hot_alloc(kv_store *s, int shard, kv_format f, uint8_t **out);
kv_page *kv_page_new(kv_store *s);
/* Frees the page object and its RAM buffer and file; emits REMOVED when it was indexed. */
void kv_page_free(kv_store *s, kv_page *p);
void kv_list_push(kv_store *s, kv_page *p); /* into its shard/tier cached list by last_use */
void kv_list_remove(kv_store *s, kv_page *p);
/* RAM bytes a cached page of format f counts in its tier's cached_bytes (0 on disk). */
size_t kv_list_bytes(const kv_store *s, kv_tier t, kv_format f);
void kv_page_ref(kv_store *s, kv_page *p);
void kv_page_unref(kv_store *s, kv_page *p);
/* Points every sequence holding p at its current buffer and format. */
void kv_refresh_all(kv_store *s);
void kv_seq_refresh(kv_store *s, kv_seq *q);
size_t kv_format_bytes(const kv_store *s, kv_format f);

/* seq.c */
int kv_page_seal(kv_store *s, kv_page *p);
int kv_seq_grow(kv_seq *q, int need);
void kv_seq_drop_page(kv_store *s, kv_seq *q, int i);

/* index.c */
void kv_index_remove(kv_store *s, kv_page *p);
int kv_index_insert(kv_store *s, kv_page *p);
kv_page *kv_index_find(const kv_store *s, km_pagehash h);

/* evict.c */
/* Moves or drops cached pages of (shard, tier) until `need` more bytes fit under `limit`. */
int kv_make_room(kv_store *s, int shard, kv_tier t, size_t need, size_t limit);
int kv_demote(kv_store *s, kv_page *p);
void kv_enforce_watermarks(kv_store *s, int shard);
int kv_seq_apply_policy(kv_store *s, kv_seq *q);

/* tier.c */
int kv_promoter_start(kv_store *s);
void kv_promoter_stop(kv_store *s);
void kv_promo_submit(kv_store *s, kv_promo *job);
void kv_promo_reap(kv_store *s);
void kv_seq_wait_promo(kv_store *s, kv_seq *q);

/* disk.c */
int kv_disk_open(kv_store *s, km_errbuf *err);
int kv_disk_write(kv_store *s, kv_page *p);
int kv_disk_read(kv_store *s, kv_page *p, uint8_t *dst);
void kv_disk_unlink(kv_store *s, kv_page *p);
int kv_disk_enabled(const kv_store *s);

/* events.c */
void kv_event_emit(kv_store *s, kv_event_kind kind, const kv_page *p, kv_tier from, kv_tier to);
void kv_events_free(kv_store *s);

#endif
