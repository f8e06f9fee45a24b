/*
 * test_controller_roles.c — roles follow the load (controller/roles.c) with a fake clock: a
 * missed pool borrows a worker from one with room only after the window, never the other pool's
 * last worker nor one that changed role within the hold; the lent worker goes back when both
 * pools are calm for a window; idle members' old quantiles do not count; one change at a time;
 * an operator's role becomes the member's own; off moves nothing; the policy hands on each
 * member's role, load and p90s from its heartbeat.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "controller/controller.h"

static ctl_roles *roles;
static ctl_roles_cfg cfg;
static ctl_role_load w[4];
static const char *const ids[4] = {"w0", "w1", "w2", "w3"};

/* 1 prefill (w0) + 3 decode (w1..w3), idle; window 1 s, hold 2 s, queue target 2. */
static void setup(void)
{
    ctl_roles_cfg_default(&cfg);
    cfg.window_ms = 1000;
    cfg.hold_ms = 2000;
    cfg.queue_target = 2;
    cfg.change_timeout_ms = 5000;
    for (int i = 0; i < 4; i++)
        w[i] = (ctl_role_load){
            .worker = ids[i], .ready = true, .role = i ? KM_WROLE_DECODE : KM_WROLE_PREFILL};
}

static void start(void)
{
    cr_assert_eq(ctl_roles_create(&cfg, &roles), 0);
}

static void teardown(void)
{
    ctl_roles_destroy(roles);
    roles = NULL;
}

TestSuite(controller_roles, .init = setup, .fini = teardown);

/* Steps every 250 ms from t to until (inclusive); the first change decided, its time in *at. */
static int run(uint64_t t, uint64_t until, ctl_role_change *ch, uint64_t *at)
{
    for (; t <= until; t += 250) {
        int rc = ctl_roles_step(roles, w, 4, t, ch);
        cr_assert(rc == 0 || rc == 1);
        if (rc == 1) {
            if (at) *at = t;
            return 1;
        }
    }
    return 0;
}

/* The worker's heartbeat now shows the change. */
static void apply(const ctl_role_change *ch)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(w[i].worker, ch->worker)) w[i].role = ch->to;
}

Test(controller_roles, a_prefill_queue_borrows_the_least_loaded_decode_worker_after_the_window)
{
    start();
    ctl_role_change ch;
    cr_assert_eq(run(0, 3000, &ch, NULL), 0, "idle: nothing moves");
    w[0].running = 1, w[0].queue_depth = 5; /* prefill load 6 > 2 */
    w[1].running = 3, w[2].running = 1, w[3].running = 2;
    uint64_t at = 0;
    cr_assert_eq(run(3250, 6000, &ch, &at), 1);
    cr_assert_geq(at, 3250 + 1000, "moved before the window (at %llu)", (unsigned long long)at);
    cr_assert_str_eq(ch.worker, "w2");
    cr_assert_eq(ch.from, KM_WROLE_DECODE);
    cr_assert_eq(ch.to, KM_WROLE_PREFILL);
    cr_assert_str_eq(ch.reason, "prefill_queue");
    cr_assert_eq(ch.n_prefill, 1);
    cr_assert_eq(ch.n_decode, 3);
    cr_assert_float_eq(ch.prefill_load, 6, 1e-9);
    cr_assert_geq(ch.id, 1ull << 62, "role ids are apart from recovery action ids");
}

Test(controller_roles, one_change_at_a_time_until_the_heartbeat_shows_it_or_it_times_out)
{
    start();
    w[0].queue_depth = 9;
    ctl_role_change ch, ch2;
    cr_assert_eq(run(2000, 4000, &ch, NULL), 1);
    /* still missing, but the first change is not shown yet */
    cr_assert_eq(run(4250, 8750, &ch2, NULL), 0);
    /* change_timeout passed: given up; a new window starts, and another change comes */
    cr_assert_eq(run(9000, 20000, &ch2, NULL), 1);
    cr_assert_eq(ctl_roles_done(roles, ch2.id, false), 0, "refused: forgotten at once");
    cr_assert_eq(ctl_roles_done(roles, ch2.id, true), KM_ENOTFOUND);
}

Test(controller_roles, the_lent_worker_goes_back_when_both_pools_are_calm_for_a_window)
{
    start();
    w[0].queue_depth = 6;
    ctl_role_change ch;
    uint64_t at = 0;
    cr_assert_eq(run(2000, 5000, &ch, &at), 1);
    apply(&ch);
    cr_assert_eq(ctl_roles_done(roles, ch.id, true), 0);
    /* the burst ends at once: the worker still holds its new role for hold_ms */
    w[0].queue_depth = 0;
    uint64_t t = at + 250, back = 0;
    ctl_role_change ch2;
    cr_assert_eq(run(t, t + 1500, &ch2, NULL), 0, "went back within the hold");
    cr_assert_eq(run(t + 1750, t + 6000, &ch2, &back), 1);
    cr_assert_str_eq(ch2.worker, ch.worker);
    cr_assert_eq(ch2.from, KM_WROLE_PREFILL);
    cr_assert_eq(ch2.to, KM_WROLE_DECODE);
    cr_assert_str_eq(ch2.reason, "calm");
    cr_assert_eq(ch2.n_prefill, 2);
    apply(&ch2);
    /* home again: calm moves nothing more */
    cr_assert_eq(run(back + 250, back + 10000, &ch2, NULL), 0);
}

Test(controller_roles, never_the_last_worker_of_a_pool_nor_a_pool_without_room)
{
    w[2].role = w[3].role = KM_WROLE_BOTH; /* 1 prefill + 1 decode */
    start();
    w[0].queue_depth = 20;
    ctl_role_change ch;
    cr_assert_eq(run(0, 10000, &ch, NULL), 0, "the only decode worker moved");
    teardown();
    setup();
    start();
    w[0].queue_depth = 20;
    w[1].queue_depth = w[2].queue_depth = w[3].queue_depth = 2; /* 6 over 2 workers: 3 > 2 */
    cr_assert_eq(run(0, 10000, &ch, NULL), 0, "a decode pool without room gave a worker");
}

Test(controller_roles, latency_targets_count_only_for_busy_workers)
{
    cfg.ttft_target_ms = 1000;
    cfg.itl_target_ms = 100;
    start();
    ctl_role_change ch;
    w[0].ttft_ms = 5000; /* old quantiles of an idle prefill worker */
    cr_assert_eq(run(0, 5000, &ch, NULL), 0);
    w[0].running = 1; /* busy: its TTFT now says the prefill pool misses */
    cr_assert_eq(run(5250, 8000, &ch, NULL), 1);
    cr_assert_str_eq(ch.reason, "prefill_ttft");
    cr_assert_float_eq(ch.ttft_ms, 5000, 1e-9);
}

Test(controller_roles, a_slow_decode_pool_borrows_a_prefill_worker_with_room)
{
    cfg.itl_target_ms = 100;
    w[1].role = KM_WROLE_PREFILL; /* 2 prefill (w0, w1) + 2 decode */
    start();
    w[2].running = 4, w[2].itl_ms = 300;
    ctl_role_change ch;
    cr_assert_eq(run(0, 4000, &ch, NULL), 1);
    cr_assert_str_eq(ch.reason, "decode_itl");
    cr_assert_eq(ch.to, KM_WROLE_DECODE);
    cr_assert_float_eq(ch.itl_ms, 300, 1e-9);
}

Test(controller_roles, an_operators_role_becomes_the_members_own)
{
    start();
    ctl_role_change ch;
    cr_assert_eq(run(0, 3000, &ch, NULL), 0);
    w[3].role = KM_WROLE_PREFILL; /* `kvmesh role`: not a change of ours */
    cr_assert_eq(run(3250, 20000, &ch, NULL), 0, "calm sent the operator's choice back");
}

Test(controller_roles, off_moves_nothing_and_missing_members_are_forgotten)
{
    cfg.on = false;
    start();
    w[0].queue_depth = 50;
    ctl_role_change ch;
    cr_assert_eq(run(0, 20000, &ch, NULL), 0);
    cr_assert_eq(ctl_roles_step(roles, w, 0, 20250, &ch), 0, "no members: nothing to do");
    cr_assert_eq(ctl_roles_done(roles, 1ull << 62, true), KM_ENOTFOUND);
}

Test(controller_roles, the_policy_gives_each_members_role_load_and_p90s_from_its_heartbeat)
{
    ctl_policy_cfg pc;
    ctl_policy_cfg_default(&pc);
    ctl_policy *p = NULL;
    cr_assert_eq(ctl_policy_create(&pc, 4, &p), 0);
    const km_latency_q lat[3] = {{.q = 0.5, .ttft_ms = 100, .tpot_ms = 10},
                                 {.q = 0.9, .ttft_ms = 900, .tpot_ms = 90},
                                 {.q = 0.99, .ttft_ms = 2000, .tpot_ms = 200}};
    km_msg_heartbeat hb = {.worker = "w7",
                           .seq = 1,
                           .uptime_ms = 10,
                           .state = KM_STATE_READY,
                           .running = 3,
                           .queue_depth = 2,
                           .latency = lat,
                           .n_latency = 3,
                           .role = KM_WROLE_PREFILL};
    ctl_action act;
    cr_assert_eq(ctl_policy_heartbeat(p, &hb, 1000, &act), 0);
    ctl_role_load l;
    cr_assert_eq(ctl_policy_role_load(p, 0, &l), 0);
    cr_assert_str_eq(l.worker, "w7");
    cr_assert(l.ready);
    cr_assert_eq(l.role, KM_WROLE_PREFILL);
    cr_assert_eq(l.running, 3);
    cr_assert_eq(l.queue_depth, 2);
    cr_assert_float_eq(l.ttft_ms, 900, 1e-9);
    cr_assert_float_eq(l.itl_ms, 90, 1e-9);
    cr_assert_eq(ctl_policy_role_load(p, 1, &l), KM_ENOTFOUND);
    ctl_policy_destroy(p);
}
