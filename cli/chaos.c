/*
 * chaos.c — `kvmesh chaos SCENARIO [--short] [--json]`: fault injection against a real local
 * cluster, with the checks that say whether the cluster kept its promises.
 *
 * Scenarios (the table `chaos_scenarios` below; `all` runs every one in order):
 *   pressure   (a) KV pressure ramp on w1 (the `pressure` admin command, workers run --chaos):
 *                  recovery levels 1, 2 and 3 must fire in that order; the drained worker is
 *                  restarted by `kvmesh up` and comes back ready
 *   kill       (b) SIGKILL w1 mid-stream; `kvmesh up` restarts it
 *   stop       (c) SIGSTOP w1 for 10 s (--short: 4 s), then SIGCONT
 *   controller (d) SIGKILL the controller; it is restarted and rebuilds its view from heartbeats
 *   router     (e) SIGKILL the router while clients retry; they reconnect to the restarted one
 *   partition  (f) w1 runs in its own network namespace (veth pair, 10.x addresses); its link is
 *                  cut, then restored (skipped, and said so, where `ip netns` is not permitted)
 *   slowloris  (g) 1,100 slow HTTP connections at the router, 80 at each worker's admin port,
 *                  for 10 s (--short: 4 s); every probe of a new HTTP client must be answered
 *   longprompt (h) a prompt at 95% of the workers' context limit through the router under load:
 *                  it completes with no migration, no member goes dead, no request fails
 *   killsoak   (i) SIGKILL w1 and w0 in turn every 10 s, 6 kills (--short: every 6 s, 3 kills),
 *                  each only once `kvmesh up` has the previous victim back and the view is all
 *                  ready: every cut stream migrates, no request fails, outputs equal; the
 *                  router's migrations are reported
 *   pullkill   (j) workers with transfer nodes pull long prefixes from each other (the router's
 *                  choice); the source of a pull is SIGKILLed the moment the router chooses it
 *                  or once its bytes leave, 4 rounds (--short: 2; chaos_pullkill.c): a pull
 *                  must have been chosen, no request fails, outputs equal
 *   netfault   (k) w1 in a network namespace, the veth to w0 slowed (tbf), lossy (iptables
 *                  statistic) and reordering (NFQUEUE, kvmesh-netdelay) while the workers pull
 *                  long prefixes from each other and w1's drain hands its chains to w0
 *                  (chaos_netfault.c): a pull and a handoff under the fault, no request fails
 *   drainkill  (l) w1 drained after taking long prefixes, SIGKILLed once its handoff to w0
 *                  has begun: no request fails, outputs equal
 *   pdkill     (m) w0 prefill, w1 decode: long prompts disaggregated beside the load; the
 *                  prefill worker SIGKILLed mid-prompt, then the decode worker at a stream's
 *                  first token (chaos_pdkill.c): no request fails, outputs equal
 *
 * Why it is built this way: each scenario starts its own cluster with the same code as `kvmesh up`
 * (this very binary, `up --base-port 0` in a temporary run directory: free ports, so it never
 * collides with tests running beside it) and finds the processes through up's cluster.env. Load is
 * real: several client threads, each with its own libkvmesh connection to the router, greedy
 * requests over prompts of mixed lengths, retrying retryable answers (503, 529, 429, 500), broken
 * connections and silences (a dead router) a bounded number of times. A fault-free pass first
 * records every prompt's output; the faulted pass compares against it, so "the client saw one
 * uninterrupted, correct stream" is checked, not assumed. Every request ends as completed, failed
 * (the client was told why) or lost (silence until the retries ran out), and lost must be 0. The
 * controller's view (a SUB on its --view) gives the recovery levels in order and the moment the
 * cluster is all ready again; the time to recover runs from the fault to that moment and a request
 * completing after it. One function per fault (chaos_faults.c); the rest is the harness they share:
 * the cluster and the signal thread (chaos_cluster.c: Ctrl-C stops the cluster and removes the
 * network namespace before exiting), the view monitor (chaos_monitor.c) and the load
 * (chaos_load.c). This file runs one scenario after another and reports.
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
#include "kernels/kernels.h"
#include "cli/cli.h"

static void knobs_init(chaos_knobs *k, bool short_run)
{
    memset(k, 0, sizeof *k);
    /* the workers run the kernels this process would pick (they inherit KVMESH_ISA) */
    k->slow = kn_ops_slowdown(kn_ops_best());
    k->short_run = short_run;
    k->clients = short_run ? 3 : 4;
    k->max_tokens = short_run ? 12 : 24;
    k->warmup_ms = short_run ? 1000 : 4000;
    k->tail_ms = short_run ? 1000 : 4000;
    k->stop_ms = short_run ? 4000 : 10000;
    k->cut_ms = short_run ? 4000 : 10000;
    k->recover_ms = (short_run ? 40000 : 60000) * k->slow;
    k->timeout_ms = (short_run ? 4000 : 6000) * k->slow;
    k->attempts = 8;
    k->ctl = short_run ? "--heartbeat=500ms --dead-after=3 --cooldown=1s --log-level=info"
                       : "--heartbeat=500ms --dead-after=3 --cooldown=2s --log-level=info";
    k->wflags = "--heartbeat=500ms --drain-timeout=3s --log-level=info";
    k->rflags = "--log-level=info";
}

/* Injects the scenario's fault under load (already running) and waits for the recovery: the
 * moment the view says so (chaos_monitor.c) and a request completing after it. */
static void fault_and_recover(chaos_run *r, chaos_load *load, chaos_result *res)
{
    km_sleep_ms(r->k.warmup_ms);
    pthread_mutex_lock(&r->mu);
    r->pre_epoch = r->epoch;
    r->fault_ms = km_wall_ms();
    r->armed = true;
    pthread_mutex_unlock(&r->mu);
    int frc = r->sc->fault(r);
    uint64_t fault_end = km_wall_ms();
    res->fault_s = (fault_end - r->fault_ms) / 1e3;
    pthread_mutex_lock(&r->mu);
    r->fault_end_ms = fault_end;
    if (r->sc->recover_when == RECOVER_COMPLETION) r->ready_at_ms = fault_end;
    pthread_mutex_unlock(&r->mu);
    if (frc) {
        snprintf(res->error, sizeof res->error, "the fault could not be injected%s%.400s",
                 r->note[0] ? ": " : "", r->note);
    } else {
        snprintf(res->fault_note, sizeof res->fault_note, "%s", r->note);
        if (r->problem[0]) snprintf(res->error, sizeof res->error, "%s", r->problem);
        uint64_t deadline = fault_end + (uint64_t)r->k.recover_ms;
        while (km_wall_ms() < deadline) {
            pthread_mutex_lock(&r->mu);
            uint64_t ready_at = r->ready_at_ms;
            pthread_mutex_unlock(&r->mu);
            uint64_t first = ready_at ? chaos_first_done_after(load, ready_at) : 0;
            if (first) {
                res->recovered = true;
                res->recover_s = (first - r->fault_ms) / 1e3;
                break;
            }
            km_sleep_ms(100);
        }
        if (!res->recovered && !res->error[0])
            snprintf(res->error, sizeof res->error,
                     "not recovered within %d s of the fault's end (view all ready: %s)",
                     r->k.recover_ms / 1000, r->all_ready ? "yes" : "no");
        km_sleep_ms(r->k.tail_ms);
    }
}

/* What the faulted pass saw, and the scenario's own promises checked. */
static void tally(chaos_run *r, const chaos_load *load, chaos_result *res)
{
    chaos_format_levels(r, res);
    res->sent = load->sent;
    res->completed = load->completed;
    res->failed = load->failed;
    res->lost = load->lost;
    res->equal = load->equal;
    res->differ = load->differ;
    res->first_differ = load->first_differ;
    res->retries = load->retries;
    res->migrated = load->migrated;
    res->migrations = load->migrations;
    res->counts = r->counts;
    res->n_errors = load->n_errors;
    memcpy(res->errors, load->first_errors, sizeof res->errors);
    res->outputs_ok = load->differ == 0 || !r->sc->outputs_must_match;
    if (!res->error[0] && r->sc->no_failures && load->failed)
        snprintf(res->error, sizeof res->error, "%d requests failed (first: %.300s)", load->failed,
                 load->n_errors ? load->first_errors[0] : "-");
    if (!res->error[0] && r->sc->drains_target && !res->order_ok)
        snprintf(res->error, sizeof res->error, "recovery levels 1, 2, 3 did not fire in order");
    if (!res->error[0] && r->sc->drains_target) { /* level 3: drained, restarted by up */
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n = chaos_read_cluster(r, procs);
        const kvm_cluster_proc *t = kvm_cluster_find(procs, n, CHAOS_TARGET);
        if (!t || t->restarts < 1)
            snprintf(res->error, sizeof res->error,
                     "%s was drained but kvmesh up did not restart it", CHAOS_TARGET);
    }
}

static void run_scenario(const chaos_scenario *sc, const chaos_knobs *k, bool keep,
                         chaos_result *res)
{
    memset(res, 0, sizeof *res);
    res->sc = sc;
    chaos_run *r = calloc(1, sizeof *r);
    r->sc = sc;
    r->k = *k;
    char wflags[512];
    const char *extra = k->short_run ? sc->wflags : sc->wflags_full;
    if (extra) { /* this scenario's worker flags after the common ones */
        snprintf(wflags, sizeof wflags, "%s %s", k->wflags, extra);
        r->k.wflags = wflags;
    }
    char rflags[512];
    if (sc->rflags) {
        snprintf(rflags, sizeof rflags, "%s %s", k->rflags, sc->rflags);
        r->k.rflags = rflags;
    }
    pthread_mutex_init(&r->mu, NULL);
    snprintf(r->dir, sizeof r->dir, "/tmp/kvmesh-chaos-XXXXXX");
    if (!mkdtemp(r->dir)) {
        snprintf(res->error, sizeof res->error, "cannot make a run directory");
        free(r);
        return;
    }
    snprintf(res->dir, sizeof res->dir, "%s", r->dir);
    snprintf(r->cluster_file, sizeof r->cluster_file, "%s/%s", r->dir, KVM_CLUSTER_FILE);
    char env_name[64] = "";
    bool env_had = false;
    char env_old[256] = "";
    if (sc->env) { /* NAME=VALUE for the cluster's processes (up passes its environment on) */
        const char *eq = strchr(sc->env, '=');
        snprintf(env_name, sizeof env_name, "%.*s", eq ? (int)(eq - sc->env) : 0, sc->env);
        const char *old = env_name[0] ? getenv(env_name) : NULL;
        env_had = old != NULL;
        if (old) snprintf(env_old, sizeof env_old, "%s", old);
        if (env_name[0]) setenv(env_name, eq + 1, 1);
    }
    chaos_load ref = {0}, load = {0};
    char *ref_out[CHAOS_N_PROMPTS] = {0};
    size_t ref_len[CHAOS_N_PROMPTS] = {0};
    chaos_client cls[16];
    if (sc->needs_netns) {
        int ns = chaos_netns_setup(r);
        if (ns == 1) {
            res->skipped = res->passed = true;
            snprintf(res->skip_reason, sizeof res->skip_reason,
                     "`ip netns add` is not permitted here (needs root or CAP_SYS_ADMIN and "
                     "iproute2); %s scenario skipped",
                     sc->name);
            goto out;
        }
        if (ns < 0) {
            snprintf(res->error, sizeof res->error, "could not set up the network namespace");
            goto out;
        }
    }
    if (sc->precheck && sc->precheck(r)) {
        res->skipped = res->passed = true;
        snprintf(res->skip_reason, sizeof res->skip_reason, "%.200s; %s scenario skipped", r->note,
                 sc->name);
        goto out;
    }
    if (chaos_cluster_start(r)) {
        snprintf(res->error, sizeof res->error,
                 "the cluster did not come up (is kvmesh-controller built? see %s/up.log and "
                 "%s/logs)",
                 r->dir, r->dir);
        goto out;
    }
    /* 1. fault-free reference */
    ref.endpoint = load.endpoint = r->router;
    ref.sec = load.sec = (kvm_sec){.cert = r->client_cert};
    ref.k = load.k = k;
    ref.prompts = load.prompts = chaos_prompts;
    ref.n_prompts = load.n_prompts = CHAOS_N_PROMPTS;
    ref.ref = load.ref = ref_out;
    ref.ref_len = load.ref_len = ref_len;
    ref.reference = true;
    pthread_mutex_init(&ref.mu, NULL);
    pthread_mutex_init(&load.mu, NULL);
    chaos_load_start(&ref, cls);
    chaos_load_join(&ref, cls);
    res->ref_sent = ref.sent;
    if (ref.completed != CHAOS_N_PROMPTS) {
        snprintf(res->error, sizeof res->error,
                 "the fault-free pass did not complete (%d of %d; first error: %s)", ref.completed,
                 CHAOS_N_PROMPTS, ref.n_errors ? ref.first_errors[0] : "-");
        goto out;
    }
    /* 2. the same load with the fault */
    chaos_load_start(&load, cls);
    fault_and_recover(r, &load, res);
    chaos_load_join(&load, cls);
    tally(r, &load, res);
    res->passed = !res->error[0] && res->lost == 0 && res->outputs_ok && res->recovered;
out:
    chaos_cluster_stop(r);
    if (env_name[0]) { /* as it was before this scenario */
        if (env_had)
            setenv(env_name, env_old, 1);
        else
            unsetenv(env_name);
    }
    if (r->netns_made) chaos_netns_cleanup();
    for (int i = 0; i < CHAOS_N_PROMPTS; i++) free(ref_out[i]);
    free(ref.done_at);
    free(load.done_at);
    if (res->passed && !keep) {
        const char *rm[] = {"rm", "-rf", r->dir, NULL};
        chaos_run_cmd(rm, true);
        res->dir[0] = 0;
    }
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* ---------------------------------------------------------------- report */

static void print_result(const chaos_result *res)
{
    const chaos_scenario *sc = res->sc;
    printf("chaos %s (%s): %s\n", sc->name, sc->letter, sc->what);
    if (res->skipped) {
        printf("  SKIPPED: %s\n\n", res->skip_reason);
        return;
    }
    if (res->sent || res->completed) {
        printf("  requests: sent %d, completed %d, failed %d (with a clear error), lost %d; "
               "%d retries, %d migrated streams (%d migrations)\n",
               res->sent, res->completed, res->failed, res->lost, res->retries, res->migrated,
               res->migrations);
        printf("  greedy outputs: %d of %d equal to the fault-free run%s\n", res->equal,
               res->completed,
               res->differ && !sc->outputs_must_match ? " (differences allowed: fp8 KV)" : "");
        if (res->differ)
            printf("  first differing output: prompt %d of the load's %d\n", res->first_differ,
                   CHAOS_N_PROMPTS);
        printf("  recovery levels: %s\n", res->levels);
        printf("  member states in the view: %s\n", res->states);
        if (res->recovered)
            printf("  time to recover: %.1f s after the fault began, %.1f s after it ended (the "
                   "fault lasted %.1f s)\n",
                   res->recover_s, res->recover_s - res->fault_s, res->fault_s);
        for (int i = 0; i < res->n_errors; i++) printf("  error seen: %s\n", res->errors[i]);
    }
    if (res->fault_note[0]) printf("  fault: %s\n", res->fault_note);
    if (res->error[0]) printf("  problem: %s\n", res->error);
    if (res->dir[0]) printf("  logs: %s\n", res->dir);
    printf("  result: %s\n\n", res->passed ? "PASS" : "FAIL");
    fflush(stdout);
}

static double msround(double s)
{
    return (double)(int64_t)(s * 1000 + 0.5) / 1000;
}

static json_t *result_json(const chaos_result *res)
{
    json_t *o = json_pack("{s:s,s:s,s:b,s:b}", "scenario", res->sc->name, "letter", res->sc->letter,
                          "passed", res->passed, "skipped", res->skipped);
    if (res->skipped) {
        json_object_set_new(o, "skip_reason", json_string(res->skip_reason));
        return o;
    }
    json_object_set_new(o, "sent", json_integer(res->sent));
    json_object_set_new(o, "completed", json_integer(res->completed));
    json_object_set_new(o, "failed", json_integer(res->failed));
    json_object_set_new(o, "lost", json_integer(res->lost));
    json_object_set_new(o, "retries", json_integer(res->retries));
    json_object_set_new(o, "migrated", json_integer(res->migrated));
    json_object_set_new(o, "migrations", json_integer(res->migrations));
    if (res->counts.set) {
        const chaos_counts *c = &res->counts;
        json_t *cj = json_pack("{s:i,s:i}", "kills", c->kills, "router_migrations", c->migrations);
        if (c->pulls) {
            json_t *pj =
                json_pack("{s:i,s:i,s:i,s:i,s:i}", "pull_rounds", c->pull_rounds,
                          "router_pulls_chosen", c->pulls_chosen, "pulls_ok", c->pulls_ok,
                          "pulls_partial", c->pulls_partial, "pulls_failed", c->pulls_failed);
            json_object_update(cj, pj);
            json_decref(pj);
        } else {
            json_object_set_new(cj, "kills_busy", json_integer(c->kills_busy));
        }
        json_object_set_new(o, "counts", cj);
    }
    if (res->fault_note[0]) json_object_set_new(o, "fault_note", json_string(res->fault_note));
    json_object_set_new(o, "outputs_equal", json_integer(res->equal));
    json_object_set_new(o, "outputs_differ", json_integer(res->differ));
    json_object_set_new(o, "outputs_must_match", json_boolean(res->sc->outputs_must_match));
    json_object_set_new(o, "recovery_levels", json_string(res->levels));
    json_object_set_new(o, "member_states", json_string(res->states));
    json_object_set_new(o, "recovered", json_boolean(res->recovered));
    if (res->recovered) json_object_set_new(o, "recover_s", json_real(msround(res->recover_s)));
    json_object_set_new(o, "fault_s", json_real(msround(res->fault_s)));
    if (res->error[0]) json_object_set_new(o, "error", json_string(res->error));
    if (res->dir[0]) json_object_set_new(o, "logs", json_string(res->dir));
    return o;
}

/* ---------------------------------------------------------------- command */

int cli_cmd_chaos(int argc, char **argv)
{
    bool short_run = false, json_out = false, keep = false;
    const km_opt opts[] = {
        {"short", NULL, KM_OPT_BOOL, "false",
         "a few seconds of load per scenario, short faults (make chaos-short)", &short_run, 0, 0},
        {"json", NULL, KM_OPT_BOOL, "false", "print the results as JSON", &json_out, 0, 0},
        {"keep", NULL, KM_OPT_BOOL, "false",
         "keep every run directory (logs, cluster.env); failed runs are always kept", &keep, 0, 0},
    };
    km_config *cfg = NULL;
    int rc = km_daemon_config(
        "kvmesh chaos",
        "fault injection against a local cluster it starts itself. SCENARIO: pressure (a), kill "
        "(b), stop (c), controller (d), router (e), partition (f), slowloris (g), longprompt "
        "(h), killsoak (i), pullkill (j), netfault (k), drainkill (l), pdkill (m) or all",
        opts, sizeof opts / sizeof *opts, argc, argv, NULL, NULL, &cfg);
    if (rc == 1)
        for (int i = 0; i < CHAOS_N_SCENARIOS; i++)
            printf("  %-11s (%s) %s\n", chaos_scenarios[i].name, chaos_scenarios[i].letter,
                   chaos_scenarios[i].what);
    if (rc) return rc == 1 ? 0 : 2;
    int nargs = 0;
    char *const *args = km_config_args(cfg, &nargs);
    const char *which = nargs ? args[0] : NULL;
    bool pick[CHAOS_N_SCENARIOS] = {0};
    int n_pick = 0;
    for (int i = 0; which && i < CHAOS_N_SCENARIOS; i++)
        if (!strcmp(which, "all") || !strcmp(which, chaos_scenarios[i].name) ||
            !strcmp(which, chaos_scenarios[i].letter))
            pick[i] = true, n_pick++;
    if (!n_pick) {
        fprintf(stderr,
                "kvmesh chaos: give a scenario: pressure, kill, stop, controller, router, "
                "partition, slowloris, longprompt, killsoak, pullkill, netfault, drainkill, "
                "pdkill or all (--help)\n");
        km_config_destroy(cfg);
        return 2;
    }
    chaos_signals_start(); /* before any other thread exists */
    chaos_knobs k;
    knobs_init(&k, short_run);
    chaos_result *results = calloc(CHAOS_N_SCENARIOS, sizeof *results);
    int status = 0;
    json_t *all = json_array();
    uint64_t t0 = km_now_ns();
    for (int i = 0; i < CHAOS_N_SCENARIOS; i++) {
        if (!pick[i]) continue;
        if (!json_out) {
            printf("== chaos %s%s ...\n", chaos_scenarios[i].name, short_run ? " (short)" : "");
            fflush(stdout);
        }
        run_scenario(&chaos_scenarios[i], &k, keep, &results[i]);
        if (json_out)
            json_array_append_new(all, result_json(&results[i]));
        else
            print_result(&results[i]);
        if (!results[i].passed) status = 1;
    }
    double secs = (km_now_ns() - t0) / 1e9;
    if (json_out) {
        json_t *o = n_pick == 1 ? json_incref(json_array_get(all, 0))
                                : json_pack("{s:O,s:b,s:f}", "chaos_scenarios", all, "passed",
                                            status == 0, "seconds", secs);
        char *s = json_dumps(o, JSON_COMPACT);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(o);
    } else if (n_pick > 1) {
        printf("%-11s %-4s %6s %9s %6s %4s %11s %8s %9s %10s  %s\n", "SCENARIO", "", "SENT",
               "COMPLETED", "FAILED", "LOST", "OUTPUTS_EQ", "FAULT_S", "RECOVER_S", "AFTER_END",
               "RESULT");
        for (int i = 0; i < CHAOS_N_SCENARIOS; i++) {
            const chaos_result *r = &results[i];
            if (!pick[i]) continue;
            char eq[24] = "-", fs[16] = "-", rs[16] = "-", ae[16] = "-";
            if (!r->skipped) snprintf(eq, sizeof eq, "%d/%d", r->equal, r->completed);
            if (!r->skipped) snprintf(fs, sizeof fs, "%.1f", r->fault_s);
            if (r->recovered) snprintf(rs, sizeof rs, "%.1f", r->recover_s);
            if (r->recovered) snprintf(ae, sizeof ae, "%.1f", r->recover_s - r->fault_s);
            const char *verdict = r->skipped ? "SKIP" : r->passed ? "PASS" : "FAIL";
            printf("%-11s (%s) %6d %9d %6d %4d %11s %8s %9s %10s  %s\n", chaos_scenarios[i].name,
                   chaos_scenarios[i].letter, r->sent, r->completed, r->failed, r->lost, eq, fs, rs,
                   ae, verdict);
        }
        printf("chaos: %s in %.0f s\n", status ? "FAILED" : "all passed", secs);
    }
    json_decref(all);
    free(results);
    km_config_destroy(cfg);
    return status;
}
