/*
 * test_keys.c — `kvmesh keys` as an operator runs it: init makes a cluster key directory whose
 * keys work end to end (a CURVE server with the ZAP handler admits the client key it made, with
 * its role), add and remove change who gets in without restarting the server, bad usage exits
 * 2 and refused changes exit 1, and api-add prints a key that the API key file then accepts.
 * Run from the repository root after `make build` (make integration).
 */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <zmq.h>

#include "common/sec.h"
#include "common/svc.h"
#include "tests/unit/sec_fixture.h"

#define KVMESH "build/bin/kvmesh"

static char tmp[64], dir[128];

static void setup(void)
{
    km_log_set_level(KM_LOG_ERROR);
    snprintf(tmp, sizeof tmp, "/tmp/kvmesh-keys-it-XXXXXX");
    cr_assert_not_null(mkdtemp(tmp));
    snprintf(dir, sizeof dir, "%s/keys", tmp);
}

static void teardown(void)
{
    rm_tree(tmp);
}

/* cppcheck-suppress unknownMacro ; criterion macros are unknown to cppcheck */
TestSuite(keys_cli, .init = setup, .fini = teardown, .timeout = 60);

/* Runs `kvmesh ARGS`, returns its exit status, with its stdout in out. */
static int kvmesh(char *out, size_t cap, const char *fmt, ...)
{
    char args[512], cmd[700];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s %s 2>/dev/null", KVMESH, args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    cr_assert(WIFEXITED(st), "%s did not exit", cmd);
    return WEXITSTATUS(st);
}

/* A CURVE ROUTER with the controller's key (from the directory the CLI made) and a ZAP handler;
 * a DEALER with private/NAME.key sends one frame: the role the server saw, or NONE when
 * refused (the handler counted a denial and nothing arrived). */
static km_role connect_as(const char *name)
{
    km_errbuf err = {{0}};
    char cert[256], ccert[256], srvkey[256], ep[256];
    snprintf(cert, sizeof cert, "%s/private/controller.key", dir);
    snprintf(ccert, sizeof ccert, "%s/private/%s.key", dir, name);
    snprintf(srvkey, sizeof srvkey, "%s/members/controller.key", dir);
    km_zsec *zs, *zc;
    km_zsec_opts so = {.cert = cert, .keydir = dir}, co = {.cert = ccert};
    must(km_zsec_open(&so, &zs, &err), &err);
    must(km_zsec_open(&co, &zc, &err), &err);
    void *sctx = km_zctx_create(), *cctx = km_zctx_create(), *srv, *cli;
    km_zap *zap;
    must(km_zap_start(sctx, zs, NULL, &zap, &err), &err);
    must(km_zsock_open(sctx, KM_ZROUTER, NULL, &srv, &err), &err);
    must(km_zsec_server(zs, srv, KM_ROLES_ALL, &err), &err);
    must(km_zsock_bind(srv, "tcp://127.0.0.1:*", &err), &err);
    must(km_zsock_last_endpoint(srv, ep, sizeof ep, &err), &err);
    must(km_zsock_open(cctx, KM_ZDEALER, NULL, &cli, &err), &err);
    must(km_zsec_client(zc, cli, srvkey, &err), &err);
    must(km_zsock_connect(cli, ep, &err), &err);
    km_zframe f = {"hello", 5};
    must(km_zsend(cli, &f, 1, 0, &err), &err);
    km_role role = KM_ROLE_NONE;
    km_zap_stats st = {0};
    for (int i = 0; i < 1000 && role == KM_ROLE_NONE && !st.denied; i++) {
        zmq_pollitem_t it = {srv, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 10) > 0) {
            zmq_msg_t m;
            int more = 1;
            while (more) {
                zmq_msg_init(&m);
                zmq_msg_recv(&m, srv, 0);
                km_zpeer p;
                if (!km_zpeer_from_msg(&m, &p)) role = p.role;
                more = zmq_msg_more(&m);
                zmq_msg_close(&m);
            }
        }
        km_zap_stats_get(zap, &st);
    }
    cr_assert(role != KM_ROLE_NONE || st.denied, "neither admitted nor refused in 10 s");
    km_zsock_close(cli);
    km_zsock_close(srv);
    km_zap_stop(zap);
    km_zctx_destroy(sctx);
    km_zctx_destroy(cctx);
    km_zsec_close(zs);
    km_zsec_close(zc);
    return role;
}

Test(keys_cli, init_makes_keys_that_work_and_add_remove_change_who_gets_in)
{
    char out[4096];
    cr_assert_eq(kvmesh(out, sizeof out, "keys init %s --workers w0,w1", dir), 0);
    cr_assert(strstr(out, "6 keys made"), "%s", out);
    cr_assert_eq(kvmesh(out, sizeof out, "keys list %s", dir), 0);
    cr_assert(strstr(out, "member    w1                       w1"), "%s", out);
    cr_assert(strstr(out, "operator  admin"), "%s", out);
    cr_assert_eq(connect_as("client"), KM_ROLE_CLIENT);
    cr_assert_eq(connect_as("admin"), KM_ROLE_OPERATOR);
    cr_assert_eq(connect_as("w1"), KM_ROLE_MEMBER);

    cr_assert_eq(kvmesh(out, sizeof out, "keys add %s bob --role client", dir), 0);
    cr_assert_eq(connect_as("bob"), KM_ROLE_CLIENT);
    cr_assert_eq(kvmesh(out, sizeof out, "keys add %s bob --role client", dir), 1, "twice");
    cr_assert_eq(kvmesh(out, sizeof out, "keys remove %s bob", dir), 0);
    /* the removed key's private half is gone too: keep a copy made before, as its owner would */
    cr_assert_eq(kvmesh(out, sizeof out, "keys add %s eve --role client", dir), 0);
    char from[256], to[256];
    const char *sfx[2] = {"", "_secret"};
    for (int i = 0; i < 2; i++) {
        snprintf(from, sizeof from, "%s/private/eve.key%s", dir, sfx[i]);
        snprintf(to, sizeof to, "%s/private/eve-copy.key%s", dir, sfx[i]);
        cr_assert_eq(link(from, to), 0);
    }
    cr_assert_eq(kvmesh(out, sizeof out, "keys remove %s eve", dir), 0);
    cr_assert_eq(connect_as("eve-copy"), KM_ROLE_NONE, "a removed key still gets in");
}

Test(keys_cli, bad_usage_exits_2_and_refused_changes_exit_1)
{
    char out[4096];
    cr_assert_eq(kvmesh(out, sizeof out, "keys"), 2);
    cr_assert_eq(kvmesh(out, sizeof out, "keys frobnicate"), 2);
    cr_assert_eq(kvmesh(out, sizeof out, "keys init"), 2);
    cr_assert_eq(kvmesh(out, sizeof out, "keys init %s", dir), 0);
    cr_assert_eq(kvmesh(out, sizeof out, "keys add %s x --role wizard", dir), 2);
    cr_assert_eq(kvmesh(out, sizeof out, "keys add %s x --role client --worker w0", dir), 1);
    cr_assert_eq(kvmesh(out, sizeof out, "keys add %s ../x --role client", dir), 1);
    cr_assert_eq(kvmesh(out, sizeof out, "keys remove %s nobody", dir), 1);
    cr_assert_eq(kvmesh(out, sizeof out, "keys --help"), 0);
}

Test(keys_cli, api_add_prints_a_key_the_key_file_accepts)
{
    char out[4096], file[256];
    snprintf(file, sizeof file, "%s/apikeys", tmp);
    cr_assert_eq(kvmesh(out, sizeof out, "keys api-add %s acme", file), 0);
    char token[128];
    cr_assert_eq(sscanf(out, "%127s", token), 1);
    cr_assert_eq(kvmesh(out, sizeof out, "keys api-add %s ops --role operator", file), 0);
    km_apikeys *k;
    km_errbuf err = {{0}};
    must(km_apikeys_open(file, &k, &err), &err);
    km_apikeys_set_check_interval(k, 0);
    km_apikey_match m;
    cr_assert_eq(km_apikeys_lookup(k, token, strlen(token), &m), 0, "token %s", token);
    cr_assert_str_eq(m.tenant, "acme");
    cr_assert_eq(m.role, KM_ROLE_CLIENT);
    cr_assert_eq(kvmesh(out, sizeof out, "keys api-remove %s acme", file), 0);
    cr_assert_eq(km_apikeys_lookup(k, token, strlen(token), &m), KM_ENOTFOUND);
    cr_assert_eq(kvmesh(out, sizeof out, "keys api-remove %s acme", file), 1, "nothing to remove");
    cr_assert_eq(kvmesh(out, sizeof out, "keys api-add %s x --role member", file), 1);
    km_apikeys_close(k);
}
