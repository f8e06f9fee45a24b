/*
 * chaos.h — private to `kvmesh chaos` (cli/chaos*.c): the run of one scenario against its own
 * local cluster, shared by the command (chaos.c), the cluster it starts and the signal thread
 * (chaos_cluster.c), the controller-view monitor (chaos_monitor.c), the client load
 * (chaos_load.c) and the faults with their table (chaos_faults.c).
 */
#ifndef KVMESH_CLI_CHAOS_H
#define KVMESH_CLI_CHAOS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "client/kvmesh.h"

#define CHAOS_WORKERS 2
#define CHAOS_TARGET  "w1" /* the worker every worker fault hits */
#define CHAOS_MAX_ACT 256  /* recovery actions remembered per run */

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
    int slow;        /* kn_ops_slowdown of the workers' kernels (they inherit KVMESH_ISA):
                      * client silences and recovery waits are multiplied by it */
    const char *ctl; /* controller policy flags */
    const char *wflags;
    const char *rflags; /* router flags */
} chaos_knobs;

/* ---------------------------------------------------------------- the cluster under test */

typedef enum chaos_recover_when {
    RECOVER_AFTER_DEGRADED, /* the view showed a member not ready, then all ready again */
    RECOVER_ALL_READY,      /* the view is all ready after the fault ended */
    RECOVER_NEW_EPOCH,      /* a view from a new controller process, all ready */
    RECOVER_COMPLETION,     /* the view is not involved: a request completes */
} chaos_recover_when;

typedef struct chaos_run chaos_run;

/* What the repeated-kill scenarios count (reported, and in --json, when a scenario sets them). */
typedef struct chaos_counts {
    int kills;        /* SIGKILLs sent */
    int kills_busy;   /* ... to a worker the router had requests at */
    int migrations;   /* the router's kvmesh_router_migrations_total over the faulted pass */
    int pull_rounds;  /* pullkill: rounds in which the router chose a pull before the kill */
    int pulls_chosen; /* the router's kvmesh_router_pulls_total{decision="pull"}, whole run */
    int pulls_ok, pulls_partial, pulls_failed; /* the pullers' outcomes of the cut pulls */
    bool set, pulls; /* set: counted; pulls: the pull fields apply (kills_busy does not) */
} chaos_counts;

/* One row of the scenario table: the fault and what recovery means after it. */
typedef struct chaos_scenario {
    const char *name, *letter, *what;
    int (*fault)(chaos_run *r); /* injects the fault; returns when it has ended (0) or failed */
    chaos_recover_when recover_when;
    bool outputs_must_match; /* false where the fault may change outputs (fp8 KV) */
    bool needs_netns;
    bool drains_target; /* levels 1, 2, 3 must fire in order, and up must restart the target */
    bool no_failures;   /* failed must be 0 too (no request may even be told why it failed) */
    bool peer_split;    /* transfer nodes on each side of the namespace's veth (netfault) */
    /* 0: the scenario can run here; 1: skip it (r->note says why); before the cluster starts */
    int (*precheck)(chaos_run *r);
    const char *wflags; /* extra worker flags for this scenario (short run, full run) */
    const char *wflags_full;
    const char *wflags_for; /* extra `--worker-args-for` entries (ID:ARGS;...), or NULL */
    const char *rflags;     /* extra router flags for this scenario */
    const char *env;        /* NAME=VALUE set while this scenario's cluster runs, or NULL */
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
    /* `kvmesh up` made the cluster's keys in dir/keys: the operator key for admin calls, the
     * client key for the load */
    char op_cert[128], client_cert[128];
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
    char note[1536];   /* what the fault function saw, for the report */
    char problem[512]; /* a promise the fault function itself checks was broken (it still ended) */
    chaos_counts counts;
};

/* ---------------------------------------------------------------- load (chaos_load.c) */

typedef struct chaos_load {
    const char *endpoint;
    kvm_sec sec; /* the client key of the cluster under test */
    const chaos_knobs *k;
    const char *const *prompts;
    int n_prompts;
    bool reference; /* the fault-free pass: each prompt once, outputs recorded */
    char **ref;     /* reference outputs, by prompt */
    size_t *ref_len;
    atomic_bool stop;
    pthread_mutex_t mu;
    int per_client;         /* > 0: each client sends this many requests, then stops */
    km_speculate speculate; /* what the requests ask for (0: the worker's default) */
    int sent, completed, failed, lost, equal, differ, retries, migrated;
    int migrations;    /* sum of done.migrations over the completed requests */
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

/* The prompts every client cycles through (chaos_load.c; the size makes a mismatch a type error).
 */
#define CHAOS_N_PROMPTS 10
extern const char *const chaos_prompts[CHAOS_N_PROMPTS];

/* Starts l->k->clients threads on cls[]; chaos_load_join stops and joins them. */
void chaos_load_start(chaos_load *l, chaos_client *cls);
void chaos_load_join(chaos_load *l, chaos_client *cls);
/* The first completion at or after t (wall ms), or 0. */
uint64_t chaos_first_done_after(chaos_load *l, uint64_t t);

/* ---------------------------------------------------------------- cluster (chaos_cluster.c) */

/* SIGINT/SIGTERM go to a thread of their own from now on (call before any other thread). */
void chaos_signals_start(void);
/* Runs argv to its end (stdout/stderr to /dev/null when quiet); its exit status. */
int chaos_run_cmd(const char *const *argv, bool quiet);
/* `kvmesh up` in r->dir on free ports, every process running and the view all ready: 0. */
int chaos_cluster_start(chaos_run *r);
/* Stops up (and anything it started), and the view monitor. */
void chaos_cluster_stop(chaos_run *r);
/* The network namespace of the partition scenario: 0 made, 1 not permitted here, -1 failed. */
int chaos_netns_setup(chaos_run *r);
void chaos_netns_cleanup(void);
/* From up's cluster.env: the processes (their number), one's pid, one's endpoint field. */
int chaos_read_cluster(chaos_run *r, kvm_cluster_proc *procs);
int chaos_proc_pid(chaos_run *r, const char *id);
const char *chaos_proc_field(chaos_run *r, const char *id, const char *field, char *buf,
                             size_t cap);
/* Waits until process id runs with a pid other than old (0: any); returns the pid or 0. */
int chaos_wait_new_pid(chaos_run *r, const char *id, int old, int timeout_ms);
/* Waits until a worker's own /readyz says 200. */
bool chaos_wait_worker_ready(chaos_run *r, const char *id, int timeout_ms);
/* Waits until `up` has restarted worker id (a pid other than old), it answers /readyz, the view
 * is all ready and the router is connected to it again: true, or false when timeout_ms passed
 * first (r->note says which step). */
bool chaos_wait_restarted(chaos_run *r, const char *id, int old, int timeout_ms);
/* One series of a process's /metrics (the admin port; the router's HTTP port), exactly as
 * written there with its labels (`kvmesh_router_pulls_total{decision="pull"}`): its value, or -1
 * when the process did not answer or has no such series. */
double chaos_metric(chaos_run *r, const char *id, const char *series);

/* ---------------------------------------------------------------- view monitor (chaos_monitor.c)
 */

/* The thread that follows the controller's view (started by chaos_cluster_start). */
void *chaos_monitor_main(void *arg);
/* The recovery levels that fired on worker (any when NULL) since `since`, oldest first. */
int chaos_actions_since(chaos_run *r, uint64_t since, const char *worker, chaos_action *out,
                        int max);
/* Waits until worker has had an action of `level` since `since` (true) or timeout_ms passed. */
bool chaos_wait_level(chaos_run *r, const char *worker, uint32_t level, uint64_t since,
                      int timeout_ms);

/* ---------------------------------------------------------------- results */

typedef struct chaos_result {
    const chaos_scenario *sc;
    bool skipped, passed, recovered, outputs_ok, order_ok;
    char skip_reason[256], error[512];
    int sent, completed, failed, lost, equal, differ, retries, migrated, migrations;
    int ref_sent, first_differ;
    chaos_counts counts;
    double recover_s, fault_s;
    char levels[512], states[512];
    char errors[4][200];
    int n_errors;
    char fault_note[1536]; /* what an injected fault saw (r->note), when it says something */
    char dir[64];
} chaos_result;

/* Fills res->levels, res->states and res->order_ok from what the monitor saw since the fault. */
void chaos_format_levels(chaos_run *r, chaos_result *res);

/* ---------------------------------------------------------------- chaos_scenarios (chaos_faults.c)
 */

#define CHAOS_N_SCENARIOS 13
extern const chaos_scenario chaos_scenarios[CHAOS_N_SCENARIOS];

/* (g) slow HTTP clients against the router's and the workers' ports (chaos_slowloris.c). */
int chaos_fault_slowloris(chaos_run *r);
/* (j) SIGKILL the source of a prefix pull while it runs (chaos_pullkill.c). */
int chaos_fault_pullkill(chaos_run *r);
/* Rounds of chaos_pullkill.c from round `first` on, until `rounds` pulls were chosen (twice as
 * many rounds at most): each a new long prefix, a burst of it, the router's pull of it, its
 * source SIGKILLed when do_kill; r->note and r->counts say what the pulls did. */
int chaos_pull_rounds(chaos_run *r, int rounds, int first, bool do_kill);
/* Round `round`'s long prompt once (greedy) through the router, or straight to `worker` when not
 * NULL: 0, and which worker served it. */
int chaos_long_prompt(chaos_run *r, int round, const char *worker, char *served_by, size_t cap);
/* (k) pulls and a drain handoff across a slow, lossy, reordering veth (chaos_netfault.c). */
int chaos_fault_netfault(chaos_run *r);
int chaos_precheck_netfault(chaos_run *r);
/* (l) SIGKILL a worker while its drain hands its pages to its peer (chaos_netfault.c). */
int chaos_fault_drainkill(chaos_run *r);
/* (m) SIGKILL a prefill worker mid-prompt, then a decode worker mid-stream (chaos_pdkill.c). */
int chaos_fault_pdkill(chaos_run *r);
/* A process to SIGTERM when the namespace goes (the netfault's packet delayer), or 0. */
void chaos_netns_helper(pid_t pid);

#endif /* KVMESH_CLI_CHAOS_H */
