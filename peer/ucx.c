/*
 * ucx.c — the UCX back end: one ucp_context and one ucp_worker per node, driven by one progress
 * thread that is the only thread calling into the worker (UCS_THREAD_MODE_SINGLE, no locks on
 * the data path). This file holds endpoints, the progress thread, open and close; the data path
 * is ucx_io.c, and what both share ucx_internal.h. The owner thread talks to it through a small
 * command queue and an eventfd; the progress thread answers through atomics in the pull and peer
 * objects.
 *
 * Memory: the store's regions are mapped with ucp_mem_map once in open and their remote keys
 * packed into the node address; they are unmapped only in close. Endpoints: a listener accepts
 * pullers (an endpoint per connection request, with our own error handler) and a puller
 * connects to a holder's listening address, so every endpoint on both sides is ours, created
 * with UCP_ERR_HANDLING_MODE_PEER and closed when it fails (UCP_EP_CLOSE_FLAG_FORCE: all its
 * outstanding operations complete as canceled; only then are the remote keys destroyed and the
 * buffers of those operations handed back).
 *
 * Reads (ucx_io.c, with the holder's answers): PR_MODE_GET issues ucp_get_nbx from the holder's
 * registered memory into the destination page (the holder's CPU is not involved where the transport
 * reads remote memory itself; over TCP UCX emulates it with messages its progress thread answers).
 * PR_MODE_AM sends a small fetch message; the holder's progress thread answers with ucp_am_send_nbx
 * of the page from its registered memory, forced to rendezvous, and the reader receives it with
 * ucp_am_recv_data_nbx straight into the destination page. Both keep max_inflight pages of a
 * pull in flight. Deadlines are checked here: a pull still reading at its deadline stops; its
 * reads that wait for an answer end, and the endpoint is closed (a stopped or partitioned peer is
 * a failed peer) only when the peer has been silent for PR_SILENT_NS, or when a read that writes
 * into our pages is still running PR_SILENT_NS after its last sign of life; a live but slow peer
 * keeps the connection its other pulls share.
 *
 * Wake-ups: after work the thread keeps polling for a short while, then arms the worker and
 * sleeps in epoll on the worker's event fd and the command eventfd, with a timeout at the next
 * deadline, so an idle node costs no CPU.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "peer/ucx_internal.h"

static void pr_ucx_wake(pr_ucx *u)
{
    uint64_t one = 1;
    ssize_t r = write(u->evfd, &one, sizeof one);
    (void)r;
}

static int pr_ucx_push(pr_ucx *u, int kind, pr_peer *peer, pr_pull *pull)
{
    pr_cmd *c = calloc(1, sizeof *c);
    if (!c) return KM_ENOMEM;
    c->kind = kind;
    c->peer = peer;
    c->pull = pull;
    pthread_mutex_lock(&u->mu);
    if (u->cmds_tail)
        u->cmds_tail->next = c;
    else
        u->cmds = c;
    u->cmds_tail = c;
    pthread_mutex_unlock(&u->mu);
    pr_ucx_wake(u);
    return 0;
}

/* ---------------------------------------------------------------- endpoints */

static void pr_ep_fail(pr_uep *e)
{
    if (e->failed) return;
    e->failed = 1;
    if (e->peer) atomic_store_explicit(&e->peer->failed, 1, memory_order_release);
}

static void pr_ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    pr_uep *e = arg;
    KM_INFO("peer_endpoint_failed", "role=%s status=%s", e->peer ? "puller" : "holder",
            ucs_status_string(status));
    pr_ep_fail(e); /* closed by the loop, not inside UCX's callback */
}

static void pr_ep_flushed(void *req, ucs_status_t status, void *arg)
{
    pr_uep *e = arg;
    e->flush_req = NULL;
    ucp_request_free(req);
    if (status != UCS_OK) pr_ep_fail(e);
}

/* The endpoint is closed and every operation on it has completed: its remote keys go now. */
static void pr_ep_closed(pr_ucx *u, pr_uep *e)
{
    e->state = PR_EP_CLOSED;
    for (int i = 0; i < PR_MAX_REGIONS; i++)
        if (e->rkey[i]) {
            ucp_rkey_destroy(e->rkey[i]);
            e->rkey[i] = NULL;
        }
    if (e->counted) atomic_fetch_sub_explicit(&u->node->endpoints, 1, memory_order_relaxed);
    e->counted = 0;
}

/* Starts closing e (force: outstanding operations complete as canceled). */
void pr_ep_close(pr_ucx *u, pr_uep *e)
{
    if (e->state == PR_EP_CLOSING || e->state == PR_EP_CLOSED) return;
    pr_ep_fail(e);
    /* Still connecting (the flush that marks the end of the handshake is pending): closing it
     * now breaks UCX (1.13.1's connection manager asserts in its async thread; 1.22.0 frees the
     * endpoint under the flush, whose next progress reads it: docs/transfer.md, "Which UCX").
     * It is failed now, so nothing more is issued on it, and closed by pr_eps_service once the
     * flush completes, either way, or destroyed with the worker at close. */
    if (e->flush_req) return;
    e->state = PR_EP_CLOSING;
    if (!e->ep) {
        pr_ep_closed(u, e);
        return;
    }
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *r = ucp_ep_close_nbx(e->ep, &prm);
    if (UCS_PTR_IS_PTR(r))
        e->close_req = r;
    else
        pr_ep_closed(u, e);
}

/* Nobody refers to the closed endpoint any more: the owner may free its peer. */
static void pr_ep_reap(pr_ucx *u, pr_uep *e)
{
    if (e->peer) atomic_store_explicit(&e->peer->closed, 1, memory_order_release);
    free(e);
}

static void pr_ep_ready(pr_ucx *u, pr_uep *e)
{
    const pr_addr *a = &e->peer->addr;
    for (int i = 0; i < a->n_regions && u->node->cfg.mode == PR_MODE_GET; i++)
        if (a->region[i].rkey_len &&
            ucp_ep_rkey_unpack(e->ep, a->region[i].rkey, &e->rkey[i]) != UCS_OK) {
            KM_WARN("peer_rkey_unpack_failed", "region=%d", i);
            pr_ep_close(u, e);
            return;
        }
    e->state = PR_EP_READY;
    e->live_ns = km_now_ns();
}

static int pr_sockaddr(const char *host, int port, struct sockaddr_storage *ss, socklen_t *len)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    if (getaddrinfo(host, ps, &hints, &res) || !res) return KM_EINVAL;
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static void pr_do_connect(pr_ucx *u, pr_peer *p)
{
    pr_uep *e = p->be;
    struct sockaddr_storage ss;
    socklen_t sl;
    e->next = u->eps;
    u->eps = e;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {pr_ep_err_cb, e},
    };
    ucs_status_t st = UCS_ERR_INVALID_ADDR;
    if (!pr_sockaddr(p->addr.host, p->addr.port, &ss, &sl)) {
        ep.sockaddr = (ucs_sock_addr_t){(struct sockaddr *)&ss, sl};
        st = ucp_ep_create(u->w, &ep, &e->ep);
    }
    if (st != UCS_OK) {
        KM_WARN("peer_connect_failed", "host=%s port=%d status=%s", p->addr.host, p->addr.port,
                ucs_status_string(st));
        e->ep = NULL;
        pr_ep_fail(e);
        pr_ep_closed(u, e);
        return;
    }
    e->counted = 1;
    atomic_fetch_add_explicit(&u->node->endpoints, 1, memory_order_relaxed);
    /* A flush completes once the connection is wired up; only then are keys unpacked. */
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = pr_ep_flushed,
                               .user_data = e};
    void *r = ucp_ep_flush_nbx(e->ep, &prm);
    if (UCS_PTR_IS_PTR(r))
        e->flush_req = r;
    else if (UCS_PTR_IS_ERR(r))
        pr_ep_fail(e);
}

static ucs_status_t pr_am_unknown_cb(void *arg, const void *header, size_t hlen, void *data,
                                     size_t len, const ucp_am_recv_param_t *param)
{
    pr_ucx *u = arg;
    atomic_fetch_add_explicit(&u->node->am_unknown, 1, memory_order_relaxed);
    return UCS_OK;
}

static void pr_conn_cb(ucp_conn_request_h req, void *arg)
{
    pr_ucx *u = arg;
    pr_uep *e = u->closing ? NULL : calloc(1, sizeof *e);
    if (!e) {
        ucp_listener_reject(u->listener, req);
        return;
    }
    e->u = u;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_USER_DATA,
        .conn_request = req,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {pr_ep_err_cb, e},
        .user_data = e,
    };
    if (ucp_ep_create(u->w, &ep, &e->ep) != UCS_OK) {
        free(e);
        return;
    }
    e->counted = 1;
    e->am_tcp = -1;
    atomic_fetch_add_explicit(&u->node->endpoints, 1, memory_order_relaxed);
    e->state = PR_EP_READY;
    e->next = u->eps;
    u->eps = e;
}

/* ---------------------------------------------------------------- quiescing the listener */

/* UCX's TCP connection manager keeps a connection its listener accepted but whose request has
 * not arrived yet after the listener is destroyed, and calls that freed listener when the
 * request arrives (docs/transfer.md, "Which UCX"). So before the listener goes, the node makes
 * sure no such connection exists or can appear: the listening socket drops every new handshake
 * (a socket filter, which a listening TCP socket applies to SYNs and handshake ACKs), and every
 * connection it accepted is shut down, which UCX sees as the client going away and answers by
 * closing its half-made endpoint; a request already read is rejected (pr_conn_cb). */

/* The worker's TCP transport listens too (the lanes' own port). Destroying it with a lane's
 * connection in its accept queue resets that connection; a puller on the same host, whose
 * connect() to that port completed at once, then sees its first send fail, its reconnect
 * refused at once, and UCX 1.22.0 fails and frees that lane while its endpoint still holds it
 * (SIGSEGV in ucp_worker_discard_uct_ep_destroy_progress; docs/transfer.md, "Which UCX"). So
 * those sockets are quiesced with the listener: filtered, and their accept queues left to drain
 * (UCX's async thread accepts). They are told apart from other listening sockets of the process
 * by inode: the ones that appeared while the worker was created (pr_tl_sockets_find). */

#define PR_MAX_LISTENING 256 /* a process's listening sockets that the node can tell apart */
#define PR_SETTLE_NS     (2ull * 1000 * 1000) /* pr_listener_quiesce: filtered this long at least */

static void pr_eps_service(pr_ucx *u);

static int pr_sa_port(const struct sockaddr_storage *s)
{
    return s->ss_family == AF_INET6  ? ntohs(((const struct sockaddr_in6 *)s)->sin6_port)
           : s->ss_family == AF_INET ? ntohs(((const struct sockaddr_in *)s)->sin_port)
                                     : -1;
}

/* 1 when the socket fd is bound where the listener is (the listening socket, or one it
 * accepted); *listening says which. */
static int pr_listener_socket(const pr_ucx *u, int fd, int *listening)
{
    const struct sockaddr_storage *l = &u->listen_sa;
    struct sockaddr_storage s;
    socklen_t sl = sizeof s, il = sizeof(int);
    int type = 0;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &il) || type != SOCK_STREAM ||
        getsockname(fd, (struct sockaddr *)&s, &sl) || s.ss_family != l->ss_family ||
        pr_sa_port(&s) != pr_sa_port(l))
        return 0;
    const struct in_addr *a4 = &((const struct sockaddr_in *)l)->sin_addr;
    const struct in6_addr *a6 = &((const struct sockaddr_in6 *)l)->sin6_addr;
    if (l->ss_family == AF_INET && a4->s_addr != htonl(INADDR_ANY) &&
        a4->s_addr != ((const struct sockaddr_in *)&s)->sin_addr.s_addr)
        return 0;
    if (l->ss_family == AF_INET6 && !IN6_IS_ADDR_UNSPECIFIED(a6) &&
        memcmp(a6, &((const struct sockaddr_in6 *)&s)->sin6_addr, sizeof *a6))
        return 0;
    il = sizeof *listening;
    return !getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, listening, &il);
}

/* The descriptor an entry of /proc/self/fd (d) names, -1 for d's own and for "." and "..". */
static int pr_dirent_fd(const struct dirent *de, DIR *d)
{
    char *end;
    long fd = strtol(de->d_name, &end, 10);
    return *end || end == de->d_name || fd == dirfd(d) ? -1 : (int)fd;
}

/* The inode of fd (the entry de of /proc/self/fd, d) when it is a listening TCP socket, else 0.
 * The inode comes from the entry's link ("socket:[N]"), not from fstat: the descriptors belong
 * to other threads too, which may close one while this reads it (ThreadSanitizer reports an
 * fstat racing a close; the link of a closed one is simply gone). */
static uint64_t pr_listening_inode(int fd, const struct dirent *de, DIR *d)
{
    char link[64];
    unsigned long long ino = 0;
    ssize_t n = readlinkat(dirfd(d), de->d_name, link, sizeof link - 1);
    if (n <= 0) return 0;
    link[n] = 0;
    if (sscanf(link, "socket:[%llu]", &ino) != 1 || !ino) return 0;
    struct sockaddr_storage s;
    socklen_t sl = sizeof s, il = sizeof(int);
    int type = 0, on = 0;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &il) || type != SOCK_STREAM ||
        getsockname(fd, (struct sockaddr *)&s, &sl) ||
        (s.ss_family != AF_INET && s.ss_family != AF_INET6) ||
        getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &il) || !on)
        return 0;
    return (uint64_t)ino;
}

/* The inodes of this process's listening TCP sockets into ino (at most cap); -1 when the
 * descriptors cannot be listed or there are more than cap. */
static int pr_listening_inodes(uint64_t *ino, int cap)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    for (struct dirent *de; (de = readdir(d));) {
        int fd = pr_dirent_fd(de, d);
        uint64_t i;
        if (fd < 0 || !(i = pr_listening_inode(fd, de, d))) continue;
        if (n == cap) {
            n = -1;
            break;
        }
        ino[n++] = i;
    }
    closedir(d);
    return n;
}

static int pr_tl_socket(const pr_ucx *u, uint64_t ino)
{
    for (int i = 0; i < u->n_tl_ino && ino; i++)
        if (u->tl_ino[i] == ino) return 1;
    return 0;
}

/* After ucp_worker_create: the listening sockets that are not in before[nb] are the worker's
 * transport's. None are kept when either list is unknown or too many appeared. */
static void pr_tl_sockets_find(pr_ucx *u, const uint64_t *before, int nb)
{
    uint64_t now[PR_MAX_LISTENING];
    int n = nb < 0 ? -1 : pr_listening_inodes(now, PR_MAX_LISTENING);
    u->n_tl_ino = 0;
    for (int i = 0; i < n; i++) {
        int old = 0;
        for (int j = 0; j < nb && !old; j++) old = before[j] == now[i];
        if (old) continue;
        if (u->n_tl_ino == PR_MAX_TL_SOCKS) {
            u->n_tl_ino = 0;
            break;
        }
        u->tl_ino[u->n_tl_ino++] = now[i];
    }
    KM_DEBUG("peer_transport_sockets", "listening=%d", u->n_tl_ino);
}

/* One pass over this process's sockets at the listener's address and the worker's transport
 * listening sockets: each listening one gets the drop-all filter (filter = 1) and adds its
 * queue of accepted handshakes to *queued; each connection the listener accepted is shut down.
 * Returns the accepted connections found, -1 when the process's descriptors cannot be listed. */
static int pr_listener_sweep(const pr_ucx *u, int filter, unsigned *queued)
{
    static struct sock_filter drop[] = {BPF_STMT(BPF_RET | BPF_K, 0)};
    const struct sock_fprog prog = {.len = 1, .filter = drop};
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int accepted = 0;
    *queued = 0;
    for (struct dirent *de; (de = readdir(d));) {
        int fd = pr_dirent_fd(de, d), listening = 0;
        if (fd < 0) continue;
        if (pr_tl_socket(u, pr_listening_inode(fd, de, d)))
            listening = 1;
        else if (!pr_listener_socket(u, fd, &listening))
            continue;
        if (listening) {
            if (filter && setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &prog, sizeof prog))
                KM_WARN("peer_listener_filter", "error=\"%s\"", strerror(errno));
            struct tcp_info ti;
            socklen_t tl = sizeof ti;
            if (!getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl)) *queued += ti.tcpi_unacked;
        } else {
            shutdown(fd, SHUT_RDWR);
            accepted++;
        }
    }
    closedir(d);
    return accepted;
}

/* Progress thread, closing: afterwards no connection of the listener waits for its request
 * (bounded by PR_SILENT_NS; a UCX that never closed a shut-down connection is logged). Only a
 * sweep that starts PR_SETTLE_NS after the filter went on may find nothing and end it: a
 * handshake whose last ACK passed just before the filter joins the accept queue a moment after,
 * and a listener destroyed then would be called for it. */
static void pr_listener_quiesce(pr_ucx *u)
{
    if (!u->listener || pr_sa_port(&u->listen_sa) <= 0) return;
    unsigned queued = 0;
    const uint64_t start = km_now_ns();
    int left = pr_listener_sweep(u, 1, &queued), found = left;
    for (const uint64_t until = start + PR_SILENT_NS; left >= 0;) {
        while (ucp_worker_progress(u->w)) {
        }
        pr_eps_service(u);
        const uint64_t swept = km_now_ns();
        left = pr_listener_sweep(u, 0, &queued);
        if (left <= 0 && !queued && swept - start >= PR_SETTLE_NS) break;
        if (km_now_ns() > until) {
            KM_WARN("peer_listener_busy", "connections=%d queued=%u", left, queued);
            break;
        }
        km_sleep_ms(1);
    }
    KM_DEBUG("peer_listener_quiesced", "connections=%d us=%llu", found,
             (unsigned long long)((km_now_ns() - start) / 1000));
}

/* ---------------------------------------------------------------- the progress thread */

static void pr_cmds_run(pr_ucx *u)
{
    pthread_mutex_lock(&u->mu);
    pr_cmd *c = u->cmds;
    u->cmds = u->cmds_tail = NULL;
    pthread_mutex_unlock(&u->mu);
    while (c) {
        pr_cmd *next = c->next;
        if (c->kind == PR_CMD_CONNECT) {
            pr_do_connect(u, c->peer);
        } else if (c->kind == PR_CMD_DISCONNECT) {
            pr_uep *e = c->peer->be;
            e->want_close = 1;
        } else { /* PR_CMD_FETCH */
            pr_upull *up = c->pull->be;
            up->next = u->pulls;
            u->pulls = up;
        }
        free(c);
        c = next;
    }
}

/* Closes failed endpoints and those the owner let go of once no pull uses them; reaps those
 * whose close has completed. */
static void pr_eps_service(pr_ucx *u)
{
    for (pr_uep **pp = &u->eps; *pp;) {
        pr_uep *e = *pp;
        if (e->state == PR_EP_CONNECTING && !e->flush_req && !e->failed) pr_ep_ready(u, e);
        if (e->failed || e->want_close) {
            int used = 0;
            for (pr_upull *up = u->pulls; up && !used; up = up->next) used = up->ep == e;
            if (e->failed || !used) pr_ep_close(u, e);
        }
        if (e->state == PR_EP_CLOSING && e->close_req &&
            ucp_request_check_status(e->close_req) != UCS_INPROGRESS) {
            ucp_request_free(e->close_req);
            e->close_req = NULL;
            pr_ep_closed(u, e);
        }
        int in_use = 0;
        for (pr_upull *up = u->pulls; up && !in_use; up = up->next) in_use = up->ep == e;
        if (e->state == PR_EP_CLOSED && !in_use && !e->flush_req && (!e->peer || e->want_close)) {
            *pp = e->next;
            pr_ep_reap(u, e);
            continue;
        }
        pp = &e->next;
    }
}

static void *pr_progress_main(void *arg)
{
    pr_ucx *u = arg;
    int idle = 0;
    uint64_t last_work = 0;
    for (;;) {
        pr_cmds_run(u);
        int work = 0;
        while (ucp_worker_progress(u->w)) work = 1;
        pr_replies_send(u);
        uint64_t now = km_now_ns(), next = UINT64_MAX;
        pr_pulls_service(u, now, &next);
        pr_eps_service(u);
        pthread_mutex_lock(&u->mu);
        int stop = u->stop && !u->cmds;
        pthread_mutex_unlock(&u->mu);
        if (stop) break;
        if (work || u->replies) {
            idle = 0;
            last_work = now;
            continue;
        }
        /* Poll while reads are ours to drive or work came lately (a reader's next request is
         * usually on its way); sleep only when idle for a while. */
        if (u->pulls || now - last_work < PR_SPIN_NS || ++idle < PR_SPINS) {
            if (!(++idle & 63)) sched_yield();
            continue;
        }
        idle = 0;
        if (ucp_worker_arm(u->w) == UCS_ERR_BUSY) continue;
        int ms = 1000;
        if (next != UINT64_MAX) ms = next > now ? (int)((next - now) / 1000000 + 1) : 0;
        if (ms > 1000) ms = 1000;
        struct epoll_event ev[4];
        int k = epoll_wait(u->epfd, ev, 4, ms);
        for (int i = 0; i < k; i++)
            if (ev[i].data.fd == u->evfd) {
                uint64_t v;
                ssize_t r = read(u->evfd, &v, sizeof v);
                (void)r;
            }
    }
    /* Close: refuse new connections, fail every pull, close every endpoint, and wait (bounded)
     * for the closes; then quiesce the listener for its destruction (pr_ucx_close). */
    u->closing = 1;
    for (pr_upull *up = u->pulls; up; up = up->next) atomic_store(&up->p->stop, 1);
    for (pr_uep *e = u->eps; e; e = e->next) {
        e->want_close = 1;
        pr_ep_fail(e);
    }
    const uint64_t closing = km_now_ns(), until = closing + PR_CLOSE_NS;
    while ((u->eps || u->pulls) && km_now_ns() < until) {
        ucp_worker_progress(u->w);
        uint64_t next = UINT64_MAX;
        pr_pulls_service(u, km_now_ns(), &next);
        pr_eps_service(u);
        /* Endpoints still connecting a while after the close began (a stopped or partitioned
         * peer) are left to the worker's teardown; a live peer's completes within it. */
        int connecting = 0, other = 0;
        for (pr_uep *e = u->eps; e; e = e->next) {
            connecting += e->flush_req != NULL;
            other += e->flush_req == NULL;
        }
        if (!u->old_cm && connecting && !other && !u->pulls && km_now_ns() - closing > PR_SILENT_NS)
            break;
    }
    if (!u->old_cm) pr_listener_quiesce(u);
    while (u->replies) {
        pr_reply *r = u->replies;
        u->replies = r->next;
        free(r);
    }
    return NULL;
}

/* ---------------------------------------------------------------- open and close */

static int pr_ucx_fail(pr_node *n, pr_ucx *u, km_errbuf *err, const char *what, ucs_status_t st)
{
    n->be = u;
    pr_ucx_ops.close(n);
    return km_errf(err, KM_EIO, "peer ucx: %s: %s", what, ucs_status_string(st));
}

/* The interface that holds the address the node listens on (NULL or 0.0.0.0: none), in dev.
 * UCX otherwise opens a lane on every interface of the host, and a lane from an address the
 * peer has no route back to (another network's interface: a second NIC, a container bridge, a
 * namespace's veth) times out the whole endpoint. */
static int pr_listen_device(const char *host, char *dev, size_t cap)
{
    struct in_addr v4;
    struct in6_addr v6;
    int fam = host && inet_pton(AF_INET, host, &v4) == 1    ? AF_INET
              : host && inet_pton(AF_INET6, host, &v6) == 1 ? AF_INET6
                                                            : 0;
    if (!fam || (fam == AF_INET && v4.s_addr == htonl(INADDR_ANY)) ||
        (fam == AF_INET6 && IN6_IS_ADDR_UNSPECIFIED(&v6)))
        return 0;
    struct ifaddrs *all, *i;
    if (getifaddrs(&all)) return 0;
    int found = 0;
    for (i = all; i && !found; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != fam) continue;
        found = fam == AF_INET
                    ? !memcmp(&((struct sockaddr_in *)i->ifa_addr)->sin_addr, &v4, sizeof v4)
                    : !memcmp(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, &v6, sizeof v6);
        if (found) snprintf(dev, cap, "%s", i->ifa_name);
    }
    freeifaddrs(all);
    return found;
}

/* UCX before 1.22 (Debian 12 ships 1.13.1; the Makefile builds against 1.22.0 from
 * deploy/ucx.sh unless told otherwise) aborts when a worker is destroyed under a connecting
 * endpoint, so there the node leaves such a worker to the process exit (pr_ucx_close). */
static int pr_ucx_old_cm(void)
{
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return major < 1 || (major == 1 && minor < 22);
}

static int pr_ucx_open(pr_node *n, km_errbuf *err)
{
    pr_ucx *u = calloc(1, sizeof *u);
    if (!u) return km_errf(err, KM_ENOMEM, "peer ucx: out of memory");
    u->node = n;
    u->wfd = u->evfd = u->epfd = -1;
    pthread_mutex_init(&u->mu, NULL);
    u->old_cm = pr_ucx_old_cm();
    u->tokens = malloc(sizeof(int32_t) * (size_t)kv_store_page_tokens(n->store));
    if (!u->tokens || pr_seal_init(&u->seal)) {
        free(u->tokens);
        pthread_mutex_destroy(&u->mu);
        free(u);
        return km_errf(err, KM_ENOMEM, "peer ucx: no cipher context");
    }
    if (u->old_cm)
        KM_WARN("peer_ucx_old",
                "version=%s why=\"its connection manager can crash; build against "
                "the pinned UCX (make deps, docs/transfer.md)\"",
                ucp_get_version_string());
    const int get = n->cfg.mode == PR_MODE_GET;
    ucp_params_t prm = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
                        .features =
                            (get ? UCP_FEATURE_RMA : 0) | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                        .name = "kvmesh-peer"};
    ucp_config_t *cfg;
    /* UCX 1.13's TCP put-zcopy (its rendezvous over TCP) hits a fatal assertion in
     * uct_tcp_ep (PUT_TX_WAITING_ACK) when the peer dies in the middle of one, taking this
     * process down with it (seen in test_xfer_proc): off unless the environment says otherwise.
     * A transport setting, read from the environment when the interface opens (ucp_config_modify
     * only takes UCP's own keys in 1.13). */
    setenv("UCX_TCP_PUT_ENABLE", "n", 0);
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) return pr_ucx_fail(n, u, err, "config", st);
    /* UCX 1.22's protocol selection (v2) answers AM fetches over TCP several times slower than
     * the one 1.13 had, still there as PROTO_ENABLE=n, under which gets fail: an AM node takes
     * the old one unless UCX_PROTO_ENABLE says otherwise (docs/transfer.md, "Which UCX"). */
    if (!get && !u->old_cm && !getenv("UCX_PROTO_ENABLE") &&
        (st = ucp_config_modify(cfg, "PROTO_ENABLE", "n")) != UCS_OK)
        KM_WARN("peer_proto_enable", "status=\"%s\"", ucs_status_string(st));
    /* Lanes only on the listening interface, unless UCX_NET_DEVICES says otherwise. */
    char dev[64];
    if (!getenv("UCX_NET_DEVICES") && pr_listen_device(n->cfg.listen_host, dev, sizeof dev)) {
        st = ucp_config_modify(cfg, "NET_DEVICES", dev);
        if (st != UCS_OK)
            KM_WARN("peer_net_devices", "device=%s status=\"%s\"", dev, ucs_status_string(st));
        else
            KM_DEBUG("peer_net_devices", "device=%s", dev);
    }
    st = ucp_init(&prm, cfg, &u->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) return pr_ucx_fail(n, u, err, "init", st);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    uint64_t before[PR_MAX_LISTENING];
    int nb = u->old_cm ? -1 : pr_listening_inodes(before, PR_MAX_LISTENING);
    if ((st = ucp_worker_create(u->ctx, &wp, &u->w)) != UCS_OK)
        return pr_ucx_fail(n, u, err, "worker", st);
    pr_tl_sockets_find(u, before, nb);
    /* The store's page memory, once. */
    pr_addr a = {0};
    for (int i = 0; i < n->n_regions; i++) {
        ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                                 UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                                   .address = n->regions[i].base,
                                   .length = n->regions[i].bytes};
        if ((st = ucp_mem_map(u->ctx, &mp, &u->memh[i])) != UCS_OK)
            return pr_ucx_fail(n, u, err, "mem_map", st);
        u->n_regions = i + 1;
        /* remote keys only for one-sided readers (the memory handle serves rendezvous sends) */
        if (get &&
            (st = ucp_rkey_pack(u->ctx, u->memh[i], &u->rkey_buf[i], &u->rkey_len[i])) != UCS_OK)
            return pr_ucx_fail(n, u, err, "rkey_pack", st);
        a.region[i].base = (uint64_t)(uintptr_t)n->regions[i].base;
        a.region[i].bytes = n->regions[i].bytes;
        a.region[i].rkey = u->rkey_buf[i];
        a.region[i].rkey_len = u->rkey_len[i];
    }
    a.n_regions = n->n_regions;
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = PR_AM_FETCH,
                                 .cb = pr_am_fetch_cb,
                                 .arg = u};
    if ((st = ucp_worker_set_am_recv_handler(u->w, &hp)) != UCS_OK)
        return pr_ucx_fail(n, u, err, "am handler", st);
    hp.id = PR_AM_DATA;
    hp.cb = pr_am_data_cb;
    if ((st = ucp_worker_set_am_recv_handler(u->w, &hp)) != UCS_OK)
        return pr_ucx_fail(n, u, err, "am handler", st);
    /* every other id a peer may name: counted and dropped rather than logged by UCX; from the
     * highest down, so that UCX's table of handlers grows once */
    hp.cb = pr_am_unknown_cb;
    for (unsigned id = PR_AM_IDS; id-- > 0;) {
        if (id == PR_AM_FETCH || id == PR_AM_DATA) continue;
        hp.id = id;
        if ((st = ucp_worker_set_am_recv_handler(u->w, &hp)) != UCS_OK)
            return pr_ucx_fail(n, u, err, "am handler", st);
    }
    struct sockaddr_storage ss;
    socklen_t sl;
    if (pr_sockaddr(n->cfg.listen_host, n->cfg.listen_port, &ss, &sl)) {
        n->be = u;
        pr_ucx_ops.close(n);
        return km_errf(err, KM_EINVAL, "peer ucx: bad listen address %s", n->cfg.listen_host);
    }
    ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                                              UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                .sockaddr = {(struct sockaddr *)&ss, sl},
                                .conn_handler = {pr_conn_cb, u}};
    if ((st = ucp_listener_create(u->w, &lp, &u->listener)) != UCS_OK)
        return pr_ucx_fail(n, u, err, "listen", st);
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if ((st = ucp_listener_query(u->listener, &la)) != UCS_OK)
        return pr_ucx_fail(n, u, err, "listener query", st);
    u->listen_sa = la.sockaddr;
    a.port = pr_sa_port(&la.sockaddr);
    snprintf(a.host, sizeof a.host, "%s", n->cfg.advertise_host);
    n->addr_len = pr_addr_size(&a);
    if (!n->addr_len || !(n->addr = malloc(n->addr_len)) ||
        pr_addr_encode(&a, n->addr, n->addr_len) != n->addr_len) {
        n->be = u;
        pr_ucx_ops.close(n);
        return km_errf(err, KM_EINVAL, "peer ucx: cannot encode the node address");
    }
    /* Wake-ups: the worker's event fd and our command eventfd. */
    if ((st = ucp_worker_get_efd(u->w, &u->wfd)) != UCS_OK)
        return pr_ucx_fail(n, u, err, "event fd", st);
    u->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    u->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event e1 = {.events = EPOLLIN, .data.fd = u->wfd};
    struct epoll_event e2 = {.events = EPOLLIN, .data.fd = u->evfd};
    if (u->evfd < 0 || u->epfd < 0 || epoll_ctl(u->epfd, EPOLL_CTL_ADD, u->wfd, &e1) ||
        epoll_ctl(u->epfd, EPOLL_CTL_ADD, u->evfd, &e2)) {
        n->be = u;
        pr_ucx_ops.close(n);
        return km_errf(err, KM_EIO, "peer ucx: epoll: %s", strerror(errno));
    }
    if (pthread_create(&u->thr, NULL, pr_progress_main, u)) {
        n->be = u;
        pr_ucx_ops.close(n);
        return km_errf(err, KM_ENOMEM, "peer ucx: cannot start the progress thread");
    }
    u->thr_started = 1;
    n->be = u;
    KM_INFO("peer_node_open", "backend=ucx host=%s port=%d regions=%d mode=%s", a.host, a.port,
            a.n_regions, n->cfg.mode == PR_MODE_GET ? "get" : "am");
    return 0;
}

static void pr_ucx_close(pr_node *n)
{
    pr_ucx *u = n->be;
    if (!u) return;
    if (u->thr_started) {
        pthread_mutex_lock(&u->mu);
        u->stop = 1;
        pthread_mutex_unlock(&u->mu);
        pr_ucx_wake(u);
        pthread_join(u->thr, NULL);
    }
    /* What the bounded wait left (a close UCX never completed) goes with the worker. */
    while (u->pulls) {
        pr_upull *up = u->pulls;
        u->pulls = up->next;
        atomic_store(&up->p->fetch_done, 1);
        pr_upull_free(up);
    }
    for (int i = 0; i < u->n_regions; i++) {
        if (u->rkey_buf[i]) ucp_rkey_buffer_release(u->rkey_buf[i]);
        ucp_mem_unmap(u->ctx, u->memh[i]);
    }
    for (pr_uep *e = u->eps; e; e = e->next)
        for (int i = 0; i < PR_MAX_REGIONS; i++)
            if (e->rkey[i]) ucp_rkey_destroy(e->rkey[i]);
    /* The listener goes right before the worker. The progress thread quiesced it
     * (pr_listener_quiesce): no connection it accepted is left waiting for its request, which
     * UCX would hand to the freed listener, and no new one can be made. */
    int stuck = 0; /* endpoints whose handshake never ended: a stopped or partitioned peer */
    for (pr_uep *e = u->eps; e && u->old_cm; e = e->next) stuck += e->flush_req != NULL;
    if (stuck) {
        /* UCX 1.13.1 aborts on either way out for such an endpoint: closing it (its TCP
         * connection manager asserts, pr_ep_close) or destroying the worker under it
         * ("pending request ... should have been flushed", seen when a draining worker exited
         * with a SIGSTOPped peer in its view). So the UCX worker, its listener and context and
         * this back end's state are left to the process exit: nothing progresses them any more,
         * so no callback of theirs can run. */
        KM_WARN("peer_close_incomplete",
                "endpoints=%d why=\"a peer never finished its handshake (stopped or "
                "partitioned); the UCX worker is left to the process exit\"",
                stuck);
        for (pr_uep *e = u->eps; e; e = e->next) {
            if (e->counted) atomic_fetch_sub(&n->endpoints, 1);
            e->counted = 0;
            if (e->peer) atomic_store(&e->peer->closed, 1);
        }
    } else {
        if (u->listener) ucp_listener_destroy(u->listener);
        if (u->w) ucp_worker_destroy(u->w);
        while (u->eps) { /* the worker destroyed them */
            pr_uep *e = u->eps;
            u->eps = e->next;
            if (e->counted) atomic_fetch_sub(&n->endpoints, 1);
            if (e->peer) atomic_store(&e->peer->closed, 1);
            free(e);
        }
        if (u->ctx) ucp_cleanup(u->ctx);
    }
    while (u->cmds) { /* commands sent after the thread stopped */
        pr_cmd *c = u->cmds;
        u->cmds = c->next;
        if (c->kind == PR_CMD_FETCH) {
            pr_upull_free(c->pull->be);
            atomic_store(&c->pull->fetch_done, 1);
        } else if (c->kind == PR_CMD_CONNECT) {
            free(c->peer->be);
            atomic_store(&c->peer->closed, 1);
        }
        free(c);
    }
    if (u->epfd >= 0) close(u->epfd);
    if (u->evfd >= 0) close(u->evfd);
    n->be = NULL;
    if (stuck) return; /* u is still UCX's callback argument (above) */
    pr_seal_free(&u->seal);
    free(u->tokens);
    pthread_mutex_destroy(&u->mu);
    free(u);
}

static int pr_ucx_connect(pr_node *n, pr_peer *p, km_errbuf *err)
{
    pr_uep *e = calloc(1, sizeof *e);
    if (!e) return km_errf(err, KM_ENOMEM, "peer ucx: out of memory");
    e->u = n->be;
    e->peer = p;
    e->am_tcp = -1;
    e->state = PR_EP_CONNECTING;
    p->be = e;
    int rc = pr_ucx_push(n->be, PR_CMD_CONNECT, p, NULL);
    if (rc) {
        free(e);
        return km_errf(err, rc, "peer ucx: out of memory");
    }
    return 0;
}

static void pr_ucx_disconnect(pr_node *n, pr_peer *p)
{
    if (pr_ucx_push(n->be, PR_CMD_DISCONNECT, p, NULL))
        KM_ERROR("peer_disconnect_lost", "reason=out_of_memory");
}

static int pr_ucx_fetch(pr_node *n, pr_pull *p)
{
    pr_upull *up = calloc(1, sizeof *up);
    const int w = n->cfg.max_inflight;
    if (!up) return KM_ENOMEM;
    up->ops = calloc((size_t)p->n, sizeof *up->ops);
    up->sums = aligned_alloc(_Alignof(kv_xfer_sum), sizeof(kv_xfer_sum) * (size_t)w);
    up->free_sums = malloc(sizeof(int) * (size_t)w);
    if (!up->ops || !up->sums || !up->free_sums) {
        pr_upull_free(up);
        return KM_ENOMEM;
    }
    for (int i = 0; i < w; i++) up->free_sums[i] = i;
    up->n_free_sums = w;
    uint64_t bytes = 0;
    for (int i = 0; i < p->n; i++) bytes += p->pages[i].dst.bytes;
    up->stream = n->cfg.stream_bytes >= 0 && bytes > (uint64_t)n->cfg.stream_bytes;
    up->p = p;
    up->ep = p->peer->be;
    for (int i = 0; i < p->n; i++) {
        up->ops[i].up = up;
        up->ops[i].index = i;
        up->ops[i].sum = -1;
    }
    p->be = up;
    int rc = pr_ucx_push(n->be, PR_CMD_FETCH, NULL, p);
    if (rc) pr_upull_free(up);
    return rc;
}

static void pr_ucx_cancel(pr_node *n, pr_pull *p)
{
    pr_ucx_wake(n->be);
}

const pr_backend_ops pr_ucx_ops = {
    .name = "ucx",
    .open = pr_ucx_open,
    .close = pr_ucx_close,
    .connect = pr_ucx_connect,
    .disconnect = pr_ucx_disconnect,
    .fetch = pr_ucx_fetch,
    .cancel = pr_ucx_cancel,
};
