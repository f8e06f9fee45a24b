/*
 * test_kvshard_chains.c — eviction keeps every indexed page reachable (issue 39, item 1).
 *
 * A prompt's pages form a chain, each page verified after its parent, so a page whose parent is
 * gone can never be reached again. The regression: recovery level 1 (and eviction under memory
 * pressure) took the oldest pages first, i.e. the heads of chains, and left their tails indexed
 * but unreachable; recomputing the prompt then stopped publishing at the first stranded page, so
 * the prompt was cached only up to there for good. Here a request is served the way the engine
 * serves one (attach the longest cached prefix, compute the rest, publish, release), and after
 * a level 1, a pressure eviction or a corrupt disk page the second request must find the whole
 * prompt again, with kv_store_check (which now reports an unreachable page) clean throughout.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvshard/internal.h" /* kv_store_check, pages of the index */
#include "kvshard/kvshard.h"

#define L  2
#define H  2
#define HD 16
#define PT 4
#define NT 125 /* a prompt of 31 full pages and one token, as 505 tokens are with 16 a page */
#define NP (NT / PT)

static const size_t page_bytes = (size_t)PT * HD * 2 * 2 * L * H;

static km_pagehash g_seed;

static kv_store *mk(size_t hot_pages, size_t host_pages, int n_shards, kv_evict_policy ev)
{
    kv_config c = {.n_layers = L,
                   .n_kv_heads = H,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .format = KN_KV_F16,
                   .hot_bytes = hot_pages * page_bytes,
                   .host_bytes = host_pages * page_bytes,
                   .n_shards = n_shards,
                   .evict = ev,
                   .sync_promote = 1};
    kv_store *s;
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "create: %s", err.msg);
    return s;
}

static void expect_clean(kv_store *s, const char *when)
{
    km_errbuf err;
    cr_assert_eq(kv_store_check(s, &err), 0, "%s: %s", when, err.msg);
}

static void prompt(int32_t *t, int n, int seed)
{
    for (int i = 0; i < n; i++) t[i] = seed * 1000 + i;
}

/* Serves a request for the n tokens of t as the scheduler does: the longest cached prefix (the
 * last token is always computed), the rest computed and published, the sequence released.
 * Returns the pages the request found cached. */
static int serve(kv_store *s, const int32_t *t, int n)
{
    km_pagehash h[NT / PT + 1];
    int np = km_pagehash_chain(g_seed, t, n, PT, h, NT / PT + 1);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(s, &q), 0);
    int got = kv_seq_attach(s, q, h, t, (n - 1) / PT);
    cr_assert_geq(got, 0, "attach: %s", km_strerror(got));
    cr_assert_eq(kv_seq_reserve(s, q, n), 0);
    float k[H * HD];
    for (int p = got * PT; p < n; p++)
        for (int l = 0; l < L; l++) {
            for (int i = 0; i < H * HD; i++) k[i] = (float)((t[p] + l + i) % 16) / 8.0f;
            kv_seq_write(s, q, l, p, k, k);
        }
    cr_assert_geq(kv_seq_publish(s, q, h, t, np * PT), 0);
    kv_seq_destroy(s, q);
    return got;
}

/* The scenario: a prompt fully cached, a level 1, then the prompt twice more. */
static void level_1_then_the_prompt_twice(size_t host_pages, int n_shards, kv_evict_policy ev)
{
    kv_store *s = mk(4 * NP, host_pages, n_shards, ev);
    int32_t a[NT], b[NT];
    prompt(a, NT, 1);
    prompt(b, NT, 2);
    cr_assert_eq(serve(s, a, NT), 0);
    cr_assert_eq(serve(s, b, NT), 0); /* another prompt, so level 1 has a choice */
    cr_assert_eq(serve(s, a, NT), NP, "fully cached before the level 1");
    int n = kv_store_evict_oldest_fraction(s, 0.25);
    cr_assert_eq(n, (2 * NP + 3) / 4, "a quarter of the cached pages, rounded up: %d", n);
    expect_clean(s, "after the level 1");
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pages, (uint64_t)(2 * NP - n));
    int first = serve(s, b, NT);
    cr_assert_gt(first, 0, "the head of the evicted chain is still there");
    expect_clean(s, "after the recompute");
    cr_assert_eq(serve(s, b, NT), NP, "the whole prefix again on the second request");
    cr_assert_eq(serve(s, a, NT), NP);
    expect_clean(s, "at the end");
    kv_store_destroy(s);
}

Test(kvshard_chains, level_1_then_a_recompute_caches_the_whole_prompt_again)
{
    level_1_then_the_prompt_twice(0, 1, KV_EVICT_LRU);
}

/* A host tier too small for what level 1 moves: most of it is dropped there. */
Test(kvshard_chains, level_1_with_a_small_host_tier_then_the_whole_prompt_again)
{
    level_1_then_the_prompt_twice(2, 1, KV_EVICT_LRU);
}

Test(kvshard_chains, level_1_with_a_host_tier_then_the_whole_prompt_again)
{
    level_1_then_the_prompt_twice(4 * NP, 1, KV_EVICT_LRU_PRIORITY);
}

/* Pages of one chain spread over shards: a chain leaves every shard it spans, tail first. */
Test(kvshard_chains, level_1_over_shards_then_the_whole_prompt_again)
{
    level_1_then_the_prompt_twice(0, 4, KV_EVICT_LRU);
    level_1_then_the_prompt_twice(8, 3, KV_EVICT_LRU_PRIORITY);
}

/* Eviction under memory pressure (a running request needs room) takes chains from their tails;
 * the request then ends without publishing, so the recompute after it needs no room. */
Test(kvshard_chains, pressure_eviction_leaves_no_unreachable_page)
{
    for (int shards = 1; shards <= 2; shards++)
        for (int ev = KV_EVICT_LRU; ev <= KV_EVICT_LRU_PRIORITY; ev++) {
            kv_store *s = mk(2 * NP + 8, 0, shards, (kv_evict_policy)ev);
            int32_t a[NT], b[NT];
            prompt(a, NT, 1);
            prompt(b, NT, 2);
            serve(s, a, NT);
            serve(s, b, NT);
            kv_seq *x;
            kv_seq_create(s, &x);
            cr_assert_eq(kv_seq_reserve(s, x, NT), 0, "room made by evicting most of a");
            kv_seq_destroy(s, x);
            expect_clean(s, "after the pressure");
            int first = serve(s, a, NT);
            /* one shard: the head stays; two: freeing a shard's pages may take whole chains */
            cr_assert(first < NP && (shards > 1 || first > 0), "shards %d policy %d: %d left",
                      shards, ev, first);
            expect_clean(s, "after the recompute");
            cr_assert_eq(serve(s, a, NT), NP, "shards %d policy %d: the whole prefix again", shards,
                         ev);
            kv_store_destroy(s);
        }
}

/* A shared prefix (a system prompt) stays while one of its continuations goes. */
Test(kvshard_chains, a_shared_prefix_stays_while_its_branches_go)
{
    kv_store *s = mk(4 * NP, 0, 1, KV_EVICT_LRU);
    int32_t a[NT], b[NT];
    prompt(a, NT, 1);
    memcpy(b, a, sizeof b);
    for (int i = NT / 2; i < NT; i++) b[i] += 500; /* the same first 15 pages */
    serve(s, a, NT);
    cr_assert_eq(serve(s, b, NT), NT / 2 / PT);
    /* a's own pages (16 of them) are the oldest: all go, b's and the shared ones stay */
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 15.5 / (NP + NP - NT / 2 / PT)), 16);
    expect_clean(s, "after the level 1");
    km_pagehash h[NP];
    km_pagehash_chain(g_seed, b, NT, PT, h, NP);
    cr_assert_eq(kv_store_lookup(s, h, b, NP, NULL), NP, "the other branch is whole");
    km_pagehash_chain(g_seed, a, NT, PT, h, NP);
    cr_assert_eq(kv_store_lookup(s, h, a, NP, NULL), NT / 2 / PT, "the shared prefix stays");
    cr_assert_eq(serve(s, a, NT), NT / 2 / PT);
    cr_assert_eq(serve(s, a, NT), NP);
    kv_store_destroy(s);
}

/* A store holding prompt seed 1 (tokens a, page hashes h), served once. */
static kv_store *cached_prompt(int32_t *a, km_pagehash *h)
{
    kv_store *s = mk(4 * NP, 0, 1, KV_EVICT_LRU);
    prompt(a, NT, 1);
    serve(s, a, NT);
    km_pagehash_chain(g_seed, a, NT, PT, h, NP);
    return s;
}

/* An orphan as the old eviction left them: the head recomputed under the same hash is a new
 * page, so the old tail hangs from nothing. kv_store_check says so, and publishing the
 * recomputed prompt replaces the orphan and its descendants. */
Test(kvshard_chains, check_reports_an_orphan_and_publishing_replaces_it)
{
    int32_t a[NT];
    km_pagehash h[NP];
    kv_store *s = cached_prompt(a, h);
    kv_page *head = kv_index_find(s, h[0]);
    cr_assert_not_null(head);
    head->id = ++s->next_page_id; /* what a drop and a recompute of the head leave */
    kv_index_relink(s);
    km_errbuf err;
    cr_assert_eq(kv_store_check(s, &err), KM_ECORRUPT);
    cr_assert_not_null(strstr(err.msg, "unreachable"), "%s", err.msg);
    cr_assert_eq(kv_store_lookup(s, h, a, NP, NULL), 1);
    cr_assert_eq(serve(s, a, NT), 1);
    expect_clean(s, "after the recompute");
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.pages_indexed, NP, "the orphans were replaced, not kept beside");
    cr_assert_eq(serve(s, a, NT), NP);
    kv_store_destroy(s);
}

/* A request attaches a cached prompt and runs a lossy policy that drops attached pages from its
 * table while it holds later ones: the dropped pages must stay (their children are held) until
 * the sequence lets go. */
Test(kvshard_chains, pages_a_lossy_sequence_let_go_of_stay_while_it_holds_their_children)
{
    int32_t a[NT];
    km_pagehash h[NP];
    kv_store *s = cached_prompt(a, h);
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_attach(s, q, h, a, NP), NP);
    kv_seq_policy po = {.kind = KV_SEQ_STREAMING, .sink_pages = 1, .window_pages = 2};
    cr_assert_eq(kv_seq_set_policy(s, q, &po), 0);
    cr_assert_eq(kv_seq_reserve(s, q, NT + 1), 0);
    cr_assert_gt(kv_seq_dropped_pages(q), 0);
    expect_clean(s, "after the policy dropped pages");
    kv_store_evict_oldest_fraction(s, 1.0);
    expect_clean(s, "after a level 1");
    cr_assert_eq(kv_store_lookup(s, h, a, NP, NULL), NP, "nothing of the held chain went");
    kv_seq_destroy(s, q);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), NP);
    expect_clean(s, "at the end");
    kv_store_destroy(s);
}

/* kv_store_held (issue 39, item 2: what a background pull asks before it starts) gives what
 * kv_store_lookup gives, without counting a hit or a miss. */
Test(kvshard_chains, held_answers_as_lookup_without_counting)
{
    int32_t a[NT], b[NT];
    km_pagehash h[NP];
    kv_store *s = cached_prompt(a, h);
    memcpy(b, a, sizeof b);
    for (int i = 5 * PT; i < NT; i++) b[i] += 500; /* the same first 5 pages */
    km_pagehash hb[NP];
    km_pagehash_chain(g_seed, b, NT, PT, hb, NP);
    kv_store_stats before, after;
    kv_store_stats_get(s, &before);
    cr_assert_eq(kv_store_held(s, h, a, NP, NULL), NP);
    cr_assert_eq(kv_store_held(s, hb, b, NP, NULL), 5);
    kv_store_stats_get(s, &after);
    cr_assert_eq(after.hits, before.hits, "held counted a hit");
    cr_assert_eq(after.misses, before.misses, "held counted a miss");
    cr_assert_eq(kv_store_lookup(s, hb, b, NP, NULL), 5);
    kv_store_stats_get(s, &after);
    cr_assert_eq(after.hits, before.hits + 1, "lookup still counts its hit");
    kv_store_destroy(s);
}
