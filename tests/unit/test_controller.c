/*
 * test_controller.c — the controller's recovery policy (controller/policy.c) driven by synthetic
 * heartbeats and a fake clock: thresholds and hysteresis, the cooldown ordering 1 -> 2 -> 3,
 * repeat-window escalation, revert after low pressure, stalls, error storms, RSS, dead after
 * missed beats and back, restart detection, the state a fresh policy rebuilds from heartbeats
 * (a controller restart), operator-forced levels, and undo when a command cannot be delivered.
 *
 * The policy has no sockets and no clock, so nothing here waits: time is the now_ms argument.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "controller/controller.h"

/* A worker's heartbeat with one hot-tier KV entry of 1 GB. */
typedef struct fake_hb {
    km_msg_heartbeat hb;
    km_kv_usage kv[2];
    km_error_count errs[1];
    km_endpoint eps[2];
} fake_hb;

#define BUDGET 1000000000ull

static void mk(fake_hb *f, const char *id, uint64_t seq, uint64_t uptime_ms, double pressure,
               const char *fmt)
{
    memset(f, 0, sizeof *f);
    f->kv[0] = (km_kv_usage){.shard = 0,
                             .tier = KM_TIER_HOT,
                             .format = fmt,
                             .pages = 100,
                             .bytes = BUDGET,
                             .capacity_bytes = BUDGET,
                             .pinned_bytes = (uint64_t)(pressure * (double)BUDGET)};
    f->kv[1] = (km_kv_usage){.shard = 0,
                             .tier = KM_TIER_HOST,
                             .format = fmt,
                             .bytes = 4 * BUDGET,
                             .capacity_bytes = 4 * BUDGET,
                             .pinned_bytes = 4 * BUDGET};
    f->eps[0] = (km_endpoint){"requests", "tcp://127.0.0.1:7100"};
    f->eps[1] = (km_endpoint){"events", "tcp://127.0.0.1:7101"};
    f->hb = (km_msg_heartbeat){.worker = id,
                               .seq = seq,
                               .uptime_ms = uptime_ms,
                               .state = KM_STATE_READY,
                               .endpoints = f->eps,
                               .n_endpoints = 2,
                               .model = "smollm2",
                               .kv = f->kv,
                               .n_kv = 2,
                               .rss_bytes = 1 << 20};
}

/* A worker process for the fake clock: each beat advances seq and uptime together with now. */
typedef struct fake_worker {
    const char *id;
    uint64_t seq, start_ms;
    const char *fmt;
    const char *base; /* hb.kv_format_base; NULL = absent (f16 assumed) */
    km_worker_state state;
    uint32_t running;
    uint64_t tokens, errors, rss, gpu;
} fake_worker;

static ctl_policy *pol;
static ctl_policy_cfg cfg;

static void setup(void)
{
    ctl_policy_cfg_default(&cfg);
}
static void teardown(void)
{
    ctl_policy_destroy(pol);
    pol = NULL;
}

static void start(void)
{
    cr_assert_eq(ctl_policy_create(&cfg, 0, &pol), 0);
}

/* One heartbeat of w at now with pressure p; returns the policy's answer (1 = *act filled). */
static int beat(fake_worker *w, uint64_t now, double p, ctl_action *act)
{
    fake_hb f;
    mk(&f, w->id, ++w->seq, now - w->start_ms, p, w->fmt ? w->fmt : "f16");
    f.hb.state = w->state;
    f.hb.kv_format_base = w->base;
    f.hb.running = w->running;
    f.hb.tokens_total = w->tokens;
    f.hb.rss_bytes = w->rss ? w->rss : 1 << 20;
    f.hb.gpu_bytes = w->gpu;
    if (w->errors) {
        f.errs[0] = (km_error_count){"engine", w->errors};
        f.hb.errors = f.errs;
        f.hb.n_errors = 1;
    }
    ctl_action dummy;
    return ctl_policy_heartbeat(pol, &f.hb, now, act ? act : &dummy);
}

static km_view_worker view(const char *id, uint64_t now, km_recovery_action *hist)
{
    km_view_worker v;
    int i = ctl_policy_find(pol, id);
    cr_assert_geq(i, 0, "%s is not a member", id);
    cr_assert_eq(ctl_policy_view_worker(pol, i, now, now, hist != NULL, &v, hist), 0);
    return v;
}

static km_member_state state_of(const char *id)
{
    return view(id, 0, NULL).state;
}
static uint32_t level_of(const char *id)
{
    return view(id, 0, NULL).level;
}

TestSuite(controller_policy, .init = setup, .fini = teardown);

Test(controller_policy, pressure_counts_pinned_hot_bytes_not_cached_ones)
{
    fake_hb f;
    mk(&f, "w0", 1, 1, 0.25, "f16");
    /* the hot tier is full of bytes, but only a quarter is pinned; the host tier is ignored */
    cr_assert_float_eq(ctl_pressure(&f.hb, 0, 0, NULL), 0.25, 1e-9);
    /* summed over shards */
    f.kv[1] = (km_kv_usage){.shard = 1,
                            .tier = KM_TIER_HOT,
                            .format = "f16",
                            .bytes = BUDGET,
                            .capacity_bytes = BUDGET,
                            .pinned_bytes = BUDGET};
    cr_assert_float_eq(ctl_pressure(&f.hb, 0, 0, NULL), 0.625, 1e-9);
    /* RSS against max_rss counts when it is the larger */
    const char *why = NULL;
    f.hb.rss_bytes = 950;
    cr_assert_float_eq(ctl_pressure(&f.hb, 1000, 0, &why), 0.95, 1e-9);
    cr_assert_str_eq(why, "rss");
    /* and GPU memory against max_gpu */
    f.hb.gpu_bytes = 980;
    cr_assert_float_eq(ctl_pressure(&f.hb, 1000, 1000, &why), 0.98, 1e-9);
    cr_assert_str_eq(why, "gpu");
    cr_assert_float_eq(ctl_pressure(&f.hb, 0, 0, &why), 0.625, 1e-9);
    cr_assert_str_eq(why, "kv_pressure");
    f.hb.n_kv = 0;
    cr_assert_float_eq(ctl_pressure(&f.hb, 0, 0, NULL), 0, 1e-9);
}

Test(controller_policy, level1_fires_at_the_high_threshold_and_is_acknowledged)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.50, &a), 0);
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    cr_assert_eq(beat(&w, 2000, 0.899, &a), 0, "below high: nothing");
    cr_assert_eq(beat(&w, 3000, 0.90, &a), 1);
    cr_assert_str_eq(a.worker, "w0");
    cr_assert_eq(a.level, 1);
    cr_assert_eq(a.cmd, KM_ADMIN_EVICT);
    cr_assert_float_eq(a.fraction, 0.25, 1e-9);
    cr_assert_str_eq(a.reason, "kv_pressure");
    cr_assert_float_eq(a.pressure, 0.90, 1e-6);
    cr_assert_eq(level_of("w0"), 1);
    km_recovery_action h[KM_PROTO_MAX_HISTORY];
    km_view_worker v = view("w0", 3000, h);
    cr_assert_eq(v.n_history, 1);
    cr_assert_eq(h[0].level, 1);
    cr_assert_not(h[0].ok, "not acknowledged yet");
    cr_assert_eq(ctl_policy_ack(pol, "w0", a.id, true), 0);
    v = view("w0", 3000, h);
    cr_assert(h[0].ok);
    cr_assert_eq(h[0].at_ms, 3000);
    cr_assert_eq(ctl_policy_ack(pol, "w0", a.id + 100, true), KM_ENOTFOUND);
    cr_assert_eq(ctl_policy_ack(pol, "nobody", a.id, true), KM_ENOTFOUND);
}

Test(controller_policy, hysteresis_holds_between_the_thresholds)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.95, &a), 1);
    cr_assert_eq(a.level, 1);
    /* between low and high: level 1 stays in effect, nothing is sent */
    for (uint64_t t = 2000; t <= 9000; t += 1000) cr_assert_eq(beat(&w, t, 0.80, &a), 0);
    cr_assert_eq(level_of("w0"), 1);
    /* at or below low: calm again (eviction needs no undoing: no command) */
    cr_assert_eq(beat(&w, 10000, 0.70, &a), 0);
    cr_assert_eq(level_of("w0"), 0);
    cr_assert_eq(beat(&w, 11000, 0.85, &a), 0, "rising again below high does nothing");
}

Test(controller_policy, cooldown_orders_level1_then_2_then_3)
{
    cfg.l1_repeat = 0;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.95, &a), 1);
    cr_assert_eq(a.level, 1);
    for (uint64_t t = 2000; t < 6000; t += 1000)
        cr_assert_eq(beat(&w, t, 0.95, &a), 0, "level 2 waits for the cooldown (t=%llu)",
                     (unsigned long long)t);
    cr_assert_eq(beat(&w, 6000, 0.95, &a), 1);
    cr_assert_eq(a.level, 2);
    cr_assert_eq(a.cmd, KM_ADMIN_SET_KV_FORMAT);
    cr_assert_str_eq(a.format, "fp8");
    ctl_policy_ack(pol, "w0", a.id, true);
    w.fmt = "fp8"; /* the worker converted */
    for (uint64_t t = 7000; t < 11000; t += 1000)
        cr_assert_eq(beat(&w, t, 0.95, &a), 0, "level 3 waits for the cooldown");
    cr_assert_eq(level_of("w0"), 2);
    cr_assert_eq(beat(&w, 11000, 0.95, &a), 1);
    cr_assert_eq(a.level, 3);
    cr_assert_eq(a.cmd, KM_ADMIN_DRAIN);
    cr_assert_str_eq(a.reason, "kv_pressure");
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    cr_assert_eq(level_of("w0"), 3);
    km_recovery_action h[KM_PROTO_MAX_HISTORY];
    km_view_worker v = view("w0", 11000, h);
    cr_assert_eq(v.n_history, 3);
    cr_assert_eq(h[0].level, 1);
    cr_assert_eq(h[1].level, 2);
    cr_assert_eq(h[2].level, 3);
}

Test(controller_policy, level1_repeated_within_the_window_escalates_to_level2)
{
    start(); /* l1_repeat 3 within 60 s, cooldown 5 s */
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    uint64_t t = 1000;
    for (int k = 0; k < 3; k++) {
        cr_assert_eq(beat(&w, t, 0.95, &a), 1);
        cr_assert_eq(a.level, 1, "fire %d", k);
        cr_assert_eq(beat(&w, t + 1000, 0.50, &a), 0); /* relieved at once */
        cr_assert_eq(level_of("w0"), 0);
        t += 6000;
    }
    cr_assert_eq(beat(&w, t, 0.95, &a), 1);
    cr_assert_eq(a.level, 2, "the fourth spike within the window goes to fp8");
    cr_assert_str_eq(a.reason, "l1_repeat");
}

Test(controller_policy, level1_spread_beyond_the_window_stays_level1)
{
    cfg.l1_window_ms = 10000;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    for (uint64_t t = 1000; t < 100000; t += 12000) {
        cr_assert_eq(beat(&w, t, 0.95, &a), 1);
        cr_assert_eq(a.level, 1);
        cr_assert_eq(beat(&w, t + 1000, 0.50, &a), 0);
    }
}

Test(controller_policy, level2_reverts_after_pressure_stayed_low)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY, .fmt = "fp8"};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.50, &a), 0);
    cr_assert_eq(level_of("w0"), 2);
    /* low for 29 s, then a bump above low restarts the clock */
    for (uint64_t t = 2000; t <= 30000; t += 1000) cr_assert_eq(beat(&w, t, 0.50, &a), 0);
    cr_assert_eq(beat(&w, 31000, 0.75, &a), 0);
    for (uint64_t t = 32000; t < 62000; t += 1000)
        cr_assert_eq(beat(&w, t, 0.50, &a), 0, "t=%llu", (unsigned long long)t);
    cr_assert_eq(beat(&w, 62000, 0.50, &a), 1);
    cr_assert_eq(a.level, 0);
    cr_assert_eq(a.cmd, KM_ADMIN_SET_KV_FORMAT);
    cr_assert_str_eq(a.format, "f16");
    cr_assert_str_eq(a.reason, "low_pressure");
    cr_assert_eq(level_of("w0"), 0);
    /* the worker's next heartbeats say f16; nothing more happens */
    w.fmt = "f16";
    cr_assert_eq(beat(&w, 63000, 0.50, &a), 0);
    cr_assert_eq(level_of("w0"), 0);
}

Test(controller_policy, a_stall_fires_level3)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY, .running = 1, .tokens = 100};
    ctl_action a;
    /* tokens moving: no stall */
    for (uint64_t t = 1000; t <= 20000; t += 1000) {
        w.tokens += 10;
        cr_assert_eq(beat(&w, t, 0.1, &a), 0);
    }
    /* stuck for 15 s */
    for (uint64_t t = 21000; t < 35000; t += 1000) cr_assert_eq(beat(&w, t, 0.1, &a), 0);
    cr_assert_eq(beat(&w, 35000, 0.1, &a), 1);
    cr_assert_eq(a.level, 3);
    cr_assert_str_eq(a.reason, "stall");
    cr_assert_eq(a.cmd, KM_ADMIN_DRAIN);
}

Test(controller_policy, an_idle_worker_or_one_without_a_token_count_never_stalls)
{
    start();
    fake_worker idle = {.id = "idle", .state = KM_STATE_READY, .tokens = 100};
    fake_worker old = {.id = "old", .state = KM_STATE_READY, .running = 2}; /* tokens_total 0 */
    for (uint64_t t = 1000; t <= 60000; t += 1000) {
        cr_assert_eq(beat(&idle, t, 0.1, NULL), 0);
        cr_assert_eq(beat(&old, t, 0.1, NULL), 0);
    }
}

Test(controller_policy, an_error_storm_fires_level3)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY, .errors = 5};
    ctl_action a;
    for (uint64_t t = 1000; t <= 10000; t += 1000) {
        w.errors += 40; /* 40/s: below 50/s */
        cr_assert_eq(beat(&w, t, 0.1, &a), 0);
    }
    w.errors += 120;
    cr_assert_eq(beat(&w, 11000, 0.1, &a), 1);
    cr_assert_eq(a.level, 3);
    cr_assert_str_eq(a.reason, "errors");
}

Test(controller_policy, rss_at_the_limit_fires_level3_and_counts_as_pressure)
{
    cfg.max_rss = 1000000;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY, .rss = 920000};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.1, &a), 1);
    cr_assert_eq(a.level, 1, "RSS at 92%% of the limit is pressure");
    cr_assert_str_eq(a.reason, "rss");
    w.rss = 1000000;
    cr_assert_eq(beat(&w, 2000, 0.1, &a), 1);
    cr_assert_eq(a.level, 3);
    cr_assert_str_eq(a.reason, "rss");
}

Test(controller_policy, gpu_memory_at_the_limit_fires_level3_and_counts_as_pressure)
{
    cfg.max_gpu = 1000000;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY, .gpu = 950000};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.1, &a), 1);
    cr_assert_eq(a.level, 1);
    cr_assert_str_eq(a.reason, "gpu");
    w.gpu = 1000000;
    cr_assert_eq(beat(&w, 2000, 0.1, &a), 1);
    cr_assert_eq(a.level, 3);
    cr_assert_str_eq(a.reason, "gpu");
}

Test(controller_policy, missed_beats_make_a_member_dead_and_beats_bring_it_back)
{
    cfg.heartbeat_ms = 200;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    beat(&w, 1000, 0.1, NULL);
    cr_assert_eq(ctl_policy_tick(pol, 1500), 0);
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    uint64_t v = ctl_policy_version(pol);
    cr_assert_eq(ctl_policy_tick(pol, 1600), 1, "3 intervals of 200 ms missed");
    cr_assert_eq(state_of("w0"), KM_MEMBER_DEAD);
    cr_assert_gt(ctl_policy_version(pol), v);
    cr_assert_eq(ctl_policy_count(pol, KM_MEMBER_DEAD), 1);
    cr_assert_eq(ctl_policy_tick(pol, 5000), 0, "dead once");
    cr_assert_eq(view("w0", 5000, NULL).last_seen_ms, 4000);
    beat(&w, 5000, 0.1, NULL); /* SIGCONT: the same process resumes */
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    cr_assert_eq(ctl_policy_count(pol, KM_MEMBER_DEAD), 0);
}

/* Issue 39: a worker stopped on purpose (SIGTERM, scale-in) says so in its last heartbeat; it is
 * "left" at once, never "dead" (no missed-heartbeat alarm), forgotten after forget_after, and a
 * new process under its id is a member again. */
Test(controller_policy, a_stopping_heartbeat_makes_the_member_left_at_once_not_dead)
{
    cfg.heartbeat_ms = 200;
    cfg.forget_after_ms = 10000;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    beat(&w, 1000, 0.1, NULL);
    w.state = KM_STATE_DRAINING;
    beat(&w, 1200, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_DRAINING);
    uint64_t v = ctl_policy_version(pol);
    w.state = KM_STATE_STOPPING;
    beat(&w, 1300, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_LEFT);
    cr_assert_str_eq(km_member_state_name(KM_MEMBER_LEFT), "left");
    cr_assert_gt(ctl_policy_version(pol), v, "the view changes at once");
    cr_assert_eq(ctl_policy_tick(pol, 5000), 0, "silent after leaving: not dead");
    cr_assert_eq(state_of("w0"), KM_MEMBER_LEFT);
    cr_assert_eq(ctl_policy_count(pol, KM_MEMBER_DEAD), 0);
    cr_assert_eq(ctl_policy_count(pol, KM_MEMBER_LEFT), 1);
    cr_assert_eq(ctl_policy_tick(pol, 11300), 1, "forgotten after forget_after");
    cr_assert_eq(ctl_policy_find(pol, "w0"), KM_ENOTFOUND);
    fake_worker again = {.id = "w0", .state = KM_STATE_READY};
    beat(&again, 12000, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    /* left, then a restarted process under the same id (kvmesh up restarts a SIGTERM'd worker) */
    again.state = KM_STATE_STOPPING;
    beat(&again, 12100, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_LEFT);
    fake_worker next = {.id = "w0", .state = KM_STATE_STARTING};
    beat(&next, 13000, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_STARTING);
}

Test(controller_policy, a_member_silent_for_forget_after_is_removed_and_a_beat_adds_it_again)
{
    cfg.heartbeat_ms = 200;
    cfg.forget_after_ms = 10000;
    start();
    fake_worker a = {.id = "a", .state = KM_STATE_READY}, b = {.id = "b", .state = KM_STATE_READY};
    beat(&a, 1000, 0.1, NULL);
    beat(&b, 1000, 0.1, NULL);
    cr_assert_eq(ctl_policy_tick(pol, 2000), 2, "both dead");
    for (uint64_t t = 2000; t <= 10500; t += 500) beat(&b, t, 0.1, NULL);
    uint64_t v = ctl_policy_version(pol);
    cr_assert_eq(ctl_policy_tick(pol, 10999), 0, "not yet");
    cr_assert_eq(ctl_policy_tick(pol, 11000), 1, "a forgotten");
    cr_assert_gt(ctl_policy_version(pol), v, "the view changes");
    cr_assert_eq(ctl_policy_n_members(pol), 1);
    cr_assert_eq(ctl_policy_find(pol, "a"), KM_ENOTFOUND);
    cr_assert_eq(state_of("b"), KM_MEMBER_READY, "b is kept (and moved down)");
    beat(&a, 13000, 0.1, NULL);
    cr_assert_eq(ctl_policy_n_members(pol), 2);
    cr_assert_eq(state_of("a"), KM_MEMBER_READY, "a heartbeat adds it again");
}

/* hb.xfer.pairs reach the view, and stay right when the member moves down the table (a member
 * before it forgotten). */
Test(controller_policy, per_holder_pull_figures_reach_the_view_and_survive_a_move)
{
    cfg.heartbeat_ms = 200;
    cfg.forget_after_ms = 10000;
    start();
    static const km_xfer_pair pairs[2] = {{.from = "holder-1", .rate_bps = 2e9, .latency_ms = 1},
                                          {.from = "holder-2", .rate_bps = 3e7, .latency_ms = 8}};
    fake_hb f;
    mk(&f, "a", 1, 1000, 0.1, "f16");
    cr_assert_eq(ctl_policy_heartbeat(pol, &f.hb, 1000, NULL), 0);
    for (uint64_t t = 1000; t <= 11000; t += 500) {
        mk(&f, "b", t, t, 0.1, "f16");
        f.hb.has_xfer = true;
        f.hb.xfer.rate_bps = 1e9;
        f.hb.xfer.pairs = pairs;
        f.hb.xfer.n_pairs = 2;
        cr_assert_eq(ctl_policy_heartbeat(pol, &f.hb, t, NULL), 0);
        ctl_policy_tick(pol, t);
    }
    cr_assert_eq(ctl_policy_find(pol, "a"), KM_ENOTFOUND, "a was forgotten, b moved down");
    /* a newcomer takes b's old slot, with figures of its own */
    static const km_xfer_pair other = {.from = "elsewhere", .rate_bps = 5e8, .latency_ms = 2};
    mk(&f, "c", 1, 100, 0.1, "f16");
    f.hb.has_xfer = true;
    f.hb.xfer.rate_bps = 5e8;
    f.hb.xfer.pairs = &other;
    f.hb.xfer.n_pairs = 1;
    cr_assert_eq(ctl_policy_heartbeat(pol, &f.hb, 11100, NULL), 0);
    km_view_worker v = view("b", 11100, NULL);
    cr_assert_eq(v.n_xfer_pairs, 2);
    cr_assert_str_eq(v.xfer_pairs[0].from, "holder-1");
    cr_assert_str_eq(v.xfer_pairs[1].from, "holder-2");
    cr_assert_eq(v.xfer_pairs[1].rate_bps, 3e7);
}

Test(controller_policy, level3_is_restarting_until_a_new_process_is_ready)
{
    cfg.heartbeat_ms = 200;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY, .start_ms = 0};
    ctl_action a;
    for (uint64_t t = 200; t <= 2000; t += 200) beat(&w, t, 0.1, NULL);
    cr_assert_eq(ctl_policy_force(pol, "w0", 3, 2100, &a), 0);
    cr_assert_eq(a.cmd, KM_ADMIN_DRAIN);
    cr_assert_str_eq(a.reason, "operator");
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    ctl_policy_ack(pol, "w0", a.id, true);
    /* the old process drains and stops: still restarting */
    w.state = KM_STATE_DRAINING;
    beat(&w, 2200, 0.1, NULL);
    w.state = KM_STATE_STOPPING;
    beat(&w, 2300, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    /* silent while it restarts: not dead */
    cr_assert_eq(ctl_policy_tick(pol, 9000), 0);
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    /* the new process: seq and uptime start over; starting first, then ready */
    fake_worker w2 = {.id = "w0", .state = KM_STATE_STARTING, .start_ms = 9000};
    beat(&w2, 9100, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    w2.state = KM_STATE_READY;
    beat(&w2, 9300, 0.1, NULL);
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    cr_assert_eq(level_of("w0"), 0);
    km_recovery_action h[KM_PROTO_MAX_HISTORY];
    km_view_worker v = view("w0", 9300, h);
    cr_assert_eq(v.n_history, 2);
    cr_assert_eq(h[0].level, 3);
    cr_assert(h[0].ok);
    cr_assert_eq(h[1].level, 0);
    cr_assert_str_eq(h[1].reason, "restarted");
    cr_assert(h[1].ok);
}

Test(controller_policy, a_ready_beat_from_the_old_process_does_not_end_restarting)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    beat(&w, 1000, 0.1, NULL);
    cr_assert_eq(ctl_policy_force(pol, "w0", 3, 1100, &a), 0);
    beat(&w, 1200, 0.1, NULL); /* sent before the drain arrived */
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
}

Test(controller_policy, a_fresh_policy_rebuilds_levels_and_states_from_heartbeats)
{
    start();
    fake_worker a = {.id = "fp8", .state = KM_STATE_READY, .fmt = "fp8", .seq = 500};
    fake_worker b = {.id = "drn", .state = KM_STATE_DRAINING, .seq = 90};
    fake_worker c = {.id = "plain", .state = KM_STATE_READY, .seq = 7};
    cr_assert_eq(beat(&a, 100000, 0.5, NULL), 0);
    cr_assert_eq(beat(&b, 100000, 0.5, NULL), 0);
    cr_assert_eq(beat(&c, 100000, 0.5, NULL), 0);
    cr_assert_eq(ctl_policy_n_members(pol), 3);
    cr_assert_eq(state_of("fp8"), KM_MEMBER_READY);
    cr_assert_eq(level_of("fp8"), 2);
    cr_assert_eq(state_of("drn"), KM_MEMBER_DRAINING);
    cr_assert_eq(state_of("plain"), KM_MEMBER_READY);
    cr_assert_eq(level_of("plain"), 0);
    km_view_worker v = view("fp8", 100000, NULL);
    cr_assert_str_eq(v.kv_format, "fp8");
    cr_assert_str_eq(v.requests, "tcp://127.0.0.1:7100");
    cr_assert_str_eq(v.events, "tcp://127.0.0.1:7101");
    cr_assert_null(v.admin);
    cr_assert_str_eq(v.model, "smollm2");
    /* and the rebuilt level 2 behaves like one: reverted after low pressure */
    ctl_action act;
    int fired = 0;
    for (uint64_t t = 101000; t <= 131000 && !fired; t += 1000) fired = beat(&a, t, 0.5, &act);
    cr_assert_eq(fired, 1);
    cr_assert_eq(act.level, 0);
    cr_assert_str_eq(act.format, "f16");
}

Test(controller_policy, recovery_off_observes_only_but_forced_levels_work)
{
    cfg.recovery = false;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    for (uint64_t t = 1000; t <= 30000; t += 1000) cr_assert_eq(beat(&w, t, 0.99, &a), 0);
    cr_assert_eq(level_of("w0"), 0);
    cr_assert_float_eq(view("w0", 30000, NULL).pressure, 0.99, 1e-6);
    cr_assert_eq(ctl_policy_force(pol, "w0", 2, 31000, &a), 0);
    cr_assert_eq(a.level, 2);
    cr_assert_str_eq(a.format, "fp8");
    cr_assert_str_eq(a.reason, "operator");
    cr_assert_eq(level_of("w0"), 2);
    cr_assert_eq(ctl_policy_force(pol, "nobody", 1, 31000, &a), KM_ENOTFOUND);
    cr_assert_eq(ctl_policy_force(pol, "w0", 0, 31000, &a), KM_EINVAL);
    cr_assert_eq(ctl_policy_force(pol, "w0", 4, 31000, &a), KM_EINVAL);
    /* a forced level 1 on an fp8 member evicts and leaves fp8 in effect */
    cr_assert_eq(ctl_policy_force(pol, "w0", 1, 32000, &a), 0);
    cr_assert_eq(a.cmd, KM_ADMIN_EVICT);
    cr_assert_eq(level_of("w0"), 2);
}

Test(controller_policy, a_forced_level_counts_for_the_cooldown)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    beat(&w, 1000, 0.5, NULL);
    cr_assert_eq(ctl_policy_force(pol, "w0", 1, 1500, &a), 0);
    cr_assert_eq(beat(&w, 2000, 0.95, &a), 0, "level 1 just happened: wait for the cooldown");
    cr_assert_eq(beat(&w, 6500, 0.95, &a), 1);
    cr_assert_eq(a.level, 2);
}

Test(controller_policy, an_undeliverable_command_leaves_the_member_as_it_was)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    beat(&w, 1000, 0.5, NULL);
    cr_assert_eq(ctl_policy_force(pol, "w0", 3, 1100, &a), 0);
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    ctl_policy_send_failed(pol, &a);
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    cr_assert_eq(level_of("w0"), 0);
    km_recovery_action h[KM_PROTO_MAX_HISTORY];
    km_view_worker v = view("w0", 1100, h);
    cr_assert_eq(v.n_history, 1, "the attempt stays in the history");
    cr_assert_not(h[0].ok);
    /* a refusal from the worker undoes it the same way */
    cr_assert_eq(ctl_policy_force(pol, "w0", 2, 1200, &a), 0);
    cr_assert_eq(level_of("w0"), 2);
    cr_assert_eq(ctl_policy_ack(pol, "w0", a.id, false), 0);
    cr_assert_eq(level_of("w0"), 0);
}

Test(controller_policy, history_keeps_the_newest_entries)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    beat(&w, 1000, 0.5, NULL);
    ctl_action a;
    for (int k = 0; k < KM_PROTO_MAX_HISTORY + 8; k++)
        cr_assert_eq(ctl_policy_force(pol, "w0", 1, 2000 + (uint64_t)k, &a), 0);
    km_recovery_action h[KM_PROTO_MAX_HISTORY];
    km_view_worker v = view("w0", 100000, h);
    cr_assert_eq(v.n_history, KM_PROTO_MAX_HISTORY);
    cr_assert_eq(h[0].at_ms, 2008, "the oldest 8 dropped");
    cr_assert_eq(h[KM_PROTO_MAX_HISTORY - 1].at_ms, 2000 + KM_PROTO_MAX_HISTORY + 7);
    /* history timestamps are turned into wall time */
    cr_assert_eq(ctl_policy_view_worker(pol, 0, 100000, 1700000000000ull, true, &v, h), 0);
    cr_assert_eq(h[0].at_ms, 1700000000000ull - (100000 - 2008));
}

Test(controller_policy, a_full_member_table_refuses_new_workers)
{
    cr_assert_eq(ctl_policy_create(&cfg, 2, &pol), 0);
    fake_worker a = {.id = "a"}, b = {.id = "b"}, c = {.id = "c"};
    cr_assert_eq(beat(&a, 1000, 0.1, NULL), 0);
    cr_assert_eq(beat(&b, 1000, 0.1, NULL), 0);
    cr_assert_eq(beat(&c, 1000, 0.1, NULL), KM_ENOSPC);
    cr_assert_eq(beat(&a, 2000, 0.1, NULL), 0, "known members still beat");
    km_msg_heartbeat none = {0};
    ctl_action act;
    cr_assert_eq(ctl_policy_heartbeat(pol, &none, 3000, &act), KM_EINVAL);
}

Test(controller_policy, a_process_restarted_behind_our_back_starts_at_its_own_level)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    beat(&w, 1000, 0.5, NULL);
    cr_assert_eq(ctl_policy_force(pol, "w0", 1, 1100, &a), 0);
    cr_assert_eq(level_of("w0"), 1);
    fake_worker w2 = {.id = "w0", .state = KM_STATE_READY, .start_ms = 5000};
    beat(&w2, 5100, 0.5, NULL);
    cr_assert_eq(level_of("w0"), 0, "a new process has evicted nothing");
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
}

Test(controller_policy, a_worker_started_with_fp8_is_not_at_level_2_and_escalates_to_3)
{
    cfg.cooldown_ms = 5000;
    start();
    fake_worker w = {.id = "w8", .state = KM_STATE_READY, .fmt = "fp8", .base = "fp8"};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.50, &a), 0);
    cr_assert_eq(level_of("w8"), 0, "fp8 is its configured format, not a recovery");
    /* low pressure for a long time: nothing to revert */
    for (uint64_t t = 2000; t <= 70000; t += 1000) cr_assert_eq(beat(&w, t, 0.50, &a), 0);
    cr_assert_eq(beat(&w, 71000, 0.95, &a), 1);
    cr_assert_eq(a.level, 1);
    int fired = 0;
    for (uint64_t t = 72000; t <= 90000 && !fired; t += 1000) fired = beat(&w, t, 0.95, &a);
    cr_assert_eq(fired, 1);
    cr_assert_eq(a.level, 3, "no smaller format to take: level 2 is skipped");
    cr_assert_eq(a.cmd, KM_ADMIN_DRAIN);
}

Test(controller_policy, a_worker_busy_with_an_unacknowledged_command_is_not_dead_before_the_timeout)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.50, &a), 0);
    cr_assert_eq(ctl_policy_force(pol, "w0", 2, 1100, &a), 0);
    uint64_t id = a.id;
    /* converting a large cache: no heartbeat for 10 s, no reply yet */
    cr_assert_eq(ctl_policy_tick(pol, 11000), 0);
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    /* acknowledged: silence counts as usual again (3 intervals of 1 s) */
    w.fmt = "fp8";
    cr_assert_eq(beat(&w, 12000, 0.50, &a), 0);
    cr_assert_eq(ctl_policy_ack(pol, "w0", id, true), 0);
    cr_assert_eq(ctl_policy_tick(pol, 15500), 1);
    cr_assert_eq(state_of("w0"), KM_MEMBER_DEAD);
}

Test(controller_policy, a_silent_worker_with_a_pending_command_is_dead_after_the_action_timeout)
{
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.50, &a), 0);
    cr_assert_eq(ctl_policy_force(pol, "w0", 2, 1100, &a), 0);
    cr_assert_eq(ctl_policy_tick(pol, 1100 + 29000), 0);
    cr_assert_eq(ctl_policy_tick(pol, 1100 + 30000), 1);
    cr_assert_eq(state_of("w0"), KM_MEMBER_DEAD);
}

Test(controller_policy, a_restarting_member_that_never_comes_back_is_dead_after_the_restart_timeout)
{
    cfg.restart_timeout_ms = 60000;
    start();
    fake_worker w = {.id = "w0", .state = KM_STATE_READY};
    ctl_action a;
    cr_assert_eq(beat(&w, 1000, 0.50, &a), 0);
    cr_assert_eq(ctl_policy_force(pol, "w0", 3, 1100, &a), 0);
    cr_assert_eq(ctl_policy_ack(pol, "w0", a.id, true), 0);
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    cr_assert_eq(ctl_policy_tick(pol, 30000), 0, "silence is what a restart looks like");
    cr_assert_eq(state_of("w0"), KM_MEMBER_RESTARTING);
    cr_assert_eq(ctl_policy_tick(pol, 61000), 1);
    cr_assert_eq(state_of("w0"), KM_MEMBER_DEAD);
    /* a new process that turns up later is taken back */
    fake_worker again = {.id = "w0", .state = KM_STATE_READY, .start_ms = 70000};
    cr_assert_eq(beat(&again, 70500, 0.10, &a), 0);
    cr_assert_eq(state_of("w0"), KM_MEMBER_READY);
    cr_assert_eq(level_of("w0"), 0);
}

Test(controller_policy, the_view_carries_a_workers_peer_address_and_measured_rates)
{
    start();
    static const uint8_t addr[24] = {'K', 'V', 'M', 'P', 'E', 'E', 'R', '1', 1};
    fake_hb f;
    ctl_action a;
    mk(&f, "w0", 1, 1000, 0.1, "f16");
    cr_assert_eq(ctl_policy_heartbeat(pol, &f.hb, 1000, &a), 0);
    km_view_worker v = view("w0", 1000, NULL);
    cr_assert_null(v.peer_addr, "no transfer node, no address");
    cr_assert_eq(v.xfer_rate_bps, 0);
    uint64_t before = ctl_policy_version(pol);
    mk(&f, "w0", 2, 2000, 0.1, "f16");
    f.hb.peer_addr = addr;
    f.hb.peer_addr_len = sizeof addr;
    f.hb.prefill_tps = 900;
    f.hb.has_xfer = true;
    f.hb.xfer.rate_bps = 1.25e9;
    f.hb.xfer.latency_ms = 0.5;
    f.hb.xfer.page_bytes = 368640;
    cr_assert_eq(ctl_policy_heartbeat(pol, &f.hb, 2000, &a), 0);
    cr_assert_gt(ctl_policy_version(pol), before, "a new address changes the view");
    v = view("w0", 2000, NULL);
    cr_assert_eq(v.peer_addr_len, sizeof addr);
    cr_assert_eq(memcmp(v.peer_addr, addr, sizeof addr), 0);
    cr_assert_eq(v.prefill_tps, 900);
    cr_assert_eq(v.xfer_rate_bps, 1.25e9);
    cr_assert_eq(v.xfer_lat_ms, 0.5);
    cr_assert_eq(v.page_bytes, 368640);
}
