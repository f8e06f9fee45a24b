/*
 * http.c — the HTTP/1.1 server of the router's OpenAI-compatible API (router.h, "HTTP server"):
 * connections on the router's libuv loop, requests parsed by picohttpparser, bodies by
 * Content-Length or chunked, responses whole or streamed (chunked transfer encoding, for SSE).
 *
 * Why it is built this way:
 *  - The parser is picohttpparser (phr_parse_request, phr_decode_chunked) as exported by Debian's
 *    libh2o, the maintained parser of h2o, declared below because the package ships no header
 *    for it (docs/dependencies.md). What a parser does not do is here: buffering, keep-alive,
 *    pipelining, 100-continue, limits, streaming, and closing every connection on shutdown (the
 *    reason h2o's own server is not used: docs/openai.md).
 *  - It runs on the router's loop, not a thread of its own, so a request handler calls straight
 *    into the router (no locks) and a token arriving from a worker is written to its HTTP client
 *    in the same callback.
 *  - One request per connection is answered at a time, in order; reading pauses while a
 *    response is pending, so a pipelining client cannot queue unbounded work.
 *  - A request outlives the handler call when the handler answers later (streaming); the
 *    connection going away then calls the handler's abort callback, after which the request is
 *    freed and must not be touched.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <uv.h>

#include "router/router.h"

/* picohttpparser's API as exported by libh2o (deps/picohttpparser/picohttpparser.h in h2o). */
struct phr_header {
    const char *name;
    size_t name_len;
    const char *value;
    size_t value_len;
};
int phr_parse_request(const char *buf, size_t len, const char **method, size_t *method_len,
                      const char **path, size_t *path_len, int *minor_version,
                      struct phr_header *headers, size_t *num_headers, size_t last_len);
struct phr_chunked_decoder {
    size_t bytes_left_in_chunk;
    char consume_trailer;
    char _hex_count;
    char _state;
};
ssize_t phr_decode_chunked(struct phr_chunked_decoder *decoder, char *buf, size_t *bufsz);

#define HEAD_MAX    16384
#define MAX_HEADERS 64
#define WRITE_MAX   (16u << 20) /* bytes queued to a slow client before it is dropped */

typedef struct conn conn;

struct rt_http_req {
    conn *c;
    char method[16];
    char *path;
    km_buf body;
    char **hname, **hvalue;
    int n_headers;
    bool keep_alive, head_only;
    bool answered, streaming, ended;
    void (*on_abort)(rt_http_req *r, void *user);
    void *abort_user;
};

struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    rt_http *h;
    conn *prev, *next;
    km_buf in;
    rt_http_req *cur;
    int open_handles, pending_writes;
    size_t queued_bytes;
    bool closing, reading, in_handler, sent_continue;
};

struct rt_http {
    uv_loop_t *loop;
    uv_tcp_t listener;
    rt_http_opts o;
    char host[64];
    int port;
    conn *conns;
    int n_conns;
    int open_handles;
    bool stopping;
    uint64_t requests;
};

typedef struct write_req {
    uv_write_t req;
    conn *c;
    km_buf out;
} write_req;

static void try_requests(conn *c);

/* ---------------------------------------------------------------- lifetime */

static void http_release(rt_http *h)
{
    if (h->stopping && h->open_handles == 0 && h->n_conns == 0) free(h);
}

static void req_free(rt_http_req *r)
{
    if (!r) return;
    free(r->path);
    km_buf_free(&r->body);
    for (int i = 0; i < r->n_headers; i++) {
        free(r->hname[i]);
        free(r->hvalue[i]);
    }
    free(r->hname);
    free(r->hvalue);
    free(r);
}

static void on_conn_closed(uv_handle_t *hd)
{
    conn *c = hd->data;
    if (--c->open_handles) return;
    rt_http *h = c->h;
    km_buf_free(&c->in);
    free(c);
    h->n_conns--;
    http_release(h);
}

static void conn_close(conn *c)
{
    if (c->closing) return;
    c->closing = true;
    if (c->prev)
        c->prev->next = c->next;
    else
        c->h->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    rt_http_req *r = c->cur;
    c->cur = NULL;
    if (r) {
        if (!r->ended && r->on_abort) r->on_abort(r, r->abort_user);
        req_free(r);
    }
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_closed);
}

/* The response ended and every byte of it was handed to the kernel: next request. */
static void req_finish(conn *c)
{
    rt_http_req *r = c->cur;
    if (!r || !r->ended || c->pending_writes) return;
    bool keep = r->keep_alive;
    c->cur = NULL;
    req_free(r);
    if (!keep) {
        conn_close(c);
        return;
    }
    uv_timer_again(&c->timer);
    try_requests(c);
}

/* ---------------------------------------------------------------- writing */

static void on_written(uv_write_t *wr, int status)
{
    write_req *w = (write_req *)wr;
    conn *c = w->c;
    c->pending_writes--;
    c->queued_bytes -= w->out.len;
    km_buf_free(&w->out);
    free(w);
    if (c->closing) return;
    if (status < 0) {
        conn_close(c);
        return;
    }
    req_finish(c);
}

/* Takes ownership of out's bytes. */
static int conn_write(conn *c, km_buf *out)
{
    if (c->closing) {
        km_buf_free(out);
        return KM_EIO;
    }
    if (c->queued_bytes + out->len > WRITE_MAX) {
        km_buf_free(out);
        conn_close(c); /* a client that does not read its stream */
        return KM_EIO;
    }
    write_req *w = calloc(1, sizeof *w);
    if (!w) {
        km_buf_free(out);
        conn_close(c);
        return KM_ENOMEM;
    }
    w->c = c;
    w->out = *out;
    memset(out, 0, sizeof *out);
    uv_buf_t b = uv_buf_init((char *)w->out.data, (unsigned)w->out.len);
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_written) < 0) {
        km_buf_free(&w->out);
        free(w);
        conn_close(c);
        return KM_EIO;
    }
    c->pending_writes++;
    c->queued_bytes += w->out.len;
    uv_timer_again(&c->timer);
    return 0;
}

static bool req_usable(rt_http_req *r)
{
    return r && r->c && !r->c->closing && r->c->cur == r && !r->ended;
}

int rt_http_respond_h(rt_http_req *r, int status, const char *ctype, const char *extra_headers,
                      const void *body, size_t len)
{
    if (!req_usable(r) || r->answered) return KM_EINVAL;
    conn *c = r->c;
    km_buf out = {0};
    int rc =
        km_buf_printf(&out,
                      "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                      "Connection: %s\r\n\r\n",
                      status, km_http_reason(status), ctype ? ctype : "text/plain", len,
                      extra_headers ? extra_headers : "", r->keep_alive ? "keep-alive" : "close");
    if (!rc && !r->head_only) rc = km_buf_append(&out, body, len);
    r->answered = r->ended = true;
    if (rc) {
        km_buf_free(&out);
        conn_close(c);
        return rc;
    }
    rc = conn_write(c, &out);
    if (!rc && !c->in_handler) req_finish(c);
    return rc;
}

int rt_http_respond(rt_http_req *r, int status, const char *ctype, const void *body, size_t len)
{
    return rt_http_respond_h(r, status, ctype, NULL, body, len);
}

int rt_http_stream_begin(rt_http_req *r, int status, const char *ctype)
{
    if (!req_usable(r) || r->answered) return KM_EINVAL;
    km_buf out = {0};
    int rc = km_buf_printf(&out,
                           "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n"
                           "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"
                           "Connection: %s\r\n\r\n",
                           status, km_http_reason(status), ctype ? ctype : "text/event-stream",
                           r->keep_alive ? "keep-alive" : "close");
    r->answered = r->streaming = true;
    if (rc) {
        km_buf_free(&out);
        return rc;
    }
    return conn_write(r->c, &out);
}

int rt_http_stream_write(rt_http_req *r, const void *data, size_t len)
{
    if (!req_usable(r) || !r->streaming) return KM_EINVAL;
    if (len == 0 || r->head_only) return 0;
    km_buf out = {0};
    int rc = km_buf_printf(&out, "%zx\r\n", len);
    if (!rc) rc = km_buf_append(&out, data, len);
    if (!rc) rc = km_buf_append(&out, "\r\n", 2);
    if (rc) {
        km_buf_free(&out);
        return rc;
    }
    return conn_write(r->c, &out);
}

int rt_http_stream_end(rt_http_req *r)
{
    if (!req_usable(r) || !r->streaming) return KM_EINVAL;
    conn *c = r->c;
    r->ended = true;
    int rc = 0;
    if (!r->head_only) {
        km_buf out = {0};
        rc = km_buf_append(&out, "0\r\n\r\n", 5);
        rc = rc ? rc : conn_write(c, &out);
    }
    if (!rc && !c->closing && !c->in_handler) req_finish(c);
    return rc;
}

void rt_http_on_abort(rt_http_req *r, void (*fn)(rt_http_req *r, void *user), void *user)
{
    if (!r) return;
    r->on_abort = fn;
    r->abort_user = user;
}

/* An error answered by the server itself, then the connection closes. */
static void fatal(conn *c, int status, const char *msg)
{
    km_buf out = {0};
    if (km_buf_printf(&out,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                      "Connection: close\r\n\r\n%s",
                      status, km_http_reason(status), strlen(msg), msg)) {
        km_buf_free(&out);
        conn_close(c);
        return;
    }
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    }
    rt_http_req *r = calloc(1, sizeof *r); /* a finished request that closes after the write */
    if (!r) {
        km_buf_free(&out);
        conn_close(c);
        return;
    }
    r->c = c;
    r->answered = r->ended = true;
    c->cur = r;
    conn_write(c, &out);
}

static void fatal_json(conn *c, int status, const char *message)
{
    char buf[320];
    snprintf(buf, sizeof buf,
             "{\"error\":{\"message\":\"%s\",\"type\":\"invalid_request_error\",\"param\":null,"
             "\"code\":null}}\n",
             message);
    fatal(c, status, buf);
}

/* ---------------------------------------------------------------- reading */

const char *rt_http_method(const rt_http_req *r)
{
    return r->method;
}
const char *rt_http_path(const rt_http_req *r)
{
    return r->path;
}
const char *rt_http_body(const rt_http_req *r, size_t *len)
{
    *len = r->body.len;
    return r->body.data ? (const char *)r->body.data : "";
}
const char *rt_http_header(const rt_http_req *r, const char *name)
{
    for (int i = 0; i < r->n_headers; i++)
        if (!strcasecmp(r->hname[i], name)) return r->hvalue[i];
    return NULL;
}

static bool hdr_is(const struct phr_header *h, const char *name)
{
    return h->name && h->name_len == strlen(name) && !strncasecmp(h->name, name, h->name_len);
}

static bool hdr_has(const struct phr_header *h, const char *token)
{
    size_t n = strlen(token);
    for (size_t i = 0; i + n <= h->value_len; i++)
        if (!strncasecmp(h->value + i, token, n)) return true;
    return false;
}

static void consume(conn *c, size_t n)
{
    memmove(c->in.data, c->in.data + n, c->in.len - n);
    c->in.len -= n;
}

static void start_reading(conn *c);

/* Parses and dispatches buffered requests, one at a time. */
static void try_requests(conn *c)
{
    rt_http *h = c->h;
    while (!c->closing && !c->cur && c->in.len) {
        const char *method, *path;
        size_t mlen, plen, nh = MAX_HEADERS;
        int minor;
        struct phr_header hs[MAX_HEADERS];
        int hl = phr_parse_request((const char *)c->in.data, c->in.len, &method, &mlen, &path,
                                   &plen, &minor, hs, &nh, 0);
        if (hl == -1) return fatal_json(c, 400, "malformed HTTP request");
        if (hl == -2) {
            if (c->in.len >= HEAD_MAX) return fatal_json(c, 431, "request head too large");
            break;
        }
        bool chunked = false, has_len = false, expect = false, keep = minor >= 1;
        size_t clen = 0;
        for (size_t i = 0; i < nh; i++) {
            if (hdr_is(&hs[i], "content-length")) {
                char tmp[24];
                if (hs[i].value_len == 0 || hs[i].value_len >= sizeof tmp)
                    return fatal_json(c, 400, "bad Content-Length");
                memcpy(tmp, hs[i].value, hs[i].value_len);
                tmp[hs[i].value_len] = 0;
                char *end;
                unsigned long long v = strtoull(tmp, &end, 10);
                if (*end || tmp[0] == '-' || (has_len && v != clen))
                    return fatal_json(c, 400, "bad Content-Length");
                clen = (size_t)v;
                has_len = true;
            } else if (hdr_is(&hs[i], "transfer-encoding")) {
                if (!hdr_has(&hs[i], "chunked"))
                    return fatal_json(c, 501, "unsupported Transfer-Encoding");
                chunked = true;
            } else if (hdr_is(&hs[i], "connection")) {
                if (hdr_has(&hs[i], "close")) keep = false;
                if (hdr_has(&hs[i], "keep-alive")) keep = true;
            } else if (hdr_is(&hs[i], "expect")) {
                expect = hdr_has(&hs[i], "100-continue");
            }
        }
        if (chunked && has_len) return fatal_json(c, 400, "both Content-Length and chunked");
        if (has_len && clen > h->o.max_body) return fatal_json(c, 413, "request body too large");
        size_t total = (size_t)hl;
        km_buf body = {0};
        if (has_len) {
            if (c->in.len < (size_t)hl + clen) goto incomplete;
            if (km_buf_append(&body, c->in.data + hl, clen)) return conn_close(c);
            total += clen;
        } else if (chunked) {
            size_t avail = c->in.len - (size_t)hl;
            if (km_buf_append(&body, c->in.data + hl, avail)) return conn_close(c);
            struct phr_chunked_decoder dec;
            memset(&dec, 0, sizeof dec);
            dec.consume_trailer = 1;
            size_t sz = body.len;
            ssize_t left = phr_decode_chunked(&dec, (char *)body.data, &sz);
            if (left == -1) {
                km_buf_free(&body);
                return fatal_json(c, 400, "malformed chunked body");
            }
            if (left == -2) {
                km_buf_free(&body);
                if (sz > h->o.max_body) return fatal_json(c, 413, "request body too large");
                goto incomplete;
            }
            body.len = sz;
            if (sz > h->o.max_body) {
                km_buf_free(&body);
                return fatal_json(c, 413, "request body too large");
            }
            total = c->in.len - (size_t)left;
        }
        rt_http_req *r = calloc(1, sizeof *r);
        if (!r) {
            km_buf_free(&body);
            return conn_close(c);
        }
        r->c = c;
        r->body = body;
        r->keep_alive = keep;
        snprintf(r->method, sizeof r->method, "%.*s", (int)(mlen < 15 ? mlen : 15), method);
        r->head_only = !strcmp(r->method, "HEAD");
        const char *q = memchr(path, '?', plen);
        r->path = strndup(path, q ? (size_t)(q - path) : plen);
        r->hname = calloc(nh ? nh : 1, sizeof *r->hname);
        r->hvalue = calloc(nh ? nh : 1, sizeof *r->hvalue);
        bool oom = !r->path || !r->hname || !r->hvalue;
        for (size_t i = 0; !oom && i < nh; i++) {
            if (!hs[i].name) continue; /* a continuation line */
            r->hname[r->n_headers] = strndup(hs[i].name, hs[i].name_len);
            r->hvalue[r->n_headers] = strndup(hs[i].value, hs[i].value_len);
            r->n_headers++;
            oom = !r->hname[r->n_headers - 1] || !r->hvalue[r->n_headers - 1];
        }
        if (oom) {
            req_free(r);
            return conn_close(c);
        }
        consume(c, total);
        c->sent_continue = false;
        c->cur = r;
        h->requests++;
        c->in_handler = true;
        h->o.handler(r, h->o.user);
        c->in_handler = false;
        if (c->closing) return;
        if (c->cur == r && r->ended) req_finish(c);
        continue;
    incomplete:
        if (expect && !c->sent_continue) {
            km_buf out = {0};
            c->sent_continue = true;
            if (km_buf_printf(&out, "HTTP/1.1 100 Continue\r\n\r\n") || conn_write(c, &out)) {
                km_buf_free(&out);
                return;
            }
        }
        break;
    }
    if (!c->closing) start_reading(c);
}

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    conn *c = hd->data;
    if (km_buf_reserve(&c->in, 65536)) {
        *buf = uv_buf_init(NULL, 0);
        return;
    }
    *buf = uv_buf_init((char *)c->in.data + c->in.len, (unsigned)(c->in.cap - c->in.len));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = s->data;
    if (nread < 0) {
        conn_close(c);
        return;
    }
    if (nread == 0) return;
    c->in.len += (size_t)nread;
    uv_timer_again(&c->timer);
    if (c->cur) {
        /* A response is pending: keep reading (to notice the client leaving) but bound what is
         * buffered of pipelined requests. */
        if (c->in.len > HEAD_MAX + c->h->o.max_body) {
            uv_read_stop(s);
            c->reading = false;
        }
        return;
    }
    if (c->in.len > HEAD_MAX + c->h->o.max_body + 64) {
        fatal_json(c, 413, "request too large");
        return;
    }
    try_requests(c);
}

static void start_reading(conn *c)
{
    if (c->reading || c->closing) return;
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) == 0) c->reading = true;
}

static void on_idle(uv_timer_t *t)
{
    conn *c = t->data;
    if (c->cur && !c->cur->ended) return; /* a response in progress (a slow prefill) */
    conn_close(c);
}

static void on_connection(uv_stream_t *server, int status)
{
    rt_http *h = server->data;
    if (status < 0) return;
    conn *c = calloc(1, sizeof *c);
    if (!c) return;
    c->h = h;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->open_handles = 2;
    h->n_conns++;
    c->next = h->conns;
    if (h->conns) h->conns->prev = c;
    h->conns = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0 || h->n_conns > h->o.max_conns) {
        conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    uv_timer_start(&c->timer, on_idle, (uint64_t)h->o.idle_ms, (uint64_t)h->o.idle_ms);
    start_reading(c);
}

/* ---------------------------------------------------------------- server */

static void on_listener_closed(uv_handle_t *hd)
{
    rt_http *h = hd->data;
    h->open_handles--;
    http_release(h);
}

int rt_http_start(void *loop, const rt_http_opts *o, rt_http **out, km_errbuf *err)
{
    *out = NULL;
    if (!loop || !o || !o->handler) return km_errf(err, KM_EINVAL, "http: no loop or handler");
    rt_http *h = calloc(1, sizeof *h);
    if (!h) return km_errf(err, KM_ENOMEM, "http: out of memory");
    h->loop = loop;
    h->o = *o;
    if (!h->o.max_body) h->o.max_body = 4u << 20;
    if (h->o.max_conns <= 0) h->o.max_conns = 1024;
    if (h->o.idle_ms <= 0) h->o.idle_ms = 60000;
    snprintf(h->host, sizeof h->host, "%s", o->host ? o->host : "127.0.0.1");
    h->o.host = h->host;
    struct sockaddr_storage sa;
    int rc = uv_ip4_addr(h->host, o->port, (struct sockaddr_in *)&sa);
    if (rc) rc = uv_ip6_addr(h->host, o->port, (struct sockaddr_in6 *)&sa);
    if (rc) {
        free(h);
        return km_errf(err, KM_EINVAL, "http: bad host '%s'", h->host);
    }
    uv_tcp_init(h->loop, &h->listener);
    h->listener.data = h;
    h->open_handles = 1;
    rc = uv_tcp_bind(&h->listener, (struct sockaddr *)&sa, 0);
    if (!rc) rc = uv_listen((uv_stream_t *)&h->listener, 256, on_connection);
    if (rc) {
        km_errf(err, KM_EIO, "http: cannot listen on %s:%d: %s", h->host, o->port, uv_strerror(rc));
        h->stopping = true;
        uv_close((uv_handle_t *)&h->listener, on_listener_closed);
        return KM_EIO;
    }
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    uv_tcp_getsockname(&h->listener, (struct sockaddr *)&bound, &blen);
    h->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);
    *out = h;
    return 0;
}

int rt_http_port(const rt_http *h)
{
    return h ? h->port : -1;
}

uint64_t rt_http_requests(const rt_http *h)
{
    return h ? h->requests : 0;
}

void rt_http_stop(rt_http *h)
{
    if (!h || h->stopping) return;
    h->stopping = true;
    while (h->conns) conn_close(h->conns);
    uv_close((uv_handle_t *)&h->listener, on_listener_closed);
}
