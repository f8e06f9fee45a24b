/*
 * chaos_faults.c — one function per fault, and the scenario table that pairs each with what
 * recovery means after it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/chaos.h"

/* ---------------------------------------------------------------- faults */

static int send_pressure(chaos_run *r, double fraction)
{
    char ep[128];
    chaos_proc_field(r, CHAOS_TARGET, "requests", ep, sizeof ep);
    km_msg_admin a = {.cmd = KM_ADMIN_PRESSURE, .fraction = fraction};
    km_msg rep;
    km_errbuf err = {{0}};
    kvm_sec sec = {.cert = r->op_cert, .server = CHAOS_TARGET};
    int rc = kvm_admin_call(ep, &sec, &a, 10000, &rep, &err);
    if (rc) {
        snprintf(r->note, sizeof r->note, "pressure %.2f: %.400s", fraction, err.msg);
        return rc;
    }
    if (rep.type != KM_MSG_ADMIN_REPLY || !rep.admin_reply.ok) {
        snprintf(r->note, sizeof r->note, "pressure %.2f refused: %d %s", fraction,
                 rep.admin_reply.code,
                 rep.admin_reply.message ? rep.admin_reply.message : "(no message)");
        km_msg_clear(&rep);
        return KM_EINVAL;
    }
    km_msg_clear(&rep);
    return 0;
}

/* (a) 0.5 (below --pressure-high: nothing may fire), 0.95 until level 2 (fp8 halves the ballast's
 * bytes), 0.95 again (and 0.99 if that is not enough) until level 3 drains the worker. */
static int fault_pressure(chaos_run *r)
{
    int cooldown = r->k.short_run ? 1000 : 2000;
    uint64_t t0 = r->fault_ms;
    if (send_pressure(r, 0.5)) return -1;
    km_sleep_ms(2 * cooldown);
    chaos_action early[CHAOS_MAX_ACT];
    if (chaos_actions_since(r, t0 + 1000, CHAOS_TARGET, early, CHAOS_MAX_ACT) > 0) {
        snprintf(r->note, sizeof r->note, "level %u fired at pressure 0.5 (%.2f in the view)",
                 early[0].level, r->target_pressure);
        return -1;
    }
    if (send_pressure(r, 0.95)) return -1;
    if (!chaos_wait_level(r, CHAOS_TARGET, 2, t0, 8 * cooldown + 10000)) {
        snprintf(r->note, sizeof r->note,
                 "level 2 did not fire (state %s, level %u, pressure %.2f)", r->target_state,
                 r->target_level, r->target_pressure);
        return -1;
    }
    if (send_pressure(r, 0.95)) return -1;
    if (!chaos_wait_level(r, CHAOS_TARGET, 3, t0, 4 * cooldown + 3000)) {
        if (send_pressure(r, 0.99)) return -1;
        if (!chaos_wait_level(r, CHAOS_TARGET, 3, t0, 4 * cooldown + 10000)) {
            snprintf(r->note, sizeof r->note,
                     "level 3 did not fire (state %s, level %u, pressure %.2f)", r->target_state,
                     r->target_level, r->target_pressure);
            return -1;
        }
    }
    return 0;
}

/* (b) SIGKILL the target mid-stream; done when `kvmesh up` has it running and ready again. */
static int fault_kill(chaos_run *r)
{
    int pid = chaos_proc_pid(r, CHAOS_TARGET);
    if (pid <= 0 || kill(pid, SIGKILL)) return -1;
    if (!chaos_wait_new_pid(r, CHAOS_TARGET, pid, 30000)) return -1;
    return chaos_wait_worker_ready(r, CHAOS_TARGET, 60000) ? 0 : -1;
}

/* (c) SIGSTOP the target for stop_ms, then SIGCONT. */
static int fault_stop(chaos_run *r)
{
    int pid = chaos_proc_pid(r, CHAOS_TARGET);
    if (pid <= 0 || kill(pid, SIGSTOP)) return -1;
    km_sleep_ms(r->k.stop_ms);
    return kill(pid, SIGCONT) ? -1 : 0;
}

/* (d) SIGKILL the controller; done when its successor runs (the view must come back from it). */
static int fault_controller(chaos_run *r)
{
    int pid = chaos_proc_pid(r, "controller");
    if (pid <= 0 || kill(pid, SIGKILL)) return -1;
    return chaos_wait_new_pid(r, "controller", pid, 30000) ? 0 : -1;
}

/* (e) SIGKILL the router while requests stream through it. */
static int fault_router(chaos_run *r)
{
    int pid = chaos_proc_pid(r, "router");
    if (pid <= 0 || kill(pid, SIGKILL)) return -1;
    return chaos_wait_new_pid(r, "router", pid, 30000) ? 0 : -1;
}

static int ns_link(chaos_run *r, const char *updown)
{
    const char *a[] = {"ip",   "netns", "exec",     r->netns, "ip",
                       "link", "set",   r->veth_ns, updown,   NULL};
    return chaos_run_cmd(a, false);
}

/* (f) cut the target's namespace off (its end of the veth pair down), then restore it. */
static int fault_partition(chaos_run *r)
{
    if (ns_link(r, "down")) return -1;
    km_sleep_ms(r->k.cut_ms);
    return ns_link(r, "up") ? -1 : 0;
}

/* The context limit the longprompt scenario gives its workers (its wflags below). */
static int longprompt_ctx(const chaos_run *r)
{
    return r->k.short_run ? 1024 : 4096;
}

/* (h) a prompt at 95% of the context limit through the router while the load runs: one engine
 * thread spends many seconds on its prefill, and the worker must stay alive in the view (its
 * heartbeats never wait for a step), so the request completes where it started: no migration,
 * no member dead (issue 12: such a prompt failed after three "dead" workers). */
static int fault_longprompt(chaos_run *r)
{
    int n = longprompt_ctx(r) * 95 / 100;
    int32_t *toks = malloc(sizeof *toks * (size_t)n);
    if (!toks) return -1;
    for (int i = 0; i < n; i++) toks[i] = 300 + (i * 131) % 30000;
    kvm_client *c = NULL;
    km_errbuf err = {{0}};
    kvm_opts o = {.timeout_ms = 600000, .sec = {.cert = r->client_cert}};
    int rc = kvm_open(r->router, &o, &c, &err);
    kvm_result res = {0};
    if (!rc) {
        km_msg_request q;
        kvm_request_init(&q);
        q.tokens = toks;
        q.n_tokens = (uint32_t)n;
        q.max_tokens = 8;
        q.temperature = 0;
        rc = kvm_generate(c, &q, NULL, NULL, &res, &err);
    }
    if (rc || res.error_code)
        snprintf(r->note, sizeof r->note, "the %d-token prompt failed: %d %.200s %.200s", n,
                 res.error_code, res.error, err.msg);
    else if (res.migrations)
        snprintf(r->note, sizeof r->note, "the %d-token prompt migrated %u times", n,
                 res.migrations);
    bool bad = rc || res.error_code || res.migrations;
    kvm_result_free(&res);
    kvm_close(c);
    free(toks);
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_trans && !bad; i++)
        if (!strcmp(r->trans[i].state, "dead")) {
            snprintf(r->note, sizeof r->note, "%s went dead %.1f s into the long prompt",
                     r->trans[i].worker, (r->trans[i].at_ms - r->fault_ms) / 1e3);
            bad = true;
        }
    pthread_mutex_unlock(&r->mu);
    return bad ? -1 : 0;
}

/* How many requests the router has at worker id (its /metrics), or -1. */
static double router_inflight(chaos_run *r, const char *id)
{
    char series[96];
    snprintf(series, sizeof series, "kvmesh_router_worker_inflight{worker=\"%s\"}", id);
    return chaos_metric(r, "router", series);
}

/* (i) SIGKILL a worker every 10 s (--short: 6 s), w1 and w0 in turn, 6 times (--short: 3), each
 * kill only once `kvmesh up` has the previous victim back, answering /readyz, and the view all
 * ready: one worker always serves, and every stream the kill cuts must migrate and finish with
 * the output it would have had (issue 12: each attempt used to replay from token 0 and requests
 * failed "gave up after 3 attempts"). A kill waits up to 2 s for the victim to have a request in
 * flight (the router's per-worker count), so most kills cut a stream; a kill that found none is
 * still made, and counted apart. */
static int fault_killsoak(chaos_run *r)
{
    int kills = r->k.short_run ? 3 : 6, period = r->k.short_run ? 6000 : 10000;
    double mig0 = chaos_metric(r, "router", "kvmesh_router_migrations_total");
    uint64_t t0 = km_wall_ms();
    const char *prev = NULL;
    int prev_pid = 0;
    char idle[64] = "";
    size_t off = 0;
    r->counts.set = true;
    for (int i = 0; i < kills; i++) {
        const char *victim = i % 2 ? "w0" : CHAOS_TARGET;
        if (prev && !chaos_wait_restarted(r, prev, prev_pid, 60000)) return -1;
        for (uint64_t at = t0 + (uint64_t)i * (uint64_t)period; km_wall_ms() < at;) km_sleep_ms(20);
        bool busy = false;
        for (uint64_t until = km_wall_ms() + 2000; !busy && km_wall_ms() < until;)
            if (!(busy = router_inflight(r, victim) > 0)) km_sleep_ms(20);
        int pid = chaos_proc_pid(r, victim);
        if (pid <= 0 || kill(pid, SIGKILL)) {
            snprintf(r->note, sizeof r->note, "kill %d: no pid for %s in cluster.env", i + 1,
                     victim);
            return -1;
        }
        r->counts.kills++;
        r->counts.kills_busy += busy;
        if (!busy && off < sizeof idle - 4)
            off += (size_t)snprintf(idle + off, sizeof idle - off, "%s%d", off ? "," : "", i + 1);
        prev = victim;
        prev_pid = pid;
    }
    if (prev && !chaos_wait_restarted(r, prev, prev_pid, 60000)) return -1;
    double mig1 = chaos_metric(r, "router", "kvmesh_router_migrations_total");
    r->counts.migrations = mig0 >= 0 && mig1 >= 0 ? (int)(mig1 - mig0) : -1;
    char idle_note[96] = "";
    if (idle[0]) snprintf(idle_note, sizeof idle_note, " (kill %s found none)", idle);
    snprintf(r->note, sizeof r->note,
             "%d kills %d s apart, %d of them with requests in flight at the victim%s; the router "
             "migrated %d streams%s",
             r->counts.kills, period / 1000, r->counts.kills_busy, idle_note, r->counts.migrations,
             r->counts.migrations > 0 ? ""
                                      : " (no kill cut a stream in flight: nothing was migrated)");
    return 0;
}

/* ---------------------------------------------------------------- the scenario table */

const chaos_scenario chaos_scenarios[] = {
    {.name = "pressure",
     .letter = "a",
     .what = "KV pressure ramp on w1 (0.5, 0.95, 0.95 again after fp8): levels 1, 2, 3 in order; "
             "the drained worker is restarted and comes back ready",
     .fault = fault_pressure,
     .recover_when = RECOVER_AFTER_DEGRADED,
     .drains_target = true},
    {.name = "kill",
     .letter = "b",
     .what = "SIGKILL w1 mid-stream; kvmesh up restarts it",
     .fault = fault_kill,
     .recover_when = RECOVER_ALL_READY,
     .outputs_must_match = true},
    {.name = "stop",
     .letter = "c",
     .what = "SIGSTOP w1 (10 s; --short 4 s), then SIGCONT",
     .fault = fault_stop,
     .recover_when = RECOVER_AFTER_DEGRADED,
     .outputs_must_match = true},
    {.name = "controller",
     .letter = "d",
     .what = "SIGKILL the controller; serving goes on, the restarted one rebuilds the view",
     .fault = fault_controller,
     .recover_when = RECOVER_NEW_EPOCH,
     .outputs_must_match = true},
    {.name = "router",
     .letter = "e",
     .what = "SIGKILL the router while clients retry; they reconnect to the restarted one",
     .fault = fault_router,
     .recover_when = RECOVER_COMPLETION,
     .outputs_must_match = true},
    {.name = "partition",
     .letter = "f",
     .what = "w1 in its own network namespace, its link cut (10 s; --short 4 s), then restored",
     .fault = fault_partition,
     .recover_when = RECOVER_AFTER_DEGRADED,
     .outputs_must_match = true,
     .needs_netns = true},
    {.name = "slowloris",
     .letter = "g",
     .what = "1,100 HTTP connections trickling request heads at the router, 80 at each worker's "
             "admin port (10 s; --short 4 s): new HTTP clients (/healthz, /v1/models) are served "
             "throughout",
     .fault = chaos_fault_slowloris,
     .recover_when = RECOVER_COMPLETION,
     .outputs_must_match = true},
    {.name = "longprompt",
     .letter = "h",
     .what = "a prompt at 95% of the context limit (4096; --short 1024) through the router under "
             "load: it completes with no migration, no member goes dead, no request fails",
     .fault = fault_longprompt,
     .recover_when = RECOVER_COMPLETION,
     .outputs_must_match = true,
     .no_failures = true,
     .wflags = "--max-ctx=1024",
     /* 3,891 tokens of f16 KV are 90 MB: more hot tier than the other scenarios' 32 MB */
     .wflags_full = "--max-ctx=4096 --kv-bytes=192M"},
    {.name = "killsoak",
     .letter = "i",
     .what = "SIGKILL w1 and w0 in turn every 10 s, 6 kills (--short: every 6 s, 3), each once "
             "the previous victim is back: every stream cut migrates, none fails, outputs equal",
     .fault = fault_killsoak,
     .recover_when = RECOVER_ALL_READY,
     .outputs_must_match = true,
     .no_failures = true},
    {.name = "pullkill",
     .letter = "j",
     .what = "workers pull long shared prefixes from each other over UCX (router's choice); the "
             "source of a pull is SIGKILLed while the pull runs, 4 rounds (--short 2): lost 0, "
             "failed 0, outputs equal, a pull seen before each kill",
     .fault = chaos_fault_pullkill,
     .recover_when = RECOVER_ALL_READY,
     .outputs_must_match = true,
     .no_failures = true,
     /* a transfer node per worker; room for the rounds' long prefixes beside the load's */
     .wflags = "--peer-listen=127.0.0.1:0 --kv-bytes=128M",
     .wflags_full = "--peer-listen=127.0.0.1:0 --kv-bytes=128M",
     /* debug: the pull_choice lines name each pull's holder; the router weighs load over
      * prefix affinity (w-prefill 0.01) so a busier holder sends a request to the other worker,
      * which is told to pull; pulls are chosen from the first request on, not only once a
      * worker has measured a rate (100 MB/s until then; TCP loopback measures more) */
     .rflags = "--log-level=debug --w-prefill=0.01 --pull-default-rate=1e8",
     .env = "UCX_TLS=tcp"},
    {.name = "netfault",
     .letter = "k",
     .what = "w1 in a network namespace, the veth to w0 slowed (tbf), lossy (iptables statistic) "
             "and reordering (NFQUEUE) while workers pull long prefixes from each other and w1's "
             "drain hands its pages to w0: lost 0, failed 0, outputs equal",
     .fault = chaos_fault_netfault,
     .recover_when = RECOVER_ALL_READY,
     .outputs_must_match = true,
     .needs_netns = true,
     .no_failures = true,
     .peer_split = true,
     .precheck = chaos_precheck_netfault,
     /* the transfer nodes' addresses come from peer_split; pullkill's room and router flags */
     .wflags = "--kv-bytes=128M",
     .wflags_full = "--kv-bytes=128M",
     .rflags = "--log-level=debug --w-prefill=0.01 --pull-default-rate=1e8",
     .env = "UCX_TLS=tcp"},
    {.name = "drainkill",
     .letter = "l",
     .what = "w1 drained (level 3) after taking long prefixes, SIGKILLed while it hands its pages "
             "to w0 (1 round; full: 2): lost 0, failed 0, outputs equal",
     .fault = chaos_fault_drainkill,
     .recover_when = RECOVER_ALL_READY,
     .outputs_must_match = true,
     .no_failures = true,
     .wflags = "--peer-listen=127.0.0.1:0 --kv-bytes=128M",
     .wflags_full = "--peer-listen=127.0.0.1:0 --kv-bytes=128M",
     .rflags = "--pull-default-rate=1e8",
     .env = "UCX_TLS=tcp"},
    {.name = "pdkill",
     .letter = "m",
     .what = "1 prefill + 1 decode worker; long prompts disaggregated beside the streaming load: "
             "the prefill worker SIGKILLed mid-prompt, then the decode worker mid-stream: lost 0, "
             "failed 0, outputs equal to one worker's",
     .fault = chaos_fault_pdkill,
     .recover_when = RECOVER_ALL_READY,
     .outputs_must_match = true,
     .no_failures = true,
     /* transfer nodes (UCX over TCP, as pullkill), room for the long prompts beside the load
      * (the full run's two references at once on w0: f16 KV, below the pressure levels) */
     .wflags = "--peer-listen=127.0.0.1:0 --kv-bytes=128M",
     .wflags_full = "--peer-listen=127.0.0.1:0 --kv-bytes=256M",
     .wflags_for = "w0:--role=prefill;w1:--role=decode",
     .env = "UCX_TLS=tcp"},
};
