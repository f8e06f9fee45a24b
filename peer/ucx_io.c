/*
 * ucx_io.c — the UCX back end's data path (ucx_internal.h): a puller's reads (one-sided gets,
 * or active-message fetches answered by eager fragments that the AM callback copies into the
 * destination page and hashes as they land, or by one rendezvous message into the page) with
 * their window and deadlines, and a holder's answers to fetches from its registered memory.
 * Runs on the node's progress thread only (ucx.c says how that thread is driven).
 *
 * Why fragments (docs/transfer.md, "Measured"): over TCP, UCX 1.13 lands a rendezvous message
 * by copying its pieces from its receive buffers into the page, after which the page was read
 * again whole for its checksum; a fragment of one TCP segment arrives whole in one receive
 * buffer, and copying it into the page and hashing it in the same callback, a piece at a time
 * while it is in the cache, reads the page once. No operation of UCX writes into the page, so
 * a page given up on is free at once. A fragment out of order (another transport) is still
 * copied; the page is then hashed whole when it is complete.
 */
#include <stdio.h>
#include <stdlib.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <string.h>

#include "peer/ucx_internal.h"

/* ---------------------------------------------------------------- reads (puller side) */

#define PR_LAND_CHUNK 16384 /* copied, then hashed while still in L1 */

/* Copies n bytes with non-temporal stores where dst is 16-byte aligned (SSE2, the x86-64
 * baseline), memcpy for the ends; the caller fences before the page is published (pr_land). */
static void pr_copy_nt(uint8_t *dst, const uint8_t *src, size_t n)
{
#ifdef __SSE2__
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(src + i)),
                      b = _mm_loadu_si128((const __m128i *)(src + i + 16)),
                      c = _mm_loadu_si128((const __m128i *)(src + i + 32)),
                      d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

static void pr_op_settle_sum(pr_op *o, int ok, const uint64_t *sum)
{
    if (o->phase == PR_OP_DONE) return;
    pr_upull *up = o->up;
    if (o->phase != PR_OP_IDLE) up->inflight--;
    o->phase = PR_OP_DONE;
    if (o->sum >= 0) {
        up->free_sums[up->n_free_sums++] = o->sum;
        o->sum = -1;
    }
    pr_page_arrived(up->p, o->index, ok, sum);
}

/* ok: 1 arrived, 0 failed, -1 failed its tag (pr_page_arrived) */
static void pr_op_settle(pr_op *o, int ok)
{
    pr_op_settle_sum(o, ok, NULL);
}

/* An eager fragment [off, off + len) of the page o reads: copied in and, when it continues
 * what has been hashed so far, hashed a chunk at a time: from the page, where it is still in L1
 * after the copy, or, in a pull larger than the caches (up->stream), from the receive buffer
 * while the copy goes around the caches: pages that cannot stay cached are not read for
 * ownership first, which pulls of many pages read faster (docs/transfer.md, "Tuning",
 * stream_bytes); 16 pages (5.9 MB, under the threshold) stay in the cache, where streaming
 * stores measured slower. */
static void pr_land(pr_ucx *u, pr_upull *up, pr_op *o, const kv_xfer_page *d, const pr_data_hdr *h,
                    const void *data, size_t len)
{
    const uint64_t off = h->offset;
    const int enc = (h->flags & PR_DATA_ENCRYPTED) != 0, check = !up->p->no_auth;
    int sealed = !check || pr_seal_begin(&u->seal, up->p->page_key, h, 1) == 0;
    if (o->phase == PR_OP_FETCH_SENT) {
        o->phase = PR_OP_LANDING;
        o->landed = o->hashed = 0;
        if (up->n_free_sums) {
            o->sum = up->free_sums[--up->n_free_sums];
            kv_xfer_sum_begin(&up->sums[o->sum], d, up->p->page_tokens);
        }
    }
    const int in_order = !check && o->sum >= 0 && off == o->hashed;
    const uint8_t *src = data;
    for (size_t at = 0; at < len; at += PR_LAND_CHUNK) {
        const size_t c = len - at < PR_LAND_CHUNK ? len - at : PR_LAND_CHUNK;
        uint8_t *to = d->buf + off + at;
        if (enc) /* decrypted into the page, then hashed there */
            sealed = sealed && pr_seal_update(&u->seal, src + at, to, c) == 0;
        else if (up->stream)
            pr_copy_nt(to, src + at, c);
        else
            memcpy(to, src + at, c);
        if (!enc && check) sealed = sealed && pr_seal_update(&u->seal, src + at, NULL, c) == 0;
        if (in_order) kv_xfer_sum_update(&up->sums[o->sum], up->stream && !enc ? src + at : to, c);
    }
    uint8_t tag[PR_TAG_BYTES];
    memcpy(tag, h->tag, sizeof tag);
    if (check && (!sealed || pr_seal_end(&u->seal, tag)))
        o->forged = 1; /* the page fails once complete */
#ifdef __SSE2__
    if (up->stream) _mm_sfence(); /* the streamed bytes are in the page before it is published */
#endif
    if (in_order) o->hashed += len;
    o->landed += len;
    if (o->landed < d->bytes) return;
    if (o->forged) {
        atomic_fetch_add_explicit(&u->node->answers_forged, 1, memory_order_relaxed);
        pr_op_settle(o, -1);
    } else if (check) { /* the holder's tag pass vouched for the checksum (pr_reply_seal) */
        pr_op_settle_sum(o, 1, &up->p->pages[o->index].src.checksum);
    } else if (o->sum >= 0 && o->hashed == d->bytes) {
        const uint64_t sum = kv_xfer_sum_end(&up->sums[o->sum]);
        pr_op_settle_sum(o, 1, &sum);
    } else {
        pr_op_settle(o, 1); /* not all in order: hashed whole now */
    }
}

static void pr_get_done(void *req, ucs_status_t status, void *arg)
{
    pr_op *o = arg;
    ucp_request_free(req);
    if (status == UCS_OK) o->up->ep->live_ns = km_now_ns();
    pr_op_settle(o, status == UCS_OK);
}

/* A page that landed whole (rendezvous): its tag checked, decrypted in place. */
static int pr_open_page(pr_ucx *u, pr_op *o)
{
    const pr_upull *up = o->up;
    uint8_t *page = up->p->pages[o->index].dst.buf;
    const size_t len = o->rndv.len;
    const int enc = (o->rndv.flags & PR_DATA_ENCRYPTED) != 0;
    if (up->p->no_auth) return 1;
    if (pr_seal_begin(&u->seal, up->p->page_key, &o->rndv, 1) ||
        pr_seal_update(&u->seal, page, enc ? page : NULL, len) ||
        pr_seal_end(&u->seal, o->rndv.tag)) {
        atomic_fetch_add_explicit(&u->node->answers_forged, 1, memory_order_relaxed);
        return -1;
    }
    return 1;
}

static void pr_recv_done(void *req, ucs_status_t status, size_t length, void *arg)
{
    pr_op *o = arg;
    ucp_request_free(req);
    if (status == UCS_OK) o->up->ep->live_ns = km_now_ns();
    const int ok = status == UCS_OK && length == o->up->p->pages[o->index].dst.bytes;
    const int opened = ok ? pr_open_page(o->up->ep->u, o) : 0;
    if (opened > 0 && !o->up->p->no_auth) /* the holder's tag pass vouched for the checksum */
        pr_op_settle_sum(o, 1, &o->up->p->pages[o->index].src.checksum);
    else
        pr_op_settle(o, opened);
}

static void pr_fetch_sent(void *req, ucs_status_t status, void *arg)
{
    ucp_request_free(req);
    /* a fetch that could not be sent never gets an answer */
    if (status != UCS_OK) pr_op_settle(arg, 0);
}

static ucp_mem_h pr_local_memh(pr_ucx *u, const kv_xfer_page *d)
{
    return d->region >= 0 && d->region < u->n_regions ? u->memh[d->region] : NULL;
}

static void pr_issue(pr_ucx *u, pr_upull *up, pr_op *o)
{
    pr_pull *p = up->p;
    const pr_xpage *x = &p->pages[o->index];
    ucp_mem_h mh = pr_local_memh(u, &x->dst);
    up->inflight++;
    void *r;
    if (up->ep->rkey[x->src.region]) { /* one-sided, where the holder publishes keys */
        o->phase = PR_OP_GETTING;
        ucp_request_param_t prm = {.op_attr_mask =
                                       UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                                   .cb.send = pr_get_done,
                                   .user_data = o};
        if (mh) {
            prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            prm.memh = mh;
        }
        r = ucp_get_nbx(up->ep->ep, x->dst.buf, x->src.bytes, x->src.addr,
                        up->ep->rkey[x->src.region], &prm);
        if (!UCS_PTR_IS_PTR(r)) pr_op_settle(o, !UCS_PTR_IS_ERR(r));
        return;
    }
    o->phase = PR_OP_FETCH_SENT;
    o->forged = 0;
    o->fetch = (pr_fetch_hdr){.pull_id = p->id,
                              .index = (uint32_t)o->index,
                              .region = x->src.region,
                              .addr = x->src.addr,
                              .bytes = x->src.bytes,
                              .flags = p->no_auth   ? PR_DATA_UNTAGGED
                                       : p->encrypt ? PR_DATA_ENCRYPTED
                                                    : 0};
    memcpy(o->fetch.token, p->token, PR_TOKEN_BYTES);
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
                               .cb.send = pr_fetch_sent,
                               .user_data = o};
    r = ucp_am_send_nbx(up->ep->ep, PR_AM_FETCH, &o->fetch, sizeof o->fetch, NULL, 0, &prm);
    if (UCS_PTR_IS_ERR(r)) pr_op_settle(o, 0);
}

static pr_upull *pr_upull_find(pr_ucx *u, uint64_t pull_id)
{
    for (pr_upull *up = u->pulls; up; up = up->next)
        if (up->p->id == pull_id) return up;
    return NULL;
}

/* Puller: a page, or a fragment of one, answering one of our fetches. */
ucs_status_t pr_am_data_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param)
{
    pr_ucx *u = arg;
    pr_data_hdr h;
    if (hlen != sizeof h) return UCS_OK;
    memcpy(&h, header, sizeof h);
    pr_upull *up = pr_upull_find(u, h.pull_id);
    if (!up || h.index >= (uint32_t)up->p->n) return UCS_OK; /* given up: dropped */
    if (!pr_token_eq(h.token, up->p->token)) { /* not from the lease's holder: no effect */
        atomic_fetch_add_explicit(&u->node->answers_forged, 1, memory_order_relaxed);
        return UCS_OK;
    }
    up->ep->live_ns = km_now_ns();
    pr_op *o = &up->ops[h.index];
    if (o->phase != PR_OP_FETCH_SENT && o->phase != PR_OP_LANDING) return UCS_OK;
    const kv_xfer_page *d = &up->p->pages[o->index].dst;
    const int rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (h.status == PR_REFUSE_TORN) { /* the holder's page changed under the lease */
        const uint64_t torn = ~up->p->pages[o->index].src.checksum;
        pr_op_settle_sum(o, 1, &torn);
        return UCS_OK;
    }
    if (h.status || h.offset > d->bytes || len > d->bytes - h.offset || h.len != len ||
        (rndv && (o->phase != PR_OP_FETCH_SENT || len != d->bytes)) ||
        o->landed + len > d->bytes) { /* refused, or not a piece of this page */
        pr_op_settle(o, 0);
        return UCS_OK;
    }
    if (up->p->encrypt && !(h.flags & PR_DATA_ENCRYPTED)) { /* asked encrypted: a downgrade */
        atomic_fetch_add_explicit(&u->node->answers_forged, 1, memory_order_relaxed);
        pr_op_settle(o, -1);
        return UCS_OK;
    }
    if (!rndv) {
        pr_land(u, up, o, d, &h, data, len);
        return UCS_OK;
    }
    o->phase = PR_OP_RECEIVING;
    o->rndv = h;
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.recv_am = pr_recv_done,
                               .user_data = o};
    ucp_mem_h mh = pr_local_memh(u, d);
    if (mh) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = mh;
    }
    void *r = ucp_am_recv_data_nbx(u->w, data, d->buf, len, &prm);
    if (!UCS_PTR_IS_PTR(r)) pr_op_settle(o, !UCS_PTR_IS_ERR(r));
    return UCS_INPROGRESS; /* the descriptor is UCX's again (ucp_am_recv_data_nbx took it) */
}

/* Issues what the window allows, settles what can no longer arrive, and finishes pulls. */
void pr_pulls_service(pr_ucx *u, uint64_t now, uint64_t *next_deadline)
{
    for (pr_upull **pp = &u->pulls; *pp;) {
        pr_upull *up = *pp;
        pr_pull *p = up->p;
        pr_uep *e = up->ep;
        int dead = e->failed || e->state == PR_EP_CLOSING || e->state == PR_EP_CLOSED;
        int late = now >= p->deadline_ns;
        if (!dead && late) {
            const int silent = e->state != PR_EP_READY || now - e->live_ns >= PR_SILENT_NS;
            if (!atomic_exchange_explicit(&p->timed_out, 1, memory_order_acq_rel) || silent)
                KM_INFO("peer_pull_timeout", "pull=%llu inflight=%d peer=%s",
                        (unsigned long long)p->id, up->inflight, silent ? "silent" : "live");
            if (silent) {
                pr_ep_close(u, e); /* a silent peer is a failed peer: every pull on it ends */
                dead = 1;
            }
        }
        int stop = dead || late || atomic_load_explicit(&p->stop, memory_order_acquire);
        if (stop) { /* nothing more is issued; what waits for an answer that cannot come ends */
            for (int i = up->next_op; i < p->n; i++) pr_op_settle(&up->ops[i], 0);
            up->next_op = p->n;
            if (dead || late) /* an answer after this is dropped (pr_am_data_cb); a page landing
                                 in fragments has nothing of UCX's writing into it */
                for (int i = 0; i < p->n; i++)
                    if (up->ops[i].phase == PR_OP_FETCH_SENT || up->ops[i].phase == PR_OP_LANDING)
                        pr_op_settle(&up->ops[i], 0);
        } else if (e->state == PR_EP_READY) {
            while (up->next_op < p->n && up->inflight < u->node->cfg.max_inflight)
                pr_issue(u, up, &up->ops[up->next_op++]);
        }
        if (up->next_op == p->n && up->inflight == 0) {
            *pp = up->next;
            pr_upull_free(up);
            pr_pull_fetched(u->node, p); /* last touch */
            continue;
        }
        /* reads that write into our pages still run after the deadline: look again when the
         * peer would count as silent */
        uint64_t at = late ? e->live_ns + PR_SILENT_NS : p->deadline_ns;
        if (late && at <= now) at = now + PR_SILENT_NS;
        if (at < *next_deadline) *next_deadline = at;
        pp = &up->next;
    }
}

/* ---------------------------------------------------------------- answers (holder side) */

static int pr_range_ok(pr_ucx *u, uint32_t region, uint64_t addr, uint64_t bytes)
{
    if (region >= (uint32_t)u->n_regions) return 0;
    const kv_mem_region *r = &u->node->regions[region];
    uint64_t b = (uint64_t)(uintptr_t)r->base;
    return addr >= b && bytes <= r->bytes && addr - b <= r->bytes - bytes;
}

static pr_uep *pr_conn_of(pr_ucx *u, ucp_ep_h ep)
{
    for (pr_uep *e = u->eps; e; e = e->next)
        if (e->ep == ep && !e->peer) return e;
    return NULL;
}

ucs_status_t pr_am_fetch_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param)
{
    pr_ucx *u = arg;
    pr_fetch_hdr f;
    if (hlen != sizeof f || len || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        atomic_fetch_add_explicit(&u->node->fetches_unkeyed, 1, memory_order_relaxed);
        return UCS_OK;
    }
    memcpy(&f, header, sizeof f);
    pr_uep *conn = pr_conn_of(u, param->reply_ep);
    if (!conn || conn->failed) return UCS_OK;
    if (conn->replies >= PR_CONN_REPLIES || u->n_replies >= PR_NODE_REPLIES) {
        atomic_fetch_add_explicit(&u->node->fetches_dropped, 1, memory_order_relaxed);
        return UCS_OK;
    }
    /* only a page a live lease offered, to whoever proves its secret: never the rest of the
     * registered memory, and nothing at all (not even a refusal) to a guess */
    const size_t tb = sizeof(int32_t) * (size_t)kv_store_page_tokens(u->node->store);
    uint8_t key[PR_KEY_BYTES];
    pr_page_desc desc;
    /* nothing is allocated before the asker has proved the lease's secret */
    int allowed = pr_range_ok(u, f.region, f.addr, f.bytes)
                      ? pr_lease_allows(u->node, f.pull_id, f.token, f.index, f.region, f.addr,
                                        f.bytes, key, &desc, u->tokens)
                      : pr_lease_allows(u->node, f.pull_id, f.token, UINT32_MAX, 0, 0, 0, key,
                                        &desc, u->tokens);
    if (allowed <= 0) atomic_fetch_add_explicit(&u->node->fetches_refused, 1, memory_order_relaxed);
    if (allowed < 0) atomic_fetch_add_explicit(&u->node->fetches_unkeyed, 1, memory_order_relaxed);
    const uint32_t flags =
        f.flags & PR_DATA_UNTAGGED ? PR_DATA_UNTAGGED : f.flags & PR_DATA_ENCRYPTED;
    const uint64_t sealed = allowed && (flags & PR_DATA_ENCRYPTED) ? f.bytes : 0;
    if (allowed < 0 || conn->sealed + sealed > PR_CONN_SEALED ||
        u->sealed + sealed > PR_NODE_SEALED) {
        if (allowed >= 0)
            atomic_fetch_add_explicit(&u->node->fetches_dropped, 1, memory_order_relaxed);
        return UCS_OK;
    }
    pr_reply *r = calloc(1, sizeof *r);
    if (r && !(r->tokens = malloc(tb))) {
        free(r);
        r = NULL;
    }
    if (!r) return UCS_OK;
    if (allowed > 0) {
        memcpy(r->key, key, PR_KEY_BYTES);
        r->desc = desc;
        memcpy(r->tokens, u->tokens, tb);
    }
    conn->sealed += sealed;
    u->sealed += sealed;
    r->reserved = sealed;
    r->u = u;
    r->conn = conn;
    r->hdr.pull_id = f.pull_id;
    r->hdr.index = f.index;
    r->hdr.status = allowed ? 0 : 1;
    r->hdr.flags = flags;
    memcpy(r->hdr.token, f.token, PR_TOKEN_BYTES);
    r->addr = f.addr;
    r->bytes = f.bytes;
    r->region = f.region;
    conn->replies++;
    u->n_replies++;
    r->next = u->replies; /* sent by the loop, outside UCX's callback */
    u->replies = r;
    return UCS_OK;
}

static void pr_reply_free(pr_reply *r)
{
    r->conn->replies--;
    r->conn->sealed -= r->reserved;
    r->u->n_replies--;
    r->u->sealed -= r->reserved;
    free(r->frag);
    free(r->sealed);
    free(r->tokens);
    free(r);
}

static void pr_reply_unref(pr_reply *r)
{
    if (--r->pending) return;
    r->u->sends--;
    pr_reply_free(r);
}

static void pr_reply_sent(void *req, ucs_status_t status, void *arg)
{
    ucp_request_free(req);
    pr_reply_unref(arg);
}

/* 1 when the connection's active messages travel on TCP, read off UCX's description of the
 * endpoint (1.13 has no query for its lanes): a line "lane[i]: n:tcp/DEV ... am ...". Elsewhere
 * (shared memory, CMA, RDMA) a rendezvous lands the page with one copy or none, which measured
 * faster than fragments (docs/transfer.md); over TCP it lands through UCX's receive buffers
 * and fragments save the second pass over the page. */
static int pr_conn_am_tcp(pr_uep *e)
{
    if (e->am_tcp >= 0) return e->am_tcp;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return 1;
    ucp_ep_print_info(e->ep, f);
    fclose(f);
    int tcp = 1; /* no lane found: TCP, the transport this layer is built for */
    for (char *l = text ? strstr(text, "lane[") : NULL; l; l = strstr(l + 1, "lane[")) {
        char *end = strchr(l, '\n');
        if (end) *end = 0;
        if (strstr(l, " am ") || strstr(l, " am_bw")) tcp = strstr(l, ":tcp/") != NULL;
        if (end) *end = '\n';
    }
    free(text);
    return e->am_tcp = tcp;
}

/* The tag pass over r's page: each fragment's header and tag (into r->frag, or r->hdr when
 * n == 1), the ciphertext when encrypted, and the page's checksum on the same read of each
 * piece. 1 when the checksum is the one the offer described; 0 when the page changed under the
 * lease (torn), or a step failed. The reader then trusts the tag for the bytes and this pass
 * for the checksum, and reads the page once (docs/transfer.md, "Who may read a page"). */
static int pr_reply_seal(pr_ucx *u, pr_reply *r, int n, size_t fb)
{
    enum { PIECE = 16384 };
    const int pt = kv_store_page_tokens(u->node->store);
    const kv_xfer_page id = {.format = (kv_format)r->desc.format,
                             .index = r->desc.index,
                             .hash = r->desc.hash,
                             .parent = r->desc.parent,
                             .tokens = r->tokens,
                             .bytes = r->desc.bytes};
    kv_xfer_sum sum;
    memset(&sum, 0, sizeof sum);
    kv_xfer_sum_begin(&sum, &id, pt);
    int ok = 1;
    for (int k = 0; k < n && ok; k++) {
        pr_data_hdr *h = n > 1 ? &r->frag[k] : &r->hdr;
        *h = r->hdr;
        h->offset = (uint64_t)k * fb;
        h->len = (uint32_t)(r->bytes - h->offset < fb ? r->bytes - h->offset : fb);
        const uint8_t *page = (const uint8_t *)(uintptr_t)(r->addr + h->offset);
        uint8_t *out = r->sealed ? r->sealed + h->offset : NULL;
        ok = pr_seal_begin(&u->seal, r->key, h, 0) == 0;
        for (size_t at = 0; ok && at < h->len; at += PIECE) {
            const size_t c = h->len - at < PIECE ? h->len - at : PIECE;
            ok = pr_seal_update(&u->seal, page + at, out ? out + at : NULL, c) == 0;
            kv_xfer_sum_update(&sum, page + at, c);
        }
        ok = ok && pr_seal_end(&u->seal, h->tag) == 0;
    }
    return ok && kv_xfer_sum_end(&sum) == r->desc.checksum;
}

/* Sends r: a refusal (a header alone), the page as one rendezvous message (am_fragment < 0, or
 * a connection not on TCP), or the page in eager fragments of am_fragment bytes, each with its
 * own header. */
static void pr_reply_send(pr_ucx *u, pr_reply *r)
{
    const size_t bytes = r->hdr.status ? 0 : r->bytes;
    const int frag = bytes && pr_conn_am_tcp(r->conn) ? u->node->cfg.am_fragment : -1;
    const size_t fb = frag > 0 ? (size_t)frag : bytes;
    const int n = bytes && fb ? (int)((bytes + fb - 1) / fb) : 1;
    const int enc = (r->hdr.flags & PR_DATA_ENCRYPTED) != 0;
    if ((n > 1 && !(r->frag = calloc((size_t)n, sizeof *r->frag))) ||
        (bytes && enc && !(r->sealed = malloc(bytes)))) {
        pr_reply_free(r); /* the reader's deadline ends its wait */
        return;
    }
    if (bytes && !(r->hdr.flags & PR_DATA_UNTAGGED) && !pr_reply_seal(u, r, n, fb)) {
        free(r->frag); /* torn: a refusal that says so, the header alone */
        r->frag = NULL;
        r->hdr.status = PR_REFUSE_TORN;
        pr_reply_send(u, r);
        return;
    }
    u->sends++;
    r->pending = n + 1; /* one for the loop below */
    for (int k = 0; k < n; k++) {
        pr_data_hdr *h = n > 1 ? &r->frag[k] : &r->hdr;
        if (!h->len) { /* untagged (pr_reply_seal filled the others) */
            *h = r->hdr;
            h->offset = (uint64_t)k * fb;
            h->len = (uint32_t)(bytes ? (bytes - h->offset < fb ? bytes - h->offset : fb) : 0);
        }
        const size_t len = h->len;
        const uint8_t *page = (const uint8_t *)(uintptr_t)(r->addr + h->offset);
        uint8_t *out = r->sealed ? r->sealed + h->offset : NULL;
        ucp_request_param_t prm = {
            .op_attr_mask =
                UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
            .flags = frag > 0 ? UCP_AM_SEND_FLAG_EAGER : UCP_AM_SEND_FLAG_RNDV,
            .cb.send = pr_reply_sent,
            .user_data = r};
        if (len && !out) {
            prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            prm.memh = u->memh[r->region];
        }
        const void *src = out ? (const void *)out : (const void *)page;
        void *q =
            ucp_am_send_nbx(r->conn->ep, PR_AM_DATA, h, sizeof *h, len ? src : NULL, len, &prm);
        if (UCS_PTR_IS_PTR(q)) continue;
        r->pending--;
        if (UCS_PTR_IS_ERR(q)) { /* the endpoint failed: the reader's wait ends by its deadline */
            r->pending -= n - 1 - k;
            break;
        }
    }
    pr_reply_unref(r);
}

void pr_replies_send(pr_ucx *u)
{
    while (u->replies) {
        pr_reply *r = u->replies;
        u->replies = r->next;
        if (r->conn->failed || r->conn->state != PR_EP_READY)
            pr_reply_free(r);
        else
            pr_reply_send(u, r);
    }
}

void pr_upull_free(pr_upull *up)
{
    free(up->ops);
    free(up->sums);
    free(up->free_sums);
    free(up);
}
