/*
 * http.h — the HTTP/1.1 server of the router's front, private to router/ (http.c).
 */
#ifndef RT_HTTP_H
#define RT_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/svc.h"

/* ---------------------------------------------------------------- HTTP server (http.c)
 * kvmesh's one HTTP server (common/http.h) under the router's names: HTTP/1.1 on a libuv loop
 * with picohttpparser (from libh2o) as the parser: keep-alive, pipelining (answered in order),
 * request bodies by Content-Length or chunked, responses either whole or streamed with chunked
 * transfer encoding (SSE). Limits: head 16 KiB, body max_body, max_conns connections, idle
 * timeout. Errors the server answers itself are OpenAI error objects. */

typedef struct rt_http rt_http;
typedef struct km_http_req rt_http_req; /* common/http.h's request */

typedef struct rt_http_opts {
    const char *host; /* default "127.0.0.1" */
    int port;         /* 0: ephemeral */
    size_t max_body;  /* default 4 MiB */
    int max_conns;    /* default 1024 */
    int idle_ms;      /* default 60000 */
    /* Called once per request; the handler answers now or later (rt_http_respond or the stream
     * calls). */
    void (*handler)(rt_http_req *r, void *user);
    void *user;
} rt_http_opts;

/* loop is a uv_loop_t *. */
int rt_http_start(void *loop, const rt_http_opts *o, rt_http **out, km_errbuf *err);
int rt_http_port(const rt_http *h);
/* Closes the listener and every connection (their requests' abort callbacks run); frees h once
 * the loop has run the close callbacks. */
void rt_http_stop(rt_http *h);
uint64_t rt_http_requests(const rt_http *h); /* requests parsed */

const char *rt_http_method(const rt_http_req *r);
const char *rt_http_path(const rt_http_req *r); /* without the query string */
const char *rt_http_body(const rt_http_req *r, size_t *len);
/* The value of a header (case-insensitive name), NUL-terminated, or NULL. */
const char *rt_http_header(const rt_http_req *r, const char *name);
/* A whole response; ends the request. */
int rt_http_respond(rt_http_req *r, int status, const char *ctype, const void *body, size_t len);
/* extra_headers: "Name: value\r\n" lines or NULL. */
int rt_http_respond_h(rt_http_req *r, int status, const char *ctype, const char *extra_headers,
                      const void *body, size_t len);
/* A streamed response (chunked); write any number of times, then end. */
int rt_http_stream_begin(rt_http_req *r, int status, const char *ctype);
int rt_http_stream_write(rt_http_req *r, const void *data, size_t len);
int rt_http_stream_end(rt_http_req *r);
/* Called (once) when the connection goes away before the response ended; r is invalid after. */
void rt_http_on_abort(rt_http_req *r, void (*fn)(rt_http_req *r, void *user), void *user);

#endif /* RT_HTTP_H */
