/*
 * worker.h — the kvmesh worker daemon around the engine (engine/engine.h): ZeroMQ requests, KV
 * events, admin commands, heartbeats, metrics, /healthz and /readyz, the page service of the
 * transfer node (peer/peer.h), drain handoff and warm-up. docs/protocol.md is the wire contract,
 * docs/operations.md the operator's page, docs/architecture.md draws its threads.
 */
#ifndef WK_WORKER_H
#define WK_WORKER_H

#include "common/svc.h"
#include "engine/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Exit status that asks the supervisor for a restart (drain, shutdown with restart). */
#define WK_EXIT_RESTART 75

typedef struct wk_service wk_service;

typedef struct wk_service_opts {
    const char *worker_id;   /* NULL: "worker-<pid>" */
    const char *listen;      /* requests/admin ROUTER endpoint; e.g. tcp://127.0.0.1:7100 */
    const char *events;      /* KV events PUB endpoint; NULL: none */
    const char *controller;  /* controller ROUTER to send heartbeats to; NULL: none */
    const char *admin_host;  /* admin HTTP host; NULL: 127.0.0.1 */
    int admin_port;          /* 0: ephemeral; -1: no admin HTTP */
    const char *model_alias; /* extra model name requests may use; NULL: none */
    const char *ports_file;  /* write the bound endpoints here once ready; NULL: none */
    int heartbeat_ms;        /* 0: 1000 */
    int drain_timeout_ms;    /* grace before in-flight requests are handed back; 0: 30000 */
    int event_replay;        /* KV events kept for replay; 0: 65536 */
    int max_frame;           /* bytes; 0: KM_PROTO_MAX_FRAME */
    bool chaos;              /* take the `pressure` admin command (fault injection; tests only) */
    km_worker_role role;     /* what it computes (docs/disaggregation.md); 0: both */
    /* CURVE (docs/security.md): the requests ROUTER admits members and operators, the events PUB
     * members, the controller DEALER pins the key "controller"; NULL or insecure: none. Owned by
     * the caller, outlives the service. */
    const km_zsec *sec;
    /* KV page transfer (docs/transfer.md); the engine's store needs kv_arena */
    const char *peer_listen;    /* "HOST:PORT" (port 0: ephemeral); NULL/empty: no transfer node */
    const char *peer_advertise; /* host peers connect to; NULL: 127.0.0.1 */
    const char *peer_mode;      /* "am" (default) or "get" */
    const char *peer_encrypt;   /* "auto" (default: to another host), "on" or "off" */
    int peer_lease_ms;          /* how long offered pages stay pinned; 0: 10000 */
    int peer_pull_ms;           /* a pull's budget when the hint names none; 0: 2000 */
    /* the controller's view PUB (its --view): the peers a drain hands pages to; NULL: none */
    const char *peer_view;
    /* warm-up: pages a newly ready worker asks its peers for (0: none; < 0: a quarter of its
     * store) */
    int peer_warm_pages;
    /* leave the arena's pages to be faulted in as they are first written instead of making the
     * hot tier's share resident in the background (pr_config.prefault_bytes) */
    bool peer_no_prefault;
    /* self-speculation (sched.spec.mode EN_SPEC_SELF, engine/scheduler_self.c): the draft engine,
     * over the same model with an int4 store; owned by the caller, outlives the service. NULL:
     * requests asking for it draft from suffixes. */
    en_engine *draft;
    en_sched_opts sched;
} wk_service_opts;

int wk_service_create(en_model *m, en_engine *e, const wk_service_opts *o, wk_service **out,
                      km_errbuf *err);
void wk_service_destroy(wk_service *s);
/* Serves until shutdown or the end of a drain; returns the process exit status (0, or
 * WK_EXIT_RESTART). */
int wk_service_run(wk_service *s);
/* Async-signal-safe: SIGTERM/SIGINT begin a drain, a second one stops at once. */
void wk_service_signal(wk_service *s, int signo);

#ifdef __cplusplus
}
#endif
#endif /* WK_WORKER_H */
