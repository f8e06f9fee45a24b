/*
 * store.c — the top of kvshard: a store is created here (configuration checked, every layer set
 * up in order: layouts, shards and budgets, the disk tier re-indexed, the promoter started) and
 * destroyed here, the reverse way. Every other public call is written in the file of the layer
 * it belongs to (docs/kvshard.md, "Layers"); nothing below calls into this file.
 */
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

/* Byte offsets of K, V and their scales of every (layer, head) in every format, so that a view
 * (kv_seq_view) is a table read. */
static void kv_view_offsets_init(kv_store *s)
{
    size_t nv = (size_t)s->n_layers * s->n_heads;
    for (size_t lh = 0; lh < nv; lh++)
        for (int f = 0; f < KV_FORMAT_COUNT; f++) {
            const kv_layout *L = &s->lay[f];
            size_t *o = s->view_offs + (lh * KV_FORMAT_COUNT + f) * 4, base = lh * L->unit;
            o[0] = base;
            o[1] = base + L->kd;
            o[2] = base + L->kd + L->vd;
            o[3] = base + L->kd + L->vd + L->ks;
        }
}

/* Each shard's format, policy and budgets: its own kv_shard_config, or an equal share. */
static int kv_shards_init(kv_store *s, const kv_config *c, km_errbuf *err)
{
    for (int i = 0; i < s->n_shards; i++) {
        kv_shard *sh = &s->shards[i];
        const kv_shard_config *sc = c->shards ? &c->shards[i] : NULL;
        sh->format = sc ? sc->format : c->format;
        sh->evict = sc ? sc->evict : c->evict;
        sh->t[KV_TIER_HOT].budget =
            sc && sc->hot_bytes ? sc->hot_bytes : c->hot_bytes / s->n_shards;
        sh->t[KV_TIER_HOST].budget =
            sc && sc->host_bytes ? sc->host_bytes : c->host_bytes / s->n_shards;
        sh->t[KV_TIER_DISK].budget =
            c->disk_dir ? (sc && sc->disk_bytes ? sc->disk_bytes : c->disk_bytes / s->n_shards) : 0;
        if (!kv_format_valid(sh->format) || !s->lay[sh->format].unit)
            return km_errf(err, KM_EUNSUPPORTED, "kv format %s needs an even head_dim (got %d)",
                           kv_format_name(sh->format), s->hd);
        if (sh->t[KV_TIER_HOT].budget < kv_format_bytes(s, KN_KV_F16))
            return km_errf(err, KM_EINVAL,
                           "hot_bytes=%zu gives shard %d less than one page of %zu bytes",
                           sh->t[KV_TIER_HOT].budget, i, kv_format_bytes(s, KN_KV_F16));
    }
    return 0;
}

int kv_store_create(const kv_config *cfg, kv_store **out, km_errbuf *err)
{
    *out = NULL;
    kv_config c = *cfg;
    if (c.page_tokens == 0) c.page_tokens = 16;
    if (c.page_tokens < 1 || (c.page_tokens & (c.page_tokens - 1)) || c.page_tokens > 4096)
        return km_errf(err, KM_EINVAL, "page_tokens=%d must be a power of two <= 4096",
                       c.page_tokens);
    if (c.n_layers <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 || c.head_dim > 1024 ||
        c.n_layers > 4096 || c.n_kv_heads > 4096)
        return km_errf(err, KM_EINVAL, "bad model shape layers=%d kv_heads=%d head_dim=%d",
                       c.n_layers, c.n_kv_heads, c.head_dim);
    if (!kv_format_valid(c.format))
        return km_errf(err, KM_EINVAL, "kv format %d is unknown", (int)c.format);
    if (c.n_shards == 0) c.n_shards = 1;
    if (c.n_shards < 1 || c.n_shards > 1024)
        return km_errf(err, KM_EINVAL, "n_shards=%d must be in [1, 1024]", c.n_shards);
    if (c.n_tok_groups <= 0) c.n_tok_groups = c.n_shards;
    if (c.n_expert_groups <= 0) c.n_expert_groups = c.n_shards;
    if (c.n_tok_groups > 1 << 16 || c.n_expert_groups > 1 << 16)
        return km_errf(err, KM_EINVAL, "n_tok_groups=%d, n_expert_groups=%d: at most 65536",
                       c.n_tok_groups, c.n_expert_groups);
    if (c.high_watermark <= 0.0f || c.high_watermark > 1.0f) c.high_watermark = 0.8f;
    if (c.event_capacity <= 0) c.event_capacity = 65536;
    if (c.disk_dir && !c.disk_bytes) c.disk_bytes = (size_t)1 << 30;

    kv_store *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "kv store: out of memory");
    s->cfg = c;
    s->cfg.shards = NULL;
    s->cfg.disk_dir = NULL;
    s->pt = c.page_tokens;
    s->n_layers = c.n_layers;
    s->n_heads = c.n_kv_heads;
    s->hd = c.head_dim;
    s->rows_full = (uint32_t)c.n_layers * (uint32_t)c.page_tokens;
    s->n_shards = c.n_shards;
    s->high_wm = c.high_watermark;
    s->low_wm = c.high_watermark > 0.1f ? c.high_watermark - 0.05f : c.high_watermark / 2;
    s->ops = kn_ops_best();
    s->next_uid = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_job, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    for (int f = 0; f < KV_FORMAT_COUNT; f++)
        kv_layout_init(&s->lay[f], (kv_format)f, s->pt, s->hd, s->n_layers, s->n_heads);

    int rc = 0;
    s->shards = calloc((size_t)s->n_shards, sizeof(kv_shard));
    if (c.shard_key == KV_SHARD_KEY_EXPERT &&
        !(s->groups = calloc((size_t)c.n_expert_groups, sizeof(kv_group)))) {
        rc = km_errf(err, KM_ENOMEM, "kv store: out of memory");
        goto fail;
    }
    s->ev = calloc((size_t)c.event_capacity, sizeof(kv_event));
    s->ev_cap = c.event_capacity;
    s->n_buckets = 1024;
    s->buckets = calloc(s->n_buckets, sizeof(kv_page *));
    s->fscratch = malloc(sizeof(float) * 2 * (size_t)s->pt * s->hd);
    size_t nv = (size_t)s->n_layers * s->n_heads;
    s->view_offs = malloc(sizeof(size_t) * nv * KV_FORMAT_COUNT * 4);
    if (!s->shards || !s->ev || !s->buckets || !s->fscratch || !s->view_offs) {
        rc = km_errf(err, KM_ENOMEM, "kv store: out of memory");
        goto fail;
    }
    kv_view_offsets_init(s);
    if ((rc = kv_shards_init(s, &c, err))) goto fail;
    if (c.arena && (rc = kv_arena_create(s, err))) goto fail;
    if (c.disk_dir) {
        s->disk_dir = strdup(c.disk_dir);
        if (!s->disk_dir) {
            rc = km_errf(err, KM_ENOMEM, "kv store: out of memory");
            goto fail;
        }
        if ((rc = kv_disk_open(s, err))) goto fail;
        kv_index_relink(s);
        kv_disk_trim(s);
    }
    if (!c.sync_promote && (rc = kv_promoter_start(s))) {
        km_errf(err, rc, "kv store: cannot start the promoter thread");
        goto fail;
    }
    *out = s;
    return 0;
fail:
    kv_store_destroy(s);
    return rc;
}

void kv_store_destroy(kv_store *s)
{
    if (!s) return;
    kv_promoter_stop(s);
    kv_promo_reap(s);
    kv_xfer_free(s);
    while (s->seqs) kv_seq_destroy(s, s->seqs);
    for (size_t b = 0; b < s->n_buckets && s->buckets; b++) {
        kv_page *p = s->buckets[b];
        while (p) {
            kv_page *n = p->hnext;
            if (p->buf) kv_buf_put(s, p->buf, p->format);
            free(p->tokens);
            free(p->slice_sum);
            free(p);
            p = n;
        }
    }
    for (int f = 0; f < KV_FORMAT_COUNT; f++) {
        for (int i = 0; i < s->n_free_bufs[f]; i++) free(s->free_bufs[f][i]);
        free(s->free_bufs[f]);
    }
    for (int i = 0; i < s->n_sum_slabs; i++) {
        free(s->sum_slabs[i].base);
        free(s->sum_slabs[i].ok);
    }
    free(s->sum_slabs);
    free(s->sum_free);
    free(s->buckets);
    free(s->fscratch);
    free(s->view_offs);
    free(s->shards);
    free(s->groups);
    free(s->disk_dir);
    kv_arena_destroy(s);
    kv_events_free(s);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_job);
    pthread_cond_destroy(&s->cv_done);
    free(s);
}
