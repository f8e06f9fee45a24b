/*
 * ucx_internal.h — what the UCX back end's two files share (peer/ucx.c: endpoints, the progress
 * thread, open and close; peer/ucx_io.c: the reads a puller issues and the answers a holder
 * sends). Everything here is touched by the progress thread only, but for the command queue
 * (under mu) and the atomics of the pull and peer objects (peer/internal.h).
 */
#ifndef PEER_UCX_INTERNAL_H
#define PEER_UCX_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include <ucp/api/ucp.h>

#include "peer/internal.h"

#define PR_AM_FETCH 21
#define PR_AM_DATA  22
#define PR_SPINS    2000                        /* empty progress rounds before sleeping */
#define PR_SPIN_NS  (200ull * 1000)             /* and at least this long after the last work */
#define PR_CLOSE_NS (5ull * 1000 * 1000 * 1000) /* longest wait for endpoints at close */
/* A pull past its deadline closes its endpoint (failing every pull on it) only when the peer has
 * shown no sign of life (a connection made, a page or an answer received) for this long; a live
 * peer keeps the connection the other pulls share. */
#define PR_SILENT_NS (1000ull * 1000 * 1000)

enum { PR_CMD_CONNECT, PR_CMD_DISCONNECT, PR_CMD_FETCH };
enum { PR_EP_CONNECTING, PR_EP_READY, PR_EP_CLOSING, PR_EP_CLOSED };
/* FETCH_SENT: waiting for the answer; LANDING: its eager fragments are arriving (each copied
 * into the page and hashed in the AM callback, so no operation of UCX writes into the page);
 * RECEIVING: a rendezvous answer UCX is writing into the page; GETTING: a one-sided read. */
enum { PR_OP_IDLE, PR_OP_FETCH_SENT, PR_OP_LANDING, PR_OP_RECEIVING, PR_OP_GETTING, PR_OP_DONE };

/* The header of a PR_AM_DATA message: one fragment of a page (or all of it) from offset. */
typedef struct pr_data_hdr {
    uint64_t pull_id;
    uint32_t index, status; /* status != 0: refused, no data */
    uint64_t offset;
} pr_data_hdr;

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
    int am_tcp; /* holder: -1 not known yet, 1 when its AM lane is TCP (answers in fragments) */
    uint64_t live_ns; /* the peer's last sign of life: ready, or a page or answer received */
    void *flush_req, *close_req;
    ucp_rkey_h rkey[PR_MAX_REGIONS];
} pr_uep;

typedef struct pr_op {
    struct pr_upull *up;
    int index, phase;
    int sum;         /* LANDING: the slot of up->sums hashing the page in order, or -1 */
    uint64_t landed; /* LANDING: payload bytes copied in so far */
    uint64_t hashed; /* LANDING: leading payload bytes hashed (in order) */
    struct {
        uint64_t pull_id;
        uint32_t index, region;
        uint64_t addr, bytes;
    } fetch; /* the fetch message header (stable until sent) */
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
    int pending;       /* sends not yet completed */
    pr_data_hdr *frag; /* [n_frag] headers of the fragments */
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
    pthread_t thr;
    int thr_started;
    pthread_mutex_t mu;
    pr_cmd *cmds, *cmds_tail;
    int stop;
    /* progress thread only */
    pr_uep *eps;
    pr_upull *pulls;
    pr_reply *replies;
    int sends; /* replies in flight */
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
