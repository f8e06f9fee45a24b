/*
 * libkvmesh.c — the C client library (client/kvmesh.h): requests over a ZeroMQ DEALER in the
 * wire format of docs/protocol.md (encoded and decoded by common/proto.c, so the client can never
 * send what a server rejects for its form), and a minimal HTTP/1.1 GET for status pages (its
 * response parsed by common/http.h, the parser the servers use too).
 *
 * Why it is built this way: kvm_generate is the common case (one request, a callback per token)
 * and is written on top of the asynchronous pair kvm_submit/kvm_next, which benchmarks use to
 * keep many requests in flight on one connection; frames of other requests that arrive while
 * kvm_generate waits are dropped (a synchronous caller has no others). Request ids are chosen by
 * the library for kvm_generate and by the caller for kvm_submit.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "client/kvmesh.h"
#include "client/monitor.h"
#include "common/http.h"

struct kvm_client {
    void *zctx, *sock;
    void *mon; /* PAIR on the socket's monitor (client/monitor.h) */
    kvm_mon_seen seen;
    char endpoint[256];
    kvm_opts o;
    uint64_t next_id;
    km_buf out;
    km_zmsg in;
    km_proto_limits lim;
};

int kvm_sec_apply(const kvm_sec *s, void *sock, const char *default_server, km_errbuf *err)
{
    if (!s || !s->cert || !s->cert[0]) return 0;
    /* DIR/private/NAME.key: DIR is the key directory, where member names are looked up */
    char keydir[4096];
    snprintf(keydir, sizeof keydir, "%s", s->cert);
    char *slash = strrchr(keydir, '/');
    bool have_dir = false;
    if (slash) {
        *slash = 0;
        char *up = strrchr(keydir, '/');
        const char *base = up ? up + 1 : keydir;
        if (!strcmp(base, "private")) {
            if (up)
                *up = 0;
            else
                snprintf(keydir, sizeof keydir, ".");
            have_dir = true;
        }
    }
    km_zsec_opts o = {.cert = s->cert, .keydir = have_dir ? keydir : NULL};
    km_zsec *z = NULL;
    int rc = km_zsec_open(&o, &z, err);
    if (!rc)
        rc = km_zsec_client(z, sock, s->server && s->server[0] ? s->server : default_server, err);
    km_zsec_close(z);
    return rc;
}

int kvm_sec_check(const kvm_sec *s, const char *default_server, km_errbuf *err)
{
    if (!s || !s->cert || !s->cert[0]) return 0;
    void *zctx = km_zctx_create(), *sock = NULL;
    if (!zctx) return km_errf(err, KM_EIO, "cannot create a ZeroMQ context");
    int rc = km_zsock_open(zctx, KM_ZDEALER, NULL, &sock, err);
    if (!rc) rc = kvm_sec_apply(s, sock, default_server, err);
    km_zsock_close(sock);
    km_zctx_destroy(zctx);
    return rc;
}

int kvm_open(const char *endpoint, const kvm_opts *o, kvm_client **out, km_errbuf *err)
{
    *out = NULL;
    kvm_client *c = calloc(1, sizeof *c);
    if (!c) return km_errf(err, KM_ENOMEM, "kvmesh: out of memory");
    if (o) c->o = *o;
    if (c->o.timeout_ms <= 0) c->o.timeout_ms = 120000;
    km_proto_limits_default(&c->lim);
    c->next_id = ((uint64_t)getpid() << 32) | 1;
    c->zctx = km_zctx_create();
    if (!c->zctx) {
        free(c);
        return km_errf(err, KM_EIO, "kvmesh: cannot create a ZeroMQ context");
    }
    km_zsock_opts zo;
    km_zsock_opts_default(&zo);
    zo.routing_id = c->o.identity;
    int rc = km_zsock_open(c->zctx, KM_ZDEALER, &zo, &c->sock, err);
    if (!rc) rc = kvm_sec_apply(&c->o.sec, c->sock, "router", err);
    if (!rc) rc = kvm_mon_open(c->zctx, c->sock, c, &c->mon, err);
    if (!rc) rc = km_zsock_connect(c->sock, endpoint, err);
    snprintf(c->endpoint, sizeof c->endpoint, "%s", endpoint);
    if (rc) {
        kvm_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

/* libzmq reconnects a DEALER by itself, but says nothing to the caller when the connection
 * breaks: a request in flight to a router that died would only end by timeout. The socket
 * monitor reports the break at once, so kvm_generate can end that request with KM_EIO and the
 * caller retry it on the reconnected socket; and a failed handshake (a key the server does not
 * take) with KM_EACCES and the key to pass. Returns the number of disconnects since the last call;
 * the last handshake failure stays in c->seen until a handshake succeeds. */
static int kvm_monitor_drain(kvm_client *c)
{
    c->seen.disconnects = 0;
    kvm_mon_read(c->mon, &c->seen);
    return c->seen.disconnects;
}

void kvm_close(kvm_client *c)
{
    if (!c) return;
    kvm_mon_close(c->sock, c->mon);
    km_zsock_close(c->sock);
    if (c->zctx) km_zctx_destroy(c->zctx);
    km_buf_free(&c->out);
    km_zmsg_clear(&c->in);
    free(c);
}

void kvm_request_init(km_msg_request *r)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    *r = m.req;
    r->model = "default";
}

void kvm_result_free(kvm_result *r)
{
    if (r) km_buf_free(&r->text);
}

double kvm_result_decode_rate(const kvm_result *r)
{
    uint32_t n = r->completion_tokens;
    uint32_t steps = n > r->accepted_draft_tokens ? n - r->accepted_draft_tokens : 1;
    double gen_s = (r->client_total_ms - r->client_ttft_ms) / 1e3;
    if (steps < 2 || !(gen_s > 0)) return 0;
    return n * (double)(steps - 1) / steps / gen_s;
}

int kvm_submit(kvm_client *c, const km_msg_request *req, km_errbuf *err)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    m.req = *req;
    int rc = km_msg_encode(&m, &c->lim, &c->out, err);
    if (rc) return rc;
    return km_zsend(c->sock, &(km_zframe){c->out.data, c->out.len}, 1, 0, err);
}

int kvm_cancel(kvm_client *c, uint64_t id)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_CANCEL);
    m.cancel.id = id;
    int rc = km_msg_encode(&m, &c->lim, &c->out, NULL);
    if (rc) return rc;
    return km_zsend(c->sock, &(km_zframe){c->out.data, c->out.len}, 1, 0, NULL);
}

int kvm_next(kvm_client *c, int timeout_ms, km_msg *out, const void **raw_body, size_t *raw_len,
             km_errbuf *err)
{
    memset(out, 0, sizeof *out);
    int rc = km_zrecv(c->sock, &c->in, timeout_ms, err);
    if (rc == KM_EAGAIN) return km_errf(err, KM_ETIMEDOUT, "no answer in %.3g s", timeout_ms / 1e3);
    if (rc) return rc;
    const km_zframe *b = km_zmsg_body(&c->in);
    if (!b) return km_errf(err, KM_EPROTO, "empty message");
    if (raw_body) *raw_body = b->data;
    if (raw_len) *raw_len = b->len;
    return km_msg_decode(b->data, b->len, &c->lim, out, err);
}

static int code_to_err(int code)
{
    if (code == KM_CODE_OVERLOADED || code == KM_CODE_RATE_LIMIT) return KM_EOVERLOAD;
    if (code == KM_CODE_UNAVAILABLE) return KM_EAGAIN;
    if (code == KM_CODE_DEADLINE) return KM_ETIMEDOUT;
    if (code == KM_CODE_CANCELED) return KM_ECANCELED;
    if (code >= 400 && code < 500) return KM_EINVAL;
    return KM_EIO;
}

int kvm_generate(kvm_client *c, const km_msg_request *req, kvm_token_fn on_token, void *user,
                 kvm_result *res, km_errbuf *err)
{
    memset(res, 0, sizeof *res);
    km_msg_request q = *req;
    q.id = c->next_id++;
    uint64_t t0 = km_now_ns();
    kvm_monitor_drain(c); /* breaks before this request are not its concern */
    int rc = kvm_submit(c, &q, err);
    if (rc) return rc;
    bool canceled = false;
    uint64_t heard = t0; /* the last frame of this request: silence is counted from it */
    for (;;) {
        km_msg m;
        uint64_t now = km_now_ns();
        if (c->o.cancel && *c->o.cancel) {
            kvm_cancel(c, q.id);
            res->client_total_ms = (now - t0) / 1e6;
            return km_errf(err, KM_ECANCELED, "request %llu canceled", (unsigned long long)q.id);
        }
        int64_t left_ms = c->o.timeout_ms - (int64_t)((now - heard) / 1000000u);
        if (left_ms <= 0) {
            kvm_cancel(c, q.id);
            res->client_total_ms = (now - t0) / 1e6;
            return km_errf(err, KM_ETIMEDOUT,
                           "no answer from the server for %.3g s (the client's time-out); the "
                           "request was canceled",
                           c->o.timeout_ms / 1e3);
        }
        if (c->o.cancel && left_ms > 100) left_ms = 100; /* look at the flag now and then */
        km_zpollitem it[2] = {{.sock = c->sock, .events = KM_ZPOLLIN},
                              {.sock = c->mon, .events = KM_ZPOLLIN}};
        int pr = km_zpoll(it, c->mon ? 2 : 1, (int)left_ms, NULL);
        if (pr == KM_EAGAIN || pr == 0) continue; /* a signal, or a slice of silence */
        if (pr < 0)
            return km_errf(err, pr, "poll failed while waiting for request %llu",
                           (unsigned long long)q.id);
        if (!(it[0].revents & KM_ZPOLLIN)) {
            int lost = kvm_monitor_drain(c);
            res->client_total_ms = (km_now_ns() - t0) / 1e6;
            rc = kvm_mon_explain(&c->seen, &c->o.sec, c->endpoint, err);
            if (rc) return rc;
            if (lost > 0 && !c->seen.handshake_event) /* a handshake is not a lost connection */
                return km_errf(err, KM_EIO, "connection lost while waiting for request %llu",
                               (unsigned long long)q.id);
            continue;
        }
        rc = kvm_next(c, 0, &m, NULL, NULL, err);
        if (rc) continue; /* a frame we cannot read, or none after all: not ours to fail on */
        uint64_t id = m.type == KM_MSG_TOKEN   ? m.tok.id
                      : m.type == KM_MSG_DONE  ? m.done.id
                      : m.type == KM_MSG_ERROR ? m.error.id
                                               : 0;
        if (id != q.id && !(m.type == KM_MSG_ERROR && id == 0)) {
            km_msg_clear(&m);
            continue;
        }
        heard = km_now_ns();
        double now_ms = (heard - t0) / 1e6;
        if (m.type == KM_MSG_TOKEN) {
            if (res->n_tokens == 0) res->client_ttft_ms = now_ms;
            if (m.tok.index == res->n_tokens) { /* indexes are consecutive; drop a repeat */
                res->n_tokens++;
                km_buf_append(&res->text, m.tok.text, m.tok.text_len);
                if (on_token && !canceled &&
                    on_token(user, m.tok.index, m.tok.token, m.tok.text, m.tok.text_len)) {
                    canceled = true;
                    kvm_cancel(c, q.id);
                }
            }
        } else if (m.type == KM_MSG_DONE) {
            res->finish = m.done.finish;
            if (m.done.text) km_buf_append(&res->text, m.done.text, m.done.text_len);
            res->prompt_tokens = m.done.prompt_tokens;
            res->cached_tokens = m.done.cached_tokens;
            res->completion_tokens = m.done.completion_tokens;
            res->draft_tokens = m.done.draft_tokens;
            res->accepted_draft_tokens = m.done.accepted_draft_tokens;
            res->queue_ms = m.done.queue_ms;
            res->ttft_ms = m.done.ttft_ms;
            res->total_ms = m.done.total_ms;
            res->client_total_ms = now_ms;
            if (!res->n_tokens) res->client_ttft_ms = now_ms;
            if (m.done.worker) snprintf(res->worker, sizeof res->worker, "%s", m.done.worker);
            res->migrations = m.done.migrations;
            km_msg_clear(&m);
            return 0;
        } else if (m.type == KM_MSG_ERROR) {
            res->error_code = m.error.code;
            snprintf(res->error, sizeof res->error, "%s", m.error.message);
            res->retry_after_ms = m.error.retry_after_ms;
            res->client_total_ms = now_ms;
            km_msg_clear(&m);
            return km_errf(err, code_to_err(res->error_code), "%d %s: %s", res->error_code,
                           km_proto_code_name(res->error_code), res->error);
        }
        km_msg_clear(&m);
    }
}

/* ---------------------------------------------------------------- HTTP GET
 * A blocking GET with Connection: close: the whole response is read until the server closes,
 * then parsed by common/http.h's response parser (picohttpparser). */

#define KVM_HTTP_MAX_RESPONSE (64 << 20)

int kvm_http_get(const char *url, int timeout_ms, km_buf *body, int *status, km_errbuf *err)
{
    return kvm_http_get_bearer(url, NULL, timeout_ms, body, status, err);
}

int kvm_http_get_bearer(const char *url, const char *api_key, int timeout_ms, km_buf *body,
                        int *status, km_errbuf *err)
{
    if (api_key && strpbrk(api_key, "\r\n"))
        return km_errf(err, KM_EINVAL, "an API key cannot hold a line break");
    char host[256], path[1024] = "/";
    int port = 80;
    if (!strncmp(url, "https://", 8))
        return km_errf(err, KM_EUNSUPPORTED,
                       "%s: this client speaks plain HTTP only; use the router's admin port, or "
                       "curl --cacert for its HTTPS front",
                       url);
    if (strncmp(url, "http://", 7)) return km_errf(err, KM_EINVAL, "not an http:// URL: %s", url);
    const char *h = url + 7, *slash = strchr(h, '/');
    size_t hl = slash ? (size_t)(slash - h) : strlen(h);
    if (hl == 0 || hl >= sizeof host) return km_errf(err, KM_EINVAL, "bad host in %s", url);
    memcpy(host, h, hl);
    host[hl] = 0;
    if (slash) snprintf(path, sizeof path, "%s", slash);
    char *colon = strrchr(host, ':');
    if (colon) {
        *colon = 0;
        port = atoi(colon + 1);
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    if (getaddrinfo(host, ps, &hints, &ai) || !ai)
        return km_errf(err, KM_EIO, "cannot resolve %s", host);
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    int rc = fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen) ? KM_EIO : 0;
    freeaddrinfo(ai);
    if (rc) {
        if (fd >= 0) close(fd);
        return km_errf(err, KM_EIO, "cannot connect to %s:%d", host, port);
    }
    km_buf req = {0}, resp = {0};
    km_buf_printf(&req, "GET %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n", path, host,
                  port);
    if (api_key && *api_key) km_buf_printf(&req, "Authorization: Bearer %s\r\n", api_key);
    km_buf_printf(&req, "\r\n");
    size_t off = 0;
    while (off < req.len) {
        ssize_t n = send(fd, req.data + off, req.len - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += (size_t)n;
    }
    km_buf_free(&req);
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, timeout_ms) <= 0) {
            close(fd);
            km_buf_free(&resp);
            return km_errf(err, KM_ETIMEDOUT, "%s: no answer in %d ms", url, timeout_ms);
        }
        if (resp.len >= KVM_HTTP_MAX_RESPONSE) {
            close(fd);
            km_buf_free(&resp);
            return km_errf(err, KM_EPROTO, "%s: response larger than %d bytes", url,
                           KVM_HTTP_MAX_RESPONSE);
        }
        if (km_buf_reserve(&resp, 65536)) break;
        ssize_t n = recv(fd, resp.data + resp.len, resp.cap - resp.len, 0);
        if (n <= 0) break;
        resp.len += (size_t)n;
    }
    close(fd);
    km_errbuf perr = {{0}};
    rc = km_http_parse_response(resp.data ? (const char *)resp.data : "", resp.len, status, body,
                                &perr);
    km_buf_free(&resp);
    if (rc) return km_errf(err, rc, "%s: %s", url, perr.msg);
    return 0;
}

/* ---------------------------------------------------------------- operator calls */

int kvm_admin_call(const char *endpoint, const kvm_sec *sec, const km_msg_admin *req,
                   int timeout_ms, km_msg *out, km_errbuf *err)
{
    memset(out, 0, sizeof *out);
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN);
    m.admin = *req;
    if (!m.admin.id) m.admin.id = ((uint64_t)getpid() << 20) ^ (km_now_ns() & 0xfffff);
    km_buf frame = {0};
    int rc = km_msg_encode(&m, NULL, &frame, err);
    if (rc) return rc;
    void *zctx = km_zctx_create(), *sock = NULL;
    if (!zctx) {
        km_buf_free(&frame);
        return km_errf(err, KM_EIO, "cannot create a ZeroMQ context");
    }
    void *mon = NULL;
    kvm_mon_seen seen = {0};
    rc = km_zsock_open(zctx, KM_ZDEALER, NULL, &sock, err);
    if (!rc) rc = kvm_sec_apply(sec, sock, "controller", err);
    if (!rc) rc = kvm_mon_open(zctx, sock, sock, &mon, err);
    if (!rc) rc = km_zsock_connect(sock, endpoint, err);
    if (!rc) rc = km_zsend(sock, &(km_zframe){frame.data, frame.len}, 1, 0, err);
    km_zmsg in = {0};
    km_proto_limits lim;
    km_proto_limits_default(&lim);
    uint64_t deadline = km_now_ns() + (uint64_t)timeout_ms * 1000000u;
    while (!rc) {
        uint64_t now = km_now_ns();
        if (now >= deadline) {
            rc = km_errf(err, KM_ETIMEDOUT, "%s: no answer in %d ms", endpoint, timeout_ms);
            break;
        }
        km_zpollitem it[2] = {{.sock = sock, .events = KM_ZPOLLIN},
                              {.sock = mon, .events = KM_ZPOLLIN}};
        int pr = km_zpoll(it, 2, (int)((deadline - now) / 1000000u) + 1, NULL);
        if (pr <= 0) continue; /* a signal, or the deadline */
        if (!(it[0].revents & KM_ZPOLLIN)) {
            kvm_mon_read(mon, &seen);
            rc = kvm_mon_explain(&seen, sec, endpoint, err);
            continue;
        }
        int r = km_zrecv(sock, &in, 0, err);
        if (r == KM_EAGAIN) continue;
        if (r) {
            rc = r;
            break;
        }
        const km_zframe *b = km_zmsg_body(&in);
        if (!b || km_msg_decode(b->data, b->len, &lim, out, NULL)) continue;
        if (out->type == KM_MSG_VIEW ||
            (out->type == KM_MSG_ADMIN_REPLY && out->admin_reply.id == m.admin.id))
            break;
        if (out->type == KM_MSG_ERROR) {
            rc = km_errf(err, KM_EPROTO, "%s answered %d %s: %s", endpoint, out->error.code,
                         km_proto_code_name(out->error.code), out->error.message);
            km_msg_clear(out);
            break;
        }
        km_msg_clear(out); /* a frame that is not the answer (status replay, ...) */
    }
    km_zmsg_clear(&in);
    kvm_mon_close(sock, mon);
    km_zsock_close(sock);
    km_zctx_destroy(zctx);
    km_buf_free(&frame);
    return rc;
}

int kvm_view_get(const char *controller, const kvm_sec *sec, int timeout_ms, km_msg *view,
                 km_errbuf *err)
{
    km_msg_admin a = {.cmd = KM_ADMIN_STATUS};
    int rc = kvm_admin_call(controller, sec, &a, timeout_ms, view, err);
    if (rc) return rc;
    if (view->type != KM_MSG_VIEW) {
        int code = view->admin_reply.code;
        rc = km_errf(err, KM_EPROTO, "%s answered status with %s (%d %s)", controller,
                     km_msg_type_name(view->type), code,
                     view->admin_reply.message ? view->admin_reply.message : "");
        km_msg_clear(view);
    }
    return rc;
}

struct kvm_view_sub {
    void *zctx, *sock;
    km_zmsg in;
    km_proto_limits lim;
};

int kvm_view_sub_open(const char *endpoint, const kvm_sec *sec, kvm_view_sub **out, km_errbuf *err)
{
    *out = NULL;
    kvm_view_sub *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "out of memory");
    km_proto_limits_default(&s->lim);
    s->lim.max_frame = 8u << 20; /* a view of many workers with their histories */
    s->zctx = km_zctx_create();
    if (!s->zctx) {
        free(s);
        return km_errf(err, KM_EIO, "cannot create a ZeroMQ context");
    }
    km_zsock_opts zo;
    km_zsock_opts_default(&zo);
    zo.max_msg_size = -1;
    int rc = km_zsock_open(s->zctx, KM_ZSUB, &zo, &s->sock, err);
    if (!rc) rc = km_zsock_subscribe(s->sock, "view", 4, err);
    if (!rc) rc = kvm_sec_apply(sec, s->sock, "controller", err);
    if (!rc) rc = km_zsock_connect(s->sock, endpoint, err);
    if (rc) {
        kvm_view_sub_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

int kvm_view_sub_next(kvm_view_sub *s, int timeout_ms, km_msg *view, km_errbuf *err)
{
    memset(view, 0, sizeof *view);
    uint64_t deadline = km_now_ns() + (uint64_t)timeout_ms * 1000000u;
    for (;;) {
        uint64_t now = km_now_ns();
        if (now >= deadline) return km_errf(err, KM_ETIMEDOUT, "no view in %d ms", timeout_ms);
        int rc = km_zrecv(s->sock, &s->in, (int)((deadline - now) / 1000000u) + 1, err);
        if (rc == KM_EAGAIN) continue;
        if (rc) return rc;
        const km_zframe *b = km_zmsg_body(&s->in);
        if (!b || km_msg_decode(b->data, b->len, &s->lim, view, NULL)) continue;
        if (view->type == KM_MSG_VIEW) return 0;
        km_msg_clear(view);
    }
}

void kvm_view_sub_close(kvm_view_sub *s)
{
    if (!s) return;
    km_zsock_close(s->sock);
    if (s->zctx) km_zctx_destroy(s->zctx);
    km_zmsg_clear(&s->in);
    free(s);
}

bool kvm_view_all_ready(const km_msg_view *v, uint32_t n)
{
    if (v->n_workers < n) return false;
    for (uint32_t i = 0; i < v->n_workers; i++)
        if (v->workers[i].state != KM_MEMBER_READY) return false;
    return true;
}

/* ---------------------------------------------------------------- cluster state file */

int kvm_cluster_read(const char *path, kvm_cluster_proc *procs, int max, km_errbuf *err)
{
    FILE *f = fopen(path, "r");
    if (!f) return km_errf(err, KM_EIO, "cannot open %s", path);
    char line[2048];
    int n = 0;
    while (n < max && fgets(line, sizeof line, f)) {
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            /* longer than any line `kvmesh up` writes: skip it whole, never half of it */
            int c;
            while ((c = fgetc(f)) != EOF && c != '\n') {
            }
            continue;
        }
        kvm_cluster_proc *p = &procs[n];
        memset(p, 0, sizeof *p);
        char *save = NULL;
        for (char *t = strtok_r(line, " \t\r\n", &save); t; t = strtok_r(NULL, " \t\r\n", &save)) {
            char *eq = strchr(t, '=');
            if (!eq) continue;
            *eq = 0;
            const char *k = t, *v = eq + 1;
            const struct {
                const char *key;
                char *dst;
                size_t cap;
            } fields[] = {
                {"role", p->role, sizeof p->role},
                {"id", p->id, sizeof p->id},
                {"requests", p->requests, sizeof p->requests},
                {"events", p->events, sizeof p->events},
                {"admin", p->admin, sizeof p->admin},
                {"listen", p->listen, sizeof p->listen},
                {"view", p->view, sizeof p->view},
                {"http", p->http, sizeof p->http},
                {"peer", p->peer, sizeof p->peer},
            };
            if (!strcmp(k, "pid")) p->pid = atoi(v);
            if (!strcmp(k, "restarts")) p->restarts = atoi(v);
            for (size_t i = 0; i < sizeof fields / sizeof *fields; i++)
                if (!strcmp(k, fields[i].key)) snprintf(fields[i].dst, fields[i].cap, "%s", v);
        }
        if (p->id[0]) n++;
    }
    fclose(f);
    return n;
}

const kvm_cluster_proc *kvm_cluster_find(const kvm_cluster_proc *procs, int n, const char *id)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(procs[i].id, id)) return &procs[i];
    return NULL;
}

static int action_cmp(const void *a, const void *b)
{
    const kvm_view_action *x = a, *y = b;
    if (x->action->at_ms != y->action->at_ms) return x->action->at_ms < y->action->at_ms ? -1 : 1;
    return x->order_ < y->order_ ? -1 : x->order_ > y->order_;
}

size_t kvm_view_history(const km_msg_view *v, kvm_view_action *out, size_t max)
{
    size_t n = 0;
    for (uint32_t i = 0; i < v->n_workers; i++)
        for (uint32_t h = 0; h < v->workers[i].n_history && n < max; h++, n++)
            out[n] = (kvm_view_action){&v->workers[i], &v->workers[i].history[h], n};
    qsort(out, n, sizeof *out, action_cmp);
    return n;
}
