/*
 * test_xfer_store.c — kvshard's side of page transfer, without a network: the page-memory arena
 * (every page buffer inside the registered region, slabs reused across formats, fallback when
 * full), exports (pinned verified prefixes, leases, checksums), imports (reserve, commit as if
 * computed locally, conversion, abort) between two stores in one process, with memcpy standing
 * in for the transport. The network side is test_xfer_peer.c.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h" /* kv_store_check */

#define L  2
#define H  2
#define HD 32
#define PT 4

static float kval(int tok, int pos, int l, int h, int c)
{
    return (float)((tok * 7 + pos * 13 + l * 3 + h * 5 + c) % 32 - 16) / 8.0f;
}
static float vval(int tok, int pos, int l, int h, int c)
{
    return (float)((tok * 5 + pos * 11 + l * 7 + h * 3 + c) % 32 - 16) / 16.0f;
}

static size_t f16_page(void)
{
    return (size_t)PT * HD * 2 * 2 * L * H;
}

static kv_config cfg(kv_format f, size_t pages, int arena)
{
    return (kv_config){.n_layers = L,
                       .n_kv_heads = H,
                       .head_dim = HD,
                       .page_tokens = PT,
                       .format = f,
                       .hot_bytes = pages * f16_page(),
                       .arena = arena};
}

static kv_store *mk_cfg(const kv_config *c)
{
    kv_store *s;
    km_errbuf err;
    cr_assert_eq(kv_store_create(c, &s, &err), 0, "create: %s", err.msg);
    return s;
}

static kv_store *mk(kv_format f, size_t pages, int arena)
{
    kv_config c = cfg(f, pages, arena);
    return mk_cfg(&c);
}

/* Computes and publishes n_pages pages of toks in s (the K/V depend on token and position),
 * reusing the cached prefix as a request would; returns how many were new to the index. */
static int compute_new(kv_store *s, const int32_t *toks, const km_pagehash *hashes, int n_pages)
{
    kv_seq *q;
    cr_assert_eq(kv_seq_create(s, &q), 0);
    const int n = n_pages * PT;
    int held = kv_seq_attach(s, q, hashes, toks, n_pages);
    cr_assert_geq(held, 0);
    kv_seq_wait_ready(s, q);
    cr_assert_eq(kv_seq_reserve(s, q, n), 0);
    float k[H * HD], v[H * HD];
    for (int p = held * PT; p < n; p++)
        for (int l = 0; l < L; l++) {
            for (int h = 0; h < H; h++)
                for (int c = 0; c < HD; c++) {
                    k[h * HD + c] = kval(toks[p], p, l, h, c);
                    v[h * HD + c] = vval(toks[p], p, l, h, c);
                }
            kv_seq_write(s, q, l, p, k, v);
        }
    int fresh = kv_seq_publish(s, q, hashes, toks, n);
    kv_seq_destroy(s, q);
    return fresh;
}

static void compute(kv_store *s, const int32_t *toks, const km_pagehash *hashes, int n_pages)
{
    cr_assert_eq(compute_new(s, toks, hashes, n_pages), n_pages);
}

/* Max abs error of s's cached chain against the reference values (attached in a sequence). */
static float read_back(kv_store *s, const int32_t *toks, const km_pagehash *hashes, int n_pages)
{
    kv_seq *q;
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_attach(s, q, hashes, toks, n_pages), n_pages);
    float k[HD], v[HD], err = 0;
    for (int p = 0; p < n_pages * PT; p++)
        for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++) {
                cr_assert_eq(kv_seq_read(s, q, l, h, p, k, v), 0);
                for (int c = 0; c < HD; c++) {
                    err = fmaxf(err, fabsf(k[c] - kval(toks[p], p, l, h, c)));
                    err = fmaxf(err, fabsf(v[c] - vval(toks[p], p, l, h, c)));
                }
            }
    kv_seq_destroy(s, q);
    return err;
}

static void chain(int32_t *toks, km_pagehash *hashes, int n_pages, int salt)
{
    for (int i = 0; i < n_pages * PT; i++) toks[i] = 1000 + i * 3 + salt;
    km_pagehash seed = km_pagehash_seed("model", 5, 42, NULL, 0);
    cr_assert_eq(km_pagehash_chain(seed, toks, n_pages * PT, PT, hashes, n_pages), n_pages);
}

/* Moves pages [k, n) of the chain from a to b as a transfer layer would; returns pages indexed. */
static int transfer(kv_store *a, kv_store *b, const int32_t *toks, const km_pagehash *hashes, int n,
                    int corrupt_at)
{
    uint64_t imp;
    int k = kv_import_begin(b, hashes, toks, n, &imp);
    cr_assert(k >= 0);
    if (k == n) return 0;
    uint64_t exp;
    int held = kv_export_begin(a, hashes, toks, n, 0, &exp);
    cr_assert_eq(held, n);
    kv_xfer_page src[64], dst[64];
    int rc;
    while ((rc = kv_export_pages(a, exp, k, n - k, src)) == KM_EAGAIN) {
    }
    cr_assert_eq(rc, 0);
    kv_format wire[64];
    for (int i = 0; i < n - k; i++) wire[i] = src[i].format;
    cr_assert_eq(kv_import_reserve(b, imp, n - k, wire, dst), n - k);
    int ok = 0;
    for (int i = 0; i < n - k; i++) {
        cr_assert_eq(dst[i].bytes, src[i].bytes);
        cr_assert_eq(dst[i].index, src[i].index);
        cr_assert(km_pagehash_eq(dst[i].hash, src[i].hash));
        memcpy(dst[i].buf, src[i].buf, src[i].bytes);
        if (i == corrupt_at) dst[i].buf[7] ^= 0x10;
        /* the receiver's own check: its expected identity, the holder's checksum */
        dst[i].checksum = kv_xfer_checksum(&dst[i], PT, dst[i].buf);
        if (dst[i].checksum != src[i].checksum) break;
        ok++;
    }
    km_errbuf err;
    cr_assert_eq(kv_store_check(a, &err), 0, "holder: %s", err.msg);
    cr_assert_eq(kv_store_check(b, &err), 0, "receiver: %s", err.msg);
    cr_assert_eq(kv_export_end(a, exp), 0);
    int got = kv_import_commit(b, imp, ok);
    cr_assert_eq(kv_store_check(b, &err), 0, "receiver after commit: %s", err.msg);
    return got;
}

/* Two arena stores; the holder a has computed the first n pages of a chain. */
typedef struct pair {
    kv_store *a, *b;
    int32_t toks[64 * PT];
    km_pagehash hs[64];
} pair;

static void pair_open(pair *p, kv_format fa, kv_format fb, int n)
{
    p->a = mk(fa, 64, 1);
    p->b = mk(fb, 64, 1);
    chain(p->toks, p->hs, n, 0);
    compute(p->a, p->toks, p->hs, n);
}

static void pair_close(pair *p)
{
    kv_store_destroy(p->a);
    kv_store_destroy(p->b);
}

Test(xfer_store, arena_holds_every_page_buffer)
{
    kv_store *s = mk(KN_KV_F16, 64, 1);
    kv_mem_region r[2];
    cr_assert_eq(kv_store_mem_regions(s, r, 2), 1);
    cr_assert(r[0].bytes >= 64 * f16_page());
    int32_t toks[16 * PT];
    km_pagehash hs[16];
    chain(toks, hs, 16, 0);
    compute(s, toks, hs, 16);
    uint64_t id;
    cr_assert_eq(kv_export_begin(s, hs, toks, 16, 0, &id), 16);
    kv_xfer_page pg[16];
    cr_assert_eq(kv_export_pages(s, id, 0, 16, pg), 0);
    for (int i = 0; i < 16; i++) {
        cr_assert_eq(pg[i].region, 0);
        cr_assert((uint8_t *)pg[i].buf >= (uint8_t *)r[0].base);
        cr_assert((uint8_t *)pg[i].buf + pg[i].bytes <= (uint8_t *)r[0].base + r[0].bytes);
    }
    kv_export_end(s, id);
    /* A live conversion frees the f16 slabs and the fp8 pages reuse them. */
    cr_assert_eq(kv_store_convert(s, KN_KV_FP8), 16);
    cr_assert_lt(read_back(s, toks, hs, 16), 0.15f);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.arena_fallbacks, 0);
    kv_store_destroy(s);

    kv_store *plain = mk(KN_KV_F16, 8, 0);
    cr_assert_eq(kv_store_mem_regions(plain, r, 2), 0);
    kv_store_destroy(plain);
}

Test(xfer_store, full_arena_falls_back_and_counts)
{
    kv_config c = cfg(KN_KV_F16, 256, 1);
    c.arena_bytes = 1; /* one slab */
    kv_store *s = mk_cfg(&c);
    int32_t toks[200 * PT];
    km_pagehash hs[200];
    chain(toks, hs, 200, 0);
    compute(s, toks, hs, 200);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_gt(st.arena_fallbacks, 0);
    cr_assert_lt(read_back(s, toks, hs, 200), 1e-6f);
    uint64_t id;
    cr_assert_eq(kv_export_begin(s, hs, toks, 200, 0, &id), 200);
    kv_xfer_page pg[200];
    cr_assert_eq(kv_export_pages(s, id, 0, 200, pg), 0);
    int outside = 0;
    for (int i = 0; i < 200; i++) outside += pg[i].region < 0;
    cr_assert_gt(outside, 0, "pages outside the arena say so (a transfer layer refuses them)");
    kv_store_destroy(s); /* with the export still alive: freed with the store */
}

Test(xfer_store, pull_between_two_stores_is_exact_and_indexed)
{
    pair P;
    pair_open(&P, KN_KV_F16, KN_KV_F16, 16);
    kv_store *a = P.a, *b = P.b;
    const int32_t *toks = P.toks;
    const km_pagehash *hs = P.hs;
    kv_event ev[64];
    kv_store_events_drain(b, ev, 64);
    cr_assert_eq(transfer(a, b, toks, hs, 16, -1), 16);
    cr_assert_eq(kv_store_lookup(b, hs, toks, 16, NULL), 16);
    cr_assert_lt(read_back(b, toks, hs, 16), 1e-6f); /* f16 of these values is exact */
    int n = kv_store_events_drain(b, ev, 64), stored = 0;
    for (int i = 0; i < n; i++) stored += ev[i].kind == KV_EVENT_STORED;
    cr_assert_eq(stored, 16, "one STORED event per imported page");
    /* the pages are cached, not pinned, and the holder's are unpinned again */
    kv_store_stats st;
    kv_store_stats_get(b, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 0);
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 0);
    int ne, ni;
    kv_xfer_counts(a, &ne, &ni);
    cr_assert_eq(ne + ni, 0);
    kv_xfer_counts(b, &ne, &ni);
    cr_assert_eq(ne + ni, 0);
    pair_close(&P);
}

Test(xfer_store, only_the_missing_suffix_moves)
{
    pair P;
    pair_open(&P, KN_KV_F16, KN_KV_F16, 12);
    kv_store *a = P.a, *b = P.b;
    const int32_t *toks = P.toks;
    const km_pagehash *hs = P.hs;
    compute(b, toks, hs, 5);
    uint64_t imp;
    cr_assert_eq(kv_import_begin(b, hs, toks, 12, &imp), 5);
    kv_import_abort(b, imp);
    cr_assert_eq(transfer(a, b, toks, hs, 12, -1), 7);
    cr_assert_eq(kv_store_lookup(b, hs, toks, 12, NULL), 12);
    cr_assert_lt(read_back(b, toks, hs, 12), 1e-6f);
    pair_close(&P);
}

Test(xfer_store, a_corrupted_page_ends_the_chain_there)
{
    pair P;
    pair_open(&P, KN_KV_F16, KN_KV_F16, 8);
    kv_store *a = P.a, *b = P.b;
    int before = kv_store_pages_free(b);
    cr_assert_eq(transfer(a, b, P.toks, P.hs, 8, 3), 3);
    cr_assert_eq(kv_store_lookup(b, P.hs, P.toks, 8, NULL), 3);
    kv_store_stats st;
    kv_store_stats_get(b, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pages, 3, "the other reserved pages went back");
    cr_assert_eq(kv_store_pages_free(b), before - 3);
    pair_close(&P);
}

/* Pages travel in the holder's format and are converted into the receiver's. */
static void convert_case(kv_format from, kv_format to, float tol)
{
    pair P;
    pair_open(&P, from, to, 8);
    cr_assert_eq(transfer(P.a, P.b, P.toks, P.hs, 8, -1), 8);
    float ea = read_back(P.a, P.toks, P.hs, 8), eb = read_back(P.b, P.toks, P.hs, 8);
    cr_assert_lt(eb, tol, "%s -> %s: error %g (holder's own %g)", kv_format_name(from),
                 kv_format_name(to), eb, ea);
    if (from == to) cr_assert_eq(ea, eb, "same format: bit-identical values");
    pair_close(&P);
}

Test(xfer_store, every_format_and_conversion)
{
    const kv_format fs[] = {KN_KV_F16, KN_KV_BF16, KN_KV_FP8, KN_KV_INT8, KN_KV_INT4};
    const float tol[] = {1e-6f, 0.02f, 0.08f, 0.02f, 0.25f};
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 5; j++) convert_case(fs[i], fs[j], fmaxf(tol[i], tol[j]) * 2);
}

Test(xfer_store, quantized_pages_move_fewer_bytes)
{
    kv_store *s = mk(KN_KV_F16, 8, 0);
    size_t f16 = kv_store_format_page_bytes(s, KN_KV_F16);
    cr_assert_lt(kv_store_format_page_bytes(s, KN_KV_FP8), f16 * 6 / 10);
    cr_assert_lt(kv_store_format_page_bytes(s, KN_KV_INT8), f16 * 6 / 10);
    cr_assert_lt(kv_store_format_page_bytes(s, KN_KV_INT4),
                 kv_store_format_page_bytes(s, KN_KV_FP8));
    kv_store_destroy(s);
}

Test(xfer_store, leases_expire_and_unpin)
{
    kv_store *a = mk(KN_KV_F16, 64, 1);
    int32_t toks[8 * PT];
    km_pagehash hs[8];
    chain(toks, hs, 8, 0);
    compute(a, toks, hs, 8);
    uint64_t e1, e2;
    cr_assert_eq(kv_export_begin(a, hs, toks, 8, 1000, &e1), 8);
    cr_assert_eq(kv_export_begin(a, hs, toks, 4, 0, &e2), 4);
    kv_store_stats st;
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 8);
    cr_assert_eq(kv_export_expire(a, 999), 0);
    cr_assert_eq(kv_export_expire(a, 1000), 1);
    kv_xfer_page pg[8];
    cr_assert_eq(kv_export_pages(a, e1, 0, 8, pg), KM_ENOTFOUND);
    cr_assert_eq(kv_export_end(a, e1), KM_ENOTFOUND);
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 4);
    cr_assert_eq(kv_export_end(a, e2), 0);
    kv_store_stats_get(a, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 0);
    /* a chain the store does not hold gives nothing and no handle */
    int32_t other[8 * PT];
    km_pagehash oh[8];
    chain(other, oh, 8, 1);
    uint64_t e3 = 77;
    cr_assert_eq(kv_export_begin(a, oh, other, 8, 0, &e3), 0);
    cr_assert_eq(e3, 0);
    kv_store_destroy(a);
}

Test(xfer_store, checksum_covers_identity_tokens_and_payload)
{
    int32_t toks[PT] = {1, 2, 3, 4};
    uint8_t payload[64] = {0};
    kv_xfer_page p = {.format = KN_KV_F16,
                      .index = 3,
                      .hash = {1, 2},
                      .parent = {3, 4},
                      .tokens = toks,
                      .buf = payload,
                      .bytes = sizeof payload};
    uint64_t c0 = kv_xfer_checksum(&p, PT, payload);
    kv_xfer_page q = p;
    q.index = 4;
    cr_assert_neq(kv_xfer_checksum(&q, PT, payload), c0);
    q = p;
    q.parent.lo ^= 1;
    cr_assert_neq(kv_xfer_checksum(&q, PT, payload), c0);
    q = p;
    q.format = KN_KV_BF16;
    cr_assert_neq(kv_xfer_checksum(&q, PT, payload), c0);
    toks[2] = 9;
    cr_assert_neq(kv_xfer_checksum(&p, PT, payload), c0);
    toks[2] = 3;
    payload[63] = 1;
    cr_assert_neq(kv_xfer_checksum(&p, PT, payload), c0);
    payload[63] = 0;
    cr_assert_eq(kv_xfer_checksum(&p, PT, payload), c0);
}

Test(xfer_store, checksum_in_pieces_as_a_page_lands_equals_the_whole)
{
    int32_t toks[PT] = {5, 6, 7, 8};
    enum { B = 368640 };
    uint8_t *payload = malloc(B);
    for (int i = 0; i < B; i++) payload[i] = (uint8_t)(i * 131 + (i >> 9));
    kv_xfer_page p = {.format = KN_KV_F16,
                      .index = 2,
                      .hash = {7, 8},
                      .parent = {9, 10},
                      .tokens = toks,
                      .buf = payload,
                      .bytes = B};
    const uint64_t whole = kv_xfer_checksum(&p, PT, payload);
    const size_t frag[] = {1, 61440, 100, 4096, 7};
    for (unsigned f = 0; f < sizeof frag / sizeof frag[0]; f++) {
        kv_xfer_sum s = {{0}};
        kv_xfer_sum_begin(&s, &p, PT);
        for (size_t at = 0; at < B; at += frag[f])
            kv_xfer_sum_update(&s, payload + at, at + frag[f] <= B ? frag[f] : B - at);
        cr_assert_eq(kv_xfer_sum_end(&s), whole, "fragments of %zu bytes", frag[f]);
    }
    free(payload);
}

Test(xfer_store, transfers_in_flight_keep_their_buffers_through_recovery_level_2)
{
    pair P;
    pair_open(&P, KN_KV_F16, KN_KV_F16, 8);
    compute(P.b, P.toks, P.hs, 2);
    km_errbuf err;
    uint64_t imp, exp;
    cr_assert_eq(kv_import_begin(P.b, P.hs, P.toks, 8, &imp), 2);
    cr_assert_eq(kv_export_begin(P.a, P.hs, P.toks, 8, 0, &exp), 8);
    kv_xfer_page src[8], dst[6];
    cr_assert_eq(kv_export_pages(P.a, exp, 2, 6, src), 0);
    kv_format wire[6];
    for (int i = 0; i < 6; i++) wire[i] = src[i].format;
    cr_assert_eq(kv_import_reserve(P.b, imp, 6, wire, dst), 6);
    cr_assert_eq(kv_store_check(P.a, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_store_check(P.b, &err), 0, "%s", err.msg);
    /* level 2 on both stores while the pages are lent: their buffers stay put */
    kv_store_convert(P.a, KN_KV_FP8);
    kv_store_convert(P.b, KN_KV_FP8);
    kv_xfer_page again[6];
    cr_assert_eq(kv_export_pages(P.a, exp, 2, 6, again), 0);
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(again[i].buf, src[i].buf);
        cr_assert_eq(again[i].checksum, src[i].checksum);
        memcpy(dst[i].buf, src[i].buf, src[i].bytes);
    }
    cr_assert_eq(kv_store_check(P.b, &err), 0, "%s", err.msg);
    kv_export_end(P.a, exp);
    cr_assert_eq(kv_import_commit(P.b, imp, 6), 6);
    cr_assert_eq(kv_store_check(P.b, &err), 0, "%s", err.msg);
    cr_assert_lt(read_back(P.b, P.toks, P.hs, 8), 0.15f);
    int ne, ni;
    kv_xfer_counts(P.b, &ne, &ni);
    cr_assert_eq(ne + ni, 0);
    pair_close(&P);
}

Test(xfer_store, an_import_is_not_a_hit_or_a_miss)
{
    pair P;
    pair_open(&P, KN_KV_F16, KN_KV_F16, 4);
    kv_store_stats before, after;
    kv_store_stats_get(P.b, &before);
    uint64_t imp;
    cr_assert_eq(kv_import_begin(P.b, P.hs, P.toks, 4, &imp), 0);
    kv_import_abort(P.b, imp);
    kv_store_stats_get(P.b, &after);
    cr_assert_eq(after.hits, before.hits);
    cr_assert_eq(after.misses, before.misses);
    pair_close(&P);
}

/* ---------------------------------------------------------------- handoff chains */

typedef struct got_chains {
    int n, len[8];
    km_pagehash leaf[8];
} got_chains;

/* Records each chain given (its length and leaf). */
static int take_chain(void *arg, const km_pagehash *hs, const int32_t *toks, int n)
{
    got_chains *g = arg;
    cr_assert_lt(g->n, 8);
    g->len[g->n] = n;
    g->leaf[g->n] = hs[n - 1];
    g->n++;
    return 0;
}

Test(xfer_store, a_draining_store_names_its_chains_most_recent_leaf_first)
{
    kv_store *a = mk(KN_KV_F16, 64, 1), *b = mk(KN_KV_F16, 64, 1);
    int32_t ta[6 * PT], tb[6 * PT], tc[2 * PT];
    km_pagehash ha[6], hb[6], hc[2];
    chain(ta, ha, 6, 0);
    memcpy(tb, ta, sizeof tb); /* B shares A's first 3 pages, then differs */
    for (int i = 3 * PT; i < 6 * PT; i++) tb[i] += 500;
    km_pagehash seed = km_pagehash_seed("model", 5, 42, NULL, 0);
    km_pagehash_chain(seed, tb, 6 * PT, PT, hb, 6);
    chain(tc, hc, 2, 7);
    compute(a, ta, ha, 6);
    cr_assert_eq(compute_new(a, tb, hb, 6), 3);
    compute(a, tc, hc, 2);
    got_chains g = {0};
    cr_assert_eq(kv_store_chains(a, 100, take_chain, &g), 3);
    /* leaves only (A's and B's shared pages are not chains of their own), most recent first */
    cr_assert_eq(g.len[0], 2);
    cr_assert(km_pagehash_eq(g.leaf[0], hc[1]));
    cr_assert_eq(g.len[1], 6);
    cr_assert(km_pagehash_eq(g.leaf[1], hb[5]));
    cr_assert_eq(g.len[2], 6);
    cr_assert(km_pagehash_eq(g.leaf[2], ha[5]));
    /* a budget: chains until they hold at least that many pages (C's 2, then B's 6) */
    g.n = 0;
    cr_assert_eq(kv_store_chains(a, 3, take_chain, &g), 2);
    /* what they name moves whole: root first, verified by the holder's export */
    cr_assert_eq(transfer(a, b, tc, hc, 2, -1), 2);
    cr_assert_eq(transfer(a, b, tb, hb, 6, -1), 6);
    cr_assert_eq(transfer(a, b, ta, ha, 6, -1), 3, "the shared prefix moved once");
    cr_assert_eq(kv_store_lookup(b, ha, ta, 6, NULL), 6);
    cr_assert_eq(kv_store_lookup(b, hb, tb, 6, NULL), 6);
    /* a chain whose pages left RAM is not named (without a host tier, eviction drops them) */
    kv_store_evict_oldest_fraction(a, 1.0);
    g.n = 0;
    cr_assert_eq(kv_store_chains(a, 100, take_chain, &g), 0);
    km_errbuf err;
    cr_assert_eq(kv_store_check(a, &err), 0, "%s", err.msg);
    kv_store_destroy(a);
    kv_store_destroy(b);
}

/* A store a transfer node serves from (arena) checksums each page as it is published, while it
 * is fresh, so that a peer's first pull does not wait for the holder to hash it; a store without
 * one does not (the checksum is then computed, and cached, when a page is first exported). */
Test(xfer_store, an_arena_store_checksums_pages_as_they_are_published)
{
    int32_t toks[4 * PT];
    km_pagehash hs[4];
    chain(toks, hs, 4, 0);
    for (int arena = 0; arena < 2; arena++) {
        kv_store *s = mk(KN_KV_F16, 16, arena);
        compute(s, toks, hs, 4);
        for (int i = 0; i < 4; i++) {
            kv_page *p = kv_index_find(s, hs[i]);
            cr_assert_not_null(p);
            if (!arena) {
                cr_assert_eq(p->xsum_fmt, 0, "page %d: no checksum without an arena", i);
                continue;
            }
            cr_assert_eq(p->xsum_fmt, (int)p->format + 1, "page %d", i);
            kv_xfer_page d = {.format = p->format,
                              .index = p->index,
                              .hash = p->hash,
                              .parent = p->parent,
                              .tokens = p->tokens,
                              .buf = p->buf,
                              .bytes = f16_page()};
            cr_assert_eq(p->xsum, kv_xfer_checksum(&d, PT, p->buf), "page %d", i);
        }
        kv_store_destroy(s);
    }
    /* pages imported from a peer were just checked against its checksum: not hashed again */
    pair P;
    pair_open(&P, KN_KV_F16, KN_KV_F16, 4);
    cr_assert_eq(transfer(P.a, P.b, P.toks, P.hs, 4, -1), 4);
    for (int i = 0; i < 4; i++) {
        kv_page *p = kv_index_find(P.b, P.hs[i]);
        cr_assert_not_null(p);
        cr_assert_eq(p->xsum_fmt, 0, "imported page %d hashed at publish", i);
    }
    pair_close(&P);
}
