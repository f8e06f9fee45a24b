/*
 * chaos_pdkill.c — (m) prefill/decode disaggregation under faults (issue 32 point 3). The
 * scenario's cluster has one prefill worker (w0) and one decode worker (w1, the table's flags),
 * each with a transfer node. The harness's load (short prompts, streamed) runs on w1 throughout;
 * this fault adds long prompts that the router disaggregates: w0 computes the prompt, w1 pulls
 * its pages as they are sealed (docs/disaggregation.md).
 *
 * Round 1 kills the prefill worker mid-prompt: a new long prompt goes through the router, and
 * w0 is SIGKILLed the moment w1 has imported the first of its pages while the prefill still
 * runs. w1 must compute what is missing and answer with the reference's tokens. Round 2 kills
 * the decode worker mid-stream: another new long prompt is disaggregated, and w1 is SIGKILLed
 * when the client has the first streamed token. The router must migrate the stream (to w0, the
 * only worker left, or to w1 restarted) and the output must be the reference's. Each kill waits
 * for `kvmesh up` to bring the victim back. The references are computed before any fault
 * straight on w0 as on a `both` worker (a worker computes a request sent to it), under a cache
 * salt of their own, so they leave nothing the routed requests could find cached: each routed
 * prompt is computed from scratch, as a user's new prompt is.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/chaos.h"

#define PD_PREFILL    "w0"
#define PD_DECODE     "w1"
#define PD_TIMEOUT_MS 120000 /* a long prompt's longest silence (its prefill recomputed) */
#define PD_PAGES_MS   120000 /* longest wait for the first page of round 1 to arrive */
#define PD_RESTART_MS 60000  /* longest wait for a victim's restart */
#define PD_BACKOFF_MS 1500   /* past the router's backoff from a prefill worker that failed */
#define PD_ATTEMPTS   3      /* a long prompt's attempts on a retryable answer */
#define PD_MIN_TOKENS 4      /* a reference shorter than this (an early EOS) compares too little */
#define PD_DURING     "kvmesh_worker_pd_pages_imported_total{when=\"during_prefill\"}"
#define PD_PARTIAL    "kvmesh_worker_pd_requests_total{outcome=\"partial\"}"
#define PD_DISAGG     "kvmesh_router_pd_total{decision=\"disaggregated\"}"
#define PD_MIGRATIONS "kvmesh_router_migrations_total"
#define PD_REF_SALT   "pdkill-reference"

/* Round's prompt: numbered notes, each different, so no page repeats and no two rounds (nor
 * the load's prompts) share one. `notes` sets the length: about 15 tokens a note. */
static char *pd_prompt(int round, int notes)
{
    static const char *const things[] = {"river",  "lantern", "orchard", "glacier", "violin",
                                         "harbor", "meadow",  "compass", "thunder", "saddle"};
    km_buf b = {0};
    km_buf_printf(&b, "Chaos round %d. Read these notes, then say which thing came first.\n",
                  round + 1);
    for (int i = 0; i < notes; i++)
        km_buf_printf(&b, "Note %d: the %s near house %d was painted %s on day %d.\n", i + 1,
                      things[(i + round * 3) % 10], 7 * i + 3 + round * 101,
                      (i + round) % 3 ? "blue" : "green", (i * 13 + round) % 31 + 1);
    km_buf_printf(&b, "Answer:");
    return (char *)b.data;
}

/* One long request, and what became of it. */
typedef struct pd_req {
    chaos_run *r;
    const char *prompt, *worker, *salt; /* worker: straight to it (router's key); else router */
    int max_tokens;
    int kill_pid; /* > 0: SIGKILLed when the first token arrives (round 2) */
    atomic_bool killed;
    pthread_t th;
    int rc, attempts;
    kvm_result res;
    char error[240];
} pd_req;

static int pd_on_token(void *user, uint32_t index, int32_t token, const char *text, size_t len)
{
    pd_req *q = user;
    if (q->kill_pid > 0 && !atomic_exchange(&q->killed, true)) kill(q->kill_pid, SIGKILL);
    return 0;
}

static bool pd_retryable(const kvm_result *res, int rc)
{
    return rc == KM_ETIMEDOUT || !res->error_code || res->error_code == KM_CODE_UNAVAILABLE ||
           res->error_code == KM_CODE_OVERLOADED || res->error_code == KM_CODE_INTERNAL;
}

static void *pd_req_main(void *arg)
{
    pd_req *q = arg;
    chaos_run *r = q->r;
    char ep[128], router_cert[160];
    kvm_opts o = {.timeout_ms = PD_TIMEOUT_MS * r->k.slow, .sec = {.cert = r->client_cert}};
    if (q->worker) { /* a worker serves members: the router's key */
        chaos_proc_field(r, q->worker, "requests", ep, sizeof ep);
        snprintf(router_cert, sizeof router_cert, "%s/keys/private/router.key", r->dir);
        o.sec = (kvm_sec){.cert = router_cert, .server = q->worker};
    }
    km_msg_request m;
    kvm_request_init(&m);
    m.prompt = q->prompt;
    m.temperature = 0;
    m.max_tokens = (uint32_t)q->max_tokens;
    m.stream = true;
    m.cache_salt = q->salt;
    q->rc = -1;
    for (q->attempts = 0; q->attempts < PD_ATTEMPTS && q->rc;) {
        kvm_client *c = NULL;
        km_errbuf err = {{0}};
        kvm_result_free(&q->res);
        memset(&q->res, 0, sizeof q->res);
        q->attempts++;
        q->rc = kvm_open(q->worker ? ep : r->router, &o, &c, &err);
        if (!q->rc) q->rc = kvm_generate(c, &m, pd_on_token, q, &q->res, &err);
        kvm_close(c);
        if (!q->rc && q->res.error_code) q->rc = -1;
        if (q->rc)
            snprintf(q->error, sizeof q->error, "%d %.100s %.100s", q->res.error_code, q->res.error,
                     err.msg);
        if (q->rc && !pd_retryable(&q->res, q->rc)) break;
    }
    return NULL;
}

static bool pd_same(const kvm_result *a, const kvm_result *b)
{
    return a->text.len == b->text.len &&
           (!a->text.len || !memcmp(a->text.data, b->text.data, a->text.len));
}

/* Waits for the victim's restart; false (r->problem says so) when it did not come back. */
static bool pd_back(chaos_run *r, const char *id, int pid, int round)
{
    if (chaos_wait_restarted(r, id, pid, PD_RESTART_MS)) return true;
    snprintf(r->problem, sizeof r->problem, "round %d: %.480s", round, r->note);
    return false;
}

int chaos_fault_pdkill(chaos_run *r)
{
    int notes = r->k.short_run ? 40 : 120, tokens = r->k.short_run ? 16 : 32;
    char *prompts[2] = {pd_prompt(0, notes), pd_prompt(1, notes)};
    pd_req ref[2] = {{0}}, got[2] = {{0}};
    int rc = -1; /* the fault could not be injected: a reference failed */
    /* the references: both at once straight on the prefill worker (the load leaves it idle),
     * under a salt of their own */
    for (int i = 0; i < 2; i++) {
        ref[i] = (pd_req){.r = r,
                          .prompt = prompts[i],
                          .worker = PD_PREFILL,
                          .salt = PD_REF_SALT,
                          .max_tokens = tokens};
        pthread_create(&ref[i].th, NULL, pd_req_main, &ref[i]);
    }
    for (int i = 0; i < 2; i++) pthread_join(ref[i].th, NULL);
    for (int i = 0; i < 2; i++) {
        if (ref[i].rc || ref[i].res.n_tokens < PD_MIN_TOKENS) {
            snprintf(r->note, sizeof r->note, "round %d's reference failed: %s (%u tokens)", i + 1,
                     ref[i].error, ref[i].res.n_tokens);
            goto out;
        }
    }
    double dis0 = chaos_metric(r, "router", PD_DISAGG);
    double mig0 = chaos_metric(r, "router", PD_MIGRATIONS);
    double partial0 = chaos_metric(r, PD_DECODE, PD_PARTIAL);
    double during0 = chaos_metric(r, PD_DECODE, PD_DURING);
    r->counts.set = true;
    rc = 0; /* from here on, r->problem says what went wrong; the load still ends and is checked */

    /* round 1: the prefill worker killed once the decode worker has its first pages */
    got[0] = (pd_req){.r = r, .prompt = prompts[0], .max_tokens = tokens};
    pthread_create(&got[0].th, NULL, pd_req_main, &got[0]);
    bool pulled = false;
    double during = -1;
    uint64_t t1 = km_wall_ms();
    for (uint64_t until = t1 + PD_PAGES_MS; !pulled && km_wall_ms() < until;)
        if (!(pulled = (during = chaos_metric(r, PD_DECODE, PD_DURING)) > during0)) km_sleep_ms(5);
    int wait1 = (int)(km_wall_ms() - t1);
    int pid0 = chaos_proc_pid(r, PD_PREFILL);
    bool killed0 = pulled && pid0 > 0 && kill(pid0, SIGKILL) == 0;
    r->counts.kills += killed0;
    pthread_join(got[0].th, NULL);
    double partial1 = chaos_metric(r, PD_DECODE, PD_PARTIAL);
    if (killed0 && !pd_back(r, PD_PREFILL, pid0, 1)) goto report;
    /* the router passes over a prefill worker whose hint failed for 1 s (router/pd.c) */
    km_sleep_ms(PD_BACKOFF_MS);

    /* round 2: the decode worker killed at the stream's first token */
    got[1] = (pd_req){.r = r,
                      .prompt = prompts[1],
                      .max_tokens = tokens,
                      .kill_pid = chaos_proc_pid(r, PD_DECODE)};
    int pid1 = got[1].kill_pid;
    pd_req_main(&got[1]);
    r->counts.kills += atomic_load(&got[1].killed);
    if (atomic_load(&got[1].killed)) pd_back(r, PD_DECODE, pid1, 2);
report:;
    double dis1 = chaos_metric(r, "router", PD_DISAGG);
    double mig1 = chaos_metric(r, "router", PD_MIGRATIONS);
    r->counts.migrations = mig0 >= 0 && mig1 >= 0 ? (int)(mig1 - mig0) : -1;
    bool eq[2];
    for (int i = 0; i < 2; i++) eq[i] = !got[i].rc && pd_same(&got[i].res, &ref[i].res);
    snprintf(r->note, sizeof r->note,
             "round 1: %s killed %d ms after the long prompt was sent (%s; pages imported "
             "during the prefill %.0f), the decode worker finished %.0f prompt(s) itself, "
             "output %s in %d attempt(s); round 2: %s killed at the first token, %u "
             "migration(s), output %s in %d attempt(s); the router disaggregated %.0f "
             "request(s) and migrated %d stream(s) over the fault",
             PD_PREFILL, wait1, pulled ? "its first pages had arrived" : "no page arrived",
             during - during0, partial1 - partial0,
             got[0].rc ? "FAILED"
             : eq[0]   ? "equal"
                       : "DIFFERENT",
             got[0].attempts, PD_DECODE, got[1].res.migrations,
             got[1].rc ? "FAILED"
             : eq[1]   ? "equal"
                       : "DIFFERENT",
             got[1].attempts, dis1 - dis0, r->counts.migrations);
    if (r->problem[0]) goto out;
    if (!pulled || !killed0)
        snprintf(r->problem, sizeof r->problem,
                 "round 1: no page of the long prompt reached %s within %d s: it was not "
                 "disaggregated, nothing killed",
                 PD_DECODE, PD_PAGES_MS / 1000);
    else if (!atomic_load(&got[1].killed))
        snprintf(r->problem, sizeof r->problem, "round 2: no token streamed: nothing killed");
    else if (got[0].rc || got[1].rc)
        snprintf(r->problem, sizeof r->problem, "a long prompt failed: %.200s",
                 got[0].rc ? got[0].error : got[1].error);
    else if (!eq[0] || !eq[1])
        snprintf(r->problem, sizeof r->problem,
                 "round %d's output differs from its reference on one worker", eq[0] ? 2 : 1);
    else if (dis1 - dis0 < 2)
        snprintf(r->problem, sizeof r->problem,
                 "the router disaggregated %.0f of the 2 long prompts", dis1 - dis0);
    else if (partial1 - partial0 < 1)
        snprintf(r->problem, sizeof r->problem,
                 "round 1: the decode worker did not finish the prompt itself (outcome partial)");
    else if (!got[1].res.migrations)
        snprintf(r->problem, sizeof r->problem, "round 2: the cut stream was not migrated");
out:
    for (int i = 0; i < 2; i++) {
        kvm_result_free(&ref[i].res);
        kvm_result_free(&got[i].res);
        free(prompts[i]);
    }
    return rc;
}
