/*
 * test_security.c — a secure cluster (kvmesh-controller, one kvmesh-worker "w0" and a
 * kvmesh-router, all started with --keydir) attacked the way issue 13 describes, over ZeroMQ on
 * 127.0.0.1 (ephemeral ports):
 *  - every ZeroMQ endpoint (router front, worker requests, worker events PUB, controller ROUTER,
 *    controller view PUB) tried with no key, an unknown key and a key of the wrong role: nothing
 *    comes back and the daemons count the refusals; the right key works;
 *  - a key of an admitted role sending a command its role may not send gets 403 and nothing
 *    happens (a client's admin on the router front, a member's evict on a worker, a member's
 *    recover on the controller);
 *  - a rogue kvmesh-worker (a key the cluster does not know) never joins; a member key bound to
 *    w1 cannot beat for w0 or register a new id, while it can beat for w1;
 *  - a daemon started with neither --keydir nor --insecure refuses to start;
 *  - every HTTP endpoint wants the right API key, and two API keys never share cached prefixes;
 *  - a disk-tier page forged while a worker was down (KV altered, checksum recomputed) is
 *    dropped and counted by the restarted worker (--cluster-secret), never served;
 *  - issue 41: a client key's pull hint (its own holder, endpoint, address) steers no worker, a
 *    worker takes hints only from a router's key naming a worker of the view; two client keys
 *    never share cached prefixes, unless --client-tenants puts them in one tenant; a key that
 *    floods the router queue delays another key's request by a slot, not its backlog, and past
 *    --max-queue-per-key gets 529 while another key is served.
 * The daemons are build/bin's, or $KVMESH_IT_BIN's (make integration-san: ASan/UBSan builds).
 * Run from the repository root after `make build` (make integration); without the model every
 * test skips and says so.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <xxhash.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "common/sec.h"
#include "common/svc.h"
#include "kvshard/diskfmt.h"
#include "tests/integration/harness.h" /* IT_WAIT */
#include "tests/unit/sec_fixture.h"

#define MODEL      "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define WORKER     it_bin("kvmesh-worker")
#define ROUTER     it_bin("kvmesh-router")
#define CONTROLLER it_bin("kvmesh-controller")

typedef struct proc {
    pid_t pid;
    char ports[256], log[256];
    char a[512], b[512], admin[512]; /* worker: requests, events; controller: listen, view;
                                      * router: front, HTTP port */
} proc;

static char g_tmp[64], g_keys[128], g_rogue[128], g_api[160], g_tenants[160];
/* HTTP API keys: two client tenants and an operator */
static char g_acme[KM_APIKEY_TOKEN_MAX], g_globex[KM_APIKEY_TOKEN_MAX], g_ops[KM_APIKEY_TOKEN_MAX];
static void *g_ctx;
static pid_t g_pids[8]; /* killed by the suite's fini, also when a test fails half way */
static int g_npids;
static proc g_ctl, g_w0, g_rt;

static bool have_model(void)
{
    if (access(MODEL, R_OK) == 0) return true;
    cr_skip_test("model %s not found (make deps)", MODEL);
    return false;
}

/* ---------------------------------------------------------------- processes */

static void read_ports(proc *p)
{
    FILE *f = fopen(p->ports, "r");
    cr_assert_not_null(f);
    char line[600];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        const char *k = line, *v = eq + 1;
        if (!strcmp(k, "requests") || !strcmp(k, "listen") || !strcmp(k, "front"))
            snprintf(p->a, sizeof p->a, "%s", v);
        else if (!strcmp(k, "events") || !strcmp(k, "view") || !strcmp(k, "http"))
            snprintf(p->b, sizeof p->b, "%s", v);
        else if (!strcmp(k, "admin"))
            snprintf(p->admin, sizeof p->admin, "%s", v);
    }
    fclose(f);
}

/* Starts argv (NULL-terminated) and waits for its ports file; returns false when it exited. */
static bool spawn(proc *p, const char *name, const char **argv)
{
    snprintf(p->ports, sizeof p->ports, "%s/%s.ports", g_tmp, name);
    snprintf(p->log, sizeof p->log, "%s/%s.log", g_tmp, name);
    p->pid = fork();
    cr_assert(p->pid >= 0);
    if (p->pid == 0) {
        FILE *f = freopen(p->log, "a", stderr);
        FILE *o = freopen("/dev/null", "w", stdout);
        (void)f, (void)o;
        unsetenv("KVMESH_INSECURE");
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    if (g_npids < 8) g_pids[g_npids++] = p->pid;
    for (int i = 0; i < 1200; i++) { /* 60 s: a loaded machine */
        if (!access(p->ports, R_OK)) {
            read_ports(p);
            return true;
        }
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            p->pid = 0;
            return false;
        }
        usleep(50000);
    }
    cr_assert_fail("%s did not start in 60 s (see %s)", argv[0], p->log);
    return false;
}

static void start_controller(void)
{
    char kd[200], pf[300];
    snprintf(kd, sizeof kd, "--keydir=%s", g_keys);
    snprintf(pf, sizeof pf, "--ports-file=%s/controller.ports", g_tmp);
    const char *argv[] = {CONTROLLER, "--listen=tcp://127.0.0.1:*", "--view=tcp://127.0.0.1:*",
                          "--admin-port=0", "--heartbeat=200ms",
                          /* a worker busy with a prefill on a loaded machine is not dead */
                          "--dead-after=25", "--view-interval=200ms", kd, pf, NULL};
    cr_assert(spawn(&g_ctl, "controller", argv), "the controller exited at start");
    int port = atoi(g_ctl.admin);
    snprintf(g_ctl.admin, sizeof g_ctl.admin, "http://127.0.0.1:%d", port);
}

/* A worker with id `id`, key directory `keys` and certificate `cert` (NULL: its id's), then the
 * flags in extra (NULL-terminated, may be NULL). */
static bool start_worker_x(proc *w, const char *name, const char *id, const char *keys,
                           const char *cert, const char *const *extra)
{
    char kd[200], pf[300], wid[100], ct[300], cf[600];
    snprintf(kd, sizeof kd, "--keydir=%s", keys);
    snprintf(pf, sizeof pf, "--ports-file=%s/%s.ports", g_tmp, name);
    snprintf(wid, sizeof wid, "--worker-id=%s", id);
    snprintf(ct, sizeof ct, "--cert=%s", cert ? cert : id);
    snprintf(cf, sizeof cf, "--controller=%s", g_ctl.a);
    const char *argv[] = {WORKER,
                          "--listen=tcp://127.0.0.1:*",
                          "--events=tcp://127.0.0.1:*",
                          "--threads=1",
                          "--admin-port=0",
                          "--heartbeat=200ms",
                          kd,
                          ct,
                          wid,
                          cf,
                          pf,
                          NULL,
                          NULL,
                          NULL,
                          NULL,
                          NULL};
    for (int i = 0, k = 11; extra && extra[i] && k < 15; i++) argv[k++] = extra[i];
    return spawn(w, name, argv);
}

static bool start_worker(proc *w, const char *name, const char *id, const char *keys,
                         const char *cert)
{
    return start_worker_x(w, name, id, keys, cert, NULL);
}

/* The router, then more flags (NULL, or up to 4 separated by spaces). */
static void start_router_x(const char *flags)
{
    char kd[200], pf[300], cf[600], ak[200], ct[200], fl[300] = "";
    snprintf(kd, sizeof kd, "--keydir=%s", g_keys);
    snprintf(pf, sizeof pf, "--ports-file=%s/router.ports", g_tmp);
    snprintf(cf, sizeof cf, "--controller=%s", g_ctl.b);
    snprintf(ak, sizeof ak, "--api-keys=%s", g_api);
    snprintf(ct, sizeof ct, "--client-tenants=%s", g_tenants);
    const char *argv[14] = {
        ROUTER, "--front=tcp://127.0.0.1:*", "--http-port=0", kd, cf, pf, ak, ct, NULL};
    snprintf(fl, sizeof fl, "%s", flags ? flags : "");
    char *save = NULL;
    int k = 8;
    for (char *f = strtok_r(fl, " ", &save); f && k < 12; f = strtok_r(NULL, " ", &save))
        argv[k++] = f;
    cr_assert(spawn(&g_rt, "router", argv), "the router exited at start");
}

static void stop_proc(proc *p)
{
    if (p->pid <= 0) return;
    kill(p->pid, SIGTERM);
    for (int i = 0; i < 250; i++) {
        if (waitpid(p->pid, NULL, WNOHANG) == p->pid) {
            p->pid = 0;
            return;
        }
        usleep(20000);
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

static void setup(void)
{
    km_log_set_level(KM_LOG_ERROR);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/kvmesh-sec-it-XXXXXX");
    cr_assert_not_null(mkdtemp(g_tmp));
    snprintf(g_keys, sizeof g_keys, "%s/keys", g_tmp);
    snprintf(g_rogue, sizeof g_rogue, "%s/rogue", g_tmp);
    km_errbuf err = {{0}};
    const char *ids[] = {"w0", "w1"};
    cr_assert_geq(km_keydir_init_cluster(g_keys, ids, 2, &err), 0, "%s", err.msg);
    /* another cluster's keys: a rogue worker "evil" and an outsider client, unknown here */
    const char *rogue_ids[] = {"evil"};
    cr_assert_geq(km_keydir_init_cluster(g_rogue, rogue_ids, 1, &err), 0, "%s", err.msg);
    snprintf(g_api, sizeof g_api, "%s/api_keys", g_tmp);
    cr_assert_eq(km_apikeys_add(g_api, "acme", KM_ROLE_CLIENT, NULL, g_acme, sizeof g_acme, &err),
                 0, "%s", err.msg);
    cr_assert_eq(
        km_apikeys_add(g_api, "globex", KM_ROLE_CLIENT, NULL, g_globex, sizeof g_globex, &err), 0);
    cr_assert_eq(km_apikeys_add(g_api, "ops", KM_ROLE_OPERATOR, NULL, g_ops, sizeof g_ops, &err),
                 0);
    /* ZeroMQ tenants: client and client2 each alone, client3 and client4 one tenant on purpose */
    const char *more[] = {"client2", "client3", "client4"};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(km_keydir_new_cert(g_keys, KM_ROLE_CLIENT, more[i], NULL, &err), 0, "%s",
                     err.msg);
    snprintf(g_tenants, sizeof g_tenants, "%s/client_tenants", g_tmp);
    FILE *tf = fopen(g_tenants, "w");
    cr_assert_not_null(tf);
    fputs("# key tenant\nclient3 shared\nclient4 shared\n", tf);
    fclose(tf);
    setenv("UCX_TLS", "tcp", 1); /* the transfer nodes of the pull tests */
    g_ctx = km_zctx_create();
}

/* The context is left to the process's exit: a test that failed half way may leave a socket
 * open, and zmq_ctx_term would wait for it forever. */
static void teardown(void)
{
    for (int i = 0; i < g_npids; i++)
        if (g_pids[i] > 0 && kill(g_pids[i], 0) == 0) {
            kill(g_pids[i], SIGKILL);
            waitpid(g_pids[i], NULL, 0);
        }
    g_npids = 0;
    rm_tree(g_tmp);
}

/* cppcheck-suppress unknownMacro ; criterion macros are unknown to cppcheck */
TestSuite(security, .init = setup, .fini = teardown, .timeout = 240);

/* ---------------------------------------------------------------- peers */

typedef enum { KEY_NONE = 0, KEY_UNKNOWN, KEY_NAMED } key_kind;

/* A socket of type t to ep: no CURVE (KEY_NONE), an outsider's key (KEY_UNKNOWN: the rogue
 * directory's "client"), or private/NAME.key of the cluster; the server is pinned by its member
 * name (a worker id, "controller", "router"); routing_id NULL: random. */
static void *peer_as(km_zsock_type t, const char *ep, key_kind k, const char *name,
                     const char *server, const char *routing_id)
{
    void *s = NULL;
    km_errbuf err = {{0}};
    km_zsock_opts o;
    km_zsock_opts_default(&o);
    o.max_msg_size = -1;
    o.routing_id = routing_id;
    cr_assert_eq(km_zsock_open(g_ctx, t, &o, &s, &err), 0, "%s", err.msg);
    if (k != KEY_NONE) {
        char cert[300];
        snprintf(cert, sizeof cert, "%s/private/%s.key", k == KEY_UNKNOWN ? g_rogue : g_keys,
                 k == KEY_UNKNOWN ? "client" : name);
        km_zsec_opts zo = {.keydir = g_keys, .cert = cert};
        km_zsec *z = NULL;
        cr_assert_eq(km_zsec_open(&zo, &z, &err), 0, "%s", err.msg);
        cr_assert_eq(km_zsec_client(z, s, server, &err), 0, "%s", err.msg);
        km_zsec_close(z);
    }
    if (t == KM_ZSUB) cr_assert_eq(km_zsock_subscribe(s, "", 0, &err), 0);
    cr_assert_eq(km_zsock_connect(s, ep, &err), 0, "%s", err.msg);
    return s;
}

static void *peer(km_zsock_type t, const char *ep, key_kind k, const char *name, const char *server)
{
    return peer_as(t, ep, k, name, server, NULL);
}

static void send_msg(void *s, const km_msg *m)
{
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(m, NULL, &b, &err), 0, "%s", err.msg);
    km_zframe f = {b.data, b.len};
    cr_assert_eq(km_zsend(s, &f, 1, KM_ZDONTWAIT, NULL), 0);
    km_buf_free(&b);
}

/* The next frame of type `type` within timeout_ms (others are skipped): 0, or KM_EAGAIN. */
static int recv_type(void *s, km_msg_type type, km_msg *m, int timeout_ms)
{
    uint64_t end = km_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    km_zmsg z = {0};
    for (;;) {
        uint64_t now = km_now_ns();
        if (now >= end) break;
        if (km_zrecv(s, &z, (int)((end - now) / 1000000ull) + 1, NULL)) continue;
        const km_zframe *b = km_zmsg_body(&z);
        if (b && !km_msg_decode(b->data, b->len, NULL, m, NULL)) {
            if (m->type == type) {
                km_zmsg_clear(&z);
                return 0;
            }
            if (m->type == KM_MSG_ERROR) { /* not what was expected: say why at once */
                cr_log_info("error frame %d: %s", m->error.code,
                            m->error.message ? m->error.message : "");
                km_msg_clear(m);
                km_zmsg_clear(&z);
                return KM_EPROTO;
            }
            km_msg_clear(m);
        }
    }
    km_zmsg_clear(&z);
    return KM_EAGAIN;
}

/* True when anything at all arrives on s within timeout_ms. */
static bool anything(void *s, int timeout_ms)
{
    km_zmsg z = {0};
    bool got = km_zrecv(s, &z, timeout_ms, NULL) == 0;
    km_zmsg_clear(&z);
    return got;
}

/* A short greedy request; the model name is the one both a router and a worker serve. */
static void msg_request(km_msg *m, uint64_t id)
{
    km_msg_init(m, KM_MSG_REQUEST);
    m->req.id = id;
    m->req.model = "SmolLM2-135M-Instruct";
    /* over 16 tokens: a full KV page, so the worker publishes a `stored` event */
    m->req.prompt = "Paris is the capital and largest city of France. It lies on the Seine, in the "
                    "north of the country, and has been a centre of finance, diplomacy, commerce, "
                    "fashion and science for centuries. The capital of France is";
    m->req.max_tokens = 4;
    m->req.temperature = 0;
}

static void msg_admin(km_msg *m, uint64_t id, km_admin_cmd cmd)
{
    km_msg_init(m, KM_MSG_ADMIN);
    m->admin.id = id;
    m->admin.cmd = cmd;
    m->admin.fraction = 0.5;
    m->admin.worker = "w0";
    m->admin.level = 1;
}

static void msg_heartbeat(km_msg *m, const char *worker, uint64_t seq)
{
    km_msg_init(m, KM_MSG_HEARTBEAT);
    m->hb.worker = worker;
    m->hb.seq = seq;
    m->hb.state = KM_STATE_READY;
}

/* The value of the first /metrics line that starts with `prefix` (0 when none). */
static double metric(const char *admin_url, const char *prefix)
{
    char url[700];
    snprintf(url, sizeof url, "%s/metrics", admin_url);
    km_buf body = {0};
    int st = 0;
    double v = 0;
    if (kvm_http_get(url, 5000, &body, &st, NULL) == 0 && st == 200) {
        km_buf_append(&body, "", 1);
        const char *p = strstr((const char *)body.data, prefix);
        while (p && p != (const char *)body.data && p[-1] != '\n') p = strstr(p + 1, prefix);
        if (p) {
            const char *sp = strchr(p, ' ');
            if (sp) v = strtod(sp + 1, NULL);
        }
    }
    km_buf_free(&body);
    return v;
}

/* The controller's view as the operator sees it: whether it lists `id`, and its state. */
static bool view_lists(const char *id, km_member_state *state)
{
    void *s = peer(KM_ZDEALER, g_ctl.a, KEY_NAMED, "admin", "controller");
    km_msg m;
    msg_admin(&m, 4242, KM_ADMIN_STATUS);
    send_msg(s, &m);
    cr_assert_eq(recv_type(s, KM_MSG_VIEW, &m, 10000), 0, "the operator got no view");
    bool found = false;
    for (uint32_t i = 0; i < m.view.n_workers; i++)
        if (!strcmp(m.view.workers[i].id, id)) {
            found = true;
            if (state) *state = m.view.workers[i].state;
        }
    km_msg_clear(&m);
    km_zsock_close(s);
    return found;
}

/* Sends requests of new prompts on s until a KV event reaches sub, a SUB that joins its PUB some
 * time after it connects (events published before are not its to see); false after 60 s. */
static bool kv_event_arrives(void *sub, void *s)
{
    const uint64_t end = km_now_ns() + 60000000000ull;
    km_msg m;
    for (uint64_t id = 1000; km_now_ns() < end; id++) {
        char prompt[300];
        snprintf(prompt, sizeof prompt, "Question %llu. %s", (unsigned long long)id,
                 "Paris is the capital and largest city of France. It lies on the Seine.");
        msg_request(&m, id);
        m.req.prompt = prompt; /* a first page no request had: a `stored` event */
        send_msg(s, &m);
        if (recv_type(s, KM_MSG_DONE, &m, 60000)) return false;
        km_msg_clear(&m);
        if (!recv_type(sub, KM_MSG_KV_EVENT, &m, 1000)) {
            km_msg_clear(&m);
            return true;
        }
    }
    return false;
}

/* Waits until the controller has taken n heartbeats more (w0 beats every 200 ms): whatever a
 * refused command or a flood would have changed in its view shows by then. */
static void wait_heartbeats(int n)
{
    const double from = metric(g_ctl.admin, "kvmesh_controller_heartbeats_total");
    IT_WAIT(metric(g_ctl.admin, "kvmesh_controller_heartbeats_total") >= from + n, 30000,
            "the controller took no %d heartbeats in 30 s", n);
}

/* Waits (up to 60 s) until the controller's view has w0 ready. */
static void wait_w0_ready(void)
{
    for (int i = 0; i < 300; i++) {
        km_member_state st = 0;
        if (view_lists("w0", &st) && st == KM_MEMBER_READY) return;
        usleep(200000);
    }
    cr_assert_fail("w0 never became ready in the controller's view (see %s)", g_w0.log);
}

/* Controller, w0 and the router (with one more flag, or NULL); w0 ready in the view. */
static void start_cluster_x(const char *router_flag)
{
    start_controller();
    cr_assert(start_worker(&g_w0, "w0", "w0", g_keys, NULL), "w0 exited at start (see %s)",
              g_w0.log);
    start_router_x(router_flag);
    wait_w0_ready();
}

static void start_cluster(void)
{
    start_cluster_x(NULL);
}

/* ---------------------------------------------------------------- tests */

Test(security, every_zeromq_endpoint_refuses_no_key_an_unknown_key_and_a_wrong_role)
{
    if (!have_model()) return;
    start_cluster();
    /* endpoint, its server's member name, the wrong role's key */
    struct {
        const char *what, *ep, *server, *wrong;
        km_zsock_type t;
    } ep[] = {
        {"router front", g_rt.a, "router", "controller", KM_ZDEALER},
        {"worker requests", g_w0.a, "w0", "client", KM_ZDEALER},
        {"worker events", g_w0.b, "w0", "admin", KM_ZSUB},
        {"controller", g_ctl.a, "controller", "client", KM_ZDEALER},
        {"controller view", g_ctl.b, "controller", "client", KM_ZSUB},
    };
    enum { N_EP = sizeof ep / sizeof ep[0] };
    void *bad[N_EP][3];
    for (int i = 0; i < N_EP; i++)
        for (int k = 0; k < 3; k++) {
            bad[i][k] = peer(ep[i].t, ep[i].ep,
                             k == 0   ? KEY_NONE
                             : k == 1 ? KEY_UNKNOWN
                                      : KEY_NAMED,
                             ep[i].wrong, ep[i].server);
            if (ep[i].t == KM_ZDEALER) { /* something each endpoint would answer */
                km_msg m;
                if (!strcmp(ep[i].server, "controller"))
                    msg_admin(&m, 7, KM_ADMIN_STATUS);
                else
                    msg_request(&m, 7);
                send_msg(bad[i][k], &m);
            }
        }
    /* the right keys work, and make the worker publish KV events meanwhile */
    void *ev = peer(KM_ZSUB, g_w0.b, KEY_NAMED, "router", "w0");
    void *view = peer(KM_ZSUB, g_ctl.b, KEY_NAMED, "admin", "controller");
    void *cl = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, "client", "router");
    km_msg m;
    msg_request(&m, 11);
    send_msg(cl, &m);
    cr_assert_eq(recv_type(cl, KM_MSG_DONE, &m, 60000), 0, "the client key got no answer");
    km_msg_clear(&m);
    void *mem = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "router", "w0");
    msg_request(&m, 12);
    send_msg(mem, &m);
    cr_assert_eq(recv_type(mem, KM_MSG_DONE, &m, 60000), 0, "a member key got no answer");
    km_msg_clear(&m);
    void *op = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "admin", "w0");
    msg_admin(&m, 13, KM_ADMIN_STATUS);
    send_msg(op, &m);
    cr_assert_eq(recv_type(op, KM_MSG_ADMIN_REPLY, &m, 10000), 0, "the operator got no status");
    cr_assert(m.admin_reply.ok);
    km_msg_clear(&m);
    cr_assert(view_lists("w0", NULL));
    cr_assert(kv_event_arrives(ev, mem), "a member got no KV events");
    cr_assert_eq(recv_type(view, KM_MSG_VIEW, &m, 10000), 0, "the operator got no view PUB");
    km_msg_clear(&m);
    /* ... while nothing ever reached the others */
    for (int i = 0; i < N_EP; i++)
        for (int k = 0; k < 3; k++) {
            cr_assert_not(anything(bad[i][k], k == 0 && i == 0 ? 1000 : 50),
                          "%s answered a peer with %s", ep[i].what,
                          k == 0   ? "no key"
                          : k == 1 ? "an unknown key"
                                   : "a key of the wrong role");
            km_zsock_close(bad[i][k]);
        }
    /* refused at the handshake and counted, on every daemon */
    cr_assert_geq(metric(g_w0.admin, "kvmesh_zap_decisions_total{decision=\"deny\",role=\"none\","
                                     "reason=\"unknown_key\"}"),
                  2);
    cr_assert_geq(
        metric(g_w0.admin, "kvmesh_zap_decisions_total{decision=\"deny\",role=\"client\""), 1);
    cr_assert_geq(
        metric(g_w0.admin, "kvmesh_zap_decisions_total{decision=\"deny\",role=\"operator\""), 1);
    cr_assert_geq(
        metric(g_ctl.admin, "kvmesh_zap_decisions_total{decision=\"deny\",role=\"client\""), 2);
    cr_assert_eq(metric(g_w0.admin, "kvmesh_insecure "), 0);
    km_zsock_close(cl);
    km_zsock_close(mem);
    km_zsock_close(op);
    km_zsock_close(ev);
    km_zsock_close(view);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

Test(security, a_command_outside_the_keys_role_gets_403_and_nothing_happens)
{
    if (!have_model()) return;
    start_cluster();
    km_msg m;
    /* a client's admin on the router front */
    void *cl = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, "client", "router");
    msg_admin(&m, 21, KM_ADMIN_SHUTDOWN);
    send_msg(cl, &m);
    cr_assert_eq(recv_type(cl, KM_MSG_ERROR, &m, 10000), 0);
    cr_assert_eq(m.error.code, KM_CODE_FORBIDDEN);
    cr_assert_eq(m.error.id, 21u);
    km_msg_clear(&m);
    /* a member (a router's key) may send requests to a worker, not commands */
    void *mem = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "router", "w0");
    const km_admin_cmd cmds[] = {KM_ADMIN_SHUTDOWN, KM_ADMIN_DRAIN, KM_ADMIN_EVICT};
    for (int i = 0; i < 3; i++) {
        msg_admin(&m, (uint64_t)(30 + i), cmds[i]);
        send_msg(mem, &m);
        cr_assert_eq(recv_type(mem, KM_MSG_ERROR, &m, 10000), 0);
        cr_assert_eq(m.error.code, KM_CODE_FORBIDDEN, "%s", km_admin_cmd_name(cmds[i]));
        km_msg_clear(&m);
    }
    /* an operator's request is not a router's either */
    void *op = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "admin", "w0");
    msg_request(&m, 40);
    send_msg(op, &m);
    cr_assert_eq(recv_type(op, KM_MSG_ERROR, &m, 10000), 0);
    cr_assert_eq(m.error.code, KM_CODE_FORBIDDEN);
    km_msg_clear(&m);
    /* a member's recover on the controller */
    void *cm = peer(KM_ZDEALER, g_ctl.a, KEY_NAMED, "router", "controller");
    msg_admin(&m, 50, KM_ADMIN_RECOVER);
    m.admin.level = 3;
    send_msg(cm, &m);
    cr_assert_eq(recv_type(cm, KM_MSG_ADMIN_REPLY, &m, 10000), 0);
    cr_assert_not(m.admin_reply.ok);
    cr_assert_eq(m.admin_reply.code, KM_CODE_FORBIDDEN);
    km_msg_clear(&m);
    /* nothing happened: the worker is alive, ready and serving, and was never drained */
    wait_heartbeats(2);
    cr_assert_eq(waitpid(g_w0.pid, NULL, WNOHANG), 0, "w0 exited");
    km_member_state st = 0;
    cr_assert(view_lists("w0", &st));
    cr_assert_eq(st, KM_MEMBER_READY);
    msg_request(&m, 60);
    send_msg(mem, &m);
    cr_assert_eq(recv_type(mem, KM_MSG_DONE, &m, 60000), 0);
    km_msg_clear(&m);
    cr_assert_geq(metric(g_w0.admin, "kvmesh_worker_forbidden_total"), 4);
    cr_assert_eq(metric(g_w0.admin, "kvmesh_recovery_actions_total{level=\"3\"}"), 0);
    /* the operator's own command does happen */
    msg_admin(&m, 70, KM_ADMIN_EVICT);
    send_msg(op, &m);
    cr_assert_eq(recv_type(op, KM_MSG_ADMIN_REPLY, &m, 10000), 0);
    cr_assert(m.admin_reply.ok, "%s", m.admin_reply.message ? m.admin_reply.message : "");
    km_msg_clear(&m);
    km_zsock_close(cl);
    km_zsock_close(mem);
    km_zsock_close(op);
    km_zsock_close(cm);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

Test(security, a_rogue_worker_cannot_join_and_no_one_beats_for_another_id)
{
    if (!have_model()) return;
    start_controller();
    cr_assert(start_worker(&g_w0, "w0", "w0", g_keys, NULL));
    wait_w0_ready();
    /* a real worker process with another cluster's key */
    proc evil = {0};
    char evil_cert[300];
    snprintf(evil_cert, sizeof evil_cert, "%s/private/evil.key", g_rogue);
    /* public keys are no secret: it knows the cluster's, but holds a key the cluster does not */
    cr_assert(start_worker(&evil, "evil", "evil", g_keys, evil_cert),
              "the rogue worker did not start");
    /* w1's member key, bound to w1: forged heartbeats for w0 (pressure, a dead state) and for a
     * new id, sent under routing id "w0" (once a takeover of w0's commands: the controller now
     * routes a worker's commands to the connection its admitted heartbeats come on) */
    km_msg m;
    void *forger = peer_as(KM_ZDEALER, g_ctl.a, KEY_NAMED, "w1", "controller", "w0");
    for (int round = 0; round < 10; round++) {
        const char *ids[] = {"w0", "evil2"};
        for (int i = 0; i < 2; i++) {
            msg_heartbeat(&m, ids[i], 1000 + (uint64_t)round);
            m.hb.state = KM_STATE_DRAINING;
            m.hb.rss_bytes = 1ull << 40;
            send_msg(forger, &m);
            usleep(50000); /* paced like heartbeats: over a second of w0's own */
        }
    }
    /* every one refused and counted (polled: the machine may be loaded) */
    double refused = 0;
    for (int i = 0; i < 300 && refused < 20; i++) {
        usleep(100000);
        refused = metric(g_ctl.admin, "kvmesh_controller_bad_frames_total{reason=\"forbidden\"}");
    }
    cr_assert_geq(refused, 20, "forged heartbeats refused: %g of 20", refused);
    /* the same key beating for its own id is admitted */
    msg_heartbeat(&m, "w1", 1);
    send_msg(forger, &m);
    bool listed = false;
    for (int i = 0; i < 300 && !listed; i++) {
        usleep(100000);
        listed = view_lists("w1", NULL);
    }
    cr_assert(listed, "w1's own key could not register w1");
    /* w0 was never disturbed, evil and evil2 never joined; the refusals were counted */
    km_member_state st = 0;
    cr_assert(view_lists("w0", &st));
    cr_assert_eq(st, KM_MEMBER_READY);
    cr_assert_not(view_lists("evil", NULL), "a worker with an unknown key joined");
    cr_assert_not(view_lists("evil2", NULL), "w1's key registered another id");
    double denied = 0;
    for (int i = 0; i < 300 && denied < 1; i++) {
        denied = metric(g_ctl.admin, "kvmesh_zap_decisions_total{decision=\"deny\",role=\"none\","
                                     "reason=\"unknown_key\"}");
        if (denied < 1) usleep(100000);
    }
    cr_assert_geq(denied, 1, "the rogue worker's key was never refused");
    cr_assert_eq(metric(g_ctl.admin, "kvmesh_recovery_actions_total"), 0);
    /* an operator's command for w0 reaches the real w0 (acknowledged by it, w0 still ready),
     * not the forger that connected as "w0" */
    void *op = peer(KM_ZDEALER, g_ctl.a, KEY_NAMED, "admin", "controller");
    msg_admin(&m, 80, KM_ADMIN_RECOVER);
    m.admin.level = 1;
    send_msg(op, &m);
    cr_assert_eq(recv_type(op, KM_MSG_ADMIN_REPLY, &m, 10000), 0);
    cr_assert(m.admin_reply.ok, "%s", m.admin_reply.message ? m.admin_reply.message : "");
    km_msg_clear(&m);
    double acks = 0;
    for (int i = 0; i < 300 && acks < 1; i++) {
        acks = metric(g_ctl.admin, "kvmesh_controller_acks_total");
        if (acks < 1) usleep(100000);
    }
    cr_assert_geq(acks, 1, "w0 never acknowledged the operator's command");
    cr_assert(view_lists("w0", &st));
    cr_assert_neq(st, KM_MEMBER_DEAD);
    km_zsock_close(forger);
    km_zsock_close(op);
    stop_proc(&evil);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

Test(security, a_daemon_without_keys_or_insecure_refuses_to_start)
{
    const char *bins[] = {WORKER, ROUTER, CONTROLLER};
    for (int i = 0; i < 3; i++) {
        pid_t pid = fork();
        cr_assert(pid >= 0);
        if (pid == 0) {
            FILE *f = freopen("/dev/null", "w", stderr);
            (void)f;
            unsetenv("KVMESH_INSECURE");
            unsetenv("KVMESH_KEYDIR");
            if (i == 1)
                execl(bins[i], bins[i], "--workers=w0=tcp://127.0.0.1:1", (char *)NULL);
            else
                execl(bins[i], bins[i], (char *)NULL);
            _exit(127);
        }
        int st = 0;
        cr_assert_eq(waitpid(pid, &st, 0), pid);
        cr_assert(WIFEXITED(st));
        cr_assert_eq(WEXITSTATUS(st), 2, "%s exited %d", bins[i], WEXITSTATUS(st));
    }
}

/* ---------------------------------------------------------------- HTTP (the OpenAI front) */

/* METHOD path on the router's HTTP port with curl, with "Authorization: Bearer key" when key is
 * not NULL and a JSON body when body is not NULL: the HTTP status, the response body in out. */
static int http(const char *method, const char *path, const char *key, const char *body, char *out,
                size_t cap)
{
    char bodyfile[200] = "", cmd[2000];
    if (body) {
        snprintf(bodyfile, sizeof bodyfile, "%s/body.json", g_tmp);
        FILE *f = fopen(bodyfile, "w");
        cr_assert_not_null(f);
        fputs(body, f);
        fclose(f);
    }
    snprintf(cmd, sizeof cmd,
             "curl -s -m 120 -X %s -w '\\n%%{http_code}' %s%s%s %s%s%s 'http://127.0.0.1:%s%s'",
             method, key ? "-H 'Authorization: Bearer " : "", key ? key : "", key ? "'" : "",
             body ? "-H 'Content-Type: application/json' --data-binary @" : "",
             body ? bodyfile : "", "", g_rt.b, path);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    pclose(p);
    char *nl = strrchr(out, '\n');
    cr_assert_not_null(nl, "no status from curl: %s", cmd);
    *nl = 0;
    return atoi(nl + 1);
}

/* The OpenAI error object's code in a response body ("" when none). */
static void error_code(const char *body, char *code, size_t cap)
{
    json_t *o = json_loads(body, 0, NULL);
    const char *c = json_string_value(json_object_get(json_object_get(o, "error"), "code"));
    snprintf(code, cap, "%s", c ? c : "");
    json_decref(o);
}

static const char *completion_body(void)
{
    return "{\"model\":\"default\",\"max_tokens\":2,\"temperature\":0,\"prompt\":\"Paris is the "
           "capital and largest city of France. It lies on the Seine, in the north of the "
           "country, and has been a centre of finance, diplomacy, commerce, fashion and science "
           "for centuries. Its museums, the Louvre first among them, draw millions of visitors "
           "every year, and its cafes, parks and bridges are known across the world. The capital "
           "of France is\"}";
}

Test(security, every_http_endpoint_needs_the_right_api_key)
{
    if (!have_model()) return;
    if (!it_have_curl()) return;
    start_cluster();
    char unknown[KM_APIKEY_TOKEN_MAX];
    cr_assert_eq(km_apikey_generate(unknown, sizeof unknown), 0);
    const char *chat = "{\"model\":\"default\",\"max_tokens\":2,\"temperature\":0,"
                       "\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}";
    struct {
        const char *method, *path, *body;
        bool operator_only;
    } ep[] = {
        {"POST", "/v1/completions", completion_body(), false},
        {"POST", "/v1/chat/completions", chat, false},
        {"GET", "/v1/models", NULL, false},
        {"GET", "/v1/status", NULL, true},
        {"GET", "/status", NULL, true},
        {"GET", "/metrics", NULL, true},
    };
    char out[1 << 16], code[64];
    for (size_t i = 0; i < sizeof ep / sizeof ep[0]; i++) {
        const char *what = ep[i].path;
        int st = http(ep[i].method, ep[i].path, NULL, ep[i].body, out, sizeof out);
        error_code(out, code, sizeof code);
        cr_assert_eq(st, 401, "%s without a key: %d", what, st);
        cr_assert_str_eq(code, "invalid_api_key", "%s: %s", what, out);
        st = http(ep[i].method, ep[i].path, unknown, ep[i].body, out, sizeof out);
        error_code(out, code, sizeof code);
        cr_assert_eq(st, 401, "%s with an unknown key: %d", what, st);
        cr_assert_str_eq(code, "invalid_api_key");
        if (ep[i].operator_only) {
            st = http(ep[i].method, ep[i].path, g_acme, ep[i].body, out, sizeof out);
            cr_assert_eq(st, 403, "%s with a client key: %d", what, st);
            cr_assert_null(strstr(out, "tcp://"), "%s leaked an endpoint to a client", what);
        }
        st = http(ep[i].method, ep[i].path, ep[i].operator_only ? g_ops : g_acme, ep[i].body, out,
                  sizeof out);
        cr_assert_eq(st, 200, "%s with the right key: %d %s", what, st, out);
    }
    /* health stays open (probes) */
    cr_assert_eq(http("GET", "/healthz", NULL, NULL, out, sizeof out), 200);
    cr_assert_eq(http("GET", "/readyz", NULL, NULL, out, sizeof out), 200);
    cr_assert_geq(metric(g_w0.admin, "kvmesh_worker_ready"), 1); /* the admin port: open */
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* prompt_tokens_details.cached_tokens of a completion response (-1 when absent). */
static long cached_tokens(const char *body)
{
    json_t *o = json_loads(body, 0, NULL);
    json_t *d = json_object_get(json_object_get(o, "usage"), "prompt_tokens_details");
    json_t *c = json_object_get(d, "cached_tokens");
    long v = json_is_integer(c) ? (long)json_integer_value(c) : -1;
    json_decref(o);
    return v;
}

Test(security, two_api_keys_never_share_cached_prefixes)
{
    if (!have_model()) return;
    if (!it_have_curl()) return;
    start_cluster();
    char out[1 << 16];
    cr_assert_eq(http("POST", "/v1/completions", g_acme, completion_body(), out, sizeof out), 200,
                 "%s", out);
    cr_assert_eq(cached_tokens(out), 0, "a cold cache: %s", out);
    cr_assert_eq(http("POST", "/v1/completions", g_acme, completion_body(), out, sizeof out), 200);
    long warm = cached_tokens(out);
    cr_assert_gt(warm, 0, "the same key's second request found nothing cached: %s", out);
    cr_assert_eq(http("POST", "/v1/completions", g_globex, completion_body(), out, sizeof out),
                 200);
    cr_assert_eq(cached_tokens(out), 0, "another key shared acme's prefix: %s", out);
    /* naming acme's salt namespace by hand does not reach it either */
    char body[4096];
    snprintf(body, sizeof body, "%.*s,\"cache_salt\":\"kvmesh:t:k:0\"}",
             (int)strlen(completion_body()) - 1, completion_body());
    cr_assert_eq(http("POST", "/v1/completions", g_globex, body, out, sizeof out), 200, "%s", out);
    cr_assert_eq(cached_tokens(out), 0);
    cr_assert_eq(http("POST", "/v1/completions", g_acme, completion_body(), out, sizeof out), 200);
    cr_assert_gt(cached_tokens(out), 0);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* ---------------------------------------------------------------- disk pages */

/* Alters the KV of every page file in d and recomputes its checksum, as anyone with write access
 * to the directory can (its MAC stays: a new one takes the cluster secret). How many. */
static int forge_pages(const char *d)
{
    DIR *dir = opendir(d);
    cr_assert_not_null(dir);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dir))) {
        if (!strstr(de->d_name, ".kvp")) continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", d, de->d_name);
        FILE *f = fopen(p, "r+b");
        cr_assert_not_null(f);
        fseek(f, 0, SEEK_END);
        size_t len = (size_t)ftell(f);
        rewind(f);
        uint8_t *b = malloc(len);
        cr_assert_eq(fread(b, 1, len, f), len);
        kv_disk_page pg;
        cr_assert_eq(kv_disk_page_parse(b, len, &pg), 0);
        for (size_t i = 0; i < pg.payload_bytes; i += 2) b[(pg.payload - b) + i + 1] ^= 0x04;
        uint64_t h = XXH3_64bits(b, len - 8);
        for (int i = 0; i < 8; i++) b[len - 8 + i] = (uint8_t)(h >> (8 * i));
        cr_assert_eq(kv_disk_page_parse(b, len, &pg), 0, "the forgery passes the checksum");
        rewind(f);
        cr_assert_eq(fwrite(b, 1, len, f), len);
        fclose(f);
        free(b);
        n++;
    }
    closedir(dir);
    return n;
}

/* A worker with a disk tier in disk and the cluster's secret, heartbeating to g_ctl. */
static void start_disk_worker(const char *disk)
{
    char kd[200], pf[300], dd[300], cs[300], cf[600];
    snprintf(kd, sizeof kd, "--keydir=%s", g_keys);
    snprintf(pf, sizeof pf, "--ports-file=%s/w0.ports", g_tmp);
    snprintf(dd, sizeof dd, "--kv-disk-dir=%s", disk);
    snprintf(cs, sizeof cs, "--cluster-secret=%s/cluster.secret", g_keys);
    snprintf(cf, sizeof cf, "--controller=%s", g_ctl.a);
    unlink(strchr(pf, '=') + 1);
    const char *argv[] = {WORKER,
                          "--listen=tcp://127.0.0.1:*",
                          "--events=tcp://127.0.0.1:*",
                          "--threads=1",
                          "--admin-port=0",
                          "--heartbeat=200ms",
                          "--worker-id=w0",
                          kd,
                          dd,
                          cs,
                          cf,
                          pf,
                          NULL};
    cr_assert(spawn(&g_w0, "w0", argv), "w0 exited at start (see %s)", g_w0.log);
}

/* The text of a greedy request sent to w0 as a router would (a member key). */
static void ask_w0(char *text, size_t cap, uint32_t *cached)
{
    void *s = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "router", "w0");
    km_msg m;
    msg_request(&m, 99);
    m.req.max_tokens = 8;
    send_msg(s, &m);
    cr_assert_eq(recv_type(s, KM_MSG_DONE, &m, 60000), 0, "w0 did not answer");
    snprintf(text, cap, "%.*s", (int)m.done.text_len, m.done.text ? m.done.text : "");
    *cached = m.done.cached_tokens;
    km_msg_clear(&m);
    km_zsock_close(s);
}

Test(security, a_disk_page_forged_while_the_worker_was_down_is_never_served)
{
    if (!have_model()) return;
    start_controller();
    char disk[200], before[512], after[512];
    snprintf(disk, sizeof disk, "%s/kv", g_tmp);
    start_disk_worker(disk);
    uint32_t cached = 0;
    ask_w0(before, sizeof before, &cached);
    stop_proc(&g_w0); /* the drain persists the hot pages to disk, with their MACs */
    int forged = forge_pages(disk);
    cr_assert_gt(forged, 0, "no page reached the disk: the test proves nothing");
    start_disk_worker(disk);
    ask_w0(after, sizeof after, &cached);
    cr_assert_str_eq(after, before, "a forged page changed the output");
    cr_assert_eq(cached, 0, "a forged page was served from the cache");
    double dropped = 0;
    for (int i = 0; i < 50 && dropped < forged; i++) { /* gauges refresh every so often */
        usleep(100000);
        dropped = metric(g_w0.admin, "kvmesh_kv_unauthenticated_pages_total");
    }
    cr_assert_geq(dropped, forged, "forged pages were not dropped and counted");
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

Test(security, a_garbage_flood_from_a_non_member_never_feeds_the_error_storm_rule)
{
    if (!have_model()) return;
    start_cluster();
    /* clients cannot reach a worker at all; an operator's garbage is counted, not reported */
    void *op = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "admin", "w0");
    void *cl = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "client", "w0");
    static const char junk[] = "\xc1 not msgpack";
    for (int i = 0; i < 1500; i++) {
        km_zframe f = {junk, sizeof junk - 1};
        km_zsend(op, &f, 1, KM_ZDONTWAIT, NULL);
        km_zsend(cl, &f, 1, KM_ZDONTWAIT, NULL);
        if (i % 100 == 99) usleep(20000); /* paced: DONTWAIT sends past the HWM would drop */
    }
    double bad = 0;
    for (int i = 0; i < 300 && bad < 1500; i++) {
        usleep(100000);
        bad = metric(g_w0.admin, "kvmesh_worker_bad_frames_total{reason=\"malformed\"}");
    }
    cr_assert_geq(bad, 1500, "the operator's garbage did not arrive (%g)", bad);
    wait_heartbeats(3);
    km_member_state st = 0;
    cr_assert(view_lists("w0", &st));
    cr_assert_eq(st, KM_MEMBER_READY);
    cr_assert_eq(metric(g_ctl.admin, "kvmesh_recovery_actions_total"), 0,
                 "the controller acted on a flood that no member sent");
    cr_assert_eq(metric(g_w0.admin, "kvmesh_recovery_actions_total{level=\"3\"}"), 0);
    km_zsock_close(op);
    km_zsock_close(cl);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* ---------------------------------------------------------------- pull hints (issue 41) */

/* A listening TCP socket on 127.0.0.1 (its port into *port) or Unix socket at path: where an
 * attacker would have a worker connect. */
static int trap_tcp(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t n = sizeof a;
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, n), 0);
    cr_assert_eq(listen(fd, 8), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &n), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

static int trap_ipc(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(fd, 8), 0);
    return fd;
}

/* True when anyone connects to either trap within timeout_ms. */
static bool trapped(int tcp, int ipc, int timeout_ms)
{
    struct pollfd p[2] = {{.fd = tcp, .events = POLLIN}, {.fd = ipc, .events = POLLIN}};
    return poll(p, 2, timeout_ms) > 0;
}

/* The pull hint an attacker writes into a request: holder `from`, endpoint and a made-up
 * transfer address of its choosing. */
static void put_hint(km_msg *m, const char *from, const char *endpoint)
{
    static const uint8_t addr[24] = {0x6b, 0x76, 0x6d, 0x31, 1, 2, 3, 4, 5, 6, 7, 8};
    m->req.pull_from = from;
    m->req.pull_endpoint = endpoint;
    m->req.pull_addr = addr;
    m->req.pull_addr_len = sizeof addr;
    m->req.pull_pages = 2;
    m->req.pull_ms = 1000;
}

/* Issue 41, 1 and 2: a client key's request naming a holder (the attacker's own CURVE key or a
 * worker id), an endpoint (TCP, ipc) and an address: the router forwards none of it, and the
 * worker takes a hint only from a router's key and only for a worker of the controller's view,
 * so it connects nowhere and imports nothing. With --max-inflight=1 most of them queue at the
 * router and are dispatched later, the path of the use-after-free (caught under ASan: make
 * integration-san). */
Test(security, a_client_key_cannot_steer_a_workers_pulls)
{
    if (!have_model()) return;
    start_controller();
    char view[600];
    snprintf(view, sizeof view, "--peer-view=%s", g_ctl.b);
    const char *const peer_flags[] = {"--peer-listen=127.0.0.1:0", view, NULL};
    cr_assert(start_worker_x(&g_w0, "w0", "w0", g_keys, NULL, peer_flags),
              "w0 exited at start (see %s)", g_w0.log);
    start_router_x("--max-inflight=1");
    wait_w0_ready();
    int port;
    int tl = trap_tcp(&port);
    char ipc_path[100], tcp_ep[64], ipc_ep[128];
    snprintf(ipc_path, sizeof ipc_path, "%s/trap.sock", g_tmp);
    int ul = trap_ipc(ipc_path);
    snprintf(tcp_ep, sizeof tcp_ep, "tcp://127.0.0.1:%d", port);
    snprintf(ipc_ep, sizeof ipc_ep, "ipc://%s", ipc_path);
    km_cert_info evil;
    km_errbuf err = {{0}};
    cr_assert_eq(km_keydir_find(g_rogue, KM_ROLE_MEMBER, "evil", &evil, &err), 0, "%s", err.msg);
    km_msg m;
    /* through the router, as a client: four at once, three of them queued */
    void *cl = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, "client", "router");
    for (int i = 0; i < 4; i++) {
        msg_request(&m, 100 + (uint64_t)i);
        put_hint(&m, i % 2 ? "w0" : evil.public_txt, i % 2 ? ipc_ep : tcp_ep);
        send_msg(cl, &m);
    }
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(recv_type(cl, KM_MSG_DONE, &m, 120000), 0, "request %d got no done", i);
        km_msg_clear(&m);
    }
    cr_assert_eq(metric(g_w0.admin, "kvmesh_kv_pull_hints_refused_total"), 0,
                 "a client's hint reached the worker (the router must strip it)");
    /* straight to w0: a worker's key is no router, and a router's hint must name a worker of
     * the controller's view (w1 runs nowhere; the attacker's key is no worker) */
    void *wk = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "w1", "w0");
    msg_request(&m, 200);
    put_hint(&m, "w1", tcp_ep);
    send_msg(wk, &m);
    cr_assert_eq(recv_type(wk, KM_MSG_DONE, &m, 120000), 0);
    km_msg_clear(&m);
    void *rk = peer(KM_ZDEALER, g_w0.a, KEY_NAMED, "router", "w0");
    msg_request(&m, 201);
    put_hint(&m, evil.public_txt, tcp_ep);
    send_msg(rk, &m);
    cr_assert_eq(recv_type(rk, KM_MSG_DONE, &m, 120000), 0);
    km_msg_clear(&m);
    msg_request(&m, 202);
    put_hint(&m, "w1", ipc_ep);
    send_msg(rk, &m);
    cr_assert_eq(recv_type(rk, KM_MSG_DONE, &m, 120000), 0);
    km_msg_clear(&m);
    /* a worker that was steered connects at once (and keeps reconnecting) */
    cr_assert_not(trapped(tl, ul, 1500), "a worker connected to the attacker's endpoint");
    cr_assert_eq(metric(g_w0.admin, "kvmesh_kv_pull_hints_refused_total{reason=\"sender\"}"), 1);
    cr_assert_eq(metric(g_w0.admin, "kvmesh_kv_pull_hints_refused_total{reason=\"holder\"}"), 2);
    cr_assert_eq(metric(g_w0.admin, "kvmesh_kv_transfer_pulls_total"), 0, "w0 pulled");
    close(tl);
    close(ul);
    km_zsock_close(cl);
    km_zsock_close(wk);
    km_zsock_close(rk);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* ---------------------------------------------------------------- ZeroMQ tenants (issue 41) */

/* cached_tokens of one greedy request sent through the router with client key `key` and salt
 * (NULL: none). */
static uint32_t cached_as(const char *key, uint64_t id, const char *salt)
{
    void *s = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, key, "router");
    km_msg m;
    msg_request(&m, id);
    m.req.prompt = "Lisbon is the capital and largest city of Portugal. It lies on the Tagus, "
                   "where the river meets the Atlantic, and has been a port of trade, navigation "
                   "and letters for centuries. The capital of Portugal is";
    m.req.cache_salt = salt;
    send_msg(s, &m);
    cr_assert_eq(recv_type(s, KM_MSG_DONE, &m, 60000), 0, "%s's request %llu got no done", key,
                 (unsigned long long)id);
    uint32_t c = m.done.cached_tokens;
    km_msg_clear(&m);
    km_zsock_close(s);
    return c;
}

/* Issue 41, 3: the cache salt is bound to the client's CURVE key as HTTP binds it to the API
 * key; a salt a client names narrows its own namespace and never reaches another's; the
 * --client-tenants file puts keys in one tenant on purpose. */
Test(security, two_client_keys_never_share_cached_prefixes_unless_one_tenant)
{
    if (!have_model()) return;
    start_cluster();
    cr_assert_eq(cached_as("client", 1, NULL), 0, "a cold cache");
    cr_assert_gt(cached_as("client", 2, NULL), 0, "the same key's second request hit nothing");
    cr_assert_eq(cached_as("client2", 3, NULL), 0, "another key shared client's prefix");
    cr_assert_eq(cached_as("client2", 4, "kvmesh:t:z:k:client"), 0,
                 "client's namespace named by hand");
    cr_assert_eq(cached_as("client", 5, "team"), 0, "a salt of its own is a namespace of its own");
    cr_assert_gt(cached_as("client", 6, "team"), 0);
    cr_assert_eq(cached_as("client2", 7, "team"), 0, "another key's salt named by hand");
    cr_assert_eq(cached_as("client3", 8, NULL), 0);
    cr_assert_gt(cached_as("client4", 9, NULL), 0, "two keys of one tenant share its cache");
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* ---------------------------------------------------------------- fairness (issue 41) */

/* n short greedy requests (ids 1..n) from client key `key` to the router front; the socket. */
static void *flood_n(const char *key, int n, uint32_t max_tokens)
{
    void *s = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, key, "router");
    km_msg m;
    for (int i = 0; i < n; i++) {
        msg_request(&m, 1 + (uint64_t)i);
        m.req.max_tokens = max_tokens;
        send_msg(s, &m);
    }
    return s;
}

static void *flood(const char *key, int n)
{
    return flood_n(key, n, 2);
}

/* The next frame on s within timeout_ms, decoded into m (the caller clears it): false when none
 * came. */
static bool next_frame(void *s, int timeout_ms, km_msg *m)
{
    km_zmsg z = {0};
    bool got = !km_zrecv(s, &z, timeout_ms, NULL);
    if (got) {
        const km_zframe *b = km_zmsg_body(&z);
        cr_assert_eq(km_msg_decode(b->data, b->len, NULL, m, NULL), 0);
    }
    km_zmsg_clear(&z);
    return got;
}

/* An admin frame on a as a fence: frames of one connection are read in order, so its answer
 * (403 to a client key) says every request before it is in the router. Returns the dones a got
 * meanwhile. */
static int fence(void *a)
{
    km_msg m;
    msg_admin(&m, 9999, KM_ADMIN_EVICT);
    send_msg(a, &m);
    int done = 0;
    bool fenced = false;
    uint64_t until = km_now_ns() + 120000000000ull;
    while (!fenced) {
        cr_assert_lt(km_now_ns(), until, "no answer to the fence");
        if (!next_frame(a, 100, &m)) continue;
        done += m.type == KM_MSG_DONE;
        fenced = m.type == KM_MSG_ERROR && m.error.id == 9999;
        km_msg_clear(&m);
    }
    return done;
}

/* A 2-token request of `key` on a new socket (returned), once its done has come. */
static void *short_request(const char *key)
{
    km_msg m;
    void *s = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, key, "router");
    msg_request(&m, 1);
    m.req.max_tokens = 2;
    send_msg(s, &m);
    cr_assert_eq(recv_type(s, KM_MSG_DONE, &m, 120000), 0, "%s's request got no done", key);
    km_msg_clear(&m);
    return s;
}

/* Issue 41, 4: a key that floods the router's queue does not hold back another key's request:
 * the queue serves the tenant with the fewest requests at workers first, so client2's one
 * request goes out at the next free slot instead of behind every queued request of client's.
 * Judged by order, not time: when client2's done arrives, client has finished at most a few. */
Test(security, a_flooding_key_does_not_hold_back_another_keys_request)
{
    if (!have_model()) return;
    start_cluster_x("--max-inflight=1");
    enum { FLOOD = 120 };
    km_msg m;
    void *a = flood("client", FLOOD);
    int a_done = fence(a);
    int before = a_done;
    void *bk = short_request("client2");
    while (next_frame(a, 0, &m)) {
        a_done += m.type == KM_MSG_DONE;
        km_msg_clear(&m);
    }
    cr_assert_lt(before, FLOOD - 10,
                 "the flood ended before client2 came: the test proves nothing");
    cr_assert_leq(a_done - before, 5,
                  "client2 waited behind %d of client's queued requests (FIFO, not fair)",
                  a_done - before);
    km_zsock_close(a);
    km_zsock_close(bk);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* Issue 41, 4: a key may hold at most --max-queue-per-key requests in the router queue; past
 * that it gets 429 (its own limit, not the cluster's 529) with a retry time, and another key is
 * still queued and served. */
Test(security, a_key_past_its_queue_share_gets_429_and_another_key_is_served)
{
    if (!have_model()) return;
    start_cluster_x("--max-queue-per-key=4");
    /* more than its share at once: 64 may be at the worker (--max-inflight), 4 queued */
    enum { N = 100 };
    km_msg m;
    void *a = flood("client", N);
    int done = 0, refused = 0;
    uint64_t until = km_now_ns() + 120000000000ull;
    while (done + refused < N) {
        cr_assert_lt(km_now_ns(), until, "%d done, %d refused of %d", done, refused, N);
        if (!next_frame(a, 100, &m)) continue;
        done += m.type == KM_MSG_DONE;
        if (m.type == KM_MSG_ERROR) {
            cr_assert_eq(m.error.code, KM_CODE_RATE_LIMIT, "%s", m.error.message);
            cr_assert_gt(m.error.retry_after_ms, 0);
            refused++;
        }
        km_msg_clear(&m);
    }
    cr_assert_gt(refused, 0, "none of client's %d requests was refused (its share: 4 queued)", N);
    void *bk = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, "client2", "router");
    msg_request(&m, 1);
    send_msg(bk, &m);
    cr_assert_eq(recv_type(bk, KM_MSG_DONE, &m, 120000), 0, "client2 was not served");
    km_msg_clear(&m);
    km_zsock_close(a);
    km_zsock_close(bk);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* The value of a series of the router's /metrics (read with the operator's API key); -1 when
 * absent. */
static double router_metric(const char *series)
{
    static char out[262144];
    if (http("GET", "/metrics", g_ops, NULL, out, sizeof out) != 200) return -1;
    const char *p = strstr(out, series);
    return p ? atof(p + strlen(series)) : -1;
}

/* Issue 41, 4: while another key is active, a key may have at most --max-inflight-per-key
 * requests at workers; the rest of its flood waits in the router queue even with worker slots
 * free (a worker runs 64 at once), so it does not fill the workers' batches, and the other
 * key's request is sent at once. client2 is made active first by a long request of its own.
 * Judged by counts, not time: the router's gauges once every request is in, and the order of
 * dones. */
Test(security, a_key_at_its_inflight_share_waits_and_another_key_goes_first)
{
    if (!have_model()) return;
    start_cluster_x("--max-inflight-per-key=2");
    enum { FLOOD = 40 };
    km_msg m;
    void *bk = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, "client2", "router");
    msg_request(&m, 100);
    m.req.max_tokens = 1024; /* runs through the whole test: client2 stays active */
    send_msg(bk, &m);
    uint64_t until = km_now_ns() + 60000000000ull;
    while (router_metric("kvmesh_router_tenant_inflight{tenant=\"z:client2\"} ") != 1) {
        cr_assert_lt(km_now_ns(), until, "client2's long request never reached the worker");
        usleep(20000);
    }
    void *a = flood_n("client", FLOOD, 64);
    int a_done = fence(a);
    double inflight = router_metric("kvmesh_router_tenant_inflight{tenant=\"z:client\"} ");
    double queued = router_metric("kvmesh_router_tenant_queued{tenant=\"z:client\"} ");
    cr_assert_leq(inflight, 2, "client has %.0f requests at the worker (its share: 2)", inflight);
    cr_assert_gt(queued, 0, "none of client's requests waits in the router (%d done)", a_done);
    int before = a_done;
    msg_request(&m, 1);
    m.req.max_tokens = 2;
    send_msg(bk, &m);
    bool got = false;
    until = km_now_ns() + 120000000000ull;
    while (!got) {
        cr_assert_lt(km_now_ns(), until, "client2's request got no done");
        if (!next_frame(bk, 100, &m)) continue;
        got = m.type == KM_MSG_DONE && m.done.id == 1;
        km_msg_clear(&m);
    }
    while (next_frame(a, 0, &m)) {
        a_done += m.type == KM_MSG_DONE;
        km_msg_clear(&m);
    }
    cr_assert_leq(a_done - before, 3, "client2 waited behind %d of client's requests",
                  a_done - before);
    km_zsock_close(a);
    km_zsock_close(bk);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* Issue 41, 4: a key alone on the cluster is never held by --max-inflight-per-key: the limit
 * makes room for other keys, and there are none, so its whole flood goes to the worker. */
Test(security, a_key_alone_is_not_held_to_its_inflight_share)
{
    if (!have_model()) return;
    start_cluster_x("--max-inflight-per-key=2");
    void *a = flood_n("client", 12, 64);
    fence(a);
    /* the flood shares one prompt: the router parks the rest behind the first one's prefill,
     * then sends them all; held to 2, at most 2 would ever be at the worker */
    double most = 0;
    uint64_t until = km_now_ns() + 60000000000ull;
    while (most <= 2 && km_now_ns() < until) {
        double n = router_metric("kvmesh_router_tenant_inflight{tenant=\"z:client\"} ");
        most = n > most ? n : most;
        usleep(20000);
    }
    cr_assert_gt(most, 2, "a lone key never had more than %.0f requests at the worker", most);
    km_zsock_close(a);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* Issue 41, 4: a key alone filled the worker's batch (the router never holds a key alone); when
 * another key asks, the worker sends the first key's newest sequences back to its queue
 * (--max-running-per-tenant, 4 by default) and runs the newcomer's, its first token in a step
 * the first key's sequences sit out. Judged by the worker's counters of sequences sent back and
 * of sequences that sat out a step, not by time. */
Test(security, a_worker_full_of_one_keys_sequences_makes_room_for_another_key)
{
    if (!have_model()) return;
    start_cluster();
    enum { FLOOD = 12 };
    void *a = flood_n("client", FLOOD, 1024); /* runs through the whole test */
    uint64_t until = km_now_ns() + 120000000000ull;
    /* running there, not only sent: requests still in its queue would just wait (no yield) */
    while (metric(g_w0.admin, "kvmesh_worker_running ") < FLOOD) {
        cr_assert_lt(km_now_ns(), until, "client's flood never all ran at the worker");
        usleep(20000);
    }
    cr_assert_eq(metric(g_w0.admin, "kvmesh_worker_tenant_yields_total"), 0, "client is alone");
    void *bk = short_request("client2");
    /* heartbeats carry the scheduler's counters to the metric */
    until = km_now_ns() + 30000000000ull;
    while (metric(g_w0.admin, "kvmesh_worker_tenant_yields_total") < 1) {
        cr_assert_lt(km_now_ns(), until, "the worker sent none of client's sequences back");
        usleep(50000);
    }
    while (metric(g_w0.admin, "kvmesh_worker_tenant_waits_total") < 1) {
        cr_assert_lt(km_now_ns(), until, "client2's first token shared its step with client");
        usleep(50000);
    }
    km_zsock_close(a);
    km_zsock_close(bk);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* Issue 41, 4: --max-tokens-per-sec-per-key is a token bucket per key over prompt and generated
 * tokens: at one token per 100 s one request is admitted (the bucket is not in debt) and pays
 * its prompt and completion, the next one gets 429 with the time until the debt is paid, and
 * another key is served. The rate is that low so that however slowly the first request runs
 * (a sanitizer build), the bucket has refilled next to nothing when the second one comes. */
Test(security, a_key_past_its_token_rate_gets_429_with_a_retry_time)
{
    if (!have_model()) return;
    start_cluster_x("--max-tokens-per-sec-per-key=0.01");
    km_msg m;
    void *a = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, "client", "router");
    msg_request(&m, 1);
    send_msg(a, &m);
    cr_assert_eq(recv_type(a, KM_MSG_DONE, &m, 120000), 0, "the first request was not served");
    uint32_t used = m.done.prompt_tokens + m.done.completion_tokens;
    km_msg_clear(&m);
    msg_request(&m, 2);
    send_msg(a, &m);
    cr_assert_eq(recv_type(a, KM_MSG_ERROR, &m, 120000), 0, "the second request was not refused");
    cr_assert_eq(m.error.code, KM_CODE_RATE_LIMIT, "%s", m.error.message);
    /* the debt: what the first used, less what the bucket held and refilled (under 2 tokens
     * unless the test ran for minutes), paid at 100 s a token */
    cr_assert_geq(m.error.retry_after_ms, (used - 2) * 100000u, "retry after %u ms for %u tokens",
                  m.error.retry_after_ms, used);
    km_msg_clear(&m);
    void *bk = peer(KM_ZDEALER, g_rt.a, KEY_NAMED, "client2", "router");
    msg_request(&m, 1);
    send_msg(bk, &m);
    cr_assert_eq(recv_type(bk, KM_MSG_DONE, &m, 120000), 0, "client2 was not served");
    km_msg_clear(&m);
    char out[65536];
    cr_assert_eq(http("GET", "/metrics", g_ops, NULL, out, sizeof out), 200);
    cr_assert_not_null(
        strstr(out, "kvmesh_router_tenant_refused_total{tenant=\"z:client\",reason=\"tokens\"} 1"),
        "no refusal counted for client");
    km_zsock_close(a);
    km_zsock_close(bk);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}

/* A completion POSTed to the router's HTTP front with API key `key` on a connection of its own
 * (closed by the router after its answer); the socket. */
static int http_post_open(const char *key, int max_tokens)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(g_rt.b))};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    char body[600], req[1400];
    snprintf(body, sizeof body,
             "{\"model\":\"default\",\"max_tokens\":%d,\"temperature\":0,\"prompt\":\"Paris is "
             "the capital and largest city of France. It lies on the Seine. The capital of "
             "France is\"}",
             max_tokens);
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     "Content-Type: application/json\r\nConnection: close\r\n"
                     "Content-Length: %zu\r\n\r\n%s",
                     key, strlen(body), body);
    cr_assert_eq(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    return fd;
}

/* The next of n connections to be answered in full within the deadline: its index, its whole
 * answer in out (headers and body); -1 when none was. done[i] marks those read already. */
static int http_next_answer(const int *fd, bool *done, int n, char *out, size_t cap, uint64_t until)
{
    static char buf[64][8192];
    static size_t len[64];
    while (km_now_ns() < until) {
        struct pollfd p[64];
        int idx[64], k = 0;
        for (int i = 0; i < n && k < 64; i++)
            if (!done[i]) p[k] = (struct pollfd){.fd = fd[i], .events = POLLIN}, idx[k++] = i;
        if (!k || poll(p, (nfds_t)k, 100) <= 0) continue;
        for (int j = 0; j < k; j++) {
            if (!(p[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int i = idx[j];
            if (len[i] == 0) buf[i][0] = 0;
            ssize_t r = recv(fd[i], buf[i] + len[i], sizeof buf[i] - 1 - len[i], 0);
            if (r > 0) {
                len[i] += (size_t)r;
                continue;
            }
            buf[i][len[i]] = 0;
            snprintf(out, cap, "%s", buf[i]);
            len[i] = 0;
            done[i] = true;
            return i;
        }
    }
    return -1;
}

/* Issue 41, 4 over HTTP: an API key that floods past its queue share (--max-queue-per-key)
 * gets OpenAI's 429 rate_limit_exceeded with Retry-After, while another key's one request is
 * served ahead of the flood's queued ones. Judged by order: once the flooder's first 429 says
 * its queue is full, globex's answer comes before more than a couple of the flood's. */
Test(security, an_http_key_flooding_gets_429_and_another_key_is_served_first)
{
    if (!have_model()) return;
    start_cluster_x("--max-inflight=1 --max-queue-per-key=4");
    enum { FLOOD = 24 };
    int fd[FLOOD + 1];
    bool done[FLOOD + 1] = {0};
    for (int i = 0; i < FLOOD; i++) fd[i] = http_post_open(g_acme, 8);
    static char out[8192];
    uint64_t until = km_now_ns() + 120000000000ull;
    int ok_before = 0, refused = 0;
    for (;;) { /* until the first 429: acme's share of the queue is full now */
        int i = http_next_answer(fd, done, FLOOD, out, sizeof out, until);
        cr_assert_geq(i, 0, "no answer to the flood");
        if (strstr(out, " 200 ")) ok_before++;
        if (strstr(out, " 429 ")) {
            refused++;
            break;
        }
    }
    fd[FLOOD] = http_post_open(g_globex, 2);
    int ok_between = 0, victim = -1;
    while (victim < 0) {
        int i = http_next_answer(fd, done, FLOOD + 1, out, sizeof out, until);
        cr_assert_geq(i, 0, "globex got no answer");
        if (i == FLOOD) {
            cr_assert_not_null(strstr(out, " 200 "), "globex: %s", out);
            victim = i;
        } else if (strstr(out, " 200 ")) {
            ok_between++;
        } else {
            cr_assert_not_null(strstr(out, " 429 "), "acme: %s", out);
            cr_assert_not_null(strstr(out, "\r\nRetry-After: "), "no Retry-After: %s", out);
            cr_assert_not_null(strstr(out, "\"rate_limit_exceeded\""), "%s", out);
            refused++;
        }
    }
    cr_assert_lt(ok_before, FLOOD - 4, "the flood was served before it filled its queue");
    cr_assert_leq(ok_between, 2, "globex waited behind %d of acme's queued requests", ok_between);
    for (int i = 0; i <= FLOOD; i++) close(fd[i]);
    stop_proc(&g_rt);
    stop_proc(&g_w0);
    stop_proc(&g_ctl);
}
