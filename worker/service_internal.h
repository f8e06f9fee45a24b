/*
 * service_internal.h — what the worker daemon's files share. Private to worker/: worker.h
 * ("service") is the contract.
 *
 * The files, top layer first (a file calls only files below it: tests/check_layers.sh):
 *
 *   service.c            create/destroy, the loop, frames in, drain and shutdown
 *   gate.c               the gate: the thread that owns the requests ROUTER
 *   service_admin.c      admin commands: status (and KV event replay), evict, set_kv_format,
 *                        drain, shutdown, pressure; the gate's answers during a step
 *   service_heartbeat.c  gauges, the heartbeat snapshot, the pulse thread
 *   service_peer.c       KV pages between workers: the transfer node, requests with a pull hint
 *                        held while their pages are pulled
 *   service_serve.c      the same as a holder: kv_pull served, offers out
 *   service_handoff.c    the controller's view, drain handoff and warm-up over that node
 *   links.c              links to holders, pulls started over them (the peer files share
 *                        service_peer_internal.h)
 *   service_pd.c         disaggregated requests: a prefill worker's pages pulled as sealed
 *   service_requests.c   requests in flight: `req` to the scheduler, tokens and ends back out
 *   events.c             KV events, their replay and snapshots
 *   frames.c, metrics.c, state.c   frames out, the series, the state and shared KV facts
 *
 * Everything runs on the loop's thread except the gate (the ROUTER, its queue under its lock),
 * the pulse (the controller socket; the snapshot under hb_mu), the admin HTTP thread (the metrics
 * registry and the atomic state only) and the threads of the engine and the transfer node
 * (docs/architecture.md draws them).
 */
#ifndef WK_SERVICE_INTERNAL_H
#define WK_SERVICE_INTERNAL_H

#include "worker/worker.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>

typedef struct wk_events wk_events; /* events.c, below */
typedef struct wk_peer wk_peer;     /* service_peer.c, below */
typedef struct wk_gate wk_gate;     /* gate.c, below */

enum {
    WK_ENV_MAX = KM_ZMSG_MAX_PARTS - 1,
    WK_ENV_BYTES = 1024,
    WK_LAT_RING = 1024,
    WK_GATE_QUEUE = 64 /* frames waiting for the loop; more wait in the ROUTER's own queue */
};

/* One request in flight, from its `req` frame to its `done` or `err`. */
typedef struct wk_sreq {
    struct wk_service *svc;
    uint64_t id, rid;
    uint8_t env[WK_ENV_BYTES]; /* routing envelope, copied */
    size_t env_len[WK_ENV_MAX];
    int n_env;
    bool stream;
    md_detok dt;
    km_buf text;  /* completion text: kept for non-streaming requests and stop strings */
    size_t sent;  /* bytes of text already streamed (stop strings: the rest may begin one) */
    bool stopped; /* a stop string ended it: nothing after the match belongs to the text */
    char *stop[KM_PROTO_MAX_STOP];
    int n_stop;
    uint64_t arrival_ns, last_ns;
    int live_idx;
} wk_sreq;

typedef enum {
    WK_BAD_MALFORMED = 0,
    WK_BAD_TOO_LARGE,
    WK_BAD_VERSION,
    WK_BAD_TYPE,
    WK_BAD_PARTS,
    WK_BAD_FIELD,
    WK_BAD_COUNT
} wk_bad;
extern const char *const wk_bad_names[WK_BAD_COUNT]; /* metric labels, heartbeat error kinds */

typedef enum {
    WK_OUT_OK = 0,
    WK_OUT_CANCELED,
    WK_OUT_DEADLINE,
    WK_OUT_ERROR,
    WK_OUT_REJECTED,
    WK_OUT_HANDED_BACK,
    WK_OUT_COUNT
} wk_outcome;
extern const char *const wk_out_names[WK_OUT_COUNT]; /* metric labels */

/* What a heartbeat reports besides its seq, uptime, state and RSS: taken by the loop between
 * steps, sent by the pulse (service_heartbeat.c). Strings are static. */
typedef struct wk_hb_snap {
    km_kv_usage kv[KM_PROTO_MAX_KV_ENTRIES];
    int n_kv;
    km_latency_q lat[3];
    km_error_count errs[WK_BAD_COUNT + 4];
    int n_errs;
    uint32_t queue_depth, running, page_tokens;
    double decode_tps, prefill_tps;
    uint64_t tokens_total;
    km_worker_role role;   /* o.role, which set_role changes on the loop's thread */
    km_msg_heartbeat peer; /* only its peer_addr, peer_addr_len, has_xfer, xfer (service_peer.c) */
    /* peer.xfer.pairs, copied: the links they come from are the loop's; the pulse points
     * peer.xfer.pairs (and each .from) at its own copy of the snapshot */
    km_xfer_pair pairs[KM_PROTO_MAX_XFER_PAIRS];
    char pair_from[KM_PROTO_MAX_XFER_PAIRS][KM_PROTO_MAX_NAME + 1];
} wk_hb_snap;

/* What `status` reports while an engine step runs (taken on the loop just before it; the gate's
 * copy is under its lock). */
typedef struct wk_quick {
    kv_format format;
    uint32_t running, queued;
    uint64_t kv_pages, kv_bytes;
    /* a drain or shutdown answered during a step: the state it takes once the loop carries it
     * out (a km_worker_state; -1: none), which later answers before then report */
    int state_after;
    int drain_loss; /* wk_svc_drain_loss: pages a drain starting now would drop */
} wk_quick;

struct wk_service {
    en_model *m;
    en_engine *e;
    kv_store *kv;
    const md_tokenizer *tok;
    en_sched *sched;
    wk_events *ev;
    wk_peer *peer; /* NULL: no transfer node (--peer-listen unset) */
    wk_service_opts o;
    char worker_id[KM_PROTO_MAX_NAME + 1];
    char model_name[KM_PROTO_MAX_NAME + 1], model_base[KM_PROTO_MAX_NAME + 1];
    char fp[33];
    char ep_requests[256], ep_events[256], ep_admin[256];
    km_proto_limits lim;
    void *zctx, *pub;
    void *router;               /* the loop's end of the gate's pair: frames for the ROUTER */
    void *ctl;                  /* the controller DEALER: the pulse's alone once it runs */
    void *ctl_loop, *ctl_pulse; /* inproc PAIR between the loop and the pulse */
    km_zap *zap;                /* the ZAP handler of zctx; NULL when insecure */
    km_series *s_forbidden;     /* kvmesh_worker_forbidden_total: frames refused with 403 */
    km_series *s_unauth;        /* disk pages dropped for a missing or wrong MAC */
    uint64_t last_unauth;
    km_admin *admin;
    km_metrics *reg;
    atomic_int state; /* km_worker_state */
    volatile sig_atomic_t signals;
    int exit_code;
    bool stop_now;
    uint64_t drain_deadline_ns, start_ns;
    /* after a drain handed its requests back: still serving their pages to the workers they
     * migrated to (wk_peer_serving), until then at the latest (0: not lingering) */
    uint64_t linger_start_ns, linger_until_ns;
    int handed_back;
    uint64_t drain_pages_out; /* pages peers had read from this worker when its drain began */
    kv_format kv_base; /* the format the worker started with: another one = level 2 in effect */
    /* compiled grammars of constrained requests, by their schema text (the last few) */
    en_grammar *grammar[8];
    char *grammar_src[8];
    int grammar_next;
    /* requests in flight */
    wk_sreq **live;
    int n_live, cap_live;
    /* scratch, reused */
    km_buf out;
    int32_t *tokbuf;
    int tokcap;
    km_zmsg in;
    /* heartbeats (the pulse) and rates */
    pthread_t hb_thread;
    bool hb_started;
    atomic_int hb_stop;
    atomic_int in_command; /* the loop carries out a controller command: the pulse holds beats */
    pthread_mutex_t hb_mu;
    wk_hb_snap snap; /* under hb_mu */
    km_latency_q lat[3];
    uint64_t hb_seq, next_quant_ns, next_gauge_ns, last_rate_ns;
    uint64_t last_prefill, last_decode, last_preempt, last_yield, last_wait;
    double decode_tps, prefill_tps;
    double ttft_ring[WK_LAT_RING], tpot_ring[WK_LAT_RING], qtmp[WK_LAT_RING];
    int n_ttft, n_tpot;
    uint64_t errors[WK_BAD_COUNT], send_errors, oom_errors;
    atomic_uint_fast64_t gate_send_errors; /* frames the ROUTER refused (the gate counts them) */
    /* metrics */
    km_metric *m_kv_bytes, *m_kv_pages, *m_kv_cap;
    km_metric *m_kv_chunk_pages; /* kvmesh_worker_kv_chunk_pages{tier} */
    km_series *s_req[WK_OUT_COUNT], *s_bad[WK_BAD_COUNT];
    km_series *s_tok_prompt, *s_tok_cached, *s_tok_gen, *s_tok_prefill, *s_tok_chunk;
    km_series *s_ttft, *s_itl, *s_queue, *s_e2e, *s_hit, *s_preempt, *s_yield, *s_wait, *s_running,
        *s_queued;
    km_series *s_steps, *s_step_time, *s_events, *s_ready, *s_hb_sent, *s_hb_dropped;
    km_series *s_rec_evict, *s_rec_format, *s_rec_drain, *s_rec_shutdown;
    km_series *s_rec_level[4]; /* kvmesh_recovery_actions_total{level="0".."3"} */
    km_metric *m_kv_pinned;
    /* kvshard's own counts (hits, demotions, evictions per shard; expert groups; placements),
     * brought up to the store's totals with every gauge update */
    km_metric *m_shard_ev, *m_grp_pages, *m_grp_ev;
    km_series *s_place[2];    /* kvmesh_kv_placements_total{result="moved","stayed"} */
    km_series *s_promoted[2]; /* kvmesh_kv_promoted_bytes_total{reason="prefix","read"} */
    km_series *s_sparse[2];   /* kvmesh_worker_sparse_pages_total{result="selected","skipped"} */
    km_series *s_demoted;     /* kvmesh_kv_sparse_demoted_bytes_total */
    km_series *s_slice_read;  /* kvmesh_kv_slice_read_bytes_total */
    km_series *s_ballast;
    /* speculative decoding: drafted, accepted, rejected tokens, verifications, back-offs (the
     * scheduler's totals, added as they grow), and the mean accepted length */
    km_series *s_spec[5], *s_spec_len;
    uint64_t last_spec[5];
    /* chaos: the `pressure` command's ballast, a sequence holding real hot pages */
    kv_seq *ballast;
    int ballast_pages;
    /* the gate (gate.c): the requests ROUTER's thread; `quick` is what it answers from */
    wk_gate *gate;
    bool reply_sent; /* a frame the gate already answered is carried out: no second reply */
};

static inline uint64_t wk_ms_ns(int64_t ms)
{
    return (uint64_t)ms * 1000000ull;
}

/* ---------------------------------------------------------------- state.c */

void wk_svc_set_state(wk_service *s, km_worker_state st);
km_worker_state wk_svc_state(wk_service *s);
kv_format wk_svc_kv_format(wk_service *s); /* the current KV format (shard 0's) */
/* Bytes of one ballast page, and of the whole ballast (the chaos `pressure` command). */
size_t wk_svc_ballast_page_bytes(wk_service *s);
size_t wk_svc_ballast_bytes(wk_service *s);

/* ---------------------------------------------------------------- frames.c */

/* body behind an envelope on sock (s->router, the loop's end of the gate, for the ROUTER; or
 * ctl_loop, with no envelope, for the controller); a failed send is counted. */
int wk_svc_send(wk_service *s, void *sock, const km_zframe *env, int n_env, const km_buf *body);
/* An `err` frame (msg NULL: the code's name). */
int wk_svc_send_error(wk_service *s, void *sock, const km_zframe *env, int n_env, uint64_t id,
                      int code, uint32_t retry_ms, const char *msg);
void wk_svc_count_bad(wk_service *s, wk_bad b);
/* The same for a frame from peer (NULL: the controller): only a member's, or any when insecure,
 * counts in heartbeats. */
void wk_svc_count_bad_from(wk_service *s, wk_bad b, const km_zpeer *peer);
/* Copies a frame's envelope into dst/lens (0), or KM_ERANGE when it does not fit WK_ENV_BYTES. */
int wk_env_copy(uint8_t *dst, size_t *lens, const km_zframe *env, int n_env);
/* Frames over a copied envelope; returns how many. */
int wk_env_view(const uint8_t *src, const size_t *lens, int n_env, km_zframe *env);

/* ---------------------------------------------------------------- metrics.c */

int wk_svc_metrics_init(wk_service *s, km_errbuf *err);
/* A request ended (done or error): its latencies into the metrics and the heartbeat's rings. */
void wk_svc_observe_end(wk_service *s, const en_sched_usage *u);

/* ---------------------------------------------------------------- service_requests.c */

/* A `req` from the ROUTER checked (state, model, id, envelope), with its prompt's token ids (its
 * own, or its text tokenized into a buffer of the service): 0, or a negative km_err once the
 * sender has been answered. */
int wk_svc_request_check(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                         const int32_t **toks, int *n_tok);
/* Queues q with its prompt's token ids; arrival_ns is when it arrived (its deadline counts from
 * there). Answers the sender itself when the scheduler refuses it. */
void wk_svc_admit(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                  const int32_t *toks, int n_tok, uint64_t arrival_ns);
/* The request in flight with this id from this envelope, or NULL. */
wk_sreq *wk_svc_live_find(wk_service *s, const km_zframe *env, int n_env, uint64_t id);
void wk_svc_sreq_free(wk_sreq *r);
/* The scheduler's callbacks (tokens, ends) that stream requests back to their senders. */
void wk_svc_callbacks(wk_service *s, en_sched_cb *out);
/* Drops the compiled grammars (after the scheduler, whose requests hold references). */
void wk_svc_grammars_free(wk_service *s);

/* ---------------------------------------------------------------- service_heartbeat.c */

/* KV, scheduler and rate gauges from the store's and scheduler's statistics. */
void wk_svc_update_gauges(wk_service *s);
/* What the next heartbeats report, from the store's and the scheduler's statistics (loop). */
void wk_svc_snapshot(wk_service *s);
/* The pulse: the thread that sends heartbeats every interval and relays the controller's
 * commands to the loop (ctl_loop) and their replies back. Nothing without a controller. */
int wk_svc_pulse_start(wk_service *s, km_errbuf *err);
/* Stops it after a last snapshot and a last heartbeat (the state it reports then). */
void wk_svc_pulse_stop(wk_service *s);

/* ---------------------------------------------------------------- service_admin.c */

/* An `admin` from the ROUTER or the controller: carried out and answered with `admin_reply`
 * (not when s->reply_sent: the gate answered it during a step). */
void wk_svc_handle_admin(wk_service *s, void *sock, const km_zframe *env, int n_env,
                         const km_msg_admin *a);
/* From ready to draining: no new requests; in-flight ones finish until the deadline. */
void wk_svc_start_drain(wk_service *s, int64_t timeout_ms, const char *why);
/* Cached pages a drain starting now will drop: those in RAM when there is no disk tier to keep
 * them and no transfer node with a view of peers to hand them to; 0 otherwise. */
int wk_svc_drain_loss(wk_service *s);
/* At the end of a drain: of the ram pages it ended with, those neither persisted (persisted:
 * pages the disk tier took, -1 without one) nor read by peers since the drain began. */
int wk_svc_drain_dropped(wk_service *s, int ram, int persisted);
/* The figures `status` reports, taken now (loop, between steps). */
void wk_svc_quick_take(wk_service *s, wk_quick *q);
/* The gate's answer during a step (its thread; reads only q, the atomic state and what never
 * changes): an authorized `status` without an event replay, from the figures in q, or a `drain`
 * or `shutdown` for this worker accepted (q->state_after set), encoded into out; returns true.
 * False for anything else: the loop carries it out and answers it after the step. */
bool wk_svc_admin_quick(wk_service *s, wk_quick *q, const km_msg_admin *a, km_buf *out);
void wk_svc_ballast_release(wk_service *s);

/* ---------------------------------------------------------------- gate.c
 *
 * The gate: the thread that owns the requests ROUTER from wk_gate_start on. It hands every frame
 * to the loop in arrival order through a bounded queue (wk_gate_next; wk_gate_fd is readable
 * while frames wait), except while the loop is inside a step (wk_gate_step_begin .. _end): an
 * authorized `status` is answered then from the figures taken before the step, and a `drain` or
 * `shutdown` is accepted (answered) and still queued, marked, to be carried out in its place.
 * What the loop sends on s->router (an inproc PAIR) the gate forwards to the ROUTER unchanged. */

enum { WK_GATE_ANSWERED = 1, WK_GATE_TOO_MANY_PARTS = 2 }; /* wk_gate_next's flags */

/* Takes router (bound; closed on failure too); s->router becomes the loop's end of the pair. */
int wk_gate_start(wk_service *s, void *router, km_errbuf *err);
/* Forwards the loop's last frames, stops the thread, closes the ROUTER (their linger). */
void wk_gate_stop(wk_service *s);
int wk_gate_fd(const wk_gate *g);
/* The oldest frame waiting, swapped into *zm: 1 (*flags: WK_GATE_*), or 0 when none. */
int wk_gate_next(wk_gate *g, km_zmsg *zm, int *flags);
/* The loop enters a step with the figures q; false (nothing changed) when frames wait and
 * force is not set: the loop handles them first, so none of them waits for the step. */
bool wk_gate_step_begin(wk_gate *g, const wk_quick *q, bool force);
void wk_gate_step_end(wk_gate *g);
/* A frame marked WK_GATE_ANSWERED has been carried out. */
void wk_gate_answered_done(wk_gate *g);

/* ---------------------------------------------------------------- service_peer.c
 *
 * With a transfer node (docs/transfer.md): kv_pull frames from peers are served (pr_serve, the
 * offer sent back behind the puller's envelope), and a request with a pull hint is held while
 * this worker pulls the hinted pages from the holder, then admitted: a pull that fails or
 * misses its deadline only means those pages are computed. Without one (s->peer NULL) hints
 * are ignored and kv_pull is refused with an offer of status KM_EUNSUPPORTED. */

int wk_peer_create(wk_service *s, km_errbuf *err);
/* Held requests get no reply (the service is going away). */
void wk_peer_destroy(wk_service *s);
/* kv_pull and kv_pull_done from a peer on the ROUTER. */
void wk_peer_handle(wk_service *s, void *sock, const km_zframe *env, int n_env, const km_msg *m);
/* 1 when q is now held for its pull (0: admit it now: no node, nothing to pull, a failure, or a
 * hint refused: one whose sender is not a router's member key, or whose holder is not a worker
 * of the controller's view; counted). The holder's endpoint, address and key come from the
 * view, never from the request. */
int wk_peer_park(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                 const km_zpeer *peer, const int32_t *toks, int n_tok, uint64_t now);
/* The loop's call: answers from holders, offers to send, held requests whose pull ended (or
 * whose deadline passed) admitted. */
void wk_peer_poll(wk_service *s);
/* What the loop's poll waits on for the transfer node besides its own sockets: the node's wait
 * fd (a pull finished) and the links to holders (offers, refusals). Returns how many (<= max;
 * never more than WK_PEER_POLL_MAX). */
#define WK_PEER_POLL_MAX 17 /* the wait fd and one per holder link (WK_PEER_LINKS) */
int wk_peer_poll_items(const wk_service *s, km_zpollitem *items, int max);
/* Requests held for a pull. */
int wk_peer_held(const wk_service *s);
/* A cancel for a held request: admitted and canceled (1), or not held here (0). */
int wk_peer_cancel(wk_service *s, const km_zframe *env, int n_env, uint64_t id);
/* Every held request admitted now, its pull given up (stop, end of drain). */
void wk_peer_admit_all(wk_service *s);
/* The heartbeat's peer_addr and xfer statistics. */
void wk_peer_heartbeat(wk_service *s, km_msg_heartbeat *hb);
/* Drain handoff: kv_push of this worker's cached chains to the ready peers of its model that
 * the controller's view names (--peer-view), most recently used first. Returns the chains
 * pushed (0: none, or no view, no node, no peer). */
int wk_peer_handoff(wk_service *s);
/* Drain handoff, a while later: a peer that has pulled none of the chains pushed to it (the view
 * still called it ready, but it died or stopped within the controller's dead-after window) has
 * them pushed again to the peers that did pull. Once per drain; returns the chains pushed again
 * (0: every peer pulled, none did, or it already ran). */
int wk_peer_handoff_again(wk_service *s);
/* True while this worker owes peers pages: kv_pull frames waiting for their offer, live leases,
 * or a kv_pull within the last quiet_ns (more may follow). False without a transfer node. */
bool wk_peer_serving(const wk_service *s, uint64_t now, uint64_t quiet_ns);

/* ---------------------------------------------------------------- KV events (events.c)
 *
 * The store's events are regrouped into `kv` frames (consecutive events of the same kind and
 * tiers share a frame) numbered per worker from 1; a ring of recent events keeps their frame
 * numbers for replay, and a mirror of the store's index (page hash -> tier, fed by the same
 * events) answers snapshots. */

/* pub may be NULL (no events endpoint): events are still numbered, mirrored and replayable. */
int wk_events_create(kv_store *kv, void *pub, const char *worker, int replay_cap, wk_events **out);
void wk_events_destroy(wk_events *ev);
/* Drains the store's pending events and publishes them; returns how many frames went out. */
int wk_events_pump(wk_events *ev);
/* The seq the next frame will carry. */
uint64_t wk_events_next_seq(const wk_events *ev);
uint64_t wk_events_frames(const wk_events *ev);
/* Sends, as `kv` frames on sock behind the envelope, every frame with seq >= since (replay), or
 * the whole index as `stored` frames carrying seq next-1 (snapshot: when snapshot is set or
 * since is older than the ring). Returns the number of frames sent; *was_snapshot says which. */
int wk_events_replay(wk_events *ev, void *sock, const km_zframe *env, int n_env, uint64_t since,
                     bool snapshot, bool *was_snapshot);

#endif
