/*
 * admin_http.c — the admin HTTP server every daemon runs: GET /metrics (the registry in
 * Prometheus text), /healthz (200 while this loop runs), /readyz (200 or 503 from a callback),
 * 404 for anything else.
 *
 * Why it is built this way:
 *  - It runs its own libuv loop on its own thread (km_admin_start / km_admin_stop), so a daemon's
 *    main loop, however busy or stuck, neither disturbs nor is disturbed by scrapes; /healthz
 *    answering means this thread and the process are alive.
 *  - Requests are parsed by picohttpparser (phr_parse_request), the maintained HTTP/1 parser of
 *    h2o, taken from Debian's libh2o (which exports it but ships no header for it, hence the
 *    declarations below; docs/dependencies.md has the reasoning). The server only adds what a
 *    parser does not: buffering, keep-alive and pipelining, limits, timeouts.
 *  - Limits keep a misbehaving client cheap: 8 KiB of request head, 64 connections, 10 s idle,
 *    no request bodies; every violation gets a status code and a closed connection.
 */
#include "common/svc.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <uv.h>

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

#define HEAD_MAX    8192
#define MAX_HEADERS 32
#define MAX_CONNS   64
#define IDLE_MS     10000

struct km_admin {
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t stop;
    uv_thread_t thread;
    km_admin_opts opts;
    char host[64];
    int port;
    int n_conns;
    bool loop_ready, listener_ready, stop_ready;
};

typedef struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    km_admin *a;
    int open_handles; /* freed when both handles are closed */
    bool closing, writing, close_after_write;
    size_t len, last_len;
    char buf[HEAD_MAX];
} conn;

typedef struct write_req {
    uv_write_t req;
    conn *c;
    km_buf out;
} write_req;

/* ---------------------------------------------------------------- connections */

static void on_handle_closed(uv_handle_t *h)
{
    conn *c = h->data;
    if (--c->open_handles == 0) {
        c->a->n_conns--;
        free(c);
    }
}

static void conn_close(conn *c)
{
    if (c->closing) return;
    c->closing = true;
    uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
    uv_close((uv_handle_t *)&c->timer, on_handle_closed);
}

static void on_idle(uv_timer_t *t)
{
    conn_close(t->data);
}

static void try_requests(conn *c);

static void on_written(uv_write_t *req, int status)
{
    write_req *w = (write_req *)req;
    conn *c = w->c;
    km_buf_free(&w->out);
    free(w);
    c->writing = false;
    if (c->closing) return;
    if (status < 0 || c->close_after_write) {
        conn_close(c);
        return;
    }
    uv_timer_again(&c->timer);
    try_requests(c); /* a pipelined request may already be buffered */
}

const char *km_http_reason(int status)
{
    switch (status) {
    case 100:
        return "Continue";
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 411:
        return "Length Required";
    case 413:
        return "Payload Too Large";
    case 415:
        return "Unsupported Media Type";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 499:
        return "Client Closed Request";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    }
    return "Unknown";
}

/* Queues one response; the body is sent unless head_only. */
static void respond(conn *c, int status, const char *ctype, const void *body, size_t len,
                    bool head_only, bool close)
{
    write_req *w = calloc(1, sizeof *w);
    if (!w) {
        conn_close(c);
        return;
    }
    w->c = c;
    int rc =
        km_buf_printf(&w->out,
                      "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                      "Connection: %s\r\n\r\n",
                      status, km_http_reason(status), ctype, len,
                      status == 405 ? "Allow: GET, HEAD\r\n" : "", close ? "close" : "keep-alive");
    if (!rc && !head_only) rc = km_buf_append(&w->out, body, len);
    if (rc) {
        km_buf_free(&w->out);
        free(w);
        conn_close(c);
        return;
    }
    uv_buf_t b = uv_buf_init((char *)w->out.data, (unsigned)w->out.len);
    c->writing = true;
    c->close_after_write = close;
    uv_read_stop((uv_stream_t *)&c->tcp); /* one response at a time, in order */
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_written) < 0) {
        c->writing = false;
        km_buf_free(&w->out);
        free(w);
        conn_close(c);
    }
}

static void respond_text(conn *c, int status, const char *text, bool head_only, bool close)
{
    respond(c, status, "text/plain; charset=utf-8", text, strlen(text), head_only, close);
}

static bool header_is(const struct phr_header *h, const char *name)
{
    return h->name && h->name_len == strlen(name) && strncasecmp(h->name, name, h->name_len) == 0;
}

static bool value_has(const struct phr_header *h, const char *token)
{
    size_t n = strlen(token);
    for (size_t i = 0; i + n <= h->value_len; i++)
        if (strncasecmp(h->value + i, token, n) == 0) return true;
    return false;
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    conn *c = h->data;
    *buf = uv_buf_init(c->buf + c->len, (unsigned)(sizeof c->buf - c->len));
}

/* Answers every complete request in the buffer (one at a time: the next waits for the write). */
static void try_requests(conn *c)
{
    if (c->closing || c->writing) return;
    if (c->len == 0) {
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
        return;
    }
    const char *method, *path;
    size_t mlen, plen, nh = MAX_HEADERS;
    int minor;
    struct phr_header hs[MAX_HEADERS];
    int n = phr_parse_request(c->buf, c->len, &method, &mlen, &path, &plen, &minor, hs, &nh,
                              c->last_len);
    if (n == -2) { /* incomplete */
        c->last_len = c->len;
        if (c->len == sizeof c->buf) {
            respond_text(c, 431, "request head too large\n", false, true);
            return;
        }
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
        return;
    }
    if (n < 0) {
        respond_text(c, 400, "malformed request\n", false, true);
        return;
    }
    bool close = minor == 0;
    for (size_t i = 0; i < nh; i++) {
        if (header_is(&hs[i], "connection")) {
            if (value_has(&hs[i], "close"))
                close = true;
            else if (value_has(&hs[i], "keep-alive"))
                close = false;
        } else if (header_is(&hs[i], "transfer-encoding")) {
            respond_text(c, 501, "request bodies are not supported\n", false, true);
            return;
        } else if (header_is(&hs[i], "content-length")) {
            if (!(hs[i].value_len == 1 && hs[i].value[0] == '0')) {
                respond_text(c, 413, "request bodies are not supported\n", false, true);
                return;
            }
        }
    }
    /* Copy what routing needs, then drop the request from the buffer. */
    char p[128];
    size_t pl = plen;
    for (size_t i = 0; i < plen; i++)
        if (path[i] == '?') pl = i < pl ? i : pl;
    bool path_fits = pl < sizeof p;
    if (path_fits) {
        memcpy(p, path, pl);
        p[pl] = '\0';
    }
    bool is_get = mlen == 3 && memcmp(method, "GET", 3) == 0;
    bool is_head = mlen == 4 && memcmp(method, "HEAD", 4) == 0;
    memmove(c->buf, c->buf + n, c->len - (size_t)n);
    c->len -= (size_t)n;
    c->last_len = 0;

    km_admin *a = c->a;
    const char *route = !path_fits                   ? NULL
                        : strcmp(p, "/metrics") == 0 ? "metrics"
                        : strcmp(p, "/healthz") == 0 ? "healthz"
                        : strcmp(p, "/readyz") == 0  ? "readyz"
                                                     : NULL;
    if (!route) {
        respond_text(c, 404, "not found\n", is_head, close);
    } else if (!is_get && !is_head) {
        respond_text(c, 405, "method not allowed\n", false, close);
    } else if (route[0] == 'h') {
        respond_text(c, 200, "ok\n", is_head, close);
    } else if (route[0] == 'r') {
        bool ready = !a->opts.ready || a->opts.ready(a->opts.user);
        respond_text(c, ready ? 200 : 503, ready ? "ready\n" : "not ready\n", is_head, close);
    } else {
        km_buf body = {0};
        if (a->opts.metrics && km_metrics_render(a->opts.metrics, &body) != 0) {
            km_buf_free(&body);
            respond_text(c, 500, "out of memory\n", false, true);
            return;
        }
        respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", body.data, body.len, is_head,
                close);
        km_buf_free(&body);
    }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = s->data;
    if (nread < 0) {
        /* EOF or error: finish a response in flight, then close */
        if (c->writing)
            c->close_after_write = true;
        else
            conn_close(c);
        return;
    }
    if (nread == 0) return;
    c->len += (size_t)nread;
    uv_timer_again(&c->timer);
    try_requests(c);
}

static void on_connection(uv_stream_t *server, int status)
{
    km_admin *a = server->data;
    if (status < 0) return;
    conn *c = calloc(1, sizeof *c);
    if (!c) return;
    c->a = a;
    uv_tcp_init(&a->loop, &c->tcp);
    uv_timer_init(&a->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->open_handles = 2;
    a->n_conns++;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0 || a->n_conns > MAX_CONNS) {
        conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    uv_timer_start(&c->timer, on_idle, IDLE_MS, IDLE_MS);
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* ---------------------------------------------------------------- start / stop */

static void close_any(uv_handle_t *h, void *arg)
{
    km_admin *a = arg;
    if (uv_is_closing(h)) return;
    if (h == (uv_handle_t *)&a->listener || h == (uv_handle_t *)&a->stop)
        uv_close(h, NULL);
    else
        conn_close(h->data);
}

static void on_stop(uv_async_t *h)
{
    km_admin *a = h->data;
    uv_walk(&a->loop, close_any, a);
}

static void run_loop(void *arg)
{
    km_admin *a = arg;
    uv_run(&a->loop, UV_RUN_DEFAULT);
}

/* Closes whatever start managed to open (before the thread runs) and frees a. */
static void teardown(km_admin *a)
{
    if (a->loop_ready) {
        if (a->listener_ready) uv_close((uv_handle_t *)&a->listener, NULL);
        if (a->stop_ready) uv_close((uv_handle_t *)&a->stop, NULL);
        uv_run(&a->loop, UV_RUN_DEFAULT);
        uv_loop_close(&a->loop);
    }
    free(a);
}

int km_admin_start(const km_admin_opts *o, km_admin **out, km_errbuf *err)
{
    *out = NULL;
    if (!o || o->port < 0 || o->port > 65535)
        return km_errf(err, KM_EINVAL, "admin http: bad options or port");
    km_admin *a = calloc(1, sizeof *a);
    if (!a) return km_errf(err, KM_ENOMEM, "admin http: out of memory");
    a->opts = *o;
    snprintf(a->host, sizeof a->host, "%s", o->host ? o->host : "127.0.0.1");
    a->opts.host = a->host;

    int rc = uv_loop_init(&a->loop);
    if (rc < 0) {
        free(a);
        return km_errf(err, KM_EIO, "admin http: uv_loop_init: %s", uv_strerror(rc));
    }
    a->loop_ready = true;
    struct sockaddr_storage addr;
    if (strchr(a->host, ':'))
        rc = uv_ip6_addr(a->host, o->port, (struct sockaddr_in6 *)&addr);
    else
        rc = uv_ip4_addr(a->host, o->port, (struct sockaddr_in *)&addr);
    const char *step = "address";
    if (rc >= 0) {
        step = "tcp init";
        rc = uv_tcp_init(&a->loop, &a->listener);
        a->listener_ready = rc >= 0;
        a->listener.data = a;
    }
    if (rc >= 0) {
        step = "bind";
        rc = uv_tcp_bind(&a->listener, (const struct sockaddr *)&addr, 0);
    }
    if (rc >= 0) {
        step = "listen";
        rc = uv_listen((uv_stream_t *)&a->listener, 128, on_connection);
    }
    if (rc >= 0) {
        step = "getsockname";
        struct sockaddr_storage bound;
        int len = sizeof bound;
        rc = uv_tcp_getsockname(&a->listener, (struct sockaddr *)&bound, &len);
        if (rc >= 0)
            a->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                        : ((struct sockaddr_in *)&bound)->sin_port);
    }
    if (rc >= 0) {
        step = "async init";
        rc = uv_async_init(&a->loop, &a->stop, on_stop);
        a->stop_ready = rc >= 0;
        a->stop.data = a;
    }
    if (rc >= 0) {
        step = "thread";
        rc = uv_thread_create(&a->thread, run_loop, a);
    }
    if (rc < 0) {
        int code = rc == UV_EADDRINUSE || rc == UV_EACCES ? KM_EIO : KM_EINVAL;
        km_errf(err, code, "admin http %s:%d: %s: %s", a->host, o->port, step, uv_strerror(rc));
        teardown(a);
        return code;
    }
    *out = a;
    return 0;
}

int km_admin_port(const km_admin *a)
{
    return a ? a->port : 0;
}

void km_admin_stop(km_admin *a)
{
    if (!a) return;
    uv_async_send(&a->stop);
    uv_thread_join(&a->thread);
    uv_loop_close(&a->loop);
    free(a);
}
