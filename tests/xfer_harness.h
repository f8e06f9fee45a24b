/*
 * xfer_harness.h — what the transfer tests (tests/unit/test_xfer_peer.c, test_xfer_proc.c) and
 * the transfer benchmark (bench/bench_transfer.c) share: stores with computed pages, a control
 * channel for pr_* messages between two processes (a SOCK_SEQPACKET socketpair standing in for
 * ZeroMQ), and a holder process that serves its pages until the channel closes. No asserts:
 * errors are returned, so the benchmark can use it too.
 */
#ifndef XFER_HARNESS_H
#define XFER_HARNESS_H

#include <sys/types.h>

#include "peer/peer.h"

#define XH_MSGCAP (1 << 20)

typedef struct xh_shape {
    int layers, heads, hd, pt;
} xh_shape;

/* An arena store with room for `pages` pages of format f (NULL on failure). */
kv_store *xh_store(xh_shape sh, kv_format f, int pages);
/* n pages of tokens and their hash chain; salt != 0 gives another tenant's chain. */
void xh_chain(int32_t *toks, km_pagehash *hs, int n, int pt, int salt);
/* Writes and publishes n pages whose K/V depend on token, position, layer and channel. */
int xh_compute(kv_store *s, xh_shape sh, const int32_t *toks, const km_pagehash *hs, int n);
uint64_t xh_after(double seconds); /* km_now_ns() + seconds */
/* -1 when the first n pages of the chain hold the same bytes (and format and checksum) in a
 * and b; else the first page that differs, -2 when one of them lacks a page, or -3 when a page
 * was still on its way up from a lower tier after 30 s. */
int xh_same_bytes(kv_store *a, kv_store *b, const int32_t *toks, const km_pagehash *hs, int n);

/* ---------------------------------------------------------------- control channel */

/* XH_SPIN: an int, 1 to have the holder's loop poll its channel without sleeping (as
 * ucx_perftest's loops do; bench_transfer's "owners spin" rows), 0 to sleep in poll again. */
enum { XH_ADDR = 1, XH_REQ, XH_OFFER, XH_DONE, XH_READING, XH_SPIN };

/* A message: u64 type (so that what follows stays aligned), then up to three parts. */
int xh_send(int fd, uint64_t type, const void *a, size_t al, const void *b, size_t bl,
            const void *c, size_t cl);
/* One message into buf (XH_MSGCAP): its length, 0 when the other side closed, -1 on timeout. */
ssize_t xh_recv(int fd, uint8_t *buf, int timeout_ms);
uint64_t xh_type(const uint8_t *msg);
int xh_send_req(int fd, const pr_pull_req *r);
int xh_send_offer(int fd, const pr_offer *o);
/* Point into msg: valid while msg is. */
void xh_parse_req(const uint8_t *msg, pr_pull_req *r);
void xh_parse_offer(const uint8_t *msg, pr_offer *o);

/* ---------------------------------------------------------------- a holder process */

typedef struct xh_role {
    xh_shape sh;
    kv_format format;
    int pages;
    pr_mode mode;
    int lease_ms;
    int am_fragment;        /* pr_config.am_fragment (0: the default) */
    long long stream_bytes; /* pr_config.stream_bytes (0: the default) */
    int chains;             /* also this many one-page chains, xh_chain salts 1..chains */
    pr_encrypt encrypt;     /* pr_config.encrypt */
    int no_auth;            /* pr_config.no_auth */
} xh_role;

typedef struct xh_child {
    pid_t pid;
    int fd;
} xh_child;

pr_node *xh_node(kv_store *s, const xh_role *r);
/* Forks a process holding r->pages computed pages (and r->chains one-page chains) that sends
 * its node address (XH_ADDR) and then serves requests until the channel closes or two minutes
 * pass. fd < 0 on failure. */
xh_child xh_spawn_holder(const xh_role *r);
/* Sends sig (when not 0), closes the channel and waits for the child (SIGKILL after 30 s). */
void xh_reap(xh_child *c, int sig);

#endif
