/*
 * promote.c — the copy of host-tier pages to the hot tier on a prefix hit (tier.c decides
 * which), done by one background thread per store, layer by layer: a page's layer l is one
 * contiguous range
 * ([l * n_kv_heads * unit, (l+1) * n_kv_heads * unit)), so after copying layer l of every page
 * of the job the thread publishes ready_layers = l + 1 and the engine's views of layer l proceed
 * while layer l + 1 is still on its way (kv_seq_view waits only for the layer it needs).
 *
 * The thread touches nothing but the job's buffers and the sequence's ready counter; the store's
 * structure (accounting, lists, freeing the host copies) is updated by the owner's next
 * structural call (kv_promo_reap), so the store needs no lock on its hot path.
 *
 * A job may also hold disk pages (kv_seq_fetch: the pages a sparse step reads): the thread reads
 * and verifies those first, through the reader tier.c hands it, then copies the host pages from
 * the layer the step is at, upward, wrapping round to the layers below it (q->ready_first).
 * A disk entry with a layer (kv_config.fetch_slices) is that layer's slice alone, read into the
 * sequence's slice buffer: its page stays on disk and is not the job's to mark or free.
 *
 * Layer: a copy engine over page memory (it calls page.c only, to free the host copies), so every
 * layer above may wait for it before it restructures a sequence.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

kv_promo *kv_promo_new(int n_pages)
{
    kv_promo *job = calloc(1, sizeof *job);
    if (!job || !n_pages) return job;
    job->src = malloc(sizeof(uint8_t *) * n_pages);
    job->dst = malloc(sizeof(uint8_t *) * n_pages);
    job->bytes = malloc(sizeof(size_t) * n_pages);
    job->fmt = malloc(sizeof(kv_format) * n_pages);
    job->pages = malloc(sizeof(kv_page *) * n_pages);
    job->rc = calloc((size_t)n_pages, sizeof(int));
    job->layer = malloc(sizeof(int) * n_pages);
    if (!job->src || !job->dst || !job->bytes || !job->fmt || !job->pages || !job->rc ||
        !job->layer) {
        kv_promo_free(job);
        return NULL;
    }
    return job;
}

void kv_promo_free(kv_promo *job)
{
    if (!job) return;
    free(job->src);
    free(job->dst);
    free(job->bytes);
    free(job->fmt);
    free(job->pages);
    free(job->rc);
    free(job->layer);
    free(job);
}

static void kv_promo_copy(kv_store *s, kv_promo *job)
{
    for (int j = 0; j < job->n; j++) {
        if (job->src[j]) continue;
        job->rc[j] = job->read(s, job->pages[j], job->layer[j], job->dst[j]);
        if (job->rc[j]) memset(job->dst[j], 0, job->bytes[j]); /* nothing unverified is read */
    }
    for (int k = 0; k < s->n_layers; k++) {
        const int l = (job->first + k) % s->n_layers;
        for (int j = 0; j < job->n; j++) {
            if (!job->src[j]) continue;
            size_t per = s->lay[job->fmt[j]].unit * s->n_heads, off = per * l;
            memcpy(job->dst[j] + off, job->src[j] + off, per);
        }
        pthread_mutex_lock(&s->mu);
        atomic_store_explicit(&job->q->ready_layers, k + 1, memory_order_release);
        pthread_cond_broadcast(&s->cv_done);
        pthread_mutex_unlock(&s->mu);
    }
}

static void *kv_promoter_main(void *arg)
{
    kv_store *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->jobs && !s->promoter_stop) pthread_cond_wait(&s->cv_job, &s->mu);
        kv_promo *job = s->jobs;
        if (!job) break;
        s->jobs = job->next;
        if (!s->jobs) s->jobs_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        kv_promo_copy(s, job);
        pthread_mutex_lock(&s->mu);
        job->done = 1;
        job->next = s->done_jobs;
        s->done_jobs = job;
        pthread_cond_broadcast(&s->cv_done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int kv_promoter_start(kv_store *s)
{
    if (pthread_create(&s->promoter, NULL, kv_promoter_main, s)) return KM_ENOMEM;
    s->promoter_started = 1;
    return 0;
}

void kv_promoter_stop(kv_store *s)
{
    if (!s->promoter_started) return;
    pthread_mutex_lock(&s->mu);
    s->promoter_stop = 1; /* queued jobs are finished first */
    pthread_cond_broadcast(&s->cv_job);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->promoter, NULL);
    s->promoter_started = 0;
}

void kv_promo_submit(kv_store *s, kv_promo *job)
{
    if (!s->promoter_started) {
        kv_promo_copy(s, job);
        job->done = 1;
        job->next = s->done_jobs;
        s->done_jobs = job;
        return;
    }
    pthread_mutex_lock(&s->mu);
    job->next = NULL;
    if (s->jobs_tail)
        s->jobs_tail->next = job;
    else
        s->jobs = job;
    s->jobs_tail = job;
    pthread_cond_signal(&s->cv_job);
    pthread_mutex_unlock(&s->mu);
}

void kv_promo_reap(kv_store *s)
{
    pthread_mutex_lock(&s->mu);
    kv_promo *job = s->done_jobs;
    s->done_jobs = NULL;
    pthread_mutex_unlock(&s->mu);
    while (job) {
        kv_promo *next = job->next;
        for (int j = 0; j < job->n; j++) {
            kv_page *p = job->pages[j];
            const int slice = job->layer[j] >= 0;
            assert(slice ? p->tier == KV_TIER_DISK : p->promoting && p->tier == KV_TIER_HOT);
            if (job->src[j]) kv_buf_put(s, job->src[j], job->fmt[j]);
            if (job->rc[j]) { /* reads as zeros for its sequence, and is never served again */
                s->st.corrupt_pages++;
                p->flags |= KV_PAGE_BAD;
                p->flags &= ~KV_PAGE_SLICES;
                KM_WARN("kv_disk_page_rejected", "page=%llu fetched=1 layer=%d",
                        (unsigned long long)p->id, job->layer[j]);
            }
            if (!slice) p->promoting = 0;
        }
        job->q->promo_pending = 0;
        kv_promo_free(job);
        job = next;
    }
}

void kv_seq_wait_promo(kv_store *s, kv_seq *q)
{
    if (!q->promo_pending) return;
    kv_seq_wait_ready(s, q);
    /* The job is on the done list once ready_layers is final; reap it. */
    pthread_mutex_lock(&s->mu);
    for (;;) {
        int found = 0;
        for (kv_promo *j = s->done_jobs; j; j = j->next) found |= j->q == q;
        if (found) break;
        pthread_cond_wait(&s->cv_done, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    kv_promo_reap(s);
}

void kv_seq_wait_ready(const kv_store *s, const kv_seq *q)
{
    if (!q->promo_pending) return;
    kv_store *ms = (kv_store *)s;
    kv_seq *mq = (kv_seq *)q;
    pthread_mutex_lock(&ms->mu);
    while (atomic_load_explicit(&mq->ready_layers, memory_order_acquire) < s->n_layers)
        pthread_cond_wait(&ms->cv_done, &ms->mu);
    pthread_mutex_unlock(&ms->mu);
}
