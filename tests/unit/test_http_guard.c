/*
 * test_http_guard.c — what the HTTP server does before it knows who is asking (issue 41, items 5
 * and 7): a head its on_head hook refuses is answered before any of its body is read, whatever
 * body it announces (Content-Length or chunked), so keyless clients cannot make the server hold
 * their bodies; the memory all connections hold is capped (503 and a count beyond it); and
 * HTTPS offers only forward-secret AEAD suites in TLS 1.2 (a static-RSA CBC client is refused).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>

#include "tests/unit/http_fixture.h"

/* cppcheck-suppress unknownMacro ; criterion macros are unknown to cppcheck */
TestSuite(http_guard, .timeout = 60);

/* The hook a keyed front installs: every request but /healthz needs "Authorization: let-me-in"
 * before its body is read. */
static void need_key(km_http_req *r, void *user)
{
    const char *k = km_http_header(r, "Authorization");
    if (strcmp(km_http_path(r), "/healthz") && (!k || strcmp(k, "let-me-in")))
        km_http_respond_error(r, 401, "no key");
}

static server *start_guarded(size_t max_body, size_t max_buffered)
{
    server *s = calloc(1, sizeof *s);
    s->on_head = need_key;
    s->max_body = max_body;
    s->max_buffered = max_buffered;
    return start_server(s);
}

/* Whether the server closed fd (reads until EOF, at most 5 s). */
static bool closed_by_server(int fd)
{
    char buf[4096];
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 5000) <= 0) return false;
        ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k <= 0) return true;
    }
}

/* The server's buffered bytes, asked with a key on a connection of its own. */
static size_t buffered_now(int port)
{
    int fd = dial(port);
    say(fd, "GET /buffered HTTP/1.1\r\nAuthorization: let-me-in\r\n\r\n");
    char *r = hear(fd, ";");
    char *v = strstr(r, "buffered=");
    cr_assert_not_null(v, "got: %s", r);
    close(fd);
    return strtoull(v + 9, NULL, 10);
}

Test(http_guard, a_head_without_a_key_is_refused_before_its_body_arrives)
{
    server *s = start_guarded(4u << 20, 0);
    /* a 4 MiB body announced, none sent: the answer comes at the head, then the close */
    int fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nContent-Length: 4000000\r\n\r\n");
    char *r = hear(fd, "no key");
    cr_assert(strstr(r, "HTTP/1.1 401") && strstr(r, "Connection: close"), "got: %s", r);
    cr_assert(closed_by_server(fd), "the connection stays open for a body never read");
    close(fd);
    /* the same chunked */
    fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n");
    r = hear(fd, "no key");
    cr_assert(strstr(r, "HTTP/1.1 401"), "got: %s", r);
    cr_assert(closed_by_server(fd));
    close(fd);
    /* no body announced: refused, and the connection serves the next request */
    fd = dial(s->port);
    say(fd, "GET /header HTTP/1.1\r\nX-Test: a\r\n\r\n");
    cr_assert(strstr(hear(fd, "no key"), "HTTP/1.1 401"));
    say(fd, "GET /header HTTP/1.1\r\nAuthorization: let-me-in\r\nX-Test: again\r\n\r\n");
    cr_assert(strstr(hear(fd, "again"), "200 OK"));
    close(fd);
    /* with the key, bodies by length and chunked (in pieces) arrive whole */
    fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nAuthorization: let-me-in\r\nContent-Length: 6\r\n\r\nabc");
    say(fd, "def");
    cr_assert(strstr(hear(fd, "abcdef"), "abcdef"));
    say(fd, "POST /echo HTTP/1.1\r\nAuthorization: let-me-in\r\nTransfer-Encoding: chunked\r\n"
            "\r\n3\r\nghi\r");
    say(fd, "\n2\r\njk\r\n0\r\n\r\n");
    cr_assert(strstr(hear(fd, "ghijk"), "Content-Length: 5"));
    close(fd);
    stop(s);
}

/* Sends head then a body of n bytes without blocking, reading all the while: what came back
 * before the server closed, and in *reset whether the close was a reset. */
static char *send_all_and_read(int fd, const char *head, size_t n, bool *reset)
{
    static char got[8192];
    size_t have = 0, sent = 0, hl = strlen(head);
    char *body = malloc(n);
    memset(body, 'b', n);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    *reset = false;
    got[0] = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN | (sent < hl + n ? POLLOUT : 0)};
        if (poll(&p, 1, 5000) <= 0) break;
        if ((p.revents & POLLOUT) && sent < hl + n) {
            ssize_t k = sent < hl ? send(fd, head + sent, hl - sent, MSG_NOSIGNAL)
                                  : send(fd, body + sent - hl, hl + n - sent, MSG_NOSIGNAL);
            if (k > 0) sent += (size_t)k;
        }
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t k = recv(fd, got + have, sizeof got - 1 - have, 0);
            if (k < 0 && errno == EAGAIN) continue;
            if (k <= 0) {
                *reset = k < 0 && errno == ECONNRESET;
                break;
            }
            have += (size_t)k;
            got[have] = 0;
        }
    }
    free(body);
    return got;
}

Test(http_guard, a_refused_client_still_sending_its_body_reads_its_401_not_a_reset)
{
    server *s = start_guarded(4u << 20, 0);
    for (int i = 0; i < 10; i++) { /* a reset depends on timing: several tries */
        int fd = dial(s->port);
        bool reset;
        char *r = send_all_and_read(fd, "POST /echo HTTP/1.1\r\nContent-Length: 3000000\r\n\r\n",
                                    3000000, &reset);
        cr_assert(strstr(r, "HTTP/1.1 401") && strstr(r, "no key"), "round %d got: %.200s", i, r);
        cr_assert_not(reset, "round %d: the connection was reset under the client", i);
        close(fd);
    }
    stop(s);
}

Test(http_guard, keyless_connections_sending_big_bodies_are_not_buffered)
{
    server *s = start_guarded(4u << 20, 0);
    enum { N = 64, SENT = 256 << 10 };
    char *junk = malloc(SENT);
    memset(junk, 'x', SENT);
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = dial(s->port);
        say(fds[i], "POST /echo HTTP/1.1\r\nContent-Length: 4000000\r\n\r\n");
        fcntl(fds[i], F_SETFL, O_NONBLOCK);
        /* as much of a body as the kernel takes; the server may already have closed */
        for (size_t at = 0; at < SENT;) {
            ssize_t k = send(fds[i], junk + at, SENT - at, MSG_NOSIGNAL);
            if (k <= 0) break;
            at += (size_t)k;
        }
    }
    /* each was answered at its head; what the server holds is its own buffers, not N bodies */
    size_t held = buffered_now(s->port);
    cr_assert_lt(held, 4u << 20, "the server holds %zu bytes", held);
    for (int i = 0; i < N; i++) close(fds[i]);
    free(junk);
    stop(s);
}

Test(http_guard, the_memory_all_connections_hold_is_capped_and_refusals_counted)
{
    /* 1 MiB for everyone: a keyed 2 MiB body does not fit, small requests still do */
    server *s = start_guarded(4u << 20, 1u << 20);
    int fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nAuthorization: let-me-in\r\nContent-Length: 2000000\r\n\r\n");
    char *r = hear(fd, "retry later");
    cr_assert(strstr(r, "HTTP/1.1 503"), "got: %s", r);
    cr_assert(closed_by_server(fd));
    close(fd);
    fd = dial(s->port);
    say(fd, "POST /echo HTTP/1.1\r\nAuthorization: let-me-in\r\nContent-Length: 5\r\n\r\nhello");
    cr_assert(strstr(hear(fd, "hello"), "200 OK"));
    close(fd);
    stop_only(s);
    cr_assert_eq(s->buffer_refusals, 1);
    free(s);
}

/* ---------------------------------------------------------------- TLS suites */

/* A TLS 1.2 handshake offering only `ciphers`: 1 when it completed. */
static int handshake_with(const tls_fx *f, const char *ciphers)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_max_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_security_level(ctx, 0); /* the client may offer anything; the server decides */
    cr_assert_eq(SSL_CTX_set_cipher_list(ctx, ciphers), 1, "%s unknown to OpenSSL", ciphers);
    SSL *ssl = SSL_new(ctx);
    int fd = dial(f->s->port);
    SSL_set_fd(ssl, fd);
    int ok = SSL_connect(ssl) == 1;
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    close(fd);
    return ok;
}

Test(http_guard, tls12_offers_only_forward_secret_aead_suites)
{
    tls_fx f = {0};
    snprintf(f.dir, sizeof f.dir, "/tmp/kvmesh-tls-XXXXXX");
    cr_assert(mkdtemp(f.dir));
    make_cert_key(f.dir, f.cert, f.key, sizeof f.cert, true); /* RSA: static RSA is possible */
    f.s = start_tls(0, 0, 0, f.cert, f.key);
    cr_assert_eq(handshake_with(&f, "AES128-SHA"), 0, "static RSA, CBC, SHA-1 accepted");
    cr_assert_eq(handshake_with(&f, "AES128-GCM-SHA256"), 0, "static RSA accepted");
    cr_assert_eq(handshake_with(&f, "ECDHE-RSA-AES128-SHA"), 0, "CBC accepted");
    cr_assert_eq(handshake_with(&f, "ECDHE-RSA-AES128-GCM-SHA256"), 1);
    cr_assert_eq(handshake_with(&f, "ECDHE-RSA-AES256-GCM-SHA384"), 1);
    cr_assert_eq(handshake_with(&f, "ECDHE-RSA-CHACHA20-POLY1305"), 1);
    /* TLS 1.3 as before */
    SSL_CTX *ctx;
    SSL *ssl = tls_dial(&f, &ctx);
    cr_assert_eq(SSL_version(ssl), TLS1_3_VERSION);
    tls_hangup(ssl, ctx);
    tls_down(&f);
    free(f.s);
}
