/*
 * kvshard.h — the KV store: a pool of fixed-size pages holding the K and V of `page_tokens`
 * consecutive tokens for every layer, and the page tables of the sequences that use them.
 *
 * Contract:
 *  - A page holds, for every layer l and kv head h, a K block and a V block of
 *    [page_tokens][head_dim] elements in the store's format. Pages are reference counted: a full
 *    page may be shared by many sequences; a partial page belongs to one sequence.
 *  - Running out of pages is KM_ENOSPC, an ordinary result the scheduler acts on (preempt,
 *    demote); the store never aborts on it.
 *  - kv_seq_reserve allocates; kv_seq_write and kv_seq_view never allocate and may be called
 *    from many threads at once for distinct positions.
 *  - The attention kernels read pages in place through kn_kv_view (kernels/kernels.h).
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

typedef struct kv_config {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int page_tokens;  /* power of two; 0 means 16 */
    kv_format format; /* KN_KV_F16 by default */
    size_t hot_bytes; /* byte budget of the hot tier; the pool holds hot_bytes / page bytes */
} kv_config;

typedef struct kv_store kv_store;
typedef struct kv_seq kv_seq;

int kv_store_create(const kv_config *cfg, kv_store **out, km_errbuf *err);
void kv_store_destroy(kv_store *s);

size_t kv_store_page_bytes(const kv_store *s);
int kv_store_page_tokens(const kv_store *s);
int kv_store_pages_total(const kv_store *s);
int kv_store_pages_free(const kv_store *s);
const char *kv_format_name(kv_format f);
/* Parses "f16", "bf16", "fp8", "int8", "int4". */
int kv_format_parse(const char *s, kv_format *out);

/* A new, empty sequence. */
int kv_seq_create(kv_store *s, kv_seq **out);
/* Releases the sequence's references to its pages. */
void kv_seq_destroy(kv_store *s, kv_seq *q);
/* Number of positions the sequence has pages for (a multiple of page_tokens). */
int kv_seq_capacity(const kv_seq *q);
/* Ensures pages exist for positions [0, n_tokens). KM_ENOSPC when the pool is exhausted (the
 * sequence keeps what it had). */
int kv_seq_reserve(kv_store *s, kv_seq *q, int n_tokens);
/* Drops the pages past the one holding position n_tokens-1. */
void kv_seq_truncate(kv_store *s, kv_seq *q, int n_tokens);

/* Stores token `pos`'s K and V of one layer ([n_kv_heads][head_dim] each) into its page. */
void kv_seq_write(kv_store *s, kv_seq *q, int layer, int pos, const float *k, const float *v);
/* Describes (layer, kv_head) of the sequence's first n_ctx positions for the attention kernel. */
void kv_seq_view(const kv_store *s, const kv_seq *q, int layer, int kv_head, int n_ctx,
                 kn_kv_view *out);

#ifdef __cplusplus
}
#endif
#endif /* KVSHARD_H */
