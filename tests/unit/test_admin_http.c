/*
 * test_admin_http.c — the admin HTTP server over real TCP connections on 127.0.0.1 (an ephemeral
 * port), driven by a raw socket client so that every byte on the wire is the test's choice:
 * /healthz, /readyz following its callback, /metrics serving the registry's exact text, 404/405,
 * HEAD, keep-alive with pipelining, requests split across writes, malformed and oversized heads,
 * and a stop that closes idle connections.
 */
#include "common/svc.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <stdio.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* cppcheck-suppress unknownMacro ; criterion macros are unknown to cppcheck */
TestSuite(admin_http, .timeout = 30);

static km_admin *start(km_metrics *m, bool (*ready)(void *), void *user)
{
    km_admin_opts o = {.host = "127.0.0.1", .port = 0, .metrics = m, .ready = ready, .user = user};
    km_admin *a = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_admin_start(&o, &a, &err), 0, "%s", err.msg);
    cr_assert_gt(km_admin_port(a), 0);
    return a;
}

static int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0, "connect: %s", strerror(errno));
    return fd;
}

static void send_all(int fd, const char *s, size_t n)
{
    while (n) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        cr_assert_gt(w, 0, "send: %s", strerror(errno));
        s += w;
        n -= (size_t)w;
    }
}

/* Reads until the peer closes (or 5 s pass); returns a NUL-terminated heap string. */
static char *read_to_eof(int fd)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, 5000);
        cr_assert_gt(r, 0, "the server neither answered nor closed within 5 s");
        if (len + 1 == cap) buf = realloc(buf, cap *= 2);
        ssize_t n = recv(fd, buf + len, cap - len - 1, 0);
        if (n <= 0) break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    return buf;
}

/* One request on a fresh connection; the whole response up to the server's close. */
static char *exchange(int port, const char *req)
{
    int fd = dial(port);
    send_all(fd, req, strlen(req));
    char *resp = read_to_eof(fd);
    close(fd);
    return resp;
}

static const char *body_of(const char *resp)
{
    const char *p = strstr(resp, "\r\n\r\n");
    cr_assert_not_null(p, "no end of headers in: %s", resp);
    return p + 4;
}

Test(admin_http, healthz_answers_ok_over_a_real_tcp_connection)
{
    km_admin *a = start(NULL, NULL, NULL);
    char *r =
        exchange(km_admin_port(a), "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    cr_assert_str_eq(r, "HTTP/1.1 200 OK\r\n"
                        "Content-Type: text/plain; charset=utf-8\r\n"
                        "Content-Length: 3\r\n"
                        "Connection: close\r\n"
                        "\r\n"
                        "ok\n");
    free(r);
    km_admin_stop(a);
}

static atomic_bool ready_flag;

static bool is_ready(void *user)
{
    cr_assert_eq(user, &ready_flag);
    return atomic_load(&ready_flag);
}

Test(admin_http, readyz_follows_the_callback)
{
    atomic_store(&ready_flag, false);
    km_admin *a = start(NULL, is_ready, &ready_flag);
    const char *req = "GET /readyz HTTP/1.1\r\nConnection: close\r\n\r\n";
    char *r = exchange(km_admin_port(a), req);
    cr_assert(strncmp(r, "HTTP/1.1 503 Service Unavailable\r\n", 34) == 0, "%s", r);
    cr_assert_str_eq(body_of(r), "not ready\n");
    free(r);
    atomic_store(&ready_flag, true);
    r = exchange(km_admin_port(a), req);
    cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", r);
    cr_assert_str_eq(body_of(r), "ready\n");
    free(r);
    km_admin_stop(a);
}

Test(admin_http, metrics_serves_the_registry_text)
{
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), 0);
    km_metric *c = NULL;
    cr_assert_eq(km_metric_register(m, KM_COUNTER, "requests_total", "Requests.", "status", NULL, 0,
                                    &c, NULL),
                 0);
    km_counter_add(km_metric_series(c, (const char *[]){"ok"}), 41);
    km_admin *a = start(m, NULL, NULL);
    km_counter_inc(km_metric_series(c, (const char *[]){"ok"})); /* updates after start show */
    char *r = exchange(km_admin_port(a), "GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n");
    cr_assert(strstr(r, "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), "%s", r);
    const char *want = "# HELP kvmesh_requests_total Requests.\n"
                       "# TYPE kvmesh_requests_total counter\n"
                       "kvmesh_requests_total{status=\"ok\"} 42\n";
    /* the registry's text first, then this process's own metrics (km_metrics_render_process) */
    const char *body = body_of(r);
    cr_assert(!strncmp(body, want, strlen(want)), "%s", body);
    cr_assert(strstr(body + strlen(want), "\n# TYPE process_resident_memory_bytes gauge\n"), "%s",
              body);
    char cl[64];
    snprintf(cl, sizeof cl, "Content-Length: %zu\r\n", strlen(body));
    cr_assert(strstr(r, cl), "%s", r);
    free(r);
    km_admin_stop(a);
    km_metrics_destroy(m);
}

Test(admin_http, unknown_paths_are_404_and_other_methods_405)
{
    km_admin *a = start(NULL, NULL, NULL);
    int port = km_admin_port(a);
    char *r = exchange(port, "GET /nope HTTP/1.1\r\nConnection: close\r\n\r\n");
    cr_assert(strncmp(r, "HTTP/1.1 404 Not Found\r\n", 24) == 0, "%s", r);
    free(r);
    r = exchange(port, "POST /metrics HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
    cr_assert(strncmp(r, "HTTP/1.1 405 Method Not Allowed\r\n", 33) == 0, "%s", r);
    cr_assert(strstr(r, "Allow: GET, HEAD\r\n"), "%s", r);
    free(r);
    /* a query string does not change the route */
    r = exchange(port, "GET /healthz?verbose=1 HTTP/1.1\r\nConnection: close\r\n\r\n");
    cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", r);
    free(r);
    km_admin_stop(a);
}

Test(admin_http, head_sends_headers_without_a_body)
{
    km_admin *a = start(NULL, NULL, NULL);
    char *r = exchange(km_admin_port(a), "HEAD /healthz HTTP/1.1\r\nConnection: close\r\n\r\n");
    cr_assert(strstr(r, "Content-Length: 3\r\n"), "%s", r);
    cr_assert_str_eq(body_of(r), "");
    free(r);
    km_admin_stop(a);
}

Test(admin_http, keep_alive_answers_pipelined_requests_in_order)
{
    km_admin *a = start(NULL, NULL, NULL);
    const char *reqs = "GET /healthz HTTP/1.1\r\n\r\n"
                       "GET /readyz HTTP/1.1\r\n\r\n"
                       "GET /missing HTTP/1.1\r\nConnection: close\r\n\r\n";
    char *r = exchange(km_admin_port(a), reqs);
    const char *p1 = strstr(r, "HTTP/1.1 200 OK");
    const char *p2 = p1 ? strstr(p1 + 1, "HTTP/1.1 200 OK") : NULL;
    const char *p3 = p2 ? strstr(p2 + 1, "HTTP/1.1 404 Not Found") : NULL;
    cr_assert(p1 && p2 && p3, "three responses in order expected, got: %s", r);
    cr_assert(strstr(r, "Connection: keep-alive\r\n"), "%s", r);
    cr_assert(strstr(p2, "ready\n"), "%s", r);
    free(r);
    km_admin_stop(a);
}

Test(admin_http, a_request_split_across_many_writes_is_still_parsed)
{
    km_admin *a = start(NULL, NULL, NULL);
    int fd = dial(km_admin_port(a));
    const char *req = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    for (size_t i = 0; req[i]; i++) {
        send_all(fd, req + i, 1);
        usleep(1000); /* the test: one byte a read, not a wait for anything */
    }
    char *r = read_to_eof(fd);
    close(fd);
    cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", r);
    cr_assert_str_eq(body_of(r), "ok\n");
    free(r);
    km_admin_stop(a);
}

Test(admin_http, malformed_oversized_and_body_requests_get_an_error_and_a_close)
{
    km_admin *a = start(NULL, NULL, NULL);
    int port = km_admin_port(a);
    char *r = exchange(port, "BLAH\r\n\r\n");
    cr_assert(strncmp(r, "HTTP/1.1 400 Bad Request\r\n", 26) == 0, "%s", r);
    cr_assert(strstr(r, "Connection: close\r\n"), "%s", r);
    free(r);

    size_t n = 10000;
    char *big = malloc(n + 64);
    strcpy(big, "GET /healthz HTTP/1.1\r\nX-Filler: ");
    size_t l = strlen(big);
    memset(big + l, 'a', n - l);
    big[n] = '\0';
    r = exchange(port, big); /* never terminated: the server gives up at its head limit */
    cr_assert(strncmp(r, "HTTP/1.1 431 ", 13) == 0, "%s", r);
    free(r);
    free(big);

    r = exchange(port, "GET /healthz HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello");
    cr_assert(strncmp(r, "HTTP/1.1 413 ", 13) == 0, "%s", r);
    free(r);
    r = exchange(port, "GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
    cr_assert(strncmp(r, "HTTP/1.1 501 ", 13) == 0, "%s", r);
    free(r);

    /* the server is still healthy afterwards */
    r = exchange(port, "GET /healthz HTTP/1.0\r\n\r\n");
    cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "HTTP/1.0 closes by default: %s", r);
    free(r);
    km_admin_stop(a);
}

Test(admin_http, stop_closes_idle_connections_and_returns)
{
    km_admin *a = start(NULL, NULL, NULL);
    int fd = dial(km_admin_port(a));
    send_all(fd, "GET /healthz HTTP/1.1\r\n\r\n", 25); /* keep-alive: stays open */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    cr_assert_gt(poll(&p, 1, 5000), 0);
    char buf[512];
    cr_assert_gt(recv(fd, buf, sizeof buf, 0), 0);
    km_admin_stop(a);
    char *rest = read_to_eof(fd); /* EOF promptly, not after the idle timeout */
    cr_assert_str_eq(rest, "");
    free(rest);
    close(fd);
}

Test(admin_http, a_port_in_use_is_an_error_naming_the_address)
{
    km_admin *a = start(NULL, NULL, NULL);
    km_admin_opts o = {.host = "127.0.0.1", .port = km_admin_port(a)};
    km_admin *b = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_admin_start(&o, &b, &err), KM_EIO);
    cr_assert_null(b);
    char want[64];
    snprintf(want, sizeof want, "admin http 127.0.0.1:%d", km_admin_port(a));
    cr_assert(strstr(err.msg, want) && strstr(err.msg, "address already in use"), "%s", err.msg);
    o.host = "not-an-ip";
    cr_assert_eq(km_admin_start(&o, &b, &err), KM_EINVAL);
    cr_assert(strstr(err.msg, "not-an-ip"), "%s", err.msg);
    km_admin_stop(a);
}

Test(admin_http, many_concurrent_clients_are_all_served)
{
    km_admin *a = start(NULL, NULL, NULL);
    enum { N = 32 };
    int fds[N];
    for (int i = 0; i < N; i++) fds[i] = dial(km_admin_port(a));
    for (int i = 0; i < N; i++) {
        const char *req = "GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n";
        send_all(fds[i], req, strlen(req));
    }
    for (int i = 0; i < N; i++) {
        char *r = read_to_eof(fds[i]);
        cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "client %d: %s", i, r);
        free(r);
        close(fds[i]);
    }
    km_admin_stop(a);
}
