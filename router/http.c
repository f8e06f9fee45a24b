/*
 * http.c — the HTTP server of the router's OpenAI-compatible API (router.h, "HTTP server"): the
 * one HTTP server of kvmesh (common/http.h) with the router's limits and OpenAI's error shape, so
 * that what the server refuses by itself (a malformed request, a body over the limit) reads like
 * any other API error to an OpenAI client.
 *
 * The rt_http_* calls are the common server's under the router's names; every request goes to the
 * one handler of rt_http_opts (a catch-all row of the route table).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/http.h"
#include "router/http.h"
#include "router/openai.h"

struct rt_http {
    km_http_server *s;
    km_http_route route; /* the catch-all row: every path to the handler */
};

/* OpenAI's error object: {"error": {"message", "type", "param", "code"}}. */
static const char *oai_error(int status, const char *message, km_buf *out)
{
    rt_oai_err e = {.status = status,
                    .type = status >= 500 ? "server_error" : "invalid_request_error"};
    snprintf(e.message, sizeof e.message, "%s", message);
    rt_oai_error_json(out, &e);
    return "application/json";
}

int rt_http_start(void *loop, const rt_http_opts *o, rt_http **out, km_errbuf *err)
{
    *out = NULL;
    if (!loop || !o || !o->handler) return km_errf(err, KM_EINVAL, "http: no loop or handler");
    rt_http *h = calloc(1, sizeof *h);
    if (!h) return km_errf(err, KM_ENOMEM, "http: out of memory");
    h->route = (km_http_route){NULL, 0, o->handler};
    km_http_opts ho = {.host = o->host,
                       .port = o->port,
                       .routes = &h->route,
                       .n_routes = 1,
                       .user = o->user,
                       .error_body = oai_error,
                       .lim = {.max_head = 16384, .max_body = o->max_body ? o->max_body : 4u << 20},
                       .max_conns = o->max_conns,
                       .idle_ms = o->idle_ms};
    km_errbuf herr = {{0}};
    int rc = km_http_server_start(loop, &ho, &h->s, &herr);
    if (rc) {
        free(h);
        return km_errf(err, rc, "http: cannot listen on %s", herr.msg);
    }
    *out = h;
    return 0;
}

int rt_http_port(const rt_http *h)
{
    return h ? km_http_server_port(h->s) : -1;
}

uint64_t rt_http_requests(const rt_http *h)
{
    return h ? km_http_server_requests(h->s) : 0;
}

void rt_http_stop(rt_http *h)
{
    if (!h) return;
    km_http_server_stop(h->s); /* no request is dispatched after this: the route may go */
    free(h);
}

const char *rt_http_method(const rt_http_req *r)
{
    return km_http_method(r);
}

const char *rt_http_path(const rt_http_req *r)
{
    return km_http_path(r);
}

const char *rt_http_body(const rt_http_req *r, size_t *len)
{
    return km_http_body(r, len);
}

const char *rt_http_header(const rt_http_req *r, const char *name)
{
    return km_http_header(r, name);
}

int rt_http_respond(rt_http_req *r, int status, const char *ctype, const void *body, size_t len)
{
    return km_http_respond(r, status, ctype, NULL, body, len);
}

int rt_http_respond_h(rt_http_req *r, int status, const char *ctype, const char *extra_headers,
                      const void *body, size_t len)
{
    return km_http_respond(r, status, ctype, extra_headers, body, len);
}

int rt_http_stream_begin(rt_http_req *r, int status, const char *ctype)
{
    return km_http_stream_begin(r, status, ctype);
}

int rt_http_stream_write(rt_http_req *r, const void *data, size_t len)
{
    return km_http_stream_write(r, data, len);
}

int rt_http_stream_end(rt_http_req *r)
{
    return km_http_stream_end(r);
}

void rt_http_on_abort(rt_http_req *r, void (*fn)(rt_http_req *r, void *user), void *user)
{
    km_http_on_abort(r, fn, user);
}
