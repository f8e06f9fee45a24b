/*
 * test_kvshard.c — the KV store's contract: pages and page tables, sharing and copy-on-write,
 * KM_ENOSPC, verified prefix reuse (with a forged hash collision), cache salts, events, shards
 * and shard keys, eviction policies, the host tier with asynchronous promotion, live format
 * conversion, and the lossy sequence policies. Formats and kernels: test_kvshard_format.c; disk
 * and crash: test_kvshard_disk.c; randomized model: test_kvshard_model.c.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h" /* kv_store_check */
#include "kvshard/kvshard.h"

#define L  2
#define H  2
#define HD 16
#define PT 4

/* Deterministic K/V content of (token, layer, head, channel): exact in f16. */
static float kval(int tok, int l, int h, int c)
{
    return (float)((tok * 7 + l * 3 + h * 5 + c) % 32 - 16) / 8.0f;
}
static float vval(int tok, int l, int h, int c)
{
    return (float)((tok * 5 + l * 7 + h * 3 + c) % 32 - 16) / 16.0f;
}

static kv_config base_cfg(size_t pages)
{
    kv_config c = {.n_layers = L,
                   .n_kv_heads = H,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .format = KN_KV_F16,
                   .sync_promote = 0};
    c.hot_bytes = pages * (size_t)PT * HD * 2 * 2 * L * H;
    return c;
}

static kv_store *mk(const kv_config *c)
{
    kv_store *s;
    km_errbuf err;
    int rc = kv_store_create(c, &s, &err);
    cr_assert_eq(rc, 0, "create: %s", err.msg);
    return s;
}

/* Writes tokens [from, to) of a sequence whose token at position p is toks[p]. */
static void fill(kv_store *s, kv_seq *q, const int32_t *toks, int from, int to)
{
    float k[H * HD], v[H * HD];
    cr_assert_eq(kv_seq_reserve(s, q, to), 0);
    for (int p = from; p < to; p++)
        for (int l = 0; l < L; l++) {
            for (int h = 0; h < H; h++)
                for (int c = 0; c < HD; c++) {
                    k[h * HD + c] = kval(toks[p], l, h, c);
                    v[h * HD + c] = vval(toks[p], l, h, c);
                }
            kv_seq_write(s, q, l, p, k, v);
        }
}

/* Max abs error of the sequence's content at [0, n) against toks. */
static float check(kv_store *s, kv_seq *q, const int32_t *toks, int n)
{
    float k[HD], v[HD], err = 0;
    for (int p = 0; p < n; p++)
        for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++) {
                cr_assert_eq(kv_seq_read(s, q, l, h, p, k, v), 0, "read pos %d", p);
                for (int c = 0; c < HD; c++) {
                    err = fmaxf(err, fabsf(k[c] - kval(toks[p], l, h, c)));
                    err = fmaxf(err, fabsf(v[c] - vval(toks[p], l, h, c)));
                }
            }
    return err;
}

static void seq_tokens(int32_t *t, int n, int seed)
{
    for (int i = 0; i < n; i++) t[i] = seed * 1000 + i;
}

static km_pagehash g_seed;
static void chain(const int32_t *t, int n, km_pagehash *h)
{
    km_pagehash_chain(g_seed, t, n, PT, h, n / PT);
}

Test(kvshard, f16_write_view_keeps_the_engine_layout_bit_for_bit)
{
    kv_config c = base_cfg(8);
    kv_store *s = mk(&c);
    kv_seq *q;
    int32_t t[8];
    seq_tokens(t, 8, 1);
    cr_assert_eq(kv_seq_create(s, &q), 0);
    fill(s, q, t, 0, 8);
    kn_kv_view v;
    kv_seq_view(s, q, 1, 1, 7, &v);
    cr_assert_eq(v.format, KN_KV_F16);
    cr_assert_null(v.page_formats);
    cr_assert_null(v.attn_mass);
    cr_assert_eq(v.n_ctx, 7);
    /* The old store's layout: block (layer, head, k/v) at ((l*H + h)*2 + v) * PT*HD*2. */
    size_t blk = (size_t)PT * HD * 2;
    cr_assert_eq(v.k_off, ((1 * H + 1) * 2 + 0) * blk);
    cr_assert_eq(v.v_off, ((1 * H + 1) * 2 + 1) * blk);
    cr_assert_eq(kv_store_page_bytes(s), blk * 2 * H * L);
    const kn_f16 *k5 = (const kn_f16 *)(v.pages[1] + v.k_off) + 1 * HD;
    for (int ch = 0; ch < HD; ch++) cr_assert_eq(k5[ch], kn_f32_to_f16(kval(t[5], 1, 1, ch)));
    cr_assert_float_eq(check(s, q, t, 8), 0.0f, 0.0f);
    kv_seq_destroy(s, q);
    kv_store_destroy(s);
}

Test(kvshard, exhausted_pool_returns_enospc_and_keeps_the_sequence)
{
    kv_config c = base_cfg(3);
    kv_store *s = mk(&c);
    kv_seq *a, *b;
    kv_seq_create(s, &a);
    kv_seq_create(s, &b);
    cr_assert_eq(kv_seq_reserve(s, a, 2 * PT), 0);
    cr_assert_eq(kv_store_pages_free(s), 1);
    cr_assert_eq(kv_seq_reserve(s, b, 2 * PT), KM_ENOSPC);
    cr_assert_eq(kv_seq_capacity(b), 0, "a failed reserve takes nothing");
    cr_assert_eq(kv_store_pages_free(s), 1);
    cr_assert_eq(kv_seq_reserve(s, b, PT), 0);
    kv_seq_destroy(s, a);
    cr_assert_eq(kv_store_pages_free(s), 2);
    kv_seq_destroy(s, b);
    cr_assert_eq(kv_store_pages_free(s), 3);
    kv_store_destroy(s);
}

Test(kvshard, fork_shares_pages_and_copies_the_partial_page_on_write)
{
    kv_config c = base_cfg(8);
    kv_store *s = mk(&c);
    int32_t t[8], u[8];
    seq_tokens(t, 8, 1);
    seq_tokens(u, 8, 1);
    u[6] = 777; /* the fork diverges inside the second page */
    kv_seq *a, *b;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 6);
    int used = kv_store_pages_total(s) - kv_store_pages_free(s);
    cr_assert_eq(kv_seq_fork(s, a, &b), 0);
    cr_assert_eq(kv_store_pages_total(s) - kv_store_pages_free(s), used, "fork copies nothing");
    fill(s, b, u, 6, 7);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.cow_copies, 1);
    fill(s, a, t, 6, 7);
    cr_assert_float_eq(check(s, a, t, 7), 0.0f, 0.0f);
    cr_assert_float_eq(check(s, b, u, 7), 0.0f, 0.0f, "b keeps a's first 6 tokens and its own");
    kv_seq_destroy(s, a);
    kv_seq_destroy(s, b);
    cr_assert_eq(kv_store_pages_free(s), kv_store_pages_total(s));
    kv_store_destroy(s);
}

Test(kvshard, truncate_then_rewrite_never_touches_a_published_page)
{
    kv_config c = base_cfg(8);
    kv_store *s = mk(&c);
    int32_t t[8], u[8];
    seq_tokens(t, 8, 2);
    memcpy(u, t, sizeof t);
    u[5] = 555;
    km_pagehash h[2];
    chain(t, 8, h);
    kv_seq *a, *b;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 8);
    cr_assert_eq(kv_seq_publish(s, a, h, t, 8), 2);
    kv_seq_truncate(s, a, 5);
    fill(s, a, u, 5, 6);
    cr_assert_float_eq(check(s, a, u, 6), 0.0f, 0.0f);
    kv_seq_create(s, &b);
    cr_assert_eq(kv_seq_attach(s, b, h, t, 2), 2);
    cr_assert_float_eq(check(s, b, t, 8), 0.0f, 0.0f, "the published page kept its tokens");
    kv_seq_destroy(s, a);
    kv_seq_destroy(s, b);
    kv_store_destroy(s);
}

Test(kvshard, prefix_lookup_returns_the_longest_verified_prefix_and_tiers)
{
    kv_config c = base_cfg(16);
    kv_store *s = mk(&c);
    int32_t t[16];
    seq_tokens(t, 16, 3);
    km_pagehash h[4];
    chain(t, 16, h);
    kv_seq *a;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 14);
    cr_assert_eq(kv_seq_publish(s, a, h, t, 14), 3, "only full pages are published");
    kv_tier tiers[4];
    cr_assert_eq(kv_store_lookup(s, h, t, 4, tiers), 3);
    for (int i = 0; i < 3; i++) cr_assert_eq(tiers[i], KV_TIER_HOT);
    int32_t u[16];
    memcpy(u, t, sizeof u);
    u[9] = -5; /* differs in page 2 */
    km_pagehash hu[4];
    chain(u, 16, hu);
    cr_assert_eq(kv_store_lookup(s, hu, u, 4, NULL), 2);
    kv_seq_destroy(s, a);
    /* Cached after the sequence is gone, and reusable. */
    kv_seq *b;
    kv_seq_create(s, &b);
    cr_assert_eq(kv_seq_attach(s, b, hu, u, 4), 2);
    fill(s, b, u, 8, 12);
    cr_assert_float_eq(check(s, b, u, 12), 0.0f, 0.0f);
    kv_seq_destroy(s, b);
    kv_store_destroy(s);
}

Test(kvshard, forged_hash_collision_never_serves_wrong_kv)
{
    kv_config c = base_cfg(16);
    kv_store *s = mk(&c);
    int32_t a_t[8], b_t[8];
    seq_tokens(a_t, 8, 4);
    seq_tokens(b_t, 8, 5);
    km_pagehash ha[2];
    chain(a_t, 8, ha);
    kv_seq *a;
    kv_seq_create(s, &a);
    fill(s, a, a_t, 0, 8);
    cr_assert_eq(kv_seq_publish(s, a, ha, a_t, 8), 2);
    /* 1. B's first page claims A's hash: token comparison refuses it. */
    cr_assert_eq(kv_store_lookup(s, ha, b_t, 2, NULL), 0);
    kv_seq *b;
    kv_seq_create(s, &b);
    cr_assert_eq(kv_seq_attach(s, b, ha, b_t, 2), 0);
    /* 2. Same tokens in page 1 but a different page 0: B publishes its own page 0, then forges
     * A's hash for page 1. Page 1's tokens match, but it was computed after A's page 0. */
    int32_t c_t[8];
    memcpy(c_t, b_t, sizeof c_t);
    memcpy(c_t + 4, a_t + 4, 4 * sizeof(int32_t));
    km_pagehash hc[2];
    chain(c_t, 8, hc);
    kv_seq *cq;
    kv_seq_create(s, &cq);
    fill(s, cq, c_t, 0, 4);
    cr_assert_eq(kv_seq_publish(s, cq, hc, c_t, 4), 1);
    km_pagehash forged[2] = {hc[0], ha[1]};
    cr_assert_eq(kv_store_lookup(s, forged, c_t, 2, NULL), 1, "stops at the forged link");
    kv_seq *d;
    kv_seq_create(s, &d);
    cr_assert_eq(kv_seq_attach(s, d, forged, c_t, 2), 1);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_geq(st.collisions, 2);
    /* 3. Publishing a different page under an existing hash keeps the original. */
    kv_seq *e;
    kv_seq_create(s, &e);
    fill(s, e, b_t, 0, 4);
    cr_assert_eq(kv_seq_publish(s, e, ha, b_t, 4), 0);
    cr_assert_eq(kv_store_lookup(s, ha, a_t, 2, NULL), 2);
    kv_seq *f;
    kv_seq_create(s, &f);
    cr_assert_eq(kv_seq_attach(s, f, ha, a_t, 2), 2);
    cr_assert_float_eq(check(s, f, a_t, 8), 0.0f, 0.0f);
    kv_seq *all[] = {a, b, cq, d, e, f};
    for (int i = 0; i < 6; i++) kv_seq_destroy(s, all[i]);
    kv_store_destroy(s);
}

Test(kvshard, different_cache_salts_never_share_pages)
{
    kv_config c = base_cfg(16);
    kv_store *s = mk(&c);
    int32_t t[8];
    seq_tokens(t, 8, 6);
    const char fp[] = "model-fingerprint";
    km_pagehash s1 = km_pagehash_seed(fp, sizeof fp, 42, "tenant-a", 8);
    km_pagehash s2 = km_pagehash_seed(fp, sizeof fp, 42, "tenant-b", 8);
    km_pagehash s3 = km_pagehash_seed(fp, sizeof fp, 43, "tenant-a", 8);
    km_pagehash h1[2], h2[2], h3[2];
    km_pagehash_chain(s1, t, 8, PT, h1, 2);
    km_pagehash_chain(s2, t, 8, PT, h2, 2);
    km_pagehash_chain(s3, t, 8, PT, h3, 2);
    cr_assert(!km_pagehash_eq(h1[0], h2[0]) && !km_pagehash_eq(h1[0], h3[0]));
    kv_seq *a;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 8);
    cr_assert_eq(kv_seq_publish(s, a, h1, t, 8), 2);
    cr_assert_eq(kv_store_lookup(s, h1, t, 2, NULL), 2);
    cr_assert_eq(kv_store_lookup(s, h2, t, 2, NULL), 0);
    cr_assert_eq(kv_store_lookup(s, h3, t, 2, NULL), 0);
    kv_seq_destroy(s, a);
    kv_store_destroy(s);
}

Test(kvshard, pagehash_chain_is_stable_and_canonical)
{
    int32_t t[4] = {1, 2, 3, 4};
    km_pagehash s = km_pagehash_seed(NULL, 0, 0, NULL, 0);
    km_pagehash a = km_pagehash_next(s, t, 4), b = km_pagehash_next(s, t, 4);
    cr_assert(km_pagehash_eq(a, b));
    uint8_t c[16];
    km_pagehash_canonical(a, c);
    cr_assert(km_pagehash_eq(km_pagehash_from_canonical(c), a));
    char hex[33];
    km_pagehash_hex(a, hex);
    cr_assert_eq(strlen(hex), 32);
    t[3] = 5;
    cr_assert(!km_pagehash_eq(km_pagehash_next(s, t, 4), a));
    km_pagehash out[3];
    int32_t many[13] = {0};
    cr_assert_eq(km_pagehash_chain(s, many, 13, 4, out, 3), 3);
    cr_assert(!km_pagehash_eq(out[0], out[1]), "position is part of the chain");
}

Test(kvshard, events_carry_consecutive_sequence_numbers)
{
    kv_config c = base_cfg(4);
    c.host_bytes = c.hot_bytes;
    kv_store *s = mk(&c);
    int32_t t[8];
    seq_tokens(t, 8, 7);
    km_pagehash h[2];
    chain(t, 8, h);
    kv_seq *a;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 8);
    kv_seq_publish(s, a, h, t, 8);
    kv_seq_destroy(s, a);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), 2);
    kv_event ev[16];
    int n = kv_store_events_drain(s, ev, 16);
    cr_assert_eq(n, 4);
    for (int i = 0; i < n; i++) cr_assert_eq(ev[i].seq, (uint64_t)i);
    cr_assert_eq(ev[0].kind, KV_EVENT_STORED);
    cr_assert(km_pagehash_eq(ev[0].hash, h[0]));
    cr_assert_eq(ev[2].kind, KV_EVENT_TIER);
    cr_assert_eq(ev[2].from_tier, KV_TIER_HOT);
    cr_assert_eq(ev[2].tier, KV_TIER_HOST);
    cr_assert_eq(kv_store_events_drain(s, ev, 16), 0);
    kv_store_destroy(s);
}

/* A chunk's pages (docs/blend.md) carry kvshard's position-free flag from the sequence that
 * publishes them: in their events, counted per tier as they move down and are evicted, and only
 * theirs (a prefix published beside them is not). */
Test(kvshard, position_free_pages_are_flagged_in_events_and_counted_per_tier)
{
    kv_config c = base_cfg(8);
    c.host_bytes = c.hot_bytes;
    kv_store *s = mk(&c);
    int32_t t[8], u[8];
    seq_tokens(t, 8, 8);
    seq_tokens(u, 8, 9);
    km_pagehash h[2], hu[2];
    km_pagehash_chain(km_pagehash_chunk_seed(g_seed), t, 8, PT, h, 2);
    chain(u, 8, hu);
    kv_seq *a, *b;
    kv_seq_create(s, &a);
    kv_seq_create(s, &b);
    kv_seq_set_position_free(a, 1);
    fill(s, a, t, 0, 8);
    fill(s, b, u, 0, 8);
    cr_assert_eq(kv_seq_publish(s, a, h, t, 8), 2);
    cr_assert_eq(kv_seq_publish(s, b, hu, u, 8), 2);
    kv_seq_destroy(s, a);
    kv_seq_destroy(s, b);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.position_free_pages[KV_TIER_HOT], 2);
    cr_assert(kv_store_position_free(s, h[1]) && !kv_store_position_free(s, hu[0]));
    kv_event ev[16];
    cr_assert_eq(kv_store_events_drain(s, ev, 16), 4);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(ev[i].position_free, i < 2, "event %d: the chunk's pages only", i);
    km_errbuf err;
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    /* down to the host tier, then gone */
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), 4);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.position_free_pages[KV_TIER_HOT], 0);
    cr_assert_eq(st.position_free_pages[KV_TIER_HOST], 2);
    int n = kv_store_events_drain(s, ev, 16), flagged = 0;
    for (int i = 0; i < n; i++) flagged += ev[i].position_free;
    cr_assert_eq(flagged, 2, "the tier events of the chunk's pages are flagged");
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_store_destroy(s);
    /* without a host tier they are evicted: removed, and no longer counted */
    c.host_bytes = 0;
    s = mk(&c);
    kv_seq_create(s, &a);
    kv_seq_set_position_free(a, 1);
    fill(s, a, t, 0, 8);
    cr_assert_eq(kv_seq_publish(s, a, h, t, 8), 2);
    kv_seq_destroy(s, a);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), 2);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.position_free_pages[KV_TIER_HOT], 0);
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_store_destroy(s);
}

Test(kvshard, hash_shards_stay_balanced_on_a_uniform_workload)
{
    kv_config c = base_cfg(4096);
    c.n_shards = 8;
    kv_store *s = mk(&c);
    kv_seq *q[64];
    for (int i = 0; i < 64; i++) {
        kv_seq_create(s, &q[i]);
        cr_assert_eq(kv_seq_reserve(s, q[i], 40 * PT), 0);
    }
    double mx = 0, sum = 0;
    for (int i = 0; i < 8; i++) {
        kv_shard_stats st;
        kv_store_shard_stats(s, i, &st);
        mx = fmax(mx, (double)st.tier[KV_TIER_HOT].pages);
        sum += (double)st.tier[KV_TIER_HOT].pages;
    }
    cr_assert_eq(sum, 64 * 40);
    cr_assert_leq(mx / (sum / 8), 1.2, "max/mean = %.3f", mx / (sum / 8));
    for (int i = 0; i < 64; i++) kv_seq_destroy(s, q[i]);
    kv_store_destroy(s);
}

Test(kvshard, expert_shard_key_follows_pikv_and_balances_synthetic_experts)
{
    kv_config c = base_cfg(4096);
    c.n_shards = 4;
    c.shard_key = KV_SHARD_KEY_EXPERT;
    c.n_tok_groups = 4;
    c.n_expert_groups = 4;
    kv_store *s = mk(&c);
    for (int p = 0; p < 16; p++)
        for (int e = 0; e < 16; e++) cr_assert_eq(kv_store_shard_of(s, 1, p, e), (p % 4) ^ (e % 4));
    /* Synthetic MoE routing: each page's dominant expert from a fixed pseudo-random stream. */
    kv_seq *q[32];
    uint32_t r = 12345;
    for (int i = 0; i < 32; i++) {
        kv_seq_create(s, &q[i]);
        for (int p = 1; p <= 50; p++) {
            r = r * 1664525u + 1013904223u;
            cr_assert_eq(kv_seq_reserve_expert(s, q[i], p * PT, (int)(r >> 24) % 8), 0);
        }
    }
    double mx = 0, sum = 0;
    for (int i = 0; i < 4; i++) {
        kv_shard_stats st;
        kv_store_shard_stats(s, i, &st);
        mx = fmax(mx, (double)st.tier[KV_TIER_HOT].pages);
        sum += (double)st.tier[KV_TIER_HOT].pages;
    }
    cr_assert_leq(mx / (sum / 4), 1.2, "max/mean = %.3f", mx / (sum / 4));
    for (int i = 0; i < 32; i++) kv_seq_destroy(s, q[i]);
    kv_store_destroy(s);
}

Test(kvshard, shards_have_their_own_budget_format_and_policy)
{
    kv_config c = base_cfg(8);
    size_t pb = c.hot_bytes / 8;
    kv_shard_config sc[2] = {
        {.hot_bytes = 2 * pb, .format = KN_KV_F16, .evict = KV_EVICT_LRU},
        {.hot_bytes = 6 * pb, .format = KN_KV_FP8, .evict = KV_EVICT_LRU_PRIORITY}};
    c.n_shards = 2;
    c.shards = sc;
    c.shard_key = KV_SHARD_KEY_EXPERT;
    c.n_tok_groups = 1;
    c.n_expert_groups = 2;
    kv_store *s = mk(&c);
    kv_seq *a, *b;
    kv_seq_create(s, &a);
    kv_seq_create(s, &b);
    cr_assert_eq(kv_seq_reserve_expert(s, a, 2 * PT, 0), 0);
    cr_assert_eq(kv_seq_reserve_expert(s, a, 3 * PT, 0), KM_ENOSPC, "shard 0 holds 2 pages");
    cr_assert_eq(kv_seq_reserve_expert(s, b, 3 * PT, 1), 0);
    kv_shard_stats s0, s1;
    kv_store_shard_stats(s, 0, &s0);
    kv_store_shard_stats(s, 1, &s1);
    cr_assert_eq(s0.format, KN_KV_F16);
    cr_assert_eq(s1.format, KN_KV_FP8);
    cr_assert_eq(s1.evict, KV_EVICT_LRU_PRIORITY);
    cr_assert_eq(s0.alloc_failures, 1);
    cr_assert_eq(s1.tier[KV_TIER_HOT].bytes, 3 * kv_store_format_page_bytes(s, KN_KV_FP8));
    kn_kv_view v;
    kv_seq_view(s, b, 0, 0, 3 * PT, &v);
    cr_assert_eq(v.format, KN_KV_FP8);
    kv_seq_destroy(s, a);
    kv_seq_destroy(s, b);
    kv_store_destroy(s);
}

/* Publishes one single-page sequence per seed and releases it: a cached page. */
static void cache_page(kv_store *s, int seed, km_pagehash *h, int32_t *t)
{
    seq_tokens(t, PT, seed);
    chain(t, PT, h);
    kv_seq *q;
    kv_seq_create(s, &q);
    fill(s, q, t, 0, PT);
    cr_assert_eq(kv_seq_publish(s, q, h, t, PT), 1);
    kv_seq_destroy(s, q);
}

static void reuse(kv_store *s, const km_pagehash *h, const int32_t *t)
{
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_attach(s, q, h, t, 1), 1);
    kv_seq_destroy(s, q);
}

Test(kvshard, lru_evicts_the_idle_longest_page_first)
{
    kv_config c = base_cfg(3);
    kv_store *s = mk(&c);
    km_pagehash h[3];
    int32_t t[3][PT];
    for (int i = 0; i < 3; i++) cache_page(s, 10 + i, &h[i], t[i]);
    reuse(s, &h[0], t[0]); /* page 1 is now the idle longest */
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_reserve(s, q, PT), 0);
    cr_assert_eq(kv_store_lookup(s, &h[1], t[1], 1, NULL), 0);
    cr_assert_eq(kv_store_lookup(s, &h[0], t[0], 1, NULL), 1);
    cr_assert_eq(kv_store_lookup(s, &h[2], t[2], 1, NULL), 1);
    kv_seq_destroy(s, q);
    kv_store_destroy(s);
}

Test(kvshard, lru_priority_keeps_reused_prefix_pages_last)
{
    kv_config c = base_cfg(3);
    c.evict = KV_EVICT_LRU_PRIORITY;
    kv_store *s = mk(&c);
    km_pagehash h[3];
    int32_t t[3][PT];
    cache_page(s, 20, &h[0], t[0]);
    reuse(s, &h[0], t[0]);
    reuse(s, &h[0], t[0]); /* a shared system prompt: oldest touch order after the next two */
    cache_page(s, 21, &h[1], t[1]);
    cache_page(s, 22, &h[2], t[2]);
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_reserve(s, q, 2 * PT), 0);
    cr_assert_eq(kv_store_lookup(s, &h[0], t[0], 1, NULL), 1, "the reused page survives");
    cr_assert_eq(kv_store_lookup(s, &h[1], t[1], 1, NULL), 0);
    cr_assert_eq(kv_store_lookup(s, &h[2], t[2], 1, NULL), 0);
    kv_seq_destroy(s, q);
    kv_store_destroy(s);
}

Test(kvshard, pages_in_use_are_never_evicted)
{
    kv_config c = base_cfg(2);
    kv_store *s = mk(&c);
    int32_t t[8];
    seq_tokens(t, 8, 30);
    km_pagehash h[2];
    chain(t, 8, h);
    kv_seq *a, *b;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 8);
    kv_seq_publish(s, a, h, t, 8);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), 0);
    kv_seq_create(s, &b);
    cr_assert_eq(kv_seq_reserve(s, b, 1), KM_ENOSPC);
    cr_assert_float_eq(check(s, a, t, 8), 0.0f, 0.0f);
    kv_seq_destroy(s, a);
    cr_assert_eq(kv_seq_reserve(s, b, 1), 0, "released pages are reclaimable");
    kv_seq_destroy(s, b);
    kv_store_destroy(s);
}

Test(kvshard, pinned_counts_pages_held_by_live_sequences_not_cached_ones)
{
    kv_config c = base_cfg(16);
    c.host_bytes = c.hot_bytes;
    kv_store *s = mk(&c);
    const uint64_t pb = kv_store_format_page_bytes(s, KN_KV_F16);
    int32_t t[16];
    seq_tokens(t, 16, 35);
    km_pagehash h[4];
    chain(t, 16, h);
    kv_seq *a, *b;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 14); /* 4 pages, the last one partial */
    kv_seq_publish(s, a, h, t, 12);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 4);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_bytes, 4 * pb);
    cr_assert_eq(kv_seq_fork(s, a, &b), 0); /* shared pages count once */
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 4);
    kv_seq_destroy(s, a);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 4, "still held by the fork");
    kv_seq_destroy(s, b);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pages, 3, "the published pages stay cached");
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 0, "cached pages are reclaimable");
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_bytes, 0);
    /* attaching pins them again; a conversion changes the bytes of pinned and cached alike */
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_attach(s, q, h, t, 2), 2);
    cr_assert_eq(kv_store_convert(s, KN_KV_FP8), 3);
    kv_shard_stats sh;
    cr_assert_eq(kv_store_shard_stats(s, 0, &sh), 0);
    const uint64_t pb8 = kv_store_format_page_bytes(s, KN_KV_FP8);
    cr_assert_eq(sh.tier[KV_TIER_HOT].pinned_pages, 2);
    cr_assert_eq(sh.tier[KV_TIER_HOT].pinned_bytes, 2 * pb8);
    cr_assert_eq(sh.tier[KV_TIER_HOT].bytes, 3 * pb8);
    kv_seq_destroy(s, q);
    /* demoted pages are never pinned */
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), 3);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOST].pages, 3);
    cr_assert_eq(st.tier[KV_TIER_HOST].pinned_pages, 0);
    cr_assert_eq(st.tier[KV_TIER_HOST].pinned_bytes, 0);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_bytes, 0);
    kv_store_destroy(s);
}

Test(kvshard, evict_oldest_fraction_takes_a_quarter_oldest_first)
{
    kv_config c = base_cfg(8);
    kv_store *s = mk(&c);
    km_pagehash h[8];
    int32_t t[8][PT];
    for (int i = 0; i < 8; i++) cache_page(s, 40 + i, &h[i], t[i]);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 0.25), 2);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(kv_store_lookup(s, &h[i], t[i], 1, NULL), i >= 2, "page %d", i);
    kv_store_destroy(s);
}

Test(kvshard, host_tier_demotes_past_the_watermark_and_promotes_asynchronously)
{
    kv_config c = base_cfg(10);
    c.host_bytes = c.hot_bytes;
    kv_store *s = mk(&c);
    int32_t t[32];
    seq_tokens(t, 32, 50);
    km_pagehash h[8];
    chain(t, 32, h);
    kv_seq *a;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 32);
    kv_seq_publish(s, a, h, t, 32);
    kv_seq_destroy(s, a); /* 8 of 10 pages cached: 80%, at the watermark */
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pages, 8);
    kv_seq *b;
    kv_seq_create(s, &b);
    cr_assert_eq(kv_seq_reserve(s, b, PT), 0); /* 90% > 80%: demote down to 75% */
    kv_store_stats_get(s, &st);
    cr_assert_leq(st.tier[KV_TIER_HOT].bytes, (size_t)(0.8 * st.tier[KV_TIER_HOT].budget));
    cr_assert_eq(st.tier[KV_TIER_HOST].pages, 2);
    kv_tier tiers[8];
    cr_assert_eq(kv_store_lookup(s, h, t, 8, tiers), 8);
    cr_assert_eq(tiers[7], KV_TIER_HOST, "a chain leaves from its tail");
    cr_assert_eq(tiers[6], KV_TIER_HOST);
    cr_assert_eq(tiers[5], KV_TIER_HOT);
    cr_assert_eq(tiers[0], KV_TIER_HOT);
    kv_seq_destroy(s, b);
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_attach(s, q, h, t, 8), 8);
    kn_kv_view v;
    kv_seq_view(s, q, L - 1, 0, 32, &v); /* waits for the last layer */
    cr_assert_float_eq(check(s, q, t, 32), 0.0f, 0.0f);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOST].pages, 0);
    kv_seq_destroy(s, q);
    kv_store_destroy(s);
}

/* Two sequences attach the same host-tier prefix one right after the other, as two requests
 * with one system prompt admitted in the same scheduler step do. The first attach queues the
 * promotion; the second finds the pages already hot but still being copied. It must wait for
 * that copy: the regression read them before it finished (its own sequence had no promotion to
 * wait for), i.e. zeros or a recycled buffer's bytes. Pages are the default model's size so the
 * copy takes long enough for a read to land inside it. */
Test(kvshard, a_prefix_still_being_promoted_for_one_sequence_is_waited_for_by_the_next)
{
    enum { NL = 30, NH = 3, D = 64, P = 16, NP = 48, N = NP * P };
    kv_config c = {.n_layers = NL,
                   .n_kv_heads = NH,
                   .head_dim = D,
                   .page_tokens = P,
                   .format = KN_KV_F16,
                   .sync_promote = 0};
    c.hot_bytes = (size_t)(NP * 3) * P * D * 2 * 2 * NL * NH;
    c.host_bytes = c.hot_bytes;
    kv_store *s = mk(&c);
    static int32_t t[N];
    static km_pagehash h[NP];
    seq_tokens(t, N, 77);
    km_pagehash_chain(g_seed, t, N, P, h, NP);
    static float k[NH * D], v[NH * D];
    kv_seq *a;
    kv_seq_create(s, &a);
    cr_assert_eq(kv_seq_reserve(s, a, N), 0);
    for (int p = 0; p < N; p++)
        for (int l = 0; l < NL; l++) {
            for (int i = 0; i < NH * D; i++) {
                k[i] = kval(t[p], l, i / D, i % D);
                v[i] = vval(t[p], l, i / D, i % D);
            }
            kv_seq_write(s, a, l, p, k, v);
        }
    cr_assert_eq(kv_seq_publish(s, a, h, t, N), NP);
    kv_seq_destroy(s, a);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), NP);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOST].pages, NP);
    for (int round = 0; round < 3; round++) {
        kv_seq *q1, *q2;
        kv_seq_create(s, &q1);
        kv_seq_create(s, &q2);
        cr_assert_eq(kv_seq_attach(s, q1, h, t, NP), NP);
        cr_assert_eq(kv_seq_attach(s, q2, h, t, NP), NP);
        /* q2 first: the last layer of the last page is the last byte the promoter copies */
        float kr[D], vr[D];
        for (int p = N - 1; p >= 0; p -= P - 1)
            for (int l = NL - 1; l >= 0; l -= NL - 1) {
                cr_assert_eq(kv_seq_read(s, q2, l, NH - 1, p, kr, vr), 0);
                for (int ch = 0; ch < D; ch++) {
                    cr_assert_float_eq(kr[ch], kval(t[p], l, NH - 1, ch), 0.0f,
                                       "round %d pos %d layer %d: K read before its copy", round, p,
                                       l);
                    cr_assert_float_eq(vr[ch], vval(t[p], l, NH - 1, ch), 0.0f);
                }
            }
        kv_seq_destroy(s, q2);
        kv_seq_destroy(s, q1);
        cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), NP); /* back to host for the next */
    }
    kv_store_destroy(s);
}

Test(kvshard, live_conversion_to_fp8_halves_memory_and_reverts)
{
    kv_config c = base_cfg(16);
    kv_store *s = mk(&c);
    int32_t t[12];
    seq_tokens(t, 12, 60);
    kv_seq *a;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 6); /* mid-page: the sequence is running */
    kv_store_stats st0, st1;
    kv_store_stats_get(s, &st0);
    cr_assert_eq(kv_store_convert(s, KN_KV_FP8), 2);
    kv_store_stats_get(s, &st1);
    cr_assert_eq(st0.tier[KV_TIER_HOT].bytes, 2 * kv_store_format_page_bytes(s, KN_KV_F16));
    cr_assert_eq(st1.tier[KV_TIER_HOT].bytes, 2 * kv_store_format_page_bytes(s, KN_KV_FP8));
    cr_assert_lt(kv_store_format_page_bytes(s, KN_KV_FP8) * 1.5,
                 kv_store_format_page_bytes(s, KN_KV_F16));
    fill(s, a, t, 6, 12); /* keeps running in fp8 */
    kn_kv_view v;
    kv_seq_view(s, a, 0, 0, 12, &v);
    cr_assert_eq(v.format, KN_KV_FP8);
    cr_assert_leq(check(s, a, t, 12), 0.08f, "fp8: 3 mantissa bits on values <= 2");
    cr_assert_eq(kv_store_convert(s, KN_KV_F16), 3);
    kv_seq_view(s, a, 0, 0, 12, &v);
    cr_assert_eq(v.format, KN_KV_F16);
    cr_assert_null(v.page_formats);
    cr_assert_leq(check(s, a, t, 12), 0.08f);
    kv_seq_destroy(s, a);
    kv_store_destroy(s);
}

Test(kvshard, int4_pages_stay_f16_until_full_then_seal)
{
    kv_config c = base_cfg(16);
    c.format = KN_KV_INT4;
    kv_store *s = mk(&c);
    int32_t t[12];
    seq_tokens(t, 12, 70);
    kv_seq *a;
    kv_seq_create(s, &a);
    fill(s, a, t, 0, 6);
    kn_kv_view v;
    kv_seq_view(s, a, 0, 0, 6, &v);
    cr_assert_eq(v.format, KN_KV_F16, "nothing sealed yet");
    fill(s, a, t, 6, 7); /* the reserve of position 6 seals page 0 */
    kv_seq_view(s, a, 0, 0, 7, &v);
    cr_assert_not_null(v.page_formats);
    cr_assert_eq(v.page_formats[0], KN_KV_INT4);
    cr_assert_eq(v.page_formats[1], KN_KV_F16);
    cr_assert_leq(check(s, a, t, 7), 0.25f, "int4: 16 levels per channel");
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.sealed_pages, 1);
    kv_seq_destroy(s, a);
    kv_store_destroy(s);
}

Test(kvshard, streaming_policy_keeps_sink_and_window)
{
    kv_config c = base_cfg(64);
    kv_store *s = mk(&c);
    int32_t t[40];
    seq_tokens(t, 40, 80);
    kv_seq *a;
    kv_seq_create(s, &a);
    kv_seq_policy p = {.kind = KV_SEQ_STREAMING, .sink_pages = 1, .window_pages = 2};
    cr_assert_eq(kv_seq_set_policy(s, a, &p), 0);
    for (int n = 1; n <= 40; n++) fill(s, a, t, n - 1, n);
    /* 10 full pages: sink 1 + window 2 kept; the reserve before the last write saw 9. */
    cr_assert_eq(kv_seq_dropped_pages(a), 6);
    kn_kv_view v;
    kv_seq_view(s, a, 0, 0, 40, &v);
    cr_assert_eq(v.n_ctx, 40 - 6 * PT);
    float k[HD], vv[HD];
    cr_assert_eq(kv_seq_read(s, a, 0, 0, 1, k, vv), 0, "sink kept");
    cr_assert_eq(kv_seq_read(s, a, 0, 0, 5, k, vv), KM_ERANGE, "dropped");
    cr_assert_eq(kv_seq_read(s, a, 0, 0, 39, k, vv), 0);
    cr_assert_float_eq(k[3], kval(t[39], 0, 0, 3), 0.0f);
    kv_seq_destroy(s, a);
    kv_store_destroy(s);
}

Test(kvshard, h2o_policy_drops_the_pages_with_least_attention)
{
    kv_config c = base_cfg(64);
    kv_store *s = mk(&c);
    int32_t t[24];
    seq_tokens(t, 24, 90);
    kv_seq *a;
    kv_seq_create(s, &a);
    kv_seq_policy p = {.kind = KV_SEQ_H2O, .window_pages = 1, .budget_pages = 3};
    cr_assert_eq(kv_seq_set_policy(s, a, &p), 0);
    fill(s, a, t, 0, 16);
    kn_kv_view v;
    kv_seq_view(s, a, 0, 0, 16, &v);
    cr_assert_not_null(v.attn_mass);
    v.attn_mass[0] = 5.0f; /* what the attention kernel would have accumulated */
    v.attn_mass[1] = 0.1f;
    v.attn_mass[2] = 3.0f;
    fill(s, a, t, 16, 17);
    cr_assert_eq(kv_seq_dropped_pages(a), 1);
    float k[HD], vv[HD];
    cr_assert_eq(kv_seq_read(s, a, 0, 0, 5, k, vv), KM_ERANGE, "page 1 had the least mass");
    cr_assert_eq(kv_seq_read(s, a, 0, 0, 1, k, vv), 0);
    cr_assert_eq(kv_seq_read(s, a, 0, 0, 9, k, vv), 0);
    kv_seq_destroy(s, a);
    kv_store_destroy(s);
}

Test(kvshard, bad_config_is_an_error_not_a_crash)
{
    kv_store *s;
    km_errbuf err;
    kv_config c = base_cfg(4);
    c.page_tokens = 3;
    cr_assert_eq(kv_store_create(&c, &s, &err), KM_EINVAL);
    c = base_cfg(4);
    c.hot_bytes = 10;
    cr_assert_eq(kv_store_create(&c, &s, &err), KM_EINVAL);
    c = base_cfg(4);
    c.format = (kv_format)9;
    cr_assert_eq(kv_store_create(&c, &s, &err), KM_EINVAL);
    c = base_cfg(4);
    c.head_dim = 15;
    c.format = KN_KV_INT4;
    cr_assert_eq(kv_store_create(&c, &s, &err), KM_EUNSUPPORTED);
    kv_format f;
    cr_assert_eq(kv_format_parse("fp9", &f), KM_EINVAL);
    cr_assert_eq(kv_format_parse("int4", &f), 0);
    cr_assert_eq(f, KN_KV_INT4);
}

/* kv_seq_place: a page computed in its provisional (hash) shard moves to its expert's shard once
 * its tokens' routing is known; its expert group counts it on whatever tier it lives, hits and
 * demotions included, and kv_store_check holds throughout. */
Test(kvshard, placing_a_page_by_its_expert_moves_it_and_its_group_follows_it)
{
    kv_config c = base_cfg(64);
    c.n_shards = 4;
    c.shard_key = KV_SHARD_KEY_EXPERT;
    c.n_tok_groups = 1; /* the shard is the expert's group alone */
    c.n_expert_groups = 4;
    c.host_bytes = c.hot_bytes;
    c.sync_promote = 1;
    kv_store *s = mk(&c);
    cr_assert_eq(kv_store_n_expert_groups(s), 4);
    km_errbuf err;
    int32_t t[8 * PT];
    km_pagehash h[8];
    seq_tokens(t, 8 * PT, 7);
    chain(t, 8 * PT, h);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(s, &q), 0);
    fill(s, q, t, 0, 8 * PT);
    for (int i = 0; i < 8; i++) {
        cr_assert_eq(kv_seq_place(s, q, i * PT + 1, i % 4 + 4), i % 4, "page %d", i);
        cr_assert_eq(kv_seq_place(s, q, i * PT, 0), i % 4, "a tagged page stays");
        cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(kv_seq_place(s, q, 8 * PT, 0), KM_ERANGE);
    cr_assert_lt(check(s, q, t, 8 * PT), 1e-6f, "content unchanged by the move");
    cr_assert_eq(kv_seq_publish(s, q, h, t, 8 * PT), 8);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.placed_pages, 8);
    cr_assert_eq(st.place_fallbacks, 0);
    for (int g = 0; g < 4; g++) {
        kv_group_stats gs;
        kv_shard_stats ss;
        cr_assert_eq(kv_store_group_stats(s, g, &gs), 0);
        cr_assert_eq(kv_store_shard_stats(s, g, &ss), 0);
        cr_assert_eq(gs.placed, 2);
        cr_assert_eq(gs.pages[KV_TIER_HOT], 2);
        cr_assert_eq(ss.tier[KV_TIER_HOT].pages, 2, "shard %d holds its group's pages", g);
    }
    kv_seq_destroy(s, q);
    /* everything cached goes to the host tier, then comes back on a hit */
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), 8);
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_group_stats g0;
    kv_store_group_stats(s, 0, &g0);
    cr_assert_eq(g0.pages[KV_TIER_HOT], 0);
    cr_assert_eq(g0.pages[KV_TIER_HOST], 2);
    cr_assert_eq(g0.demotions, 2);
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_attach(s, q, h, t, 8), 8);
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_store_group_stats(s, 0, &g0);
    cr_assert_eq(g0.pages[KV_TIER_HOT], 2);
    cr_assert_eq(g0.hits, 2);
    cr_assert_eq(kv_seq_place(s, q, 0, 3), 0, "an indexed page keeps its shard and its tag");
    kv_seq_destroy(s, q);
    kv_store_destroy(s);
}

Test(kvshard, placing_under_the_hash_key_or_without_room_leaves_the_page)
{
    kv_config c = base_cfg(8);
    c.n_shards = 2;
    kv_store *s = mk(&c);
    cr_assert_eq(kv_store_n_expert_groups(s), 0);
    kv_group_stats gs;
    cr_assert_eq(kv_store_group_stats(s, 0, &gs), KM_EINVAL);
    int32_t t[2 * PT];
    seq_tokens(t, 2 * PT, 3);
    kv_seq *q;
    kv_seq_create(s, &q);
    fill(s, q, t, 0, 2 * PT);
    int sh = kv_store_shard_of(s, kv_seq_uid(q), 0, -1);
    cr_assert_eq(kv_seq_place(s, q, 0, 1), sh, "hash key: the page stays");
    kv_seq_destroy(s, q);
    kv_store_destroy(s);

    /* expert key, every page of shard 1 pinned: a page routed there stays in shard 0 */
    c = base_cfg(4);
    c.n_shards = 2;
    c.shard_key = KV_SHARD_KEY_EXPERT;
    c.n_tok_groups = 1;
    c.n_expert_groups = 2;
    s = mk(&c);
    kv_seq *full, *a;
    kv_seq_create(s, &full);
    kv_seq_create(s, &a);
    cr_assert_eq(kv_seq_reserve_expert(s, full, 2 * PT, 1), 0);
    cr_assert_eq(kv_seq_reserve_expert(s, a, PT, 0), 0);
    cr_assert_eq(kv_seq_place(s, a, 0, 1), 0);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.place_fallbacks, 1);
    km_errbuf err;
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_group_stats g1;
    kv_store_group_stats(s, 1, &g1);
    cr_assert_eq(g1.pages[KV_TIER_HOT], 1, "tagged with its expert's group even where it stays");
    kv_seq_destroy(s, a);
    kv_seq_destroy(s, full);
    kv_store_destroy(s);
}
