/*
 * http_server.c — the HTTP/1.1 server of every kvmesh daemon (common/http.h, "server"): the admin
 * port (admin_http.c) and the router's OpenAI-compatible front both run it, each with its own
 * route table, limits and error shape.
 *
 * Why it is built this way:
 *  - Parsing is km_http_parse_request (http_parse.c, on picohttpparser); this file keeps the I/O:
 *    connections on a libuv loop the caller owns, buffering, keep-alive, pipelining, 100-continue,
 *    limits, idle timeouts, streaming, and closing every connection on stop (the reason h2o's own
 *    server is not used: docs/openai.md).
 *  - It runs on the caller's loop, not a thread of its own, so a handler calls straight into its
 *    daemon (no locks) and, in the router, a token arriving from a worker is written to its HTTP
 *    client in the same callback. The admin port gets a thread by running a loop of its own.
 *  - One request per connection is answered at a time, in order; while a response is pending the
 *    connection keeps reading (to notice the client leaving) but stops once a bounded amount of
 *    pipelined input is buffered, so a client cannot queue unbounded work.
 *  - A request outlives the handler call when the handler answers later (streaming); the
 *    connection going away then calls the handler's abort callback, after which the request is
 *    freed and must not be touched.
 *  - Bounded against clients that hold connections without finishing requests (slowloris): each
 *    connection is in one phase with one deadline (waiting for a request, its head, its body, or
 *    its response being written), set when the phase begins and not moved by the bytes that
 *    trickle in; and at max_conns a new connection evicts the one waiting longest without a
 *    request in progress, so connections cannot be hoarded either.
 *  - TLS (opts.tls_cert/tls_key) is a layer between the socket and the rest (http_tls.c): bytes
 *    read are decrypted into the same input buffer the parser reads, and every write is sealed
 *    first, so nothing above it knows. The handshake runs inside the head phase: a client that
 *    does not finish it in head_ms is closed like a slow head.
 *  - Nothing is done for a request before its head is admitted: opts.on_head (the router's API
 *    key check) answers a refused one before its body is read, bodies are taken out of the input
 *    as they arrive (chunked ones decoded once, incrementally), and what all connections hold
 *    is counted against opts.max_buffered.
 *  - Responses and the writes under them are http_respond.c's; both files share http_conn.h.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <uv.h>

#include "common/http_conn.h"

#define BODY_MAX     (1u << 30)   /* the most any server may accept as max_body */
#define READ_SIZE    65536        /* room made for each read */
#define IN_KEEP      (128u << 10) /* an emptied input buffer larger than this is freed */
#define BUFFERED_MAX (256u << 20) /* default opts.max_buffered */
#define DISCARD_READ 4096         /* room made for each read of a refused body */
#define LINGER_IDLE  1000         /* ms a refused body may pause once its answer is written */
#define LINGER_MAX   10000        /* ms it may take in all after that */

static void try_requests(conn *c);
static void start_reading(conn *c);
static void on_deadline(uv_timer_t *t);
static void linger(conn *c);

/* Enters a phase and starts its deadline (a phase's bytes never move it). */
void km_http_set_phase(conn *c, phase ph)
{
    const km_http_opts *o = &c->s->o;
    int ms = ph == PH_IDLE   ? o->idle_ms
             : ph == PH_HEAD ? o->head_ms
             : ph == PH_BODY ? o->body_ms
                             : o->idle_ms;
    if (ph != PH_BUSY && c->ph == PH_BUSY) c->waiting_since = uv_now(c->s->loop);
    c->ph = ph;
    uv_timer_start(&c->timer, on_deadline, (uint64_t)ms, 0);
}

/* ---------------------------------------------------------------- memory held

 * What connections hold of request input (buffers, bodies being read) is counted against
 * opts.max_buffered, so many connections sending big bodies, or none finishing, cannot make the
 * process grow without bound; see also on_head (http.h), which keeps a request without a key
 * from getting past its head. */

static size_t conn_footprint(const conn *c)
{
    return c->in.cap + c->raw.cap + (c->pend ? c->pend->body.cap : 0) + c->dec.body.cap;
}

static void conn_account(conn *c)
{
    size_t now = c->closing ? 0 : conn_footprint(c);
    c->s->buffered = c->s->buffered - c->held + now;
    c->held = now;
}

static bool budget_allows(const conn *c, size_t extra)
{
    const km_http_server *s = c->s;
    return s->buffered <= s->o.max_buffered && extra <= s->o.max_buffered - s->buffered;
}

/* How much b's capacity grows (km_buf_reserve doubles) to make room for extra more bytes. */
static size_t growth(const km_buf *b, size_t extra)
{
    if (extra <= b->cap - b->len) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    return cap - b->cap;
}

/* ---------------------------------------------------------------- lifetime */

static void server_release(km_http_server *s)
{
    if (s->stopping && s->open_handles == 0 && s->n_conns == 0) {
        km_tls_ctx_free(s->tls);
        free(s);
    }
}

static void req_free(km_http_req *r)
{
    if (!r) return;
    free(r->path);
    free(r->extra);
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
    km_http_server *s = c->s;
    km_buf_free(&c->in);
    km_buf_free(&c->raw);
    km_tls_free(c->tls);
    free(c);
    s->n_conns--;
    server_release(s);
}

/* Forgets the request whose body was being read. */
static void drop_pending(conn *c)
{
    req_free(c->pend);
    c->pend = NULL;
    km_http_chunked_free(&c->dec);
    c->pend_chunked = false;
    c->body_left = 0;
}

void km_http_conn_close(conn *c)
{
    if (c->closing) return;
    c->closing = true;
    drop_pending(c);
    conn_account(c);
    if (c->prev)
        c->prev->next = c->next;
    else
        c->s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    km_http_req *r = c->cur;
    c->cur = NULL;
    if (r) {
        if (!r->ended && r->on_abort) r->on_abort(r, r->abort_user);
        req_free(r);
    }
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_closed);
}

/* The response ended and every byte of it was handed to the kernel: next request. */
void km_http_req_finish(conn *c)
{
    km_http_req *r = c->cur;
    if (!r || !r->ended || c->pending_writes) return;
    bool keep = r->keep_alive;
    c->cur = NULL;
    req_free(r);
    if (!keep) {
        if (c->discarding && !c->input_done) { /* a refused body still arriving */
            c->linger_until = uv_now(c->s->loop) + LINGER_MAX;
            linger(c);
            return;
        }
        km_http_conn_close(c);
        return;
    }
    km_http_set_phase(c, c->in.len ? PH_HEAD : PH_IDLE);
    try_requests(c);
}

/* The connection reads nothing more: what it buffered or was reading is dropped, and it closes
 * once its last answer is written. */
static void stop_input(conn *c)
{
    drop_pending(c);
    km_buf_free(&c->in);
    c->input_done = true;
    if (c->reading) uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = false;
}

/* An error the server answers before any request exists (malformed, too large): a finished
 * request that closes the connection after its write. */
static void fatal(conn *c, int status, const char *message)
{
    stop_input(c);
    km_http_req *r = calloc(1, sizeof *r);
    if (!r) {
        km_http_conn_close(c);
        return;
    }
    r->c = c;
    c->cur = r;
    km_http_set_phase(c, PH_BUSY);
    km_http_respond_error_with(r, status, NULL, message);
}

/* ---------------------------------------------------------------- requests */

const char *km_http_method(const km_http_req *r)
{
    return r->method;
}
const char *km_http_path(const km_http_req *r)
{
    return r->path;
}
const char *km_http_body(const km_http_req *r, size_t *len)
{
    *len = r->body.len;
    return r->body.data ? (const char *)r->body.data : "";
}
const char *km_http_header(const km_http_req *r, const char *name)
{
    for (int i = 0; i < r->n_headers; i++)
        if (!strcasecmp(r->hname[i], name)) return r->hvalue[i];
    return NULL;
}

/* The request as the handler sees it: method, path and headers copied out of the connection's
 * buffer (which the next request reuses), the body taken over. NULL on out of memory. */
static km_http_req *req_new(conn *c, km_http_request *p)
{
    km_http_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->c = c;
    r->body = p->body;
    memset(&p->body, 0, sizeof p->body);
    r->keep_alive = p->keep_alive;
    snprintf(r->method, sizeof r->method, "%.*s", (int)(p->method_len < 15 ? p->method_len : 15),
             p->method);
    r->head_only = !strcmp(r->method, "HEAD");
    r->path = strndup(p->path, p->path_len);
    r->hname = calloc(p->n_headers ? p->n_headers : 1, sizeof *r->hname);
    r->hvalue = calloc(p->n_headers ? p->n_headers : 1, sizeof *r->hvalue);
    bool oom = !r->path || !r->hname || !r->hvalue;
    for (size_t i = 0; !oom && i < p->n_headers; i++) {
        const km_http_field *f = &p->headers[i];
        if (!f->name) continue; /* a continuation line */
        r->hname[r->n_headers] = strndup(f->name, f->name_len);
        r->hvalue[r->n_headers] = strndup(f->value, f->value_len);
        r->n_headers++;
        oom = !r->hname[r->n_headers - 1] || !r->hvalue[r->n_headers - 1];
    }
    if (oom) {
        req_free(r);
        return NULL;
    }
    return r;
}

/* "GET, HEAD" / "POST" / both: the Allow header of a route's 405. */
static void allow_list(unsigned methods, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s%s%s", methods & KM_HTTP_GET ? "GET, HEAD" : "",
             (methods & KM_HTTP_GET) && (methods & KM_HTTP_POST) ? ", " : "",
             methods & KM_HTTP_POST ? "POST" : "");
}

static bool method_allowed(unsigned methods, const char *m)
{
    if (!methods) return true;
    if ((methods & KM_HTTP_GET) && (!strcmp(m, "GET") || !strcmp(m, "HEAD"))) return true;
    return (methods & KM_HTTP_POST) && !strcmp(m, "POST");
}

/* A route's path against a request's: exact, or (ending in '/') anything below it. */
static bool path_matches(const char *route, const char *path)
{
    size_t n = strlen(route);
    if (n && route[n - 1] == '/') return !strncmp(route, path, n) && path[n];
    return !strcmp(route, path);
}

/* The route table: the handler, or the server's own 404 / 405. */
static void dispatch(km_http_server *s, km_http_req *r)
{
    for (size_t i = 0; i < s->o.n_routes; i++) {
        const km_http_route *rt = &s->o.routes[i];
        if (rt->path && !path_matches(rt->path, r->path)) continue;
        if (method_allowed(rt->methods, r->method)) {
            rt->fn(r, s->o.user);
            return;
        }
        char allow[32], hdr[64], msg[64];
        allow_list(rt->methods, allow, sizeof allow);
        snprintf(hdr, sizeof hdr, "Allow: %s\r\n", allow);
        snprintf(msg, sizeof msg, "method not allowed: use %s", allow);
        km_http_respond_error_with(r, 405, hdr, msg);
        return;
    }
    km_http_respond_error_with(r, 404, NULL, "not found");
}

/* Drops n bytes from the front of the input. */
static void consume(conn *c, size_t n)
{
    memmove(c->in.data, c->in.data + n, c->in.len - n);
    c->in.len -= n;
    if (!c->in.len && c->in.cap > IN_KEEP) km_buf_free(&c->in);
}

static void refuse_memory(conn *c)
{
    km_http_server *s = c->s;
    s->buffer_refusals++;
    if (s->o.buffer_refusals) km_counter_inc(s->o.buffer_refusals);
    KM_WARN("http_buffer_full", "buffered=%zu max_buffered=%zu", s->buffered, s->o.max_buffered);
    fatal(c, 503, "the server holds too much request data; retry later");
}

/* Once a refused request is answered, the rest of its body gets LINGER_IDLE after each read and
 * LINGER_MAX in all (on_deadline then closes), so a client still sending it reads its answer
 * instead of a reset, and one that stopped costs a second at most. */
static void linger(conn *c)
{
    uint64_t now = uv_now(c->s->loop), left = c->linger_until > now ? c->linger_until - now : 0;
    c->ph = PH_BODY;
    uv_timer_start(&c->timer, on_deadline, left < LINGER_IDLE ? left : LINGER_IDLE, 0);
}

/* Drops what arrived of a refused body; once all of it is in, the connection closes (after its
 * answer, if that is still being written). */
static void discard_input(conn *c)
{
    size_t n = c->in.len < c->discard_left ? c->in.len : c->discard_left;
    c->discard_left -= n;
    c->in.len = 0;
    if (c->discard_left) {
        if (!c->cur) linger(c);
        return;
    }
    c->input_done = true;
    if (c->reading) uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = false;
    if (!c->cur) km_http_conn_close(c);
}

/* A refused request's body is read and dropped, never buffered, up to what it announced (a
 * chunked one: up to the limits), so that closing after the answer does not reset the
 * connection under a client still sending it (which could lose the answer); the body deadline
 * bounds how long. */
static void skip_body(conn *c, size_t announced)
{
    drop_pending(c);
    c->discarding = true;
    c->discard_left = announced;
    discard_input(c);
    km_buf_free(&c->in); /* reads of the rest take DISCARD_READ at a time */
}

/* opts.on_head's say on r, whose head just arrived: true to read on to its body. When the hook
 * answered, r is the connection's current request, answered; a request that announced a body
 * (body bytes, at most) closes the connection after the answer, its body dropped unread. */
static bool head_admitted(conn *c, km_http_req *r, size_t body)
{
    bool has_body = body > 0;
    bool keep = r->keep_alive;
    r->keep_alive = keep && !has_body;
    c->pend = NULL; /* r is the current request while the hook runs, so it may answer it */
    c->cur = r;
    c->in_handler = true;
    c->s->o.on_head(r, c->s->o.user);
    c->in_handler = false;
    if (c->closing) return false;
    if (!r->answered) {
        r->keep_alive = keep;
        c->cur = NULL;
        c->pend = r;
        return true;
    }
    km_http_set_phase(c, PH_BUSY);
    if (has_body) skip_body(c, body);
    if (!c->closing && r->ended) km_http_req_finish(c);
    return false;
}

/* The next request's head from the input: true with it pending (c->pend), its body to read;
 * false when the head is incomplete, or was refused or answered. */
static bool take_head(conn *c)
{
    km_http_server *s = c->s;
    km_http_request p;
    int n = km_http_parse_head((const char *)c->in.data, c->in.len, &s->o.lim, &p);
    if (n < 0) {
        fatal(c, p.status, p.message);
        return false;
    }
    if (n == 0) {
        if (c->ph == PH_IDLE) km_http_set_phase(c, PH_HEAD);
        return false;
    }
    km_http_req *r = req_new(c, &p);
    if (!r) {
        km_http_conn_close(c);
        return false;
    }
    consume(c, (size_t)n);
    c->pend = r;
    c->pend_chunked = p.chunked;
    c->body_left = p.content_length;
    if (p.chunked) km_http_chunked_init(&c->dec, &s->o.lim);
    bool has_body = p.chunked || p.content_length;
    const km_http_limits *l = &s->o.lim;
    size_t announced = p.chunked ? l->max_head + l->max_body + 64 : p.content_length;
    if (s->o.on_head && !head_admitted(c, r, announced)) return false;
    if (!has_body) return true;
    if (!budget_allows(c, p.content_length)) {
        refuse_memory(c);
        return false;
    }
    if (km_buf_reserve(&r->body, p.content_length)) {
        km_http_conn_close(c);
        return false;
    }
    km_http_set_phase(c, PH_BODY);
    if (p.expect_continue) {
        km_buf out = {0};
        if (km_buf_printf(&out, "HTTP/1.1 100 Continue\r\n\r\n") || km_http_conn_write(c, &out)) {
            km_buf_free(&out);
            return false;
        }
    }
    return true;
}

/* Moves input into the pending request's body (chunked bodies decoded as they come, never from
 * the start again): true once the body is whole. */
static bool take_body(conn *c)
{
    km_http_req *r = c->pend;
    if (!c->pend_chunked) {
        size_t k = c->body_left < c->in.len ? c->body_left : c->in.len;
        km_buf_append(&r->body, c->in.data, k); /* reserved at the head */
        consume(c, k);
        c->body_left -= k;
        return c->body_left == 0;
    }
    if (!budget_allows(c, growth(&c->dec.body, c->in.len))) {
        refuse_memory(c);
        return false;
    }
    size_t taken;
    int rc = km_http_chunked_feed(&c->dec, (const char *)c->in.data, c->in.len, &taken);
    if (rc < 0) {
        fatal(c, c->dec.status, c->dec.message);
        return false;
    }
    consume(c, taken);
    if (rc == 0) return false;
    km_buf_free(&r->body);
    r->body = c->dec.body;
    memset(&c->dec.body, 0, sizeof c->dec.body);
    c->pend_chunked = false;
    return true;
}

/* Parses and dispatches buffered requests, one at a time. */
static void try_requests(conn *c)
{
    km_http_server *s = c->s;
    while (!c->closing && !c->cur) {
        if (!c->pend && (!c->in.len || !take_head(c))) break;
        if (c->closing || c->cur || !take_body(c)) break;
        km_http_req *r = c->pend;
        c->pend = NULL;
        c->cur = r;
        km_http_set_phase(c, PH_BUSY);
        s->requests++;
        if (s->o.requests) km_counter_inc(s->o.requests);
        c->in_handler = true;
        dispatch(s, r);
        c->in_handler = false;
        if (c->closing) return;
        if (c->cur == r && r->ended) km_http_req_finish(c);
    }
    if (c->closing) return;
    conn_account(c);
    start_reading(c);
}

/* ---------------------------------------------------------------- reading */

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    conn *c = hd->data;
    km_buf *b = c->tls ? &c->raw : &c->in;
    size_t room = c->discarding && !c->tls ? DISCARD_READ : READ_SIZE;
    if (!budget_allows(c, growth(b, room)) || km_buf_reserve(b, room)) {
        *buf = uv_buf_init(NULL, 0);
        return;
    }
    *buf = uv_buf_init((char *)b->data + b->len, (unsigned)(b->cap - b->len));
}

/* The n bytes just read into raw, through TLS: what they decrypt to is appended to in, what
 * the handshake answers is written. Returns the plaintext bytes, UV_EOF once the client ended
 * the session, or UV_EPROTO after a TLS failure (counted; the caller closes). */
static ssize_t tls_in(conn *c, size_t n)
{
    size_t before = c->in.len;
    km_buf out = {0};
    const char *why;
    c->raw.len += n;
    int rc = km_tls_feed(c->tls, c->raw.data, c->raw.len, &c->in, &out, &why);
    c->raw.len = 0;
    if (out.len && rc >= 0)
        km_http_conn_write_raw(c, &out);
    else
        km_buf_free(&out);
    if (rc < 0) {
        c->s->tls_failures++;
        if (c->s->o.tls_failures) km_counter_inc(c->s->o.tls_failures);
        KM_DEBUG("http_tls_failed", "reason=\"%s\"", why ? why : km_strerror(rc));
        return UV_EPROTO;
    }
    if (c->closing) return UV_EPROTO;
    return rc == 1 && c->in.len == before ? UV_EOF : (ssize_t)(c->in.len - before);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = st->data;
    if (nread == UV_ENOBUFS) {
        /* no room under max_buffered (on_alloc): a connection with a response in progress waits
         * for it (reading resumes after it), any other is refused */
        if (c->cur) {
            uv_read_stop(st);
            c->reading = false;
        } else if (c->discarding) {
            km_http_conn_close(c);
        } else {
            refuse_memory(c);
        }
        return;
    }
    if (nread > 0 && c->tls) {
        nread = tls_in(c, (size_t)nread);
        if (nread == UV_EPROTO) {
            km_http_conn_close(c);
            return;
        }
    } else if (nread > 0) {
        c->in.len += (size_t)nread;
    }
    if (nread < 0) {
        /* EOF or an error: a response still being written finishes first (the client may have
         * only shut down its side); anything else closes now */
        if (c->cur && c->cur->ended && c->pending_writes) {
            c->cur->keep_alive = false;
            c->input_done = true;
            uv_read_stop(st);
            c->reading = false;
        } else {
            km_http_conn_close(c);
        }
        return;
    }
    if (nread == 0) return;
    if (c->discarding) {
        discard_input(c);
        if (!c->closing) conn_account(c);
        return;
    }
    const km_http_limits *lim = &c->s->o.lim;
    if (c->cur) {
        /* A response is pending: keep reading (to notice the client leaving) but bound what is
         * buffered of pipelined requests. */
        if (c->in.len > lim->max_head + lim->max_body) {
            uv_read_stop(st);
            c->reading = false;
        }
        conn_account(c);
        return;
    }
    try_requests(c);
}

static void start_reading(conn *c)
{
    if (c->reading || c->closing || c->input_done) return;
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) == 0) c->reading = true;
}

/* A phase ran out of time. Waiting for a request: close. Inside one: 408, then close. Busy: a
 * response being produced (a slow prefill) may take its time; one produced but not read by the
 * client for idle_ms closes. */
static void on_deadline(uv_timer_t *t)
{
    conn *c = t->data;
    if (c->closing) return;
    if (c->ph == PH_BUSY) {
        if (c->cur && !c->cur->ended) return;
        km_http_conn_close(c);
        return;
    }
    if (c->discarding) { /* answered already: the rest of a refused body is not waited for */
        km_http_conn_close(c);
        return;
    }
    c->s->timeouts++;
    if (c->ph == PH_IDLE || (c->ph == PH_HEAD && c->in.len == 0)) {
        km_http_conn_close(c);
        return;
    }
    fatal(c, 408,
          c->ph == PH_HEAD ? "the request head did not arrive in time"
                           : "the request body did not arrive in time");
}

/* The connection that has waited longest without a request in progress, or NULL. */
static conn *oldest_waiting(km_http_server *s, const conn *except)
{
    conn *best = NULL;
    for (conn *c = s->conns; c; c = c->next)
        if (c != except && !c->closing && !c->cur &&
            (!best || c->waiting_since <= best->waiting_since))
            best = c;
    return best;
}

static void on_connection(uv_stream_t *server, int status)
{
    km_http_server *s = server->data;
    if (status < 0) return;
    conn *c = calloc(1, sizeof *c);
    if (!c) return;
    c->s = s;
    uv_tcp_init(s->loop, &c->tcp);
    uv_timer_init(s->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->open_handles = 2;
    s->n_conns++;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0 ||
        (s->tls && !(c->tls = km_tls_new(s->tls)))) {
        km_http_conn_close(c);
        return;
    }
    if (s->n_conns > s->o.max_conns) {
        conn *victim = oldest_waiting(s, c);
        if (!victim) {
            km_http_conn_close(c);
            return;
        }
        s->evictions++;
        km_http_conn_close(victim);
    }
    uv_tcp_nodelay(&c->tcp, 1);
    c->ph = PH_BUSY; /* so that km_http_set_phase stamps waiting_since */
    km_http_set_phase(c, PH_HEAD);
    start_reading(c);
}

/* ---------------------------------------------------------------- server */

/* Connections need descriptors, and a process out of them fails every accept (new clients and
 * /healthz included) before max_conns, whose eviction keeps them served, is ever reached. So
 * the soft limit is raised to the hard one, and max_conns kept a margin below what is left. */
static int conns_fd_cap(int max_conns)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) return max_conns;
    if (rl.rlim_cur < rl.rlim_max) {
        rlim_t want = rl.rlim_max;
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl)) getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > INT_MAX) return max_conns;
    int fds = (int)rl.rlim_cur, cap = fds > 512 ? fds - 256 : fds / 2;
    return max_conns < cap ? max_conns : cap;
}

static void on_listener_closed(uv_handle_t *hd)
{
    km_http_server *s = hd->data;
    s->open_handles--;
    server_release(s);
}

int km_http_server_start(void *loop, const km_http_opts *o, km_http_server **out, km_errbuf *err)
{
    *out = NULL;
    if (!loop || !o || o->port < 0 || o->port > 65535)
        return km_errf(err, KM_EINVAL, "no loop, or a bad port");
    km_http_server *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "out of memory");
    s->loop = loop;
    s->o = *o;
    if (!s->o.lim.max_head) s->o.lim.max_head = 16384;
    if (s->o.lim.max_body > BODY_MAX) s->o.lim.max_body = BODY_MAX;
    if (s->o.max_conns <= 0) s->o.max_conns = 1024;
    s->o.max_conns = conns_fd_cap(s->o.max_conns);
    if (s->o.idle_ms <= 0) s->o.idle_ms = 60000;
    if (s->o.head_ms <= 0) s->o.head_ms = 10000;
    if (s->o.body_ms <= 0) s->o.body_ms = 60000;
    if (!s->o.max_buffered) s->o.max_buffered = BUFFERED_MAX;
    snprintf(s->host, sizeof s->host, "%s", o->host ? o->host : "127.0.0.1");
    s->o.host = s->host;
    if ((o->tls_cert && *o->tls_cert) || (o->tls_key && *o->tls_key)) {
        int trc = km_tls_ctx_new(o->tls_cert, o->tls_key, &s->tls, err);
        if (trc) {
            free(s);
            return trc;
        }
    }
    s->o.tls_cert = s->o.tls_key = NULL; /* read once, here */
    struct sockaddr_storage sa;
    int rc = strchr(s->host, ':') ? uv_ip6_addr(s->host, o->port, (struct sockaddr_in6 *)&sa)
                                  : uv_ip4_addr(s->host, o->port, (struct sockaddr_in *)&sa);
    if (rc) {
        km_errf(err, KM_EINVAL, "%s:%d: not an IP address: %s", s->host, o->port, uv_strerror(rc));
        km_tls_ctx_free(s->tls);
        free(s);
        return KM_EINVAL;
    }
    uv_tcp_init(s->loop, &s->listener);
    s->listener.data = s;
    s->open_handles = 1;
    const char *step = "bind";
    rc = uv_tcp_bind(&s->listener, (struct sockaddr *)&sa, 0);
    if (!rc) {
        step = "listen";
        rc = uv_listen((uv_stream_t *)&s->listener, 256, on_connection);
    }
    if (rc) {
        km_errf(err, KM_EIO, "%s:%d: %s: %s", s->host, o->port, step, uv_strerror(rc));
        s->stopping = true;
        uv_close((uv_handle_t *)&s->listener, on_listener_closed);
        return KM_EIO;
    }
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    uv_tcp_getsockname(&s->listener, (struct sockaddr *)&bound, &blen);
    s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);
    *out = s;
    return 0;
}

int km_http_server_port(const km_http_server *s)
{
    return s ? s->port : -1;
}

uint64_t km_http_server_requests(const km_http_server *s)
{
    return s ? s->requests : 0;
}

uint64_t km_http_server_timeouts(const km_http_server *s)
{
    return s ? s->timeouts : 0;
}

uint64_t km_http_server_evictions(const km_http_server *s)
{
    return s ? s->evictions : 0;
}

size_t km_http_server_buffered(const km_http_server *s)
{
    return s ? s->buffered : 0;
}

uint64_t km_http_server_buffer_refusals(const km_http_server *s)
{
    return s ? s->buffer_refusals : 0;
}

uint64_t km_http_server_tls_failures(const km_http_server *s)
{
    return s ? s->tls_failures : 0;
}

int km_http_server_tls(const km_http_server *s)
{
    return s && s->tls;
}

void km_http_server_stop(km_http_server *s)
{
    if (!s || s->stopping) return;
    s->stopping = true;
    while (s->conns) km_http_conn_close(s->conns);
    uv_close((uv_handle_t *)&s->listener, on_listener_closed);
}
