/*
 * internal.h — what the router daemon's files share (router.c: life cycle and the loop;
 * front.c: the HTTP handlers and the status document). Private to router/: router.h is the
 * component's contract.
 *
 * Everything here runs on the router's one loop thread, so none of it takes a lock.
 */
#ifndef RT_INTERNAL_H
#define RT_INTERNAL_H

#include <uv.h>

#include "router/router.h"
#include "worker/worker.h"

#define RT_RQ_BUCKETS 4096
#define RT_REPLAY_MAX 4096 /* kv frames buffered from one replay */
#define RT_TICK_MS    50

typedef enum { RQ_ZMQ = 0, RQ_HTTP = 1 } rq_origin;

typedef struct rt_rq rt_rq;
typedef struct rt_wk rt_wk;

struct rt_rq {
    rt_router *r;
    uint64_t rid;         /* toward workers */
    rt_rq *hnext;         /* rid hash chain */
    rt_rq *qprev, *qnext; /* router queue, or the in-flight list */
    bool queued;
    /* origin */
    rq_origin origin;
    km_buf env_mem;
    km_zframe env[KM_ZMSG_MAX_PARTS];
    int n_env;
    uint64_t cid; /* client's id */
    rt_http_req *http;
    bool http_stream, http_chat, include_usage, http_began;
    char oai_id[48];
    int64_t created;
    /* request */
    km_msg_request q; /* strings below owned by the rq */
    char model[KM_PROTO_MAX_NAME + 1];
    char *salt;
    char *stop[KM_PROTO_MAX_STOP];
    int32_t *tokens; /* prompt, then every generated token */
    int n_prompt, n_gen, cap;
    uint32_t max_tokens;
    bool client_stream;
    km_pagehash *chain;
    int n_chain;
    km_pagehash key;
    uint64_t deadline_ns; /* absolute; 0 none */
    /* state */
    int worker;        /* -1: not at a worker */
    int attempts;      /* workers tried */
    int base;          /* n_gen when the current attempt began */
    bool router_detok; /* continuation after a migration: the router makes the text */
    bool replay;       /* this attempt regenerates the first n_gen tokens, checked, not sent */
    int att_next;      /* next `index` expected from the current attempt */
    int migrations;
    km_detok dt;
    km_buf text; /* whole completion (non-streaming clients, HTTP) */
    double predicted;
    uint32_t first_cached;
    bool first_cached_set;
    uint64_t t_arrive, t_sent, t_first;
    double worker_queue_ms;
    /* prefix gating: a request whose prefix is being computed right now by an earlier request
     * on the chosen worker waits for that request's first token (its pages are then cached) */
    rt_rq *owner, *waiters, *wnext;
    bool parked;
};

struct rt_wk {
    rt_router *r;
    int idx;
    char id[KM_PROTO_MAX_NAME + 1];
    char req_url[256], ev_url[256];
    void *dealer, *mon;
    uv_poll_t p_dealer, p_mon;
    bool polls_open;
    bool connected, draining;
    uint64_t draining_until_ms;
    int inflight;
    rt_evstream *evs;
    /* replay */
    bool sync_out;
    uint64_t sync_id, sync_deadline_ms;
    km_buf *replay;
    int n_replay;
    /* stats */
    uint64_t routed, served, failed, prompt_tokens, cached_tokens, migrated_away, connects;
    uint64_t resyncs, snapshots;
    km_series *s_inflight, *s_routed, *s_pages[KM_TIER_COUNT], *s_up;
    /* the controller's view of it */
    char view_id[KM_PROTO_MAX_NAME + 1]; /* the id the view gives it ("" when never named) */
    bool in_view;                        /* the last view names it */
    bool from_view;                      /* added at run time from a view */
    km_member_state member;              /* its state in that view (when in_view) */
    uint32_t level;                      /* the recovery level in effect */
    uint64_t view_migrated;              /* requests migrated away because the view said dead */
    km_series *s_member, *s_level;
};

struct rt_router {
    rt_config c;
    char model_name[KM_PROTO_MAX_NAME + 1];
    char fp[65];
    wk_model *model;
    const km_tokenizer *tok;
    km_chat_kind chat;
    km_proto_limits lim;
    uv_loop_t loop;
    uv_async_t stop_async;
    uv_check_t check;
    uv_timer_t tick;
    uv_poll_t p_front, p_sub;
    void *zctx, *front, *sub;
    char front_ep[256];
    rt_wk *w;
    int n_w;
    rt_index *index;
    rt_http *http;
    km_admin *admin;
    km_metrics *metrics;
    /* requests */
    rt_rq *buckets[RT_RQ_BUCKETS];
    rt_rq *qhead, *qtail;
    int n_queued, n_inflight;
    uint64_t next_rid, next_admin_id, policy_state;
    /* scratch */
    km_buf out;
    km_zmsg zm;
    int32_t *tokbuf;
    int tokcap;
    /* stats */
    uint64_t n_requests, n_ok, n_err, n_overloaded, n_migrations, n_bad_frames;
    uint64_t prompt_tokens, cached_tokens, predicted_tokens;
    double ewma_total_ms;
    km_series *s_req_ok, *s_req_err, *s_overloaded, *s_migr, *s_bad, *s_prompt, *s_cached,
        *s_predicted, *s_queue, *s_inflight_all, *s_decision, *s_ttft, *s_total, *s_gaps, *s_resync,
        *s_index_pages, *s_http_req;
    bool stopping, running;
    bool pumping;
    /* the controller's cluster view (--controller) */
    void *vsub;
    uv_poll_t p_vsub;
    bool have_view, view_fresh, slots_full_warned;
    char ctl_url[256], ctl_id[KM_PROTO_MAX_NAME + 1];
    uint64_t view_epoch, view_seq, view_at_ms, n_views, n_bad_views;
    km_series *s_views, *s_bad_views, *s_view_age;
};

/* ---------------------------------------------------------------- shared by the router's files */

uint64_t rt_now_ms(void);

/* May w get a new request now: its connection is up, it did not just refuse one (503/529), and a
 * fresh view, when it names w, says "ready". */
bool rt_wk_routable(rt_router *r, rt_wk *w, uint64_t now);
/* Does a client's model name mean the router's model (its name with or without the quantization
 * suffix, "default", --model-name or the fingerprint)? */
bool rt_model_ok(rt_router *r, const char *model);
/* The per-worker page gauges and the index size, from the prefix index. */
void rt_update_page_gauges(rt_router *r);
/* Drains every ZeroMQ socket until none has anything to read. */
void rt_pump(rt_router *r);

/* A new request from origin (not yet in the table), or NULL. */
rt_rq *rt_rq_new(rt_router *r, rq_origin origin);
/* Frees a request that never entered the table (rt_rq_start was not called). */
void rt_rq_free(rt_rq *q);
/* Tokenizes text into q->tokens as the worker does (parse_special on; add_special off for a
 * rendered chat template, which carries its own BOS). */
int rt_rq_tokenize(rt_router *r, rt_rq *q, const char *text, size_t len, int add_special);
/* Everything after the prompt is in q->tokens: the chain, the key, the table, then dispatch.
 * On failure q has been answered and freed. */
int rt_rq_start(rt_router *r, rt_rq *q);
/* Ends a request's life in the router (after its final frame went out). */
void rt_rq_end(rt_router *r, rt_rq *q);
/* The client gave up: a queued or parked request ends now (done: canceled); one at a worker is
 * canceled there, and the worker's done(canceled) ends it. */
void rt_rq_cancel(rt_router *r, rt_rq *q);
/* What the OpenAI response objects of q say besides the text. */
void rt_rq_oai_meta(rt_router *r, rt_rq *q, rt_oai_meta *m, const char *worker);

/* ---------------------------------------------------------------- HTTP front (front.c) */

/* The HTTP server's handler (rt_http_opts.handler, user = the router): /healthz, /readyz,
 * /metrics, /v1/models, /v1/status (and /status), /v1/completions, /v1/chat/completions. */
void rt_front_on_http(rt_http_req *h, void *user);

#endif
