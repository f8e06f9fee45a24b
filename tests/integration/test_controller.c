/*
 * test_controller.c — kvmesh-controller with real kvmesh-worker processes on 127.0.0.1
 * (ephemeral ports), driven over ZeroMQ like an operator and a router would: the view lists a
 * worker ready (status reply and PUB); forced levels 1, 2 and 3 reach the worker (evict
 * acknowledged, heartbeats showing fp8, a drain that exits 75 and a restart that is re-admitted);
 * bad operator frames get error replies and are counted; a SIGSTOPped worker goes dead and comes
 * back on SIGCONT; a restarted controller rebuilds its view from heartbeats; and, with the
 * worker's --chaos `pressure` command, the controller fires level 1 then level 2 on its own.
 *
 * Heartbeats every 200 ms and a 1 s cooldown keep the file short. Run from the repository root
 * after `make build` (make integration); without the model every test skips and says so.
 */
#include <criterion/criterion.h>
#include <msgpack.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "common/svc.h"
#include "tests/integration/harness.h"

typedef it_proc proc;

TestSuite(controller, .fini = it_kill_all, .timeout = 120);

static bool have_binaries(void)
{
    return it_have((const char *const[]){IT_MODEL, IT_WORKER, IT_CONTROLLER, NULL});
}

/* A controller; listen NULL = an ephemeral port. extra: NULL-terminated flags. */
static void start_controller(proc *c, const char *listen, const char **extra)
{
    it_proc_dir(c, "ctl");
    char ports[128], lflag[600];
    snprintf(ports, sizeof ports, "%s/ports", c->dir);
    snprintf(lflag, sizeof lflag, "--listen=%s", listen ? listen : "tcp://127.0.0.1:*");
    const char *argv[] = {IT_CONTROLLER,
                          lflag,
                          "--view=tcp://127.0.0.1:*",
                          "--admin-port=0",
                          "--heartbeat=200ms",
                          "--view-interval=200ms",
                          "--log-level=info",
                          "--ports-file",
                          ports,
                          NULL};
    it_spawn(c, argv, extra, "controller.log");
}

/* A worker heartbeating to ctl every 200 ms; extra: NULL-terminated flags. */
static void start_worker(proc *w, const char *id, const proc *ctl, const char **extra)
{
    char wid[80], cflag[600];
    snprintf(wid, sizeof wid, "--worker-id=%s", id);
    snprintf(cflag, sizeof cflag, "--controller=%s", ctl->listen);
    const char *flags[] = {"--admin-port=-1",
                           "--threads=1",
                           "--heartbeat=200ms",
                           "--log-level=info",
                           wid,
                           cflag,
                           NULL};
    it_start_worker(w, "ctl", flags, extra);
}

/* ---------------------------------------------------------------- operator side */

/* Receives the reply to what was sent on s (within timeout_ms); the caller clears it. */
static void recv_msg(void *s, km_msg *m, int timeout_ms)
{
    cr_assert(it_recv_msg(s, m, timeout_ms), "no reply in %d ms", timeout_ms);
}

static void send_admin(void *s, km_admin_cmd cmd, const char *worker, uint32_t level,
                       double fraction)
{
    static uint64_t id = 1000;
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN);
    m.admin.id = ++id;
    m.admin.cmd = cmd;
    m.admin.worker = worker;
    m.admin.level = level;
    m.admin.fraction = fraction;
    it_send_msg(s, &m);
}

/* The controller's view by `status` (with histories); the caller clears it. */
static void status(const proc *ctl, km_msg *view)
{
    void *s = it_dealer(ctl->listen);
    send_admin(s, KM_ADMIN_STATUS, NULL, 0, 0);
    recv_msg(s, view, 5000);
    km_zsock_close(s);
    cr_assert_eq(view->type, KM_MSG_VIEW, "status answered '%s'", km_msg_type_name(view->type));
}

static const km_view_worker *member(const km_msg *view, const char *id)
{
    for (uint32_t i = 0; i < view->view.n_workers; i++)
        if (!strcmp(view->view.workers[i].id, id)) return &view->view.workers[i];
    return NULL;
}

/* Waits until worker id is in `state` (and at `level` unless level < 0) in the status view. */
static void wait_member(const proc *ctl, const char *id, km_member_state state, int level,
                        int timeout_ms)
{
    const char *last = "absent";
    int last_level = -1;
    for (int i = 0; i < timeout_ms / 100; i++) {
        km_msg v;
        status(ctl, &v);
        const km_view_worker *w = member(&v, id);
        bool done = w && w->state == state && (level < 0 || (int)w->level == level);
        if (w) {
            last = km_member_state_name(w->state);
            last_level = (int)w->level;
        }
        km_msg_clear(&v);
        if (done) return;
        usleep(100000);
    }
    cr_assert_fail("%s never became %s level %d (last: %s level %d)", id,
                   km_member_state_name(state), level, last, last_level);
}

/* Waits for a history entry of `level` with ok (and reason when not NULL). */
static void wait_history(const proc *ctl, const char *id, uint32_t level, const char *reason,
                         int timeout_ms)
{
    for (int i = 0; i < timeout_ms / 100; i++) {
        km_msg v;
        status(ctl, &v);
        const km_view_worker *w = member(&v, id);
        bool found = false;
        for (uint32_t k = 0; w && k < w->n_history && !found; k++)
            found = w->history[k].level == level && w->history[k].ok &&
                    (!reason || !strcmp(w->history[k].reason, reason));
        km_msg_clear(&v);
        if (found) return;
        usleep(100000);
    }
    cr_assert_fail("%s: no acknowledged level-%u action (%s) in the history", id, level,
                   reason ? reason : "any reason");
}

/* Waits until the worker's heartbeats (as the view shows them) say KV format fmt. */
static void wait_format(const proc *ctl, const char *id, const char *fmt, int timeout_ms)
{
    for (int i = 0; i < timeout_ms / 100; i++) {
        km_msg v;
        status(ctl, &v);
        const km_view_worker *w = member(&v, id);
        bool done = w && w->kv_format && !strcmp(w->kv_format, fmt);
        km_msg_clear(&v);
        if (done) return;
        usleep(100000);
    }
    cr_assert_fail("%s never showed KV format %s", id, fmt);
}

/* Sends `recover` and returns the admin_reply's code (0 when ok). */
static int recover(const proc *ctl, const char *worker, uint32_t level)
{
    void *s = it_dealer(ctl->listen);
    send_admin(s, KM_ADMIN_RECOVER, worker, level, 0);
    km_msg r;
    recv_msg(s, &r, 5000);
    km_zsock_close(s);
    cr_assert_eq(r.type, KM_MSG_ADMIN_REPLY);
    int code = r.admin_reply.ok ? 0 : r.admin_reply.code;
    km_msg_clear(&r);
    return code;
}

/* A `recover` frame with a level our own encoder would refuse to write; the reply's code. */
static int recover_raw_level(const proc *ctl, const char *worker, uint64_t level)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 6);
#define KEY(k) (msgpack_pack_str(&pk, strlen(k)), msgpack_pack_str_body(&pk, k, strlen(k)))
    KEY("v");
    msgpack_pack_uint64(&pk, KM_PROTO_VERSION);
    KEY("t");
    KEY("admin");
    KEY("id");
    msgpack_pack_uint64(&pk, 77);
    KEY("cmd");
    KEY("recover");
    KEY("worker");
    KEY(worker);
    KEY("level");
    msgpack_pack_uint64(&pk, level);
#undef KEY
    void *s = it_dealer(ctl->listen);
    it_send_raw(s, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
    km_msg r;
    recv_msg(s, &r, 5000);
    km_zsock_close(s);
    cr_assert_eq(r.type, KM_MSG_ADMIN_REPLY, "recover level %llu answered '%s'",
                 (unsigned long long)level, km_msg_type_name(r.type));
    cr_assert_eq(r.admin_reply.id, 77, "the reply names the frame's id");
    cr_assert_eq(r.admin_reply.cmd, KM_ADMIN_RECOVER);
    int code = r.admin_reply.ok ? 0 : r.admin_reply.code;
    km_msg_clear(&r);
    return code;
}

/* Sends a raw frame on a fresh DEALER and returns the `err` reply's id (its code in *code). */
static uint64_t raw_error_id(const proc *ctl, const void *frame, size_t len, int *code)
{
    void *s = it_dealer(ctl->listen);
    it_send_raw(s, frame, len);
    km_msg r;
    recv_msg(s, &r, 5000);
    km_zsock_close(s);
    cr_assert_eq(r.type, KM_MSG_ERROR, "answered '%s'", km_msg_type_name(r.type));
    uint64_t id = r.error.id;
    *code = r.error.code;
    km_msg_clear(&r);
    return id;
}

/* ---------------------------------------------------------------- tests */

Test(controller, view_lists_the_worker_and_forced_levels_1_2_3_reach_it)
{
    if (!have_binaries()) return;
    proc ctl = {0}, w = {0};
    start_controller(&ctl, NULL, NULL);
    /* a router's view of the cluster: the PUB */
    void *sub = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_open(it_zctx(), KM_ZSUB, NULL, &sub, &err), 0);
    cr_assert_eq(km_zsock_subscribe(sub, "view", 4, &err), 0);
    cr_assert_eq(km_zsock_connect(sub, ctl.view, &err), 0);

    start_worker(&w, "w0", &ctl, NULL);
    wait_member(&ctl, "w0", KM_MEMBER_READY, 0, 10000);
    bool seen = false;
    for (int i = 0; i < 50 && !seen; i++) {
        km_zmsg z = {0};
        if (km_zrecv(sub, &z, 200, NULL)) continue;
        cr_assert_eq(z.n, 2, "a view is two parts");
        cr_assert_eq(z.part[0].len, 4);
        cr_assert(!memcmp(z.part[0].data, "view", 4));
        km_msg v;
        cr_assert_eq(km_msg_decode(z.part[1].data, z.part[1].len, NULL, &v, &err), 0, "%s",
                     err.msg);
        const km_view_worker *m = member(&v, "w0");
        if (m && m->state == KM_MEMBER_READY) {
            seen = true;
            cr_assert_str_eq(m->requests, w.req);
            cr_assert_not_null(m->events);
            cr_assert_str_eq(v.view.controller, "controller");
        }
        km_msg_clear(&v);
        km_zmsg_clear(&z);
    }
    cr_assert(seen, "the PUB never showed w0 ready");
    km_zsock_close(sub);

    /* operator errors: unknown worker, bad level, a command the controller does not take, a
     * malformed frame; the controller answers each and keeps serving */
    cr_assert_eq(recover(&ctl, "nobody", 1), KM_CODE_NOT_FOUND);
    cr_assert_eq(recover_raw_level(&ctl, "w0", 7), KM_CODE_BAD_REQUEST);
    cr_assert_eq(recover_raw_level(&ctl, "w0", 0), KM_CODE_BAD_REQUEST);
    void *op = it_dealer(ctl.listen);
    send_admin(op, KM_ADMIN_DRAIN, NULL, 0, 0);
    km_msg r;
    recv_msg(op, &r, 5000);
    cr_assert_eq(r.type, KM_MSG_ADMIN_REPLY);
    cr_assert_not(r.admin_reply.ok);
    cr_assert_eq(r.admin_reply.code, KM_CODE_BAD_REQUEST);
    km_msg_clear(&r);
    it_send_raw(op, "\xc1garbage", 8);
    recv_msg(op, &r, 5000);
    cr_assert_eq(r.type, KM_MSG_ERROR);
    cr_assert_eq(r.error.code, KM_CODE_BAD_REQUEST);
    km_msg_clear(&r);
    km_zsock_close(op);
    cr_assert_geq(
        it_metric(ctl.admin_port, "kvmesh_controller_bad_frames_total{reason=\"malformed\"}"), 1);
    cr_assert_geq(it_metric(ctl.admin_port, "kvmesh_controller_heartbeats_total"), 1);

    /* level 1: the worker evicts and acknowledges */
    cr_assert_eq(recover(&ctl, "w0", 1), 0);
    wait_history(&ctl, "w0", 1, "operator", 5000);
    cr_assert_eq(it_metric(ctl.admin_port,
                           "kvmesh_recovery_actions_total{worker=\"w0\",level=\"1\","
                           "reason=\"operator\"}"),
                 1);
    /* level 2: its heartbeats show fp8 */
    cr_assert_eq(recover(&ctl, "w0", 2), 0);
    wait_history(&ctl, "w0", 2, "operator", 5000);
    wait_format(&ctl, "w0", "fp8", 5000);
    wait_member(&ctl, "w0", KM_MEMBER_READY, 2, 1000);
    /* level 3: the worker drains and exits 75; restarted like a supervisor would, it is
     * re-admitted */
    cr_assert_eq(recover(&ctl, "w0", 3), 0);
    cr_assert_eq(it_wait_exit(&w, 15000), 75, "a drained worker exits with the restart code");
    wait_member(&ctl, "w0", KM_MEMBER_RESTARTING, 3, 2000);
    start_worker(&w, "w0", &ctl, NULL);
    wait_member(&ctl, "w0", KM_MEMBER_READY, 0, 10000);
    wait_history(&ctl, "w0", 0, "restarted", 2000);
    wait_history(&ctl, "w0", 3, "operator", 100);

    it_stop(&w);
    it_stop(&ctl);
}

Test(controller, a_rejected_frame_is_answered_with_its_id_and_a_bad_level_is_counted_as_such)
{
    if (!it_have((const char *const[]){IT_CONTROLLER, NULL})) return;
    proc ctl = {0};
    start_controller(&ctl, NULL, NULL);
    /* a bad level: admin_reply 400 naming the frame, counted as bad_level (checked before the
     * worker, so no worker is needed) */
    cr_assert_eq(recover_raw_level(&ctl, "nobody", 7), KM_CODE_BAD_REQUEST);
    cr_assert_eq(recover_raw_level(&ctl, "nobody", 0), KM_CODE_BAD_REQUEST);
    cr_assert_eq(
        it_metric(ctl.admin_port, "kvmesh_controller_bad_frames_total{reason=\"bad_level\"}"), 2);
    cr_assert_leq(
        it_metric(ctl.admin_port, "kvmesh_controller_bad_frames_total{reason=\"malformed\"}"), 0,
        "a bad level is not a malformed frame");

    /* a frame the decoder refuses (version 9) and one the controller does not take (a token):
     * `err` with each frame's own id */
    int code = 0;
    const char v9[] = "\x83\xa1v\x09\xa1t\xa3tok\xa2id\x37";
    cr_assert_eq(raw_error_id(&ctl, v9, sizeof v9 - 1, &code), 0x37);
    cr_assert_eq(code, KM_CODE_VERSION);
    km_msg tok;
    km_msg_init(&tok, KM_MSG_TOKEN);
    tok.tok.id = 4242;
    tok.tok.text = "x";
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&tok, NULL, &b, NULL), 0);
    cr_assert_eq(raw_error_id(&ctl, b.data, b.len, &code), 4242);
    cr_assert_eq(code, KM_CODE_BAD_REQUEST);
    km_buf_free(&b);
    it_stop(&ctl);
}

Test(controller, a_stopped_worker_goes_dead_and_comes_back)
{
    if (!have_binaries()) return;
    proc ctl = {0}, w = {0};
    start_controller(&ctl, NULL, NULL);
    start_worker(&w, "w1", &ctl, NULL);
    wait_member(&ctl, "w1", KM_MEMBER_READY, -1, 10000);
    kill(w.pid, SIGSTOP);
    wait_member(&ctl, "w1", KM_MEMBER_DEAD, -1, 5000);
    cr_assert_eq(it_metric(ctl.admin_port, "kvmesh_controller_members{state=\"dead\"}"), 1);
    kill(w.pid, SIGCONT);
    wait_member(&ctl, "w1", KM_MEMBER_READY, -1, 5000);
    it_stop(&w);
    it_stop(&ctl);
}

Test(controller, a_restarted_controller_rebuilds_the_view_from_heartbeats)
{
    if (!have_binaries()) return;
    proc ctl = {0}, w = {0};
    start_controller(&ctl, NULL, NULL);
    start_worker(&w, "w2", &ctl, NULL);
    wait_member(&ctl, "w2", KM_MEMBER_READY, 0, 10000);
    cr_assert_eq(recover(&ctl, "w2", 2), 0);
    wait_format(&ctl, "w2", "fp8", 5000);
    /* killed without warning, and started again on the same endpoint the worker knows */
    char listen[512];
    snprintf(listen, sizeof listen, "%s", ctl.listen);
    kill(ctl.pid, SIGKILL);
    it_wait_exit(&ctl, 2000);
    start_controller(&ctl, listen, NULL);
    wait_member(&ctl, "w2", KM_MEMBER_READY, 2, 5000);
    km_msg v;
    status(&ctl, &v);
    const km_view_worker *m = member(&v, "w2");
    cr_assert_str_eq(m->kv_format, "fp8");
    cr_assert_str_eq(m->requests, w.req);
    cr_assert_eq(m->n_history, 0, "a new controller starts with no history");
    km_msg_clear(&v);
    it_stop(&w);
    it_stop(&ctl);
}

Test(controller, pinned_pressure_fires_level1_then_level2_on_its_own)
{
    if (!have_binaries()) return;
    proc ctl = {0}, w = {0};
    const char *cflags[] = {"--cooldown=1s", NULL};
    start_controller(&ctl, NULL, cflags);
    const char *wflags[] = {"--chaos", NULL};
    start_worker(&w, "w3", &ctl, wflags);
    wait_member(&ctl, "w3", KM_MEMBER_READY, 0, 10000);
    /* the worker pins 95% of its hot budget in ballast pages (chaos command) */
    void *s = it_dealer(w.req);
    send_admin(s, KM_ADMIN_PRESSURE, NULL, 0, 0.95);
    km_msg r;
    recv_msg(s, &r, 20000);
    cr_assert_eq(r.type, KM_MSG_ADMIN_REPLY);
    cr_assert(r.admin_reply.ok, "pressure refused: %s",
              r.admin_reply.message ? r.admin_reply.message : "");
    km_msg_clear(&r);
    /* level 1 (eviction cannot free pinned pages), then level 2 after the cooldown; fp8 halves
     * the ballast, so the pressure falls below high and nothing more happens */
    wait_history(&ctl, "w3", 1, "kv_pressure", 20000);
    wait_history(&ctl, "w3", 2, "kv_pressure", 30000); /* converting ~1000 pages takes seconds */
    wait_member(&ctl, "w3", KM_MEMBER_READY, 2, 5000);
    km_msg v;
    status(&ctl, &v);
    const km_view_worker *m = member(&v, "w3");
    cr_assert_str_eq(m->kv_format, "fp8");
    cr_assert_lt(m->pressure, 0.9);
    km_msg_clear(&v);
    /* release the ballast */
    send_admin(s, KM_ADMIN_PRESSURE, NULL, 0, 0);
    recv_msg(s, &r, 20000);
    km_msg_clear(&r);
    km_zsock_close(s);
    it_stop(&w);
    it_stop(&ctl);
}

/* Issue 39: a drain with no disk tier and no peers loses the worker's cache; its log said only
 * pages_demoted=94 and `kvmesh recover` nothing. Now the worker's acknowledgement, which the
 * controller passes on to the operator, and its drain_done line say how many pages go. */
Test(controller, a_drain_that_loses_the_cache_says_how_many_pages)
{
    if (!have_binaries()) return;
    proc ctl = {0}, w = {0};
    start_controller(&ctl, NULL, NULL);
    start_worker(&w, "w0", &ctl, NULL);
    wait_member(&ctl, "w0", KM_MEMBER_READY, 0, 10000);
    /* a prompt of a few pages, cached once served */
    kvm_client *cl = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(kvm_open(w.req, NULL, &cl, &err), 0, "%s", err.msg);
    static int32_t toks[100];
    for (int i = 0; i < 100; i++) toks[i] = 300 + (i * 37) % 20000;
    km_msg_request q;
    kvm_request_init(&q);
    q.tokens = toks;
    q.n_tokens = 100;
    q.max_tokens = 2;
    q.temperature = 0;
    kvm_result res;
    cr_assert_eq(kvm_generate(cl, &q, NULL, NULL, &res, &err), 0, "%s", err.msg);
    kvm_result_free(&res);
    kvm_close(cl);

    void *s = it_dealer(ctl.listen);
    send_admin(s, KM_ADMIN_RECOVER, "w0", 3, 0);
    km_msg r;
    recv_msg(s, &r, 10000);
    km_zsock_close(s);
    cr_assert_eq(r.type, KM_MSG_ADMIN_REPLY);
    cr_assert(r.admin_reply.ok);
    const char *m = r.admin_reply.message ? r.admin_reply.message : "";
    const char *n = strstr(m, "draining: ");
    cr_assert(n && atoi(n + 10) >= 6 && strstr(m, "cached pages will be dropped"), "%s", m);
    km_msg_clear(&r);
    cr_assert_eq(it_wait_exit(&w, 15000), 75, "a drained worker exits with the restart code");
    char cmd[256];
    snprintf(cmd, sizeof cmd, "grep -o 'pages_dropped=[0-9]*' %s/worker.log", w.dir);
    FILE *f = popen(cmd, "r");
    char line[64] = "";
    cr_assert(f && fgets(line, sizeof line, f), "no pages_dropped in %s/worker.log", w.dir);
    pclose(f);
    cr_assert_geq(atoi(line + strlen("pages_dropped=")), 6, "%s", line);
    it_stop(&ctl);
}

Test(controller, flags_the_option_table_cannot_check_are_refused_with_exit_2)
{
    if (!it_have((const char *const[]){IT_CONTROLLER, NULL})) return;
    const struct {
        const char *flags, *says;
    } bad[] = {
        {"--recovery=maybe", "--recovery must be on or off"},
        {"--roles-follow-load=sometimes", "--roles-follow-load must be on or off"},
        {"--pressure-low=0.95 --pressure-high=0.9", "--pressure-low must not exceed"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "%s --admin-port=-1 --listen=tcp://127.0.0.1:0 %s", IT_CONTROLLER,
                 bad[i].flags);
        it_shell_expect(cmd, 2, bad[i].says);
    }
}
