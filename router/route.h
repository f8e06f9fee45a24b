/*
 * route.h — the router's routing core, private to router/: the prefix index (index.c), the
 * per-worker KV event streams (evstream.c), the worker choice (policy.c) and the rules of the
 * controller's view (view.c). Each is plain data in, decision out, with no sockets and no loop,
 * so tests/unit/test_router.c exercises each alone and bench/bench_router.c times them.
 */
#ifndef RT_ROUTE_H
#define RT_ROUTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "router/router.h"

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
    int stored[RT_MAX_WORKERS];    /* the same without pending pages: what it could hand over */
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

/* ---------------------------------------------------------------- worker choice (policy.c) */

typedef struct rt_candidate {
    const char *id;       /* worker id: rendezvous hashing uses it, so replicas agree */
    bool usable;          /* connected, not draining */
    int inflight;         /* requests this router has running there */
    int slots;            /* requests the worker runs at once; beyond that they queue */
    int max_inflight;     /* the router sends no more than this; 0 = no limit */
    double cached_tokens; /* rt_match credit for this request */
    double backlog;       /* prompt tokens the worker has yet to compute for others (cold only) */
} rt_candidate;

/* The rendezvous weight of (key, worker): the highest weight wins ties and cold prefixes. */
uint64_t rt_rendezvous(km_pagehash key, const char *worker_id);
/* Cost of sending a request with n_prompt tokens to c (RT_MODE_KV's formula). */
double rt_cost(const rt_policy *p, const rt_candidate *c, int n_prompt);
/* Picks a candidate index, or KM_EOVERLOAD when every usable one is at max_inflight, or
 * KM_ENOTFOUND when none is usable. *state carries the round-robin position and random state. */
int rt_pick(const rt_policy *p, const rt_candidate *c, int n, int n_prompt, km_pagehash key,
            uint64_t *state);

/* ---------------------------------------------------------------- cluster view (view.c)
 * With --controller the router subscribes to the controller's view (two-part PUB messages
 * ["view", km_msg_view frame]) and acts on it: only "ready" members get new requests; "starting",
 * "draining" and "restarting" members keep their in-flight requests but get nothing new; a
 * "dead" or "left" member's in-flight requests migrate as on a disconnect. Members are matched to
 * the router's workers by requests endpoint (normalised below); a member with an unknown
 * endpoint is connected at run time. While no view has arrived for view_timeout_ms the view is
 * *stale* and ignored: the router's own liveness alone decides, so a controller outage never stops
 * serving. A worker the view does not name is routed by liveness alone, too (a fresh controller's
 * first views may not list every worker yet). */

/* Canonical form of a ZeroMQ endpoint for comparing: scheme and host lower-cased; loopback and
 * wildcard hosts (localhost, 0.0.0.0, *, [::1], [::]) become 127.0.0.1. 0 or KM_EINVAL /
 * KM_ERANGE. */
int rt_endpoint_norm(const char *url, char *out, size_t cap);
bool rt_endpoint_same(const char *a, const char *b);
/* May a worker get new requests? connected: the router's own liveness (a veto); view_fresh: a
 * view arrived within the timeout; in_view: that view names the worker with `state`. */
bool rt_member_routable(bool connected, bool view_fresh, bool in_view, km_member_state state);
/* May another worker pull KV pages from it: connected and, in a fresh view, ready, draining,
 * restarting or left (a drained worker lingers to hand its pages to the requests migrated off
 * it). */
bool rt_member_serves_pages(bool connected, bool view_fresh, bool in_view, km_member_state state);
/* Must the worker's in-flight requests migrate because the view says it is dead or left? */
bool rt_member_migrates(bool view_fresh, bool in_view, km_member_state state);

/* ---------------------------------------------------------------- pull or recompute (pull.c)
 * When another worker holds a longer prefix of the chain than the chosen one, should the chosen
 * worker pull the difference or compute it? docs/transfer.md has the rule; every figure is
 * measured by the workers (heartbeats, then the controller's view). */

typedef enum rt_pull_decision {
    RT_PULL_NONE = -1,      /* nobody that can serve holds more than the chosen worker */
    RT_PULL_PULL = 0,       /* pulling is cheaper: hint the chosen worker */
    RT_PULL_RECOMPUTE = 1,  /* computing is cheaper (or pulling not cheaper by the margin) */
    RT_PULL_UNMEASURED = 2, /* no measured rate, prefill rate or page size: compute */
    RT_PULL_DECISIONS = 3
} rt_pull_decision;

extern const char *const rt_pull_decision_names[RT_PULL_DECISIONS];

typedef struct rt_pull_in {
    int pages;          /* leading pages of the chain it holds (rt_match.pages) */
    bool serves;        /* may be pulled from: routable, with a transfer node address */
    double rate_bps;    /* its measured pull rate (bytes/s); 0: not measured */
    double lat_ms;      /* its measured per-pull latency */
    double prefill_tps; /* its measured prefill rate (tokens/s); 0: not measured */
    double page_bytes;  /* bytes of one of its pages; 0: unknown */
    /* the chosen worker's measured pulls from this one (view xfer_pairs); 0: none */
    double pair_rate_bps, pair_lat_ms;
} rt_pull_in;

typedef struct rt_pull_choice {
    int decision; /* rt_pull_decision */
    int holder;   /* -1 with RT_PULL_NONE */
    int pages;    /* the holder's pages (the hint's pull_pages) */
    double pull_ms, recompute_ms;
} rt_pull_choice;

/* Decides for candidate pick among c[0..n); returns the decision (also in out). */
/* Did a hint work: the request's cached tokens cover the pages it was told to pull (one page of
 * slack: the scheduler may compute a prompt's last token again). */
bool rt_pull_hint_ok(uint32_t cached_tokens, uint32_t pull_pages, int page_tokens);
/* How long a (puller, holder) pair gets no hint after its fails-th failed hint in a row:
 * 1 s doubling, at most 60 s. */
uint64_t rt_pull_backoff_ms(uint32_t fails);
int rt_pull_decide(const rt_policy *pol, const rt_pull_in *c, int n, int pick, int page_tokens,
                   rt_pull_choice *out);
/* What pulling saves candidate i, in prompt tokens for the cost model: when rt_pull_decide says
 * pull, the pulled pages' tokens x (1 - pull_ms / recompute_ms) less the tie band, so that a pull
 * is priced at the prefill time it takes and never ties with a holder as loaded; else 0. Added
 * to i's cached credit before rt_pick. */
double rt_pull_credit(const rt_policy *pol, const rt_pull_in *c, int n, int i, int page_tokens);
/* The same rule for a chunk's chain (its preamble page, then its whole pages; docs/blend.md): a
 * reused chunk is still partly recomputed, so pulling saves only chunk_credit of computing it,
 * and recompute_ms (in out) is that share. */
int rt_chunk_pull_decide(const rt_policy *pol, const rt_pull_in *c, int n, int pick,
                         int page_tokens, rt_pull_choice *out);
/* What pulling a chunk's chain saves candidate i, as rt_pull_credit for a prefix: when
 * rt_chunk_pull_decide says pull, the chunk tokens it lacks (past the preamble page) x
 * chunk_credit x (1 - pull_ms / recompute_ms) less the tie band; else 0. */
double rt_chunk_pull_credit(const rt_policy *pol, const rt_pull_in *c, int n, int i,
                            int page_tokens);

/* Disaggregation (router/pd.c, docs/disaggregation.md): one worker's part in the decision. */
typedef struct rt_pd_in {
    km_worker_role role;
    bool usable; /* may take requests (the decode side) or compute for a decode worker (the
                  * prefill side: routable, a transfer node, no backoff from the pick) */
    int pages;   /* leading pages of the chain it holds (rt_match.pages) */
    int inflight;
} rt_pd_in;

/* Whether the cluster disaggregates at all: a usable prefill and a usable decode worker. */
bool rt_pd_cluster(const rt_pd_in *c, int n);
/* The prefill worker for a prompt of n_prompt tokens picked for decode worker pick (the one
 * holding the longest prefix, then the least loaded), or -1 (served as today): pick is no decode
 * worker, the cluster has no prefill worker, or fewer than min_tokens of the prompt are
 * uncached on pick (min_tokens <= 0: never). */
int rt_pd_decide(const rt_pd_in *c, int n, int pick, int n_prompt, int page_tokens, int min_tokens);

#endif /* RT_ROUTE_H */
