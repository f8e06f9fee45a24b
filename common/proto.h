/*
 * proto.h — the kvmesh wire protocol: every message exchanged over ZeroMQ as one msgpack map with
 * "v" (version) and "t" (type), held in C as a km_msg, encoded with km_msg_encode and decoded with
 * km_msg_decode. docs/protocol.md is the specification (enough to write a client in any
 * language); it and the files behind this header change together.
 *
 * Contract:
 *  - Every wire field is a km_msg field: no code outside common/proto*.c reads or writes msgpack,
 *    and no frame is patched or peeked into by hand.
 *  - The encoder validates first (km_msg_validate, the same checks the decoder applies after the
 *    types), so a sender can never emit a frame a receiver rejects.
 *  - Decoding never trusts a length: a bounds scan walks the raw bytes before msgpack-c builds
 *    anything, so a hostile frame costs at most a small multiple of its own size; a malformed
 *    frame is an error code and a message naming the field (the decoder is fuzzed), and a
 *    rejected frame still names its request id when it had a readable one (rejected_id).
 *  - Ownership: a decoded km_msg owns its strings and arrays until km_msg_clear; an encoded
 *    frame lives in the caller's km_buf. A km_msg being filled for encoding points to the
 *    caller's memory and owns nothing.
 *  - This header includes no third-party header.
 *
 * Behind it: proto.c (the entry points, names, limits), proto_wire.c (msgpack helpers),
 * proto_scan.c (the bounds scan) and one file per message family: proto_stream.c (req, tok,
 * done, err, cancel), proto_admin.c (admin, admin_reply), proto_hb.c (hb), proto_kv.c (kv),
 * proto_view.c (view), proto_pull.c (kv_pull, kv_offer, kv_pull_done).
 */
#ifndef KM_PROTO_H
#define KM_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/km.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KM_PROTO_VERSION          1
#define KM_PROTO_MAX_FRAME        (1u << 20)  /* default max frame bytes */
#define KM_PROTO_MAX_NAME         256         /* model, worker id, cache_salt, stop, format, ... */
#define KM_PROTO_MAX_MESSAGE      1024        /* error and admin reply messages */
#define KM_PROTO_MAX_PIECE        1024        /* text of one token frame */
#define KM_PROTO_MAX_STOP         16          /* stop strings per request */
#define KM_PROTO_MAX_DRAFT        256         /* req.max_draft_tokens */
#define KM_PROTO_MAX_BIAS         1024        /* req.logit_bias entries */
#define KM_PROTO_MAX_TOP          20          /* req.top_logprobs, tok.top entries */
#define KM_PROTO_MAX_CHUNKS       64          /* req.chunks segments */
#define KM_PROTO_MAX_PULL_MORE    3           /* req.pull_more: chunk holders past pull_from */
#define KM_PROTO_MAX_GRAMMAR      (64u << 10) /* req.grammar bytes */
#define KM_PROTO_MAX_PROMPT_TOK   (1u << 18)  /* default max prompt token ids */
#define KM_PROTO_MAX_EVENT_HASHES 8192        /* default max page hashes per KV event */
#define KM_PROTO_MAX_ENDPOINTS    16
#define KM_PROTO_MAX_KV_ENTRIES   256
#define KM_PROTO_MAX_QUANTILES    16
#define KM_PROTO_MAX_ERROR_KINDS  64
#define KM_PROTO_MAX_VIEW_WORKERS 256  /* workers in one cluster view */
#define KM_PROTO_MAX_HISTORY      32   /* recovery actions kept per worker in a view */
#define KM_PROTO_MAX_PULL_PAGES   4096 /* pages in one kv_pull / kv_offer (peer.h PR_MAX_PAGES) */
#define KM_PROTO_MAX_PAGE_TOKENS  1024 /* tokens per KV page in kv_pull / kv_offer */
#define KM_PROTO_LEASE_KEY        32   /* bytes of a kv_offer's lease secret (PR_KEY_BYTES) */
#define KM_PROTO_MAX_WARM_PAGES   (1 << 20) /* pages one kv_warm asks for */
#define KM_PROTO_MAX_PEER_ADDR    4096      /* bytes of a transfer node's address (hb, view, req) */
#define KM_PROTO_MAX_XFER_PAIRS   16        /* holders a worker reports its own pull figures from */

/* What a decoder accepts; km_proto_limits_default fills the defaults above. */
typedef struct km_proto_limits {
    size_t max_frame;          /* whole frame bytes */
    uint32_t max_prompt_tok;   /* request.tokens length */
    uint32_t max_event_hashes; /* kv_event.hashes length */
} km_proto_limits;

void km_proto_limits_default(km_proto_limits *l);

typedef enum km_msg_type {
    KM_MSG_NONE = 0,
    KM_MSG_REQUEST,      /* "req"         client/router -> worker */
    KM_MSG_TOKEN,        /* "tok"         worker -> router/client, one per generated token */
    KM_MSG_DONE,         /* "done"        worker -> router/client, ends a stream */
    KM_MSG_ERROR,        /* "err"         any -> peer, ends a request (or reports a bad frame) */
    KM_MSG_CANCEL,       /* "cancel"      client/router -> worker */
    KM_MSG_ADMIN,        /* "admin"       controller/operator -> worker */
    KM_MSG_ADMIN_REPLY,  /* "admin_reply" worker -> controller/operator */
    KM_MSG_HEARTBEAT,    /* "hb"          worker -> controller */
    KM_MSG_KV_EVENT,     /* "kv"          worker -> routers (PUB) */
    KM_MSG_VIEW,         /* "view"        controller -> routers (PUB), and -> operator (status) */
    KM_MSG_KV_PULL,      /* "kv_pull"      worker -> worker: pin these pages of a chain for me */
    KM_MSG_KV_OFFER,     /* "kv_offer"     worker -> worker: the pages pinned, where they lie */
    KM_MSG_KV_PULL_DONE, /* "kv_pull_done" worker -> worker: the lease can end */
    KM_MSG_KV_PUSH,      /* "kv_push"      worker -> worker: pull this chain from me (handoff) */
    KM_MSG_KV_WARM,      /* "kv_warm"      worker -> worker: push me your chains (warm-up) */
    KM_MSG_TYPE_COUNT
} km_msg_type;

const char *km_msg_type_name(km_msg_type t); /* the wire "t" value; "?" when unknown */

/* Error codes carried in error frames and failed admin replies (docs/protocol.md). Any value in
 * 1..999 decodes, so a newer peer's codes pass through; these are the ones defined today. */
typedef enum km_proto_code {
    KM_CODE_BAD_REQUEST = 400, /* malformed frame or invalid field */
    KM_CODE_FORBIDDEN = 403,   /* the sender's key may not do this (docs/security.md) */
    KM_CODE_NOT_FOUND = 404,   /* unknown model or request id */
    KM_CODE_TOO_LARGE = 413,   /* frame, prompt or context too large */
    KM_CODE_VERSION = 426,     /* unsupported protocol version */
    KM_CODE_RATE_LIMIT = 429,  /* the sender's key is past a limit of its own: retry after */
    KM_CODE_CANCELED = 499,    /* canceled by the client */
    KM_CODE_INTERNAL = 500,    /* bug or unexpected failure in the server */
    KM_CODE_UNAVAILABLE = 503, /* draining, shutting down or not ready: retry elsewhere */
    KM_CODE_OVERLOADED = 529,  /* queue full: retry after retry_after_ms */
    KM_CODE_DEADLINE = 504,    /* deadline_ms passed before completion */
} km_proto_code;

const char *km_proto_code_name(int code); /* "bad_request", ...; "unknown" */
/* The error code a peer should see for a local km_err (KM_EFORMAT -> BAD_REQUEST, ...). */
int km_proto_code_from_err(int err);

typedef enum km_finish {
    KM_FINISH_STOP = 0, /* "stop": end-of-generation token or a stop string */
    KM_FINISH_LENGTH,   /* "length": max_tokens or the context limit */
    KM_FINISH_CANCELED, /* "canceled" */
    KM_FINISH_DEADLINE, /* "deadline" */
    KM_FINISH_COUNT
} km_finish;

const char *km_finish_name(km_finish f);

/* Speculative decoding a request asks for (docs/speculative.md). */
typedef enum km_speculate {
    KM_SPECULATE_DEFAULT = 0, /* "default" (or the key absent): the worker's --speculate */
    KM_SPECULATE_OFF,         /* "off": no drafts */
    KM_SPECULATE_AUTO,        /* "auto": drafts where the worker's step-cost budget says they pay */
    KM_SPECULATE_SELF,        /* "self": drafts by the model itself over a 4-bit copy of the KV
                               * (a worker started with --speculate self; elsewhere "auto") */
    KM_SPECULATE_COUNT
} km_speculate;

/* A token id with a number: a logit bias (req.logit_bias), or an alternative's log-probability
 * (tok.top). */
typedef struct km_token_value {
    int32_t token;
    float value;
} km_token_value;

/* A segment of a request's token prompt marked as a reusable chunk (req.chunks): ids
 * [start, start + n). */
typedef struct km_chunk_seg {
    uint32_t start, n;
} km_chunk_seg;

/* Another holder of a request's chunks (req.pull_more): a worker id and its chunks, a bit each. */
typedef struct km_pull_more {
    const char *from;
    uint64_t chunks;
} km_pull_more;

const char *km_speculate_name(km_speculate s);

typedef enum km_tier { KM_TIER_HOT = 0, KM_TIER_HOST = 1, KM_TIER_DISK = 2, KM_TIER_COUNT } km_tier;

typedef enum km_kv_event_kind {
    KM_KV_STORED = 0, /* "stored": pages now held in `tier` */
    KM_KV_REMOVED,    /* "removed": pages gone from the worker */
    KM_KV_TIER,       /* "tier": pages moved from `from_tier` to `tier` */
    KM_KV_KIND_COUNT
} km_kv_event_kind;

typedef enum km_admin_cmd {
    KM_ADMIN_STATUS = 0,    /* "status" */
    KM_ADMIN_EVICT,         /* "evict": evict the oldest `fraction` of unpinned pages */
    KM_ADMIN_SET_KV_FORMAT, /* "set_kv_format": switch KV pages to `format` */
    KM_ADMIN_DRAIN,         /* "drain": take no new requests, finish or migrate in-flight ones */
    KM_ADMIN_SHUTDOWN,      /* "shutdown": exit (with the restart code when `restart`) */
    KM_ADMIN_RECOVER,       /* "recover": operator -> controller: force `level` on `worker` */
    KM_ADMIN_PRESSURE,      /* "pressure": chaos/test only: the worker pins `fraction` of its
                             * hot-tier budget in ballast pages (0 releases them); refused unless
                             * the worker runs with --chaos */
    KM_ADMIN_SET_ROLE,      /* "set_role": operator or controller -> worker: take `role` */
    KM_ADMIN_CMD_COUNT
} km_admin_cmd;

const char *km_admin_cmd_name(km_admin_cmd c);

typedef enum km_worker_state {
    KM_STATE_STARTING = 0, /* "starting" */
    KM_STATE_READY,        /* "ready" */
    KM_STATE_DRAINING,     /* "draining" */
    KM_STATE_STOPPING,     /* "stopping" */
    KM_STATE_COUNT
} km_worker_state;

const char *km_worker_state_name(km_worker_state s);

/* What a worker computes (docs/disaggregation.md): both (default), prefill (prompts for decode
 * workers to pull) or decode (requests whose prompts a prefill worker computes when long). */
typedef enum km_worker_role {
    KM_WROLE_BOTH = 0, /* "both" */
    KM_WROLE_PREFILL,  /* "prefill" */
    KM_WROLE_DECODE,   /* "decode" */
    KM_WROLE_COUNT
} km_worker_role;

const char *km_worker_role_name(km_worker_role r);
/* 0 and *out set when s names a role, else KM_EINVAL. */
int km_worker_role_parse(const char *s, km_worker_role *out);

/* A worker as the controller sees it (cluster view). */
typedef enum km_member_state {
    KM_MEMBER_STARTING = 0, /* "starting": heartbeats say starting, not ready yet */
    KM_MEMBER_READY,        /* "ready": routable */
    KM_MEMBER_DRAINING,     /* "draining": send nothing new; in-flight requests finish */
    KM_MEMBER_RESTARTING,   /* "restarting": level 3 drained it; waiting for it to come back */
    KM_MEMBER_DEAD,         /* "dead": missed heartbeats; migrate its requests */
    KM_MEMBER_LEFT,         /* "left": stopped on purpose (its last heartbeat said "stopping") */
    KM_MEMBER_STATE_COUNT
} km_member_state;

const char *km_member_state_name(km_member_state s);

/* Strings are NUL-terminated; a NULL optional string means "absent". */
typedef struct km_msg_request {
    uint64_t id;        /* chosen by the sender, unique among its in-flight requests */
    const char *model;  /* required, 1..KM_PROTO_MAX_NAME bytes */
    const char *prompt; /* text prompt, or NULL when tokens are given (exactly one of the two) */
    size_t prompt_len;  /* encoding: 0 = strlen(prompt); same for the other text/text_len pairs */
    const int32_t *tokens; /* token ids, 0..2^31-1 */
    uint32_t n_tokens;
    /* sampling */
    float temperature;       /* [0, 100], 0 = greedy; default 1 */
    int32_t top_k;           /* [0, 2^20], 0 = off */
    float top_p;             /* [0, 1], 1 = off */
    float min_p;             /* [0, 1], 0 = off */
    float repeat_penalty;    /* (0, 100], 1 = off */
    int32_t repeat_last_n;   /* [0, 2^20], 0 = the server's default */
    float presence_penalty;  /* [-2, 2] */
    float frequency_penalty; /* [-2, 2] */
    bool has_seed;
    uint64_t seed;
    uint32_t max_tokens;     /* [0, 2^20], 0 = the server's default */
    const char *const *stop; /* up to KM_PROTO_MAX_STOP strings, each 1..KM_PROTO_MAX_NAME bytes */
    uint32_t n_stop;
    const char *cache_salt; /* tenant isolation of cached pages; NULL = none */
    int32_t priority;       /* [-100, 100], higher first; default 0 */
    uint32_t deadline_ms;   /* budget from receipt; 0 = none */
    uint32_t generated;     /* the last `generated` ids of tokens were generated for this request
                             * by an earlier attempt (a migration): the receiver's sampler
                             * continues its random draws after them; 0 = none */
    bool stream;            /* send token frames (otherwise only done, with the whole text) */
    /* speculative decoding (optional, added within version 1); never changes the output */
    km_speculate speculate;
    uint32_t max_draft_tokens; /* [0, KM_PROTO_MAX_DRAFT] per step; 0 = the worker's default */
    /* Log-probabilities (optional, added within version 1): each tok frame carries its token's
     * log-probability under the model's distribution, and the top_logprobs most likely
     * alternatives (requires logprobs). */
    bool logprobs;
    uint32_t top_logprobs; /* [0, KM_PROTO_MAX_TOP] */
    /* With logprobs (optional, added within version 1): each prompt token's log-probability
     * too, in tok frames with prompt set, before the first generated token (echo). */
    bool prompt_logprobs;
    /* Added to the logits before sampling (optional, added within version 1): up to
     * KM_PROTO_MAX_BIAS distinct ids, each bias in [-100, 100]. */
    const km_token_value *logit_bias;
    uint32_t n_logit_bias;
    /* Constrained decoding (optional, added within version 1): the output must be a value of
     * this JSON Schema (text, 1..KM_PROTO_MAX_GRAMMAR bytes; engine.h en_grammar_compile says
     * what is supported, and a worker refuses what is not with bad_request); NULL = free. */
    const char *grammar;
    /* Pull hint (a router's, optional, added within version 1): before computing the prompt,
     * pull its first pull_pages KV pages from worker pull_from, whose requests endpoint is
     * pull_endpoint and transfer node address pull_addr, spending at most pull_ms on it; a
     * failed or slow pull means the pages are recomputed. Absent when pull_from is NULL. */
    const char *pull_from;     /* worker id */
    const char *pull_endpoint; /* required with pull_from */
    const uint8_t *pull_addr;  /* required with pull_from: 1..KM_PROTO_MAX_PEER_ADDR bytes */
    uint32_t pull_addr_len;
    uint32_t pull_pages; /* 1..KM_PROTO_MAX_PULL_PAGES with pull_from (0 with pull_chunks) */
    uint32_t pull_ms;    /* budget; 0 = the worker's default */
    /* Disaggregation (docs/disaggregation.md; optional, added within version 1; only with
     * pull_from): pull_from is a prefill worker that has not computed the prompt yet. The
     * receiver asks it to (a req of max_tokens 1 it sends itself) and pulls the pages again and
     * again as they are sealed, until pull_pages are here, the prefill is done, or pull_ms. */
    bool pd;
    /* Chunk pulls (optional, added within version 1; only with pull_from; docs/blend.md
     * "Routing"): bit c set asks the receiver to pull chunk c's pages (its chunk chain: the
     * preamble page, then the chunk's whole pages) from pull_from too, within the same pull_ms.
     * With it pull_pages may be 0 (no prefix pull). Bits past n_chunks are refused. */
    uint64_t pull_chunks;
    /* More chunk holders (optional, added within version 1; only with pull_from): each a worker
     * (found in the receiver's view, as pull_from) and the chunks to pull from it, pulled after
     * pull_from's within the same pull_ms. Up to KM_PROTO_MAX_PULL_MORE; no chunk named twice in
     * the hint, none past n_chunks. A receiver that does not read it pulls from pull_from only. */
    const km_pull_more *pull_more;
    uint32_t n_pull_more;
    /* Chunks (optional, added within version 1; docs/blend.md): segments of `tokens` whose KV
     * may be cached and reused by their content wherever they appear (a retrieved document);
     * up to KM_PROTO_MAX_CHUNKS, in order, disjoint, non-empty, inside the prompt. */
    const km_chunk_seg *chunks;
    uint32_t n_chunks;
} km_msg_request;

typedef struct km_msg_token {
    uint64_t id;      /* request id */
    uint32_t index;   /* 0-based position in the completion */
    int32_t token;    /* token id */
    const char *text; /* UTF-8 piece (may be empty while a character is incomplete) */
    size_t text_len;
    /* With req.logprobs (optional, added within version 1): the token's log-probability, and
     * the most likely alternatives, most likely first (up to KM_PROTO_MAX_TOP). */
    bool has_logprob;
    float logprob;
    const km_token_value *top;
    uint32_t n_top;
    /* (optional, added within version 1) a prompt token's log-probability (req.prompt_logprobs):
     * index is its position in the prompt, text empty; not part of the completion */
    bool prompt;
} km_msg_token;

typedef struct km_msg_done {
    uint64_t id;
    km_finish finish;
    const char *text; /* non-streaming: the whole completion; streams: the tail no token frame
                       * carried (held back for a stop string, an incomplete last character),
                       * NULL when none; tokens' texts + this tail = the whole text */
    size_t text_len;
    uint32_t prompt_tokens, cached_tokens, completion_tokens; /* usage */
    /* usage: draft tokens verified, and of them accepted (part of completion_tokens); optional,
     * added within version 1, absent = 0 */
    uint32_t draft_tokens, accepted_draft_tokens;
    /* usage: prompt tokens whose KV came from cached chunks (req.chunks), not counted in
     * cached_tokens; optional, added within version 1, absent = 0 */
    uint32_t chunk_tokens;
    double queue_ms, ttft_ms, total_ms; /* timings, >= 0 */
    /* set by routers (optional, added within version 1) */
    const char *worker;  /* the worker that finished the request; NULL = absent */
    uint32_t migrations; /* times the request moved to another worker; 0 = absent */
} km_msg_done;

typedef struct km_msg_error {
    uint64_t id;             /* request id; 0 when the frame could not be attributed */
    int32_t code;            /* km_proto_code, 1..999 */
    const char *message;     /* required, up to KM_PROTO_MAX_MESSAGE bytes */
    uint32_t retry_after_ms; /* 0 = do not retry here */
} km_msg_error;

typedef struct km_msg_cancel {
    uint64_t id;
} km_msg_cancel;

typedef struct km_msg_admin {
    uint64_t id; /* correlation id echoed in the reply */
    km_admin_cmd cmd;
    double fraction;     /* evict: (0, 1]; pressure: [0, 1] */
    const char *format;  /* set_kv_format: "f16", "bf16", "fp8", "int8" or "int4" */
    uint32_t timeout_ms; /* drain: grace before in-flight requests are migrated; 0 = default */
    bool restart;        /* shutdown: exit with the restart code */
    const char *worker;  /* recover: target worker id (required); optional otherwise */
    uint32_t level;      /* recover: 1..3 */
    const char *role;    /* set_role: "both", "prefill" or "decode" (required) */
    /* status: KV event replay (docs/protocol.md section 9; optional, added within version 1).
     * A replay is asked for when has_events_since or events_snapshot is set. */
    bool has_events_since;
    uint64_t events_since; /* resend every kv frame with seq >= this */
    bool events_snapshot;  /* send the whole index instead of a replay */
} km_msg_admin;

typedef struct km_msg_admin_reply {
    uint64_t id;
    km_admin_cmd cmd;
    bool ok;
    int32_t code;        /* when !ok: km_proto_code */
    const char *message; /* optional, up to KM_PROTO_MAX_MESSAGE bytes */
    /* results; zero when not applicable */
    km_worker_state state;
    const char *kv_format; /* optional */
    km_worker_role role;   /* optional, added within version 1; absent = both */
    uint32_t inflight, queued;
    uint64_t kv_pages, kv_bytes;
    uint64_t evicted_pages, freed_bytes, converted_pages;
    /* the answer to a status with a replay request (section 9): absent from a worker that does
     * not replay, which the requester recognises by has_events_next false */
    bool has_events_next;
    uint64_t events_next; /* the seq the next published event carries: continue there */
    bool events_snapshot; /* the kv frames sent were a snapshot, not a replay */
} km_msg_admin_reply;

typedef struct km_endpoint {
    const char *name; /* "requests", "events", "admin", "peer", ... */
    const char *url;
} km_endpoint;

typedef struct km_kv_usage {
    uint32_t shard;
    km_tier tier;
    const char *format;
    uint64_t pages, bytes, capacity_bytes;
    uint64_t pinned_bytes; /* of `bytes`, held by live sequences (not reclaimable); optional, 0 */
} km_kv_usage;

typedef struct km_latency_q {
    double q;       /* quantile, (0, 1] */
    double ttft_ms; /* time to first token */
    double tpot_ms; /* time per output token */
} km_latency_q;

typedef struct km_error_count {
    const char *name; /* "bad_frame", "oom", ... */
    uint64_t count;
} km_error_count;

/* Pulls into a worker from one holder (hb.xfer.pairs, view.workers[].xfer_pairs): what the
 * router's pull-or-recompute rule uses for that pair before the worker's overall figures. */
typedef struct km_xfer_pair {
    const char *from;  /* the holder's worker id; required */
    double rate_bps;   /* payload bytes/s of recent pulls from it; > 0 */
    double latency_ms; /* their fixed cost (request to first page), ms; >= 0 */
} km_xfer_pair;

/* A worker's page transfer statistics since start (hb.xfer). */
typedef struct km_xfer_stats {
    uint64_t bytes_in, bytes_out, pages_in, pages_out;
    uint64_t pulls_ok, pulls_failed, offers;
    double rate_bps;     /* measured pull rate, payload bytes/s (recent pulls); 0 = not measured */
    double latency_ms;   /* measured per-pull fixed cost (request to first page), ms; >= 0 */
    uint64_t page_bytes; /* bytes of one KV page in the worker's current format */
    const km_xfer_pair *pairs; /* per holder it pulled from lately; up to KM_PROTO_MAX_XFER_PAIRS */
    uint32_t n_pairs;
} km_xfer_stats;

typedef struct km_msg_heartbeat {
    const char *worker; /* required worker id */
    uint64_t seq;       /* increases by one per heartbeat of this process */
    uint64_t uptime_ms;
    km_worker_state state;
    const km_endpoint *endpoints;
    uint32_t n_endpoints;
    const char *model;       /* model name */
    const char *fingerprint; /* model fingerprint (hex) */
    uint32_t slots;          /* capacity: concurrent sequences */
    uint32_t max_ctx;        /* capacity: context tokens per sequence */
    uint32_t page_tokens;
    const km_kv_usage *kv;
    uint32_t n_kv;
    uint64_t rss_bytes, gpu_bytes;
    uint32_t queue_depth, running;
    double decode_tps, prefill_tps;
    const km_latency_q *latency;
    uint32_t n_latency;
    const km_error_count *errors;
    uint32_t n_errors;
    uint64_t tokens_total;      /* prompt + generated tokens computed since start (stall detection);
                                 * optional, 0 */
    const char *kv_format_base; /* the KV format the worker was started with (--kv-format); a
                                 * current format other than this one is a recovery level 2 in
                                 * effect. Optional: NULL = unknown (then f16 is assumed) */
    /* KV page transfer (docs/transfer.md; optional, added within version 1) */
    const uint8_t *peer_addr; /* the worker's transfer node address; NULL = no node */
    uint32_t peer_addr_len;
    bool has_xfer; /* the statistics below are present */
    km_xfer_stats xfer;
    km_worker_role role; /* optional, added within version 1; absent = both */
} km_msg_heartbeat;

typedef struct km_msg_kv_event {
    const char *worker;
    uint64_t seq; /* per worker, +1 per event; a gap means events were lost */
    km_kv_event_kind kind;
    km_tier tier;          /* stored: where; tier: destination */
    km_tier from_tier;     /* tier: source */
    const uint8_t *hashes; /* n_hashes * 16 bytes, each an XXH128 canonical (big-endian) hash */
    uint32_t n_hashes;
    /* The pages are a chunk's, position-free (docs/blend.md; optional, added within version 1,
     * absent = false): a frame carries pages of one kind only. */
    bool position_free;
} km_msg_kv_event;

/* One recovery action in a worker's history (newest last). */
typedef struct km_recovery_action {
    uint64_t at_ms;     /* Unix time, ms */
    uint32_t level;     /* 1..3; 0 = back to normal (level 2 reverted, or re-admitted) */
    const char *reason; /* "kv_pressure", "rss", "stall", "errors", "operator", ...; required */
    bool ok;            /* the worker acknowledged it */
} km_recovery_action;

typedef struct km_view_worker {
    const char *id; /* required */
    km_member_state state;
    uint32_t level;                        /* 0 = normal; 1..3 = the recovery level in effect */
    const char *requests, *events, *admin; /* endpoints; NULL when unknown */
    const char *model, *fingerprint, *kv_format; /* optional */
    double pressure;                             /* hot-tier pinned bytes / budget, >= 0 */
    uint64_t last_seen_ms;                       /* since its last heartbeat */
    uint32_t running, queue_depth;
    const km_recovery_action *history; /* up to KM_PROTO_MAX_HISTORY */
    uint32_t n_history;
    /* KV page transfer, from its heartbeats (optional, added within version 1) */
    const uint8_t *peer_addr; /* NULL = no transfer node */
    uint32_t peer_addr_len;
    double prefill_tps;   /* measured prefill tokens/s; 0 = unknown */
    double xfer_rate_bps; /* measured pull rate into this worker, bytes/s; 0 = unknown */
    double xfer_lat_ms;   /* measured per-pull fixed cost, ms */
    uint64_t page_bytes;  /* bytes of one of its KV pages (what a pull from it moves); 0 unknown */
    uint64_t xfer_bytes_in, xfer_bytes_out; /* KV payload pulled into it / read from it, bytes */
    const km_xfer_pair *xfer_pairs;         /* its hb.xfer.pairs; up to KM_PROTO_MAX_XFER_PAIRS */
    uint32_t n_xfer_pairs;
    km_worker_role role; /* its hb.role (optional, added within version 1; absent = both) */
} km_view_worker;

typedef struct km_msg_view {
    const char *controller; /* controller id; required */
    uint64_t epoch;         /* controller start, Unix ms: a new value means it restarted */
    uint64_t seq;           /* +1 per view published by this controller process */
    const km_view_worker *workers;
    uint32_t n_workers; /* up to KM_PROTO_MAX_VIEW_WORKERS */
} km_msg_view;

/* kv_pull (puller -> holder, on the holder's requests endpoint): pin chain pages [first,
 * n_pages) for me; the holder verifies the whole chain [0, n_pages) against its index. The
 * frame's id is the puller's pull id, echoed by the offer. */
typedef struct km_msg_kv_pull {
    uint64_t id;
    uint32_t first, n_pages; /* first < n_pages <= KM_PROTO_MAX_PULL_PAGES */
    uint32_t page_tokens;    /* 1..KM_PROTO_MAX_PAGE_TOKENS */
    const uint8_t *hashes;   /* n_pages * 16 bytes, canonical (km_pagehash_canonical) */
    const int32_t *tokens;   /* n_pages * page_tokens ids */
} km_msg_kv_pull;

/* One offered page: its identity and where it lies in the holder's registered memory. */
typedef struct km_kv_page_desc {
    uint32_t index;  /* chain index */
    uint32_t format; /* the KV format it travels in: 0 f16, 1 bf16, 2 fp8, 3 int8, 4 int4 */
    uint8_t hash[16], parent[16]; /* canonical */
    uint32_t region;
    uint64_t addr, bytes, checksum;
} km_kv_page_desc;

/* kv_offer (holder -> puller): the pages pinned for the pull (none, with status < 0, when the
 * holder has nothing or refused). */
typedef struct km_msg_kv_offer {
    uint64_t id;       /* the pull id */
    uint64_t lease_id; /* 0: nothing pinned */
    int32_t status;    /* 0 or a negative km_err */
    uint32_t lease_ms;
    uint32_t page_tokens;
    const km_kv_page_desc *pages; /* n_pages, consecutive chain indexes */
    uint32_t n_pages;
    const int32_t *tokens; /* n_pages * page_tokens: the holder's stored ids */
    /* the lease's secret (peer.h pr_offer.key): sent when lease_id != 0; absent: zero */
    uint8_t key[KM_PROTO_LEASE_KEY];
} km_msg_kv_offer;

/* kv_pull_done (puller -> holder): the lease can end. */
typedef struct km_msg_kv_pull_done {
    uint64_t lease_id; /* >= 1 */
    uint32_t pages_ok;
} km_msg_kv_pull_done;

/* kv_push (a draining worker -> a peer, on the peer's requests endpoint): "I hold this chain;
 * pull what you want of it from me" (the drain handoff, docs/transfer.md). The peer answers
 * nothing; it may start a pull (kv_pull back to `endpoint`) of the pages it lacks. */
typedef struct km_msg_kv_push {
    km_msg_kv_pull chain; /* id: the pusher's; first: 0; the chain's hashes and token ids */
    const char *from;     /* the pusher's worker id (its member key, for CURVE) */
    const char *endpoint; /* the pusher's requests endpoint */
    const uint8_t *addr;  /* the pusher's transfer node address */
    uint32_t addr_len;    /* 1..KM_PROTO_MAX_PEER_ADDR */
    /* a chunk's chain (position-free pages, docs/blend.md; optional, added within version 1,
     * absent = false): the taker indexes what it pulls position-free too */
    bool position_free;
} km_msg_kv_push;

/* kv_warm (a new worker -> a peer, on the peer's requests endpoint): "push me your most
 * recently used chains, up to max_pages pages"; the peer answers with kv_push frames on the same
 * connection (the warm-up of docs/transfer.md). */
typedef struct km_msg_kv_warm {
    uint64_t id;
    uint32_t max_pages; /* 1..KM_PROTO_MAX_WARM_PAGES */
} km_msg_kv_warm;

typedef struct km_msg {
    km_msg_type type;
    union {
        km_msg_request req;
        km_msg_token tok;
        km_msg_done done;
        km_msg_error error;
        km_msg_cancel cancel;
        km_msg_admin admin;
        km_msg_admin_reply admin_reply;
        km_msg_heartbeat hb;
        km_msg_kv_event kv;
        km_msg_view view;
        km_msg_kv_pull kv_pull;
        km_msg_kv_offer kv_offer;
        km_msg_kv_pull_done kv_pull_done;
        km_msg_kv_push kv_push;
        km_msg_kv_warm kv_warm;
    };
    /* After a failed km_msg_decode: the rejected frame's top-level `id` (an unsigned integer),
     * when the frame had one the bounds scan could read, so the error reply can name the request
     * it answers; 0 otherwise. Never encoded. */
    uint64_t rejected_id;
    void *mem_; /* decoder-owned allocations; private */
} km_msg;

/* The id a decoded frame carries (request, pull or correlation id), for an error reply that
 * names it; 0 for types without one. */
uint64_t km_msg_id(const km_msg *m);
/* Zeroes m and sets the type's defaults (temperature 1, top_p 1, repeat_penalty 1, ...). */
void km_msg_init(km_msg *m, km_msg_type type);
/* Frees what the decoder allocated and zeroes m; safe on any initialised message. */
void km_msg_clear(km_msg *m);

/* Checks every field's range and the required fields (what the decoder enforces after types). */
int km_msg_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err);
/* Validates, then writes one frame into out (out->len is reset first). lim NULL = defaults. */
int km_msg_encode(const km_msg *m, const km_proto_limits *lim, km_buf *out, km_errbuf *err);
/* Decodes one whole frame into out (initialised by the call; km_msg_clear it when done; after a
 * failure it is already cleared but for out->rejected_id). Errors: KM_ERANGE (too large),
 * KM_EFORMAT (not msgpack, wrong types, missing fields, out-of-range values), KM_EUNSUPPORTED
 * (version or type unknown). */
int km_msg_decode(const void *data, size_t len, const km_proto_limits *lim, km_msg *out,
                  km_errbuf *err);

#ifdef __cplusplus
}
#endif
#endif /* KM_PROTO_H */
