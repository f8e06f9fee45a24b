/*
 * http_conn.h — private to the HTTP server (http_server.c, http_respond.c): a connection, a
 * request and the server as both files see them, and what one calls in the other. Not part of
 * common/http.h: the structs stay opaque to the server's users.
 */
#ifndef KM_HTTP_CONN_H
#define KM_HTTP_CONN_H

#include <uv.h>

#include "common/http.h"
#include "common/http_tls.h"

typedef struct conn conn;

/* What a connection waits for; each phase has its own deadline (km_http_opts). */
typedef enum phase {
    PH_IDLE, /* the first byte of the next request (idle_ms) */
    PH_HEAD, /* the rest of a request's head (head_ms from its first byte) */
    PH_BODY, /* the rest of its body (body_ms from the end of the head) */
    PH_BUSY, /* a request in progress: the handler, then the response's writes */
} phase;

struct km_http_req {
    conn *c;
    char method[16];
    char *path;
    km_buf body;
    char **hname, **hvalue;
    int n_headers;
    bool keep_alive, head_only;
    bool answered, streaming, ended;
    void (*on_abort)(km_http_req *r, void *user);
    void *abort_user;
    char *extra; /* header lines every response to it carries (km_http_add_headers) */
};

struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    km_http_server *s;
    conn *prev, *next;
    km_buf in;  /* plaintext: what the parser reads */
    km_buf raw; /* TLS only: ciphertext just read */
    km_tls *tls;
    km_http_req *cur;
    km_http_req *pend;   /* its head read (and admitted by on_head), its body still arriving */
    km_http_chunked dec; /* pend's body when chunked */
    size_t body_left;    /* pend's Content-Length bytes still to come */
    bool pend_chunked;
    size_t held; /* bytes of this connection counted in the server's buffered */
    int open_handles, pending_writes;
    size_t queued_bytes;
    phase ph;
    uint64_t waiting_since; /* loop time the connection last had no request in progress */
    bool closing, reading, in_handler;
    bool input_done; /* reads nothing more: its last request was refused */
    bool discarding; /* reads a refused request's body only to drop it */
    size_t discard_left;
    uint64_t linger_until; /* loop time: once answered, the most it waits for that body */
};

struct km_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    km_http_opts o;
    char host[64];
    int port;
    conn *conns;
    int n_conns;
    int open_handles;
    bool stopping;
    km_tls_ctx *tls;
    size_t buffered; /* request bytes held by every connection (opts.max_buffered) */
    uint64_t requests, timeouts, evictions, tls_failures, buffer_refusals;
};

/* Enters a phase and starts its deadline (a phase's bytes never move it). */
void km_http_set_phase(conn *c, phase ph);
/* Closes c: its current request's abort callback runs, its handles close, it is freed after. */
void km_http_conn_close(conn *c);
/* The response ended and every byte of it was handed to the kernel: the next request. */
void km_http_req_finish(conn *c);
/* Take ownership of out's bytes: as they are, or plaintext (sealed first on TLS). */
int km_http_conn_write_raw(conn *c, km_buf *out);
int km_http_conn_write(conn *c, km_buf *out);
/* An error in the server's error shape (opts.error_body), with extra headers or NULL. */
int km_http_respond_error_with(km_http_req *r, int status, const char *extra_headers,
                               const char *message);

#endif
