/*
 * test_router_pd.c — the router's disaggregation rule (router/pd.c, docs/disaggregation.md): a
 * cluster disaggregates only with a usable prefill and a usable decode worker; a request is
 * disaggregated only when its pick is a decode worker and at least min_tokens of the prompt are
 * uncached there; the prefill worker is the one holding the longest prefix, then the least
 * loaded; min_tokens 0 turns it off.
 */
#include <criterion/criterion.h>

#include "router/route.h"

TestSuite(router_pd);

#define PT 16

static rt_pd_in wk(km_worker_role role, int pages, int inflight)
{
    return (rt_pd_in){.role = role, .usable = true, .pages = pages, .inflight = inflight};
}

Test(router_pd, needs_both_roles)
{
    rt_pd_in c[3] = {wk(KM_WROLE_BOTH, 0, 0), wk(KM_WROLE_DECODE, 0, 0), wk(KM_WROLE_BOTH, 0, 0)};
    cr_assert_not(rt_pd_cluster(c, 3));
    cr_assert_eq(rt_pd_decide(c, 3, 1, 2000, PT, 512), -1);
    c[2].role = KM_WROLE_PREFILL;
    cr_assert(rt_pd_cluster(c, 3));
    c[2].usable = false; /* unreachable, or backing off after a failed hint */
    cr_assert_not(rt_pd_cluster(c, 3));
    cr_assert_eq(rt_pd_decide(c, 3, 1, 2000, PT, 512), -1);
}

Test(router_pd, long_uncached_prompts_on_a_decode_worker_only)
{
    rt_pd_in c[2] = {wk(KM_WROLE_PREFILL, 0, 0), wk(KM_WROLE_DECODE, 0, 0)};
    cr_assert_eq(rt_pd_decide(c, 2, 1, 2000, PT, 512), 0);
    cr_assert_eq(rt_pd_decide(c, 2, 1, 511, PT, 512), -1, "short");
    cr_assert_eq(rt_pd_decide(c, 2, 1, 512, PT, 512), 0, "at the threshold");
    c[1].pages = 100; /* 1600 of 2000 tokens cached on the decode worker */
    cr_assert_eq(rt_pd_decide(c, 2, 1, 2000, PT, 512), -1, "mostly cached there");
    c[1].pages = 0;
    cr_assert_eq(rt_pd_decide(c, 2, 1, 2000, PT, 0), -1, "off");
    cr_assert_eq(rt_pd_decide(c, 2, 0, 2000, PT, 512), -1, "the pick is no decode worker");
    c[1].role = KM_WROLE_BOTH;
    cr_assert_eq(rt_pd_decide(c, 2, 1, 2000, PT, 512), -1, "a both worker computes itself");
}

Test(router_pd, prefill_worker_by_longest_prefix_then_load)
{
    rt_pd_in c[4] = {wk(KM_WROLE_PREFILL, 10, 0), wk(KM_WROLE_DECODE, 0, 0),
                     wk(KM_WROLE_PREFILL, 40, 5), wk(KM_WROLE_PREFILL, 40, 2)};
    cr_assert_eq(rt_pd_decide(c, 4, 1, 2000, PT, 512), 3);
    c[3].pages = 39;
    cr_assert_eq(rt_pd_decide(c, 4, 1, 2000, PT, 512), 2);
    c[2].usable = false;
    cr_assert_eq(rt_pd_decide(c, 4, 1, 2000, PT, 512), 3);
}
