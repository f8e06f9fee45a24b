/*
 * http_respond.c — the HTTP server's responses (common/http.h, "server"): whole or streamed
 * (chunked), errors in the server's error shape, and the writes under them, bounded per
 * connection so a client that does not read is dropped rather than buffered for.
 *
 * Why it is its own file: answering is the handlers' side of the server, reading and parsing
 * (http_server.c) the clients'; both share the connection (http_conn.h). A write restarts the
 * stall clock of a busy connection, and the last one of an ended response starts the next
 * request (km_http_req_finish).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/http_conn.h"

#define WRITE_MAX (16u << 20) /* bytes queued to a slow client before it is dropped */

typedef struct write_req {
    uv_write_t req;
    conn *c;
    km_buf out;
} write_req;

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
        km_http_conn_close(c);
        return;
    }
    if (c->ph == PH_BUSY)
        km_http_set_phase(c, PH_BUSY); /* the client reads: the stall clock restarts */
    km_http_req_finish(c);
}

/* Takes ownership of out's bytes, which go to the socket as they are. */
int km_http_conn_write_raw(conn *c, km_buf *out)
{
    if (c->closing) {
        km_buf_free(out);
        return KM_EIO;
    }
    if (c->queued_bytes + out->len > WRITE_MAX) {
        km_buf_free(out);
        km_http_conn_close(c); /* a client that does not read its stream */
        return KM_EIO;
    }
    write_req *w = calloc(1, sizeof *w);
    if (!w) {
        km_buf_free(out);
        km_http_conn_close(c);
        return KM_ENOMEM;
    }
    w->c = c;
    w->out = *out;
    memset(out, 0, sizeof *out);
    uv_buf_t b = uv_buf_init((char *)w->out.data, (unsigned)w->out.len);
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_written) < 0) {
        km_buf_free(&w->out);
        free(w);
        km_http_conn_close(c);
        return KM_EIO;
    }
    c->pending_writes++;
    c->queued_bytes += w->out.len;
    if (c->ph == PH_BUSY) km_http_set_phase(c, PH_BUSY);
    return 0;
}

/* Takes ownership of out's bytes: plaintext, sealed first on a TLS connection. */
int km_http_conn_write(conn *c, km_buf *out)
{
    if (!c->tls || c->closing) return km_http_conn_write_raw(c, out);
    km_buf sealed = {0};
    int rc = km_tls_seal(c->tls, out->data, out->len, &sealed);
    km_buf_free(out);
    if (rc) {
        km_buf_free(&sealed);
        km_http_conn_close(c);
        return KM_EIO;
    }
    return km_http_conn_write_raw(c, &sealed);
}

static bool req_usable(km_http_req *r)
{
    return r && r->c && !r->c->closing && r->c->cur == r && !r->ended;
}

int km_http_add_headers(km_http_req *r, const char *lines)
{
    if (!r || !lines) return KM_EINVAL;
    size_t old = r->extra ? strlen(r->extra) : 0, n = strlen(lines);
    char *e = realloc(r->extra, old + n + 1);
    if (!e) return KM_ENOMEM;
    memcpy(e + old, lines, n + 1);
    r->extra = e;
    return 0;
}

int km_http_respond(km_http_req *r, int status, const char *ctype, const char *extra_headers,
                    const void *body, size_t len)
{
    if (!req_usable(r) || r->answered) return KM_EINVAL;
    conn *c = r->c;
    km_buf out = {0};
    int rc = km_buf_printf(&out,
                           "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s%s"
                           "Connection: %s\r\n\r\n",
                           status, km_http_reason(status), ctype ? ctype : "text/plain", len,
                           extra_headers ? extra_headers : "", r->extra ? r->extra : "",
                           r->keep_alive ? "keep-alive" : "close");
    if (!rc && !r->head_only && len) rc = km_buf_append(&out, body, len);
    r->answered = r->ended = true;
    if (rc) {
        km_buf_free(&out);
        km_http_conn_close(c);
        return rc;
    }
    rc = km_http_conn_write(c, &out);
    if (!rc && !c->in_handler) km_http_req_finish(c);
    return rc;
}

static const char *text_error(int status, const char *message, km_buf *out)
{
    km_buf_printf(out, "%s\n", message);
    return "text/plain; charset=utf-8";
}

int km_http_respond_error_with(km_http_req *r, int status, const char *extra_headers,
                               const char *message)
{
    km_http_server *s = r->c->s;
    km_buf b = {0};
    const char *ctype = (s->o.error_body ? s->o.error_body : text_error)(status, message, &b);
    int rc = km_http_respond(r, status, ctype, extra_headers, b.data, b.len);
    km_buf_free(&b);
    return rc;
}

int km_http_respond_error(km_http_req *r, int status, const char *message)
{
    if (!req_usable(r)) return KM_EINVAL;
    return km_http_respond_error_with(r, status, NULL, message);
}

int km_http_stream_begin(km_http_req *r, int status, const char *ctype)
{
    if (!req_usable(r) || r->answered) return KM_EINVAL;
    km_buf out = {0};
    int rc = km_buf_printf(&out,
                           "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n"
                           "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n%s"
                           "Connection: %s\r\n\r\n",
                           status, km_http_reason(status), ctype ? ctype : "text/event-stream",
                           r->extra ? r->extra : "", r->keep_alive ? "keep-alive" : "close");
    r->answered = r->streaming = true;
    if (rc) {
        km_buf_free(&out);
        return rc;
    }
    return km_http_conn_write(r->c, &out);
}

int km_http_stream_write(km_http_req *r, const void *data, size_t len)
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
    return km_http_conn_write(r->c, &out);
}

int km_http_stream_end(km_http_req *r)
{
    if (!req_usable(r) || !r->streaming) return KM_EINVAL;
    conn *c = r->c;
    r->ended = true;
    int rc = 0;
    if (!r->head_only) {
        km_buf out = {0};
        rc = km_buf_append(&out, "0\r\n\r\n", 5);
        rc = rc ? rc : km_http_conn_write(c, &out);
    }
    if (!rc && !c->closing && !c->in_handler) km_http_req_finish(c);
    return rc;
}

void km_http_on_abort(km_http_req *r, void (*fn)(km_http_req *r, void *user), void *user)
{
    if (!r) return;
    r->on_abort = fn;
    r->abort_user = user;
}
