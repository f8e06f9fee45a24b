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
 * This header is the daemon's API: its configuration and its life cycle (what router/main.c and
 * `kvmesh up` need). Everything else in router/ is private to it: the routing core (route.h:
 * prefix index, event streams, policy, view rules), the OpenAI layer (openai.h), the HTTP server
 * (http.h) and the daemon's own state shared by its files (internal.h). Names are rt_.
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

/* ---------------------------------------------------------------- routing policy (policy.c) */

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
    /* pull or recompute (router/pull.c, docs/transfer.md) */
    double pull_margin;      /* pull when its cost < recompute's x this (0.8) */
    double pull_default_bps; /* pull rate assumed before any is measured (RT_PULL_DEFAULT_BPS);
                              * 0: none (recompute until measured) */
    /* disaggregation (router/pd.c): uncached prompt tokens on the decode worker from which a
     * prefill worker computes the prompt (RT_PD_MIN_TOKENS); 0: never */
    int pd_min_tokens;
    /* chunk credit (chunks.c): a worker holding a request's chunk pages is credited this share
     * of their tokens (the rest is the recompute that repairs them); 0: chunks not credited */
    double chunk_credit;
} rt_policy;

/* The default --pd-min-tokens: docs/disaggregation.md says why (the workers' default
 * --max-batch-tokens: a shorter prompt is computed in one engine step). */
#define RT_PD_MIN_TOKENS 512

/* The starting pull rate, bytes/s: the order of a pull's rate between two workers on one host
 * or a 10 GbE link, measured end to end (request, offer, reads, import) by `make bench-pull`
 * (docs/transfer.md, "On by default"). Measured rates replace it as pulls happen. */
#define RT_PULL_DEFAULT_BPS 1e9

void rt_policy_default(rt_policy *p);

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
    int worker_slots;      /* requests a worker runs at once (cost model) */
    int max_inflight;      /* per worker, sent by this router; more wait in the router queue */
    int max_queue;         /* router queue; beyond it: 529 */
    int max_queue_per_key; /* queued requests of one keyed tenant; beyond: 429 (fair.c); 0: off */
    int max_inflight_per_key; /* one keyed tenant's requests at workers while another tenant is
                               * active; more wait; 0: off */
    double max_tokens_per_sec_per_key; /* a keyed tenant's prompt+generated tokens/s; 0: off */
    int max_attempts; /* a request fails after this many different workers failed it, or this
                       * many attempts in a row gave no token */
    uint32_t default_max_tokens;
    uint32_t max_ctx; /* prompt + completion tokens, as the workers' --max-ctx: an HTTP request
                       * asking for more is 400 context_length_exceeded; 0: not checked here */
    uint32_t sync_timeout_ms; /* replay wait before forgetting a worker's pages */
    size_t index_pages;
    uint32_t pending_ttl_ms;
    size_t max_http_body;
    size_t max_http_buffered;    /* request bytes the HTTP front holds at once (default 256 MiB) */
    size_t max_prompt_bytes;     /* a text prompt longer than this gets 413 before tokenization
                                  * (default 1 MiB; 0: no limit) */
    uint32_t request_timeout_ms; /* every request ends by then at the latest (504); default
                                  * 600000, 0: none */
    uint32_t queue_timeout_ms;   /* a request waiting longer in the router queue gets 503 */
    bool migrate_replay;         /* greedy/seeded migrations regenerate the streamed tokens;
                                  * default false: every migration continues from prompt + streamed
                                  * tokens (exact too: the engine's prefill equals its decode, and
                                  * req.generated keeps a seeded sampler's draws in step) */
    const char *controller_url;  /* the controller's view PUB; NULL: no controller (workers must
                                  * then be given) */
    uint32_t view_timeout_ms;    /* a view older than this is ignored (default 5000) */
    /* CURVE (docs/security.md): the front admits clients and operators, each worker's DEALER
     * and events connection pins that worker id's member key, the view SUB the key
     * "controller"; NULL or insecure: none. Owned by the caller, outlives the router. */
    const km_zsec *sec;
    /* HTTP API keys (common/sec.h: `b2:HASH TENANT ROLE [salt=S]` lines, re-read when changed):
     * every HTTP request but /healthz and /readyz needs a Bearer key, /v1/status and /metrics an
     * operator's, and each key's requests are hashed under its tenant's cache salt. NULL: the
     * HTTP front is open (only with --insecure or without an HTTP port, main.c decides). */
    const char *api_keys;
    /* ZeroMQ clients' tenants (`KEYNAME TENANT` lines, re-read when changed): keys named in one
     * tenant share its cache; every other key is a tenant of its own. NULL: none. */
    const char *client_tenants;
    /* HTTPS on the OpenAI front (PEM certificate chain and key, TLS 1.2+); NULL: plain HTTP. */
    const char *tls_cert, *tls_key;
    /* CORS on the HTTP front (docs/openai.md): "*" or a comma-separated list of origins whose
     * browsers may call it (preflight answered, Access-Control-Allow-Origin set); NULL: off. */
    const char *cors_origins;
    int max_n; /* most choices one OpenAI request may ask for (n, prompt lists); default 8 */
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
