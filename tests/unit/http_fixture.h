/*
 * http_fixture.h — what the HTTP server tests (test_router_http.c, test_http_guard.c) share: a
 * km_http_server on a loop thread of its own, with a handler that echoes, streams and reports,
 * plain sockets to talk to it, and self-signed certificates with an OpenSSL client for HTTPS.
 */
#ifndef KM_TEST_HTTP_FIXTURE_H
#define KM_TEST_HTTP_FIXTURE_H

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "common/http.h"
#include "router/openai.h"

typedef struct server {
    uv_loop_t loop;
    uv_async_t stop;
    uv_timer_t stream_timer;
    km_http_server *h;
    int port;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool ready;
    km_http_req *streaming;
    int chunks_left;
    int aborts;
    int head_ms, body_ms, max_conns; /* 0: the server's defaults */
    const char *tls_cert, *tls_key;  /* HTTPS when set */
    km_http_head_fn on_head;         /* the server's hook, or NULL */
    size_t max_body, max_buffered;   /* 0: 1024 and the server's default */
    uint64_t timeouts, evictions;    /* read after stop */
    uint64_t tls_failures, buffer_refusals;
} server;

static inline void on_stream_tick(uv_timer_t *t)
{
    server *s = t->data;
    if (!s->streaming) return;
    char line[32];
    int n = snprintf(line, sizeof line, "data: %d\n\n", s->chunks_left);
    km_http_stream_write(s->streaming, line, (size_t)n);
    if (--s->chunks_left == 0) {
        km_http_stream_end(s->streaming);
        s->streaming = NULL;
        uv_timer_stop(t);
    }
}

static inline void on_abort(km_http_req *r, void *user)
{
    server *s = user;
    s->aborts++;
    s->streaming = NULL;
    uv_timer_stop(&s->stream_timer);
}

static inline void handler(km_http_req *r, void *user)
{
    server *s = user;
    const char *path = km_http_path(r);
    if (!strcmp(path, "/echo")) {
        size_t n;
        const char *b = km_http_body(r, &n);
        km_http_respond(r, 200, "text/plain", NULL, b, n);
    } else if (!strcmp(path, "/stream") || !strcmp(path, "/forever")) {
        km_http_stream_begin(r, 200, "text/event-stream");
        s->streaming = r;
        s->chunks_left = !strcmp(path, "/stream") ? 3 : 1000000;
        km_http_on_abort(r, on_abort, s);
        uv_timer_start(&s->stream_timer, on_stream_tick, 5, 5);
    } else if (!strcmp(path, "/header")) {
        const char *v = km_http_header(r, "x-test");
        km_http_respond(r, 200, "text/plain", NULL, v ? v : "none", v ? strlen(v) : 4);
    } else if (!strcmp(path, "/buffered")) {
        char n[32];
        snprintf(n, sizeof n, "buffered=%zu;", km_http_server_buffered(s->h));
        km_http_respond(r, 200, "text/plain", NULL, n, strlen(n));
    } else {
        km_http_respond(r, 404, "text/plain", NULL, "nope", 4);
    }
}

static inline void on_stop(uv_async_t *a)
{
    server *s = a->data;
    s->timeouts = km_http_server_timeouts(s->h);
    s->evictions = km_http_server_evictions(s->h);
    s->tls_failures = km_http_server_tls_failures(s->h);
    s->buffer_refusals = km_http_server_buffer_refusals(s->h);
    km_http_server_stop(s->h);
    uv_close((uv_handle_t *)&s->stop, NULL);
    uv_close((uv_handle_t *)&s->stream_timer, NULL);
}

static inline void *serve(void *arg)
{
    server *s = arg;
    uv_loop_init(&s->loop);
    uv_async_init(&s->loop, &s->stop, on_stop);
    s->stop.data = s;
    uv_timer_init(&s->loop, &s->stream_timer);
    s->stream_timer.data = s;
    /* the router's shape: a body limit, OpenAI error objects for what the server refuses */
    static const km_http_route every_path[] = {{NULL, 0, handler}};
    km_http_opts o = {.port = 0,
                      .routes = every_path,
                      .n_routes = 1,
                      .user = s,
                      .error_body = rt_oai_http_error,
                      .lim = {.max_head = 16384, .max_body = s->max_body ? s->max_body : 1024},
                      .on_head = s->on_head,
                      .max_buffered = s->max_buffered,
                      .head_ms = s->head_ms,
                      .body_ms = s->body_ms,
                      .max_conns = s->max_conns,
                      .tls_cert = s->tls_cert,
                      .tls_key = s->tls_key};
    km_errbuf err;
    cr_assert_eq(km_http_server_start(&s->loop, &o, &s->h, &err), 0, "%s", err.msg);
    pthread_mutex_lock(&s->mu);
    s->port = km_http_server_port(s->h);
    s->ready = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    return NULL;
}

/* Starts a server with the options set in s (calloc'd by the caller); returns s. */
static inline server *start_server(server *s)
{
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->th, NULL, serve, s);
    pthread_mutex_lock(&s->mu);
    while (!s->ready) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return s;
}

static inline server *start_tls(int head_ms, int body_ms, int max_conns, const char *cert,
                                const char *key)
{
    server *s = calloc(1, sizeof *s);
    s->head_ms = head_ms;
    s->body_ms = body_ms;
    s->max_conns = max_conns;
    s->tls_cert = cert;
    s->tls_key = key;
    return start_server(s);
}

static inline server *start_with(int head_ms, int body_ms, int max_conns)
{
    return start_tls(head_ms, body_ms, max_conns, NULL, NULL);
}

static inline server *start(void)
{
    return start_with(0, 0, 0);
}

/* Stops the server; s stays readable (its counters) until freed. */
static inline void stop_only(server *s)
{
    uv_async_send(&s->stop);
    pthread_join(s->th, NULL);
}

static inline void stop(server *s)
{
    stop_only(s);
    free(s);
}

static inline int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static inline void say(int fd, const char *s)
{
    cr_assert_eq(send(fd, s, strlen(s), MSG_NOSIGNAL), (ssize_t)strlen(s));
}

/* Reads until `until` appears (or the peer closes / 3 s pass). */
static inline char *hear(int fd, const char *until)
{
    static char buf[65536];
    size_t n = 0;
    buf[0] = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 3000) <= 0) break;
        ssize_t k = recv(fd, buf + n, sizeof buf - 1 - n, 0);
        if (k <= 0) break;
        n += (size_t)k;
        buf[n] = 0;
        if (until && strstr(buf, until)) break;
    }
    return buf;
}

/* A self-signed P-256 (or RSA 2048) certificate for 127.0.0.1 and its key, in PEM files under
 * dir. */
static inline void make_cert_key(const char *dir, char *cert, char *key, size_t cap, bool rsa)
{
    snprintf(cert, cap, "%s/cert.pem", dir);
    snprintf(key, cap, "%s/key.pem", dir);
    EVP_PKEY *k = rsa ? EVP_RSA_gen(2048) : EVP_EC_gen("P-256");
    X509 *x = X509_new();
    cr_assert(k && x);
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
    X509_gmtime_adj(X509_getm_notBefore(x), -60);
    X509_gmtime_adj(X509_getm_notAfter(x), 86400);
    X509_set_pubkey(x, k);
    X509_NAME *nm = X509_get_subject_name(x);
    X509_NAME_add_entry_by_txt(nm, "CN", MBSTRING_ASC, (const unsigned char *)"127.0.0.1", -1, -1,
                               0);
    X509_set_issuer_name(x, nm);
    cr_assert(X509_sign(x, k, EVP_sha256()) > 0);
    FILE *f = fopen(cert, "w"), *g = fopen(key, "w");
    cr_assert(f && g);
    cr_assert(PEM_write_X509(f, x) && PEM_write_PrivateKey(g, k, NULL, NULL, 0, NULL, NULL));
    fclose(f);
    fclose(g);
    X509_free(x);
    EVP_PKEY_free(k);
}

static inline void make_cert(const char *dir, char *cert, char *key, size_t cap)
{
    make_cert_key(dir, cert, key, cap, false);
}

typedef struct tls_fx {
    char dir[64], cert[128], key[128];
    server *s;
} tls_fx;

static inline void tls_up(tls_fx *f, int head_ms)
{
    snprintf(f->dir, sizeof f->dir, "/tmp/kvmesh-tls-XXXXXX");
    cr_assert(mkdtemp(f->dir));
    make_cert(f->dir, f->cert, f->key, sizeof f->cert);
    f->s = start_tls(head_ms, 0, 0, f->cert, f->key);
}

static inline void tls_down(tls_fx *f)
{
    stop_only(f->s);
    unlink(f->cert);
    unlink(f->key);
    rmdir(f->dir);
}

/* An OpenSSL client that trusts only the test's certificate and checks it. */
static inline SSL *tls_dial(const tls_fx *f, SSL_CTX **ctx_out)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    cr_assert_eq(SSL_CTX_load_verify_locations(ctx, f->cert, NULL), 1);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    SSL *ssl = SSL_new(ctx);
    SSL_set_fd(ssl, dial(f->s->port));
    cr_assert_eq(SSL_connect(ssl), 1, "handshake: %s",
                 ERR_reason_error_string(ERR_peek_last_error()));
    cr_assert_eq(SSL_get_verify_result(ssl), X509_V_OK);
    *ctx_out = ctx;
    return ssl;
}

static inline void tls_say(SSL *ssl, const char *s)
{
    cr_assert_eq(SSL_write(ssl, s, (int)strlen(s)), (int)strlen(s));
}

/* Reads until `until` appears (or the session ends). */
static inline char *tls_hear(SSL *ssl, const char *until)
{
    static char buf[65536];
    size_t n = 0;
    buf[0] = 0;
    while (n < sizeof buf - 1) {
        int k = SSL_read(ssl, buf + n, (int)(sizeof buf - 1 - n));
        if (k <= 0) break;
        n += (size_t)k;
        buf[n] = 0;
        if (until && strstr(buf, until)) break;
    }
    return buf;
}

static inline void tls_hangup(SSL *ssl, SSL_CTX *ctx)
{
    int fd = SSL_get_fd(ssl);
    SSL_shutdown(ssl);
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    close(fd);
}

#endif
