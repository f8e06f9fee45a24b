/*
 * zmqx.c — thin helpers over libzmq for the socket patterns kvmesh uses: ROUTER (a daemon's
 * request front), DEALER (a client or a router talking to one worker), PUB/SUB (KV events and the
 * cluster view).
 *
 * Why it is built this way:
 *  - Every socket gets the same sane options in one place: bounded queues (high-water marks), no
 *    linger on close (a dying daemon must not hang on unsent frames), ZMQ_MAXMSGSIZE so libzmq
 *    itself drops a peer that sends a frame larger than the protocol allows before it is ever
 *    buffered whole, and ZMTP heartbeats so dead TCP peers are noticed without traffic.
 *  - Messages are received whole into km_zmsg (copies, so the caller never juggles zmq_msg_t) and
 *    a message with more parts than any kvmesh message has is consumed and reported, never left
 *    half-read in the socket.
 *  - libzmq calls are direct (not CZMQ): the surface needed is small and libzmq's own handles are
 *    plain `void *`, which keeps zmq.h out of svc.h.
 */
#include "common/svc.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

static int zerr(km_errbuf *err, const char *what, const char *detail)
{
    int e = zmq_errno();
    int code = KM_EIO;
    if (e == EAGAIN)
        code = KM_EAGAIN;
    else if (e == EINTR)
        code = KM_EAGAIN;
    else if (e == EHOSTUNREACH)
        code = KM_ENOTFOUND;
    else if (e == ETERM)
        code = KM_ECANCELED;
    else if (e == EINVAL || e == EPROTONOSUPPORT || e == ENOCOMPATPROTO)
        code = KM_EINVAL;
    else if (e == ENOMEM)
        code = KM_ENOMEM;
    return km_errf(err, code, "zmq %s%s%s: %s", what, detail ? " " : "", detail ? detail : "",
                   zmq_strerror(e));
}

void km_zsock_opts_default(km_zsock_opts *o)
{
    memset(o, 0, sizeof *o);
    o->sndhwm = 10000;
    o->rcvhwm = 10000;
    o->linger_ms = 0;
    o->max_msg_size = (int64_t)KM_PROTO_MAX_FRAME + 4096;
    o->heartbeat_ivl_ms = 1000;
    o->heartbeat_timeout_ms = 0;
}

void *km_zctx_create(void)
{
    return zmq_ctx_new();
}

void km_zctx_destroy(void *zctx)
{
    if (!zctx) return;
    while (zmq_ctx_term(zctx) != 0 && zmq_errno() == EINTR) {
    }
}

static int set_int(void *s, int opt, int v, const char *name, km_errbuf *err)
{
    if (zmq_setsockopt(s, opt, &v, sizeof v) != 0) return zerr(err, "setsockopt", name);
    return 0;
}

int km_zsock_open(void *zctx, km_zsock_type type, const km_zsock_opts *o_in, void **out,
                  km_errbuf *err)
{
    static const int ztype[] = {ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PUB, ZMQ_SUB};
    *out = NULL;
    if (!zctx || (unsigned)type > KM_ZSUB)
        return km_errf(err, KM_EINVAL, "zmq socket: bad context or type %d", (int)type);
    km_zsock_opts o;
    if (o_in)
        o = *o_in;
    else
        km_zsock_opts_default(&o);

    void *s = zmq_socket(zctx, ztype[type]);
    if (!s) return zerr(err, "socket", NULL);
    int rc = 0;
    if (!rc) rc = set_int(s, ZMQ_SNDHWM, o.sndhwm, "ZMQ_SNDHWM", err);
    if (!rc) rc = set_int(s, ZMQ_RCVHWM, o.rcvhwm, "ZMQ_RCVHWM", err);
    if (!rc) rc = set_int(s, ZMQ_LINGER, o.linger_ms, "ZMQ_LINGER", err);
    if (!rc && zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &o.max_msg_size, sizeof o.max_msg_size) != 0)
        rc = zerr(err, "setsockopt", "ZMQ_MAXMSGSIZE");
    if (!rc && o.heartbeat_ivl_ms > 0) {
        int timeout = o.heartbeat_timeout_ms > 0 ? o.heartbeat_timeout_ms : 3 * o.heartbeat_ivl_ms;
        int ttl = timeout > 6553599 ? 6553599 : timeout; /* libzmq's limit (deciseconds) */
        rc = set_int(s, ZMQ_HEARTBEAT_IVL, o.heartbeat_ivl_ms, "ZMQ_HEARTBEAT_IVL", err);
        if (!rc) rc = set_int(s, ZMQ_HEARTBEAT_TIMEOUT, timeout, "ZMQ_HEARTBEAT_TIMEOUT", err);
        if (!rc) rc = set_int(s, ZMQ_HEARTBEAT_TTL, ttl, "ZMQ_HEARTBEAT_TTL", err);
    }
    if (!rc && o.routing_id) {
        size_t n = strlen(o.routing_id);
        if (n == 0 || n > 255)
            rc = km_errf(err, KM_EINVAL, "zmq routing id must be 1..255 bytes, got %zu", n);
        else if (zmq_setsockopt(s, ZMQ_ROUTING_ID, o.routing_id, n) != 0)
            rc = zerr(err, "setsockopt", "ZMQ_ROUTING_ID");
    }
    if (!rc && type == KM_ZROUTER && o.router_mandatory)
        rc = set_int(s, ZMQ_ROUTER_MANDATORY, 1, "ZMQ_ROUTER_MANDATORY", err);
    if (rc) {
        zmq_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

void km_zsock_close(void *s)
{
    if (s) zmq_close(s);
}

int km_zsock_bind(void *s, const char *endpoint, km_errbuf *err)
{
    if (zmq_bind(s, endpoint) != 0) return zerr(err, "bind", endpoint);
    return 0;
}

int km_zsock_connect(void *s, const char *endpoint, km_errbuf *err)
{
    if (zmq_connect(s, endpoint) != 0) return zerr(err, "connect", endpoint);
    return 0;
}

int km_zsock_last_endpoint(void *s, char *buf, size_t cap, km_errbuf *err)
{
    char tmp[256];
    size_t n = sizeof tmp;
    if (zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, tmp, &n) != 0)
        return zerr(err, "getsockopt", "ZMQ_LAST_ENDPOINT");
    size_t len = strnlen(tmp, n);
    if (len + 1 > cap)
        return km_errf(err, KM_ENOSPC, "zmq endpoint '%.*s' does not fit in %zu bytes", (int)len,
                       tmp, cap);
    memcpy(buf, tmp, len);
    buf[len] = '\0';
    return 0;
}

int km_zsock_subscribe(void *s, const void *prefix, size_t len, km_errbuf *err)
{
    if (zmq_setsockopt(s, ZMQ_SUBSCRIBE, len ? prefix : "", len) != 0)
        return zerr(err, "setsockopt", "ZMQ_SUBSCRIBE");
    return 0;
}

int km_zsock_fd(void *s, int *fd, km_errbuf *err)
{
    size_t n = sizeof *fd;
    if (zmq_getsockopt(s, ZMQ_FD, fd, &n) != 0) return zerr(err, "getsockopt", "ZMQ_FD");
    return 0;
}

int km_zsock_readable(void *s)
{
    int ev = 0;
    size_t n = sizeof ev;
    if (zmq_getsockopt(s, ZMQ_EVENTS, &ev, &n) != 0) return 0;
    return (ev & ZMQ_POLLIN) != 0;
}

int km_zsend(void *s, const km_zframe *parts, int n, int flags, km_errbuf *err)
{
    if (n < 1 || !parts) return km_errf(err, KM_EINVAL, "zmq send: no parts");
    int zf = (flags & KM_ZDONTWAIT) ? ZMQ_DONTWAIT : 0;
    for (int i = 0; i < n; i++) {
        int more = i + 1 < n ? ZMQ_SNDMORE : 0;
        /* zmq_send copies the bytes; an empty part is legal (a delimiter) */
        if (zmq_send(s, parts[i].len ? parts[i].data : "", parts[i].len, zf | more) < 0) {
            char what[32];
            snprintf(what, sizeof what, "part %d of %d", i + 1, n);
            return zerr(err, "send", what);
        }
    }
    return 0;
}

void km_zmsg_clear(km_zmsg *m)
{
    km_buf_free(&m->mem_);
    memset(m, 0, sizeof *m);
}

const km_zframe *km_zmsg_body(const km_zmsg *m)
{
    return m->n > 0 ? &m->part[m->n - 1] : NULL;
}

int km_zrecv(void *s, km_zmsg *m, int timeout_ms, km_errbuf *err)
{
    m->n = 0;
    m->src_fd = -1;
    m->mem_.len = 0;
    memset(&m->peer, 0, sizeof m->peer);
    if (timeout_ms >= 0) {
        zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
        int r = zmq_poll(&it, 1, timeout_ms);
        if (r < 0) return zerr(err, "poll", NULL);
        if (r == 0) return km_errf(err, KM_EAGAIN, "zmq recv: nothing within %d ms", timeout_ms);
    }
    size_t offs[KM_ZMSG_MAX_PARTS];
    int total = 0, rc = 0;
    zmq_msg_t zm;
    for (;;) {
        zmq_msg_init(&zm);
        /* The first part may block (timeout -1); the rest of a message is already here. */
        int zf = total == 0 && timeout_ms < 0 ? 0 : ZMQ_DONTWAIT;
        if (zmq_msg_recv(&zm, s, zf) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&zm);
            if (total == 0 || e != EAGAIN) return zerr(err, "recv", NULL);
            /* cannot happen: libzmq delivers messages atomically */
            return km_errf(err, KM_EIO, "zmq recv: message ended early after %d parts", total);
        }
        size_t len = zmq_msg_size(&zm);
        /* a ROUTER makes the identity part itself (no descriptor); the wire parts have one */
        int fd = zmq_msg_get(&zm, ZMQ_SRCFD);
        if (fd >= 0) m->src_fd = fd;
        if (total < KM_ZMSG_MAX_PARTS && !rc) {
            offs[total] = m->mem_.len;
            m->part[total].len = len;
            if (km_buf_append(&m->mem_, zmq_msg_data(&zm), len))
                rc = km_errf(err, KM_ENOMEM, "zmq recv: out of memory for %zu bytes", len);
        }
        total++;
        int more = zmq_msg_more(&zm);
        if (!more) km_zpeer_from_msg(&zm, &m->peer); /* the body carries the ZAP properties */
        zmq_msg_close(&zm);
        if (!more) break;
    }
    if (rc) {
        m->mem_.len = 0;
        return rc;
    }
    if (total > KM_ZMSG_MAX_PARTS) {
        m->mem_.len = 0;
        return km_errf(err, KM_EPROTO, "zmq recv: message of %d parts, limit %d (dropped)", total,
                       KM_ZMSG_MAX_PARTS);
    }
    for (int i = 0; i < total; i++)
        m->part[i].data = m->mem_.data ? m->mem_.data + offs[i] : (const void *)"";
    m->n = total;
    return 0;
}

int km_zpoll(km_zpollitem *items, int n, int timeout_ms, km_errbuf *err)
{
    enum { MAX_ITEMS = 64 };
    if (n < 0 || n > MAX_ITEMS) return km_errf(err, KM_EINVAL, "zmq poll: %d items", n);
    zmq_pollitem_t zi[MAX_ITEMS];
    for (int i = 0; i < n; i++) {
        zi[i].socket = items[i].sock;
        zi[i].fd = items[i].fd;
        zi[i].events = (short)(((items[i].events & KM_ZPOLLIN) ? ZMQ_POLLIN : 0) |
                               ((items[i].events & KM_ZPOLLOUT) ? ZMQ_POLLOUT : 0));
        zi[i].revents = 0;
    }
    int r = zmq_poll(zi, n, timeout_ms);
    if (r < 0) return zerr(err, "poll", NULL);
    for (int i = 0; i < n; i++)
        items[i].revents = (short)(((zi[i].revents & ZMQ_POLLIN) ? KM_ZPOLLIN : 0) |
                                   ((zi[i].revents & ZMQ_POLLOUT) ? KM_ZPOLLOUT : 0));
    return r;
}
