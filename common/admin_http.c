/*
 * admin_http.c — the admin HTTP server every daemon runs: GET /metrics (the registry in
 * Prometheus text), /healthz (200 while this loop runs), /readyz (200 or 503 from a callback),
 * 404 for anything else, 405 for other methods.
 *
 * Why it is built this way:
 *  - It is the common HTTP server (http_server.c) with a three-row route table, run on a libuv
 *    loop of its own on its own thread (km_admin_start / km_admin_stop), so a daemon's main loop,
 *    however busy or stuck, neither disturbs nor is disturbed by scrapes; /healthz answering
 *    means this thread and the process are alive.
 *  - Limits keep a misbehaving client cheap: 8 KiB of request head, 64 connections, 10 s idle,
 *    no request bodies; every violation gets a status code and a closed connection.
 */
#include "common/http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

struct km_admin {
    uv_loop_t loop;
    uv_async_t stop;
    uv_thread_t thread;
    km_http_server *http;
    km_admin_opts opts;
    char host[64];
};

static void on_healthz(km_http_req *r, void *user)
{
    km_http_respond(r, 200, "text/plain; charset=utf-8", NULL, "ok\n", 3);
}

static void on_readyz(km_http_req *r, void *user)
{
    km_admin *a = user;
    bool ready = !a->opts.ready || a->opts.ready(a->opts.user);
    const char *text = ready ? "ready\n" : "not ready\n";
    km_http_respond(r, ready ? 200 : 503, "text/plain; charset=utf-8", NULL, text, strlen(text));
}

static void on_metrics(km_http_req *r, void *user)
{
    km_admin *a = user;
    km_buf body = {0};
    if ((a->opts.metrics && km_metrics_render(a->opts.metrics, &body) != 0) ||
        km_metrics_render_process(&body) != 0) {
        km_buf_free(&body);
        km_http_respond_error(r, 500, "out of memory");
        return;
    }
    km_http_respond(r, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, body.data, body.len);
    km_buf_free(&body);
}

static const km_http_route admin_routes[] = {
    {"/metrics", KM_HTTP_GET, on_metrics},
    {"/healthz", KM_HTTP_GET, on_healthz},
    {"/readyz", KM_HTTP_GET, on_readyz},
};

static void on_stop(uv_async_t *h)
{
    km_admin *a = h->data;
    km_http_server_stop(a->http);
    uv_close((uv_handle_t *)&a->stop, NULL);
}

static void run_loop(void *arg)
{
    km_admin *a = arg;
    uv_run(&a->loop, UV_RUN_DEFAULT);
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
    km_http_opts ho = {.host = a->host,
                       .port = o->port,
                       .routes = admin_routes,
                       .n_routes = sizeof admin_routes / sizeof *admin_routes,
                       .user = a,
                       .lim = {.max_head = 8192, .max_body = 0},
                       .max_conns = 64,
                       .idle_ms = 10000};
    km_errbuf herr = {{0}};
    rc = km_http_server_start(&a->loop, &ho, &a->http, &herr);
    if (!rc) {
        rc = uv_async_init(&a->loop, &a->stop, on_stop);
        a->stop.data = a;
        if (rc < 0) {
            km_http_server_stop(a->http);
            snprintf(herr.msg, sizeof herr.msg, "async init: %s", uv_strerror(rc));
            rc = KM_EIO;
        } else if ((rc = uv_thread_create(&a->thread, run_loop, a)) < 0) {
            km_http_server_stop(a->http);
            uv_close((uv_handle_t *)&a->stop, NULL);
            snprintf(herr.msg, sizeof herr.msg, "thread: %s", uv_strerror(rc));
            rc = KM_EIO;
        }
    }
    if (rc) {
        km_errf(err, rc, "admin http %s", herr.msg);
        uv_run(&a->loop, UV_RUN_DEFAULT); /* the close callbacks of what was opened */
        uv_loop_close(&a->loop);
        free(a);
        return rc;
    }
    *out = a;
    return 0;
}

int km_admin_port(const km_admin *a)
{
    return a ? km_http_server_port(a->http) : 0;
}

void km_admin_stop(km_admin *a)
{
    if (!a) return;
    uv_async_send(&a->stop);
    uv_thread_join(&a->thread);
    uv_loop_close(&a->loop);
    free(a);
}
