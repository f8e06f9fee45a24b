/*
 * convert.c — recovery level 2 and its revert: every page in RAM re-encoded into another format
 * (f16 -> fp8 halves the KV bytes), and the format of new pages switched, while sequences keep
 * running between steps. The per-page encodings are format.c's; this file finds every page (from
 * the sequences' tables and the cached lists), makes room where a page grows (evict.c) and
 * refreshes the sequences' tables (seq.c), so it sits at the top with tier.c and store.c.
 *
 * A page that has a disk copy loses it: the copy is in the old format and the page is now the
 * authority. Reverting converts back to f16 (the values stay the fp8-rounded ones).
 */
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

/* Puts the new buffer in place of the old one; a disk copy in the old format is dropped. */
static void kv_convert_swap(kv_store *s, kv_page *p, uint8_t *nb, kv_format f)
{
    kv_buf_put(s, p->buf, p->format);
    if (p->flags & KV_PAGE_ON_DISK) kv_disk_unlink(s, p);
    p->buf = nb;
    p->format = f;
    kv_page_sum_clear(s, p);
}

/* A page a sequence holds (so hot): a page that grows makes room like any allocation. */
static int kv_convert_held(kv_store *s, kv_page *p, kv_format f)
{
    uint8_t *nb;
    if (s->lay[f].page_bytes > s->lay[p->format].page_bytes) {
        int rc = kv_hot_alloc(s, p->shard, f, &nb);
        if (rc) return rc;
    } else {
        if (!(nb = kv_buf_get(s, f))) return KM_ENOMEM;
        kv_acct_add(s, p->shard, KV_TIER_HOT, f, 1);
    }
    kv_page_convert(s, p->buf, p->format, nb, f);
    kv_acct_sub(s, p->shard, KV_TIER_HOT, p->format);
    kv_convert_swap(s, p, nb, f);
    return 0;
}

/* A cached page of the hot or host tier: converted within its tier's budget, evicting nothing. */
static int kv_convert_cached(kv_store *s, kv_page *p, kv_format f)
{
    kv_tier_acct *a = &s->shards[p->shard].t[p->tier];
    size_t nbytes = s->lay[f].page_bytes, obytes = s->lay[p->format].page_bytes;
    uint8_t *nb = kv_buf_get(s, f);
    if (!nb) return KM_ENOMEM;
    if (nbytes > obytes && a->used - obytes + nbytes > a->budget) {
        kv_buf_put(s, nb, f);
        return KM_ENOSPC;
    }
    kv_page_convert(s, p->buf, p->format, nb, f);
    kv_acct_sub(s, p->shard, p->tier, p->format);
    kv_acct_add(s, p->shard, p->tier, f, 1);
    a->cached_bytes += kv_list_bytes(s, p->tier, f);
    a->cached_bytes -= kv_list_bytes(s, p->tier, p->format);
    kv_convert_swap(s, p, nb, f);
    return 0;
}

int kv_store_convert(kv_store *s, kv_format f)
{
    if ((unsigned)f >= KV_FORMAT_COUNT || !s->lay[f].unit) return KM_EINVAL;
    for (kv_seq *q = s->seqs; q; q = q->next) kv_seq_wait_promo(s, q);
    kv_promo_reap(s);
    for (int i = 0; i < s->n_shards; i++) s->shards[i].format = f;
    int converted = 0, rc = 0;
    /* Every page in RAM is reachable either from a sequence or from a cached list. */
    for (kv_seq *q = s->seqs; q && !rc; q = q->next)
        for (int i = 0; i < q->n_pages && !rc && !q->lent; i++) { /* lent: a NIC has them */
            kv_page *p = q->pg[i];
            if (p->format == f) continue;
            uint32_t rows = atomic_load_explicit(&p->rows, memory_order_relaxed);
            if (f == KN_KV_INT4 && rows < s->rows_full) continue; /* sealed when full */
            if (!(rc = kv_convert_held(s, p, f))) converted++;
        }
    for (int sh = 0; sh < s->n_shards && !rc; sh++)
        for (int t = KV_TIER_HOT; t <= KV_TIER_HOST && !rc; t++)
            for (kv_page *p = s->shards[sh].t[t].head; p && !rc; p = p->lnext) {
                if (p->format == f) continue;
                if (!(rc = kv_convert_cached(s, p, f))) converted++;
            }
    kv_refresh_all(s);
    s->st.converted_pages += (uint64_t)converted;
    return rc ? rc : converted;
}
