/*
 * xfer_harness.c — stores with computed pages, the control channel between two processes and
 * the holder process, shared by the transfer tests and benchmark (tests/xfer_harness.h).
 */
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/xfer_harness.h"

uint64_t xh_after(double seconds)
{
    return km_now_ns() + (uint64_t)(seconds * 1e9);
}

kv_store *xh_store(xh_shape sh, kv_format f, int pages)
{
    kv_config c = {.n_layers = sh.layers,
                   .n_kv_heads = sh.heads,
                   .head_dim = sh.hd,
                   .page_tokens = sh.pt,
                   .format = f,
                   .arena = 1};
    c.hot_bytes = (size_t)pages * sh.pt * sh.hd * 2 * 2 * sh.layers * sh.heads;
    kv_store *s = NULL;
    km_errbuf err;
    if (kv_store_create(&c, &s, &err)) {
        fprintf(stderr, "xfer_harness: store: %s\n", err.msg);
        return NULL;
    }
    return s;
}

void xh_chain(int32_t *toks, km_pagehash *hs, int n, int pt, int salt)
{
    for (int i = 0; i < n * pt; i++) toks[i] = 7 + (i * 31 + salt * 1009) % 40000;
    km_pagehash seed = km_pagehash_seed("m", 1, 9, salt ? "other" : NULL, salt ? 5 : 0);
    km_pagehash_chain(seed, toks, n * pt, pt, hs, n);
}

int xh_compute(kv_store *s, xh_shape sh, const int32_t *toks, const km_pagehash *hs, int n)
{
    kv_seq *q;
    int rc = kv_seq_create(s, &q);
    if (rc) return rc;
    if ((rc = kv_seq_reserve(s, q, n * sh.pt))) {
        kv_seq_destroy(s, q);
        return rc;
    }
    size_t w = (size_t)sh.heads * sh.hd;
    float *k = malloc(sizeof(float) * w), *v = malloc(sizeof(float) * w);
    for (int p = 0; p < n * sh.pt; p++)
        for (int l = 0; l < sh.layers; l++) {
            for (size_t c = 0; c < w; c++) {
                k[c] = (float)((toks[p] * 3 + p * 7 + l * 11 + (int)c) % 64 - 32) / 16.0f;
                v[c] = (float)((toks[p] * 5 + p * 3 + l * 13 + (int)c) % 64 - 32) / 32.0f;
            }
            kv_seq_write(s, q, l, p, k, v);
        }
    free(k);
    free(v);
    rc = kv_seq_publish(s, q, hs, toks, n * sh.pt);
    kv_seq_destroy(s, q);
    return rc == n ? 0 : KM_EIO;
}

int xh_same_bytes(kv_store *a, kv_store *b, const int32_t *toks, const km_pagehash *hs, int n)
{
    uint64_t ea = 0, eb = 0;
    kv_xfer_page *pa = malloc(sizeof *pa * n), *pb = malloc(sizeof *pb * n);
    int rc = -2;
    if (pa && pb && kv_export_begin(a, hs, toks, n, 0, &ea) == n &&
        kv_export_begin(b, hs, toks, n, 0, &eb) == n) {
        const uint64_t guard = xh_after(30); /* pages on their way up from a lower tier */
        int ra, rb;
        while ((ra = kv_export_pages(a, ea, 0, n, pa)) == KM_EAGAIN && km_now_ns() < guard)
            km_sleep_ms(1);
        while ((rb = kv_export_pages(b, eb, 0, n, pb)) == KM_EAGAIN && km_now_ns() < guard)
            km_sleep_ms(1);
        rc = ra == KM_EAGAIN || rb == KM_EAGAIN ? -3 : -1;
        for (int i = 0; i < n && rc == -1; i++)
            if (pa[i].format != pb[i].format || pa[i].bytes != pb[i].bytes ||
                memcmp(pa[i].buf, pb[i].buf, pa[i].bytes) || pa[i].checksum != pb[i].checksum)
                rc = i;
    }
    if (ea) kv_export_end(a, ea);
    if (eb) kv_export_end(b, eb);
    free(pa);
    free(pb);
    return rc;
}

/* ---------------------------------------------------------------- control channel */

int xh_send(int fd, uint64_t type, const void *a, size_t al, const void *b, size_t bl,
            const void *c, size_t cl)
{
    struct iovec iov[4] = {{&type, 8}, {(void *)a, al}, {(void *)b, bl}, {(void *)c, cl}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 4};
    return sendmsg(fd, &mh, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

ssize_t xh_recv(int fd, uint8_t *buf, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) <= 0) return -1;
    ssize_t r = recv(fd, buf, XH_MSGCAP, 0);
    return r < 0 ? 0 : r;
}

uint64_t xh_type(const uint8_t *msg)
{
    uint64_t t;
    memcpy(&t, msg, 8);
    return t;
}

int xh_send_req(int fd, const pr_pull_req *r)
{
    return xh_send(fd, XH_REQ, r, sizeof *r, r->hashes, sizeof(km_pagehash) * r->n_pages, r->tokens,
                   sizeof(int32_t) * (size_t)r->n_pages * r->page_tokens);
}

int xh_send_offer(int fd, const pr_offer *o)
{
    return xh_send(fd, XH_OFFER, o, sizeof *o, o->pages, sizeof(pr_page_desc) * o->n, o->tokens,
                   sizeof(int32_t) * (size_t)o->n * o->page_tokens);
}

void xh_parse_req(const uint8_t *m, pr_pull_req *r)
{
    memcpy(r, m + 8, sizeof *r);
    r->hashes = (const km_pagehash *)(m + 8 + sizeof *r);
    r->tokens = (const int32_t *)(m + 8 + sizeof *r + sizeof(km_pagehash) * r->n_pages);
}

void xh_parse_offer(const uint8_t *m, pr_offer *o)
{
    memcpy(o, m + 8, sizeof *o);
    o->pages = (const pr_page_desc *)(m + 8 + sizeof *o);
    o->tokens = (const int32_t *)(m + 8 + sizeof *o + sizeof(pr_page_desc) * o->n);
}

/* ---------------------------------------------------------------- the holder process */

pr_node *xh_node(kv_store *s, const xh_role *r)
{
    pr_config c = {.store = s,
                   .mode = r->mode,
                   .lease_ms = r->lease_ms,
                   .am_fragment = r->am_fragment,
                   .stream_bytes = r->stream_bytes,
                   .encrypt = r->encrypt,
                   .no_auth = r->no_auth};
    pr_node *n = NULL;
    km_errbuf err;
    if (pr_node_create(&c, &n, &err)) fprintf(stderr, "xfer_harness: node: %s\n", err.msg);
    return n;
}

static void xh_holder_main(int fd, const xh_role *r)
{
    kv_store *s = xh_store(r->sh, r->format, r->pages + r->chains + 8);
    int32_t *toks = malloc(sizeof(int32_t) * r->sh.pt * r->pages);
    km_pagehash *hs = malloc(sizeof(km_pagehash) * r->pages);
    uint8_t *buf = malloc(XH_MSGCAP);
    if (!s || !toks || !hs || !buf) _exit(2);
    for (int c = 1; c <= r->chains; c++) { /* the one-page chains first: toks is reused */
        xh_chain(toks, hs, 1, r->sh.pt, c);
        if (xh_compute(s, r->sh, toks, hs, 1)) _exit(2);
    }
    xh_chain(toks, hs, r->pages, r->sh.pt, 0);
    if (xh_compute(s, r->sh, toks, hs, r->pages)) _exit(2);
    pr_node *n = xh_node(s, r);
    if (!n) _exit(2);
    const uint8_t *a;
    size_t al;
    pr_node_address(n, &a, &al);
    xh_send(fd, XH_ADDR, a, al, NULL, 0, NULL, 0);
    uint64_t end = xh_after(120);
    int spin = 0;
    while (km_now_ns() < end) {
        ssize_t len = xh_recv(fd, buf, spin ? 0 : 1);
        if (len == 0) break;
        if (len < 0 && spin) sched_yield(); /* the progress thread shares the CPU */
        if (len > 0 && xh_type(buf) == XH_SPIN) {
            memcpy(&spin, buf + 8, sizeof spin);
        } else if (len > 0 && xh_type(buf) == XH_REQ) {
            pr_pull_req req;
            xh_parse_req(buf, &req);
            pr_serve(n, &req);
        } else if (len > 0 && xh_type(buf) == XH_DONE) {
            pr_pull_done d;
            memcpy(&d, buf + 8, sizeof d);
            pr_serve_done(n, &d);
        }
        pr_offer o[4];
        int k = pr_node_poll(n, o, 4);
        for (int i = 0; i < k; i++) xh_send_offer(fd, &o[i]);
    }
    pr_node_destroy(n);
    kv_store_destroy(s);
    _exit(0);
}

xh_child xh_spawn_holder(const xh_role *r)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv)) return (xh_child){-1, -1};
    pid_t pid = fork();
    if (pid < 0) {
        close(sv[0]);
        close(sv[1]);
        return (xh_child){-1, -1};
    }
    if (pid == 0) {
        close(sv[0]);
        xh_holder_main(sv[1], r);
    }
    close(sv[1]);
    return (xh_child){pid, sv[0]};
}

void xh_reap(xh_child *c, int sig)
{
    if (c->pid <= 0) return;
    if (sig) kill(c->pid, sig);
    close(c->fd);
    uint64_t guard = xh_after(30);
    int st;
    while (waitpid(c->pid, &st, WNOHANG) == 0) {
        if (km_now_ns() > guard) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &st, 0);
            break;
        }
        km_sleep_ms(5);
    }
    c->pid = -1;
}
