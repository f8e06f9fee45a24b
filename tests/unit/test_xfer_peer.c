/*
 * test_xfer_peer.c — the transfer layer (peer/) with two stores and two nodes in one process,
 * over real UCX endpoints: pulls of 1, 16 and 256 pages compared byte for byte with the
 * holder's, both read modes, every format and conversion, pages that are corrupted, carry
 * other tokens, break the chain, are foreign or lie outside the region (dropped and counted,
 * the chain ending before them), leases that run out, deadlines, a holder that disappears, and
 * that nothing is left behind (endpoints, imports, pins). Two processes and killed or stopped
 * peers: test_xfer_proc.c. Waits are bounded; nothing asserts on time.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvshard/diskfmt.h"   /* kv_layout_init */
#include "kvshard/internal.h"  /* kv_store_check */
#include "peer/ucx_internal.h" /* seal.c: the tags of answers */
#include "tests/xfer_harness.h"

#define PT 4

typedef xh_shape shape;

static const shape SMALL = {2, 2, 32, PT};
static const shape SMOL = {30, 3, 64, PT}; /* the default model's KV: 368,640-byte f16 pages */

static kv_store *mk_store(shape sh, kv_format f, int pages)
{
    kv_store *s = xh_store(sh, f, pages);
    cr_assert_not_null(s);
    return s;
}

static void mk_chain(int32_t *toks, km_pagehash *hs, int n, int salt)
{
    xh_chain(toks, hs, n, PT, salt);
}

static void compute(kv_store *s, shape sh, const int32_t *toks, const km_pagehash *hs, int n)
{
    cr_assert_eq(xh_compute(s, sh, toks, hs, n), 0);
}

static int g_fragment;       /* pr_config.am_fragment of the nodes made (0: the default) */
static pr_encrypt g_encrypt; /* pr_config.encrypt of the nodes made */

static pr_node *mk_node(kv_store *s, pr_mode mode, int lease_ms)
{
    pr_config c = {.store = s,
                   .mode = mode,
                   .lease_ms = lease_ms,
                   .am_fragment = g_fragment,
                   .encrypt = g_encrypt};
    pr_node *n;
    km_errbuf err;
    cr_assert_eq(pr_node_create(&c, &n, &err), 0, "node: %s", err.msg);
    return n;
}

static pr_peer *connect_to(pr_node *from, pr_node *to)
{
    const uint8_t *a;
    size_t len;
    cr_assert_eq(pr_node_address(to, &a, &len), 0);
    pr_peer *p;
    km_errbuf err;
    cr_assert_eq(pr_peer_connect(from, a, len, &p, &err), 0, "%s", err.msg);
    return p;
}

static uint64_t secs(double s)
{
    return xh_after(s);
}

/* A place to change an offer before the puller sees it (the holder stays honest). */
typedef void (*tamper_fn)(pr_offer *o, pr_page_desc *descs, int32_t *tokens);

/* Runs one pull from `holder` into `puller` with the control messages carried here. */
static int pull(pr_node *holder, pr_node *puller, pr_peer *peer, const int32_t *toks,
                const km_pagehash *hs, int n, uint64_t deadline, tamper_fn tamper,
                pr_pull_result *res)
{
    pr_pull *p;
    pr_pull_req req;
    int k = pr_pull_start(puller, peer, hs, toks, n, deadline, &p, &req);
    cr_assert_geq(k, 0, "pull_start: %s", km_strerror(k));
    if (!p) {
        memset(res, 0, sizeof *res);
        res->pages_local = k;
        return 0;
    }
    pr_serve(holder, &req);
    pr_offer o;
    uint64_t guard = secs(60);
    while (pr_node_poll(holder, &o, 1) == 0) {
        cr_assert_lt(km_now_ns(), guard, "no offer");
        km_sleep_ms(1);
    }
    pr_page_desc *descs = malloc(sizeof *descs * (o.n ? o.n : 1));
    int32_t *tokens = malloc(sizeof(int32_t) * PT * (o.n ? o.n : 1));
    if (o.n) {
        memcpy(descs, o.pages, sizeof *descs * o.n);
        memcpy(tokens, o.tokens, sizeof(int32_t) * PT * o.n);
    }
    o.pages = descs;
    o.tokens = tokens;
    if (tamper) tamper(&o, descs, tokens);
    pr_pull_offer(puller, p, &o);
    while (!pr_pull_done_yet(puller, p)) {
        cr_assert_lt(km_now_ns(), guard, "the pull never ended");
        pr_offer none[1];
        pr_node_poll(holder, none, 1);
        pr_node_poll(puller, none, 1);
        km_sleep_ms(1);
    }
    pr_pull_done done;
    int got = pr_pull_finish(puller, p, res, &done);
    if (done.lease_id) pr_serve_done(holder, &done);
    free(descs);
    free(tokens);
    return got;
}

/* The first n pages of the chain hold the same bytes in a and b. */
static void same_bytes(kv_store *a, kv_store *b, const int32_t *toks, const km_pagehash *hs, int n)
{
    int d = xh_same_bytes(a, b, toks, hs, n);
    cr_assert_eq(d, -1, "page %d differs (-2: missing, -3: not exportable)", d);
}

/* Nothing left: no pull, lease, import, export or pin; the peer's endpoint closed. */
static void release_and_check(pr_node *puller, pr_peer *peer, pr_node *holder, kv_store *ps,
                              kv_store *hs)
{
    pr_peer_release(puller, peer);
    pr_stats st;
    uint64_t guard = secs(30);
    pr_offer none[1];
    do {
        pr_node_poll(puller, none, 1);
        pr_node_poll(holder, none, 1);
        pr_node_stats(puller, &st);
        if (st.peers == 0 && st.endpoints == 0 && st.pulls_active == 0) break;
        km_sleep_ms(2);
    } while (km_now_ns() < guard);
    cr_assert_eq(st.peers, 0);
    cr_assert_eq(st.endpoints, 0, "the puller's endpoint is closed");
    cr_assert_eq(st.pulls_active, 0);
    pr_node_stats(holder, &st);
    cr_assert_eq(st.leases_active, 0);
    int ne, ni;
    kv_xfer_counts(ps, &ne, &ni);
    cr_assert_eq(ne + ni, 0);
    kv_xfer_counts(hs, &ne, &ni);
    cr_assert_eq(ne + ni, 0);
    kv_store_stats s1, s2;
    kv_store_stats_get(ps, &s1);
    kv_store_stats_get(hs, &s2);
    cr_assert_eq(s1.tier[KV_TIER_HOT].pinned_pages, 0);
    cr_assert_eq(s2.tier[KV_TIER_HOT].pinned_pages, 0);
    km_errbuf err;
    cr_assert_eq(kv_store_check(ps, &err), 0, "puller: %s", err.msg);
    cr_assert_eq(kv_store_check(hs, &err), 0, "holder: %s", err.msg);
}

/* Two stores and two nodes; the holder has computed the first `computed` pages of the chain. */
typedef struct duo {
    kv_store *a, *b;
    pr_node *na, *nb;
    pr_peer *peer;
    int32_t toks[256 * PT];
    km_pagehash hs[256];
} duo;

static kv_format g_holder_fmt = KN_KV_F16; /* the holder's format in a duo (the puller's: f16) */

static duo *duo_open(shape sh, int pages, int computed, pr_mode mode)
{
    duo *d = calloc(1, sizeof *d);
    d->a = mk_store(sh, g_holder_fmt, pages);
    d->b = mk_store(sh, KN_KV_F16, pages);
    d->na = mk_node(d->a, mode, 0);
    d->nb = mk_node(d->b, mode, 0);
    mk_chain(d->toks, d->hs, pages, 0);
    compute(d->a, sh, d->toks, d->hs, computed);
    d->peer = connect_to(d->nb, d->na);
    return d;
}

/* A pull of the first n pages, offered and reading. */
static pr_pull *duo_start(duo *d, int n, uint64_t deadline)
{
    pr_pull *p;
    pr_pull_req req;
    cr_assert_eq(pr_pull_start(d->nb, d->peer, d->hs, d->toks, n, deadline, &p, &req), 0);
    pr_serve(d->na, &req);
    pr_offer o;
    const uint64_t guard = secs(60);
    while (pr_node_poll(d->na, &o, 1) == 0) {
        cr_assert_lt(km_now_ns(), guard, "no offer");
        km_sleep_ms(1);
    }
    cr_assert_eq(pr_pull_offer(d->nb, p, &o), 0);
    return p;
}

static void duo_close(duo *d)
{
    if (d->nb) pr_node_destroy(d->nb);
    if (d->na) pr_node_destroy(d->na);
    kv_store_destroy(d->a);
    kv_store_destroy(d->b);
    free(d);
}

static void pull_pages(pr_mode mode, shape sh, int n)
{
    kv_store *a = mk_store(sh, KN_KV_F16, n + 8), *b = mk_store(sh, KN_KV_F16, n + 8);
    pr_node *na = mk_node(a, mode, 0), *nb = mk_node(b, mode, 0);
    int32_t *toks = malloc(sizeof(int32_t) * PT * n);
    km_pagehash *hs = malloc(sizeof(km_pagehash) * n);
    mk_chain(toks, hs, n, 0);
    compute(a, sh, toks, hs, n);
    pr_peer *peer = connect_to(nb, na);
    kv_event ev[8];
    while (kv_store_events_drain(b, ev, 8)) {
    }
    pr_pull_result r;
    cr_assert_eq(pull(na, nb, peer, toks, hs, n, secs(60), NULL, &r), n, "status %s",
                 km_strerror(r.status));
    cr_assert_eq(r.status, 0);
    cr_assert_eq(r.pages_imported, n);
    cr_assert_eq(r.bytes, (uint64_t)n * kv_store_page_bytes(a));
    same_bytes(a, b, toks, hs, n);
    int stored = 0, got;
    while ((got = kv_store_events_drain(b, ev, 8)) > 0)
        for (int i = 0; i < got; i++) stored += ev[i].kind == KV_EVENT_STORED;
    cr_assert_eq(stored, n, "a STORED event per pulled page");
    /* a second pull finds everything local: nothing moves */
    cr_assert_eq(pull(na, nb, peer, toks, hs, n, secs(60), NULL, &r), 0);
    cr_assert_eq(r.pages_local, n);
    release_and_check(nb, peer, na, b, a);
    pr_node_destroy(nb);
    pr_node_destroy(na);
    kv_store_destroy(a);
    kv_store_destroy(b);
    free(toks);
    free(hs);
}

Test(xfer_peer, get_1_16_256_pages_arrive_byte_for_byte, .timeout = 300)
{
    pull_pages(PR_MODE_GET, SMALL, 1);
    pull_pages(PR_MODE_GET, SMALL, 16);
    pull_pages(PR_MODE_GET, SMALL, 256);
}

Test(xfer_peer, am_1_16_256_pages_arrive_byte_for_byte, .timeout = 300)
{
    pull_pages(PR_MODE_AM, SMALL, 1);
    pull_pages(PR_MODE_AM, SMALL, 16);
    pull_pages(PR_MODE_AM, SMALL, 256);
}

Test(xfer_peer, default_model_sized_pages_in_both_modes, .timeout = 300)
{
    pull_pages(PR_MODE_GET, SMOL, 16);
    pull_pages(PR_MODE_AM, SMOL, 16);
}

/* ---------------------------------------------------------------- formats */

static float max_err(kv_store *s, shape sh, const int32_t *toks, const km_pagehash *hs, int n,
                     kv_store *ref)
{
    kv_seq *q, *r;
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_create(ref, &r), 0);
    cr_assert_eq(kv_seq_attach(s, q, hs, toks, n), n);
    cr_assert_eq(kv_seq_attach(ref, r, hs, toks, n), n);
    float *k = malloc(sizeof(float) * sh.hd * 4), *v = k + sh.hd, *k2 = v + sh.hd, *v2 = k2 + sh.hd,
          e = 0;
    for (int p = 0; p < n * PT; p++)
        for (int l = 0; l < sh.layers; l++)
            for (int h = 0; h < sh.heads; h++) {
                cr_assert_eq(kv_seq_read(s, q, l, h, p, k, v), 0);
                cr_assert_eq(kv_seq_read(ref, r, l, h, p, k2, v2), 0);
                for (int c = 0; c < sh.hd; c++) {
                    float d1 = k[c] - k2[c], d2 = v[c] - v2[c];
                    if (d1 < 0) d1 = -d1;
                    if (d2 < 0) d2 = -d2;
                    if (d1 > e) e = d1;
                    if (d2 > e) e = d2;
                }
            }
    free(k);
    kv_seq_destroy(s, q);
    kv_seq_destroy(ref, r);
    return e;
}

Test(xfer_peer, every_format_travels_stored_and_is_converted_on_arrival, .timeout = 300)
{
    const kv_format fs[] = {KN_KV_F16, KN_KV_BF16, KN_KV_FP8, KN_KV_INT8, KN_KV_INT4};
    const int n = 6;
    int32_t toks[6 * PT];
    km_pagehash hs[6];
    mk_chain(toks, hs, n, 0);
    for (int i = 0; i < 5; i++) {
        kv_store *a = mk_store(SMALL, fs[i], 16);
        compute(a, SMALL, toks, hs, n);
        pr_node *na = mk_node(a, PR_MODE_GET, 0);
        for (int j = 0; j < 5; j++) {
            kv_store *b = mk_store(SMALL, fs[j], 16);
            pr_node *nb = mk_node(b, PR_MODE_GET, 0);
            pr_peer *peer = connect_to(nb, na);
            pr_pull_result r;
            cr_assert_eq(pull(na, nb, peer, toks, hs, n, secs(60), NULL, &r), n);
            /* the bytes that moved are the holder's format: fewer for quantized pages */
            cr_assert_eq(r.bytes, (uint64_t)n * kv_store_page_bytes(a));
            if (i == j) {
                same_bytes(a, b, toks, hs, n);
            } else {
                /* converted on arrival: as close to the holder's values as one re-encoding */
                float e = max_err(b, SMALL, toks, hs, n, a);
                cr_assert_lt(e, 0.3f, "%s -> %s: %g", kv_format_name(fs[i]), kv_format_name(fs[j]),
                             e);
            }
            release_and_check(nb, peer, na, b, a);
            pr_node_destroy(nb);
            kv_store_destroy(b);
        }
        pr_node_destroy(na);
        kv_store_destroy(a);
    }
}

/* ---------------------------------------------------------------- correct or nothing */

static int g_bad = 3; /* the page a tamper function spoils */

static void tamper_payload(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    /* the holder's memory changes after it described the page (a torn read) */
    ((uint8_t *)(uintptr_t)d[g_bad].addr)[17] ^= 0x40;
}
static void tamper_tokens(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    t[g_bad * PT + 1] += 1;
}
static void tamper_parent(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    d[g_bad].parent.lo ^= 1;
}
static void tamper_foreign(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    int32_t other[8 * PT];
    km_pagehash oh[8];
    mk_chain(other, oh, 8, 1); /* another tenant's chain over the same tokens: another salt */
    d[g_bad].hash = oh[g_bad];
}
static void tamper_size(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    d[g_bad].bytes -= 16;
}
static void tamper_address(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    d[g_bad].addr += (uint64_t)1 << 40;
}
static void tamper_index(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    pr_page_desc x = d[g_bad];
    d[g_bad] = d[g_bad + 1];
    d[g_bad + 1] = x;
}

/* A NaN in the page's values (f16, bf16, fp8: 0x7fff is a NaN in all three, 0x7f/0xff in fp8)
 * or in its first scale (int8, int4), with the checksum recomputed over the forged bytes: what a
 * holder that lies can send, since the checksum is unkeyed. */
static void tamper_nan(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    pr_page_desc *p = &d[g_bad];
    uint8_t *buf = (uint8_t *)(uintptr_t)p->addr;
    kv_layout L;
    kv_layout_init(&L, (kv_format)p->format, PT, SMALL.hd, SMALL.layers, SMALL.heads);
    size_t at = p->format == KN_KV_INT8 || p->format == KN_KV_INT4 ? L.kd + L.vd : 0;
    buf[at] = 0xff;
    buf[at + 1] = 0x7f;
    kv_xfer_page x = {.format = (kv_format)p->format,
                      .index = p->index,
                      .hash = p->hash,
                      .parent = p->parent,
                      .tokens = t + g_bad * PT,
                      .buf = buf,
                      .bytes = p->bytes};
    p->checksum = kv_xfer_checksum(&x, PT, buf);
}

static void bad_page(pr_mode mode, tamper_fn f, pr_drop why)
{
    const int n = 8;
    duo *d = duo_open(SMALL, 16, n, mode);
    pr_pull_result r;
    int got = pull(d->na, d->nb, d->peer, d->toks, d->hs, n, secs(60), f, &r);
    cr_assert_eq(got, g_bad, "%s: %d pages imported", pr_drop_name(why), got);
    cr_assert_eq(r.dropped[why], 1, "%s counted", pr_drop_name(why));
    cr_assert_lt(r.status, 0);
    for (int k = 0; k < PR_DROP_COUNT; k++)
        if (k != (int)why) cr_assert_eq(r.dropped[k], 0, "%s", pr_drop_name((pr_drop)k));
    pr_stats st;
    pr_node_stats(d->nb, &st);
    cr_assert_eq(st.dropped[why], 1);
    /* the pages before the bad one are in the index and right; none after it */
    cr_assert_eq(kv_store_lookup(d->b, d->hs, d->toks, n, NULL), g_bad);
    if (f != tamper_payload && g_holder_fmt == KN_KV_F16)
        same_bytes(d->a, d->b, d->toks, d->hs, g_bad);
    release_and_check(d->nb, d->peer, d->na, d->b, d->a);
    duo_close(d);
}

Test(xfer_peer, corrupted_payload_is_dropped_and_counted, .timeout = 120)
{
    bad_page(PR_MODE_GET, tamper_payload, PR_DROP_CHECKSUM);
    bad_page(PR_MODE_AM, tamper_payload, PR_DROP_CHECKSUM);
}

Test(xfer_peer, wrong_tokens_are_dropped_and_counted, .timeout = 120)
{
    bad_page(PR_MODE_GET, tamper_tokens, PR_DROP_TOKENS);
}

/* Chunk pages (docs/blend.md) travel as any chain: a preamble page, then the chunk's whole pages,
 * seeded by the tenant's chunk seed (km_pagehash_chunk_seed). One whose ids are not the chunk's
 * (a stale page: another document's KV under this one's hashes) is dropped by its token ids, and
 * the chunk's pages before it are kept. */
Test(xfer_peer, a_stale_chunk_page_is_dropped_by_its_token_ids, .timeout = 120)
{
    const int n = 8;
    duo *d = duo_open(SMALL, 16, 0, PR_MODE_AM);
    const km_pagehash tenant = km_pagehash_seed("m", 1, 9, NULL, 0);
    km_pagehash_chain(km_pagehash_chunk_seed(tenant), d->toks, n * PT, PT, d->hs, n);
    compute(d->a, SMALL, d->toks, d->hs, n);
    pr_pull_result r;
    int got = pull(d->na, d->nb, d->peer, d->toks, d->hs, n, secs(60), tamper_tokens, &r);
    cr_assert_eq(got, g_bad, "%d chunk pages imported", got);
    cr_assert_eq(r.dropped[PR_DROP_TOKENS], 1);
    cr_assert_eq(kv_store_lookup(d->b, d->hs, d->toks, n, NULL), g_bad);
    /* the rest of the chunk, honest this time, arrives */
    cr_assert_eq(pull(d->na, d->nb, d->peer, d->toks, d->hs, n, secs(60), NULL, &r), n - g_bad);
    same_bytes(d->a, d->b, d->toks, d->hs, n);
    release_and_check(d->nb, d->peer, d->na, d->b, d->a);
    duo_close(d);
}

Test(xfer_peer, a_broken_chain_link_is_dropped_and_counted, .timeout = 120)
{
    bad_page(PR_MODE_GET, tamper_parent, PR_DROP_CHAIN);
    bad_page(PR_MODE_GET, tamper_index, PR_DROP_CHAIN);
}

Test(xfer_peer, a_page_of_nans_in_any_format_is_dropped_and_counted, .timeout = 120)
{
    for (int f = 0; f < KV_FORMAT_COUNT; f++) {
        g_holder_fmt = (kv_format)f;
        bad_page(PR_MODE_GET, tamper_nan, PR_DROP_NONFINITE);
    }
    g_holder_fmt = KN_KV_F16;
}

Test(xfer_peer, a_foreign_page_is_dropped_and_counted, .timeout = 120)
{
    bad_page(PR_MODE_GET, tamper_foreign, PR_DROP_CHAIN);
}

Test(xfer_peer, bad_sizes_and_addresses_are_dropped_before_any_read, .timeout = 120)
{
    bad_page(PR_MODE_GET, tamper_size, PR_DROP_FORMAT);
    bad_page(PR_MODE_GET, tamper_address, PR_DROP_FORMAT);
    bad_page(PR_MODE_AM, tamper_address, PR_DROP_FORMAT);
}

/* A holder answers in fragments of any size (the reader copies and hashes each as it lands) or
 * with one rendezvous message per page (-1); the reader takes either, byte for byte. */
Test(xfer_peer, am_pages_arrive_whole_in_any_fragment_size_or_one_rendezvous, .timeout = 300)
{
    const int frag[] = {-1, 1000, 4096, PR_FRAGMENT_DEFAULT, 368640, 1 << 20};
    for (unsigned i = 0; i < sizeof frag / sizeof frag[0]; i++) {
        g_fragment = frag[i];
        pull_pages(PR_MODE_AM, SMALL, 16);
        pull_pages(PR_MODE_AM, SMOL, 4);
    }
    g_fragment = 1000; /* past PR_STREAM_DEFAULT (streaming stores), fragments unaligned too */
    pull_pages(PR_MODE_AM, SMOL, 48);
    g_fragment = 0;
    pull_pages(PR_MODE_AM, SMOL, 48);
    g_fragment = 1000; /* a page in pieces: a bad byte in one of them still fails the page */
    bad_page(PR_MODE_AM, tamper_payload, PR_DROP_CHECKSUM);
}

/* Encrypted answers land the same bytes, in fragments or as one rendezvous message. */
Test(xfer_peer, encrypted_pages_arrive_whole_in_fragments_or_one_rendezvous, .timeout = 300)
{
    const int frag[] = {-1, 4096, PR_FRAGMENT_DEFAULT};
    g_encrypt = PR_ENCRYPT_ON;
    for (unsigned i = 0; i < sizeof frag / sizeof frag[0]; i++) {
        g_fragment = frag[i];
        pull_pages(PR_MODE_AM, SMALL, 16);
        pull_pages(PR_MODE_AM, SMOL, 4);
    }
    g_fragment = 0;
    g_encrypt = PR_ENCRYPT_AUTO;
}

/* A reader that does not hold the lease's secret: its own endpoint, the pull id and every
 * page's place right, only the key not the one the holder drew. */
static void tamper_key(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    o->key[0] ^= 1;
}

/* The holder answers none of its fetches (not even with a refusal): nothing read, nothing
 * imported; an honest pull right after is served whole. */
Test(xfer_peer, a_reader_without_the_lease_secret_reads_nothing, .timeout = 120)
{
    const int n = 8;
    duo *d = duo_open(SMALL, 16, n, PR_MODE_AM);
    pr_pull_result r;
    int got = pull(d->na, d->nb, d->peer, d->toks, d->hs, n, secs(1), tamper_key, &r);
    cr_assert_eq(got, 0);
    cr_assert_eq(r.bytes, 0);
    cr_assert_eq(r.status, KM_ETIMEDOUT, "%s", km_strerror(r.status));
    pr_stats st;
    pr_node_stats(d->na, &st);
    cr_assert_geq(st.fetches_unkeyed, 1);
    cr_assert_eq(st.fetches_unkeyed, st.fetches_refused);
    kv_store_evict_oldest_fraction(d->b, 1.0);
    got = pull(d->na, d->nb, d->peer, d->toks, d->hs, n, secs(60), NULL, &r);
    cr_assert_eq(got, n, "%s", km_strerror(r.status));
    same_bytes(d->a, d->b, d->toks, d->hs, n);
    release_and_check(d->nb, d->peer, d->na, d->b, d->a);
    duo_close(d);
}

Test(xfer_peer, the_first_page_bad_means_nothing_imported, .timeout = 120)
{
    g_bad = 0;
    bad_page(PR_MODE_GET, tamper_payload, PR_DROP_CHECKSUM);
    bad_page(PR_MODE_GET, tamper_tokens, PR_DROP_TOKENS);
    g_bad = 3;
}

/* A holder's page that is inside its registered memory but was never offered: 16 bytes before
 * the bad page, i.e. the tail of another page (what a reader probing the arena would ask for). */
static void tamper_unoffered(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    d[g_bad].addr -= 16;
}

/* A page the lease did offer, asked for in another page's place: the holder checks the fetch
 * against the offer's entry at its index, so this is refused too, not served and caught only by
 * the puller's checksum. */
static void tamper_misplaced(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    d[g_bad].addr = d[0].addr;
    d[g_bad].bytes = d[0].bytes;
    d[g_bad].region = d[0].region;
}

/* AM mode: the holder checks every fetch against its live leases and refuses a read the lease
 * did not offer at that place (counted), so the page fails as a transfer, not as bytes that
 * arrived and were wrong; an honest pull right after is served whole. */
static void holder_refuses(void (*tamper)(pr_offer *, pr_page_desc *, int32_t *))
{
    const int n = 8;
    duo *d = duo_open(SMALL, 16, n, PR_MODE_AM);
    pr_pull_result r;
    int got = pull(d->na, d->nb, d->peer, d->toks, d->hs, n, secs(60), tamper, &r);
    cr_assert_eq(got, g_bad);
    cr_assert_eq(r.dropped[PR_DROP_TRANSFER], 1, "checksum %d transfer %d",
                 r.dropped[PR_DROP_CHECKSUM], r.dropped[PR_DROP_TRANSFER]);
    cr_assert_eq(r.dropped[PR_DROP_CHECKSUM], 0, "the holder sent bytes it never offered there");
    pr_stats st;
    pr_node_stats(d->na, &st);
    cr_assert_eq(st.fetches_refused, 1);
    kv_store_evict_oldest_fraction(d->b, 1.0);
    got = pull(d->na, d->nb, d->peer, d->toks, d->hs, n, secs(60), NULL, &r);
    cr_assert_eq(got, n, "%s", km_strerror(r.status));
    pr_node_stats(d->na, &st);
    cr_assert_eq(st.fetches_refused, 1);
    release_and_check(d->nb, d->peer, d->na, d->b, d->a);
    duo_close(d);
}

Test(xfer_peer, a_holder_answers_only_reads_of_pages_its_lease_offered, .timeout = 120)
{
    holder_refuses(tamper_unoffered);
}

Test(xfer_peer, a_holder_answers_a_read_only_at_the_place_its_lease_offered_it, .timeout = 120)
{
    holder_refuses(tamper_misplaced);
}

/* ---------------------------------------------------------------- partial, leases, deadlines */

Test(xfer_peer, a_holder_with_part_of_the_chain_offers_that_part, .timeout = 120)
{
    duo *d = duo_open(SMALL, 32, 7, PR_MODE_GET);
    kv_store *a = d->a, *b = d->b;
    pr_node *na = d->na, *nb = d->nb;
    pr_peer *peer = d->peer;
    const int32_t *toks = d->toks;
    const km_pagehash *hs = d->hs;
    compute(b, SMALL, toks, hs, 3);
    pr_pull_result r;
    cr_assert_eq(pull(na, nb, peer, toks, hs, 12, secs(60), NULL, &r), 4);
    cr_assert_eq(r.pages_local, 3);
    cr_assert_eq(r.pages_wanted, 9);
    cr_assert_eq(r.pages_offered, 4);
    cr_assert_eq(kv_store_lookup(b, hs, toks, 12, NULL), 7);
    same_bytes(a, b, toks, hs, 7);
    /* a chain the holder does not have: an empty offer, nothing reserved */
    int32_t other[4 * PT];
    km_pagehash oh[4];
    mk_chain(other, oh, 4, 1);
    cr_assert_eq(pull(na, nb, peer, other, oh, 4, secs(60), NULL, &r), 0);
    cr_assert_eq(r.pages_offered, 0);
    cr_assert_eq(r.status, KM_ENOTFOUND);
    release_and_check(nb, peer, na, b, a);
    duo_close(d);
}

/* A holder alone: a node over a store that computed a 4-page chain, and the offer of a lease on
 * all of it to `requester`. */
typedef struct solo {
    kv_store *a;
    pr_node *na;
    int32_t toks[4 * PT];
    km_pagehash hs[4];
    pr_pull_req req;
    pr_offer o;
} solo;

static solo *solo_open(int lease_ms, uint64_t requester)
{
    static solo x;
    x.a = mk_store(SMALL, KN_KV_F16, 16);
    x.na = mk_node(x.a, PR_MODE_GET, lease_ms);
    mk_chain(x.toks, x.hs, 4, 0);
    compute(x.a, SMALL, x.toks, x.hs, 4);
    x.req = (pr_pull_req){.pull_id = 1,
                          .requester = requester,
                          .first = 0,
                          .n_pages = 4,
                          .page_tokens = PT,
                          .hashes = x.hs,
                          .tokens = x.toks};
    cr_assert_eq(pr_serve(x.na, &x.req), 0);
    const uint64_t guard = secs(60);
    while (pr_node_poll(x.na, &x.o, 1) == 0) {
        cr_assert_lt(km_now_ns(), guard, "no offer");
        km_sleep_ms(1);
    }
    cr_assert_eq(x.o.n, 4);
    return &x;
}

Test(xfer_peer, a_lease_nobody_ends_runs_out_and_unpins, .timeout = 120)
{
    solo *x = solo_open(50, 0);
    kv_store *a = x->a;
    pr_node *na = x->na;
    pr_pull_req req = x->req;
    pr_offer o = x->o;
    kv_store_stats st;
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 4);
    pr_stats ps;
    uint64_t guard = secs(30);
    do {
        km_sleep_ms(10);
        pr_node_poll(na, &o, 1);
        pr_node_stats(na, &ps);
    } while (ps.leases_active && km_now_ns() < guard);
    cr_assert_eq(ps.leases_expired, 1);
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 0);
    /* a bad request gets a refusal, not silence */
    req.page_tokens = PT * 2;
    cr_assert_eq(pr_serve(na, &req), KM_EPROTO);
    cr_assert_eq(pr_node_poll(na, &o, 1), 1);
    cr_assert_eq(o.status, KM_EPROTO);
    cr_assert_eq(o.n, 0);
    pr_node_destroy(na);
    kv_store_destroy(a);
}

Test(xfer_peer, only_the_requester_ends_its_lease, .timeout = 120)
{
    /* a member that learns (or guesses) a lease id cannot end another puller's lease early */
    solo *x = solo_open(60000, 0x1234);
    kv_store *a = x->a;
    pr_node *na = x->na;
    const pr_offer o = x->o;
    pr_pull_done other = {.lease_id = o.lease_id, .requester = 0x9999, .pages_ok = 4};
    cr_assert_eq(pr_serve_done(na, &other), 0);
    pr_pull_done anyone = {.lease_id = o.lease_id, .pages_ok = 4};
    cr_assert_eq(pr_serve_done(na, &anyone), 0);
    pr_stats ps;
    pr_node_stats(na, &ps);
    cr_assert_eq(ps.leases_active, 1, "another requester's done ended the lease");
    cr_assert_eq(ps.dones_ignored, 2);
    kv_store_stats st;
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 4);
    pr_pull_done mine = {.lease_id = o.lease_id, .requester = 0x1234, .pages_ok = 4};
    cr_assert_eq(pr_serve_done(na, &mine), 1);
    pr_node_stats(na, &ps);
    cr_assert_eq(ps.leases_active, 0);
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 0);
    cr_assert_eq(pr_serve_done(na, &mine), 0, "a lease ends once");
    pr_node_destroy(na);
    kv_store_destroy(a);
}

Test(xfer_peer, a_pull_past_its_deadline_fails_the_peer_and_leaves_nothing, .timeout = 120)
{
    duo *d = duo_open(SMALL, 32, 8, PR_MODE_GET);
    kv_store *a = d->a, *b = d->b;
    pr_node *na = d->na, *nb = d->nb;
    pr_peer *peer = d->peer;
    const int32_t *toks = d->toks;
    const km_pagehash *hs = d->hs;
    pr_pull_result r;
    cr_assert_eq(pull(na, nb, peer, toks, hs, 8, km_now_ns(), NULL, &r), 0);
    cr_assert_eq(r.status, KM_ETIMEDOUT);
    cr_assert_eq(r.dropped[PR_DROP_TIMEOUT], 1);
    cr_assert(pr_peer_failed(peer), "a peer that missed a deadline is failed");
    cr_assert_eq(kv_store_lookup(b, hs, toks, 8, NULL), 0);
    release_and_check(nb, peer, na, b, a);
    /* a fresh connection works again */
    peer = connect_to(nb, na);
    cr_assert_eq(pull(na, nb, peer, toks, hs, 8, secs(60), NULL, &r), 8);
    release_and_check(nb, peer, na, b, a);
    duo_close(d);
}

/* A pull past its deadline on a peer that is alive (pages came in a moment ago) ends alone: the
 * connection its other pulls share stays, and the next pull on it reads what is missing. */
static void deadline_on_a_live_peer(pr_mode mode)
{
    duo *d = duo_open(SMALL, 32, 16, mode);
    pr_pull_result r;
    cr_assert_eq(pull(d->na, d->nb, d->peer, d->toks, d->hs, 8, secs(60), NULL, &r), 8);
    const uint64_t live = km_now_ns();
    cr_assert_eq(pull(d->na, d->nb, d->peer, d->toks, d->hs, 16, km_now_ns(), NULL, &r), 0);
    cr_assert_eq(r.status, KM_ETIMEDOUT);
    cr_assert_eq(r.pages_local, 8);
    if (km_now_ns() - live < 500ull * 1000 * 1000) /* else the machine stalled: silent is right */
        cr_assert_not(pr_peer_failed(d->peer), "a live peer keeps its connection");
    else
        cr_log_warn("the timed-out pull took over 0.5 s here: the peer may count as silent");
    if (!pr_peer_failed(d->peer)) {
        cr_assert_eq(pull(d->na, d->nb, d->peer, d->toks, d->hs, 16, secs(60), NULL, &r), 8);
        same_bytes(d->a, d->b, d->toks, d->hs, 16);
    }
    release_and_check(d->nb, d->peer, d->na, d->b, d->a);
    duo_close(d);
}

Test(xfer_peer, a_pull_past_its_deadline_on_a_live_peer_keeps_the_connection, .timeout = 120)
{
    deadline_on_a_live_peer(PR_MODE_AM);
    deadline_on_a_live_peer(PR_MODE_GET);
}

Test(xfer_peer, finishing_early_cancels_and_reclaims_later, .timeout = 120)
{
    duo *d = duo_open(SMOL, 40, 32, PR_MODE_GET);
    pr_pull *p = duo_start(d, 32, secs(60));
    pr_pull_result r;
    pr_pull_done done;
    int got = pr_pull_finish(d->nb, p, &r, &done); /* at once: most reads still in flight */
    cr_assert_geq(got, 0);
    pr_serve_done(d->na, &done);
    /* whatever arrived intact is indexed when the reads complete; never a wrong page */
    release_and_check(d->nb, d->peer, d->na, d->b, d->a);
    int held = kv_store_lookup(d->b, d->hs, d->toks, 32, NULL);
    if (held) same_bytes(d->a, d->b, d->toks, d->hs, held);
    duo_close(d);
}

/* Releases the puller's peer and polls until its endpoint and peer are gone (or 30 s pass). */
static void release_and_settle(pr_node *puller, pr_peer *peer, pr_stats *st)
{
    pr_peer_release(puller, peer);
    pr_offer o;
    const uint64_t guard = secs(30);
    do {
        pr_node_poll(puller, &o, 1);
        pr_node_stats(puller, st);
        km_sleep_ms(2);
    } while ((st->endpoints || st->peers) && km_now_ns() < guard);
}

Test(xfer_peer, a_holder_that_goes_away_mid_pull_costs_the_pull_only, .timeout = 120)
{
    duo *d = duo_open(SMOL, 72, 64, PR_MODE_GET);
    pr_pull *p = duo_start(d, 64, secs(30));
    /* Mid-pull means reading: the connection is up on both sides (the holder gone while the
     * connection is on its way is the next test). */
    uint64_t guard = secs(60);
    while (pr_pull_pages_settled(p, NULL) == 0 && !pr_pull_done_yet(d->nb, p)) {
        cr_assert_lt(km_now_ns(), guard);
        km_sleep_ms(1);
    }
    pr_node_destroy(d->na); /* the holder's node closes every endpoint and unregisters */
    d->na = NULL;
    guard = secs(60);
    while (!pr_pull_done_yet(d->nb, p)) {
        cr_assert_lt(km_now_ns(), guard);
        km_sleep_ms(2);
    }
    pr_pull_result r;
    pr_pull_done done;
    int got = pr_pull_finish(d->nb, p, &r, &done);
    cr_assert_geq(got, 0);
    if (got < 64) cr_assert_lt(r.status, 0);
    int held = kv_store_lookup(d->b, d->hs, d->toks, 64, NULL);
    cr_assert_eq(held, got);
    if (held) same_bytes(d->a, d->b, d->toks, d->hs, held);
    pr_stats st;
    release_and_settle(d->nb, d->peer, &st);
    cr_assert_eq(st.endpoints, 0);
    int ne, ni;
    kv_xfer_counts(d->b, &ne, &ni);
    cr_assert_eq(ni, 0);
    kv_xfer_counts(d->a, &ne, &ni);
    cr_assert_eq(ne, 0, "the holder's node ended its leases when it closed");
    duo_close(d);
}

/* A holder destroyed while a puller's connection request to it is on its way. Rounds destroy it
 * a little later each time to cross the handshake's steps. UCX's TCP connection manager calls a
 * freed listener when a request it accepted arrives after the listener is gone, and UCX 1.22.0
 * frees the puller's TCP lane under its endpoint when the holder's transport socket resets the
 * lane's fresh connection (ucp_worker_discard_uct_ep_destroy_progress); the node quiesces its
 * listener and its transport's listening sockets before destroying them (peer/ucx.c,
 * docs/transfer.md "Which UCX"). */
Test(xfer_peer, a_holder_that_goes_away_while_a_puller_connects_fails_that_peer_only,
     .timeout = 300)
{
    for (int round = 0; round < 20; round++) {
        duo *d = duo_open(SMALL, 8, 8, PR_MODE_AM);
        for (uint64_t until = km_now_ns() + (uint64_t)round * 50000; km_now_ns() < until;)
            sched_yield(); /* a spread of moments, not a wait for anything */
        pr_node_destroy(d->na);
        d->na = NULL;
        uint64_t guard = secs(30);
        while (!pr_peer_failed(d->peer)) {
            cr_assert_lt(km_now_ns(), guard, "round %d: the puller never saw the holder go", round);
            km_sleep_ms(1);
        }
        pr_stats st;
        release_and_settle(d->nb, d->peer, &st);
        cr_assert_eq(st.endpoints, 0, "round %d", round);
        cr_assert_eq(st.peers, 0, "round %d", round);
        duo_close(d);
    }
}

Test(xfer_peer, a_store_without_an_arena_is_refused)
{
    kv_config c = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 32, .hot_bytes = 1 << 20};
    kv_store *s;
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, &s, &err), 0);
    pr_config pc = {.store = s};
    pr_node *n;
    cr_assert_eq(pr_node_create(&pc, &n, &err), KM_EINVAL);
    cr_assert(strstr(err.msg, "arena"));
    pc.backend = "carrier-pigeon";
    cr_assert_eq(pr_node_create(&pc, &n, &err), KM_EUNSUPPORTED);
    kv_store_destroy(s);
}

Test(xfer_peer, a_malformed_address_is_refused)
{
    kv_store *a = mk_store(SMALL, KN_KV_F16, 8);
    pr_node *na = mk_node(a, PR_MODE_GET, 0);
    const uint8_t *addr;
    size_t len;
    cr_assert_eq(pr_node_address(na, &addr, &len), 0);
    uint8_t buf[4096];
    memcpy(buf, addr, len);
    pr_peer *p;
    km_errbuf err;
    for (size_t cut = 0; cut < len; cut++)
        cr_assert_eq(pr_peer_connect(na, buf, cut, &p, &err), KM_EFORMAT, "cut %zu", cut);
    buf[0] = 'X';
    cr_assert_eq(pr_peer_connect(na, buf, len, &p, &err), KM_EFORMAT);
    pr_node_destroy(na);
    kv_store_destroy(a);
}

/* ---------------------------------------------------------------- many pulls with faults */

static uint8_t *g_flipped; /* the holder byte tamper_payload_once changed, restored after */

/* Changes a byte of a leased page behind the holder's back, on purpose: its progress thread may
 * be sending that page, ordered only through sockets, which ThreadSanitizer cannot see (the one
 * kvmesh function tests/tsan/suppressions.txt names). */
static __attribute__((noinline)) void flip_leased_byte(uint8_t *p)
{
    *p ^= 0x08;
}

static void tamper_payload_once(pr_offer *o, pr_page_desc *d, int32_t *t)
{
    g_flipped = (uint8_t *)(uintptr_t)d[g_bad].addr + 5;
    flip_leased_byte(g_flipped);
}

static void pulls_with_faults(pr_mode mode, int rounds)
{
    const int n = 8;
    km_log_set_level(KM_LOG_ERROR); /* a rejected page is a warning each: 800 of them here */
    kv_store *a = mk_store(SMALL, KN_KV_F16, 16), *b = mk_store(SMALL, KN_KV_F16, 16);
    pr_node *na = mk_node(a, mode, 0), *nb = mk_node(b, mode, 0);
    int32_t toks[8 * PT];
    km_pagehash hs[8];
    mk_chain(toks, hs, n, 0);
    compute(a, SMALL, toks, hs, n);
    pr_peer *peer = connect_to(nb, na);
    const tamper_fn faults[] = {NULL,        tamper_payload_once, tamper_tokens, tamper_parent,
                                tamper_size, tamper_address,      tamper_foreign};
    const pr_drop why[] = {PR_DROP_COUNT,  PR_DROP_CHECKSUM, PR_DROP_TOKENS, PR_DROP_CHAIN,
                           PR_DROP_FORMAT, PR_DROP_FORMAT,   PR_DROP_CHAIN};
    uint64_t expect[PR_DROP_COUNT] = {0}, rng = 12345;
    int clean = 0;
    for (int i = 0; i < rounds; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        int f = (int)((rng >> 33) % 8); /* 7: a deadline that has already passed */
        g_bad = (int)((rng >> 40) % n);
        if (pr_peer_failed(peer)) {
            pr_peer_release(nb, peer);
            peer = connect_to(nb, na);
        }
        pr_pull_result r;
        int got = pull(na, nb, peer, toks, hs, n, f == 7 ? km_now_ns() : secs(60),
                       f == 7 ? NULL : faults[f], &r);
        if (g_flipped) {
            flip_leased_byte(g_flipped);
            g_flipped = NULL;
        }
        if (f == 7) {
            expect[PR_DROP_TIMEOUT]++;
            cr_assert_eq(got, 0);
        } else if (f == 0) {
            cr_assert_eq(got, n, "round %d: %s", i, km_strerror(r.status));
            clean++;
        } else {
            expect[why[f]]++;
            cr_assert_eq(got, g_bad, "round %d fault %d at %d: %d imported", i, f, g_bad, got);
        }
        if (got) same_bytes(a, b, toks, hs, got);
        kv_store_evict_oldest_fraction(b, 1.0); /* so that the next round moves pages again */
        cr_assert_eq(kv_store_lookup(b, hs, toks, n, NULL), 0);
    }
    pr_stats st;
    pr_node_stats(nb, &st);
    for (int d = 0; d < PR_DROP_COUNT; d++)
        cr_assert_eq(st.dropped[d], expect[d], "%s: %llu counted, %llu caused",
                     pr_drop_name((pr_drop)d), (unsigned long long)st.dropped[d],
                     (unsigned long long)expect[d]);
    cr_assert_eq(st.pulls_ok, (uint64_t)clean);
    release_and_check(nb, peer, na, b, a);
    kv_store_stats ks;
    kv_store_stats_get(b, &ks);
    cr_assert_eq(ks.tier[KV_TIER_HOT].pages, 0, "every reserved page went back");
    cr_assert_eq(ks.arena_fallbacks, 0);
    pr_node_destroy(nb);
    pr_node_destroy(na);
    kv_store_destroy(a);
    kv_store_destroy(b);
}

Test(xfer_peer, a_thousand_pulls_with_faults_leave_nothing_behind, .timeout = 900)
{
    pulls_with_faults(PR_MODE_GET, 500);
    pulls_with_faults(PR_MODE_AM, 500);
}

Test(xfer_peer, destroying_a_node_with_pulls_in_flight_releases_everything, .timeout = 120)
{
    duo *d = duo_open(SMOL, 40, 32, PR_MODE_AM);
    pr_pull *p = duo_start(d, 32, secs(60));
    (void)p;
    pr_node_destroy(d->nb); /* the pull, its peer and its pages go with it */
    d->nb = NULL;
    int ne, ni;
    kv_xfer_counts(d->b, &ne, &ni);
    cr_assert_eq(ni, 0);
    km_errbuf err;
    cr_assert_eq(kv_store_check(d->b, &err), 0, "%s", err.msg);
    duo_close(d);
}

/* Pages of [base, base + bytes) that are resident (mincore), of how many. */
static size_t resident_pages(const void *base, size_t bytes, size_t *of)
{
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = (bytes + pg - 1) / pg;
    unsigned char *v = calloc(n, 1);
    cr_assert_not_null(v);
    cr_assert_eq(mincore((void *)base, bytes, v), 0);
    size_t r = 0;
    for (size_t i = 0; i < n; i++) r += v[i] & 1;
    free(v);
    *of = n;
    return r;
}

Test(xfer_peer, a_node_makes_its_arena_resident_in_the_background_when_asked, .timeout = 120)
{
    kv_store *s = mk_store(SMOL, KN_KV_F16, 256); /* 256 pages of 92,160 bytes: 23.6 MB hot */
    kv_mem_region r;
    cr_assert_eq(kv_store_mem_regions(s, &r, 1), 1);
    size_t of, before = resident_pages(r.base, r.bytes, &of);
    cr_assert_lt(before, of / 4, "a fresh arena is not resident (%zu of %zu pages)", before, of);
    /* 0: the hot tier's budget; -1: none; a size: that many leading bytes */
    const long long asked[] = {-1, 8 << 20, 0};
    for (int k = 0; k < 3; k++) {
        pr_config c = {.store = s, .prefault_bytes = asked[k]};
        pr_node *n;
        km_errbuf err;
        cr_assert_eq(pr_node_create(&c, &n, &err), 0, "node: %s", err.msg);
        kv_store_stats ks;
        kv_store_stats_get(s, &ks);
        const uint64_t want = asked[k] < 0   ? 0
                              : asked[k] > 0 ? (uint64_t)asked[k]
                                             : ks.tier[KV_TIER_HOT].budget & ~(uint64_t)4095;
        pr_stats st;
        for (uint64_t end = secs(60); km_now_ns() < end; km_sleep_ms(5)) {
            pr_node_stats(n, &st);
            if (st.prefaulted == st.prefault_target) break;
        }
        pr_node_stats(n, &st);
        cr_assert_eq(st.prefault_target, want, "case %d", k);
        cr_assert_eq(st.prefaulted, want, "case %d: %llu of %llu bytes", k,
                     (unsigned long long)st.prefaulted, (unsigned long long)want);
        if (want) {
            size_t in = resident_pages(r.base, (size_t)want, &of);
            cr_assert_eq(in, of, "case %d: %zu of %zu pages resident", k, in, of);
        }
        pr_node_destroy(n);
    }
    /* a node destroyed while it prefaults stops at once (bounded by one chunk) */
    pr_config c = {.store = s, .prefault_bytes = (long long)r.bytes};
    pr_node *n;
    km_errbuf err;
    cr_assert_eq(pr_node_create(&c, &n, &err), 0, "node: %s", err.msg);
    pr_node_destroy(n);
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_store_destroy(s);
}

/* ---------------------------------------------------------------- answer tags (seal.c) */

/* Seals len bytes of in (into out when h asks for encryption) under key; the tag into h. */
static void seal_msg(pr_seal *s, const uint8_t *key, pr_data_hdr *h, const uint8_t *in,
                     uint8_t *out, size_t len)
{
    cr_assert_eq(pr_seal_begin(s, key, h, 0), 0);
    cr_assert_eq(pr_seal_update(s, in, out, len), 0);
    cr_assert_eq(pr_seal_end(s, h->tag), 0);
}

/* 1 when the message opens (its plaintext into out when encrypted), 0 when its tag fails. */
static int open_msg(pr_seal *s, const uint8_t *key, const pr_data_hdr *h, const uint8_t *in,
                    uint8_t *out, size_t len)
{
    uint8_t tag[PR_TAG_BYTES];
    memcpy(tag, h->tag, sizeof tag);
    cr_assert_eq(pr_seal_begin(s, key, h, 1), 0);
    cr_assert_eq(pr_seal_update(s, in, out, len), 0);
    return pr_seal_end(s, tag) == 0;
}

/* Any changed byte, place, length, flag or key fails the tag; an encrypted page opens to the
 * bytes sealed, and its ciphertext is not them. */
Test(xfer_peer, an_answer_opens_only_as_sealed_under_its_lease_key)
{
    uint8_t secret[PR_KEY_BYTES], tok[PR_TOKEN_BYTES], key[PR_KEY_BYTES], other[PR_KEY_BYTES];
    pr_lease_secret(secret);
    pr_key_derive(secret, tok, key);
    pr_lease_secret(other);
    enum { N = 5000 };
    static uint8_t page[N], wire[N], back[N];
    for (int i = 0; i < N; i++) page[i] = (uint8_t)(i * 13 + 1);
    pr_seal s;
    cr_assert_eq(pr_seal_init(&s), 0);
    for (int enc = 0; enc < 2; enc++) {
        pr_data_hdr h = {.pull_id = 7, .index = 3, .offset = 4096, .len = N};
        h.flags = enc ? PR_DATA_ENCRYPTED : 0;
        memcpy(wire, page, N);
        seal_msg(&s, key, &h, page, enc ? wire : NULL, N);
        if (enc) cr_assert_neq(memcmp(wire, page, N), 0, "encrypted bytes are not the page's");
        cr_assert(open_msg(&s, key, &h, wire, back, N));
        if (enc) cr_assert_eq(memcmp(back, page, N), 0);
        cr_assert_not(open_msg(&s, other, &h, wire, back, N), "another lease's key");
        wire[N / 2] ^= 1;
        cr_assert_not(open_msg(&s, key, &h, wire, back, N), "a changed byte");
        wire[N / 2] ^= 1;
        pr_data_hdr moved = h;
        moved.index = 4;
        cr_assert_not(open_msg(&s, key, &moved, wire, back, N), "another page's place");
        moved = h;
        moved.offset = 0;
        cr_assert_not(open_msg(&s, key, &moved, wire, back, N), "another offset");
        moved = h;
        moved.flags ^= PR_DATA_ENCRYPTED;
        cr_assert_not(open_msg(&s, key, &moved, wire, back, N), "the other flag");
        moved = h;
        moved.len = N - 1;
        cr_assert_not(open_msg(&s, key, &moved, wire, back, N - 1), "a shorter message");
        cr_assert(open_msg(&s, key, &h, wire, back, N), "the key schedule kept is still right");
    }
    pr_seal_free(&s);
}

/* gmac.c's GHASH (AVX-512 and VPCLMULQDQ) makes GCM's tags exactly: a holder of either kind
 * and a reader of the other agree. Every length up to three of its rounds and a page's
 * fragment, given whole and in uneven pieces, against OpenSSL's GCM. */
Test(xfer_peer, the_fast_gmac_tags_as_openssl_does)
{
    pr_seal fast, ossl;
    cr_assert_eq(pr_seal_init(&fast), 0);
    cr_assert_eq(pr_seal_init(&ossl), 0);
    if (!fast.fast) {
        pr_seal_free(&fast);
        pr_seal_free(&ossl);
        cr_skip_test("this CPU has no VPCLMULQDQ: OpenSSL's GCM only");
    }
    ossl.fast = 0;
    enum { N = 61440 + 77 };
    static uint8_t data[N];
    uint8_t key[PR_KEY_BYTES];
    srand(31);
    for (int i = 0; i < N; i++) data[i] = (uint8_t)rand();
    for (int k = 0; k < PR_KEY_BYTES; k++) key[k] = (uint8_t)rand();
    static const size_t lens[] = {61440, N, 4096, 16384};
    for (size_t len = 0; len < 3 * 16 * PR_GMAC_POWERS + 40; len++)
        for (int pieces = 0; pieces < 2; pieces++) {
            pr_data_hdr h = {.index = (uint32_t)len, .offset = 4096, .len = (uint32_t)len};
            uint8_t t1[PR_TAG_BYTES], t2[PR_TAG_BYTES];
            cr_assert_eq(pr_seal_begin(&fast, key, &h, 0), 0);
            for (size_t at = 0, c = 1; at < len; at += c, c = c * 3 + 1) {
                if (!pieces || c > len - at) c = len - at;
                cr_assert_eq(pr_seal_update(&fast, data + at, NULL, c), 0);
            }
            cr_assert_eq(pr_seal_end(&fast, t1), 0);
            cr_assert_eq(pr_seal_begin(&ossl, key, &h, 0), 0);
            cr_assert_eq(pr_seal_update(&ossl, data, NULL, len), 0);
            cr_assert_eq(pr_seal_end(&ossl, t2), 0);
            cr_assert_eq(memcmp(t1, t2, PR_TAG_BYTES), 0, "length %zu, pieces %d", len, pieces);
            cr_assert_eq(pr_seal_begin(&fast, key, &h, 1), 0); /* and it opens */
            cr_assert_eq(pr_seal_update(&fast, data, NULL, len), 0);
            cr_assert_eq(pr_seal_end(&fast, t2), 0, "length %zu", len);
        }
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
        const size_t len = lens[i];
        pr_data_hdr h = {.index = 9, .offset = len, .len = (uint32_t)len};
        uint8_t t1[PR_TAG_BYTES], t2[PR_TAG_BYTES];
        cr_assert_eq(pr_seal_begin(&fast, key, &h, 0), 0);
        for (size_t at = 0; at < len; at += 16384)
            cr_assert_eq(
                pr_seal_update(&fast, data + at, NULL, len - at < 16384 ? len - at : 16384), 0);
        cr_assert_eq(pr_seal_end(&fast, t1), 0);
        cr_assert_eq(pr_seal_begin(&ossl, key, &h, 0), 0);
        cr_assert_eq(pr_seal_update(&ossl, data, NULL, len), 0);
        cr_assert_eq(pr_seal_end(&ossl, t2), 0);
        cr_assert_eq(memcmp(t1, t2, PR_TAG_BYTES), 0, "length %zu", len);
        data[len / 2] ^= 1; /* a changed byte fails */
        cr_assert_eq(pr_seal_begin(&fast, key, &h, 1), 0);
        cr_assert_eq(pr_seal_update(&fast, data, NULL, len), 0);
        cr_assert_eq(pr_seal_end(&fast, t1), KM_ECORRUPT, "length %zu", len);
        data[len / 2] ^= 1;
    }
    pr_seal_free(&fast);
    pr_seal_free(&ossl);
}

/* ---------------------------------------------------------------- forged answers */

static void forger_err(void *arg, ucp_ep_h ep, ucs_status_t status) {}

static void forger_sent(void *req, ucs_status_t status, void *arg)
{
    (*(int *)arg)--;
    ucp_request_free(req);
}

/* While a pull of 64 pages reads, a process of its own UCX connects to the puller's listener
 * and answers fetches it never saw: refusals and fragments for every pull id and page it may
 * guess, with a made-up token; then fragments with the pull's real token (as if it had seen a
 * fetch on the wire) but a tag it cannot make. The pull imports the holder's bytes and nothing
 * else, and the puller counts what it dropped. */
Test(xfer_peer, forged_answers_from_another_endpoint_change_nothing, .timeout = 120)
{
    duo *d = duo_open(SMOL, 72, 64, PR_MODE_AM);
    const uint8_t *ab;
    size_t alen;
    pr_addr pa;
    cr_assert_eq(pr_node_address(d->nb, &ab, &alen), 0);
    cr_assert_eq(pr_addr_parse(ab, alen, &pa), 0);
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_params_t prm = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    cr_assert_eq(ucp_init(&prm, NULL, &ctx), UCS_OK);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    cr_assert_eq(ucp_worker_create(ctx, &wp, &w), UCS_OK);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)pa.port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {(struct sockaddr *)&sa, sizeof sa},
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {forger_err, NULL}};
    ucp_ep_h e;
    cr_assert_eq(ucp_ep_create(w, &ep, &e), UCS_OK);
    ucp_request_param_t fp = {0}; /* connected before the pull starts */
    void *fr = ucp_ep_flush_nbx(e, &fp);
    const uint64_t up = secs(30);
    while (UCS_PTR_IS_PTR(fr) && ucp_request_check_status(fr) == UCS_INPROGRESS) {
        cr_assert_lt(km_now_ns(), up, "the forger never connected");
        ucp_worker_progress(w);
    }
    if (UCS_PTR_IS_PTR(fr)) ucp_request_free(fr);
    pr_pull *p = duo_start(d, 64, secs(60));
    static uint8_t junk[4096];
    memset(junk, 0x3c, sizeof junk);
    int inflight = 0, sent = 0;
    for (int round = 0; round < 2; round++)
        for (uint64_t id = 0; id < 4; id++)
            for (uint32_t i = 0; i < 64; i++) {
                pr_data_hdr h = {.pull_id = id, .index = i, .len = sizeof junk};
                if (round) memcpy(h.token, p->token, PR_TOKEN_BYTES); /* seen on the wire */
                memset(h.tag, 0x5a, sizeof h.tag);
                ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                          UCP_OP_ATTR_FIELD_USER_DATA |
                                                          UCP_OP_ATTR_FIELD_FLAGS,
                                          .flags = UCP_AM_SEND_FLAG_EAGER,
                                          .cb.send = forger_sent,
                                          .user_data = &inflight};
                for (int refusal = 0; refusal < 2 - round; refusal++, sent++) {
                    h.status = (uint32_t)refusal;
                    void *r = ucp_am_send_nbx(e, PR_AM_DATA, &h, sizeof h, refusal ? NULL : junk,
                                              refusal ? 0 : sizeof junk, &rp);
                    if (UCS_PTR_IS_PTR(r)) inflight++;
                }
                ucp_worker_progress(w);
            }
    const uint64_t guard = secs(60);
    while (!pr_pull_done_yet(d->nb, p) || inflight > 0) {
        cr_assert_lt(km_now_ns(), guard, "the pull never ended");
        ucp_worker_progress(w);
        pr_offer none[1];
        pr_node_poll(d->na, none, 1);
    }
    pr_pull_result res;
    pr_pull_done done;
    const int got = pr_pull_finish(d->nb, p, &res, &done);
    pr_serve_done(d->na, &done);
    /* a fragment with the real token may land before the holder's and fail the page (auth), or
     * overrun it (transfer): never imported; what was imported is the holder's */
    cr_assert_eq(res.dropped[PR_DROP_CHECKSUM], 0);
    if (got) same_bytes(d->a, d->b, d->toks, d->hs, got);
    cr_assert_eq(got + res.dropped[PR_DROP_AUTH] + res.dropped[PR_DROP_TRANSFER] > 0, 1);
    pr_stats st;
    pr_node_stats(d->nb, &st);
    cr_assert_gt(st.answers_forged, 0, "%d forged answers sent", sent);
    ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *r = ucp_ep_close_nbx(e, &cp);
    while (UCS_PTR_IS_PTR(r) && ucp_request_check_status(r) == UCS_INPROGRESS)
        ucp_worker_progress(w);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    /* an honest pull right after is served whole */
    kv_store_evict_oldest_fraction(d->b, 1.0);
    pr_pull_result r2;
    cr_assert_eq(pull(d->na, d->nb, d->peer, d->toks, d->hs, 64, secs(60), NULL, &r2), 64);
    same_bytes(d->a, d->b, d->toks, d->hs, 64);
    release_and_check(d->nb, d->peer, d->na, d->b, d->a);
    duo_close(d);
}
