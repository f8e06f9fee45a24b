/*
 * cli_chaos.c — `kvmesh chaos SCENARIO [--short] [--json]`: fault injection against a real local
 * cluster, with the checks that say whether the cluster kept its promises.
 *
 * Scenarios (the table `scenarios` below; `all` runs every one in order):
 *   pressure   (a) KV pressure ramp on w1 (the `pressure` admin command, workers run --chaos):
 *                  recovery levels 1, 2 and 3 must fire in that order; the drained worker is
 *                  restarted by `kvmesh up` and comes back ready
 *   kill       (b) SIGKILL w1 mid-stream; `kvmesh up` restarts it
 *   stop       (c) SIGSTOP w1 for 10 s (--short: 4 s), then SIGCONT
 *   controller (d) SIGKILL the controller; it is restarted and rebuilds its view from heartbeats
 *   router     (e) SIGKILL the router while clients retry; they reconnect to the restarted one
 *   partition  (f) w1 runs in its own network namespace (veth pair, 10.x addresses); its link is
 *                  cut, then restored (skipped, and said so, where `ip netns` is not permitted)
 *
 * Why it is built this way: each scenario starts its own cluster with the same code as `kvmesh up`
 * (this very binary, `up --base-port 0` in a temporary run directory: free ports, so it never
 * collides with tests running beside it) and finds the processes through up's cluster.env. Load is
 * real: several client threads, each with its own libkvmesh connection to the router, greedy
 * requests over prompts of mixed lengths, retrying retryable answers (503, 529, 500), broken
 * connections and silences (a dead router) a bounded number of times. A fault-free pass first
 * records every prompt's output; the faulted pass compares against it, so "the client saw one
 * uninterrupted, correct stream" is checked, not assumed. Every request ends as completed, failed
 * (the client was told why) or lost (silence until the retries ran out), and lost must be 0. The
 * controller's view (a SUB on its
 * --view) gives the recovery levels in order and the moment the cluster is all ready again; the
 * time to recover runs from the fault to that moment and a request completing after it.
 * One function per fault; the rest is the harness they share. Ctrl-C is taken by a thread of
 * its own, which stops the cluster and removes the network namespace before exiting.
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

#include "client/kvmesh.h"

#define CHAOS_WORKERS 2
#define CHAOS_TARGET  "w1" /* the worker every worker fault hits */
#define CHAOS_MAX_ACT 256  /* recovery actions remembered per run */

/* ---------------------------------------------------------------- knobs */

typedef struct chaos_knobs {
    bool short_run;
    int clients;     /* concurrent client threads */
    int max_tokens;  /* per request, greedy */
    int warmup_ms;   /* load before the fault */
    int tail_ms;     /* load after recovery */
    int stop_ms;     /* SIGSTOP length */
    int cut_ms;      /* partition length */
    int recover_ms;  /* longest wait for recovery */
    int timeout_ms;  /* client: longest silence per attempt */
    int attempts;    /* client: attempts per request */
    const char *ctl; /* controller policy flags */
    const char *wflags;
} chaos_knobs;

static void knobs_init(chaos_knobs *k, bool short_run)
{
    memset(k, 0, sizeof *k);
    k->short_run = short_run;
    k->clients = short_run ? 3 : 4;
    k->max_tokens = short_run ? 12 : 24;
    k->warmup_ms = short_run ? 1000 : 4000;
    k->tail_ms = short_run ? 1000 : 4000;
    k->stop_ms = short_run ? 4000 : 10000;
    k->cut_ms = short_run ? 4000 : 10000;
    k->recover_ms = short_run ? 40000 : 60000;
    k->timeout_ms = short_run ? 4000 : 6000;
    k->attempts = 8;
    k->ctl = short_run ? "--heartbeat=500ms --dead-after=3 --cooldown=1s --log-level=info"
                       : "--heartbeat=500ms --dead-after=3 --cooldown=2s --log-level=info";
    k->wflags = "--heartbeat=500ms --drain-timeout=3s --log-level=info";
}

/* ---------------------------------------------------------------- the cluster under test */

typedef enum chaos_recover_when {
    RECOVER_AFTER_DEGRADED, /* the view showed a member not ready, then all ready again */
    RECOVER_ALL_READY,      /* the view is all ready after the fault ended */
    RECOVER_NEW_EPOCH,      /* a view from a new controller process, all ready */
    RECOVER_COMPLETION,     /* the view is not involved: a request completes */
} chaos_recover_when;

typedef struct chaos_run chaos_run;

/* One row of the scenario table: the fault and what recovery means after it. */
typedef struct chaos_scenario {
    const char *name, *letter, *what;
    int (*fault)(chaos_run *r); /* injects the fault; returns when it has ended (0) or failed */
    chaos_recover_when recover_when;
    bool outputs_must_match; /* false where the fault may change outputs (fp8 KV) */
    bool needs_netns;
} chaos_scenario;

typedef struct chaos_action {
    char worker[64], reason[48];
    uint64_t at_ms;
    uint32_t level;
    bool ok;
} chaos_action;

struct chaos_run {
    const chaos_scenario *sc;
    chaos_knobs k;
    char dir[64], cluster_file[128];
    pid_t up_pid;
    char netns[32], veth_host[16], veth_ns[16], addr_host[32], addr_ns[32];
    bool netns_made;
    char ctl_listen[128], ctl_view[128], router[128];
    /* the view monitor (a thread on the controller's PUB) */
    pthread_t mon;
    atomic_bool mon_stop;
    pthread_mutex_t mu;
    bool mon_started;
    uint64_t epoch, pre_epoch, views, last_view_ms;
    bool all_ready, armed, degraded_seen;
    uint64_t fault_ms, fault_end_ms, ready_at_ms;
    chaos_action acts[CHAOS_MAX_ACT];
    int n_acts;
    struct {
        char worker[64], state[16];
        uint64_t at_ms;
    } trans[32]; /* member state changes seen in views since the fault began */
    int n_trans;
    char last_state[CHAOS_WORKERS + 2][2][64]; /* id, state */
    char target_state[16];
    uint32_t target_level;
    double target_pressure;
    char note[512]; /* what the fault function saw, for the report */
};

/* What to clean up if we are interrupted (the signal thread reads them). */
static volatile pid_t g_up_pid;
static char g_netns[32], g_veth[16], g_cluster_file[128];

/* Children get the signal mask back that kvm_cli_chaos blocked for its signal thread. */
static void unblock_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
}

/* In a forked child: stdout and stderr to these files. */
static void redirect_output(const char *out, const char *err)
{
    int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o >= 0) dup2(o, 1), close(o);
    if (e >= 0) dup2(e, 2), close(e);
}

static int run_cmd(const char *const *argv, bool quiet)
{
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        unblock_signals();
        if (quiet) redirect_output("/dev/null", "/dev/null");
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void netns_cleanup(void)
{
    if (g_veth[0]) {
        const char *a[] = {"ip", "link", "del", g_veth, NULL};
        run_cmd(a, true);
        g_veth[0] = 0;
    }
    if (g_netns[0]) {
        const char *a[] = {"ip", "netns", "del", g_netns, NULL};
        run_cmd(a, true);
        g_netns[0] = 0;
    }
}

static void on_signal_noop(int sig)
{
    (void)sig;
}

/* Ctrl-C or SIGTERM: a thread of its own (the signals are blocked everywhere else and taken with
 * sigwait), so the cleanup runs in ordinary context: stop the cluster (`up` stops its daemons;
 * anything left in cluster.env is killed), remove the namespace, exit. */
static void *signal_main(void *arg)
{
    sigset_t *set = arg;
    int sig = 0;
    if (sigwait(set, &sig)) return NULL;
    fprintf(stderr, "\nkvmesh chaos: %s: stopping the cluster and cleaning up\n", strsignal(sig));
    pid_t up = g_up_pid;
    if (up > 0) {
        kill(up, SIGTERM);
        for (int i = 0; i < 300 && kill(up, 0) == 0; i++) {
            waitpid(up, NULL, WNOHANG);
            km_sleep_ms(50);
        }
        kill(up, SIGKILL);
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n =
            g_cluster_file[0] ? kvm_cluster_read(g_cluster_file, procs, KVM_CLUSTER_MAX, NULL) : 0;
        for (int i = 0; i < n; i++)
            if (procs[i].pid > 0) kill(procs[i].pid, SIGKILL);
    }
    netns_cleanup();
    if (g_cluster_file[0]) {
        char *slash = strrchr(g_cluster_file, '/');
        if (slash) *slash = 0;
        fprintf(stderr, "kvmesh chaos: the interrupted run's logs are in %s\n", g_cluster_file);
    }
    _exit(128 + sig);
}

static int read_cluster(chaos_run *r, kvm_cluster_proc *procs)
{
    km_errbuf err = {{0}};
    int n = kvm_cluster_read(r->cluster_file, procs, KVM_CLUSTER_MAX, &err);
    return n < 0 ? 0 : n;
}

static int proc_pid(chaos_run *r, const char *id)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = read_cluster(r, procs);
    const kvm_cluster_proc *p = kvm_cluster_find(procs, n, id);
    return p ? p->pid : 0;
}

static const char *proc_field(chaos_run *r, const char *id, const char *field, char *buf,
                              size_t cap)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = read_cluster(r, procs);
    const kvm_cluster_proc *p = kvm_cluster_find(procs, n, id);
    buf[0] = 0;
    if (!p) return buf;
    const char *v = !strcmp(field, "requests") ? p->requests
                    : !strcmp(field, "admin")  ? p->admin
                    : !strcmp(field, "listen") ? p->listen
                    : !strcmp(field, "view")   ? p->view
                                               : "";
    snprintf(buf, cap, "%s", v);
    return buf;
}

/* Waits until process id runs with a pid other than old (0: any); returns the pid or 0. */
static int wait_new_pid(chaos_run *r, const char *id, int old, int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 50) {
        int pid = proc_pid(r, id);
        if (pid > 0 && pid != old) return pid;
        km_sleep_ms(50);
    }
    return 0;
}

/* Waits until a worker's own /readyz says 200. */
static bool wait_worker_ready(chaos_run *r, const char *id, int timeout_ms)
{
    char admin[128], url[200];
    proc_field(r, id, "admin", admin, sizeof admin);
    snprintf(url, sizeof url, "%s/readyz", admin);
    for (int waited = 0; waited < timeout_ms; waited += 100) {
        km_buf b = {0};
        int st = 0;
        int rc = kvm_http_get(url, 1000, &b, &st, NULL);
        km_buf_free(&b);
        if (!rc && st == 200) return true;
        km_sleep_ms(100);
    }
    return false;
}

/* ---------------------------------------------------------------- view monitor */

static void mon_merge(chaos_run *r, const km_view_worker *w)
{
    for (uint32_t h = 0; h < w->n_history; h++) {
        const km_recovery_action *a = &w->history[h];
        /* the same action comes again in every view; its at_ms may move by a few ms (the
         * controller derives wall time from its own clock each time), so match loosely */
        bool seen = false;
        for (int i = 0; i < r->n_acts && !seen; i++) {
            chaos_action *c = &r->acts[i];
            uint64_t d = c->at_ms > a->at_ms ? c->at_ms - a->at_ms : a->at_ms - c->at_ms;
            seen = d < 250 && c->level == a->level && !strcmp(c->worker, w->id) &&
                   !strcmp(c->reason, a->reason ? a->reason : "?");
            if (seen) c->ok |= a->ok;
        }
        if (seen || r->n_acts == CHAOS_MAX_ACT) continue;
        chaos_action *c = &r->acts[r->n_acts++];
        snprintf(c->worker, sizeof c->worker, "%s", w->id);
        snprintf(c->reason, sizeof c->reason, "%s", a->reason ? a->reason : "?");
        c->at_ms = a->at_ms;
        c->level = a->level;
        c->ok = a->ok;
    }
}

/* Remembers member state changes (ready -> dead -> ready, ...) once the fault has begun. */
static void mon_state(chaos_run *r, const km_view_worker *w, uint64_t now)
{
    const char *st = km_member_state_name(w->state);
    int slot = -1;
    for (int i = 0; i < CHAOS_WORKERS + 2 && slot < 0; i++)
        if (!strcmp(r->last_state[i][0], w->id) || !r->last_state[i][0][0]) slot = i;
    if (slot < 0) return;
    bool changed = strcmp(r->last_state[slot][1], st) != 0;
    snprintf(r->last_state[slot][0], 64, "%s", w->id);
    snprintf(r->last_state[slot][1], 64, "%s", st);
    if (!changed || !r->armed || r->n_trans == 32) return;
    snprintf(r->trans[r->n_trans].worker, 64, "%s", w->id);
    snprintf(r->trans[r->n_trans].state, 16, "%s", st);
    r->trans[r->n_trans++].at_ms = now;
}

static void mon_on_view(chaos_run *r, const km_msg_view *v)
{
    uint64_t now = km_wall_ms();
    pthread_mutex_lock(&r->mu);
    r->views++;
    r->last_view_ms = now;
    r->epoch = v->epoch;
    r->all_ready = kvm_view_all_ready(v, CHAOS_WORKERS);
    for (uint32_t i = 0; i < v->n_workers; i++) {
        mon_merge(r, &v->workers[i]);
        mon_state(r, &v->workers[i], now);
        if (!strcmp(v->workers[i].id, CHAOS_TARGET)) {
            snprintf(r->target_state, sizeof r->target_state, "%s",
                     km_member_state_name(v->workers[i].state));
            r->target_level = v->workers[i].level;
            r->target_pressure = v->workers[i].pressure;
        }
    }
    if (r->armed && !r->all_ready) r->degraded_seen = true;
    if (r->armed && r->fault_end_ms && !r->ready_at_ms && r->all_ready) {
        bool ok = true;
        if (r->sc->recover_when == RECOVER_AFTER_DEGRADED) ok = r->degraded_seen;
        if (r->sc->recover_when == RECOVER_NEW_EPOCH) ok = r->epoch != r->pre_epoch;
        if (ok) r->ready_at_ms = now;
    }
    pthread_mutex_unlock(&r->mu);
}

static void *mon_main(void *arg)
{
    chaos_run *r = arg;
    kvm_view_sub *sub = NULL;
    km_errbuf err = {{0}};
    if (kvm_view_sub_open(r->ctl_view, &sub, &err)) {
        fprintf(stderr, "kvmesh chaos: view subscription: %s\n", err.msg);
        return NULL;
    }
    uint64_t last_poll = 0;
    while (!atomic_load(&r->mon_stop)) {
        km_msg v;
        if (!kvm_view_sub_next(sub, 100, &v, NULL)) {
            mon_on_view(r, &v.view);
            km_msg_clear(&v);
        }
        /* published views may leave the histories out; the status reply carries them */
        if (km_now_ns() - last_poll > 250000000u) {
            last_poll = km_now_ns();
            if (!kvm_view_get(r->ctl_listen, 1000, &v, NULL)) {
                pthread_mutex_lock(&r->mu);
                for (uint32_t i = 0; i < v.view.n_workers; i++) mon_merge(r, &v.view.workers[i]);
                pthread_mutex_unlock(&r->mu);
                km_msg_clear(&v);
            }
        }
    }
    kvm_view_sub_close(sub);
    return NULL;
}

/* The recovery levels that fired on worker (any when NULL) since `since`, oldest first. */
static int actions_since(chaos_run *r, uint64_t since, const char *worker, chaos_action *out,
                         int max)
{
    pthread_mutex_lock(&r->mu);
    int n = 0;
    for (int i = 0; i < r->n_acts && n < max; i++)
        if (r->acts[i].at_ms + 1000 >= since && (!worker || !strcmp(r->acts[i].worker, worker)))
            out[n++] = r->acts[i];
    pthread_mutex_unlock(&r->mu);
    for (int i = 1; i < n; i++) /* insertion sort by time */
        for (int j = i; j > 0 && out[j].at_ms < out[j - 1].at_ms; j--) {
            chaos_action t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return n;
}

/* Waits until worker has had an action of `level` since `since` (true) or timeout_ms passed. */
static bool wait_level(chaos_run *r, const char *worker, uint32_t level, uint64_t since,
                       int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 100) {
        chaos_action a[CHAOS_MAX_ACT];
        int n = actions_since(r, since, worker, a, CHAOS_MAX_ACT);
        for (int i = 0; i < n; i++)
            if (a[i].level == level) return true;
        km_sleep_ms(100);
    }
    return false;
}

/* ---------------------------------------------------------------- load */

typedef struct chaos_load {
    const char *endpoint;
    const chaos_knobs *k;
    const char *const *prompts;
    int n_prompts;
    bool reference; /* the fault-free pass: each prompt once, outputs recorded */
    char **ref;     /* reference outputs, by prompt */
    size_t *ref_len;
    atomic_bool stop;
    pthread_mutex_t mu;
    int sent, completed, failed, lost, equal, differ, retries, migrated;
    int first_differ;  /* prompt index of the first output that differed */
    uint64_t *done_at; /* completion times (wall ms) */
    int n_done, cap_done;
    char first_errors[4][200];
    int n_errors;
} chaos_load;

typedef struct chaos_client {
    chaos_load *load;
    int index;
    pthread_t th;
} chaos_client;

static bool retryable(const kvm_result *res, int rc)
{
    if (rc == KM_ETIMEDOUT) return true; /* silence: a dead router or worker */
    if (!res->error_code) return true;   /* could not even send */
    return res->error_code == KM_CODE_UNAVAILABLE || res->error_code == KM_CODE_OVERLOADED ||
           res->error_code == KM_CODE_INTERNAL;
}

static void load_note_error(chaos_load *l, const char *msg)
{
    if (l->n_errors < 4) snprintf(l->first_errors[l->n_errors++], 200, "%.190s", msg);
}

/* One logical request: up to k->attempts tries. */
static void load_one(chaos_load *l, kvm_client **c, int prompt)
{
    const chaos_knobs *k = l->k;
    km_msg_request q;
    kvm_request_init(&q);
    q.prompt = l->prompts[prompt];
    q.temperature = 0;
    q.max_tokens = (uint32_t)k->max_tokens;
    q.stream = true;
    pthread_mutex_lock(&l->mu);
    l->sent++;
    pthread_mutex_unlock(&l->mu);
    bool done = false, told = false;
    char last[200] = "";
    kvm_result res;
    memset(&res, 0, sizeof res);
    for (int attempt = 0; attempt < k->attempts && !done; attempt++) {
        if (attempt) {
            pthread_mutex_lock(&l->mu);
            l->retries++;
            pthread_mutex_unlock(&l->mu);
        }
        km_errbuf err = {{0}};
        kvm_result_free(&res);
        int rc = kvm_generate(*c, &q, NULL, NULL, &res, &err);
        if (rc == 0) {
            done = true;
            break;
        }
        told = res.error_code != 0;
        snprintf(last, sizeof last, "%.190s", err.msg);
        if (!retryable(&res, rc)) break;
        if (rc == KM_ETIMEDOUT) { /* a new connection: the old one may be to a dead router */
            kvm_close(*c);
            *c = NULL;
            kvm_opts o = {.timeout_ms = k->timeout_ms};
            if (kvm_open(l->endpoint, &o, c, NULL)) break;
        } else {
            int wait = res.retry_after_ms ? (int)res.retry_after_ms : 200;
            km_sleep_ms(wait > 2000 ? 2000 : wait);
        }
    }
    uint64_t now = km_wall_ms();
    pthread_mutex_lock(&l->mu);
    if (done) {
        l->completed++;
        if (res.migrations) l->migrated++;
        if (l->n_done == l->cap_done) {
            int cap = l->cap_done ? 2 * l->cap_done : 1024;
            uint64_t *nd = realloc(l->done_at, sizeof *nd * (size_t)cap);
            if (nd) l->done_at = nd, l->cap_done = cap;
        }
        if (l->n_done < l->cap_done) l->done_at[l->n_done++] = now;
        const char *text = res.text.data ? (const char *)res.text.data : "";
        if (l->reference) {
            free(l->ref[prompt]);
            l->ref[prompt] = malloc(res.text.len + 1);
            if (l->ref[prompt]) memcpy(l->ref[prompt], text, res.text.len);
            l->ref_len[prompt] = res.text.len;
        } else if (l->ref[prompt] && l->ref_len[prompt] == res.text.len &&
                   !memcmp(l->ref[prompt], text, res.text.len)) {
            l->equal++;
        } else {
            if (!l->differ) l->first_differ = prompt;
            l->differ++;
        }
    } else if (told) {
        l->failed++;
        load_note_error(l, last);
    } else {
        l->lost++;
        char m[240];
        snprintf(m, sizeof m, "lost: %s", last);
        load_note_error(l, m);
    }
    pthread_mutex_unlock(&l->mu);
    kvm_result_free(&res);
}

static void *client_main(void *arg)
{
    chaos_client *cl = arg;
    chaos_load *l = cl->load;
    kvm_client *c = NULL;
    kvm_opts o = {.timeout_ms = l->k->timeout_ms};
    if (kvm_open(l->endpoint, &o, &c, NULL)) return NULL;
    if (l->reference) {
        for (int p = cl->index; p < l->n_prompts && c; p += l->k->clients) {
            load_one(l, &c, p);
            if (!c && kvm_open(l->endpoint, &o, &c, NULL)) break;
        }
    } else {
        for (int i = cl->index; !atomic_load(&l->stop); i += l->k->clients) {
            load_one(l, &c, i % l->n_prompts);
            if (!c && kvm_open(l->endpoint, &o, &c, NULL)) break;
        }
    }
    kvm_close(c);
    return NULL;
}

static void load_start(chaos_load *l, chaos_client *cls)
{
    for (int i = 0; i < l->k->clients; i++) {
        cls[i].load = l;
        cls[i].index = i;
        pthread_create(&cls[i].th, NULL, client_main, &cls[i]);
    }
}

static void load_join(chaos_load *l, chaos_client *cls)
{
    atomic_store(&l->stop, true);
    for (int i = 0; i < l->k->clients; i++) pthread_join(cls[i].th, NULL);
}

/* The first completion at or after t (wall ms), or 0. */
static uint64_t first_done_after(chaos_load *l, uint64_t t)
{
    uint64_t best = 0;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->n_done; i++)
        if (l->done_at[i] >= t && (!best || l->done_at[i] < best)) best = l->done_at[i];
    pthread_mutex_unlock(&l->mu);
    return best;
}

/* Prompts of mixed lengths: short continuations, code, chat turns, and long ones sharing a
 * ~100-token system prefix (what the KV-aware router keeps together). */
#define CHAOS_SYS                                                                                  \
    "<|im_start|>system\nYou are a careful assistant for a shipping company. You answer "          \
    "questions about parcels, delivery times, customs forms and returns. Always answer in one "    \
    "short paragraph, mention the relevant form number when there is one, and never invent "       \
    "tracking numbers. Delivery within the country takes two to four working days; abroad it "     \
    "takes five to ten. Parcels above thirty kilograms need form F-30. Returns are free within "   \
    "thirty days with form R-1.<|im_end|>\n<|im_start|>user\n"

static const char *const chaos_prompts[] = {
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "1. Apples\n2. Oranges\n3.",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n"
    "<|im_start|>assistant\n",
    CHAOS_SYS "How long does a parcel to Spain take?<|im_end|>\n<|im_start|>assistant\n",
    CHAOS_SYS "I want to return a jacket I bought last week.<|im_end|>\n<|im_start|>assistant\n",
    CHAOS_SYS "My parcel weighs 35 kg. What do I need?<|im_end|>\n<|im_start|>assistant\n",
    "The meeting is on Tuesday at 14:30 in room 4.12; the budget review follows at",
    "La tour Eiffel a été construite pour",
};
#define CHAOS_N_PROMPTS ((int)(sizeof chaos_prompts / sizeof *chaos_prompts))

/* ---------------------------------------------------------------- faults */

static int send_pressure(chaos_run *r, double fraction)
{
    char ep[128];
    proc_field(r, CHAOS_TARGET, "requests", ep, sizeof ep);
    km_msg_admin a = {.cmd = KM_ADMIN_PRESSURE, .fraction = fraction};
    km_msg rep;
    km_errbuf err = {{0}};
    int rc = kvm_admin_call(ep, &a, 10000, &rep, &err);
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
    if (actions_since(r, t0 + 1000, CHAOS_TARGET, early, CHAOS_MAX_ACT) > 0) {
        snprintf(r->note, sizeof r->note, "level %u fired at pressure 0.5 (%.2f in the view)",
                 early[0].level, r->target_pressure);
        return -1;
    }
    if (send_pressure(r, 0.95)) return -1;
    if (!wait_level(r, CHAOS_TARGET, 2, t0, 8 * cooldown + 10000)) {
        snprintf(r->note, sizeof r->note,
                 "level 2 did not fire (state %s, level %u, pressure %.2f)", r->target_state,
                 r->target_level, r->target_pressure);
        return -1;
    }
    if (send_pressure(r, 0.95)) return -1;
    if (!wait_level(r, CHAOS_TARGET, 3, t0, 4 * cooldown + 3000)) {
        if (send_pressure(r, 0.99)) return -1;
        if (!wait_level(r, CHAOS_TARGET, 3, t0, 4 * cooldown + 10000)) {
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
    int pid = proc_pid(r, CHAOS_TARGET);
    if (pid <= 0 || kill(pid, SIGKILL)) return -1;
    if (!wait_new_pid(r, CHAOS_TARGET, pid, 30000)) return -1;
    return wait_worker_ready(r, CHAOS_TARGET, 60000) ? 0 : -1;
}

/* (c) SIGSTOP the target for stop_ms, then SIGCONT. */
static int fault_stop(chaos_run *r)
{
    int pid = proc_pid(r, CHAOS_TARGET);
    if (pid <= 0 || kill(pid, SIGSTOP)) return -1;
    km_sleep_ms(r->k.stop_ms);
    return kill(pid, SIGCONT) ? -1 : 0;
}

/* (d) SIGKILL the controller; done when its successor runs (the view must come back from it). */
static int fault_controller(chaos_run *r)
{
    int pid = proc_pid(r, "controller");
    if (pid <= 0 || kill(pid, SIGKILL)) return -1;
    return wait_new_pid(r, "controller", pid, 30000) ? 0 : -1;
}

/* (e) SIGKILL the router while requests stream through it. */
static int fault_router(chaos_run *r)
{
    int pid = proc_pid(r, "router");
    if (pid <= 0 || kill(pid, SIGKILL)) return -1;
    return wait_new_pid(r, "router", pid, 30000) ? 0 : -1;
}

static int ns_link(chaos_run *r, const char *updown)
{
    const char *a[] = {"ip",   "netns", "exec",     r->netns, "ip",
                       "link", "set",   r->veth_ns, updown,   NULL};
    return run_cmd(a, false);
}

/* (f) cut the target's namespace off (its end of the veth pair down), then restore it. */
static int fault_partition(chaos_run *r)
{
    if (ns_link(r, "down")) return -1;
    km_sleep_ms(r->k.cut_ms);
    return ns_link(r, "up") ? -1 : 0;
}

/* Makes the namespace and veth pair of the partition scenario; 1 = not permitted here (skip). */
static int netns_setup(chaos_run *r)
{
    int id = getpid();
    snprintf(r->netns, sizeof r->netns, "kvmesh-chaos-%d", id);
    snprintf(r->veth_host, sizeof r->veth_host, "kvc%dh", id % 10000000);
    snprintf(r->veth_ns, sizeof r->veth_ns, "kvc%dn", id % 10000000);
    int a = 200 + id % 50, b = (id / 50) % 256, c = 4 * ((id / 12800) % 64);
    snprintf(r->addr_host, sizeof r->addr_host, "10.%d.%d.%d", a, b, c + 1);
    snprintf(r->addr_ns, sizeof r->addr_ns, "10.%d.%d.%d", a, b, c + 2);
    const char *add[] = {"ip", "netns", "add", r->netns, NULL};
    if (run_cmd(add, true)) return 1;
    snprintf(g_netns, sizeof g_netns, "%s", r->netns);
    r->netns_made = true;
    char host_cidr[40], ns_cidr[40];
    snprintf(host_cidr, sizeof host_cidr, "%s/30", r->addr_host);
    snprintf(ns_cidr, sizeof ns_cidr, "%s/30", r->addr_ns);
    const char *veth[] = {"ip",   "link", "add",  r->veth_host, "type",
                          "veth", "peer", "name", r->veth_ns,   NULL};
    if (run_cmd(veth, false)) return -1;
    snprintf(g_veth, sizeof g_veth, "%s", r->veth_host);
    const char *steps[][10] = {
        {"ip", "link", "set", r->veth_ns, "netns", r->netns, NULL},
        {"ip", "addr", "add", host_cidr, "dev", r->veth_host, NULL},
        {"ip", "link", "set", r->veth_host, "up", NULL},
        {"ip", "netns", "exec", r->netns, "ip", "addr", "add", ns_cidr, "dev", r->veth_ns},
        {"ip", "netns", "exec", r->netns, "ip", "link", "set", r->veth_ns, "up", NULL},
        {"ip", "netns", "exec", r->netns, "ip", "link", "set", "lo", "up", NULL},
    };
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        const char *argv[12] = {0};
        for (int j = 0; j < 10 && steps[i][j]; j++) argv[j] = steps[i][j];
        if (run_cmd(argv, false)) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the scenario table */

static const chaos_scenario scenarios[] = {
    {"pressure", "a",
     "KV pressure ramp on w1 (0.5, 0.95, 0.95 again after fp8): levels 1, 2, 3 in order; the "
     "drained worker is restarted and comes back ready",
     fault_pressure, RECOVER_AFTER_DEGRADED, false, false},
    {"kill", "b", "SIGKILL w1 mid-stream; kvmesh up restarts it", fault_kill, RECOVER_ALL_READY,
     true, false},
    {"stop", "c", "SIGSTOP w1 (10 s; --short 4 s), then SIGCONT", fault_stop,
     RECOVER_AFTER_DEGRADED, true, false},
    {"controller", "d",
     "SIGKILL the controller; serving goes on, the restarted one rebuilds the view",
     fault_controller, RECOVER_NEW_EPOCH, true, false},
    {"router", "e", "SIGKILL the router while clients retry; they reconnect to the restarted one",
     fault_router, RECOVER_COMPLETION, true, false},
    {"partition", "f",
     "w1 in its own network namespace, its link cut (10 s; --short 4 s), then restored",
     fault_partition, RECOVER_AFTER_DEGRADED, true, true},
};
#define N_SCENARIOS ((int)(sizeof scenarios / sizeof *scenarios))

/* ---------------------------------------------------------------- one run */

typedef struct chaos_result {
    const chaos_scenario *sc;
    bool skipped, passed, recovered, outputs_ok, order_ok;
    char skip_reason[256], error[512];
    int sent, completed, failed, lost, equal, differ, retries, migrated;
    int ref_sent, first_differ;
    double recover_s, fault_s;
    char levels[512], states[512];
    char errors[4][200];
    int n_errors;
    char dir[64];
} chaos_result;

static int cluster_start(chaos_run *r)
{
    /* this binary (exec'd through /proc/self/exe, which still works when a rebuild has replaced
     * the file meanwhile) and the daemons next to it */
    char bin_dir[4096];
    ssize_t l = readlink("/proc/self/exe", bin_dir, sizeof bin_dir - 1);
    if (l <= 0) return -1;
    bin_dir[l] = 0;
    char *slash = strrchr(bin_dir, '/');
    if (!slash) return -1;
    *slash = 0;
    char bin_flag[4200];
    snprintf(bin_flag, sizeof bin_flag, "--bin-dir=%s", bin_dir);
    char logs[128], uplog[128], netns[256] = "";
    snprintf(logs, sizeof logs, "%s/logs", r->dir);
    snprintf(uplog, sizeof uplog, "%s/up.log", r->dir);
    if (r->netns_made)
        snprintf(netns, sizeof netns, "%s=%s,%s,%s", CHAOS_TARGET, r->netns, r->addr_ns,
                 r->addr_host);
    const char *argv[40] = {"kvmesh",
                            "up",
                            "--run-dir",
                            r->dir,
                            "--log-dir",
                            logs,
                            "--base-port=0",
                            "--workers=2",
                            "--threads=1",
                            "--kv-bytes=32M",
                            "--worker-args",
                            r->k.wflags,
                            "--worker-args-for",
                            CHAOS_TARGET ":--chaos",
                            "--controller-args",
                            r->k.ctl,
                            "--router-args",
                            "--log-level=info"};
    int k = 18;
    argv[k++] = bin_flag;
    if (netns[0]) argv[k++] = "--netns", argv[k++] = netns;
    argv[k] = NULL;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        unblock_signals();
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        redirect_output("/dev/null", uplog);
        execv("/proc/self/exe", (char *const *)argv);
        _exit(127);
    }
    r->up_pid = g_up_pid = pid;
    snprintf(g_cluster_file, sizeof g_cluster_file, "%s", r->cluster_file);
    /* every process running ... */
    for (int waited = 0;; waited += 100) {
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n = read_cluster(r, procs), running = 0;
        for (int i = 0; i < n; i++) running += procs[i].pid > 0;
        if (n >= CHAOS_WORKERS + 2 && running == n) {
            const kvm_cluster_proc *c = kvm_cluster_find(procs, n, "controller");
            const kvm_cluster_proc *rt = kvm_cluster_find(procs, n, "router");
            if (!c || !rt) return -1;
            snprintf(r->ctl_listen, sizeof r->ctl_listen, "%s", c->listen);
            snprintf(r->ctl_view, sizeof r->ctl_view, "%s", c->view);
            snprintf(r->router, sizeof r->router, "%s", rt->requests);
            break;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid || waited > 30000) return -1;
        km_sleep_ms(100);
    }
    /* ... and the controller's view all ready */
    atomic_store(&r->mon_stop, false);
    pthread_create(&r->mon, NULL, mon_main, r);
    r->mon_started = true;
    for (int waited = 0; waited < 120000; waited += 100) {
        pthread_mutex_lock(&r->mu);
        bool ready = r->all_ready;
        pthread_mutex_unlock(&r->mu);
        if (ready) return 0;
        km_sleep_ms(100);
    }
    return -1;
}

static void cluster_stop(chaos_run *r)
{
    if (r->mon_started) {
        atomic_store(&r->mon_stop, true);
        pthread_join(r->mon, NULL);
        r->mon_started = false;
    }
    if (r->up_pid > 0) {
        kill(r->up_pid, SIGTERM);
        int st;
        bool gone = false;
        for (int i = 0; i < 300 && !gone; i++) {
            gone = waitpid(r->up_pid, &st, WNOHANG) == r->up_pid;
            if (!gone) km_sleep_ms(50);
        }
        if (!gone) {
            kill(r->up_pid, SIGKILL);
            waitpid(r->up_pid, &st, 0);
        }
        /* nothing up started may outlive it */
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n = read_cluster(r, procs);
        for (int i = 0; i < n; i++)
            if (procs[i].pid > 0 && kill(procs[i].pid, 0) == 0) kill(procs[i].pid, SIGKILL);
        r->up_pid = g_up_pid = 0;
        g_cluster_file[0] = 0;
    }
}

static void format_levels(chaos_run *r, chaos_result *res)
{
    chaos_action a[CHAOS_MAX_ACT];
    int n = actions_since(r, r->fault_ms, NULL, a, CHAOS_MAX_ACT);
    res->levels[0] = 0;
    size_t off = 0;
    for (int i = 0; i < n && off < sizeof res->levels - 64; i++)
        off += (size_t)snprintf(res->levels + off, sizeof res->levels - off, "%s%s:L%u(%s)%s",
                                i ? " -> " : "", a[i].worker, a[i].level, a[i].reason,
                                a[i].ok ? "" : "!ack");
    if (!n) snprintf(res->levels, sizeof res->levels, "none");
    pthread_mutex_lock(&r->mu);
    off = 0;
    res->states[0] = 0;
    for (int i = 0; i < r->n_trans && off < sizeof res->states - 64; i++)
        off += (size_t)snprintf(res->states + off, sizeof res->states - off, "%s%s %s (+%.1f s)",
                                i ? ", " : "", r->trans[i].worker, r->trans[i].state,
                                (r->trans[i].at_ms - r->fault_ms) / 1e3);
    if (!r->n_trans) snprintf(res->states, sizeof res->states, "no change");
    pthread_mutex_unlock(&r->mu);
    /* the pressure scenario's promise: the first 1, 2 and 3 on the target come in that order */
    uint64_t first[4] = {0};
    for (int i = 0; i < n; i++)
        if (!strcmp(a[i].worker, CHAOS_TARGET) && a[i].level >= 1 && a[i].level <= 3 &&
            !first[a[i].level])
            first[a[i].level] = a[i].at_ms;
    res->order_ok =
        first[1] && first[2] && first[3] && first[1] <= first[2] && first[2] <= first[3];
}

static void run_scenario(const chaos_scenario *sc, const chaos_knobs *k, bool keep,
                         chaos_result *res)
{
    memset(res, 0, sizeof *res);
    res->sc = sc;
    chaos_run *r = calloc(1, sizeof *r);
    r->sc = sc;
    r->k = *k;
    pthread_mutex_init(&r->mu, NULL);
    snprintf(r->dir, sizeof r->dir, "/tmp/kvmesh-chaos-XXXXXX");
    if (!mkdtemp(r->dir)) {
        snprintf(res->error, sizeof res->error, "cannot make a run directory");
        free(r);
        return;
    }
    snprintf(res->dir, sizeof res->dir, "%s", r->dir);
    snprintf(r->cluster_file, sizeof r->cluster_file, "%s/%s", r->dir, KVM_CLUSTER_FILE);
    chaos_load ref = {0}, load = {0};
    char *ref_out[CHAOS_N_PROMPTS] = {0};
    size_t ref_len[CHAOS_N_PROMPTS] = {0};
    chaos_client cls[16];
    if (sc->needs_netns) {
        int ns = netns_setup(r);
        if (ns == 1) {
            res->skipped = res->passed = true;
            snprintf(res->skip_reason, sizeof res->skip_reason,
                     "`ip netns add` is not permitted here (needs root or CAP_SYS_ADMIN and "
                     "iproute2); partition scenario skipped");
            goto out;
        }
        if (ns < 0) {
            snprintf(res->error, sizeof res->error, "could not set up the network namespace");
            goto out;
        }
    }
    if (cluster_start(r)) {
        snprintf(res->error, sizeof res->error,
                 "the cluster did not come up (is kvmesh-controller built? see %s/up.log and "
                 "%s/logs)",
                 r->dir, r->dir);
        goto out;
    }
    /* 1. fault-free reference */
    ref.endpoint = load.endpoint = r->router;
    ref.k = load.k = k;
    ref.prompts = load.prompts = chaos_prompts;
    ref.n_prompts = load.n_prompts = CHAOS_N_PROMPTS;
    ref.ref = load.ref = ref_out;
    ref.ref_len = load.ref_len = ref_len;
    ref.reference = true;
    pthread_mutex_init(&ref.mu, NULL);
    pthread_mutex_init(&load.mu, NULL);
    load_start(&ref, cls);
    load_join(&ref, cls);
    res->ref_sent = ref.sent;
    if (ref.completed != CHAOS_N_PROMPTS) {
        snprintf(res->error, sizeof res->error,
                 "the fault-free pass did not complete (%d of %d; first error: %s)", ref.completed,
                 CHAOS_N_PROMPTS, ref.n_errors ? ref.first_errors[0] : "-");
        goto out;
    }
    /* 2. the same load with the fault */
    load_start(&load, cls);
    km_sleep_ms(k->warmup_ms);
    pthread_mutex_lock(&r->mu);
    r->pre_epoch = r->epoch;
    r->fault_ms = km_wall_ms();
    r->armed = true;
    pthread_mutex_unlock(&r->mu);
    int frc = sc->fault(r);
    uint64_t fault_end = km_wall_ms();
    res->fault_s = (fault_end - r->fault_ms) / 1e3;
    pthread_mutex_lock(&r->mu);
    r->fault_end_ms = fault_end;
    if (sc->recover_when == RECOVER_COMPLETION) r->ready_at_ms = fault_end;
    pthread_mutex_unlock(&r->mu);
    if (frc) {
        snprintf(res->error, sizeof res->error, "the fault could not be injected%s%.400s",
                 r->note[0] ? ": " : "", r->note);
    } else {
        uint64_t deadline = fault_end + (uint64_t)k->recover_ms;
        while (km_wall_ms() < deadline) {
            pthread_mutex_lock(&r->mu);
            uint64_t ready_at = r->ready_at_ms;
            pthread_mutex_unlock(&r->mu);
            uint64_t first = ready_at ? first_done_after(&load, ready_at) : 0;
            if (first) {
                res->recovered = true;
                res->recover_s = (first - r->fault_ms) / 1e3;
                break;
            }
            km_sleep_ms(100);
        }
        if (!res->recovered)
            snprintf(res->error, sizeof res->error,
                     "not recovered within %d s of the fault's end (view all ready: %s)",
                     k->recover_ms / 1000, r->all_ready ? "yes" : "no");
        km_sleep_ms(k->tail_ms);
    }
    load_join(&load, cls);
    format_levels(r, res);
    res->sent = load.sent;
    res->completed = load.completed;
    res->failed = load.failed;
    res->lost = load.lost;
    res->equal = load.equal;
    res->differ = load.differ;
    res->first_differ = load.first_differ;
    res->retries = load.retries;
    res->migrated = load.migrated;
    res->n_errors = load.n_errors;
    memcpy(res->errors, load.first_errors, sizeof res->errors);
    res->outputs_ok = load.differ == 0 || !sc->outputs_must_match;
    if (!res->error[0] && sc->fault == fault_pressure && !res->order_ok)
        snprintf(res->error, sizeof res->error, "recovery levels 1, 2, 3 did not fire in order");
    if (!res->error[0] && sc->fault == fault_pressure) { /* level 3: drained, restarted by up */
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n = read_cluster(r, procs);
        const kvm_cluster_proc *t = kvm_cluster_find(procs, n, CHAOS_TARGET);
        if (!t || t->restarts < 1)
            snprintf(res->error, sizeof res->error,
                     "%s was drained but kvmesh up did not restart it", CHAOS_TARGET);
    }
    res->passed = !res->error[0] && res->lost == 0 && res->outputs_ok && res->recovered;
out:
    cluster_stop(r);
    if (r->netns_made) netns_cleanup();
    for (int i = 0; i < CHAOS_N_PROMPTS; i++) free(ref_out[i]);
    free(ref.done_at);
    free(load.done_at);
    if (res->passed && !keep) {
        const char *rm[] = {"rm", "-rf", r->dir, NULL};
        run_cmd(rm, true);
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
               "%d retries, %d migrated streams\n",
               res->sent, res->completed, res->failed, res->lost, res->retries, res->migrated);
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

int kvm_cli_chaos(int argc, char **argv)
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
        "(b), stop (c), controller (d), router (e), partition (f) or all",
        opts, sizeof opts / sizeof *opts, argc, argv, NULL, NULL, &cfg);
    if (rc == 1)
        for (int i = 0; i < N_SCENARIOS; i++)
            printf("  %-11s (%s) %s\n", scenarios[i].name, scenarios[i].letter, scenarios[i].what);
    if (rc) return rc == 1 ? 0 : 2;
    int nargs = 0;
    char *const *args = km_config_args(cfg, &nargs);
    const char *which = nargs ? args[0] : NULL;
    bool pick[N_SCENARIOS] = {0};
    int n_pick = 0;
    for (int i = 0; which && i < N_SCENARIOS; i++)
        if (!strcmp(which, "all") || !strcmp(which, scenarios[i].name) ||
            !strcmp(which, scenarios[i].letter))
            pick[i] = true, n_pick++;
    if (!n_pick) {
        fprintf(stderr, "kvmesh chaos: give a scenario: pressure, kill, stop, controller, router, "
                        "partition or all (--help)\n");
        km_config_destroy(cfg);
        return 2;
    }
    /* before any other thread exists: SIGINT/SIGTERM go to the signal thread only (a handler is
     * set first, as a signal still ignored when blocked would be dropped) */
    static sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    struct sigaction sa = {.sa_handler = on_signal_noop};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    pthread_t sig_thread;
    pthread_create(&sig_thread, NULL, signal_main, &sigs);
    pthread_detach(sig_thread);
    chaos_knobs k;
    knobs_init(&k, short_run);
    chaos_result *results = calloc(N_SCENARIOS, sizeof *results);
    int status = 0;
    json_t *all = json_array();
    uint64_t t0 = km_now_ns();
    for (int i = 0; i < N_SCENARIOS; i++) {
        if (!pick[i]) continue;
        if (!json_out) {
            printf("== chaos %s%s ...\n", scenarios[i].name, short_run ? " (short)" : "");
            fflush(stdout);
        }
        run_scenario(&scenarios[i], &k, keep, &results[i]);
        if (json_out)
            json_array_append_new(all, result_json(&results[i]));
        else
            print_result(&results[i]);
        if (!results[i].passed) status = 1;
    }
    double secs = (km_now_ns() - t0) / 1e9;
    if (json_out) {
        json_t *o = n_pick == 1 ? json_incref(json_array_get(all, 0))
                                : json_pack("{s:O,s:b,s:f}", "scenarios", all, "passed",
                                            status == 0, "seconds", secs);
        char *s = json_dumps(o, JSON_COMPACT);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(o);
    } else if (n_pick > 1) {
        printf("%-11s %-4s %6s %9s %6s %4s %11s %8s %9s %10s  %s\n", "SCENARIO", "", "SENT",
               "COMPLETED", "FAILED", "LOST", "OUTPUTS_EQ", "FAULT_S", "RECOVER_S", "AFTER_END",
               "RESULT");
        for (int i = 0; i < N_SCENARIOS; i++) {
            const chaos_result *r = &results[i];
            if (!pick[i]) continue;
            char eq[24] = "-", fs[16] = "-", rs[16] = "-", ae[16] = "-";
            if (!r->skipped) snprintf(eq, sizeof eq, "%d/%d", r->equal, r->completed);
            if (!r->skipped) snprintf(fs, sizeof fs, "%.1f", r->fault_s);
            if (r->recovered) snprintf(rs, sizeof rs, "%.1f", r->recover_s);
            if (r->recovered) snprintf(ae, sizeof ae, "%.1f", r->recover_s - r->fault_s);
            const char *verdict = r->skipped ? "SKIP" : r->passed ? "PASS" : "FAIL";
            printf("%-11s (%s) %6d %9d %6d %4d %11s %8s %9s %10s  %s\n", scenarios[i].name,
                   scenarios[i].letter, r->sent, r->completed, r->failed, r->lost, eq, fs, rs, ae,
                   verdict);
        }
        printf("chaos: %s in %.0f s\n", status ? "FAILED" : "all passed", secs);
    }
    json_decref(all);
    free(results);
    km_config_destroy(cfg);
    return status;
}
