/*
 * test_security_http.c — the router's HTTP front against clients without a key (issue 41, item
 * 5): a real kvmesh-router with --api-keys (no workers: nothing here gets as far as one) on
 * 127.0.0.1. Many keyless connections announcing 4 MiB bodies, by Content-Length and chunked,
 * and sending part of them, each get OpenAI's 401 invalid_api_key at their head, without the
 * router waiting for (or holding) the body; a keyed client's body is still read. Run from the
 * repository root after `make build` (make integration); without the model every test skips.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/sec.h"
#include "tests/integration/harness.h"
#include "tests/unit/http_fixture.h"
#include "tests/unit/sec_fixture.h"

static char g_tmp[64], g_api[128], g_acme[KM_APIKEY_TOKEN_MAX];

static void setup(void)
{
    km_log_set_level(KM_LOG_ERROR);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/kvmesh-sechttp-XXXXXX");
    cr_assert_not_null(mkdtemp(g_tmp));
    snprintf(g_api, sizeof g_api, "%s/api_keys", g_tmp);
    km_errbuf err = {{0}};
    cr_assert_eq(km_apikeys_add(g_api, "acme", KM_ROLE_CLIENT, NULL, g_acme, sizeof g_acme, &err),
                 0, "%s", err.msg);
}

static void teardown(void)
{
    it_kill_all();
    rm_tree(g_tmp);
}

/* cppcheck-suppress unknownMacro ; criterion macros are unknown to cppcheck */
TestSuite(security_http, .init = setup, .fini = teardown, .timeout = 120);

static void start_router(it_proc *r)
{
    memset(r, 0, sizeof *r);
    it_proc_dir(r, "sechttp");
    char ports[128], keys[200];
    snprintf(ports, sizeof ports, "--ports-file=%s/ports", r->dir);
    snprintf(keys, sizeof keys, "--api-keys=%s", g_api);
    /* a worker slot nothing listens on: the router needs one to start */
    const char *argv[] = {IT_ROUTER,
                          "--front=tcp://127.0.0.1:*",
                          "--workers=w0=tcp://127.0.0.1:9+tcp://127.0.0.1:9",
                          "--http-port=0",
                          "--admin-port=0",
                          "--log-level=warn",
                          ports,
                          keys,
                          NULL};
    it_spawn(r, argv, NULL, "log");
}

/* Sends what the kernel takes of n bytes without blocking (the router may have closed). */
static void send_some(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k <= 0) return;
        p += k;
        n -= (size_t)k;
    }
}

Test(security_http, keyless_clients_get_401_at_their_head_and_their_bodies_are_never_held)
{
    if (!it_have((const char *const[]){IT_MODEL, IT_ROUTER, NULL})) return;
    it_proc r;
    start_router(&r);
    enum { N = 150, PART = 64 << 10 };
    char *part = malloc(PART);
    memset(part, ' ', PART);
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = dial(r.http_port);
        char head[256];
        snprintf(head, sizeof head,
                 "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 "Content-Type: application/json\r\n%s\r\n",
                 i % 2 ? "Content-Length: 4194304\r\n" : "Transfer-Encoding: chunked\r\n");
        send_some(fds[i], head, strlen(head));
        if (i % 2) {
            send_some(fds[i], part, PART);
        } else {
            send_some(fds[i], "400000\r\n", 8); /* a 4 MiB chunk */
            send_some(fds[i], part, PART);
        }
    }
    /* no connection sent its whole body: an answer at all is one given at the head */
    for (int i = 0; i < N; i++) {
        char *a = hear(fds[i], "}}");
        cr_assert(!strncmp(a, "HTTP/1.1 401", 12), "connection %d got: %.300s", i, a);
        cr_assert(strstr(a, "invalid_api_key") && strstr(a, "WWW-Authenticate: Bearer"),
                  "connection %d got: %.300s", i, a);
        close(fds[i]);
    }
    free(part);
    double refused =
        it_metric(r.admin_port, "kvmesh_router_http_auth_refused_total{status=\"401\"}");
    cr_assert_eq(refused, N, "401s counted: %g", refused);
    /* a keyed client's body is read and parsed as before */
    int fd = dial(r.http_port);
    char req[512];
    snprintf(req, sizeof req,
             "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
             "Content-Type: application/json\r\nContent-Length: 8\r\n\r\n{\"bad\": ",
             g_acme);
    send_some(fd, req, strlen(req));
    char *a = hear(fd, "}}");
    cr_assert(!strncmp(a, "HTTP/1.1 400", 12), "got: %.300s", a);
    close(fd);
    /* the health probes need no key */
    char out[512];
    cr_assert_eq(it_http_get(r.http_port, "/healthz", out, sizeof out), 200);
    it_stop(&r);
    rm_tree(r.dir);
}
