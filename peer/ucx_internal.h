/*
 * ucx_internal.h — what the UCX back end's two files share (peer/ucx.c: endpoints, the progress
 * thread, open and close; peer/ucx_io.c: the reads a puller issues and the answers a holder
 * sends). Everything here is touched by the progress thread only, but for the command queue
 * (under mu) and the atomics of the pull and peer objects (peer/internal.h).
 */
#ifndef PEER_UCX_INTERNAL_H
#define PEER_UCX_INTERNAL_H

#include <pthread.h>
#include <sys/socket.h>
#include <stdint.h>

#include <openssl/evp.h>
#include <ucp/api/ucp.h>

#include "peer/gmac.h"
#include "peer/internal.h"

#define PR_AM_FETCH 21
#define PR_AM_DATA  22
/* UCX logs a warning for each active message of an id nobody registered; a peer choosing the
 * id must not choose what this process logs, so every id gets a handler (ucx.c). */
#define PR_AM_IDS 65536
/* Answers queued or being sent on one accepted connection, and on the whole node: a reader that
 * sends fetches and never reads the answers holds at most this much memory of ours; fetches
 * past it are dropped (counted) and the reader's wait ends by its deadline. */
#define PR_CONN_REPLIES 512
#define PR_NODE_REPLIES 8192
/* Encrypted answers hold a copy of the page until sent: bytes of them per connection and node. */
#define PR_CONN_SEALED (64ull << 20)
#define PR_NODE_SEALED (256ull << 20)
#define PR_SPINS       2000                        /* empty progress rounds before sleeping */
#define PR_SPIN_NS     (200ull * 1000)             /* and at least this long after the last work */
#define PR_CLOSE_NS    (5ull * 1000 * 1000 * 1000) /* longest wait for endpoints at close */
/* A pull past its deadline closes its endpoint (failing every pull on it) only when the peer has
 * shown no sign of life (a connection made, a page or an answer received) for this long; a live
 * peer keeps the connection the other pulls share. */
#define PR_SILENT_NS    (1000ull * 1000 * 1000)
#define PR_MAX_TL_SOCKS 8 /* transport listening sockets of one worker that are quiesced */

enum { PR_CMD_CONNECT, PR_CMD_DISCONNECT, PR_CMD_FETCH };
enum { PR_EP_CONNECTING, PR_EP_READY, PR_EP_CLOSING, PR_EP_CLOSED };
/* FETCH_SENT: waiting for the answer; LANDING: its eager fragments are arriving (each copied
 * into the page and hashed in the AM callback, so no operation of UCX writes into the page);
 * RECEIVING: a rendezvous answer UCX is writing into the page; GETTING: a one-sided read. */
enum { PR_OP_IDLE, PR_OP_FETCH_SENT, PR_OP_LANDING, PR_OP_RECEIVING, PR_OP_GETTING, PR_OP_DONE };

#define PR_DATA_ENCRYPTED 1u /* pr_data_hdr.flags, and a fetch's: the bytes are encrypted */
#define PR_DATA_UNTAGGED  2u /* no tag (pr_config.no_auth); only a reader that asked takes it */
/* pr_data_hdr.status: 1 refused; PR_REFUSE_TORN: the page no longer has the bytes the offer
 * described (the holder's checksum of it, taken in its tag pass, differs): a checksum drop */
#define PR_REFUSE_TORN 2u

/* The header of a PR_AM_DATA message: one fragment of a page (or all of it) from offset. */
typedef struct pr_data_hdr {
    uint64_t pull_id;
    uint32_t index, status; /* status != 0: refused, no data */
    uint64_t offset;
    uint32_t len, flags;           /* the fragment's bytes; PR_DATA_* */
    uint8_t token[PR_TOKEN_BYTES]; /* the fetch's token, echoed */
    uint8_t tag[PR_TAG_BYTES];     /* GCM tag of the fragment (seal.c) */
} pr_data_hdr;

/* The header of a PR_AM_FETCH message. */
typedef struct pr_fetch_hdr {
    uint64_t pull_id;
    uint32_t index, region;
    uint64_t addr, bytes;
    uint32_t flags, pad;           /* PR_DATA_ENCRYPTED: answer encrypted */
    uint8_t token[PR_TOKEN_BYTES]; /* the lease's fetch token (seal.c) */
} pr_fetch_hdr;

/* seal.c: one GCM context, used by one thread (the progress thread). Unencrypted messages are
 * authenticated with gmac.c's GHASH where the CPU has it (fast), else with OpenSSL's GCM. */
typedef struct pr_seal {
    EVP_CIPHER_CTX *ctx;
    int open, enc;
    int keyed; /* ctx holds key's schedule for `keyed_open`'s direction */
    int keyed_open;
    uint8_t key[PR_KEY_BYTES]; /* the last key set */
    int fast;                  /* gmac.c may be used (pr_gmac_fast(); 0: OpenSSL's only) */
    int gm;                    /* this message is gmac.c's */
    EVP_CIPHER_CTX *ecb;       /* AES-256 of single blocks: H and E_K(J0) for gmac.c */
    int gk_keyed;              /* gk and ecb hold gk_key's */
    uint8_t gk_key[PR_KEY_BYTES];
    uint8_t ekj0[16]; /* E_K(J0) of this message */
    pr_gmac_key gk;
    pr_gmac g;
} pr_seal;

int pr_seal_init(pr_seal *s);
void pr_seal_free(pr_seal *s);
/* Starts the message h describes (its index, offset, len and flags make the nonce): open = 1
 * checks and, when h is encrypted, decrypts; 0 tags and encrypts. */
int pr_seal_begin(pr_seal *s, const uint8_t page_key[PR_KEY_BYTES], const pr_data_hdr *h, int open);
/* The next len bytes: encrypted or decrypted into out, or only authenticated (out unused). */
int pr_seal_update(pr_seal *s, const void *in, void *out, size_t len);
/* Sealing: writes the tag. Opening: 0 when tag is the message's, else KM_ECORRUPT. */
int pr_seal_end(pr_seal *s, uint8_t tag[PR_TAG_BYTES]);

typedef struct pr_ucx pr_ucx;

typedef struct pr_cmd {
    struct pr_cmd *next;
    int kind;
    pr_peer *peer;
    pr_pull *pull;
} pr_cmd;

/* An endpoint, either ours to a holder (peer != NULL) or a puller's connection to us. */
typedef struct pr_uep {
    struct pr_uep *next;
    pr_ucx *u;
    pr_peer *peer; /* NULL for an accepted connection */
    ucp_ep_h ep;
    int state, failed, want_close, counted;
    int am_tcp;  /* holder: -1 not known yet, 1 when its AM lane is TCP (answers in fragments) */
    int replies; /* holder: answers queued or being sent on this connection */
    uint64_t sealed;  /* holder: bytes of those that are encrypted (PR_CONN_SEALED) */
    uint64_t live_ns; /* the peer's last sign of life: ready, or a page or answer received */
    void *flush_req, *close_req;
    ucp_rkey_h rkey[PR_MAX_REGIONS];
} pr_uep;

typedef struct pr_op {
    struct pr_upull *up;
    int index, phase;
    int sum;            /* LANDING: the slot of up->sums hashing the page in order, or -1 */
    int forged;         /* a fragment failed its tag: the page fails when it is complete */
    uint64_t landed;    /* LANDING: payload bytes copied in so far */
    uint64_t hashed;    /* LANDING: leading payload bytes hashed (in order) */
    pr_fetch_hdr fetch; /* the fetch message header (stable until sent) */
    pr_data_hdr rndv;   /* RECEIVING: the answer's header, to check the page once it landed */
} pr_op;

typedef struct pr_upull {
    struct pr_upull *next;
    pr_pull *p;
    pr_uep *ep;
    pr_op *ops;
    int next_op, inflight;
    kv_xfer_sum *sums; /* [max_inflight] checksums of pages landing in fragments */
    int *free_sums, n_free_sums;
    int stream; /* larger than cfg.stream_bytes: fragments are copied around the caches */
} pr_upull;

/* An answer to a fetch, waiting to be sent or in flight (holder side): the page in fragments
 * (or one rendezvous message), each with its own header, stable until its send completes. */
typedef struct pr_reply {
    struct pr_reply *next;
    pr_ucx *u;
    pr_uep *conn;
    pr_data_hdr hdr;
    uint64_t addr, bytes;
    uint32_t region;
    int pending;               /* sends not yet completed */
    pr_data_hdr *frag;         /* [n_frag] headers of the fragments */
    uint8_t key[PR_KEY_BYTES]; /* the lease's page key (seal.c) */
    pr_page_desc desc;         /* the page as the offer described it (its checksum) */
    int32_t *tokens;           /* its token ids */
    uint64_t reserved;         /* bytes counted in the connection's and node's `sealed` */
    uint8_t *sealed;           /* encrypted answers: the page's ciphertext, sent from here */
} pr_reply;

struct pr_ucx {
    pr_node *node;
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_listener_h listener;
    ucp_mem_h memh[PR_MAX_REGIONS];
    void *rkey_buf[PR_MAX_REGIONS];
    size_t rkey_len[PR_MAX_REGIONS];
    int n_regions, wfd, evfd, epfd;
    int old_cm; /* UCX before 1.22: no worker is destroyed under a connecting endpoint */
    struct sockaddr_storage listen_sa; /* where the listener is bound (pr_listener_quiesce) */
    uint64_t tl_ino[PR_MAX_TL_SOCKS];  /* the worker's transport listening sockets (inodes) */
    int n_tl_ino;
    int closing; /* progress thread: the node is closing; connection requests are rejected */
    pthread_t thr;
    int thr_started;
    pthread_mutex_t mu;
    pr_cmd *cmds, *cmds_tail;
    int stop;
    /* progress thread only */
    pr_uep *eps;
    pr_upull *pulls;
    pr_reply *replies;
    int sends;       /* replies in flight */
    int n_replies;   /* replies queued or in flight (PR_NODE_REPLIES) */
    uint64_t sealed; /* bytes of encrypted replies queued or in flight (PR_NODE_SEALED) */
    pr_seal seal;    /* tags and checks answers */
    int32_t *tokens; /* a page's token ids, as a fetch is checked (page_tokens) */
};

/* ucx.c */
/* Starts closing e (force: outstanding operations complete as canceled). */
void pr_ep_close(pr_ucx *u, pr_uep *e);

/* ucx_io.c */
/* Puller: a page answering one of our fetches (the PR_AM_DATA handler). */
ucs_status_t pr_am_data_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param);
/* Holder: a fetch (the PR_AM_FETCH handler): queued for pr_replies_send. */
ucs_status_t pr_am_fetch_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param);
/* Issues what each pull's window allows, settles what can no longer arrive, finishes pulls;
 * lowers *next_deadline to the earliest deadline still running. */
void pr_pulls_service(pr_ucx *u, uint64_t now, uint64_t *next_deadline);
/* Sends the queued answers. */
void pr_replies_send(pr_ucx *u);
/* Frees a pull's back-end state (no operation of it left in UCX). */
void pr_upull_free(pr_upull *up);

#endif
