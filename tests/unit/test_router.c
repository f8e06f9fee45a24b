/*
 * test_router.c — the router's routing core without sockets: the prefix index (events, tiers,
 * pending marks, forgetting a worker, a full table), the event-stream ordering (duplicates,
 * gaps, replays, overflow, resync) and the policy (cost model, tier credits, rendezvous ties and
 * cold placement, load, round-robin and random baselines), and the cluster-view rules (endpoint
 * matching, which members are routable and which migrate), and the router's model metadata
 * (common/) agreeing with the worker's loader.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "router/route.h"
#include "worker/worker.h"

static const double CREDIT[3] = {1.0, 0.8, 0.5};

/* A chain of n pages under salt, as the router computes it. */
static void chain(const char *salt, int n, km_pagehash *out)
{
    int32_t toks[16 * 512];
    cr_assert(n <= 512);
    for (int i = 0; i < n * 16; i++) toks[i] = i * 7 + 3;
    km_pagehash seed = km_pagehash_seed("fp", 2, 42, salt, strlen(salt));
    cr_assert_eq(km_pagehash_chain(seed, toks, n * 16, 16, out, n), n);
}

static rt_index *mk(size_t n)
{
    rt_index *x = NULL;
    cr_assert_eq(rt_index_create(n, 1000, &x), 0);
    return x;
}

Test(router_index, stored_pages_match_the_longest_prefix_per_worker)
{
    rt_index *x = mk(1024);
    km_pagehash c[8];
    chain("a", 8, c);
    cr_assert_eq(rt_index_apply(x, 0, KM_KV_STORED, KM_TIER_HOT, KM_TIER_HOT, c, 8), 0);
    cr_assert_eq(rt_index_apply(x, 1, KM_KV_STORED, KM_TIER_HOT, KM_TIER_HOT, c, 3), 0);
    rt_match m;
    rt_index_match(x, c, 8, 0x7, CREDIT, 16, 0, &m);
    cr_assert_eq(m.pages[0], 8);
    cr_assert_eq(m.pages[1], 3);
    cr_assert_eq(m.pages[2], 0);
    cr_assert_float_eq(m.credit[0], 128.0, 1e-9);
    cr_assert_eq(rt_index_pages(x, 0, KM_TIER_HOT), 8);
    cr_assert_eq(rt_index_size(x), 8);
    rt_index_destroy(x);
}

Test(router_index, a_hole_in_the_chain_ends_the_match)
{
    rt_index *x = mk(1024);
    km_pagehash c[6];
    chain("a", 6, c);
    rt_index_apply(x, 0, KM_KV_STORED, KM_TIER_HOT, 0, c, 6);
    rt_index_apply(x, 0, KM_KV_REMOVED, 0, 0, &c[2], 1);
    rt_match m;
    rt_index_match(x, c, 6, 1, CREDIT, 16, 0, &m);
    cr_assert_eq(m.pages[0], 2);
    cr_assert_eq(rt_index_pages(x, 0, KM_TIER_HOT), 5);
    rt_index_destroy(x);
}

Test(router_index, tiers_give_their_credit_and_moves_are_tracked)
{
    rt_index *x = mk(1024);
    km_pagehash c[4];
    chain("t", 4, c);
    rt_index_apply(x, 0, KM_KV_STORED, KM_TIER_HOT, 0, c, 4);
    rt_index_apply(x, 0, KM_KV_TIER, KM_TIER_HOST, KM_TIER_HOT, &c[2], 1);
    rt_index_apply(x, 0, KM_KV_TIER, KM_TIER_DISK, KM_TIER_HOT, &c[3], 1);
    rt_match m;
    rt_index_match(x, c, 4, 1, CREDIT, 16, 0, &m);
    cr_assert_eq(m.pages[0], 4);
    cr_assert_float_eq(m.credit[0], 16 * (1 + 1 + 0.8 + 0.5), 1e-9);
    cr_assert_eq(rt_index_pages(x, 0, KM_TIER_HOT), 2);
    cr_assert_eq(rt_index_pages(x, 0, KM_TIER_HOST), 1);
    cr_assert_eq(rt_index_pages(x, 0, KM_TIER_DISK), 1);
    rt_index_destroy(x);
}

Test(router_index, salts_never_share_pages)
{
    rt_index *x = mk(1024);
    km_pagehash a[4], b[4];
    chain("tenant-a", 4, a);
    chain("tenant-b", 4, b);
    rt_index_apply(x, 0, KM_KV_STORED, KM_TIER_HOT, 0, a, 4);
    rt_match m;
    rt_index_match(x, b, 4, 1, CREDIT, 16, 0, &m);
    cr_assert_eq(m.pages[0], 0);
    rt_index_destroy(x);
}

Test(router_index, pending_marks_count_until_they_expire_or_are_confirmed)
{
    rt_index *x = mk(1024);
    km_pagehash c[4];
    chain("p", 4, c);
    rt_index_mark_pending(x, 2, c, 4, 5000);
    rt_match m;
    rt_index_match(x, c, 4, 1u << 2, CREDIT, 16, 5500, &m);
    cr_assert_eq(m.pages[2], 4);
    cr_assert_eq(m.stored[2], 0, "pending pages cannot be handed over (pulled) yet");
    cr_assert_eq(rt_index_pages(x, 2, KM_TIER_HOT), 0, "pending pages are not confirmed pages");
    rt_index_match(x, c, 4, 1u << 2, CREDIT, 16, 7000, &m);
    cr_assert_eq(m.pages[2], 0, "expired");
    rt_index_sweep(x, 7000);
    cr_assert_eq(rt_index_size(x), 0);
    /* confirmed by an event: no longer expires */
    rt_index_mark_pending(x, 2, c, 4, 8000);
    rt_index_apply(x, 2, KM_KV_STORED, KM_TIER_HOT, 0, c, 4);
    rt_index_match(x, c, 4, 1u << 2, CREDIT, 16, 100000, &m);
    cr_assert_eq(m.pages[2], 4);
    cr_assert_eq(m.stored[2], 4);
    rt_index_destroy(x);
}

Test(router_index, forgetting_a_worker_keeps_the_others)
{
    rt_index *x = mk(4096);
    km_pagehash c[64];
    chain("f", 64, c);
    rt_index_apply(x, 0, KM_KV_STORED, KM_TIER_HOT, 0, c, 64);
    rt_index_apply(x, 1, KM_KV_STORED, KM_TIER_HOST, 0, c, 32);
    rt_index_forget_worker(x, 0);
    cr_assert_eq(rt_index_size(x), 32);
    cr_assert_eq(rt_index_pages(x, 0, KM_TIER_HOT), 0);
    rt_match m;
    rt_index_match(x, c, 64, 3, CREDIT, 16, 0, &m);
    cr_assert_eq(m.pages[0], 0);
    cr_assert_eq(m.pages[1], 32);
    rt_index_destroy(x);
}

Test(router_index, a_full_index_drops_and_counts_and_deletions_keep_lookups_right)
{
    rt_index *x = mk(64);
    km_pagehash c[100];
    chain("full", 100, c);
    int lost = rt_index_apply(x, 0, KM_KV_STORED, KM_TIER_HOT, 0, c, 100);
    cr_assert_eq(lost, 36);
    cr_assert_eq(rt_index_size(x), 64);
    cr_assert_eq(rt_index_dropped(x), 36);
    /* remove every other page; the rest must still be found (backward-shift deletion) */
    for (int i = 0; i < 64; i += 2) rt_index_apply(x, 0, KM_KV_REMOVED, 0, 0, &c[i], 1);
    cr_assert_eq(rt_index_size(x), 32);
    for (int i = 1; i < 64; i += 2) {
        rt_match m;
        rt_index_match(x, &c[i], 1, 1, CREDIT, 16, 0, &m);
        cr_assert_eq(m.pages[0], 1, "page %d lost after deletions", i);
    }
    cr_assert_eq(rt_index_apply(x, RT_MAX_WORKERS, KM_KV_STORED, 0, 0, c, 1), KM_EINVAL);
    rt_index_destroy(x);
}

Test(router_index, random_churn_agrees_with_a_reference_model)
{
    enum { N = 300 };
    rt_index *x = mk(1024);
    km_pagehash c[N];
    chain("churn", N, c);
    int ref[N][4]; /* tier+1 per worker, 0 = absent */
    memset(ref, 0, sizeof ref);
    uint64_t s = 12345;
    for (int step = 0; step < 20000; step++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int p = (int)((s >> 33) % N), w = (int)((s >> 20) % 4), op = (int)((s >> 10) % 3);
        km_tier t = (km_tier)((s >> 5) % 3);
        if (op == 2) {
            rt_index_apply(x, w, KM_KV_REMOVED, 0, 0, &c[p], 1);
            ref[p][w] = 0;
        } else {
            rt_index_apply(x, w, op ? KM_KV_TIER : KM_KV_STORED, t, KM_TIER_HOT, &c[p], 1);
            ref[p][w] = (int)t + 1;
        }
    }
    for (int w = 0; w < 4; w++) {
        uint64_t cnt[3] = {0};
        for (int p = 0; p < N; p++) {
            if (ref[p][w]) cnt[ref[p][w] - 1]++;
            rt_match m;
            rt_index_match(x, &c[p], 1, 1ull << w, CREDIT, 16, 0, &m);
            cr_assert_eq(m.pages[w], ref[p][w] ? 1 : 0);
        }
        for (int t = 0; t < 3; t++) cr_assert_eq(rt_index_pages(x, w, (km_tier)t), cnt[t]);
    }
    rt_index_destroy(x);
}

/* ---------------------------------------------------------------- event streams */

typedef struct applied {
    uint64_t seqs[64];
    int n;
} applied;

static void record(void *user, const km_msg_kv_event *ev)
{
    applied *a = user;
    a->seqs[a->n++] = ev->seq;
}

static km_msg_kv_event ev(uint64_t seq)
{
    static const uint8_t h[16] = {1};
    return (km_msg_kv_event){
        .worker = "w0", .seq = seq, .kind = KM_KV_STORED, .hashes = h, .n_hashes = 1};
}

Test(router_evstream, in_order_events_apply_and_duplicates_drop)
{
    rt_evstream *s;
    cr_assert_eq(rt_evstream_create(8, &s), 0);
    applied a = {0};
    for (uint64_t i = 0; i < 3; i++) {
        km_msg_kv_event e = ev(i);
        cr_assert_eq(rt_evstream_push(s, &e, record, &a), RT_EV_APPLIED);
    }
    km_msg_kv_event e = ev(1);
    cr_assert_eq(rt_evstream_push(s, &e, record, &a), RT_EV_DUPLICATE);
    cr_assert_eq(a.n, 3);
    cr_assert_eq(rt_evstream_next(s), 3);
    rt_evstream_destroy(s);
}

Test(router_evstream, a_gap_holds_events_until_the_replay_fills_it)
{
    rt_evstream *s;
    rt_evstream_create(8, &s);
    applied a = {0};
    km_msg_kv_event e0 = ev(0), e3 = ev(3), e4 = ev(4), e1 = ev(1), e2 = ev(2);
    rt_evstream_push(s, &e0, record, &a);
    cr_assert_eq(rt_evstream_push(s, &e3, record, &a), RT_EV_GAP);
    cr_assert(rt_evstream_waiting(s));
    cr_assert_eq(rt_evstream_next(s), 1, "the replay is asked from 1");
    cr_assert_eq(rt_evstream_push(s, &e4, record, &a), RT_EV_HELD);
    cr_assert_eq(rt_evstream_push(s, &e1, record, &a), RT_EV_APPLIED);
    cr_assert_eq(rt_evstream_push(s, &e2, record, &a), RT_EV_APPLIED);
    cr_assert_eq(a.n, 5);
    for (int i = 0; i < 5; i++) cr_assert_eq(a.seqs[i], (uint64_t)i, "applied in order");
    cr_assert_not(rt_evstream_waiting(s));
    cr_assert_eq(rt_evstream_gaps(s), 1);
    rt_evstream_destroy(s);
}

Test(router_evstream, a_failed_replay_resumes_from_the_held_events)
{
    rt_evstream *s;
    rt_evstream_create(8, &s);
    applied a = {0};
    km_msg_kv_event e7 = ev(7), e8 = ev(8), e6 = ev(6);
    cr_assert_eq(rt_evstream_push(s, &e7, record, &a), RT_EV_GAP, "router started late");
    rt_evstream_push(s, &e8, record, &a);
    cr_assert_eq(rt_evstream_resync(s, record, &a), 2);
    cr_assert_eq(rt_evstream_next(s), 9);
    cr_assert_eq(rt_evstream_push(s, &e6, record, &a), RT_EV_DUPLICATE);
    rt_evstream_destroy(s);
}

Test(router_evstream, resync_with_nothing_held_adopts_the_next_seq)
{
    rt_evstream *s;
    rt_evstream_create(8, &s);
    applied a = {0};
    rt_evstream_set_waiting(s, true); /* a replay from 0 asked at connect */
    cr_assert_eq(rt_evstream_resync(s, record, &a), 0);
    km_msg_kv_event e = ev(500);
    cr_assert_eq(rt_evstream_push(s, &e, record, &a), RT_EV_APPLIED);
    cr_assert_eq(rt_evstream_next(s), 501);
    rt_evstream_destroy(s);
}

Test(router_evstream, overflow_is_reported_and_reset_restarts_at_zero)
{
    rt_evstream *s;
    rt_evstream_create(2, &s);
    applied a = {0};
    km_msg_kv_event e5 = ev(5), e6 = ev(6), e7 = ev(7), e0 = ev(0);
    rt_evstream_push(s, &e5, record, &a);
    rt_evstream_push(s, &e6, record, &a);
    cr_assert_eq(rt_evstream_push(s, &e7, record, &a), RT_EV_OVERFLOW);
    rt_evstream_reset(s);
    cr_assert_eq(rt_evstream_push(s, &e0, record, &a), RT_EV_APPLIED);
    cr_assert_eq(a.n, 1);
    rt_evstream_destroy(s);
}

/* ---------------------------------------------------------------- policy */

static rt_candidate cand(const char *id, int inflight, double cached)
{
    return (rt_candidate){.id = id,
                          .usable = true,
                          .inflight = inflight,
                          .slots = 8,
                          .max_inflight = 64,
                          .cached_tokens = cached};
}

Test(router_policy, the_worker_holding_the_prefix_wins)
{
    rt_policy p;
    rt_policy_default(&p);
    km_pagehash k = {1, 2};
    rt_candidate c[4] = {cand("w0", 0, 0), cand("w1", 2, 1024), cand("w2", 0, 0),
                         cand("w3", 0, 512)};
    uint64_t st = 0;
    cr_assert_eq(rt_pick(&p, c, 4, 1100, k, &st), 1);
}

Test(router_policy, load_outweighs_a_small_prefix)
{
    rt_policy p;
    rt_policy_default(&p);
    km_pagehash k = {1, 2};
    rt_candidate c[2] = {cand("w0", 12, 64), cand("w1", 0, 0)};
    uint64_t st = 0;
    /* w0: 36 uncached + 8 running * 32 + 4 queued * 256 = 1316 > w1: 100 */
    cr_assert_eq(rt_pick(&p, c, 2, 100, k, &st), 1);
    cr_assert_float_eq(rt_cost(&p, &c[0], 100), 36 + 8 * 32 + 4 * 256, 1e-9);
}

Test(router_policy, cold_prefixes_spread_by_rendezvous_and_stick)
{
    rt_policy p;
    rt_policy_default(&p);
    const char *ids[4] = {"w0", "w1", "w2", "w3"};
    int hits[4] = {0};
    for (int t = 0; t < 400; t++) {
        km_pagehash seed = km_pagehash_seed("fp", 2, 1, (const char *)&t, sizeof t);
        rt_candidate c[4];
        for (int i = 0; i < 4; i++) c[i] = cand(ids[i], 0, 0);
        uint64_t st = 0;
        int a = rt_pick(&p, c, 4, 100, seed, &st);
        int b = rt_pick(&p, c, 4, 100, seed, &st);
        cr_assert_eq(a, b, "same key, same worker");
        /* the choice is by id, not by position: a replica listing workers in another order
         * agrees */
        rt_candidate r[4] = {c[3], c[2], c[1], c[0]};
        cr_assert_eq(3 - rt_pick(&p, r, 4, 100, seed, &st), a);
        hits[a]++;
    }
    for (int i = 0; i < 4; i++) cr_assert(hits[i] > 60 && hits[i] < 140, "w%d got %d", i, hits[i]);
}

/* A cold prefix (held nowhere) goes past a worker with first prefills still to compute, whatever
 * rendezvous prefers: in flight alone, a worker computing two prefixes looks as busy as one
 * serving two hits. */
Test(router_policy, a_cold_prefix_avoids_a_worker_with_a_prefill_backlog)
{
    rt_policy p;
    rt_policy_default(&p);
    const char *ids[4] = {"w0", "w1", "w2", "w3"};
    km_pagehash k = {5, 6};
    rt_candidate c[4];
    for (int i = 0; i < 4; i++) c[i] = cand(ids[i], 1, 0);
    uint64_t st = 0;
    int first = rt_pick(&p, c, 4, 900, k, &st);
    c[first].backlog = 1800; /* two first prefills of ~900 tokens ahead */
    int next = rt_pick(&p, c, 4, 900, k, &st);
    cr_assert_neq(next, first);
    cr_assert_float_eq(rt_cost(&p, &c[first], 900), 900 + 1800 + 32, 1e-9);
}

Test(router_policy, unusable_and_full_workers_are_skipped)
{
    rt_policy p;
    rt_policy_default(&p);
    km_pagehash k = {9, 9};
    rt_candidate c[3] = {cand("w0", 0, 1000), cand("w1", 64, 1000), cand("w2", 5, 0)};
    c[0].usable = false;
    uint64_t st = 0;
    cr_assert_eq(rt_pick(&p, c, 3, 1000, k, &st), 2);
    c[2].inflight = 64;
    cr_assert_eq(rt_pick(&p, c, 3, 1000, k, &st), KM_EOVERLOAD);
    c[1].usable = c[2].usable = false;
    cr_assert_eq(rt_pick(&p, c, 3, 1000, k, &st), KM_ENOTFOUND);
}

Test(router_policy, baselines_ignore_the_cache)
{
    rt_policy p;
    rt_policy_default(&p);
    p.mode = RT_MODE_ROUND_ROBIN;
    km_pagehash k = {1, 1};
    rt_candidate c[3] = {cand("a", 0, 1000), cand("b", 0, 0), cand("c", 0, 0)};
    uint64_t st = 0;
    int seen[3] = {0};
    for (int i = 0; i < 9; i++) seen[rt_pick(&p, c, 3, 1000, k, &st)]++;
    cr_assert(seen[0] == 3 && seen[1] == 3 && seen[2] == 3);
    p.mode = RT_MODE_RANDOM;
    memset(seen, 0, sizeof seen);
    st = 7;
    for (int i = 0; i < 300; i++) seen[rt_pick(&p, c, 3, 1000, k, &st)]++;
    for (int i = 0; i < 3; i++) cr_assert(seen[i] > 60);
    rt_mode m;
    cr_assert_eq(rt_mode_parse("round-robin", &m), 0);
    cr_assert_eq(m, RT_MODE_ROUND_ROBIN);
    cr_assert_eq(rt_mode_parse("bogus", &m), KM_EINVAL);
}

/* ---------------------------------------------------------------- cluster view (view.c) */

Test(router_view, endpoint_spellings_of_one_worker_match)
{
    char out[128];
    cr_assert_eq(rt_endpoint_norm("tcp://LocalHost:7100", out, sizeof out), 0);
    cr_assert_str_eq(out, "tcp://127.0.0.1:7100");
    cr_assert_eq(rt_endpoint_norm("TCP://0.0.0.0:7100", out, sizeof out), 0);
    cr_assert_str_eq(out, "tcp://127.0.0.1:7100");
    cr_assert_eq(rt_endpoint_norm("tcp://*:7100", out, sizeof out), 0);
    cr_assert_str_eq(out, "tcp://127.0.0.1:7100");
    cr_assert_eq(rt_endpoint_norm("tcp://[::1]:7100", out, sizeof out), 0);
    cr_assert_str_eq(out, "tcp://127.0.0.1:7100");
    cr_assert_eq(rt_endpoint_norm("tcp://10.0.0.5:7100", out, sizeof out), 0);
    cr_assert_str_eq(out, "tcp://10.0.0.5:7100");
    cr_assert_eq(rt_endpoint_norm("ipc:///tmp/w0", out, sizeof out), 0);
    cr_assert_str_eq(out, "ipc:///tmp/w0");
    cr_assert(rt_endpoint_same("tcp://localhost:7100", "tcp://127.0.0.1:7100"));
    cr_assert(!rt_endpoint_same("tcp://127.0.0.1:7100", "tcp://127.0.0.1:7110"));
    cr_assert(!rt_endpoint_same("tcp://10.0.0.5:7100", "tcp://10.0.0.6:7100"));
    cr_assert(!rt_endpoint_same("", "tcp://127.0.0.1:7100"));
    cr_assert(!rt_endpoint_same(NULL, "tcp://127.0.0.1:7100"));
    cr_assert_neq(rt_endpoint_norm("tcp://nohostport", out, sizeof out), 0);
    cr_assert_eq(rt_endpoint_norm("tcp://127.0.0.1:7100", out, 8), KM_ERANGE);
}

Test(router_view, only_ready_members_of_a_fresh_view_are_routable)
{
    for (int s = 0; s < KM_MEMBER_STATE_COUNT; s++) {
        km_member_state st = (km_member_state)s;
        /* a fresh view that names the worker decides, but never over a dropped connection */
        cr_assert_eq(rt_member_routable(true, true, true, st), st == KM_MEMBER_READY, "%s",
                     km_member_state_name(st));
        cr_assert(!rt_member_routable(false, true, true, st));
        /* a stale view: the router's own liveness; a fresh view that does not name the worker:
         * not routable (a slot the controller never admitted or has forgotten) */
        cr_assert(rt_member_routable(true, false, true, st));
        cr_assert(rt_member_routable(true, false, false, st));
        cr_assert(!rt_member_routable(true, true, false, st));
        cr_assert(!rt_member_routable(false, false, true, st));
        /* only a fresh "dead" or "left" migrates in-flight requests */
        cr_assert_eq(rt_member_migrates(true, true, st),
                     st == KM_MEMBER_DEAD || st == KM_MEMBER_LEFT);
        cr_assert(!rt_member_migrates(false, true, st));
        cr_assert(!rt_member_migrates(true, false, st));
    }
}

Test(router_view, ready_and_draining_members_serve_their_pages_to_pulls)
{
    for (int s = 0; s < KM_MEMBER_STATE_COUNT; s++) {
        km_member_state st = (km_member_state)s;
        /* a draining worker (or a level-3 drained one: restarting) takes nothing new but hands
         * its pages to the requests migrated off it; a dead or starting one has none to hand */
        cr_assert_eq(rt_member_serves_pages(true, true, true, st),
                     st == KM_MEMBER_READY || st == KM_MEMBER_DRAINING ||
                         st == KM_MEMBER_RESTARTING || st == KM_MEMBER_LEFT,
                     "%s", km_member_state_name(st));
        cr_assert(!rt_member_serves_pages(false, true, true, st));
        cr_assert(!rt_member_serves_pages(false, false, true, st));
        cr_assert(rt_member_serves_pages(true, false, true, st));
        cr_assert(!rt_member_serves_pages(true, true, false, st));
    }
}

/* The router reads the model's metadata with common/'s md_model_info, never loading its weights;
 * the workers load it with en_model_load. The page-hash chain seeds from the fingerprint, so the
 * two must agree to the bit, and so must the name clients use and the tokenizer. */
Test(router_model, metadata_from_common_equals_the_workers_loader)
{
    const char *path = md_default_model_path();
    FILE *f = fopen(path, "rb");
    if (!f) cr_skip_test("no model at %s", path);
    fclose(f);
    km_errbuf err = {{0}};
    md_model_info *info = NULL;
    cr_assert_eq(md_model_info_open(path, &info, &err), 0, "%s", err.msg);
    en_model *m = NULL;
    cr_assert_eq(en_model_load(path, &m, &err), 0, "%s", err.msg);
    char fp[33];
    en_model_fingerprint_hex(m, fp);
    cr_assert_str_eq(md_model_info_fingerprint(info), fp);
    cr_assert_eq(strlen(fp), 32);
    cr_assert_str_eq(md_model_info_name(info), en_model_name(m));
    cr_assert_eq(md_model_info_chat(info), en_model_chat_kind(m));
    const md_tokenizer *a = md_model_info_tokenizer(info), *b = en_model_tokenizer(m);
    cr_assert_eq(md_tok_n_vocab(a), md_tok_n_vocab(b));
    const char *text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n";
    int32_t ta[64], tb[64];
    int na = md_tok_encode(a, text, strlen(text), 1, 1, ta, 64);
    int nb = md_tok_encode(b, text, strlen(text), 1, 1, tb, 64);
    cr_assert_gt(na, 0);
    cr_assert_eq(na, nb);
    cr_assert_arr_eq(ta, tb, sizeof(int32_t) * (size_t)na);
    en_model_free(m);
    md_model_info_close(info);

    char name[64];
    md_model_display_name("/a/b/SmolLM2-135M-Instruct.Q4_1.gguf", name, sizeof name);
    cr_assert_str_eq(name, "SmolLM2-135M-Instruct.Q4_1");
    md_model_display_name("plain", name, sizeof name);
    cr_assert_str_eq(name, "plain");
    cr_assert_neq(md_model_info_open("/nonexistent.gguf", &info, &err), 0);
    cr_assert_null(info);
}
