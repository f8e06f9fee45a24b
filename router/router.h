/*
 * router.h — kvmesh-router: the front door of a kvmesh cluster. It accepts requests from clients
 * (ZeroMQ ROUTER socket speaking docs/protocol.md, and an OpenAI-compatible HTTP API), tokenizes
 * them with the model's tokenizer, computes their page-hash chain with the same code as the
 * workers (km_pagehash_*), picks a worker by the cost model of DESIGN.md "Routing", relays the
 * token stream back, and migrates a request to another worker when its worker dies.
 * Design notes and figures: docs/router.md; the HTTP API: docs/openai.md.
 *
 * Contract:
 *  - The router owns no state that cannot be rebuilt: its prefix index is built from the workers'
 *    KV events (PUB/SUB, per-worker sequence numbers); a gap is repaired by asking the worker for
 *    a replay (`kv_sync`), and when that fails the worker's pages are forgotten, which can cost a
 *    cache miss but never a wrong answer (workers verify every hit against token ids). Replicas
 *    fed the same events route alike.
 *  - Every request gets exactly one end: `done` or `err`. Queues are bounded; a full cluster
 *    answers `err` 529 ("overloaded") with retry_after_ms. A request whose worker dies is re-sent
 *    to another worker with its prompt plus the tokens already streamed (at most max_attempts
 *    times, then `err` 503); the client sees one stream with consecutive indexes.
 *  - Nothing aborts or exits on outside input: malformed frames, bad JSON, hostile HTTP get an
 *    error reply and a counter, and every other request keeps being served.
 *  - One thread: the router runs one libuv loop that watches the ZeroMQ sockets' descriptors,
 *    the HTTP listener and its timers. rt_router_stop is the only call safe from another thread
 *    (or a signal handler's thread).
 *
 * Naming: everything exported here is rt_. The parts below (index, event streams, policy,
 * OpenAI layer, HTTP server) are separate so that each is unit-tested on its own
 * (tests/unit/test_router*.c).
 */
#ifndef RT_ROUTER_H
#define RT_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/km.h"
#include "common/svc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RT_MAX_WORKERS 64 /* worker slots one router tracks (bit masks in the index) */

/* ---------------------------------------------------------------- prefix index (index.c)
 * page hash -> which workers hold the page and in which tier. Open addressing over a table
 * sized at creation (bounded memory); a store into a full index is dropped and counted. Besides
 * what events say, the router marks pages it has just sent to a worker as *pending* there (the
 * worker will store them once its prefill runs); pending marks expire after pending_ttl_ms unless
 * an event confirms them, so requests that share a prefix land together even before the first
 * one's pages are published. */

typedef struct rt_index rt_index;

typedef struct rt_match {
    int pages[RT_MAX_WORKERS];     /* leading pages of the chain the worker holds (or pending) */
    double credit[RT_MAX_WORKERS]; /* cached tokens, each page weighted by its tier's credit */
} rt_match;

/* max_pages: most distinct pages indexed (memory is about 64 bytes each). */
int rt_index_create(size_t max_pages, uint32_t pending_ttl_ms, rt_index **out);
void rt_index_destroy(rt_index *x);
/* Applies one KV event of worker w (0..RT_MAX_WORKERS-1). Returns how many pages could not be
 * stored because the index is full (0 normally), or KM_EINVAL. */
int rt_index_apply(rt_index *x, int w, km_kv_event_kind kind, km_tier tier, km_tier from_tier,
                   const km_pagehash *hashes, int n);
/* Marks the chain's pages as pending on w at time now_ms (not counted in rt_index_pages). */
void rt_index_mark_pending(rt_index *x, int w, const km_pagehash *chain, int n, uint64_t now_ms);
/* Forgets every page of w (after a failed catch-up, or when w died). */
void rt_index_forget_worker(rt_index *x, int w);
/* For every worker in `workers` (bit mask): how many leading pages of chain[0..n) it holds and
 * their credit in tokens (page_tokens * tier_credit[tier]; pending pages count as hot). */
void rt_index_match(const rt_index *x, const km_pagehash *chain, int n, uint64_t workers,
                    const double tier_credit[KM_TIER_COUNT], int page_tokens, uint64_t now_ms,
                    rt_match *out);
uint64_t rt_index_pages(const rt_index *x, int w, km_tier tier); /* confirmed pages */
size_t rt_index_size(const rt_index *x);                         /* distinct pages held */
uint64_t rt_index_dropped(const rt_index *x);                    /* stores lost to a full index */
/* Clears expired pending marks (the router calls it from a timer). */
void rt_index_sweep(rt_index *x, uint64_t now_ms);

/* ---------------------------------------------------------------- event streams (evstream.c)
 * Orders one worker's KV events by sequence number. Events in order are applied at once;
 * duplicates (seq below the next expected) are dropped; an event past a gap is held back (up to
 * `cap` events) and the caller is told to ask the worker for a replay. When the replay fills the
 * gap the held events are applied in order; when it cannot (the worker no longer has them, or
 * never answers), rt_evstream_resync forgets the worker and continues from the held events. */

typedef struct rt_evstream rt_evstream;

typedef void (*rt_ev_apply_fn)(void *user, const km_msg_kv_event *ev);

typedef enum rt_ev_result {
    RT_EV_APPLIED = 0, /* applied (and possibly held events after it) */
    RT_EV_DUPLICATE,   /* already seen: dropped */
    RT_EV_HELD,        /* past a gap, held back; a replay is already being asked for */
    RT_EV_GAP,         /* past a gap, held back: ask the worker to replay from rt_evstream_next */
    RT_EV_OVERFLOW,    /* too many held: the caller must rt_evstream_resync now */
} rt_ev_result;

int rt_evstream_create(int cap, rt_evstream **out);
void rt_evstream_destroy(rt_evstream *s);
/* A new stream expects seq 0 (the first event a worker's store numbers); the router starts
 * every worker with a replay from 0, so a router started late still learns the whole history
 * when the worker kept it. */
rt_ev_result rt_evstream_push(rt_evstream *s, const km_msg_kv_event *ev, rt_ev_apply_fn apply,
                              void *user);
uint64_t rt_evstream_next(const rt_evstream *s); /* seq expected next */
bool rt_evstream_waiting(const rt_evstream *s);  /* a replay is outstanding */
void rt_evstream_set_waiting(rt_evstream *s, bool waiting);
/* Gives up on the gap: the caller forgets the worker's pages first; the stream then continues
 * from the lowest held event, applying what it holds in order, or, when it holds none, adopts
 * the next event's seq as it comes. Returns the number of events applied. */
int rt_evstream_resync(rt_evstream *s, rt_ev_apply_fn apply, void *user);
/* Continues at `next` (after a snapshot covering everything before it): held events below it
 * are dropped, the rest applied in order. Returns the number applied. */
int rt_evstream_jump(rt_evstream *s, uint64_t next, rt_ev_apply_fn apply, void *user);
/* The worker restarted (its sequence began again): forget held events, expect seq 0. */
void rt_evstream_reset(rt_evstream *s);
uint64_t rt_evstream_gaps(const rt_evstream *s); /* gaps seen */

/* ---------------------------------------------------------------- policy (policy.c) */

typedef enum rt_mode {
    RT_MODE_KV = 0,      /* cost model: uncached prefill + decode load + queue */
    RT_MODE_ROUND_ROBIN, /* ignores the cache (benchmark baseline) */
    RT_MODE_RANDOM,      /* ignores the cache (benchmark baseline) */
    RT_MODE_COUNT
} rt_mode;

const char *rt_mode_name(rt_mode m);
int rt_mode_parse(const char *s, rt_mode *out); /* "kv", "round-robin", "random" */

typedef struct rt_policy {
    rt_mode mode;
    double w_prefill;                  /* cost of one uncached prompt token (1) */
    double w_decode;                   /* cost of one running request on the worker (32) */
    double w_queue;                    /* cost of one request waiting at the worker (256) */
    double tier_credit[KM_TIER_COUNT]; /* fraction of a cached page's tokens saved: 1, .8, .5 */
    double tie_band;                   /* costs within this of the best tie (16) */
} rt_policy;

void rt_policy_default(rt_policy *p);

typedef struct rt_candidate {
    const char *id;       /* worker id: rendezvous hashing uses it, so replicas agree */
    bool usable;          /* connected, not draining */
    int inflight;         /* requests this router has running there */
    int slots;            /* requests the worker runs at once; beyond that they queue */
    int max_inflight;     /* the router sends no more than this; 0 = no limit */
    double cached_tokens; /* rt_match credit for this request */
} rt_candidate;

/* The rendezvous weight of (key, worker): the highest weight wins ties and cold prefixes. */
uint64_t rt_rendezvous(km_pagehash key, const char *worker_id);
/* Cost of sending a request with n_prompt tokens to c (RT_MODE_KV's formula). */
double rt_cost(const rt_policy *p, const rt_candidate *c, int n_prompt);
/* Picks a candidate index, or KM_EOVERLOAD when every usable one is at max_inflight, or
 * KM_ENOTFOUND when none is usable. *state carries the round-robin position and random state. */
int rt_pick(const rt_policy *p, const rt_candidate *c, int n, int n_prompt, km_pagehash key,
            uint64_t *state);

/* ---------------------------------------------------------------- OpenAI layer (openai.c)
 * JSON in and out of the HTTP API (jansson): request bodies into a generation spec, token
 * streams into chunk objects and SSE events, errors into OpenAI's error shape. */

typedef struct rt_oai_msg {
    char *role, *content;
} rt_oai_msg;

typedef struct rt_oai_req {
    bool chat;        /* /v1/chat/completions */
    char *model;      /* NULL: the router's model */
    char *prompt;     /* completions */
    rt_oai_msg *msgs; /* chat */
    int n_msgs;
    uint32_t max_tokens; /* 0: the router's default */
    float temperature, top_p, min_p, presence_penalty, frequency_penalty, repeat_penalty;
    int32_t top_k;
    bool has_seed;
    uint64_t seed;
    char *stop[KM_PROTO_MAX_STOP];
    int n_stop;
    bool stream, include_usage;
    char *cache_salt; /* "user" or the extension "cache_salt" */
    int32_t priority;
} rt_oai_req;

typedef struct rt_oai_err {
    int status; /* HTTP status */
    char message[512];
    const char *type;  /* "invalid_request_error", "server_error", ... */
    const char *param; /* offending field or NULL */
    const char *code;  /* machine code or NULL */
} rt_oai_err;

/* Parses a request body. 0 or KM_EFORMAT/KM_EINVAL with e filled (status 400). */
int rt_oai_parse(const char *body, size_t len, bool chat, rt_oai_req *out, rt_oai_err *e);
void rt_oai_req_free(rt_oai_req *r);

/* What the response objects say besides the text. */
typedef struct rt_oai_meta {
    bool chat;
    const char *id; /* "cmpl-..." / "chatcmpl-..." */
    const char *model;
    int64_t created;    /* unix seconds */
    const char *worker; /* extension field "kvmesh": {"worker": ...}; NULL = omitted */
} rt_oai_meta;

typedef struct rt_oai_usage {
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
} rt_oai_usage;

/* One SSE event "data: {chunk}\n\n" with a text delta (finish NULL) or a finish reason. */
int rt_oai_sse_chunk(km_buf *out, const rt_oai_meta *m, const char *text, size_t len,
                     const char *finish);
/* The usage chunk of stream_options.include_usage (choices: []). */
int rt_oai_sse_usage(km_buf *out, const rt_oai_meta *m, const rt_oai_usage *u);
/* "data: [DONE]\n\n" */
int rt_oai_sse_done(km_buf *out);
/* An SSE event carrying an error object (a stream that fails after it began). */
int rt_oai_sse_error(km_buf *out, const rt_oai_err *e);
/* The whole non-streaming response. */
int rt_oai_response(km_buf *out, const rt_oai_meta *m, const char *text, size_t len,
                    const char *finish, const rt_oai_usage *u);
/* {"error": {"message", "type", "param", "code"}} */
int rt_oai_error_json(km_buf *out, const rt_oai_err *e);
/* /v1/models */
int rt_oai_models(km_buf *out, const char *model, int64_t created);
/* The HTTP status and error type for a protocol error code (529 -> 429 rate_limit_exceeded...). */
void rt_oai_err_from_code(int code, const char *message, rt_oai_err *e);
/* The OpenAI finish_reason for a km_finish ("stop", "length"). */
const char *rt_oai_finish(km_finish f);

/* ---------------------------------------------------------------- HTTP server (http.c)
 * kvmesh's one HTTP server (common/http.h) under the router's names: HTTP/1.1 on a libuv loop
 * with picohttpparser (from libh2o) as the parser: keep-alive, pipelining (answered in order),
 * request bodies by Content-Length or chunked, responses either whole or streamed with chunked
 * transfer encoding (SSE). Limits: head 16 KiB, body max_body, max_conns connections, idle
 * timeout. Errors the server answers itself are OpenAI error objects. */

typedef struct rt_http rt_http;
typedef struct km_http_req rt_http_req; /* common/http.h's request */

typedef struct rt_http_opts {
    const char *host; /* default "127.0.0.1" */
    int port;         /* 0: ephemeral */
    size_t max_body;  /* default 4 MiB */
    int max_conns;    /* default 1024 */
    int idle_ms;      /* default 60000 */
    /* Called once per request; the handler answers now or later (rt_http_respond or the stream
     * calls). */
    void (*handler)(rt_http_req *r, void *user);
    void *user;
} rt_http_opts;

/* loop is a uv_loop_t *. */
int rt_http_start(void *loop, const rt_http_opts *o, rt_http **out, km_errbuf *err);
int rt_http_port(const rt_http *h);
/* Closes the listener and every connection (their requests' abort callbacks run); frees h once
 * the loop has run the close callbacks. */
void rt_http_stop(rt_http *h);
uint64_t rt_http_requests(const rt_http *h); /* requests parsed */

const char *rt_http_method(const rt_http_req *r);
const char *rt_http_path(const rt_http_req *r); /* without the query string */
const char *rt_http_body(const rt_http_req *r, size_t *len);
/* The value of a header (case-insensitive name), NUL-terminated, or NULL. */
const char *rt_http_header(const rt_http_req *r, const char *name);
/* A whole response; ends the request. */
int rt_http_respond(rt_http_req *r, int status, const char *ctype, const void *body, size_t len);
/* extra_headers: "Name: value\r\n" lines or NULL. */
int rt_http_respond_h(rt_http_req *r, int status, const char *ctype, const char *extra_headers,
                      const void *body, size_t len);
/* A streamed response (chunked); write any number of times, then end. */
int rt_http_stream_begin(rt_http_req *r, int status, const char *ctype);
int rt_http_stream_write(rt_http_req *r, const void *data, size_t len);
int rt_http_stream_end(rt_http_req *r);
/* Called (once) when the connection goes away before the response ended; r is invalid after. */
void rt_http_on_abort(rt_http_req *r, void (*fn)(rt_http_req *r, void *user), void *user);

/* ---------------------------------------------------------------- cluster view (view.c)
 * With --controller the router subscribes to the controller's view (two-part PUB messages
 * ["view", km_msg_view frame]) and acts on it: only "ready" members get new requests; "starting",
 * "draining" and "restarting" members keep their in-flight requests but get nothing new; a
 * "dead" member's in-flight requests migrate as on a disconnect. Members are matched to the
 * router's workers by requests endpoint (normalised below); a member with an unknown endpoint is
 * connected at run time. While no view has arrived for view_timeout_ms the view is *stale* and
 * ignored: the router's own liveness alone decides, so a controller outage never stops serving.
 * A worker the view does not name is routed by liveness alone, too (a fresh controller's first
 * views may not list every worker yet). */

/* Canonical form of a ZeroMQ endpoint for comparing: scheme and host lower-cased; loopback and
 * wildcard hosts (localhost, 0.0.0.0, *, [::1], [::]) become 127.0.0.1. 0 or KM_EINVAL /
 * KM_ERANGE. */
int rt_endpoint_norm(const char *url, char *out, size_t cap);
bool rt_endpoint_same(const char *a, const char *b);
/* May a worker get new requests? connected: the router's own liveness (a veto); view_fresh: a
 * view arrived within the timeout; in_view: that view names the worker with `state`. */
bool rt_member_routable(bool connected, bool view_fresh, bool in_view, km_member_state state);
/* Must the worker's in-flight requests migrate because the view says it is dead? */
bool rt_member_migrates(bool view_fresh, bool in_view, km_member_state state);

/* ---------------------------------------------------------------- the router daemon (router.c) */

typedef struct rt_worker_cfg {
    const char *id;           /* the id its KV events carry */
    const char *requests_url; /* its ROUTER endpoint */
    const char *events_url;   /* its PUB endpoint */
} rt_worker_cfg;

typedef struct rt_config {
    const char *model_path;       /* GGUF: tokenizer, chat template, fingerprint */
    const char *model_name;       /* name clients use; NULL: from the file name */
    const char *fingerprint;      /* NULL: computed like the worker does */
    uint64_t cluster_seed;        /* must equal the workers' */
    int page_tokens;              /* must equal the workers' (16) */
    const char *front_url;        /* ZeroMQ ROUTER for clients, e.g. tcp://127.0.0.1:7000 */
    const char *http_host;        /* OpenAI HTTP; NULL or port < 0: off */
    int http_port;                /* 0: ephemeral */
    const char *admin_host;       /* admin HTTP host; NULL: 127.0.0.1 */
    int admin_port;               /* /metrics, /healthz, /readyz; < 0: off */
    const rt_worker_cfg *workers; /* may be empty with a controller: its view adds workers */
    int n_workers;
    rt_policy policy;
    int worker_slots; /* requests a worker runs at once (cost model) */
    int max_inflight; /* per worker, sent by this router; more wait in the router queue */
    int max_queue;    /* router queue; beyond it: 529 */
    int max_attempts; /* worker tries per request (migrations + 1) */
    uint32_t default_max_tokens;
    uint32_t sync_timeout_ms; /* replay wait before forgetting a worker's pages */
    size_t index_pages;
    uint32_t pending_ttl_ms;
    size_t max_http_body;
    uint32_t queue_timeout_ms;  /* a request waiting longer in the router queue gets 503 */
    bool migrate_replay;        /* greedy/seeded migrations regenerate (exact), else continue */
    const char *controller_url; /* the controller's view PUB; NULL: no controller (workers must
                                 * then be given) */
    uint32_t view_timeout_ms;   /* a view older than this is ignored (default 5000) */
} rt_config;

void rt_config_default(rt_config *c);

typedef struct rt_router rt_router;

int rt_router_create(const rt_config *c, rt_router **out, km_errbuf *err);
/* Runs until rt_router_stop. */
int rt_router_run(rt_router *r);
/* Thread-safe and async-signal-safe enough (uv_async_send). */
void rt_router_stop(rt_router *r);
void rt_router_destroy(rt_router *r);
int rt_router_front_endpoint(const rt_router *r, char *buf, size_t cap);
int rt_router_http_port(const rt_router *r);
int rt_router_admin_port(const rt_router *r);

#ifdef __cplusplus
}
#endif
#endif /* RT_ROUTER_H */
