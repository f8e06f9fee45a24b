/*
 * peer.h — KV pages between workers: a transfer node per process moves pages of its KV store to
 * and from the stores of other processes. Design, failure handling and measured figures:
 * docs/transfer.md.
 *
 * Contract:
 *  - One node per process, over one store created with kv_config.arena. The node owns one back
 *    end context (UCX: one ucp_context and one ucp_worker, driven by the node's own progress
 *    thread), registers the store's page memory once when it is created (ucp_mem_map of the
 *    arena) and never per transfer. No call here waits for the network, so an engine step never
 *    waits for a transfer.
 *  - Control messages (pr_pull_req, pr_offer, pr_pull_done) are plain structs that the caller
 *    carries between processes (ZeroMQ in the daemons); page bytes move on the back end. The
 *    receiver always reads (one-sided get into its registered memory, or an active-message fetch
 *    answered by rendezvous into buffers it chose): a peer never writes into this process's
 *    memory, so nothing a peer does late can land in a page that has been reused.
 *  - Correct or nothing: a page reaches the receiver's index only when its token ids equal the
 *    receiver's, its chain link holds (parent = the receiver's previous link, hash =
 *    km_pagehash_next(parent, tokens)) and the checksum of what arrived equals the holder's
 *    (kv_xfer_checksum: identity, tokens and payload). In AM mode every answer is also
 *    authenticated under the lease's secret, which only the holder and this reader know
 *    (docs/transfer.md, "Who may read a page"): the holder takes the checksum in the pass that
 *    tags the bytes, and the reader, checking the tag, trusts it rather than reading the page a
 *    second time. A page that fails is dropped and counted by reason, and the chain ends before
 *    it; a page in another format than the receiver's store is converted as it is indexed.
 *  - Every wait has a deadline. A pull still running at its deadline is canceled: nothing more
 *    is read and its pages still missing are dropped (PR_DROP_TIMEOUT). If the peer has been
 *    silent for a second (no page or answer on the connection), or a read into our pages is
 *    still running a second after the peer's last sign of life, the endpoint is closed and the
 *    peer marked failed (every pull on it ends); a live but slow peer keeps the connection its
 *    other pulls share. Buffers are given back only once every operation on them has
 *    completed. A holder unpins a lease when it runs out, whatever the reader does. Endpoints of
 *    failed peers are closed and their remote keys released.
 *  - All calls are made from the store's owner thread (they call kvshard's structural
 *    functions, between engine steps); the node never calls kvshard from its own thread.
 *  - Back ends sit behind one table of operations (peer/internal.h): UCX now, a GPU path
 *    (NCCL / CUDA IPC, issue 17) later, without a change to this header's callers.
 */
#ifndef PEER_H
#define PEER_H

#include <stddef.h>
#include <stdint.h>

#include "common/km.h"
#include "kvshard/kvshard.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PR_MAX_PAGES   4096 /* pages in one pull */
#define PR_KEY_BYTES   32   /* a lease's secret */
#define PR_TOKEN_BYTES 16   /* the fetch token derived from it */
#define PR_TAG_BYTES   16   /* an answer's authentication tag */

typedef struct pr_node pr_node;
typedef struct pr_peer pr_peer;
typedef struct pr_pull pr_pull;

/* How the receiver reads a page. docs/transfer.md has the figures and the failure behind the
 * default. A node in AM mode publishes no remote keys: a reader in GET mode reads from it with
 * AM fetches, so a holder decides whether it serves one-sided reads. */
typedef enum pr_mode {
    PR_MODE_AM = 0,  /* an active-message fetch, answered by a rendezvous send (default) */
    PR_MODE_GET = 1, /* one-sided ucp_get_nbx from the holder's registered memory */
} pr_mode;

/* Whether a puller asks for its pages encrypted (they are always authenticated): docs/transfer.md,
 * "Who may read a page", says why auto is the default. */
typedef enum pr_encrypt {
    PR_ENCRYPT_AUTO = 0, /* when the holder's advertised host is not a loopback address or ours */
    PR_ENCRYPT_ON = 1,
    PR_ENCRYPT_OFF = 2,
} pr_encrypt;

typedef struct pr_config {
    kv_store *store;            /* created with kv_config.arena = 1 */
    const char *backend;        /* "ucx"; NULL: "ucx" */
    pr_mode mode;               /* default PR_MODE_AM */
    const char *listen_host;    /* address the node listens on; NULL: "0.0.0.0" */
    int listen_port;            /* 0: an ephemeral port */
    const char *advertise_host; /* what peers connect to; NULL: "127.0.0.1" */
    int lease_ms;               /* how long a holder keeps pages pinned for a reader; 0: 10000 */
    int max_inflight;           /* pages read at once per pull; 0: 32 */
    /* AM mode, holder side: a page is answered as eager fragments of this many bytes, which the
     * reader copies into the page and hashes as they land (the page is read once); 0:
     * PR_FRAGMENT_DEFAULT; < 0: one rendezvous message per page, hashed after it has landed.
     * A reader takes either. docs/transfer.md has the figures. */
    int am_fragment;
    /* Reader side: a pull of more page bytes than this lands its fragments with non-temporal
     * stores (it would not stay in the caches anyway); 0: PR_STREAM_DEFAULT; < 0: never. */
    long long stream_bytes;
    /* Leading bytes of the page arena a background thread makes resident after the node starts
     * (MADV_POPULATE_WRITE a chunk at a time, a tenth of one CPU at most), so that
     * pages landing from a peer do not take a page fault per 4 KiB (docs/transfer.md, "Tuning",
     * says what that costs a fresh worker's pull); 0: the store's hot-tier budget; < 0:
     * none (pages are faulted in as they are first written). Resident memory grows to it. */
    long long prefault_bytes;
    pr_encrypt encrypt; /* reader side; a holder answers as each fetch asks */
    /* Benchmarks only (bench_transfer's baseline): ask for answers without tags and take them
     * unchecked. A reader without it fails every untagged answer, so it opens nothing to a
     * peer; never set in a daemon. */
    int no_auth;
} pr_config;

#define PR_STREAM_DEFAULT (16ll << 20)

/* One TCP segment of UCX 1.13 (UCX_TCP_RX_SEG_SIZE, 64 KiB) with room for its headers, so that a
 * fragment travels as one zero-copy send and arrives whole in one receive buffer; a page of the
 * default model (368,640 bytes in f16) is six. */
#define PR_FRAGMENT_DEFAULT 61440

int pr_node_create(const pr_config *cfg, pr_node **out, km_errbuf *err);
/* Cancels every pull, ends every lease, closes every endpoint, unregisters the memory. */
void pr_node_destroy(pr_node *n);

/* The bytes a peer needs to read from this node (listening address, registered regions and
 * their packed remote keys): advertised in heartbeats. Valid until the node is destroyed. */
int pr_node_address(const pr_node *n, const uint8_t **addr, size_t *len);

/* ---------------------------------------------------------------- control messages */

/* Puller -> holder: "pin chain pages [first, n_pages) of this chain for me". The holder
 * verifies the whole chain [0, n_pages) against its own index (tokens and parent links). */
typedef struct pr_pull_req {
    uint64_t pull_id;
    /* Who asked: the caller's tag for the connection the request came on (the worker: a hash of
     * the ZeroMQ routing envelope, which the holder's socket assigns and a peer cannot choose).
     * Only a pr_pull_done with the same tag ends the lease. 0: anyone's. */
    uint64_t requester;
    int first, n_pages, page_tokens;
    const km_pagehash *hashes; /* [n_pages] */
    const int32_t *tokens;     /* [n_pages * page_tokens] */
} pr_pull_req;

/* One page of an offer: where it lies in the holder's memory and what it must prove to be. */
typedef struct pr_page_desc {
    int32_t index;  /* chain index */
    int32_t format; /* kv_format it travels in (the holder's) */
    km_pagehash hash, parent;
    uint32_t region; /* in the holder's address */
    uint64_t addr, bytes;
    uint64_t checksum; /* kv_xfer_checksum */
} pr_page_desc;

/* Holder -> puller: the pages pinned for it (n = 0 and status < 0 when none). The key is the
 * lease's secret: every read of its pages proves it, and their bytes are authenticated (or
 * encrypted) under it, so the offer must travel on an authenticated, encrypted channel (the
 * workers' CURVE connection): whoever learns it may read the lease's pages. */
typedef struct pr_offer {
    uint64_t pull_id;
    uint64_t lease_id; /* 0: nothing pinned */
    int status;        /* 0, or why nothing is offered (KM_ENOTFOUND, KM_ENOSPC, ...) */
    int lease_ms;      /* the pages stay pinned this long from when the holder offered them */
    int n;             /* pages first .. first + n - 1 of the request */
    int page_tokens;
    const pr_page_desc *pages; /* [n] */
    const int32_t *tokens;     /* [n * page_tokens]: the holder's stored token ids */
    uint8_t key[PR_KEY_BYTES]; /* the lease's secret (random; zero when nothing is pinned) */
} pr_offer;

/* Puller -> holder: the lease can end. */
typedef struct pr_pull_done {
    uint64_t lease_id;
    uint64_t requester; /* as in the pr_pull_req: another requester's done is ignored */
    int pages_ok;
} pr_pull_done;

/* ---------------------------------------------------------------- peers (puller side) */

/* Connects to the node whose address is addr (from pr_node_address); the connection completes
 * in the background. The handle is the caller's until pr_peer_release. */
int pr_peer_connect(pr_node *n, const uint8_t *addr, size_t len, pr_peer **out, km_errbuf *err);
/* 1 once the peer's endpoint failed, or was closed at a pull's deadline because the peer was
 * silent: release it and connect again (with a fresh address if it restarted). */
int pr_peer_failed(const pr_peer *p);
/* Closes the endpoint (when no pull uses it any more) and frees the handle. */
void pr_peer_release(pr_node *n, pr_peer *p);

/* ---------------------------------------------------------------- pulls (puller side) */

typedef enum pr_drop {
    PR_DROP_TOKENS = 0, /* the holder's token ids differ from ours */
    PR_DROP_CHAIN,      /* index, hash or parent hash break our chain (or a foreign page) */
    PR_DROP_FORMAT,     /* unknown format, wrong size, or an address outside its region */
    PR_DROP_CHECKSUM,   /* the bytes that arrived are not the ones the holder described */
    PR_DROP_TRANSFER,   /* the read failed (peer failure, canceled) */
    PR_DROP_TIMEOUT,    /* still missing at the deadline */
    PR_DROP_NONFINITE,  /* its checksum held, but a value or scale is an infinity or a NaN */
    PR_DROP_AUTH,       /* an answer failed its tag, or came unencrypted when asked encrypted */
    PR_DROP_COUNT
} pr_drop;

const char *pr_drop_name(pr_drop d);

typedef struct pr_pull_result {
    int status;         /* 0, or the first failure (KM_ETIMEDOUT, KM_EIO, KM_ECORRUPT, ...) */
    int pages_local;    /* leading pages this store already held */
    int pages_wanted;   /* pages asked from the holder */
    int pages_offered;  /* pages the holder pinned */
    int pages_imported; /* pages now in this store's index */
    uint64_t bytes;     /* payload bytes that arrived and passed */
    uint64_t ns;        /* from pr_pull_start to pr_pull_finish */
    int dropped[PR_DROP_COUNT];
} pr_pull_result;

/* Starts pulling the chain's pages that the store lacks from peer `from`. Returns how many
 * leading pages the store already holds; when that is n_pages there is nothing to pull and
 * *out is NULL. Otherwise *out is the pull and *req the request to deliver to the holder
 * (valid while the pull lives). deadline_ns (km_now_ns clock) bounds the whole pull. */
int pr_pull_start(pr_node *n, pr_peer *from, const km_pagehash *hashes, const int32_t *tokens,
                  int n_pages, uint64_t deadline_ns, pr_pull **out, pr_pull_req *req);
/* The pull's chain is a chunk's (docs/blend.md): its pages are indexed position-free
 * (kv_import_set_position_free); call before the pull ends. */
int pr_pull_position_free(pr_node *n, pr_pull *p);
/* The holder's answer: checks every page's identity, reserves destination pages and starts
 * reading. Pages after the first one that fails are not read. */
int pr_pull_offer(pr_node *n, pr_pull *p, const pr_offer *offer);
/* 1 when every read has completed (or failed, or the deadline passed), else 0. */
int pr_pull_done_yet(pr_node *n, pr_pull *p);
/* Pages whose reads have completed so far, of how many are being read (*of may be NULL). */
int pr_pull_pages_settled(const pr_pull *p, int *of);
/* Ends the pull: indexes the leading pages that arrived and passed every check, fills *res
 * (may be NULL) and *done, the message that lets the holder unpin (done->lease_id 0: nothing
 * to send). Called before the pull is done, it cancels the rest; never blocks. */
int pr_pull_finish(pr_node *n, pr_pull *p, pr_pull_result *res, pr_pull_done *done);

/* ---------------------------------------------------------------- serving (holder side) */

/* Pins the pages a puller asked for; the offer comes out of pr_node_poll (at once, or when
 * pages on the host tier have been promoted). Bad requests get an offer with status < 0. */
int pr_serve(pr_node *n, const pr_pull_req *req);
/* The puller is done with a lease: ends it when done->requester is the lease's requester; 1 when
 * a lease ended, 0 when none of that id and requester is live (already ended, ran out, or
 * someone else's: ignored). */
int pr_serve_done(pr_node *n, const pr_pull_done *done);

/* The owner loop's call: ends leases that ran out, reclaims canceled pulls whose reads have
 * completed, and returns up to max offers ready to send (valid until the next call on the
 * node). It also clears pr_node_wait_fd. */
int pr_node_poll(pr_node *n, pr_offer *out, int max);
/* A file descriptor that becomes readable when a pull's reads have all completed (its
 * pr_pull_done_yet turns 1), for the owner to poll beside its sockets instead of looking every
 * so often: a pull's end is seen at once. Cleared by pr_node_poll. Valid until the node is
 * destroyed. */
int pr_node_wait_fd(const pr_node *n);

/* ---------------------------------------------------------------- statistics */

typedef struct pr_stats {
    uint64_t pulls, pulls_ok, pulls_failed, pages_in, bytes_in;
    uint64_t offers, pages_out, bytes_out, leases_expired;
    uint64_t fetches_refused; /* reads asked of pages no live lease offered (holder side) */
    uint64_t fetches_unkeyed; /* of those, reads whose token matched no lease: not answered */
    uint64_t fetches_dropped; /* reads over the bound of answers queued (PR_CONN_REPLIES) */
    uint64_t answers_forged;  /* answers to our reads with a wrong token or tag (puller side) */
    uint64_t am_unknown;      /* active messages of an id this node does not use */
    uint64_t dones_ignored;   /* pr_serve_done that ended no lease: late, or not the requester */
    uint64_t peers_failed, dropped[PR_DROP_COUNT];
    uint64_t prefaulted, prefault_target; /* arena bytes made resident so far, of how many */
    int peers, pulls_active, leases_active, endpoints; /* alive now */
} pr_stats;

void pr_node_stats(const pr_node *n, pr_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* PEER_H */
