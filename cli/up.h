/*
 * up.h — private to `kvmesh up` (cli/up*.c): the process table of a local cluster. up.c is the
 * command (options, directories, the run), up_plan.c decides every process's ports, endpoints and
 * argv, up_procs.c supervises them on a libuv loop and keeps <run-dir>/cluster.env, up_scale.c
 * adds and removes workers at run time (`kvmesh scale`, cli/scale.c).
 */
#ifndef KVMESH_CLI_UP_H
#define KVMESH_CLI_UP_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "client/kvmesh.h"

#define UP_MAX 72

typedef struct up_proc {
    char name[32]; /* the id: controller, w0.., router, router1.. */
    const char *role;
    char **argv;
    int argc;
    uv_process_t proc;
    bool running, closing;
    bool retired; /* removed by `kvmesh scale`: drained, not restarted, then off cluster.env */
    int restarts, pid;
    uint64_t started_ms;
    uv_timer_t backoff;
    int log_fd;
    char requests[128], events[128], admin[128], listen[128], view[128], http[128];
    char peer[128]; /* a worker's UCX listener, HOST:PORT; "" = none (--no-peer) */
    struct up_state *st;
} up_proc;

typedef struct up_state {
    uv_loop_t *loop;
    up_proc p[UP_MAX];
    int n;
    bool stopping;
    int running;
    uv_signal_t sigint, sigterm;
    uv_timer_t kill_timer;
    int64_t stop_ms;         /* Ctrl-C: SIGKILL what still runs after this (the drain + 5 s) */
    char state_path[4200];   /* <run-dir>/cluster.env; "" = none */
    uv_timer_t ready_timer;  /* polls /readyz until every worker and router answers 200 */
    char ready_msg[8192];    /* printed once then; "" = no poll */
    const struct up_opts *o; /* what workers added at run time are planned from */
    const char *bin_dir;
    uv_signal_t sigscale; /* `kvmesh scale` asks through <run-dir>/scale (up_scale.c) */
} up_state;

/* --netns ID=NETNS,WORKER_ADDR,HOST_ADDR: worker ID runs inside network namespace NETNS (made by
 * the caller: `kvmesh chaos partition`, `netfault`), bound to WORKER_ADDR; the controller then
 * listens and publishes its view on HOST_ADDR (the host end of the namespace's veth pair), and
 * the other workers bind it too, so that every worker reaches the controller and its peers. */
typedef struct up_netns {
    char worker[64], ns[64], worker_addr[64], host_addr[64];
} up_netns;

/* The command's options (up.c has the table with their defaults and help). */
typedef struct up_opts {
    int64_t n_workers, n_routers, base_port, threads, http_port, cluster_seed, front_port;
    int64_t ctl_port, ctl_admin_port;
    int64_t n_prefill, n_decode; /* workers w0.. run --role=prefill, the next n_decode decode */
    bool with_controller;
    bool insecure;       /* --insecure: no keys, daemons run without CURVE */
    const char *keydir;  /* <run-dir>/keys (made by `kvmesh up`) unless insecure */
    char api_keys[4300]; /* keydir/api_keys: the routers' --api-keys; "" when insecure */
    const char *model, *bin_dir, *log_dir, *mode, *kv_bytes;
    const char *worker_args, *worker_args_for, *router_args;
    const char *ctl_args, *run_dir, *netns_spec;
    bool has_ns; /* netns_spec parsed into ns */
    up_netns ns;
} up_opts;

/* up_plan.c: parses --netns (0 none, 1 parsed, -1 malformed). */
int up_parse_netns(const char *spec, up_netns *out);
/* up_plan.c: fills st->p[] for the controller (first, so that workers' first heartbeats find
 * it), the workers, then the routers (which need the workers' endpoints), daemons from bin_dir;
 * 0, or nonzero after saying on stderr why the cluster cannot start. */
int up_plan(up_state *st, const up_opts *o, const char *bin_dir);

/* up_plan.c: appends worker wi (w<wi>) to st->p, planned as up_plan plans it (st->o,
 * st->bin_dir); not started. 0, or nonzero after saying on stderr why not. */
int up_plan_worker(up_state *st, int wi);

/* up_scale.c: writes <run-dir>/up.pid and takes SIGUSR1: `kvmesh scale` wrote <run-dir>/scale. */
void up_scale_start(up_state *st);
/* up_scale.c: removes <run-dir>/up.pid (the cluster is stopping). */
void up_scale_stop(up_state *st);

/* up_procs.c: starts (or restarts) one process of the table. */
void up_start(up_proc *p);
/* up_procs.c: takes SIGINT/SIGTERM on st->loop and starts every process of the plan. */
void up_start_all(up_state *st);
/* up_procs.c: runs the loop until a signal has stopped every process. */
void up_wait(up_state *st);
/* up_procs.c: closes what up_plan and up_run opened (after a setup failure too). */
void up_cleanup(up_state *st);
/* up_procs.c: rewrites <run-dir>/cluster.env (client/kvmesh.h), atomically. */
void up_write_state(up_state *st);

#endif /* KVMESH_CLI_UP_H */
