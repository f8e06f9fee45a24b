/*
 * test_router_pull.c — the router's pull-or-recompute rule (router/pull.c, docs/transfer.md):
 * with every figure measured it pulls exactly when pull_ms < recompute_ms x margin, the holder
 * is the one with the longest prefix that can serve, a worker without measured figures is never
 * told to pull unless the default rate stands in for the transfer rate (it does by default; 0
 * turns it off), and a chosen worker that holds the most already gets no hint. Chunk pulls are
 * decided and priced before the pick by the same rule at the chunk credit's share.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "router/route.h"

static rt_policy pol;

static void setup(void)
{
    rt_policy_default(&pol);
}

TestSuite(router_pull, .init = setup);

/* A 368,640-byte f16 page of the default model, 16 tokens a page. */
#define PB 368640.0
#define PT 16

static rt_pull_in measured(int pages)
{
    return (rt_pull_in){.pages = pages,
                        .serves = true,
                        .rate_bps = 1e9, /* a page in PB / 1e9 s */
                        .lat_ms = 2,
                        .prefill_tps = 1000, /* a page in PT / 1000 s */
                        .page_bytes = PB};
}

Test(router_pull, pulls_a_longer_prefix_when_pulling_is_cheaper)
{
    rt_pull_in c[3] = {measured(0), measured(100), measured(40)};
    rt_pull_choice ch;
    cr_assert_eq(rt_pull_decide(&pol, c, 3, 0, PT, &ch), RT_PULL_PULL);
    cr_assert_eq(ch.holder, 1, "the longest prefix");
    cr_assert_eq(ch.pages, 100);
    cr_assert_float_eq(ch.pull_ms, 2 + 100 * PB / 1e9 * 1000, 1e-9);
    cr_assert_float_eq(ch.recompute_ms, 100 * 16 / 1000.0 * 1000, 1e-9);
}

Test(router_pull, recomputes_when_the_transfer_is_slower_than_the_margin_allows)
{
    rt_pull_in c[2] = {measured(0), measured(10)};
    /* pull: 2 + 10 x 0.36864 / r ... make the rate such that pull = 0.9 x recompute */
    double recompute = 10 * 16 / 1000.0 * 1000; /* 160 ms */
    c[0].lat_ms = 0;
    c[0].rate_bps = 10 * PB / (0.9 * recompute / 1000);
    rt_pull_choice ch;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_RECOMPUTE, "0.9 > margin 0.8");
    c[0].rate_bps = 10 * PB / (0.7 * recompute / 1000);
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL, "0.7 < margin 0.8");
    pol.pull_margin = 0.5;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_RECOMPUTE, "margin 0.5");
}

/* A chunk's pages (docs/blend.md) are pulled by the same rule, but reusing a chunk saves only
 * chunk_credit of computing it (it is still partly recomputed): a pull at 0.7 of computing is
 * worth it for a prefix, not for a chunk at credit 0.5; at 0.3 it is. */
Test(router_pull, a_chunk_is_pulled_when_pulling_beats_the_share_of_computing_reuse_saves)
{
    rt_pull_in c[2] = {measured(0), measured(5)};
    double recompute = 5 * 16 / 1000.0 * 1000; /* 80 ms */
    c[0].lat_ms = 0;
    c[0].rate_bps = 5 * PB / (0.7 * recompute / 1000);
    rt_pull_choice ch;
    pol.chunk_credit = 0.5;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL, "a prefix: pulled");
    cr_assert_eq(rt_chunk_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_RECOMPUTE,
                 "0.7 > 0.5 x margin 0.8");
    cr_assert_float_eq(ch.recompute_ms, 0.5 * recompute, 1e-9, "the saving is the credit's share");
    c[0].rate_bps = 5 * PB / (0.3 * recompute / 1000);
    cr_assert_eq(rt_chunk_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL, "0.3 < 0.4");
    cr_assert_eq(ch.holder, 1);
    c[0].pages = 5; /* the chosen worker holds the chunk: nothing to pull */
    cr_assert_eq(rt_chunk_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_NONE);
    c[0].pages = 0;
    c[0].rate_bps = 0, c[1].rate_bps = 0, pol.pull_default_bps = 0;
    cr_assert_eq(rt_chunk_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_UNMEASURED);
}

/* A chunk pull is priced before the pick as a prefix pull is, at the chunk credit's share: the
 * chunk tokens the candidate lacks past the preamble page, less the pull's time and the tie
 * band; nothing for the holder, or where the pull is not worth it. Equally loaded, the puller's
 * credit stays below the holder's own for the chunk (chunks.c: chunk_credit of its tokens). */
Test(router_pull, a_chunk_pull_is_credited_with_the_share_of_prefill_it_saves)
{
    /* the holder: the preamble page and 20 chunk pages; another holds the preamble only */
    rt_pull_in c[3] = {measured(0), measured(21), measured(1)};
    pol.chunk_credit = 0.5;
    const double band = pol.tie_band;
    const double pull0 = 2 + 21 * PB / 1e9 * 1000, rec0 = 0.5 * 21 * PT / 1000.0 * 1000;
    cr_assert_float_eq(rt_chunk_pull_credit(&pol, c, 3, 0, PT),
                       0.5 * 20 * PT * (1 - pull0 / rec0) - band, 1e-9,
                       "the chunk's 20 pages, not the preamble's");
    const double pull2 = 2 + 20 * PB / 1e9 * 1000, rec2 = 0.5 * 20 * PT / 1000.0 * 1000;
    cr_assert_float_eq(rt_chunk_pull_credit(&pol, c, 3, 2, PT),
                       0.5 * 20 * PT * (1 - pull2 / rec2) - band, 1e-9);
    cr_assert_lt(rt_chunk_pull_credit(&pol, c, 3, 0, PT), 0.5 * 20 * PT,
                 "below the holder's credit for the chunk");
    cr_assert_eq(rt_chunk_pull_credit(&pol, c, 3, 1, PT), 0, "the holder itself");
    c[0].rate_bps = 21 * PB / (0.9 * rec0 / 1000); /* a pull at 0.9 of what reuse saves */
    c[0].lat_ms = 0;
    cr_assert_eq(rt_chunk_pull_credit(&pol, c, 3, 0, PT), 0, "0.9 > margin 0.8: not pulled");
    pol.chunk_credit = 0; /* no chunk credit: no chunk is worth pulling */
    cr_assert_eq(rt_chunk_pull_credit(&pol, c, 3, 2, PT), 0);
}

/* A document (a chunk of 40 pages) cached on one worker: credited alone (chunk_credit of its
 * tokens), its holder keeps the requests that carry it however busy it gets past the others;
 * with the chunk pull priced, a less loaded worker that would pull it wins sooner. */
Test(router_pull, a_chunk_on_a_busy_holder_goes_to_a_worker_that_pulls_it_sooner)
{
    enum { W = 3, PAGES = 40 };
    rt_pull_in in[W];
    for (int i = 0; i < W; i++) in[i] = measured(i == 1 ? 1 + PAGES : 0);
    pol.chunk_credit = 0.5;
    const char *ids[W] = {"w0", "w1", "w2"};
    km_pagehash key = {.lo = 3, .hi = 5};
    int flip[2] = {99, 99}; /* the first busy level at which w1 loses: without, with pricing */
    for (int priced = 0; priced < 2; priced++)
        for (int busy = 0; busy <= 12 && flip[priced] == 99; busy++) {
            rt_candidate c[W];
            uint64_t st = 0;
            for (int i = 0; i < W; i++) {
                c[i] = (rt_candidate){.id = ids[i], .usable = true, .slots = 8, .max_inflight = 64};
                c[i].inflight = i == 1 ? busy : 1;
                c[i].cached_tokens = i == 1 ? 0.5 * PAGES * PT : 0;
                if (priced) c[i].cached_tokens += rt_chunk_pull_credit(&pol, in, W, i, PT);
            }
            if (rt_pick(&pol, c, W, PAGES * PT + 300, key, &st) != 1) flip[priced] = busy;
        }
    cr_log_info("the holder loses at %d busy without chunk pull pricing, %d with", flip[0],
                flip[1]);
    cr_assert_gt(flip[1], 1, "as idle as the others, the holder keeps it");
    cr_assert_lt(flip[1], flip[0], "priced, the pull wins sooner");
}

/* The chosen worker's pulls from this very holder (the view's xfer_pairs) price the pull, not
 * its rate over every holder: a holder behind a slow hop is recomputed from even though the
 * worker pulls fast from the others, and a fast pair pulls where the average would not. */
Test(router_pull, a_pairs_own_figures_come_before_the_workers_overall_ones)
{
    rt_pull_in c[2] = {measured(0), measured(10)};
    rt_pull_choice ch;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL, "1 GB/s overall");
    c[1].pair_rate_bps = 1e7; /* 100 times slower from this holder: dearer than computing */
    c[1].pair_lat_ms = 5;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_RECOMPUTE);
    cr_assert_float_eq(ch.pull_ms, 5 + 10 * PB / 1e7 * 1000, 1e-9);
    c[0].rate_bps = 1e7; /* slow overall, fast from this holder */
    c[1].pair_rate_bps = 1e9;
    c[1].pair_lat_ms = 1;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL);
    cr_assert_float_eq(ch.pull_ms, 1 + 10 * PB / 1e9 * 1000, 1e-9);
}

Test(router_pull, nothing_to_decide_when_the_chosen_worker_holds_the_most)
{
    rt_pull_in c[3] = {measured(50), measured(50), measured(20)};
    rt_pull_choice ch;
    cr_assert_eq(rt_pull_decide(&pol, c, 3, 0, PT, &ch), RT_PULL_NONE);
    cr_assert_eq(ch.holder, -1);
}

Test(router_pull, a_holder_that_cannot_serve_is_passed_over)
{
    rt_pull_in c[3] = {measured(0), measured(100), measured(30)};
    c[1].serves = false; /* draining, or no transfer node */
    rt_pull_choice ch;
    cr_assert_eq(rt_pull_decide(&pol, c, 3, 0, PT, &ch), RT_PULL_PULL);
    cr_assert_eq(ch.holder, 2);
    c[2].serves = false;
    cr_assert_eq(rt_pull_decide(&pol, c, 3, 0, PT, &ch), RT_PULL_NONE);
}

Test(router_pull, before_any_measured_rate_the_default_rate_decides_and_0_means_recompute)
{
    rt_pull_in c[2] = {measured(0), measured(100)};
    c[0].rate_bps = c[1].rate_bps = 0; /* nobody has pulled yet */
    rt_pull_choice ch;
    cr_assert_eq(pol.pull_default_bps, RT_PULL_DEFAULT_BPS); /* on with default flags */
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL);
    pol.pull_default_bps = 0;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_UNMEASURED);
    c[1].rate_bps = 1e9; /* another worker has measured one: the cluster's figure */
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL);
    c[0].prefill_tps = 0; /* the chosen worker's prefill rate is unknown */
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_UNMEASURED);
    c[0].prefill_tps = 1000;
    c[1].page_bytes = 0; /* the holder's page size is unknown */
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_UNMEASURED);
}

Test(router_pull, smaller_pages_make_pulling_cheaper)
{
    /* f16 pages too slow to pull, fp8 pages (0.5625 x) fast enough */
    rt_pull_in c[2] = {measured(0), measured(10)};
    double recompute = 160;
    c[0].lat_ms = 0;
    c[0].rate_bps = 10 * PB / (0.95 * recompute / 1000);
    rt_pull_choice ch;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_RECOMPUTE);
    c[1].page_bytes = PB * 0.5625;
    cr_assert_eq(rt_pull_decide(&pol, c, 2, 0, PT, &ch), RT_PULL_PULL);
}

Test(router_pull, a_hint_worked_when_the_cached_tokens_cover_its_pages)
{
    cr_assert(rt_pull_hint_ok(12 * 16, 12, 16));
    cr_assert(rt_pull_hint_ok(11 * 16 + 1, 12, 16), "one page of slack");
    cr_assert(rt_pull_hint_ok(11 * 16, 12, 16));
    cr_assert(!rt_pull_hint_ok(11 * 16 - 1, 12, 16));
    cr_assert(!rt_pull_hint_ok(0, 12, 16), "nothing arrived");
    cr_assert(rt_pull_hint_ok(0, 1, 16));
}

Test(router_pull, failed_hints_back_a_pair_off_doubling_up_to_a_minute)
{
    cr_assert_eq(rt_pull_backoff_ms(0), 0);
    cr_assert_eq(rt_pull_backoff_ms(1), 1000);
    cr_assert_eq(rt_pull_backoff_ms(2), 2000);
    cr_assert_eq(rt_pull_backoff_ms(6), 32000);
    cr_assert_eq(rt_pull_backoff_ms(7), 60000);
    cr_assert_eq(rt_pull_backoff_ms(1000), 60000);
}

/* What a pull saves is priced for the cost model: the pulled pages' tokens less the prefill time
 * the pull takes and the tie band; nothing when it would not be pulled (no cheaper pull, nobody
 * to pull from). */
Test(router_pull, a_pull_is_credited_with_the_prefill_it_saves)
{
    rt_pull_in c[3] = {measured(0), measured(50), measured(10)};
    double pull = 2 + 50 * PB / 1e9 * 1000, recompute = 50 * PT / 1000.0 * 1000;
    double band = pol.tie_band; /* a pull never ties with a holder as loaded */
    cr_assert_float_eq(rt_pull_credit(&pol, c, 3, 0, PT), 50 * PT * (1 - pull / recompute) - band,
                       1e-9);
    cr_assert_float_eq(rt_pull_credit(&pol, c, 3, 2, PT),
                       40 * PT * (1 - (2 + 40 * PB / 1e6) / (40 * PT)) - band, 1e-9,
                       "only the pages it lacks");
    c[2].pages = 49; /* one page to pull: it saves less than the band */
    cr_assert_eq(rt_pull_credit(&pol, c, 3, 2, PT), 0);
    c[2].pages = 10;
    cr_assert_eq(rt_pull_credit(&pol, c, 3, 1, PT), 0, "the holder itself");
    c[0].rate_bps = 1e6; /* a slow link: pulling dearer than computing */
    cr_assert_eq(rt_pull_credit(&pol, c, 3, 0, PT), 0);
    c[0].rate_bps = 1e9;
    c[1].serves = c[2].serves = false; /* draining without a node, or backed off */
    cr_assert_eq(rt_pull_credit(&pol, c, 3, 0, PT), 0);
}

/* A skewed workload's hot tenant: its holder keeps it while it is no busier than the others;
 * once its queue costs more than a pull, a less loaded worker that can pull wins (and gets the
 * hint), while without a pull to price it the holder keeps every request however busy. */
Test(router_pull, a_hot_prefix_goes_to_a_less_loaded_worker_once_its_holder_is_busy)
{
    enum { W = 4, PAGES = 55 };
    rt_pull_in in[W];
    for (int i = 0; i < W; i++) in[i] = measured(i == 2 ? PAGES : 0);
    const char *ids[W] = {"w0", "w1", "w2", "w3"};
    rt_candidate c[W];
    int n_prompt = PAGES * PT + 12;
    km_pagehash key = {.lo = 7, .hi = 9};
    uint64_t st = 0;
    for (int busy = 0; busy <= 4; busy++) {
        for (int i = 0; i < W; i++) {
            c[i] = (rt_candidate){.id = ids[i], .usable = true, .slots = 8, .max_inflight = 64};
            c[i].inflight = i == 2 ? busy : 1;
            c[i].cached_tokens = i == 2 ? PAGES * PT : 0;
        }
        cr_assert_eq(rt_pick(&pol, c, W, n_prompt, key, &st), 2, "no pull priced: sticky");
        for (int i = 0; i < W; i++) c[i].cached_tokens += rt_pull_credit(&pol, in, W, i, PT);
        int pick = rt_pick(&pol, c, W, n_prompt, key, &st);
        if (busy == 2) continue; /* within the tie band of a pull: rendezvous decides */
        if (busy <= 1)
            cr_assert_eq(pick, 2, "holder as idle as the rest (busy %d)", busy);
        else
            cr_assert_neq(pick, 2, "holder %d busy, the others 1: pulling is cheaper", busy);
        rt_pull_choice ch;
        cr_assert_eq(rt_pull_decide(&pol, in, W, pick, PT, &ch),
                     pick == 2 ? RT_PULL_NONE : RT_PULL_PULL);
    }
}
