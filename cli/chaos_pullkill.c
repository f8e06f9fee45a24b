/*
 * chaos_pullkill.c — (j) SIGKILL the source of a prefix pull while the pull runs, under load
 * (issue 14 point 5). The scenario's workers run transfer nodes (--peer-listen, UCX over TCP)
 * and its router weighs load above prefix affinity and pulls before it has measured a rate (the
 * table's flags), so a request whose prefix one worker holds goes to the other one when the
 * holder is busier, with a hint to pull the prefix (router/pull.c, docs/transfer.md).
 *
 * Each round makes that happen on purpose: a new prompt with a long prefix of its own (~680
 * tokens, 42 pages) is computed once through the router (its greedy output is the round's
 * reference), then a burst of the same prompt is sent at once, without speculative drafts: the
 * first requests land on the holder, which is then busier than the other worker, so a later one
 * goes there with a pull hint. The router's `pull_choice` debug line names the holder the
 * moment it decides; the holder is SIGKILLed right then (rounds 1, 3: the puller is still
 * connecting or waiting for the offer) or once bytes leave it (rounds 2, 4: the puller is
 * reading). The puller must end the pull (the holder's endpoint fails), compute what it is
 * missing and answer; the holder's own streams migrate; `kvmesh up` restarts it. Every request
 * of the bursts must complete with the reference's output, as must the harness's load around it.
 *
 * Why the router's log and not its counter: kvmesh_router_pulls_total says that a pull was
 * chosen, not from whom nor for which prompt; the load's own prompts pull now and then too.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/chaos.h"

#define PK_BURST        8     /* requests of the round's prompt sent at once */
#define PK_TOKENS       32    /* long enough that the burst's requests overlap on the holder */
#define PK_LINES        24    /* lines of the round's long prefix (~28 tokens each: 42 pages) */
#define PK_MIN_PAGES    16    /* a pull of the round's prefix, not of a load prompt (<= 8) */
#define PK_DECIDE_MS    20000 /* longest wait for the router to choose a pull */
#define PK_READ_WAIT_MS 3000  /* longest wait for the holder's first bytes out */
#define PK_OUTCOME_MS   15000 /* longest wait for the puller to end the cut pull */
#define PK_RESTART_MS   60000 /* longest wait for the holder's restart */
#define PK_TIMEOUT_MS   60000 /* a burst request's longest silence (its prefix recomputed) */
#define PK_BYTES_OUT    "kvmesh_kv_transfer_bytes_total{direction=\"out\"}"

/* The round's prompt: a log whose first line names the round, so no two rounds (and none of
 * the load's prompts) share a page, then lines that differ in their numbers. */
static void pk_prompt(char *buf, size_t cap, int round)
{
    static const char *const goods[] = {"apples",     "copper wire",   "printer paper",
                                        "olive oil",  "bicycle tyres", "tea",
                                        "glass jars", "wool"};
    static const char *const days[] = {"Monday", "Tuesday", "Wednesday", "Thursday", "Friday"};
    size_t off = (size_t)snprintf(buf, cap,
                                  "Warehouse journal number %d. Each line records one delivery "
                                  "received at the north site.\n",
                                  100 + round * 37);
    for (int j = 0; j < PK_LINES && off < cap; j++)
        off += (size_t)snprintf(buf + off, cap - off,
                                "Entry %d: %d crates of %s reached dock %d on %s and went to "
                                "aisle %d.\n",
                                j + 1, 3 + (round * 11 + j * 7) % 40, goods[(round + j * 3) % 8],
                                1 + (j * 5 + round) % 6, days[(j + round) % 5],
                                10 + (round * 13 + j * 17) % 50);
    if (off < cap) snprintf(buf + off, cap - off, "Entry %d:", PK_LINES + 1); /* go on */
}

/* The router's next `pull_choice` line in its log at or after *off (complete lines only) for a
 * prefix of at least PK_MIN_PAGES pages (a round's own, not one of the load's short prompts):
 * the puller, the holder, the decision and the two costs it compared (the line as written). */
typedef struct pk_choice {
    char worker[64], holder[64], decision[16], costs[96];
} pk_choice;

static bool pk_next_choice(const char *log, long *off, pk_choice *c)
{
    FILE *f = fopen(log, "r");
    if (!f) return false;
    bool found = false;
    if (fseek(f, *off, SEEK_SET) == 0) {
        char line[2048];
        while (!found && fgets(line, sizeof line, f)) {
            size_t n = strlen(line);
            if (!n || line[n - 1] != '\n') break; /* still being written */
            *off += (long)n;
            if (!strstr(line, "event=pull_choice ")) continue;
            const char *w = strstr(line, " worker="), *h = strstr(line, " holder=");
            const char *d = strstr(line, " decision="), *pg = strstr(line, " pages=");
            const char *slash = pg ? strchr(pg, '/') : NULL, *cost = strstr(line, " pull_ms=");
            if (!w || !h || !d || !slash || atoi(slash + 1) < PK_MIN_PAGES) continue;
            snprintf(c->worker, sizeof c->worker, "%.*s", (int)strcspn(w + 8, " \n"), w + 8);
            snprintf(c->holder, sizeof c->holder, "%.*s", (int)strcspn(h + 8, " \n"), h + 8);
            snprintf(c->decision, sizeof c->decision, "%.*s", (int)strcspn(d + 10, " \n"), d + 10);
            snprintf(c->costs, sizeof c->costs, "%.*s", cost ? (int)strcspn(cost + 1, "\n") : 0,
                     cost ? cost + 1 : "");
            found = true;
        }
    }
    fclose(f);
    return found;
}

static long pk_file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : 0;
}

/* A puller's counters: pulls by outcome, pulls the holder never offered for, pages dropped
 * because their read failed. */
enum { PK_OK, PK_PARTIAL, PK_FAILED, PK_NO_OFFER, PK_DROPPED, PK_N };

static bool pk_pulls(chaos_run *r, const char *id, double out[PK_N])
{
    static const char *const series[PK_N] = {
        "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}",
        "kvmesh_kv_transfer_pulls_total{outcome=\"partial\"}",
        "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}",
        "kvmesh_kv_transfer_failures_total{reason=\"no_offer\"}",
        "kvmesh_kv_transfer_failures_total{reason=\"transfer\"}",
    };
    for (int i = 0; i < PK_N; i++)
        if ((out[i] = chaos_metric(r, id, series[i])) < 0) return false;
    return true;
}

typedef struct pk_tally {
    int rounds, chosen, sent, completed, failed, lost, differ;
    int no_offer, dropped; /* the cut pulls: never offered; pages whose read failed */
    char first_error[200];
    char rounds_note[1024];
} pk_tally;

/* The round's reference: its prompt once through the router, no fault. */
static int pk_reference(chaos_run *r, const char *prompt, char **text, size_t *len, char *served_by,
                        size_t cap, const char *worker)
{
    kvm_client *c = NULL;
    km_errbuf err = {{0}};
    kvm_opts o = {.timeout_ms = PK_TIMEOUT_MS * r->k.slow, .sec = {.cert = r->client_cert}};
    kvm_result res = {0};
    char ep[128], router_cert[160];
    if (worker) { /* straight to that worker, with the router's key (a worker serves members) */
        chaos_proc_field(r, worker, "requests", ep, sizeof ep);
        snprintf(router_cert, sizeof router_cert, "%s/keys/private/router.key", r->dir);
        o.sec = (kvm_sec){.cert = router_cert, .server = worker};
    }
    int rc = kvm_open(worker ? ep : r->router, &o, &c, &err);
    if (!rc) {
        km_msg_request q;
        kvm_request_init(&q);
        q.prompt = prompt;
        q.temperature = 0;
        q.max_tokens = PK_TOKENS;
        q.stream = true;
        q.speculate = KM_SPECULATE_OFF; /* as the burst below */
        rc = kvm_generate(c, &q, NULL, NULL, &res, &err);
    }
    if (!rc && !res.error_code && res.n_tokens < PK_TOKENS / 2) {
        snprintf(r->problem, sizeof r->problem,
                 "the long-prefix prompt gave only %u tokens (finish %d): too little to compare",
                 res.n_tokens, (int)res.finish);
        rc = -1;
    } else if (!rc && !res.error_code) {
        *text = malloc(res.text.len + 1);
        if (*text) memcpy(*text, res.text.data ? (char *)res.text.data : "", res.text.len);
        *len = res.text.len;
        snprintf(served_by, cap, "%s", res.worker);
    } else {
        snprintf(r->problem, sizeof r->problem,
                 "the long-prefix prompt failed before any kill: %d %.200s %.200s", res.error_code,
                 res.error, err.msg);
        rc = rc ? rc : -1;
    }
    kvm_result_free(&res);
    kvm_close(c);
    return rc;
}

int chaos_long_prompt(chaos_run *r, int round, const char *worker, char *served_by, size_t cap)
{
    char prompt[4096], *text = NULL;
    size_t len = 0;
    pk_prompt(prompt, sizeof prompt, round);
    int rc = pk_reference(r, prompt, &text, &len, served_by, cap, worker);
    free(text);
    return rc;
}

/* One round: reference, burst, kill the first pull's source (when do_kill; netfault lets the pull
 * run through its faulty link), wait for the puller's outcome and the holder's restart, then the
 * burst's end. 0, or -1 when the cluster did not come back. */
static int pk_round(chaos_run *r, int round, bool do_kill, pk_tally *t)
{
    char prompt[4096], holder_ref[KM_PROTO_MAX_NAME + 1] = "";
    pk_prompt(prompt, sizeof prompt, round);
    char *ref_text = NULL;
    size_t ref_len = 0;
    if (pk_reference(r, prompt, &ref_text, &ref_len, holder_ref, sizeof holder_ref, NULL))
        return -1;
    char log[160];
    snprintf(log, sizeof log, "%s/logs/router.log", r->dir);
    long off = pk_file_size(log);
    double before[CHAOS_WORKERS][PK_N] = {{0}};
    const char *ids[CHAOS_WORKERS] = {"w0", "w1"};
    for (int i = 0; i < CHAOS_WORKERS; i++) pk_pulls(r, ids[i], before[i]);

    /* the burst: PK_BURST clients, one request each, compared with the reference */
    chaos_knobs bk = r->k;
    bk.clients = PK_BURST;
    bk.timeout_ms = PK_TIMEOUT_MS * r->k.slow;
    bk.max_tokens = PK_TOKENS;
    bk.attempts = 4; /* each ends within attempts x PK_TIMEOUT_MS */
    const char *prompts[1] = {prompt};
    char *refs[1] = {ref_text};
    size_t ref_lens[1] = {ref_len};
    chaos_load b = {.endpoint = r->router,
                    .sec = {.cert = r->client_cert},
                    .k = &bk,
                    .prompts = prompts,
                    .n_prompts = 1,
                    .ref = refs,
                    .ref_len = ref_lens,
                    .per_client = 1,
                    /* no drafts: each request of the burst decodes token by token, so they
                     * pile up on the holder instead of finishing in a few drafted steps */
                    .speculate = KM_SPECULATE_OFF};
    pthread_mutex_init(&b.mu, NULL);
    chaos_client cls[PK_BURST];
    chaos_load_start(&b, cls);

    /* the router's first decision on the round's prefix: a pull (kill its source), or a
     * recompute (the other worker now computes the prefix: no pull of it will follow) */
    pk_choice ch = {0};
    bool decided = false;
    for (uint64_t until = km_wall_ms() + PK_DECIDE_MS; !decided && km_wall_ms() < until;)
        if (!(decided = pk_next_choice(log, &off, &ch))) km_sleep_ms(10);
    bool chosen = decided && !strcmp(ch.decision, "pull");
    const char *puller = ch.worker, *holder = ch.holder;
    int rc = 0;
    char what[400];
    if (chosen) {
        /* rounds 1, 3: the kill follows the decision at once, when the holder has rarely
         * offered yet (the puller connects, asks, waits); rounds 2, 4 wait until bytes leave
         * the holder (its bytes out grow), so the kill lands while the puller reads */
        uint64_t t_chosen = km_wall_ms();
        bool reading = false, at_once = t->chosen % 2 == 0;
        if (do_kill && !at_once) {
            double out0 = chaos_metric(r, holder, PK_BYTES_OUT);
            for (uint64_t until = t_chosen + PK_READ_WAIT_MS; !reading && km_wall_ms() < until;)
                if (!(reading = out0 >= 0 && chaos_metric(r, holder, PK_BYTES_OUT) > out0))
                    km_sleep_ms(2);
        }
        int delay = (int)(km_wall_ms() - t_chosen);
        int pid = chaos_proc_pid(r, holder);
        if (do_kill && (pid <= 0 || kill(pid, SIGKILL))) {
            snprintf(r->problem, sizeof r->problem, "round %d: no pid for the pull's source %s",
                     round + 1, holder);
            rc = -1;
        } else {
            t->chosen++;
            r->counts.kills += do_kill;
            r->counts.pull_rounds++;
            /* the puller's pull ends (the holder's endpoint fails, or its budget passes) */
            int pi = !strcmp(puller, "w0") ? 0 : 1;
            double after[PK_N] = {0};
            double seen = before[pi][PK_OK] + before[pi][PK_PARTIAL] + before[pi][PK_FAILED];
            bool ended = false;
            for (uint64_t until = km_wall_ms() + PK_OUTCOME_MS; !ended && km_wall_ms() < until;)
                if (!(ended = pk_pulls(r, puller, after) &&
                              after[PK_OK] + after[PK_PARTIAL] + after[PK_FAILED] > seen))
                    km_sleep_ms(50);
            int d[PK_N] = {0};
            for (int i = 0; ended && i < PK_N; i++) d[i] = (int)(after[i] - before[pi][i]);
            r->counts.pulls_ok += d[PK_OK];
            r->counts.pulls_partial += d[PK_PARTIAL];
            r->counts.pulls_failed += d[PK_FAILED];
            t->no_offer += d[PK_NO_OFFER];
            t->dropped += d[PK_DROPPED];
            snprintf(what, sizeof what,
                     "%s<-%s, %s +%d ms%s: pulls ok %d, partial %d, failed %d (never offered "
                     "%d, pages whose read failed %d)%s",
                     puller, holder, do_kill ? "kill" : "no kill, chosen", delay,
                     !do_kill || at_once ? ""
                     : reading           ? " as bytes left"
                                         : " (no bytes seen leaving)",
                     d[PK_OK], d[PK_PARTIAL], d[PK_FAILED], d[PK_NO_OFFER], d[PK_DROPPED],
                     ended ? "" : " (no outcome yet)");
            if (do_kill && !chaos_wait_restarted(r, holder, pid, PK_RESTART_MS)) {
                snprintf(r->problem, sizeof r->problem, "round %d: %.480s", round + 1, r->note);
                rc = -1;
            }
        }
    } else if (decided) {
        snprintf(what, sizeof what, "%s chose %s for %s (%s), nothing killed", "the router",
                 ch.decision, ch.worker, ch.costs);
    } else {
        snprintf(what, sizeof what, "no decision within %d s (reference on %s), nothing killed",
                 PK_DECIDE_MS / 1000, holder_ref[0] ? holder_ref : "?");
    }
    chaos_load_join(&b, cls);
    t->rounds++;
    t->sent += b.sent;
    t->completed += b.completed;
    t->failed += b.failed;
    t->lost += b.lost;
    t->differ += b.differ;
    if (!t->first_error[0] && b.n_errors)
        snprintf(t->first_error, sizeof t->first_error, "%s", b.first_errors[0]);
    size_t n = strlen(t->rounds_note);
    snprintf(t->rounds_note + n, sizeof t->rounds_note - n, "%s%d: %s", n ? "; " : "", round + 1,
             what);
    free(b.done_at);
    pthread_mutex_destroy(&b.mu);
    free(ref_text);
    return rc;
}

int chaos_fault_pullkill(chaos_run *r)
{
    return chaos_pull_rounds(r, r->k.short_run ? 2 : 4, 0, true);
}

int chaos_pull_rounds(chaos_run *r, int rounds, int first, bool do_kill)
{
    /* rounds with a pull wanted; a round whose pull the router did not choose (measured
     * figures said recompute, or no decision in time) is tried again with a new prefix, up to
     * twice as many rounds in all */
    pk_tally t = {0};
    r->counts.set = r->counts.pulls = true;
    double mig0 = chaos_metric(r, "router", "kvmesh_router_migrations_total");
    int rc = 0;
    for (int i = 0; i < 2 * rounds && t.chosen < rounds && !rc; i++)
        rc = pk_round(r, first + i, do_kill, &t);
    double mig1 = chaos_metric(r, "router", "kvmesh_router_migrations_total");
    r->counts.migrations = mig0 >= 0 && mig1 >= 0 ? (int)(mig1 - mig0) : -1;
    double d[3];
    static const char *const dec[3] = {"pull", "recompute", "unmeasured"};
    for (int i = 0; i < 3; i++) {
        char series[96];
        snprintf(series, sizeof series, "kvmesh_router_pulls_total{decision=\"%s\"}", dec[i]);
        d[i] = chaos_metric(r, "router", series);
    }
    r->counts.pulls_chosen = (int)d[0];
    size_t nn = strlen(r->note);
    snprintf(r->note + nn, sizeof r->note - nn,
             "rounds %.1024s; killed before the offer %d, pages whose read was cut %d; bursts: "
             "sent %d, completed %d, failed %d, lost %d, %d outputs differ; the router chose "
             "pull %.0f, recompute %.0f, unmeasured %.0f times; %d migrations",
             t.rounds_note, t.no_offer, t.dropped, t.sent, t.completed, t.failed, t.lost, t.differ,
             d[0], d[1], d[2], r->counts.migrations);
    if (rc) return 0; /* r->problem says what went wrong; the load still ends and is checked */
    if (!t.chosen)
        snprintf(r->problem, sizeof r->problem,
                 "the router chose no pull of a round's prefix in %d rounds: no pull %s "
                 "(kvmesh_router_pulls_total: pull %.0f, recompute %.0f, unmeasured "
                 "%.0f)",
                 t.rounds, do_kill ? "was cut by a kill" : "ran under the fault", d[0], d[1], d[2]);
    else if (t.failed || t.lost || t.differ || t.completed != t.sent)
        snprintf(r->problem, sizeof r->problem,
                 "the long-prefix bursts: %d of %d completed, %d failed, %d lost, %d outputs "
                 "differ from the round's reference (first error: %.200s)",
                 t.completed, t.sent, t.failed, t.lost, t.differ,
                 t.first_error[0] ? t.first_error : "-");
    return 0;
}
