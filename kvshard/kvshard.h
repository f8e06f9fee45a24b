/*
 * kvshard.h — the KV store: pages holding the K and V of `page_tokens` consecutive tokens for
 * every layer, the page tables of the sequences that use them, a prefix index that lets a new
 * request reuse the pages of an earlier one, shards, tiers (hot, host RAM, disk), eviction and
 * an event stream for the router. Design notes: docs/kvshard.md.
 *
 * Contract:
 *  - A page holds, for every layer l and kv head h, a K block and a V block of
 *    [page_tokens][head_dim] elements in the page's format (f16, bf16, fp8, int8, int4), plus the
 *    format's scales. Pages are reference counted: a full page may be shared by many sequences;
 *    a partial page belongs to one sequence and is copied before a second one writes to it.
 *  - Running out of memory for pages is KM_ENOSPC, an ordinary result the scheduler acts on
 *    (preempt, demote, evict); the store never aborts on it, and a failed call leaves the
 *    sequence as it was.
 *  - kv_seq_write and kv_seq_view never allocate and may be called from many threads at once for
 *    distinct (sequence, position) pairs. Every other call changes structure and must not run
 *    concurrently with any call on the same store (the worker calls them between steps).
 *  - The attention kernels read pages in place through kn_kv_view (kernels/kernels.h); f16 is
 *    the default format and its pages and views are bit-for-bit what the engine has always read.
 *  - Prefix reuse is verified: a page is reused only when its stored token ids equal the
 *    request's, so a hash collision can never serve another prompt's KV. Pages hashed under
 *    different seeds (model, cluster seed, cache_salt) never meet.
 *  - Pages on disk are written atomically (temporary file, fsync, rename) with a checksum that
 *    is verified on every read; a page that fails is dropped (and counted), never served. With a
 *    cluster secret (kv_config.disk_secret) their token ids and KV are also encrypted and
 *    authenticated (sealed), so no other local account reads them and a page written by anyone
 *    without the secret is dropped (and counted) too. The directory is the worker's alone
 *    (0700, files 0600); one that others may write is refused at open.
 *  - Every page the index gains, loses or moves between tiers yields a kv_event with a
 *    per-store sequence number (a gap means events were dropped: ask for a snapshot).
 */
#ifndef KVSHARD_H
#define KVSHARD_H

#include <stddef.h>
#include <stdint.h>

#include "common/km.h"
#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef kn_kv_format kv_format;
#define KV_FORMAT_COUNT 5

/* Same values as km_tier of common/svc.h. */
typedef enum kv_tier { KV_TIER_HOT = 0, KV_TIER_HOST = 1, KV_TIER_DISK = 2, KV_TIER_COUNT } kv_tier;

typedef enum kv_shard_key {
    KV_SHARD_KEY_HASH = 0,   /* hash of (sequence, page index): uniform, for dense models */
    KV_SHARD_KEY_EXPERT = 1, /* PiKV: (page index mod N_tok) xor (expert mod N_exp) */
} kv_shard_key;

typedef enum kv_evict_policy {
    KV_EVICT_LRU = 0,          /* idle longest first */
    KV_EVICT_LRU_PRIORITY = 1, /* recency plus frequency; shared prefix pages last */
} kv_evict_policy;

/* Lossy policies inside one running sequence: off unless asked for. */
typedef enum kv_seq_policy_kind {
    KV_SEQ_KEEP_ALL = 0,
    KV_SEQ_STREAMING = 1, /* keep the first sink_pages and the last window_pages */
    KV_SEQ_H2O = 2,       /* keep the window and the pages with the most accumulated attention */
} kv_seq_policy_kind;

typedef struct kv_seq_policy {
    kv_seq_policy_kind kind;
    int sink_pages;   /* streaming: pages kept from the start */
    int window_pages; /* pages kept from the end (the partial page not counted) */
    int budget_pages; /* h2o: full pages kept in all (heavy hitters + window) */
} kv_seq_policy;

/* One shard's settings; when kv_config.shards is NULL every shard gets an equal share of
 * hot_bytes/host_bytes/disk_bytes and the store's format and evict policy. */
typedef struct kv_shard_config {
    size_t hot_bytes, host_bytes, disk_bytes;
    kv_format format;
    kv_evict_policy evict;
} kv_shard_config;

typedef struct kv_config {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int page_tokens;  /* power of two; 0 means 16 */
    kv_format format; /* KN_KV_F16 by default */
    size_t hot_bytes; /* byte budget of the hot tier (all shards together) */
    /* Everything below is optional: zero means the default. */
    int n_shards;                  /* 0: 1 */
    kv_shard_key shard_key;        /* hash */
    int n_tok_groups;              /* PiKV N_tok; 0: n_shards */
    int n_expert_groups;           /* PiKV N_exp; 0: n_shards */
    kv_evict_policy evict;         /* lru */
    const kv_shard_config *shards; /* [n_shards] or NULL */
    size_t host_bytes;             /* host-RAM tier budget; 0: no host tier */
    const char *disk_dir; /* disk tier directory (created if missing); NULL: no disk tier */
    /* The cluster secret (KM_SECRET_BYTES, common/sec.h), read at create only: disk pages carry
     * a keyed MAC and a page without a valid one is dropped, never served. NULL: checksum only. */
    const uint8_t *disk_secret;
    size_t disk_bytes;    /* disk tier budget; 0 with a disk_dir: 1 GiB */
    float high_watermark; /* fraction of a tier's budget that triggers demotion; 0: 0.8 */
    int event_capacity;   /* events kept until drained; 0: 65536 */
    int sync_promote;     /* 1: promotion completes inside kv_seq_attach (no thread) */
    /* 1: every RAM page buffer (hot and host tiers) is cut from one region reserved at create,
     * which a transfer layer registers once (kv_store_mem_regions); 0: buffers from malloc. */
    int arena;
    size_t arena_bytes; /* region size; 0: 1.25 x (hot + host budgets) + a few slabs */
    /* 1: every full page keeps a key summary for sparse attention (kv_seq_summaries), in RAM
     * beside the page whatever its tier: 2 x n_layers x n_kv_heads x head_dim f16 a page. */
    int summaries;
    /* 1: kv_seq_attach leaves a prefix's host and disk pages where they are, held by the
     * sequence, and a step brings up only the pages it reads (kv_seq_fetch; sparse attention). */
    int promote_selected;
    /* With promote_selected: layer slices a step may read of a page on host RAM (in place) or
     * on disk (one layer of its file, verified against a checksum kept in RAM) before the page
     * comes up whole; 0: it comes up whole at its first read (kv_seq_fetch). */
    int fetch_slices;
} kv_config;

typedef struct kv_store kv_store;
typedef struct kv_seq kv_seq;

int kv_store_create(const kv_config *cfg, kv_store **out, km_errbuf *err);
/* Waits for background promotions, then frees everything (disk pages stay on disk). */
void kv_store_destroy(kv_store *s);

/* Bytes of a page in the store's format (kv_format_page_bytes for others). */
size_t kv_store_page_bytes(const kv_store *s);
size_t kv_store_format_page_bytes(const kv_store *s, kv_format f);
int kv_store_page_tokens(const kv_store *s);
/* Hot-tier capacity and free room, in pages of the store's format. */
int kv_store_pages_total(const kv_store *s);
int kv_store_pages_free(const kv_store *s);
const char *kv_format_name(kv_format f);
/* Parses "f16", "bf16", "fp8", "int8", "int4". */
int kv_format_parse(const char *s, kv_format *out);
const char *kv_tier_name(kv_tier t);
const char *kv_evict_policy_name(kv_evict_policy p);

/* ---------------------------------------------------------------- sequences */

/* A new, empty sequence. */
int kv_seq_create(kv_store *s, kv_seq **out);
/* Releases the sequence's references to its pages; indexed pages stay cached for reuse. */
void kv_seq_destroy(kv_store *s, kv_seq *q);
/* A new sequence sharing every page of src (the partial last page is copied on first write). */
int kv_seq_fork(kv_store *s, const kv_seq *src, kv_seq **out);
/* Number of positions the sequence has pages for (a multiple of page_tokens). */
int kv_seq_capacity(const kv_seq *q);
/* Ensures pages exist for positions [0, n_tokens) and that the pages holding the positions
 * from the end of the previous reserve (or n_tokens-1) up to n_tokens-1 are private and
 * writable (copy-on-write when shared or published): reserve before writing, as the engine does.
 * Also seals the sequence's completed int4 pages and applies its lossy policy. KM_ENOSPC when
 * the shard cannot make room (the sequence keeps what it had). */
int kv_seq_reserve(kv_store *s, kv_seq *q, int n_tokens);
/* Same, placing new pages by the caller's expert id (shard key `expert`; MoE engines). */
int kv_seq_reserve_expert(kv_store *s, kv_seq *q, int n_tokens, int expert);
/* Places the page holding position pos by the expert its tokens were routed to (an MoE engine's
 * report, e.g. the most frequent first choice of its tokens), once they are computed and before
 * kv_seq_publish: the page is tagged with the expert (counted in its group, kv_group_stats, from
 * then on) and, if private and hot, moved to the shard the `expert` key gives (room made there as
 * for a new page). A page already tagged, or under the `hash` key, is left as it is; one that
 * cannot move (shared, indexed, a shard of another format, no room) keeps its shard and is
 * counted in kv_store_stats.place_fallbacks. Returns the page's shard, or KM_EINVAL/KM_ERANGE. */
int kv_seq_place(kv_store *s, kv_seq *q, int pos, int expert);
/* Drops the pages past the one holding position n_tokens-1. */
void kv_seq_truncate(kv_store *s, kv_seq *q, int n_tokens);
/* Lossy in-sequence policy (default: keep all). */
int kv_seq_set_policy(kv_store *s, kv_seq *q, const kv_seq_policy *p);
/* Pages dropped by the lossy policy so far. */
int kv_seq_dropped_pages(const kv_seq *q);
/* on != 0: the pages q publishes from now are position-free, a chunk's (docs/blend.md): their
 * KV was computed apart from any prompt and is reused at other positions. The flag stays with
 * the indexed page on every tier, is counted (kv_store_stats.position_free_pages) and is carried
 * by its events (kv_event.position_free). */
void kv_seq_set_position_free(kv_seq *q, int on);

/* Stores token `pos`'s K and V of one layer ([n_kv_heads][head_dim] each) into its page,
 * quantizing to the page's format. */
void kv_seq_write(kv_store *s, kv_seq *q, int layer, int pos, const float *k, const float *v);
/* Describes (layer, kv_head) of the sequence's first n_ctx positions for the attention kernel.
 * Waits, when the sequence's prefix is being promoted, until that layer has arrived. */
void kv_seq_view(const kv_store *s, const kv_seq *q, int layer, int kv_head, int n_ctx,
                 kn_kv_view *out);
/* Key summaries (kv_config.summaries; docs/sparse.md): for each (layer, kv head) of a page, the
 * minimum and maximum of every key channel over the page's tokens, as attention reads them (after
 * quantization), in f16 rounded outward (the minimum down, the maximum up, so they still bound
 * the keys). kv_seq_reserve gives the sequence's pages their summary buffers and computes the
 * summaries of full pages that lack one (pages attached, imported, re-encoded); the engine
 * computes a page's summary for a layer as soon as its last row of that layer is written:
 * kv_seq_summarize, for the page holding pos, once every row of it is (any thread, distinct
 * pages; it allocates nothing). kv_seq_summaries points out[i] at page i's block of (layer,
 * kv_head), min[head_dim] then max[head_dim], or NULL where a page has none (the partial last
 * page, a page not yet summarized): first n_pages pages of the view. */
void kv_seq_summarize(const kv_store *s, kv_seq *q, int layer, int pos);
void kv_seq_summaries(const kv_store *s, const kv_seq *q, int layer, int kv_head, int n_pages,
                      const kn_f16 **out);
/* Reads back token pos of (layer, kv_head) as floats (dequantized): k and v of head_dim. */
int kv_seq_read(const kv_store *s, const kv_seq *q, int layer, int kv_head, int pos, float *k,
                float *v);

/* ---------------------------------------------------------------- prefix reuse */

/* Publishes the sequence's full pages among positions [0, n_tokens) (already written) in the
 * prefix index: page i under hashes[i] with tokens[i*pt, (i+1)*pt). hashes come from
 * km_pagehash_chain. Pages already published are skipped; a hash already held by another page
 * keeps the older page and ends publishing there, unless that page is an orphan (its parent is
 * gone, so no lookup reaches it): then it and what hangs from it are replaced. Returns the number
 * of pages newly indexed. */
int kv_seq_publish(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                   int n_tokens);

/* The longest cached prefix: how many leading pages of the chain are held, each verified
 * against its token ids; tiers[i] (may be NULL) receives each page's tier. */
int kv_store_lookup(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                    kv_tier *tiers);
/* 1 when the indexed page h is position-free (kv_seq_set_position_free: a chunk's), else 0. */
int kv_store_position_free(const kv_store *s, km_pagehash h);
/* The same answer without counting a hit or a miss: what a transfer asks before it pulls. */
int kv_store_held(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                  kv_tier *tiers);

/* Gives an empty sequence the longest cached, verified prefix (at most n_pages pages): pages on
 * host or disk are promoted to the hot tier, host ones asynchronously layer by layer (views wait
 * for their layer). Returns the number of pages attached (0 is a miss), KM_ENOSPC when the hot
 * tier has no room. */
int kv_seq_attach(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                  int n_pages);
/* Blocks until the sequence's pending promotion has finished. */
void kv_seq_wait_ready(const kv_store *s, const kv_seq *q);
/* Pages of the sequence's table not on the hot tier (only kv_config.promote_selected leaves any:
 * they are on host RAM, where a view may read them in place, or on disk, where it must not). */
int kv_seq_cold_pages(const kv_seq *q);
/* Whether kv_seq_view of that layer would return at once (no promotion of the sequence is still
 * copying it). Hot path. */
int kv_seq_layer_ready(const kv_store *s, const kv_seq *q, int layer);
/* Brings up the listed pages (indexes into the sequence's table) that are not hot, because a step
 * is about to read them from `layer` on: host pages are copied by the promoter thread starting
 * at that layer and going up, so later layers arrive while earlier ones compute; disk pages are
 * read and verified on the promoter thread too. The sequence's views wait for their layer. Pages
 * not listed stay where they are. Without hot room a host page stays on host RAM (read in place)
 * and a disk page comes up over the budget (eviction catches up at the next reserve). A disk page
 * that fails verification reads as zeros for this sequence, is counted corrupt and is never served
 * to another. Returns the number of pages brought up, or KM_ENOMEM. Structural. */
int kv_seq_fetch(kv_store *s, kv_seq *q, int layer, const int *pages, int n);
/* With kv_config.fetch_slices, kv_seq_fetch reads a listed page that has been read fewer times
 * than that since it last came up (or any, while the hot tier has no room for it) as a layer
 * slice instead of bringing it up: a host page in place, a disk page's
 * layer `layer` alone into the sequence's slice buffer (on the promoter thread, verified against
 * the checksums kept when its file was written), which the sequence's views of that layer read
 * until its next kv_seq_fetch of another layer or kv_seq_fetch_end. Counted in
 * kv_store_stats.slice_*. kv_seq_fetch_end waits for the sequence's reads and drops its slices
 * (a step's end; structural). */
void kv_seq_fetch_end(kv_store *s, kv_seq *q);
/* Records that a step read the listed pages of the sequence (pages NULL: pages [0, n)): what
 * kv_seq_demote_idle measures idleness by. Hot path: any thread, between structural calls. */
void kv_seq_touch(const kv_store *s, const kv_seq *q, const int *pages, int n);
/* Ends one step of a sparse sequence: while its shard's hot tier is above the low watermark,
 * its held hot pages that no step touched (kv_seq_touch) in the last `idle` of these calls go
 * down to host RAM, or to disk (where a verified copy is, or can be written); above the high
 * watermark (pages a step read came up over the budget) any of them goes. The last keep_tail
 * pages, pages other sequences hold and pages not indexed stay. They come up again when a step
 * reads them (kv_seq_fetch). Counted in kv_store_stats.held_demoted_*. Returns the pages moved.
 * With kv_config.promote_selected only; structural. */
int kv_seq_demote_idle(kv_store *s, kv_seq *q, int idle, int keep_tail);

/* ---------------------------------------------------------------- formats, eviction, tiers */

/* Converts every page in RAM to format f (f16 <-> fp8/int8/bf16, and int4 for full pages) and
 * makes f the format of new pages: recovery level 2 and its revert. Sequences keep running;
 * views see the new format. Returns the number of pages converted, or KM_ENOSPC (pages converted
 * so far stay converted). */
int kv_store_convert(kv_store *s, kv_format f);

/* Recovery level 1: takes the oldest `fraction` of the hot pages no sequence uses (of the whole
 * store), each chain from its tail (a page goes only after the pages that hang from it, so every
 * page left is reachable), demotes each to a lower tier with room, drops it otherwise. Returns
 * the number of pages moved or dropped. */
int kv_store_evict_oldest_fraction(kv_store *s, double fraction);
/* Brings every tier of every shard below its high watermark (also done by reserve and destroy). */
int kv_store_maintain(kv_store *s);
/* Writes a disk copy of every indexed page held in RAM (hot or host) that has none, parents
 * before children and most recently used first, within the disk budget (older disk-only pages
 * make room) and until deadline_ns (km_now_ns(); 0: none). Pages stay where they are: this is
 * a drain's last step, so that the next process re-indexes them. Returns the number of pages
 * written (0 without a disk tier), or KM_ENOMEM. */
int kv_store_persist(kv_store *s, uint64_t deadline_ns);

typedef struct kv_tier_stats {
    uint64_t pages, bytes, budget;
    /* Of pages/bytes, those held by at least one live sequence (not on the tier's cached,
     * reclaimable list): what eviction cannot free. Hot pages (and host ones under
     * kv_config.promote_selected) can be held; always 0 on disk. Recovery measures pressure with
     * these, since a full warm prefix cache is not. */
    uint64_t pinned_pages, pinned_bytes;
} kv_tier_stats;

typedef struct kv_shard_stats {
    kv_format format;
    kv_evict_policy evict;
    kv_tier_stats tier[KV_TIER_COUNT];
    uint64_t allocs, alloc_failures, evictions, demotions, promotions, hits, misses;
} kv_shard_stats;

typedef enum kv_promote_reason {
    KV_PROMOTE_PREFIX = 0,
    KV_PROMOTE_READ = 1,
    KV_PROMOTE_REASONS
} kv_promote_reason;

typedef struct kv_store_stats {
    int n_shards;
    kv_tier_stats tier[KV_TIER_COUNT];
    uint64_t pages_indexed, hits, misses, collisions, corrupt_pages, converted_pages,
        disk_write_errors, events_dropped, cow_copies, sealed_pages, dropped_seq_pages,
        unauthenticated_pages, /* disk pages dropped for a missing or wrong seal (disk_secret) */
        skipped_files,   /* named like a page at open but not one: not a regular file, too large */
        placed_pages,    /* pages tagged by kv_seq_place */
        place_fallbacks; /* of those, left in their shard (see kv_seq_place) */
    uint64_t arena_fallbacks; /* page buffers that did not fit the arena (taken from malloc) */
    /* Pages brought up to the hot tier, and their bytes, by reason: KV_PROMOTE_PREFIX for a
     * prefix hit or an export (kv_seq_attach), KV_PROMOTE_READ for pages a step reads
     * (kv_seq_fetch); fetch_in_place: host pages a step read where they were (no hot room). */
    uint64_t promoted_pages[KV_PROMOTE_REASONS], promoted_bytes[KV_PROMOTE_REASONS];
    uint64_t fetch_in_place;
    /* kv_config.fetch_slices: layer slices of disk pages read (and their bytes), and of host
     * pages read in place, instead of bringing those pages up whole */
    uint64_t slice_disk_reads, slice_disk_bytes, slice_host_reads;
    /* held pages a sparse sequence stopped reading, sent down (kv_seq_demote_idle) */
    uint64_t held_demoted_pages, held_demoted_bytes;
    /* indexed position-free pages (chunks: kv_seq_set_position_free), by tier */
    uint64_t position_free_pages[KV_TIER_COUNT];
} kv_store_stats;

void kv_store_stats_get(const kv_store *s, kv_store_stats *out);
int kv_store_shard_stats(const kv_store *s, int shard, kv_shard_stats *out);
int kv_store_n_shards(const kv_store *s);
/* Expert groups (shard key `expert`; kv_config.n_expert_groups of them, 0 under `hash`): the
 * pages kv_seq_place tagged with an expert of the group, by tier (occupancy), and counters. */
typedef struct kv_group_stats {
    uint64_t pages[KV_TIER_COUNT];
    uint64_t placed, hits, demotions, evictions; /* hits: prefix hits (kv_seq_attach) */
} kv_group_stats;
int kv_store_n_expert_groups(const kv_store *s);
int kv_store_group_stats(const kv_store *s, int group, kv_group_stats *out);
/* The shard a page lands in under the store's shard key. */
int kv_store_shard_of(const kv_store *s, uint64_t seq_uid, int page_index, int expert);
uint64_t kv_seq_uid(const kv_seq *q);

/* ---------------------------------------------------------------- events */

typedef enum kv_event_kind {
    KV_EVENT_STORED = 0,  /* the page is now indexed, in `tier` */
    KV_EVENT_REMOVED = 1, /* the page is gone from every tier */
    KV_EVENT_TIER = 2,    /* the page moved from `from_tier` to `tier` */
} kv_event_kind;

typedef struct kv_event {
    uint64_t seq; /* per store, +1 per event */
    kv_event_kind kind;
    kv_tier tier, from_tier;
    int shard;
    km_pagehash hash;
    int position_free; /* a chunk's page (kv_seq_set_position_free) */
} kv_event;

/* Moves up to max pending events, oldest first, into out; returns how many. */
int kv_store_events_drain(kv_store *s, kv_event *out, int max);
/* The sequence number the next event will carry. */
uint64_t kv_store_events_next_seq(const kv_store *s);

/* ---------------------------------------------------------------- page transfer support
 * What a transfer layer between stores (peer/peer.h) needs, and nothing about networks:
 *  - the memory to register once: with kv_config.arena every RAM page buffer lies inside one of
 *    kv_store_mem_regions, which stay mapped until kv_store_destroy;
 *  - export: the longest verified prefix of a chain, promoted to hot and pinned for a reader
 *    until kv_export_end or its lease deadline (kv_export_expire); it counts as a prefix hit;
 *  - import: buffers for pages that will arrive, then those the caller verified indexed as if
 *    computed here (a STORED event each); the page checksum both sides compute (kv_xfer_checksum).
 * All are structural calls (the store's owner thread, between steps). Another thread or a NIC
 * may touch a pinned page's bytes meanwhile, so recovery level 2 leaves them where they are
 * (docs/kvshard.md, "Page transfer support"). */

typedef struct kv_mem_region {
    void *base;
    size_t bytes;
} kv_mem_region;

/* Writes up to max regions; returns how many the store has (0 without kv_config.arena). */
int kv_store_mem_regions(const kv_store *s, kv_mem_region *out, int max);

/* One page as it leaves or enters a store. */
typedef struct kv_xfer_page {
    kv_format format;
    int index; /* position in its chain */
    km_pagehash hash, parent;
    const int32_t *tokens; /* page_tokens ids (valid while the export lives) */
    uint8_t *buf;          /* the payload in the store's memory */
    size_t bytes;          /* payload bytes (kv_store_format_page_bytes of format) */
    int region;            /* index into kv_store_mem_regions holding buf; -1: none */
    uint64_t checksum;     /* kv_xfer_checksum (export only) */
} kv_xfer_page;

/* XXH3-64 over a fixed little-endian header (format, page_tokens, index, hash, parent, bytes),
 * the token ids and the payload: a torn, corrupted or relabelled page fails it. The payload is
 * hashed with the CPU's fastest vector unit (kn_ops.xxh3_update; the same value on every). */
uint64_t kv_xfer_checksum(const kv_xfer_page *p, int page_tokens, const void *payload);

/* The same checksum computed as the payload arrives, in pieces and in order (a receiver hashing
 * each fragment while it copies it, so the page is read once): begin with the page's identity,
 * update with consecutive parts of the payload (p->bytes in all), end gives what
 * kv_xfer_checksum would. The state is an XXH3 state; any thread, one state per page. */
typedef struct kv_xfer_sum {
    _Alignas(64) unsigned char st[640];
} kv_xfer_sum;

void kv_xfer_sum_begin(kv_xfer_sum *s, const kv_xfer_page *p, int page_tokens);
void kv_xfer_sum_update(kv_xfer_sum *s, const void *part, size_t n);
uint64_t kv_xfer_sum_end(kv_xfer_sum *s);

/* Pins the longest verified prefix of the chain (at most n_pages) until kv_export_end or
 * lease_deadline_ns (km_now_ns clock). Returns the number of pages pinned (0: nothing held, no
 * id), *id the export's handle; KM_ENOSPC when the hot tier cannot take a promoted page. */
int kv_export_begin(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                    uint64_t lease_deadline_ns, uint64_t *id);
/* Describes pages [first, first + n) of the export, with checksums (computed once per page and
 * format, then cached). KM_EAGAIN while promoted pages are still being copied; KM_ENOTFOUND
 * when the export ended or expired. */
int kv_export_pages(kv_store *s, uint64_t id, int first, int n, kv_xfer_page *out);
/* Unpins; KM_ENOTFOUND when it had already ended or expired. */
int kv_export_end(kv_store *s, uint64_t id);
/* Ends every export whose lease passed now_ns; returns how many. */
int kv_export_expire(kv_store *s, uint64_t now_ns);
/* The chains of cached pages in RAM most worth handing to another store (a draining worker's
 * handoff): chains that end at a page no other page follows, most recently used first, each
 * given root to leaf (hashes and token ids, valid during the call) to fn, until fn returns
 * non-zero or the chains given hold at least max_pages distinct pages. A chain whose root is no
 * longer indexed is skipped (a reader could not verify it). Returns the chains given, or KM_ENOMEM.
 */
typedef int (*kv_chain_fn)(void *arg, const km_pagehash *hashes, const int32_t *tokens,
                           int n_pages);
int kv_store_chains(kv_store *s, int max_pages, kv_chain_fn fn, void *arg);
/* Exports and imports alive (for leak checks and metrics). */
void kv_xfer_counts(const kv_store *s, int *exports, int *imports);

/* Starts an import of a chain: returns how many leading pages the store already holds (k,
 * verified, attached like a request's: promoted and pinned until commit or abort, not counted
 * as a hit or a miss). When k < n_pages, *id is the import. */
int kv_import_begin(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                    uint64_t *id);
/* Destination buffers for chain pages [k, k + n) arriving in formats wire[0..n): out[i].buf
 * (bytes, format, region) is where page k + i's payload goes. Returns how many were reserved
 * (fewer when the hot tier ran out; KM_ENOSPC when none). Call at most once per import. */
int kv_import_reserve(kv_store *s, uint64_t id, int n, const kv_format *wire, kv_xfer_page *out);
/* Indexes reserved pages [k, k + n_ok), which the caller has verified, converting those that
 * arrived in another format; the rest are released. Returns the pages newly indexed (a page
 * that was computed here meanwhile keeps its place and ends the chain there). */
int kv_import_commit(kv_store *s, uint64_t id, int n_ok);
/* 1 when every value of a page of format f at buf (a page of this store's shape, as it arrived
 * from a peer) is a number: no infinity or NaN in its values or its scales; 0 otherwise, a page
 * the caller must not commit. Reads only the store's immutable layout: any thread may call it,
 * e.g. a transfer's progress thread while the page it just landed is still in the cache. */
int kv_page_finite(const kv_store *s, const uint8_t *buf, kv_format f);
/* Releases everything of the import. */
void kv_import_abort(kv_store *s, uint64_t id);
/* The import's pages are a chunk's: indexed position-free (kv_seq_set_position_free). */
int kv_import_set_position_free(kv_store *s, uint64_t id);

#ifdef __cplusplus
}
#endif
#endif /* KVSHARD_H */
