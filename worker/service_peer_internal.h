/*
 * service_peer_internal.h — what the worker's three page-transfer files share (service_internal.h
 * lists the daemon's files): service_peer.c (the transfer node, requests held while their pages
 * are pulled), service_serve.c (kv_pull served as a holder) and service_handoff.c (the
 * controller's view, drain handoff, warm-up and the background pulls both start). Private to
 * worker/.
 */
#ifndef WK_SERVICE_PEER_INTERNAL_H
#define WK_SERVICE_PEER_INTERNAL_H

#include "peer/peer.h"
#include "worker/service_internal.h"

enum {
    WK_PEER_LINKS = 16,    /* holders this worker keeps a connection to */
    WK_PEER_HELD = 256,    /* requests held for a pull at once */
    WK_PEER_SERVES = 256,  /* kv_pull frames waiting for their offer */
    WK_PEER_OFFERS = 16,   /* offers taken from the node per poll */
    WK_PEER_VIEW = 64,     /* peers remembered from the controller's view */
    WK_PEER_BG = 256,      /* handoffs taken and waiting for their background pull */
    WK_BG_AT_ONCE = 4,     /* background pulls running at once: the rate bound */
    WK_PUSH_PER_PEER = 64, /* chains one drain pushes to one peer at most */
    WK_BG_PULL_MS = 5000,  /* a background pull's budget */
};

/* kvmesh_kv_transfer_pulls_total{outcome} */
enum { WK_PULL_OK, WK_PULL_PARTIAL, WK_PULL_FAILED, WK_PULL_PRESENT, WK_PULL_OUTCOMES };
/* kvmesh_kv_handoff_chains_total{outcome} */
enum { WK_HO_PUSHED, WK_HO_TAKEN, WK_HO_DROPPED, WK_HO_PRESENT, WK_HO_OUTCOMES };

/* A peer the controller's view names: where a drain may hand its pages. */
typedef struct wk_member {
    char id[KM_PROTO_MAX_NAME + 1], requests[KM_PROTO_MAX_NAME + 1];
    uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t addr_len;
    bool takes; /* ready, same model, a transfer node, room */
} wk_member;

/* A holder: a DEALER to its requests endpoint and a node peer to its transfer address. */
typedef struct wk_link {
    char endpoint[KM_PROTO_MAX_NAME + 1];
    char holder[KM_PROTO_MAX_NAME + 1]; /* its worker id */
    double rate_bps, lat_ms;            /* measured on pulls from it (hb.xfer.pairs); 0: none */
    uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t addr_len;
    void *sock;
    pr_peer *peer;
    uint64_t used_ns;
    int pulls; /* held requests pulling through it */
} wk_link;

/* A disaggregated request's prefill and rounds (service_pd.c; freed with its wk_held). */
struct wk_pd {
    uint64_t prefill_id;  /* the req this worker sent the prefill worker; 0: not sent */
    km_pagehash *hs;      /* the chain [0, n_pages) */
    int imported, during; /* pages pulled in all rounds; of them while the prefill ran */
    int have;             /* leading pages here after the last round */
    int rounds, empty_after;
    uint64_t next_ns;  /* between rounds: when the next one starts */
    uint64_t begin_ns; /* the first round's start */
    bool done, failed; /* the prefill's done, or its error (or no link to send it) */
    bool stop;         /* no more rounds */
};

/* A request held while its pull runs. */
typedef struct wk_held {
    uint64_t id, pull_id;
    wk_link *link;
    pr_pull *pull;
    km_buf frame; /* the request without its hint, decoded again when admitted */
    uint8_t env[WK_ENV_BYTES];
    size_t env_len[WK_ENV_MAX];
    int n_env;
    int32_t *tokens;
    int n_tokens, n_pages;
    uint64_t arrival_ns, start_ns, offer_ns, deadline_ns;
    bool end_now;    /* refused or answered with an error: finish at the next poll */
    bool background; /* a handoff taken: no request behind it */
    bool warm;       /* background: an answer to this worker's warm-up (--peer-warm-pages) */
    int first;       /* background, pulling: the pages already here when it started */
    int reserved;    /* background, pulling: warm-up pages reserved for it */
    km_pagehash *hs; /* background: the chain's hashes */
    /* disaggregated (service_pd.c): the prefill it pulls from; NULL: none */
    struct wk_pd *pd;
    /* chunk pulls (the hint's pull_chunks, docs/blend.md "Routing"): pulled one after another
     * through the same link, after the prefix, within the same deadline (then pull_more's) */
    km_chunk_seg *chunks; /* the request's chunks */
    int n_chunks;
    uint64_t chunks_left;   /* a bit per chunk still to pull */
    km_pagehash chunk_seed; /* the tenant's chunk seed */
    bool chunk_pull;        /* the pull running is a chunk's */
    /* the hint's other chunk holders (pull_more): each one's chunks pulled through its link
     * once the link before it has none left, in the hint's order */
    wk_link *more_link[KM_PROTO_MAX_PULL_MORE];
    uint64_t more_chunks[KM_PROTO_MAX_PULL_MORE];
    int n_more;
} wk_held;

/* A chain this worker's drain pushed: its first and last page, the peer it went to (an index into
 * wk_peer.push_to) and whether a kv_pull naming it came back. */
typedef struct wk_pushed {
    km_pagehash root, last;
    int to;
    bool pulled;
} wk_pushed;

/* A kv_pull whose offer the node has not yielded yet. */
typedef struct wk_serve {
    uint64_t pull_id, at_ns;
    uint8_t env[WK_ENV_BYTES];
    size_t env_len[WK_ENV_MAX];
    int n_env;
} wk_serve;

struct wk_peer {
    pr_node *node;
    char listen_host[128], advertise_host[128];
    const uint8_t *addr;
    size_t addr_len;
    wk_link links[WK_PEER_LINKS];
    int n_links;
    wk_held *held[WK_PEER_HELD];
    int n_held;
    wk_serve serves[WK_PEER_SERVES];
    int n_serves;
    pr_offer offers[WK_PEER_OFFERS];
    km_zmsg in;
    km_buf out;
    /* measured: EWMA of the pull rate (payload bytes/s after the offer) and of the fixed cost
     * (request to offer), for the heartbeat and the routers' cost model */
    double rate_bps, lat_ms;
    uint64_t pulls_ok, pulls_failed;
    km_xfer_pair hb_pairs[WK_PEER_LINKS]; /* the heartbeat's per-holder figures */
    km_series *s_bytes_in, *s_bytes_out, *s_seconds, *s_pulls[WK_PULL_OUTCOMES],
        *s_fail[PR_DROP_COUNT + 2];
    km_series *s_refused, *s_dones_ignored;
    km_series *s_hints_refused[2]; /* kvmesh_kv_pull_hints_refused_total{reason}: sender, holder */
    km_series *s_view_peers;       /* kvmesh_kv_peer_view_workers */
    /* kvmesh_kv_transfer_chunk_{pages,bytes}_total: what chunk pulls imported */
    km_series *s_chunk_pages, *s_chunk_bytes;
    int32_t *chunk_pre; /* the chunk preamble's first page of tokens; NULL: no chunk pulls */
    uint64_t seen_out, seen_refused; /* bytes_out, fetches_refused already counted */
    /* kvmesh_kv_page_plane_rejected_total{reason}: unkeyed, over_bound, forged, unknown_am */
    km_series *s_plane[4];
    uint64_t seen_plane[4];
    uint64_t last_pull_ns; /* the last kv_pull that came in */
    /* drain handoff */
    void *vsub; /* the controller's view (--peer-view) */
    km_zmsg vin;
    wk_member members[WK_PEER_VIEW];
    int n_members, n_bg;          /* background pulls running */
    wk_held *bg_wait[WK_PEER_BG]; /* taken chains waiting for their pull, oldest first */
    int n_wait;
    bool warmed;      /* this process asked its peers for their chains */
    int warm_pages;   /* --peer-warm-pages resolved */
    int warm_left;    /* of it: pages not yet pulled nor reserved by a running pull */
    uint64_t push_id; /* the last kv_push / kv_warm id this worker sent */
    km_series *s_handoff[WK_HO_OUTCOMES]; /* kvmesh_kv_handoff_chains_total{outcome} */
    /* this drain's handoff, to push again what a silent peer never pulled */
    wk_pushed *pushed;
    int n_pushed, n_push_to;
    wk_link *push_to[WK_PEER_VIEW];
    bool pushed_again; /* once per drain */
    /* disaggregation (service_pd.c): requests between two pull rounds, their prefill ids */
    wk_held *pd_wait[WK_PEER_HELD];
    int n_pd_wait;
    uint64_t pd_next_id;
    km_series *s_pd_pages[2]; /* kvmesh_worker_pd_pages_imported_total{when} */
    km_series *s_pd_reqs[3];  /* kvmesh_worker_pd_requests_total{outcome} */
};

/* links.c */
void wk_held_free(wk_held *h);
/* Whether h came in this routing envelope. */
bool wk_held_env_is(const wk_held *h, const km_zframe *env, int n_env);
/* h's request is admitted (its pull over), h freed. */
void wk_peer_admit_held(wk_service *s, wk_held *h);
void wk_link_close(wk_peer *p, wk_link *l);
/* The link to a holder (its DEALER and node peer), made or reused; NULL when none can be. */
wk_link *wk_peer_link(wk_service *s, const char *holder, const char *endpoint, const uint8_t *addr,
                      uint32_t addr_len);
/* A pull that could not even start (holder unreachable, connection failed, kv_pull not sent)
 * counts as a failed pull, as one that ends without pages does; returns -1. */
int wk_peer_not_started(wk_peer *p, const wk_link *l);
/* Starts h's pull of the chain through l (kv_pull out); the pages already here, or < 0. */
int wk_peer_start(wk_service *s, wk_link *l, wk_held *h, const km_pagehash *hs, const int32_t *toks,
                  int n_pages);

/* service_pd.c: requests whose prompt a prefill worker computes (docs/disaggregation.md) */
int wk_pd_metrics(wk_service *s, wk_peer *p, km_errbuf *err);
/* h's first round has started: asks l's worker to compute the prompt (a req of max_tokens 1). */
void wk_pd_begin(wk_service *s, wk_link *l, wk_held *h, const km_msg_request *q,
                 const km_pagehash *hs);
/* h's round ended with res: true when h waits for another round (not admitted). */
bool wk_pd_round_end(wk_service *s, wk_held *h, const pr_pull_result *res);
/* A done or error on link l answering a prefill this worker asked for: true when it was one. */
bool wk_pd_answer(wk_service *s, wk_link *l, const km_msg *m);
/* Starts the rounds that are due. */
void wk_pd_poll(wk_service *s);
/* Ends h's rounds at its current one (a cancel, a drain). */
void wk_pd_stop(wk_held *h);
/* A cancel of a request between two rounds: 1 when it was one (then admitted and canceled). */
int wk_pd_cancel(wk_service *s, const km_zframe *env, int n_env, uint64_t id);
/* Admits every request between rounds. */
void wk_pd_admit_all(wk_service *s);

/* service_serve.c */
/* Offers the node has ready go back to their pullers. */
void wk_peer_offers_out(wk_service *s);

/* service_handoff.c */
/* The worker `id` as the controller's latest view names it (NULL: not in it, or no view). */
const wk_member *wk_peer_member(wk_service *s, const char *id);
/* The link to the worker `id` of the controller's view, at the endpoint and address the view
 * gives (NULL: not in the view, or no link can be had). */
wk_link *wk_peer_link_member(wk_service *s, const char *id);
/* A peer's kv_push (its drain's handoff, or with warm its answer to our warm-up): queued for a
 * background pull. */
void wk_peer_take(wk_service *s, const km_msg_kv_push *q, bool warm);
/* A background pull has ended (res: its result): its warm-up pages settled, its outcome counted,
 * h freed. */
void wk_peer_bg_end(wk_service *s, wk_held *h, const pr_pull_result *res);
/* Reads the controller's latest views (--peer-view). */
void wk_peer_view_read(wk_service *s);
/* A peer's kv_warm: our chains, answered as kv_push frames. */
void wk_peer_warm_answer(wk_service *s, const km_zframe *env, int n_env, const km_msg_kv_warm *q);
/* Starts waiting background pulls while fewer than WK_BG_AT_ONCE run. */
void wk_peer_bg_start(wk_service *s);
/* Once ready with peers in the view: ask them for their chains (the warm-up on scale-out). */
void wk_peer_warm_up(wk_service *s);
/* Gives up the handoffs taken but not started (a drain or a stop). */
void wk_peer_bg_drop(wk_peer *p);
/* A kv_pull came in naming a chain ending at last: a chain the drain pushed is being pulled. */
void wk_peer_pushed_pulled(wk_peer *p, km_pagehash last);

#endif
