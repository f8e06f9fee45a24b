/*
 * libkvmesh.c — the C client library (client/kvmesh.h): requests over a ZeroMQ DEALER in the
 * wire format of docs/protocol.md (encoded and decoded by common/proto.c, so the client can never
 * send what a server rejects for its form), and a minimal HTTP/1.1 GET for status pages.
 *
 * Why it is built this way: kvm_generate is the common case (one request, a callback per token)
 * and is written on top of the asynchronous pair kvm_submit/kvm_next, which benchmarks use to
 * keep many requests in flight on one connection; frames of other requests that arrive while
 * kvm_generate waits are dropped (a synchronous caller has no others). Request ids are chosen by
 * the library for kvm_generate and by the caller for kvm_submit.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <msgpack.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "client/kvmesh.h"

struct kvm_client {
    void *zctx, *sock;
    kvm_opts o;
    uint64_t next_id;
    km_buf out;
    km_zmsg in;
    km_proto_limits lim;
};

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
    if (!rc) rc = km_zsock_connect(c->sock, endpoint, err);
    if (rc) {
        kvm_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

void kvm_close(kvm_client *c)
{
    if (!c) return;
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
    if (rc == KM_EAGAIN) return km_errf(err, KM_ETIMEDOUT, "no answer in %d ms", timeout_ms);
    if (rc) return rc;
    const km_zframe *b = km_zmsg_body(&c->in);
    if (!b) return km_errf(err, KM_EPROTO, "empty message");
    if (raw_body) *raw_body = b->data;
    if (raw_len) *raw_len = b->len;
    return km_msg_decode(b->data, b->len, &c->lim, out, err);
}

void kvm_done_extras(const void *body, size_t len, char *worker, size_t cap, uint32_t *migrations)
{
    if (worker && cap) worker[0] = 0;
    if (migrations) *migrations = 0;
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    if (msgpack_unpack_next(&u, body, len, NULL) == MSGPACK_UNPACK_SUCCESS &&
        u.data.type == MSGPACK_OBJECT_MAP) {
        const msgpack_object_map *mp = &u.data.via.map;
        for (uint32_t i = 0; i < mp->size; i++) {
            const msgpack_object *k = &mp->ptr[i].key, *v = &mp->ptr[i].val;
            if (k->type != MSGPACK_OBJECT_STR) continue;
            if (k->via.str.size == 6 && !memcmp(k->via.str.ptr, "worker", 6) &&
                v->type == MSGPACK_OBJECT_STR && worker && cap) {
                size_t n = v->via.str.size < cap - 1 ? v->via.str.size : cap - 1;
                memcpy(worker, v->via.str.ptr, n);
                worker[n] = 0;
            } else if (k->via.str.size == 10 && !memcmp(k->via.str.ptr, "migrations", 10) &&
                       v->type == MSGPACK_OBJECT_POSITIVE_INTEGER && migrations) {
                *migrations = (uint32_t)v->via.u64;
            }
        }
    }
    msgpack_unpacked_destroy(&u);
}

static int code_to_err(int code)
{
    if (code == KM_CODE_OVERLOADED) return KM_EOVERLOAD;
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
    int rc = kvm_submit(c, &q, err);
    if (rc) return rc;
    bool canceled = false;
    for (;;) {
        km_msg m;
        const void *raw;
        size_t raw_len;
        rc = kvm_next(c, c->o.timeout_ms, &m, &raw, &raw_len, err);
        if (rc == KM_ETIMEDOUT) {
            kvm_cancel(c, q.id);
            return rc;
        }
        if (rc) continue; /* a frame we cannot read: not ours to fail on */
        uint64_t id = m.type == KM_MSG_TOKEN   ? m.tok.id
                      : m.type == KM_MSG_DONE  ? m.done.id
                      : m.type == KM_MSG_ERROR ? m.error.id
                                               : 0;
        if (id != q.id && !(m.type == KM_MSG_ERROR && id == 0)) {
            km_msg_clear(&m);
            continue;
        }
        double now_ms = (km_now_ns() - t0) / 1e6;
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
            res->queue_ms = m.done.queue_ms;
            res->ttft_ms = m.done.ttft_ms;
            res->total_ms = m.done.total_ms;
            res->client_total_ms = now_ms;
            if (!res->n_tokens) res->client_ttft_ms = now_ms;
            kvm_done_extras(raw, raw_len, res->worker, sizeof res->worker, &res->migrations);
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

/* ---------------------------------------------------------------- HTTP GET */

int kvm_http_get(const char *url, int timeout_ms, km_buf *body, int *status, km_errbuf *err)
{
    char host[256], path[1024] = "/";
    int port = 80;
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
    km_buf_printf(&req, "GET %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n", path, host,
                  port);
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
        if (km_buf_reserve(&resp, 65536)) break;
        ssize_t n = recv(fd, resp.data + resp.len, resp.cap - resp.len, 0);
        if (n <= 0) break;
        resp.len += (size_t)n;
    }
    close(fd);
    km_buf_append(&resp, "", 1);
    const char *s = (const char *)resp.data;
    if (!s || sscanf(s, "HTTP/1.%*d %d", status) != 1) {
        km_buf_free(&resp);
        return km_errf(err, KM_EPROTO, "%s: not an HTTP response", url);
    }
    const char *b = strstr(s, "\r\n\r\n");
    km_buf_reset(body);
    if (b) {
        b += 4;
        bool chunked = strcasestr(s, "transfer-encoding: chunked") != NULL &&
                       strcasestr(s, "transfer-encoding: chunked") < b;
        if (!chunked) {
            km_buf_append(body, b, strlen(b));
        } else {
            while (*b) {
                char *end;
                unsigned long n = strtoul(b, &end, 16);
                if (end == b || n == 0) break;
                b = strstr(end, "\r\n");
                if (!b) break;
                b += 2;
                km_buf_append(body, b, n);
                b += n;
                if (!strncmp(b, "\r\n", 2)) b += 2;
            }
        }
    }
    km_buf_free(&resp);
    return 0;
}
