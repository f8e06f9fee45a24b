/*
 * internal.h — the private structures of peer/, shared by its files:
 *   node.c   the node: back end choice, registered regions, peers, statistics, the owner poll
 *   pull.c   the puller side: identity checks, destination pages, results, import
 *   serve.c  the holder side: leases (kvshard exports) and the offers describing them
 *   addr.c   the node address a peer connects with (pure: parsed from the network, fuzzed)
 *   ucx.c    the UCX back end: context, worker, progress thread, endpoints, get and AM reads
 *
 * Threads: everything here belongs to the owner thread except what the back end's progress
 * thread touches, which is marked (atomics, or fields the owner no longer touches once it has
 * handed an object to the back end until the back end says it is done with it).
 */
#ifndef PEER_INTERNAL_H
#define PEER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "peer/peer.h"

#define PR_MAX_REGIONS 4
#define PR_ADDR_HOST   64

/* ---------------------------------------------------------------- node address (addr.c) */

/* What pr_node_address encodes: where to connect and which memory can be read. */
typedef struct pr_addr {
    char host[PR_ADDR_HOST];
    int port;
    int n_regions;
    struct {
        uint64_t base, bytes;
        const uint8_t *rkey; /* packed remote key, into the parsed buffer */
        size_t rkey_len;
    } region[PR_MAX_REGIONS];
} pr_addr;

/* Bytes needed for a; 0 when a is invalid. */
size_t pr_addr_size(const pr_addr *a);
/* Writes a into buf (cap from pr_addr_size); returns bytes written or 0. */
size_t pr_addr_encode(const pr_addr *a, uint8_t *buf, size_t cap);
/* Parses buf; the rkeys point into buf. KM_EFORMAT on anything malformed; never reads outside
 * [buf, buf + len). */
int pr_addr_parse(const uint8_t *buf, size_t len, pr_addr *out);

/* ---------------------------------------------------------------- objects */

struct pr_peer {
    struct pr_peer *next;
    int refs;           /* the caller's handle + pulls using it (owner thread) */
    int released;       /* the caller let go */
    int disconnecting;  /* handed to the back end to close */
    int failure_seen;   /* counted in the node's statistics */
    int encrypt;        /* pulls from it ask for encrypted pages (pr_config.encrypt) */
    pr_addr addr;       /* regions, for checking the offers' addresses */
    uint8_t *addr_buf;  /* what addr points into */
    _Atomic int failed; /* set by the back end: endpoint error, or closed by a deadline */
    _Atomic int closed; /* set by the back end: endpoint and keys released */
    void *be;           /* back end state */
};

/* One page being read. */
typedef struct pr_xpage {
    pr_page_desc src;  /* where and what, as the holder described it */
    kv_xfer_page dst;  /* where it goes, and what it must be (our identity, our tokens) */
    _Atomic int state; /* PR_PAGE_* */
} pr_xpage;

/* PR_PAGE_NONFINITE: its checksum held, but a value or scale is an infinity or a NaN */
enum {
    PR_PAGE_PENDING = 0,
    PR_PAGE_OK = 1,
    PR_PAGE_BAD_SUM = 2,
    PR_PAGE_FAILED = 3,
    PR_PAGE_NONFINITE = 4,
    PR_PAGE_BAD_AUTH = 5 /* an answer failed its tag (pr_page_arrived's ok < 0) */
};

struct pr_pull {
    struct pr_pull *next;
    uint64_t id;
    pr_node *node;
    pr_peer *peer;
    int page_tokens;
    uint64_t start_ns, deadline_ns;
    uint64_t import_id;
    int k, n_chain; /* local prefix; chain length */
    km_pagehash *hashes;
    int32_t *tokens;
    uint64_t lease_id;
    int offered, n; /* pages the holder offered; pages being read (a prefix of them) */
    pr_xpage *pages;
    int drop[PR_DROP_COUNT];
    int status;
    int encrypt;                   /* ask for the pages encrypted */
    int no_auth;                   /* pr_config.no_auth */
    uint8_t token[PR_TOKEN_BYTES]; /* the lease's, from the offer (seal.c) */
    uint8_t page_key[PR_KEY_BYTES];
    int submitted;          /* handed to the back end */
    _Atomic int fetch_done; /* the back end is done with it: no operation left on its pages */
    _Atomic int settled;    /* pages whose state is final */
    _Atomic int timed_out;  /* the back end canceled it at its deadline */
    _Atomic int stop;       /* the owner wants no more reads issued */
    void *be;               /* back end state */
};

/* A holder's lease: a kvshard export and the offer that describes it. */
typedef struct pr_lease {
    struct pr_lease *next;
    uint64_t id, pull_id, requester, deadline_ns;
    int first, n, status, emitted;
    pr_page_desc *descs;
    int32_t *tokens;
    uint8_t key[PR_KEY_BYTES], token[PR_TOKEN_BYTES], page_key[PR_KEY_BYTES];
} pr_lease;

/* ---------------------------------------------------------------- back ends */

typedef struct pr_backend_ops {
    const char *name;
    /* Context, progress, registration of the node's regions, listening; fills the node's
     * address. */
    int (*open)(pr_node *n, km_errbuf *err);
    /* Cancels everything, closes every endpoint, unregisters, stops the progress thread. */
    void (*close)(pr_node *n);
    int (*connect)(pr_node *n, pr_peer *p, km_errbuf *err);
    /* Closes the peer's endpoint; sets p->closed once everything of it is released. */
    void (*disconnect)(pr_node *n, pr_peer *p);
    /* Starts reading p->pages[0..n); each page settles through pr_page_arrived; sets
     * p->fetch_done when no operation on them remains. */
    int (*fetch)(pr_node *n, pr_pull *p);
    /* The owner gave up on p (p->stop is set): issue nothing more. */
    void (*cancel)(pr_node *n, pr_pull *p);
} pr_backend_ops;

extern const pr_backend_ops pr_ucx_ops;

struct pr_node {
    pr_config cfg;
    kv_store *store;
    const pr_backend_ops *ops;
    void *be;
    kv_mem_region regions[PR_MAX_REGIONS];
    int n_regions;
    uint8_t *addr;
    size_t addr_len;
    pr_peer *peers;
    pr_pull *pulls, *zombies; /* in progress; finished by the owner but still being read */
    pr_lease *leases;
    uint64_t next_pull_id;
    pr_stats st;
    _Atomic int endpoints; /* server and client endpoints alive (back end) */
    /* The leases list and what their offers describe, against the back end's lookups
     * (pr_lease_allows, from its progress thread); the owner thread takes it to change them. */
    pthread_mutex_t lease_mu;
    _Atomic uint64_t fetches_refused; /* reads asked of pages no live lease offered */
    _Atomic uint64_t fetches_unkeyed, fetches_dropped, answers_forged, am_unknown; /* pr_stats */
    int wait_fd; /* eventfd: the back end writes it when a pull's reads have all completed */
    int closed;  /* the back end is gone (pr_node_destroy): nothing more to tell it */
    /* the background prefault of the arena (pr_config.prefault_bytes; node.c) */
    pthread_t prefault_thr;
    int prefault_started;
    _Atomic int prefault_stop;
    _Atomic uint64_t prefaulted;
    uint64_t prefault_target;
};

/* node.c — the back end says that pull p's reads have all completed (sets p->fetch_done and
 * wakes the owner's wait_fd); any thread. */
void pr_pull_fetched(pr_node *n, pr_pull *p);

/* pull.c — called by the back end's progress thread when page i's read completed (ok > 0),
 * failed (0) or failed its tag (< 0); verifies the checksum (sum: what the back end computed of the
 * page as it landed, or NULL to compute it now) and settles the page. */
void pr_page_arrived(pr_pull *p, int i, int ok, const uint64_t *sum);
/* Imports what a zombie pull got intact, then frees it (its reads have all completed). */
void pr_pull_reap(pr_node *n, pr_pull *p);
/* Frees a pull the back end is done with (owner thread). */
void pr_pull_free(pr_node *n, pr_pull *p);
void pr_peer_unref(pr_node *n, pr_peer *p);

/* serve.c */
void pr_leases_expire(pr_node *n, uint64_t now_ns);
/* What a holder answering a fetch checks, so that a reader gets only pages offered to it while
 * the lease lasts, never the rest of the registered memory (another tenant's pages): 1 when a
 * live lease of pull pull_id whose fetch token is `token` offered exactly this page (region,
 * address, size), its page key, description and token ids (page_tokens) copied out; 0 when a lease
 * of that pull and token exists but this page is not its (answered with a refusal); -1 when no
 * lease has that token (not answered: the asker proved nothing). Any thread. */
int pr_lease_allows(pr_node *n, uint64_t pull_id, const uint8_t *token, uint32_t index,
                    uint32_t region, uint64_t addr, uint64_t bytes, uint8_t *page_key,
                    pr_page_desc *desc, int32_t *tokens);

/* seal.c */
void pr_lease_secret(uint8_t key[PR_KEY_BYTES]);
/* The fetch token and the page key of a lease secret. */
void pr_key_derive(const uint8_t key[PR_KEY_BYTES], uint8_t token[PR_TOKEN_BYTES],
                   uint8_t page_key[PR_KEY_BYTES]);
/* 1 when the two tokens are equal (in constant time). */
int pr_token_eq(const uint8_t *a, const uint8_t *b);
int pr_leases_emit(pr_node *n, pr_offer *out, int max);
void pr_leases_free(pr_node *n);

#endif
