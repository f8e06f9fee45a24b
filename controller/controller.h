/*
 * controller.h — kvmesh-controller: membership, health and the three-level recovery of a kvmesh
 * cluster (DESIGN.md "Recovery (controller)"). Workers send it heartbeats; it publishes the
 * cluster view that routers follow and sends workers recovery commands when their memory runs
 * out, they stall or they fail in bursts, and moves workers between the prefill and decode
 * pools as the load asks (roles.c, docs/disaggregation.md "Roles follow the load"). Operation
 * and the policy in words: docs/controller.md.
 *
 * Contract:
 *  - The controller keeps no state that heartbeats cannot rebuild. Everything it knows about a
 *    member comes from that member's heartbeats (a worker whose KV format is fp8 is at level 2, a
 *    draining worker is draining); a restarted controller publishes an equivalent view after one
 *    heartbeat interval. What is lost on a restart is the recovery history and the timers.
 *  - The policy (policy.c) is a pure state machine: no sockets, no clock of its own (every call
 *    takes now_ms, a monotonic millisecond clock), no allocation after create. Its output is the
 *    action to send and the member's new state; the daemon (controller.c) sends the action and
 *    reports back (ctl_policy_ack, ctl_policy_send_failed). Unit-tested with a fake clock
 *    (tests/unit/test_controller.c).
 *  - Every action is recorded the same way whoever caused it (thresholds or an operator's
 *    `recover`): one history entry per member (last KM_PROTO_MAX_HISTORY kept), one log line
 *    `event=recovery worker=W level=N reason=R pressure=P`, one kvmesh_recovery_actions_total
 *    increment.
 *  - Nothing aborts or exits on outside input: a malformed frame gets an error reply and a
 *    counter; a worker that cannot be reached costs a log line and a counter, and the member
 *    stays as it was.
 *  - One thread: the daemon polls its sockets and timers in ctl_controller_run; ctl_controller_stop
 *    is the only call safe from another thread or a signal handler.
 *
 * Naming: everything exported here is ctl_.
 */
#ifndef CTL_CONTROLLER_H
#define CTL_CONTROLLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/km.h"
#include "common/svc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- policy (policy.c) */

typedef struct ctl_policy_cfg {
    double pressure_high;       /* level 1 at or above this; default 0.90 */
    double pressure_low;        /* revert / calm at or below this; default 0.70 */
    int64_t cooldown_ms;        /* between level 1 -> 2 -> 3; default 5000 */
    uint32_t l1_repeat;         /* level 1 fired this often within l1_window_ms -> level 2; 3 */
    int64_t l1_window_ms;       /* default 60000 */
    int64_t revert_after_ms;    /* level 2 reverted after pressure stayed low this long; 30000 */
    int64_t stall_timeout_ms;   /* busy with tokens_total unchanged this long -> level 3; 15000 */
    double error_storm;         /* errors rising faster than this per second -> level 3; 50 */
    uint64_t max_rss;           /* bytes; RSS at or above -> level 3 (and pressure counts RSS/max);
                                 * 0 = off */
    uint64_t max_gpu;           /* bytes of GPU memory; the same as max_rss for heartbeats'
                                 * gpu_bytes; 0 = off */
    int64_t heartbeat_ms;       /* the workers' heartbeat interval; default 1000 */
    uint32_t dead_after;        /* missed intervals before "dead"; default 3 */
    int64_t restart_timeout_ms; /* a member restarting (level 3) and silent this long is dead;
                                 * default 120000, 0 = never */
    int64_t forget_after_ms;    /* a member silent this long is removed (dead or left); default
                                 * 600000, 0 = never */
    int64_t action_timeout_ms;  /* a worker busy with an unacknowledged command (an fp8 conversion
                                 * of a large cache) is silent this long before "dead"; 30000 */
    double evict_fraction;      /* level 1's evict fraction; default 0.25 */
    bool recovery;              /* false: observe and publish only (forced levels still work) */
} ctl_policy_cfg;

void ctl_policy_cfg_default(ctl_policy_cfg *c);

/* One command the daemon must send to a worker (an `admin` frame with this id). */
typedef struct ctl_action {
    char worker[KM_PROTO_MAX_NAME + 1];
    uint64_t id;        /* the admin frame's id: the worker's admin_reply echoes it */
    uint32_t level;     /* 1..3; 0 = level 2 reverted */
    const char *reason; /* static: "kv_pressure", "rss", "l1_repeat", "stall", "errors",
                         * "low_pressure", "operator" */
    double pressure;    /* the member's pressure when it was decided */
    km_admin_cmd cmd;   /* KM_ADMIN_EVICT, KM_ADMIN_SET_KV_FORMAT or KM_ADMIN_DRAIN */
    double fraction;    /* evict */
    const char *format; /* set_kv_format: "fp8" or "f16" */
} ctl_action;

typedef struct ctl_policy ctl_policy;

/* max_members: members tracked at most (KM_PROTO_MAX_VIEW_WORKERS when 0). */
int ctl_policy_create(const ctl_policy_cfg *cfg, int max_members, ctl_policy **out);
void ctl_policy_destroy(ctl_policy *p);

/* Feeds one decoded heartbeat received at now_ms (adds the member on its first one). Returns 1
 * and fills *act when an action must be sent, 0 when not, KM_ENOSPC when the member table is
 * full, KM_EINVAL on a heartbeat without a worker id. */
int ctl_policy_heartbeat(ctl_policy *p, const km_msg_heartbeat *hb, uint64_t now_ms,
                         ctl_action *act);
/* An operator's forced level (1..3) on worker: bypasses thresholds, cooldowns and the recovery
 * switch, recorded like any other action with reason "operator". 0 and *act filled;
 * KM_ENOTFOUND for an unknown worker, KM_EINVAL for a level outside 1..3. */
int ctl_policy_force(ctl_policy *p, const char *worker, uint32_t level, uint64_t now_ms,
                     ctl_action *act);
/* The worker answered action `id`: ok marks the history entry acknowledged; !ok undoes the
 * member's change as ctl_policy_send_failed does. KM_ENOTFOUND when no such action is known. */
int ctl_policy_ack(ctl_policy *p, const char *worker, uint64_t id, bool ok);
/* The action could not be sent: the member goes back to its state and level before it (the
 * history entry stays, not ok; the cooldown still runs so that a retry waits). */
void ctl_policy_send_failed(ctl_policy *p, const ctl_action *act);
/* Missed heartbeats: members silent for dead_after intervals become "dead" (not one that "left":
 * its last heartbeat said stopping); dead or left members silent for forget_after are removed
 * (the view stops naming them, so routers free their slots; a heartbeat adds them again as new
 * members). Member indexes after a removed one move down. Returns how many members changed or
 * were removed. */
int ctl_policy_tick(ctl_policy *p, uint64_t now_ms);

/* Grows whenever a member is added or changes state, level or history (views publish on it). */
uint64_t ctl_policy_version(const ctl_policy *p);
int ctl_policy_n_members(const ctl_policy *p);
int ctl_policy_find(const ctl_policy *p, const char *worker); /* index, or KM_ENOTFOUND */
int ctl_policy_count(const ctl_policy *p, km_member_state s); /* members in state s */
/* Member i as a view entry. Strings and the history point into the policy (valid until its next
 * call); hist (KM_PROTO_MAX_HISTORY entries) receives the history when with_history, with at_ms
 * turned into Unix ms by wall_now_ms (the Unix time that corresponds to now_ms). */
int ctl_policy_view_worker(const ctl_policy *p, int i, uint64_t now_ms, uint64_t wall_now_ms,
                           bool with_history, km_view_worker *out,
                           km_recovery_action hist[KM_PROTO_MAX_HISTORY]);

/* Hot-tier pinned bytes / hot-tier budget summed over shards (cached pages nobody uses do not
 * count: they are reclaimable), RSS / max_rss and GPU bytes / max_gpu when those are set: the
 * largest, with *why (when not NULL) naming it: "kv_pressure", "rss" or "gpu". */
double ctl_pressure(const km_msg_heartbeat *hb, uint64_t max_rss, uint64_t max_gpu,
                    const char **why);

/* ---------------------------------------------------------------- roles (roles.c) */

/* Roles follow the load (docs/disaggregation.md, "Roles follow the load"): a state machine like
 * the policy (pure, clock injected, no allocation after create) that moves one worker at a time
 * between the prefill and decode pools when one pool misses its targets for window_ms and the
 * other has room; a worker keeps a role at least hold_ms and a pool never gives its last worker.
 * Workers with role both are not in either pool and never moved. */
typedef struct ctl_roles_cfg {
    bool on;                   /* false: roles change only by an operator; default true */
    int64_t ttft_target_ms;    /* a busy prefill worker's TTFT p90 above: prefill misses; 10000,
                                * 0 = off */
    int64_t itl_target_ms;     /* a busy decode worker's time per output token p90 above: decode
                                * misses; 250, 0 = off */
    double queue_target;       /* requests per worker of a pool above: it misses (prefill:
                                * running + queued, decode: queued); default 4 */
    int64_t window_ms;         /* a miss (or calm) lasts this long before a move; 30000 */
    int64_t hold_ms;           /* a worker keeps a role at least this long; 120000 */
    int64_t change_timeout_ms; /* a set_role its heartbeats do not show after this is given
                                * up; 10000 */
} ctl_roles_cfg;

void ctl_roles_cfg_default(ctl_roles_cfg *c);

/* One member as roles.c sees it (ctl_policy_role_load). */
typedef struct ctl_role_load {
    const char *worker;
    bool ready;          /* state ready: only ready members count and move */
    km_worker_role role; /* its heartbeat's */
    uint32_t running, queue_depth;
    double ttft_ms, itl_ms; /* p90 of its heartbeat's latency (time per output token); 0 unknown */
} ctl_role_load;

/* One role change the daemon must send (admin set_role with this id), and why. */
typedef struct ctl_role_change {
    char worker[KM_PROTO_MAX_NAME + 1];
    uint64_t id; /* the admin frame's id; never one a ctl_action has */
    km_worker_role from, to;
    const char *reason;               /* static: "prefill_queue", "prefill_ttft", "decode_queue",
                                       * "decode_itl", "calm" (a lent worker going back to its own role) */
    int n_prefill, n_decode;          /* the pools it was decided on */
    double prefill_load, decode_load; /* requests per worker, as queue_target counts */
    double ttft_ms, itl_ms;           /* the pools' worst busy p90s */
} ctl_role_change;

typedef struct ctl_roles ctl_roles;

int ctl_roles_create(const ctl_roles_cfg *cfg, ctl_roles **out);
void ctl_roles_destroy(ctl_roles *r);
/* Feeds every member's load at now_ms. Returns 1 and fills *out when a worker must change role
 * (no other change is decided until its heartbeats show it, or change_timeout), else 0. */
int ctl_roles_step(ctl_roles *r, const ctl_role_load *w, int n, uint64_t now_ms,
                   ctl_role_change *out);
/* The change with this id was refused or could not be sent (ok false), or acknowledged (ok
 * true). 0, or KM_ENOTFOUND when no change with this id waits. */
int ctl_roles_done(ctl_roles *r, uint64_t id, bool ok);
/* Member i's load, for ctl_roles_step (strings point into the policy). */
int ctl_policy_role_load(const ctl_policy *p, int i, ctl_role_load *out);

/* ---------------------------------------------------------------- daemon (controller.c) */

typedef struct ctl_config {
    const char *controller_id; /* default "controller" */
    const char *listen_url;    /* ROUTER: heartbeats, worker replies, operator admin frames */
    const char *view_url;      /* PUB: ["view", frame] */
    int64_t view_interval_ms;  /* publish at least this often; default 1000 */
    const char *admin_host;    /* default 127.0.0.1 */
    int admin_port;            /* 0 ephemeral, -1 off */
    /* CURVE (docs/security.md): the ROUTER admits members and operators (a heartbeat only from
     * the member key bound to its worker id, recover only from an operator), the view PUB
     * members and operators; NULL or insecure: none. Owned by the caller. */
    const km_zsec *sec;
    ctl_policy_cfg policy;
    ctl_roles_cfg roles;
} ctl_config;

void ctl_config_default(ctl_config *c);

typedef struct ctl_controller ctl_controller;

/* Binds every socket and starts the admin HTTP server (errors come back here). */
int ctl_controller_create(const ctl_config *c, ctl_controller **out, km_errbuf *err);
/* Serves until ctl_controller_stop; returns 0. */
int ctl_controller_run(ctl_controller *c);
void ctl_controller_stop(ctl_controller *c); /* async-signal-safe */
void ctl_controller_destroy(ctl_controller *c);
/* Bound endpoints (tcp://127.0.0.1:* resolved) and the admin port (-1 when off). */
int ctl_controller_listen_endpoint(const ctl_controller *c, char *buf, size_t cap);
int ctl_controller_view_endpoint(const ctl_controller *c, char *buf, size_t cap);
int ctl_controller_admin_port(const ctl_controller *c);

#ifdef __cplusplus
}
#endif
#endif /* CTL_CONTROLLER_H */
