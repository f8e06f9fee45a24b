/*
 * http.h — HTTP/1.1 for kvmesh: one server and one response parser, both on picohttpparser (the
 * maintained HTTP/1 parser of h2o, exported by Debian's libh2o; docs/dependencies.md).
 *
 *  - The parser (http_parse.c) is pure: bytes in, a parsed request or response out, no I/O, so
 *    each has a fuzz driver (tests/fuzz/fuzz_http_request.c, fuzz_http_response.c).
 *  - The server (http_server.c) runs on a libuv loop the caller owns and routes each request by
 *    a table of exact paths and methods. It does what a parser does not: buffering, keep-alive,
 *    pipelining (answered in order, one at a time), request bodies by Content-Length or chunked,
 *    100-continue, limits, idle timeouts, responses whole or streamed (chunked transfer encoding,
 *    for SSE), and closing every connection on stop. Its users: the admin port of every daemon
 *    (admin_http.c, km_admin_* in svc.h) and the router's OpenAI-compatible front.
 *  - libkvmesh's kvm_http_get reads a response with km_http_parse_response.
 *
 * Contract: functions return 0 or a negative km_err; nothing here exits or aborts on what a peer
 * sent. Everything about one server runs on its loop's thread; a request (km_http_req) belongs to
 * the server and is valid until its response ended or its abort callback ran.
 */
#ifndef KM_HTTP_H
#define KM_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/svc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The reason phrase of an HTTP status ("Not Found"); "Unknown" for codes the servers never send. */
const char *km_http_reason(int status);

/* ---------------------------------------------------------------- parsing (http_parse.c) */

#define KM_HTTP_MAX_HEADERS 64

typedef struct km_http_field {
    const char *name; /* NULL for a continuation line of the previous header */
    size_t name_len;
    const char *value;
    size_t value_len;
} km_http_field;

/* Limits of one request. max_body 0: the request may carry no body at all (a Content-Length
 * other than 0 is 413, any Transfer-Encoding 501), as on the admin port. */
typedef struct km_http_limits {
    size_t max_head; /* bytes of request line + headers; beyond: 431 */
    size_t max_body; /* decoded body bytes; beyond: 413 */
} km_http_limits;

/* A request parsed from the front of a buffer. Pointers point into that buffer (valid while it
 * is); the body is copied (and de-chunked) into `body`, which the caller frees. */
typedef struct km_http_request {
    const char *method, *path; /* path without its query string */
    size_t method_len, path_len;
    int minor_version;
    km_http_field headers[KM_HTTP_MAX_HEADERS];
    size_t n_headers;
    bool keep_alive;      /* HTTP/1.1 unless "Connection: close"; 1.0 only with keep-alive */
    bool expect_continue; /* "Expect: 100-continue" */
    size_t head_len;      /* bytes of the head */
    bool chunked;         /* the body comes chunked (else content_length bytes of it) */
    size_t content_length;
    km_buf body;
    /* on an error: the status to answer (400, 413, 431, 501) and why */
    int status;
    const char *message;
} km_http_request;

/* Parses one request from buf[0, len). Returns the bytes it took (head and body, > 0) when the
 * request is complete; 0 when more bytes are needed (out->head_len is nonzero once the head is
 * complete and a body is awaited: the moment to send 100 Continue); KM_EPROTO when it is
 * malformed or over a limit (out->status and out->message say which; the connection must close).
 * out->body is reset first and freed on every return but a complete request. */
int km_http_parse_request(const char *buf, size_t len, const km_http_limits *lim,
                          km_http_request *out);

/* The head alone: head_len (> 0) once the head is complete, with the body's framing in
 * out->chunked / out->content_length and no body read; 0 when more bytes are needed; KM_EPROTO
 * as above. The server reads bodies itself, after its on_head hook had its say. */
int km_http_parse_head(const char *buf, size_t len, const km_http_limits *lim,
                       km_http_request *out);

/* A chunked body decoded as it arrives: state is kept between feeds, so each byte is decoded
 * once however the body is split (never from the start again). */
typedef struct km_http_chunked {
    union {
        size_t align;
        unsigned char bytes[32];
    } dec;                    /* picohttpparser's decoder state */
    size_t max_body, max_raw; /* decoded and framed bytes allowed */
    size_t raw;               /* framed bytes taken so far */
    km_buf body;              /* decoded so far; the caller takes it once done */
    int status;               /* on a refusal: 400 or 413, and why */
    const char *message;
} km_http_chunked;

void km_http_chunked_init(km_http_chunked *d, const km_http_limits *lim);
/* Takes bytes from buf[0, len): 1 when the body (and its trailer) ended, *taken saying how many
 * bytes were its own (the rest belong to the next request); 0 when all len were taken and more
 * are needed; KM_EPROTO when it is malformed or over a limit (d->status, d->message; d->body
 * freed). */
int km_http_chunked_feed(km_http_chunked *d, const char *buf, size_t len, size_t *taken);
void km_http_chunked_free(km_http_chunked *d);

/* The value of a header of a parsed request (case-insensitive), or NULL; *len gets its length. */
const char *km_http_request_header(const km_http_request *r, const char *name, size_t *len);

/* Parses a whole HTTP/1.x response, buf[0, len) being everything read until the server closed:
 * *status gets the status code, body the body by Content-Length, chunked transfer encoding, or
 * up to the end. KM_EPROTO (with a reason in err) when it is malformed or cut short. */
int km_http_parse_response(const char *buf, size_t len, int *status, km_buf *body, km_errbuf *err);

/* ---------------------------------------------------------------- server (http_server.c) */

typedef struct km_http_server km_http_server;
typedef struct km_http_req km_http_req;
typedef void (*km_http_fn)(km_http_req *r, void *user);

/* Methods a route takes; GET admits HEAD (answered without the body). 0: any method. */
enum { KM_HTTP_GET = 1, KM_HTTP_POST = 2 };

/* One row of a route table: an exact path (the query string is not part of it); a path ending in
 * '/' for every path below it ("/v1/models/": "/v1/models/x", not "/v1/models/" itself); or NULL
 * for every path no earlier row took. */
typedef struct km_http_route {
    const char *path;
    unsigned methods;
    km_http_fn fn;
} km_http_route;

/* The body of an error the server answers itself (400, 404, 405, 413, 431, 501, ...): fills out
 * and returns its content type. Default: text/plain, "message\n". */
typedef const char *(*km_http_error_fn)(int status, const char *message, km_buf *out);

/* Called once a request's head has arrived, before any of its body is read: method, path and
 * headers are readable, the body is empty. Answering r here (a whole response, e.g. 401 for a
 * missing key) refuses the request: its body is never buffered and the connection closes after
 * the answer, so work and memory before authentication stay those of one head. (What arrives of
 * the body is read into a small buffer and dropped, a second after each read and ten in all at
 * most once answered, so that a client still sending it reads its answer, not a reset.) */
typedef void (*km_http_head_fn)(km_http_req *r, void *user);

typedef struct km_http_opts {
    const char *host; /* default "127.0.0.1"; an IPv4 or IPv6 literal */
    int port;         /* 0: an ephemeral port (km_http_server_port) */
    const km_http_route *routes;
    size_t n_routes; /* no match: 404; a match without the method: 405 with Allow */
    void *user;      /* passed to every route's fn */
    km_http_error_fn error_body;
    km_http_limits lim; /* default max_head 16 KiB; max_body 0 = no bodies */
    /* Open connections. At the limit a new connection takes the place of the one that has waited
     * longest without a request being answered (idle, or still sending its head or body); only
     * when every connection has a request in progress is the new one closed at once. A few
     * clients holding connections open therefore cannot lock others out. Default 1024; the
     * server raises the process's descriptor limit to its hard limit and keeps max_conns 256
     * below it (half of it under 512), so descriptors never run out first. */
    int max_conns;
    int idle_ms; /* default 60000: a connection waiting for its next request closes after this */
    /* Deadlines for a request to arrive, counted from its first byte (the head; on a new
     * connection from the accept) or from the end of its head (the body), never extended by
     * later bytes: a client sending a byte now and then (slowloris) gets 408 and is closed.
     * Defaults 10000 and 60000. */
    int head_ms, body_ms;
    km_series *requests;     /* a counter incremented per request parsed, or NULL */
    km_http_head_fn on_head; /* or NULL: every head is read on to its body */
    /* Request bytes held across all connections (input buffers, bodies being read, TLS
     * records). A read that would take more is answered 503 and its connection closed (a
     * connection with a response in progress only stops reading). Default 256 MiB. */
    size_t max_buffered;
    km_series *buffer_refusals; /* a counter of km_http_server_buffer_refusals, or NULL */
    /* HTTPS: a PEM certificate chain and its key (TLS 1.2 or later, http_tls.h). Both or
     * neither; read when the server starts, which fails with the file and the reason when they
     * cannot be used. A client that does not complete the handshake within head_ms is closed. */
    const char *tls_cert, *tls_key;
    km_series *tls_failures; /* a counter of km_http_server_tls_failures, or NULL */
} km_http_opts;

/* Binds and listens on loop (a uv_loop_t *); errors come back here ("HOST:PORT: bind: ..."). */
int km_http_server_start(void *loop, const km_http_opts *o, km_http_server **out, km_errbuf *err);
int km_http_server_port(const km_http_server *s);
uint64_t km_http_server_requests(const km_http_server *s); /* requests parsed */
/* Requests that missed their head or body deadline; connections evicted at max_conns. */
uint64_t km_http_server_timeouts(const km_http_server *s);
uint64_t km_http_server_evictions(const km_http_server *s);
/* Request bytes held now (opts.max_buffered), and connections refused for going over it. */
size_t km_http_server_buffered(const km_http_server *s);
uint64_t km_http_server_buffer_refusals(const km_http_server *s);
/* Connections closed for a failed TLS handshake or record; 1 when the server speaks TLS. */
uint64_t km_http_server_tls_failures(const km_http_server *s);
int km_http_server_tls(const km_http_server *s);
/* Closes the listener and every connection (their requests' abort callbacks run); s is freed
 * once the loop has run the close callbacks. */
void km_http_server_stop(km_http_server *s);

const char *km_http_method(const km_http_req *r);
const char *km_http_path(const km_http_req *r); /* without the query string */
const char *km_http_body(const km_http_req *r, size_t *len);
/* The value of a header (case-insensitive name), NUL-terminated, or NULL. */
const char *km_http_header(const km_http_req *r, const char *name);

/* Header lines ("Name: value\r\n") that every response to r carries besides its own (CORS
 * headers set at the head, whichever handler answers). Appended to earlier ones. */
int km_http_add_headers(km_http_req *r, const char *lines);
/* A whole response; ends the request. extra_headers: "Name: value\r\n" lines or NULL. */
int km_http_respond(km_http_req *r, int status, const char *ctype, const char *extra_headers,
                    const void *body, size_t len);
/* An error in the server's error shape (opts.error_body); ends the request. */
int km_http_respond_error(km_http_req *r, int status, const char *message);
/* A streamed response (chunked); write any number of times, then end. */
int km_http_stream_begin(km_http_req *r, int status, const char *ctype);
int km_http_stream_write(km_http_req *r, const void *data, size_t len);
int km_http_stream_end(km_http_req *r);
/* Called (once) when the connection goes away before the response ended; r is invalid after. */
void km_http_on_abort(km_http_req *r, void (*fn)(km_http_req *r, void *user), void *user);

#ifdef __cplusplus
}
#endif
#endif /* KM_HTTP_H */
