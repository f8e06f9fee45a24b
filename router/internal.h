/*
 * internal.h — the router daemon's state and what its files share. Private to router/: router.h
 * is the component's contract, route.h the routing core these files drive.
 *
 * The files, in their one-way order (a file calls only those below it; `make check-layers`,
 * tests/check_layers.sh), with a request's way through them:
 *   router.c    create/run/destroy and the loop that drains every socket
 *   front.c     an HTTP completion arrives (OpenAI API; replies built by openai.c)
 *   clients.c   a ZeroMQ `req` or `cancel` arrives; client connections come and go
 *   view.c      the controller's view, narrowing which workers get new requests
 *   workers.c   one DEALER per worker with its socket monitor (liveness), the KV event stream
 *               and its replay after a gap
 *   relay.c     the worker's `tok` frames go back to the client; `done` ends it; a dead worker's
 *               requests migrate (replayed or continued) to another
 *   prompt.c    tokenize (on or off the loop), then rt_rq_start: page-hash chain, dispatch
 *   dispatch.c  pick a worker by the cost model (route.h) and send it, or queue or park it
 *   requests.c  the request table, the router queue, a request's end; its replies go out through
 *               its front's rt_front_ops (clients.c: ZeroMQ frames; front.c: SSE or JSON)
 *   metrics.c   the Prometheus series
 *   pull.c      pull or recompute: a pull hint when another worker holds more of the prefix
 *               (or of a chunk)
 *   chunks.c    the credit of a worker for the request's chunk pages it holds (docs/blend.md)
 *   evstream.c index.c policy.c openai.c fair.c tenants.c   leaves (openai.c over
 *               openai_tools.c and openai_chunks.c)
 *   state.c     the clock; rt_pump and the socket watch, which call up through r->pump
 * Two calls go back up through hooks router.c sets: r->pump (drain every socket) and
 * r->redispatch (rt_dispatch, for the waiters a request releases as it ends); a request's replies
 * go up through q->fops, the table of the front that made it (rt_rq_new).
 *
 * Everything here runs on the router's one loop thread, so none of it takes a lock.
 */
#ifndef RT_INTERNAL_H
#define RT_INTERNAL_H

#include <uv.h>

#include "common/http.h"
#include "model/model.h"
#include "router/openai.h"
#include "router/route.h"

#define RT_RQ_BUCKETS 4096
#define RT_REPLAY_MAX 4096 /* kv frames buffered from one replay */
#define RT_TICK_MS    50

typedef enum { RQ_ZMQ = 0, RQ_HTTP = 1 } rq_origin;

typedef struct rt_rq rt_rq;
typedef struct rt_front_ops rt_front_ops;
typedef struct rt_wk rt_wk;
typedef struct rt_tokjob rt_tokjob;           /* prompt.c */
typedef struct rt_hgroup rt_hgroup;           /* front.c */
typedef struct rt_tenants rt_tenants;         /* tenants.c */
typedef struct rt_tenant_load rt_tenant_load; /* fair.c */

struct rt_rq {
    rt_router *r;
    uint64_t rid;         /* toward workers */
    rt_rq *hnext;         /* rid hash chain */
    rt_rq *qprev, *qnext; /* router queue, or the in-flight list */
    bool queued;
    /* origin */
    const rt_front_ops *fops; /* its front: how its replies reach the client */
    km_buf env_mem;
    km_zframe env[KM_ZMSG_MAX_PARTS];
    int n_env;
    uint64_t cid;                     /* client's id */
    char tenant[KM_SEC_NAME_MAX + 3]; /* "z:NAME", "h:NAME", "" unkeyed (fair.c) */
    int load;                         /* its tenant's entry in r->loads (-1: none yet) */
    int src_fd;        /* ZeroMQ: the client connection's descriptor (-1: unknown) ... */
    uint64_t src_gen;  /* ... and which connection on it (clients.c: disconnects) */
    bool canceled;     /* the client canceled it: it ends, it is never migrated */
    km_http_req *http; /* the HTTP request (common/http.h) of an OpenAI request */
    rt_hgroup *grp;    /* one of its choices (n > 1, several prompts); NULL: its only one */
    int choice;        /* its choice's index in grp */
    bool http_stream, http_chat, include_usage, http_began;
    char oai_id[48];
    int64_t created;
    /* request */
    km_msg_request q; /* whitelisted sampling fields only: no pointer (strings below, owned) */
    char model[KM_PROTO_MAX_NAME + 1];
    char *salt;
    char *stop[KM_PROTO_MAX_STOP];
    km_token_value *bias;     /* req.logit_bias (q.n_logit_bias entries), owned */
    km_chunk_seg *chunks;     /* req.chunks (q.n_chunks segments of the prompt), owned */
    km_pagehash *chunk_chain; /* each chunk's chain (chunks.c): preamble page, whole pages */
    int n_chunk_chain;
    bool chunk_bytes;            /* HTTP text prompt: chunks count bytes until tokenized */
    const km_msg_token *cur_tok; /* the worker's frame of the token being delivered (its
                                  * logprobs), NULL outside rt_relay_token */
    km_buf lp;                   /* HTTP: logprobs gathered (openai.c's rt_oai_lp entries) */
    size_t lp_off;               /* HTTP completions: text_offset of the next token */
    km_buf plp; /* HTTP echo with logprobs: the prompt's tokens 1.. (rt_oai_lp entries) */
    bool echo;  /* HTTP completions: the prompt's text goes first */
    char *echo_text;
    size_t echo_len;
    char *grammar;     /* the JSON Schema the output is held to (response_format) */
    char *tool_names;  /* the functions the reply may call (rt_oai_req.tool_names) */
    bool tool_several; /* rt_oai_req.tool_several */
    int32_t *tokens;   /* prompt, then every generated token */
    int n_prompt, n_gen, cap;
    uint32_t max_tokens;
    bool client_stream;
    km_pagehash *chain;
    int n_chain;
    km_pagehash key;
    uint64_t deadline_ns; /* absolute; 0 none */
    uint64_t limit_ns;    /* absolute: --request-timeout after arrival; 0 none */
    rt_tokjob *tokjob;    /* its prompt is being tokenized on the thread pool (prompt.c) */
    /* state */
    int worker;         /* -1: not at a worker */
    int attempts;       /* workers tried */
    uint64_t failed_on; /* slots of the workers that failed it (migrations away) */
    int fruitless;      /* attempts in a row that ended without a new token */
    int gen_at_send;    /* n_gen when the current attempt was sent */
    int base;           /* n_gen when the current attempt began */
    bool router_detok;  /* continuation after a migration: the router makes the text */
    bool replay;        /* this attempt regenerates the first n_gen tokens, checked, not sent */
    int att_next;       /* next `index` expected from the current attempt */
    int migrations;
    md_detok dt;
    km_buf text; /* whole completion (non-streaming clients, HTTP) */
    double predicted;
    uint32_t first_cached;
    bool first_cached_set;
    uint32_t draft_tokens, accepted_draft_tokens; /* the finishing worker's done.usage */
    uint32_t chunk_tokens;                        /* its prompt tokens reused from chunks */
    uint64_t t_arrive, t_sent, t_first;
    double worker_queue_ms;
    /* pull hint (pull.c): holder index + 1 (0: none), its pages and the pull's budget */
    int pull_w;
    uint32_t pull_pages, pull_ms;
    uint64_t pull_chunks; /* chunks to pull from the same holder (chunks.c), a bit each */
    /* chunks to pull from other holders (their index + 1, their chunks), and the hint's copy */
    int pull_more_w[KM_PROTO_MAX_PULL_MORE], n_pull_more;
    uint64_t pull_more_chunks[KM_PROTO_MAX_PULL_MORE];
    km_pull_more pull_more[KM_PROTO_MAX_PULL_MORE];
    bool pd; /* the hint names a prefill worker computing the prompt now (pd.c) */
    /* prefix gating: a request whose prefix is being computed right now by an earlier request
     * on the chosen worker waits for that request's first token (its pages are then cached) */
    rt_rq *owner, *waiters, *wnext;
    bool parked;
    bool waited; /* was parked: admitted already, so never refused when it goes on */
};

/* A prompt being tokenized on the thread pool (prompt.c), q->tokjob. */
struct rt_tokjob {
    uv_work_t work;
    rt_router *r;
    rt_rq *q; /* NULL once the request ended without it */
    char *text;
    size_t len;
    int add_special;
    km_chunk_seg *chunks; /* byte spans in, token spans out (the job's own copy) */
    uint32_t n_chunks;
    int32_t *tokens;
    int cap, n; /* n: the token count, or a negative km_err */
};

/* How a completed request is summed up to its client (rt_rq_finish). */
typedef struct rt_rq_done {
    km_finish finish;
    uint32_t cached;    /* prompt tokens found cached, at most the prompt */
    const char *worker; /* the worker that finished it (NULL: none) */
    double queue_ms, ttft_ms, total_ms;
} rt_rq_done;

/* A front's replies, one table per front (clients.c: rt_front_zmq, front.c: rt_front_http), set
 * in each of its requests when it is made: requests.c calls up through it and names no front. */
struct rt_front_ops {
    rq_origin origin;
    const char *name; /* in logs: "zmq", "http" */
    /* One generated token's text (index n_gen - 1): sent, or kept in q->text until the end. */
    void (*token)(rt_router *r, rt_rq *q, int32_t token, const char *text, size_t len);
    /* The request completed: its last frame or body (q->text holds what is left to send). */
    void (*done)(rt_router *r, rt_rq *q, const rt_rq_done *d);
    /* One error to the client (nothing when the client is already gone). */
    void (*error)(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg);
    /* q is about to be freed: the front lets go of it. */
    void (*release)(rt_rq *q);
    /* q's prompt is tokens now (prompt.c): 1 when the front answered and ended q (its checks
     * failed), 0 to start it. NULL: start it. */
    int (*tokens_ready)(rt_router *r, rt_rq *q);
};

/* What the controller's view says about a worker's page transfer (pull.c). */
typedef struct rt_wk_xfer {
    uint8_t addr[KM_PROTO_MAX_PEER_ADDR]; /* its transfer node address; addr_len 0: none */
    uint32_t addr_len;
    double rate_bps, lat_ms, prefill_tps, page_bytes;
    /* its pulls from particular holders (view xfer_pairs), preferred to rate_bps/lat_ms */
    struct {
        char from[KM_PROTO_MAX_NAME + 1];
        double rate_bps, lat_ms;
    } pairs[KM_PROTO_MAX_XFER_PAIRS];
    uint32_t n_pairs;
} rt_wk_xfer;

struct rt_wk {
    rt_router *r;
    int idx;
    /* as a puller, per holder: hints that failed in a row, and no hint before this (pull.c) */
    uint32_t pull_fails[RT_MAX_WORKERS];
    uint64_t pull_cool_until_ms[RT_MAX_WORKERS];
    char id[KM_PROTO_MAX_NAME + 1];
    char req_url[256], ev_url[256];
    void *dealer, *mon;
    /* its KV events: a SUB of its own, pinned to its member key, so an event is taken only from
     * the connection of the worker it names (one shared SUB could not say which sent it) */
    void *sub;
    uv_poll_t p_dealer, p_mon, p_sub;
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
    bool free;                           /* released (workers.c): the slot may be reused */
    int closing;                         /* polls still closing before the slot is free */
    uint64_t absent_since_ms;            /* fresh views stopped naming it (0: they name it) */
    km_member_state member;              /* its state in that view (when in_view) */
    uint32_t level;                      /* the recovery level in effect */
    uint64_t view_migrated;              /* requests migrated away because the view said dead */
    km_series *s_member, *s_level;
    rt_wk_xfer xfer;
    km_worker_role role; /* from the view (pd.c) */
};

struct rt_router {
    rt_config c;
    char model_name[KM_PROTO_MAX_NAME + 1];
    char fp[65];
    md_model_info *model; /* tokenizer, chat format, name, fingerprint: no weights */
    const md_tokenizer *tok;
    int32_t *chunk_pre; /* the chunk preamble's first page of tokens (chunks.c); NULL: none */
    md_chat_kind chat;
    km_proto_limits lim;
    uv_loop_t loop;
    uv_async_t stop_async;
    uv_check_t check;
    uv_timer_t tick;
    uv_poll_t p_front, p_fmon;
    void *zctx, *front;
    km_zap *zap;        /* the ZAP handler of zctx; NULL when insecure */
    void *fmon;         /* the front's socket monitor: client connections come and go */
    uint64_t *conn_gen; /* per descriptor: the generation of the connection on it (0: none) */
    int n_conn_gen;     /* entries of conn_gen */
    uint64_t next_conn_gen;
    char front_ep[256];
    rt_wk *w;
    int n_w;
    rt_index *index;
    km_http_server *http;
    km_apikeys *apikeys;   /* NULL: the HTTP front takes no API keys */
    rt_tenants *tenants;   /* --client-tenants; NULL: every client key a tenant of its own */
    rt_tenant_load *loads; /* fair.c: per tenant, requests queued and at workers */
    int n_loads, cap_loads;
    uint64_t fair_seq;
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
    uint64_t last_sweep_ms;  /* the index's expired pending marks were last cleared */
    uint64_t last_expire_ms; /* requests past their deadline were last looked for */
    /* stats */
    uint64_t n_requests, n_ok, n_err, n_overloaded, n_migrations, n_bad_frames;
    uint64_t prompt_tokens, cached_tokens, predicted_tokens;
    double ewma_total_ms;
    km_series *s_forbidden;
    km_series *s_http_unauthorized, *s_http_forbidden;
    km_series *s_http_buffer_full; /* HTTP connections refused at --max-http-buffered */
    km_series *s_req_ok, *s_req_err, *s_overloaded, *s_migr, *s_bad, *s_prompt, *s_cached,
        *s_predicted, *s_queue, *s_inflight_all, *s_decision, *s_ttft, *s_total, *s_gaps, *s_resync,
        *s_index_pages, *s_http_req, *s_tls_fail, *s_ev_foreign, *s_tok_loop, *s_tok_pool,
        *s_abandoned;
    bool stopping, running;
    bool pumping;
    /* the two calls back up the layers, set by router.c: the drain of every socket (rt_pump),
     * and rt_dispatch for the waiters a request releases as it ends (requests.c) */
    void (*pump)(rt_router *r);
    int (*redispatch)(rt_router *r, rt_rq *q, bool from_queue);
    /* the controller's cluster view (--controller) */
    void *vsub;
    uv_poll_t p_vsub;
    bool have_view, view_fresh, slots_full_warned;
    char ctl_url[256], ctl_id[KM_PROTO_MAX_NAME + 1];
    uint64_t view_epoch, view_seq, view_at_ms, n_views, n_bad_views;
    km_series *s_views, *s_bad_views, *s_view_age;
    km_series *s_pulls[RT_PULL_DECISIONS];       /* kvmesh_router_pulls_total{decision} */
    km_series *s_chunk_pulls[RT_PULL_DECISIONS]; /* kvmesh_router_chunk_pulls_total{decision} */
    km_series *s_hints[2];                       /* kvmesh_router_pull_hints_total{outcome} */
    km_series *s_pd[2];                          /* kvmesh_router_pd_total{decision} */
};

/* ---------------------------------------------------------------- state.c: clock, loop hooks */

uint64_t rt_now_ms(void);
/* Drains every ZeroMQ socket until none has anything to read (router.c, through r->pump). */
void rt_pump(rt_router *r);
/* Watches a ZeroMQ socket's descriptor on the loop (readable: rt_pump). */
int rt_open_poll(rt_router *r, uv_poll_t *p, void *sock, km_errbuf *err);

/* ---------------------------------------------------------------- requests.c: table, replies */

/* A new request from the front whose replies are fops (not yet in the table), or NULL. */
rt_rq *rt_rq_new(rt_router *r, const rt_front_ops *fops);
/* Frees a request that never entered the table (rt_rq_start was not called). */
void rt_rq_free(rt_rq *q);
void rt_rq_link(rt_router *r, rt_rq *q); /* into the table under q->rid */
void rt_rq_unlink(rt_router *r, rt_rq *q);
/* Takes q off its owner's waiting list (parked behind a prefix being computed). */
void rt_rq_unpark(rt_rq *q);
/* The owner's prefix is computed (or the owner is gone): its waiters go on their way. */
void rt_rq_release_waiters(rt_router *r, rt_rq *owner);
/* q ends while its prompt is on the thread pool: the job's result will be thrown away. */
void rt_rq_detach_tokjob(rt_rq *q);
rt_rq *rt_rq_find(rt_router *r, uint64_t rid);
/* The router queue (front: a migrated request goes first). */
void rt_queue_push(rt_router *r, rt_rq *q, bool front);
void rt_queue_remove(rt_router *r, rt_rq *q);
/* q leaves its worker (the worker's and the router's in-flight counts). */
void rt_rq_release_worker(rt_router *r, rt_rq *q);
/* From the tick: requests past --request-timeout, or past their own deadline with no end from
 * their worker, end with 504 (and a cancel to the worker). */
void rt_rq_expire(rt_router *r, uint64_t now_ns);
/* Ends a request's life in the router (after its final frame went out). */
void rt_rq_end(rt_router *r, rt_rq *q);
/* One `err` to the client, through its front (q->fops). */
void rt_rq_reply_error(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg);
/* The request failed: one `err` to the client, counted and logged, then it is gone. */
void rt_rq_fail(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg);
/* One generated token's text to the client (or to q->text for a non-streaming one). */
void rt_rq_deliver(rt_router *r, rt_rq *q, int32_t token, const char *text, size_t len);
/* The request completed: its `done` (or HTTP ending) goes out, then it is gone. wid: the worker
 * that finished it (NULL: none, e.g. max_tokens reached between attempts). */
void rt_rq_finish(rt_router *r, rt_rq *q, km_finish finish, uint32_t cached, const char *wid);
/* A `cancel` for request rid to worker w. */
void rt_send_cancel(rt_router *r, rt_wk *w, uint64_t rid);

/* ---------------------------------------------------------------- dispatch.c: choosing a worker */

/* May w get a new request now: its connection is up, it did not just refuse one (503/529), and a
 * fresh view, when it names w, says "ready". */
bool rt_wk_routable(rt_router *r, rt_wk *w, uint64_t now);
/* Sends q to a worker, or queues or parks it. Returns 0, or a negative km_err when q was failed
 * and freed. */
int rt_dispatch(rt_router *r, rt_rq *q, bool from_queue);
/* Dispatches queued requests while workers take them; fails those past their deadline. */
void rt_pump_queue(rt_router *r);
/* When a refused client may retry: the queue ahead over the cluster's capacity, 0.1..30 s. */
uint32_t rt_retry_after_ms(rt_router *r);

/* ---------------------------------------------------------------- relay.c: streams, migration */

/* A worker's `tok`, `done`, `err` for one of its requests. */
void rt_relay_token(rt_router *r, rt_wk *w, const km_msg_token *t);
void rt_relay_done(rt_router *r, rt_wk *w, const km_msg_done *d);
void rt_relay_error(rt_router *r, rt_wk *w, const km_msg_error *e);
/* The worker is gone (or refused): send q elsewhere. */
void rt_migrate(rt_router *r, rt_rq *q, const char *why);
/* Every request at w goes elsewhere; cancel: also tell w to stop them. */
void rt_migrate_all(rt_router *r, rt_wk *w, const char *why, bool cancel);

/* ---------------------------------------------------------------- clients.c: the ZeroMQ front */

/* The ZeroMQ front's replies: `tok`, `done`, `err` frames behind the client's envelope. */
extern const rt_front_ops rt_front_zmq;
/* body behind a routing envelope on sock (the client front). */
int rt_zsend_env(void *sock, const km_zframe *env, int n_env, const km_buf *body);
/* An `err` frame to a client's envelope (for frames that never became a request). */
void rt_send_error_env(rt_router *r, const km_zframe *env, int n_env, uint64_t id, int code,
                       uint32_t retry_after, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
/* One message from the client front (envelope + body). */
void rt_on_front_message(rt_router *r, const km_zmsg *zm);
/* Does a client's model name mean the router's model (its name with or without the quantization
 * suffix, "default", --model-name or the fingerprint)? */
bool rt_model_ok(rt_router *r, const char *model);
/* The cache salt q is hashed under (common/sec.h km_cache_salt_compose): a keyed request's in its
 * tenant's namespace, an unkeyed one's as it came unless it names that namespace. KM_ERANGE
 * when the result is longer than a protocol salt (256 bytes). */
int rt_rq_compose_salt(rt_rq *q, const km_apikey_match *key);
/* The client gave up: a queued or parked request ends now (done: canceled); one at a worker is
 * canceled there, and the worker's done(canceled) ends it. */
void rt_rq_cancel(rt_router *r, rt_rq *q);
/* The client is gone (disconnected, HTTP connection closed): q ends now without a reply, and its
 * worker is told to stop. */
void rt_rq_abandon(rt_router *r, rt_rq *q);
/* The front's socket monitor (connections accepted and lost): a lost client's requests are
 * abandoned. */
int rt_front_monitor_open(rt_router *r, km_errbuf *err);
void rt_read_front_monitor(rt_router *r);

/* ---------------------------------------------------------------- tenants.c: ZeroMQ cache salts */

/* The --client-tenants file (path NULL or "": none, *out NULL). */
int rt_tenants_open(const char *path, rt_tenants **out, km_errbuf *err);
void rt_tenants_close(rt_tenants *t);
/* The tenant of a ZeroMQ client's key into m (its salt: "z:t:TENANT" when the file names the key,
 * else "z:k:KEYNAME"); false for an unauthenticated peer (insecure mode). t may be NULL. */
bool rt_tenant_of(rt_tenants *t, const km_zpeer *peer, km_apikey_match *m);

/* ---------------------------------------------------------------- fair.c: tenants share the queue
 */

/* The entry of tenant `name` ("" or NULL: the unkeyed one), made on first use; -1 when out of
 * memory. */
int rt_fair_tenant(rt_router *r, const char *name);
void rt_fair_free(rt_router *r);
/* q's tenant has `queued` more requests queued and `inflight` more at workers (+1 or -1). */
void rt_fair_count(rt_router *r, const rt_rq *q, int queued, int inflight);
/* Why a tenant's request was refused with 429 (kvmesh_router_tenant_refused_total{reason}). */
enum { RT_REFUSE_QUEUE, RT_REFUSE_TOKENS, RT_REFUSE_COUNT };
/* Must q be refused rather than queued: its keyed tenant has --max-queue-per-key queued
 * already (counted). */
bool rt_fair_refuse(rt_router *r, const rt_rq *q);
/* Must q (never sent yet) wait in the queue: its keyed tenant has --max-inflight-per-key
 * requests at workers already while another tenant is active. */
bool rt_fair_held(rt_router *r, const rt_rq *q);
/* How many requests beyond --max-inflight a worker may still take for q (never sent yet): its
 * keyed tenant's room under --max-inflight-per-key while another tenant is active, else 0. */
int rt_fair_room(rt_router *r, const rt_rq *q);
/* q arrives (its prompt tokenized): 0 when admitted (its prompt charged to its tenant's token
 * bucket), else the milliseconds until that bucket is out of debt (refusal counted). */
uint32_t rt_fair_admit(rt_router *r, const rt_rq *q);
/* q's tenant used n more tokens (generated). */
void rt_fair_tokens(rt_router *r, const rt_rq *q, int n);
/* The queued request to dispatch next: a migrated one first, else the oldest of a tenant not
 * held, the one with the fewest requests at workers (ties: the tenant served longest ago). NULL:
 * nothing may go. */
rt_rq *rt_fair_next(rt_router *r);

/* ---------------------------------------------------------------- prompt.c: text to tokens */

/* A text prompt (text: malloc'd, owned from here) becomes q's tokens, then rt_rq_start: bytes
 * over --max-prompt-bytes are refused first, short prompts are tokenized on the loop, long ones
 * on the thread pool (q is in the table meanwhile, with q->tokjob set). On failure q has been
 * answered and freed. */
void rt_rq_prepare(rt_router *r, rt_rq *q, char *text, size_t len, int add_special);
/* Everything after the prompt is in q->tokens: the chain, the key, the table, then dispatch.
 * On failure q has been answered and freed. */
int rt_rq_start(rt_router *r, rt_rq *q);
/* What the OpenAI response objects of q say besides the text. */
void rt_rq_oai_meta(rt_router *r, rt_rq *q, rt_oai_meta *m, const char *worker);

/* ---------------------------------------------------------------- front.c: choices
 * An OpenAI request with several choices (n, several prompts) runs as one request of the table
 * per choice; their group answers the client once: one body with every choice, or one stream
 * whose chunks carry their choice's index, ended when the last choice is. */
struct rt_hgroup {
    rt_router *r;
    km_http_req *http; /* NULL once the client is gone */
    int n, per, refs;  /* choices, of them per prompt (n); members not yet ended + holds */
    int n_done;
    bool stream, began, failed;
    rt_rq **m;        /* by choice; NULL once ended */
    rt_oai_choice *c; /* non-streaming: each finished choice (strings owned) */
    rt_oai_usage u;   /* summed over the choices (the prompt counted once per prompt) */
    char worker[KM_PROTO_MAX_NAME + 1]; /* the last worker that finished a choice */
};

/* ---------------------------------------------------------------- workers.c: links, KV events */

/* Fills a free worker slot (a released one first, else the next; no sockets yet). */
int rt_worker_slot_init(rt_router *r, const char *id, const char *req, const char *ev, rt_wk **out,
                        km_errbuf *err);
/* The worker's DEALER with its socket monitor, the SUB's connection to its events, their polls. */
int rt_worker_open(rt_router *r, rt_wk *w, km_errbuf *err);
/* Connects the events SUB to w's events endpoint, pinning w's member key (CURVE). */
int rt_sub_connect(rt_router *r, rt_wk *w, km_errbuf *err);
/* A slot a view added and no longer names, with nothing in flight: its sockets closed, its pages
 * forgotten, the slot free for the next worker a view adds. */
void rt_worker_release(rt_router *r, rt_wk *w);
/* w's connection is gone: its pages are forgotten and its requests migrate. */
void rt_worker_down(rt_router *r, rt_wk *w, const char *why);
/* A socket monitor on sock for these events (inproc endpoint ep), read from *mon (a PAIR). */
int rt_monitor_open(rt_router *r, void *sock, const char *ep, int events, void **mon,
                    km_errbuf *err);
/* The next event of a socket monitor (libzmq's two-part event message): 1 and the event and its
 * value (a descriptor for connection events), 0 when none is waiting. */
int rt_monitor_next(void *mon, uint16_t *event, uint32_t *value);
/* Connection events of w's DEALER (up: ask for a replay; down: rt_worker_down). */
void rt_read_monitor(rt_router *r, rt_wk *w);
/* One frame from w's DEALER: a stream frame, or part of a KV event replay. */
void rt_on_worker_frame(rt_router *r, rt_wk *w, const km_zframe *body);
/* One frame from the KV events SUB. */
/* A frame from w's events SUB: an event naming another worker is refused and counted. */
void rt_on_sub_frame(rt_router *r, rt_wk *w, const km_zframe *body);
/* From the tick: a replay that did not answer in time gives up on the worker's pages. */
void rt_sync_expire(rt_router *r, uint64_t now);
void rt_replay_clear(rt_wk *w);

/* ---------------------------------------------------------------- view.c: the controller's view */

/* One message from the view SUB (["view", frame]). */
void rt_on_view_message(rt_router *r, const km_zmsg *zm);
/* A view message that could not be used (counted and logged). */
void rt_view_bad(rt_router *r, const char *why);
/* From the tick: a view older than --view-timeout stops counting. */
void rt_view_check_age(rt_router *r, uint64_t now);

/* ---------------------------------------------------------------- metrics.c */

int rt_register_metrics(rt_router *r, km_errbuf *err);
/* The per-worker series (at start, and for a worker a view adds at run time). */
int rt_register_worker_metrics(rt_router *r, rt_wk *w, km_errbuf *err);
/* The per-worker page gauges and the index size, from the prefix index. */
void rt_update_page_gauges(rt_router *r);

/* ---------------------------------------------------------------- chunks.c: chunk credit */

/* The chunk preamble's first page of tokens (r->chunk_pre; left NULL when it is shorter). */
void rt_chunk_setup(rt_router *r);
/* q's chunk chains (q->chunk_chain), from its tokens and its tenant's prefix seed. */
int rt_chunk_chains(rt_router *r, rt_rq *q, km_pagehash tenant_seed);
/* Whether chunk g of q has a chain: a whole page at least, inside the prompt (the last chunk,
 * computed in full, has none either: callers stop before it). */
bool rt_chunk_has_chain(const rt_router *r, const rt_rq *q, const km_chunk_seg *g);
/* Adds to each usable candidate's cached tokens the chunk pages of q it holds, at the policy's
 * chunk_credit, but for chunks inside the prefix it holds (prefix: the prompt chain's match). */
void rt_chunk_credit(rt_router *r, const rt_rq *q, uint64_t workers, const rt_match *prefix,
                     uint64_t now_ms, rt_candidate *cand);
/* ---------------------------------------------------------------- pull.c: pull or recompute */

/* A view's figures for w (its transfer address, measured rates, page size). */
void rt_pull_view(rt_wk *w, const km_view_worker *vw);
/* Before the pick: each usable candidate that could pull a longer prefix than it holds, more
 * cheaply than computing it, gets the saved prefill in its cached credit (rt_pull_credit), so a
 * loaded holder loses to a less loaded worker that pulls (docs/router.md, "Hot prefixes"). */
void rt_pull_price(const rt_router *r, const rt_match *m, rt_candidate *cand);
/* After the pick: does another worker hold more of q's chain, and is pulling it cheaper? Sets
 * q's hint (or clears it) and counts the decision. */
void rt_pull_advise(rt_router *r, rt_rq *q, int pick, const rt_match *m);
/* The rule's decision for pick over the chain matched in m (its inputs as rt_pull_advise's). */
int rt_pull_choose(const rt_router *r, int pick, const rt_match *m, rt_pull_choice *ch);
/* Holders one request's chunk pulls may name: the hint's pull_from and its pull_more. */
#define RT_PULL_HOLDERS (1 + KM_PROTO_MAX_PULL_MORE)
/* Before the pick, with the mesh on: each usable candidate gets the credit of the chunk pulls
 * rt_chunk_pull_advise would give it (past the prefix it holds or would pull),
 * rt_chunk_pull_credit each; prefix: the prompt chain's match. */
void rt_chunk_pull_price(const rt_router *r, const rt_rq *q, const rt_match *prefix,
                         uint64_t workers, rt_candidate *cand);
/* With the mesh on: the chunks of q that another worker holds more of than pick, where pulling
 * them measures cheaper than the computation their reuse saves, join q's pull hint, each from
 * the holder the rule picks (at most RT_PULL_HOLDERS, the prefix pull's first):
 * q->pull_chunks for pull_w's, q->pull_more_* for the others, q->pull_ms their budget. */
void rt_chunk_pull_advise(rt_router *r, rt_rq *q, int pick, const rt_match *prefix,
                          uint64_t workers);
/* q ended on w with cached prompt tokens (and chunk_tokens reused from chunks): whether its hint
 * worked, which sets that pair's backoff (a failed hint keeps the pair from the next ones for a
 * while). */
void rt_pull_outcome(rt_router *r, rt_rq *q, rt_wk *w, uint32_t cached, uint32_t chunk_tokens);
/* q's hint, if any, into the request frame to the chosen worker. */
void rt_pull_hint(rt_router *r, rt_rq *q, km_msg_request *out);
/* May w be the source of a pull: it need not take requests; a draining worker still serves the
 * pages of the requests migrated off it. */
bool rt_wk_serves_pages(const rt_router *r, const rt_wk *w);
int rt_pull_metrics(rt_router *r, km_errbuf *err);

/* ---------------------------------------------------------------- pd.c: disaggregation */

/* With prefill and decode workers, prefill workers take no whole request (cand[i].usable);
 * routable: bit i when worker i may take requests (rt_wk_routable). */
void rt_pd_mask(rt_router *r, rt_candidate *cand, uint64_t routable);
/* After the pull advice: is q disaggregated (pick computes it from a prefill worker's pages as
 * they are sealed)? Sets q's hint (replacing a pull's) and q->pd, counts the decision. */
void rt_pd_advise(rt_router *r, rt_rq *q, int pick, const rt_match *m, int n_ctx,
                  uint64_t routable);
int rt_pd_metrics(rt_router *r, km_errbuf *err);

/* ---------------------------------------------------------------- front.c: HTTP */

/* Starts the HTTP front on the router's loop (nothing when the config turns it off): /healthz,
 * /readyz, /metrics, /v1/models, /v1/status (and /status), /v1/completions,
 * /v1/chat/completions, by front.c's route table. */
int rt_front_start(rt_router *r, km_errbuf *err);
/* The HTTP front's replies: SSE chunks for a stream, else one JSON body (openai.h). */
extern const rt_front_ops rt_front_http;

#endif /* RT_INTERNAL_H */
