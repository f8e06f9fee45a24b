/*
 * controller.c — the kvmesh-controller daemon around the policy (controller.h): one ZeroMQ
 * ROUTER that takes workers' heartbeats and admin replies and operators' admin frames, one PUB
 * that publishes the cluster view, the admin HTTP server (/metrics, /healthz, /readyz).
 *
 * One thread and one zmq_poll: a heartbeat per worker per second and a handful of operator
 * frames are far below what needs more, and one thread means the policy needs no lock.
 *
 * Workers are addressed by the routing id of the connection their last admitted heartbeat came
 * on (ctl_route): the ROUTER gives every connection its own id, and a heartbeat is admitted only
 * under the member key bound to its worker id, so no other key holder can have a worker's
 * commands sent to it (a worker-chosen routing id with ROUTER_HANDOVER let any member take a
 * worker's id over, and made the real worker's next heartbeats arrive under another id). A
 * restarted worker's first heartbeat moves its route to the new connection. The ROUTER is
 * router_mandatory so that a command to a connection that is gone fails at once and is counted
 * instead of vanishing.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "controller/controller.h"

/* Where a worker's commands go: the routing id its last admitted heartbeat came under. */
typedef struct ctl_route {
    char worker[KM_PROTO_MAX_NAME + 1];
    uint8_t rid[255]; /* ZeroMQ routing ids are 1..255 bytes */
    uint8_t len;
    uint64_t at_ms;
} ctl_route;

/* An operator's recover waiting for the worker's acknowledgement, so that the answer carries
 * what the worker said (a drain that will drop the cache says so); answered without it after
 * CTL_ACK_WAIT_MS. */
#define CTL_PENDING     16
#define CTL_ACK_WAIT_MS 3000
typedef struct ctl_pending {
    uint64_t action_id, admin_id, deadline_ms;
    uint8_t rid[255];
    uint8_t len;
    char text[160]; /* "level 3 sent to w0 (action 7)" */
} ctl_pending;

typedef struct ctl_logged {
    char id[KM_PROTO_MAX_NAME + 1];
    km_member_state state;
    bool seen;
} ctl_logged;

struct ctl_controller {
    ctl_config cfg;
    void *zctx, *router, *pub;
    km_zap *zap; /* the ZAP handler of zctx; NULL when insecure */
    km_admin *admin;
    km_metrics *reg;
    ctl_policy *pol;
    ctl_roles *roles;
    ctl_role_load *loads; /* [KM_PROTO_MAX_VIEW_WORKERS]: ctl_roles_step's input */
    volatile sig_atomic_t stop;
    volatile int running;
    char ep_listen[256], ep_view[256];
    uint64_t epoch_ms, view_seq, published_version;
    int64_t wall_minus_mono; /* read once, so a history entry's at_ms is the same in every view */
    km_proto_limits lim;
    km_zmsg in;
    km_buf out;
    /* view scratch: every member and its history */
    km_view_worker *vw;
    km_recovery_action *vh;
    ctl_logged *logged; /* every member known at the last note_changes, with the state logged */
    int n_logged;
    ctl_route *routes; /* [KM_PROTO_MAX_VIEW_WORKERS] */
    int n_routes;
    ctl_pending pending[CTL_PENDING];
    int n_pending;
    /* metrics */
    km_metric *m_members, *m_actions, *m_bad, *m_role_changes;
    km_series *s_heartbeats, *s_send_errors, *s_views, *s_acks, *s_forgotten;
};

static uint64_t mono_ms(void)
{
    return km_now_ns() / 1000000ull;
}

void ctl_config_default(ctl_config *c)
{
    memset(c, 0, sizeof *c);
    c->controller_id = "controller";
    c->listen_url = "tcp://127.0.0.1:7200";
    c->view_url = "tcp://127.0.0.1:7201";
    c->view_interval_ms = 1000;
    c->admin_host = "127.0.0.1";
    c->admin_port = 9200;
    ctl_policy_cfg_default(&c->policy);
    ctl_roles_cfg_default(&c->roles);
}

static void count_bad(ctl_controller *c, const char *reason)
{
    const char *lv[1] = {reason};
    km_counter_inc(km_metric_series(c->m_bad, lv));
}

/* ---------------------------------------------------------------- replies */

static void send_to(ctl_controller *c, const km_zframe *id, const km_buf *body)
{
    km_zframe parts[2] = {*id, {body->data, body->len}};
    km_errbuf err = {{0}};
    if (km_zsend(c->router, parts, 2, KM_ZDONTWAIT, &err)) {
        km_counter_inc(c->s_send_errors);
        KM_DEBUG("reply_send", "msg=\"%s\"", err.msg);
    }
}

static void reply_error(ctl_controller *c, const km_zframe *id, uint64_t req_id, int code,
                        const char *msg)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ERROR);
    m.error.id = req_id;
    m.error.code = code;
    m.error.message = msg && msg[0] ? msg : km_proto_code_name(code);
    if (km_msg_encode(&m, &c->lim, &c->out, NULL) == 0) send_to(c, id, &c->out);
}

static void reply_admin(ctl_controller *c, const km_zframe *id, const km_msg_admin *a, int code,
                        const char *msg)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN_REPLY);
    m.admin_reply.id = a->id;
    m.admin_reply.cmd = a->cmd;
    m.admin_reply.ok = code == 0;
    m.admin_reply.code = code;
    m.admin_reply.message = msg && msg[0] ? msg : NULL;
    if (km_msg_encode(&m, &c->lim, &c->out, NULL) == 0) send_to(c, id, &c->out);
}

/* Holds the operator's answer to recover until the worker acknowledges action_id; false when
 * the table is full (the caller answers at once). */
static bool pending_add(ctl_controller *c, const km_zframe *id, const km_msg_admin *a,
                        uint64_t action_id, const char *text)
{
    if (c->n_pending == CTL_PENDING || !id->len || id->len > sizeof c->pending->rid) return false;
    ctl_pending *p = &c->pending[c->n_pending++];
    p->action_id = action_id;
    p->admin_id = a->id;
    p->deadline_ms = mono_ms() + CTL_ACK_WAIT_MS;
    memcpy(p->rid, id->data, id->len);
    p->len = (uint8_t)id->len;
    snprintf(p->text, sizeof p->text, "%.150s", text);
    return true;
}

/* Answers pending entry i (r: the worker's reply; NULL: none came in time) and drops it. */
static void pending_answer(ctl_controller *c, int i, const km_msg_admin_reply *r)
{
    ctl_pending *p = &c->pending[i];
    km_msg_admin a = {.id = p->admin_id, .cmd = KM_ADMIN_RECOVER};
    km_zframe id = {p->rid, p->len};
    char msg[KM_PROTO_MAX_MESSAGE];
    if (!r)
        snprintf(msg, sizeof msg, "%s; not acknowledged within %d ms (kvmesh status --controller)",
                 p->text, CTL_ACK_WAIT_MS);
    else
        snprintf(msg, sizeof msg, "%s; the worker %s%s%.700s", p->text,
                 r->ok ? "acknowledged it" : "refused it", r->message ? ": " : "",
                 r->message ? r->message : "");
    reply_admin(c, &id, &a, !r || r->ok ? 0 : (r->code ? r->code : KM_CODE_INTERNAL), msg);
    c->pending[i] = c->pending[--c->n_pending];
}

static void pending_expire(ctl_controller *c, uint64_t now)
{
    for (int i = c->n_pending - 1; i >= 0; i--)
        if (now >= c->pending[i].deadline_ms) pending_answer(c, i, NULL);
}

/* ---------------------------------------------------------------- view */

/* Encodes the view into c->out (history included when asked: status replies). */
static int encode_view(ctl_controller *c, bool with_history, km_errbuf *err)
{
    uint64_t now = mono_ms(), wall = (uint64_t)((int64_t)now + c->wall_minus_mono);
    int n = ctl_policy_n_members(c->pol);
    if (n > KM_PROTO_MAX_VIEW_WORKERS) n = KM_PROTO_MAX_VIEW_WORKERS;
    for (int i = 0; i < n; i++)
        ctl_policy_view_worker(c->pol, i, now, wall, with_history, &c->vw[i],
                               &c->vh[(size_t)i * KM_PROTO_MAX_HISTORY]);
    km_msg m;
    km_msg_init(&m, KM_MSG_VIEW);
    m.view.controller = c->cfg.controller_id;
    m.view.epoch = c->epoch_ms;
    m.view.seq = c->view_seq;
    m.view.workers = c->vw;
    m.view.n_workers = (uint32_t)n;
    return km_msg_encode(&m, &c->lim, &c->out, err);
}

static void publish_view(ctl_controller *c)
{
    c->view_seq++;
    km_errbuf err = {{0}};
    if (encode_view(c, false, &err)) {
        KM_WARN("view_encode", "msg=\"%s\"", err.msg);
        return;
    }
    km_zframe parts[2] = {{"view", 4}, {c->out.data, c->out.len}};
    if (km_zsend(c->pub, parts, 2, KM_ZDONTWAIT, &err) == 0) km_counter_inc(c->s_views);
    c->published_version = ctl_policy_version(c->pol);
}

/* Logs member joins, state transitions and members forgotten, and refreshes the per-state
 * gauges. Members are matched by id: a forgotten one moves the indexes of those after it. */
static void note_changes(ctl_controller *c)
{
    int n = ctl_policy_n_members(c->pol);
    uint64_t now = mono_ms();
    for (int k = 0; k < c->n_logged; k++) c->logged[k].seen = false;
    for (int i = 0; i < n; i++) {
        km_view_worker w;
        ctl_policy_view_worker(c->pol, i, now, 0, false, &w, NULL);
        int k = 0;
        while (k < c->n_logged && strcmp(c->logged[k].id, w.id)) k++;
        if (k == c->n_logged) {
            if (k == KM_PROTO_MAX_VIEW_WORKERS) continue;
            snprintf(c->logged[k].id, sizeof c->logged[k].id, "%s", w.id);
            c->logged[k].state = w.state;
            c->n_logged++;
            KM_INFO("member_join", "worker=%s state=%s requests=%s", w.id,
                    km_member_state_name(w.state), w.requests ? w.requests : "-");
        } else if (c->logged[k].state != w.state) {
            KM_INFO("member_state", "worker=%s from=%s to=%s level=%u", w.id,
                    km_member_state_name(c->logged[k].state), km_member_state_name(w.state),
                    w.level);
            c->logged[k].state = w.state;
        }
        c->logged[k].seen = true;
    }
    for (int k = 0; k < c->n_logged;) {
        if (c->logged[k].seen) {
            k++;
            continue;
        }
        KM_INFO("member_forgotten", "worker=%s silent_ms>=%lld", c->logged[k].id,
                (long long)c->cfg.policy.forget_after_ms);
        km_counter_inc(c->s_forgotten);
        c->logged[k] = c->logged[--c->n_logged];
    }
    for (int s = 0; s < KM_MEMBER_STATE_COUNT; s++) {
        const char *lv[1] = {km_member_state_name((km_member_state)s)};
        km_gauge_set(km_metric_series(c->m_members, lv),
                     ctl_policy_count(c->pol, (km_member_state)s));
    }
}

/* ---------------------------------------------------------------- routes */

static ctl_route *route_of(ctl_controller *c, const char *worker)
{
    for (int i = 0; i < c->n_routes; i++)
        if (!strcmp(c->routes[i].worker, worker)) return &c->routes[i];
    return NULL;
}

/* The worker whose commands go to routing id id, or NULL. */
static const char *route_owner(const ctl_controller *c, const km_zframe *id)
{
    for (int i = 0; i < c->n_routes; i++)
        if (c->routes[i].len == id->len && !memcmp(c->routes[i].rid, id->data, id->len))
            return c->routes[i].worker;
    return NULL;
}

/* An admitted heartbeat: the worker's commands go to the connection it came on. A full table
 * gives up the route updated longest ago (a member the policy has long forgotten). */
static void route_learn(ctl_controller *c, const char *worker, const km_zframe *id)
{
    if (!id->len || id->len > sizeof c->routes->rid) return;
    ctl_route *r = route_of(c, worker);
    if (!r && c->n_routes < KM_PROTO_MAX_VIEW_WORKERS) r = &c->routes[c->n_routes++];
    if (!r) {
        r = &c->routes[0];
        for (int i = 1; i < c->n_routes; i++)
            if (c->routes[i].at_ms < r->at_ms) r = &c->routes[i];
    }
    if (strcmp(r->worker, worker) || r->len != id->len || memcmp(r->rid, id->data, id->len))
        KM_DEBUG("worker_route", "worker=%s routing_id_bytes=%zu", worker, id->len);
    snprintf(r->worker, sizeof r->worker, "%s", worker);
    memcpy(r->rid, id->data, id->len);
    r->len = (uint8_t)id->len;
    r->at_ms = mono_ms();
}

/* ---------------------------------------------------------------- actions */

/* Sends a policy action to its worker; returns 0, or the send error (the member is restored). */
static int send_action(ctl_controller *c, const ctl_action *a)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN);
    m.admin.id = a->id;
    m.admin.cmd = a->cmd;
    m.admin.fraction = a->fraction;
    m.admin.format = a->format;
    km_errbuf err = {{0}};
    int rc = km_msg_encode(&m, &c->lim, &c->out, &err);
    if (!rc) {
        /* no heartbeat admitted yet: the worker's id, which is nobody's routing id */
        const ctl_route *rt = route_of(c, a->worker);
        km_zframe parts[2] = {
            {rt ? rt->rid : (const void *)a->worker, rt ? rt->len : strlen(a->worker)},
            {c->out.data, c->out.len}};
        rc = km_zsend(c->router, parts, 2, KM_ZDONTWAIT, &err);
    }
    char level[16];
    snprintf(level, sizeof level, "%u", a->level);
    const char *lv[3] = {a->worker, level, a->reason};
    km_counter_inc(km_metric_series(c->m_actions, lv));
    if (rc) {
        km_counter_inc(c->s_send_errors);
        ctl_policy_send_failed(c->pol, a);
        KM_WARN("recovery", "worker=%s level=%u reason=%s pressure=%.3f cmd=%s sent=0 msg=\"%s\"",
                a->worker, a->level, a->reason, a->pressure, km_admin_cmd_name(a->cmd), err.msg);
        return rc;
    }
    KM_INFO("recovery", "worker=%s level=%u reason=%s pressure=%.3f cmd=%s%s%s sent=1 id=%llu",
            a->worker, a->level, a->reason, a->pressure, km_admin_cmd_name(a->cmd),
            a->format ? " format=" : "", a->format ? a->format : "", (unsigned long long)a->id);
    return 0;
}

/* Roles follow the load (roles.c): one step over every member's load; a change it decides is
 * sent as an admin set_role, logged with the figures it was decided on and counted. */
static void roles_step(ctl_controller *c, uint64_t now)
{
    int n = ctl_policy_n_members(c->pol);
    if (n > KM_PROTO_MAX_VIEW_WORKERS) n = KM_PROTO_MAX_VIEW_WORKERS;
    for (int i = 0; i < n; i++) ctl_policy_role_load(c->pol, i, &c->loads[i]);
    ctl_role_change ch;
    if (ctl_roles_step(c->roles, c->loads, n, now, &ch) != 1) return;
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN);
    m.admin.id = ch.id;
    m.admin.cmd = KM_ADMIN_SET_ROLE;
    m.admin.role = km_worker_role_name(ch.to);
    km_errbuf err = {{0}};
    int rc = km_msg_encode(&m, &c->lim, &c->out, &err);
    const ctl_route *rt = route_of(c, ch.worker);
    if (!rc && !rt) rc = km_errf(&err, KM_ENOTFOUND, "no connection from the worker");
    if (!rc) {
        km_zframe parts[2] = {{rt->rid, rt->len}, {c->out.data, c->out.len}};
        rc = km_zsend(c->router, parts, 2, KM_ZDONTWAIT, &err);
    }
    const char *from = km_worker_role_name(ch.from), *to = km_worker_role_name(ch.to);
    if (rc) {
        km_counter_inc(c->s_send_errors);
        ctl_roles_done(c->roles, ch.id, false);
        KM_WARN("role_change", "worker=%s from=%s to=%s reason=%s sent=0 msg=\"%s\"", ch.worker,
                from, to, ch.reason, err.msg);
        return;
    }
    const char *lv[2] = {from, to};
    km_counter_inc(km_metric_series(c->m_role_changes, lv));
    KM_INFO("role_change",
            "worker=%s from=%s to=%s reason=%s prefill_workers=%d decode_workers=%d "
            "prefill_load=%.2f decode_load=%.2f ttft_p90_ms=%.1f itl_p90_ms=%.1f sent=1 id=%llu",
            ch.worker, from, to, ch.reason, ch.n_prefill, ch.n_decode, ch.prefill_load,
            ch.decode_load, ch.ttft_ms, ch.itl_ms, (unsigned long long)ch.id);
}

/* ---------------------------------------------------------------- frames */

static void handle_operator(ctl_controller *c, const km_zframe *id, const km_msg_admin *a)
{
    char msg[KM_PROTO_MAX_MESSAGE];
    switch (a->cmd) {
    case KM_ADMIN_STATUS: {
        km_errbuf err = {{0}};
        if (encode_view(c, true, &err)) {
            reply_admin(c, id, a, KM_CODE_INTERNAL, err.msg);
            return;
        }
        send_to(c, id, &c->out);
        return;
    }
    case KM_ADMIN_RECOVER: {
        ctl_action act;
        int rc = ctl_policy_force(c->pol, a->worker, a->level, mono_ms(), &act);
        if (rc == KM_ENOTFOUND) {
            snprintf(msg, sizeof msg, "unknown worker '%.200s'", a->worker ? a->worker : "");
            count_bad(c, "unknown_worker");
            reply_admin(c, id, a, KM_CODE_NOT_FOUND, msg);
            return;
        }
        if (rc) {
            snprintf(msg, sizeof msg, "recover.level must be 1, 2 or 3 (got %u)", a->level);
            count_bad(c, "bad_level");
            reply_admin(c, id, a, KM_CODE_BAD_REQUEST, msg);
            return;
        }
        if (send_action(c, &act)) {
            snprintf(msg, sizeof msg, "worker '%.200s' is not connected to the controller",
                     act.worker);
            reply_admin(c, id, a, KM_CODE_UNAVAILABLE, msg);
            return;
        }
        snprintf(msg, sizeof msg, "level %u sent to %.120s (action %llu)", act.level, act.worker,
                 (unsigned long long)act.id);
        if (!pending_add(c, id, a, act.id, msg)) reply_admin(c, id, a, 0, msg);
        return;
    }
    default:
        snprintf(msg, sizeof msg, "the controller takes admin status and recover, not '%s'",
                 km_admin_cmd_name(a->cmd));
        count_bad(c, "bad_command");
        reply_admin(c, id, a, KM_CODE_BAD_REQUEST, msg);
    }
}

/* True when the sender's key may not send m (docs/security.md): counted, logged and, for an
 * admin command, answered 403. A heartbeat needs the member key bound to its worker id (its
 * connection then becomes the worker's route, ctl_route); an admin_reply the member key of the
 * worker routed to that connection; recover an operator. */
static bool forbidden(ctl_controller *c, const km_zframe *id, const char *peer_id,
                      const km_zpeer *peer, const km_msg *m)
{
    const km_zsec *z = c->cfg.sec;
    km_errbuf err = {{0}};
    int rc = 0;
    switch (m->type) {
    case KM_MSG_HEARTBEAT:
        rc = km_zsec_check_worker(z, peer, m->hb.worker, &err);
        break;
    case KM_MSG_ADMIN_REPLY:
        rc = peer_id[0] ? km_zsec_check_worker(z, peer, peer_id, &err)
                        : km_errf(&err, KM_EACCES, "a reply from a connection no worker beats on");
        break;
    case KM_MSG_ADMIN:
        rc = km_zsec_authorize(z, peer,
                               m->admin.cmd == KM_ADMIN_STATUS ? KM_ROLE_MEMBER | KM_ROLE_OPERATOR
                                                               : KM_ROLE_OPERATOR,
                               &err);
        break;
    default:
        break;
    }
    if (!rc) return false;
    count_bad(c, "forbidden");
    KM_WARN("forbidden", "type=%s role=%s key=%s routing_id=%s msg=\"%s\"",
            km_msg_type_name(m->type), km_role_name(peer->role), peer->name, peer_id, err.msg);
    if (m->type == KM_MSG_ADMIN) reply_admin(c, id, &m->admin, KM_CODE_FORBIDDEN, err.msg);
    return true;
}

static void handle_message(ctl_controller *c, const km_zmsg *zm)
{
    if (zm->n < 2) {
        count_bad(c, "parts");
        return;
    }
    const km_zframe *id = &zm->part[0];
    const km_zframe *body = km_zmsg_body(zm);
    km_msg m;
    km_errbuf err = {{0}};
    int rc = km_msg_decode(body->data, body->len, &c->lim, &m, &err);
    if (rc) {
        count_bad(c, rc == KM_ERANGE         ? "too_large"
                     : rc == KM_EUNSUPPORTED ? "version"
                                             : "malformed");
        KM_DEBUG("bad_frame", "bytes=%zu msg=\"%s\"", body->len, err.msg);
        reply_error(c, id, m.rejected_id, km_proto_code_from_err(rc), err.msg);
        return;
    }
    /* the worker this connection is the route of ("" for operators and unknown connections) */
    char peer[KM_PROTO_MAX_NAME + 1] = "";
    const char *owner = route_owner(c, id);
    if (owner) snprintf(peer, sizeof peer, "%s", owner);
    if (forbidden(c, id, peer, &zm->peer, &m)) {
        km_msg_clear(&m);
        return;
    }
    switch (m.type) {
    case KM_MSG_HEARTBEAT: {
        km_counter_inc(c->s_heartbeats);
        route_learn(c, m.hb.worker, id);
        ctl_action act;
        rc = ctl_policy_heartbeat(c->pol, &m.hb, mono_ms(), &act);
        if (rc == 1)
            send_action(c, &act);
        else if (rc == KM_ENOSPC) {
            count_bad(c, "members_full");
            KM_WARN("members_full", "worker=%s max=%d", m.hb.worker, KM_PROTO_MAX_VIEW_WORKERS);
        }
        break;
    }
    case KM_MSG_ADMIN_REPLY: {
        const km_msg_admin_reply *r = &m.admin_reply;
        if (ctl_policy_ack(c->pol, peer, r->id, r->ok) == 0) {
            km_counter_inc(c->s_acks);
            KM_INFO("recovery_ack", "worker=%s id=%llu ok=%d cmd=%s msg=\"%s\"", peer,
                    (unsigned long long)r->id, (int)r->ok, km_admin_cmd_name(r->cmd),
                    r->message ? r->message : "");
            for (int i = 0; i < c->n_pending; i++)
                if (c->pending[i].action_id == r->id) {
                    pending_answer(c, i, r);
                    break;
                }
        } else if (ctl_roles_done(c->roles, r->id, r->ok) == 0) {
            km_counter_inc(c->s_acks);
            KM_INFO("role_change_ack", "worker=%s id=%llu ok=%d msg=\"%s\"", peer,
                    (unsigned long long)r->id, (int)r->ok, r->message ? r->message : "");
        } else {
            KM_DEBUG("stray_reply", "peer=%s id=%llu", peer, (unsigned long long)r->id);
        }
        break;
    }
    case KM_MSG_ADMIN:
        handle_operator(c, id, &m.admin);
        break;
    case KM_MSG_ERROR:
        /* a worker refusing one of our frames: nothing to answer (answering could loop) */
        count_bad(c, "peer_error");
        KM_WARN("peer_error", "peer=%s code=%d msg=\"%s\"", peer, m.error.code,
                m.error.message ? m.error.message : "");
        break;
    default: {
        char msg[160];
        snprintf(msg, sizeof msg, "the controller does not take '%s' frames",
                 km_msg_type_name(m.type));
        count_bad(c, "type");
        reply_error(c, id, km_msg_id(&m), KM_CODE_BAD_REQUEST, msg);
    }
    }
    km_msg_clear(&m);
}

/* ---------------------------------------------------------------- create / run */

static bool ctl_ready(void *user)
{
    const ctl_controller *c = user;
    return c->running;
}

static int metrics_init(ctl_controller *c, km_errbuf *err)
{
    int rc = km_metrics_create(&c->reg);
    if (rc) return km_errf(err, rc, "metrics: cannot create the registry");
    km_metric *m;
#define REG(kind, name, help, labels, dst)                                                         \
    do {                                                                                           \
        rc = km_metric_register(c->reg, kind, name, help, labels, NULL, 0, &m, err);               \
        if (rc) return rc;                                                                         \
        dst;                                                                                       \
    } while (0)
    REG(KM_GAUGE, "kvmesh_controller_members", "Cluster members, by state.", "state",
        c->m_members = m);
    REG(KM_COUNTER, "kvmesh_recovery_actions_total",
        "Recovery actions sent (or tried), by worker, level (0 = fp8 reverted) and reason.",
        "worker,level,reason", c->m_actions = m);
    REG(KM_COUNTER, "kvmesh_controller_role_changes_total",
        "Workers moved between the prefill and decode pools by the controller (roles follow the "
        "load), by role before and after.",
        "from,to", c->m_role_changes = m);
    REG(KM_COUNTER, "kvmesh_controller_heartbeats_total", "Heartbeats received.", NULL,
        c->s_heartbeats = km_metric_series(m, NULL));
    REG(KM_COUNTER, "kvmesh_controller_bad_frames_total",
        "Frames refused (malformed, too_large, version, type, parts, bad_command, bad_level, "
        "unknown_worker, members_full, peer_error, forbidden: a key whose role or worker binding "
        "may not send it).",
        "reason", c->m_bad = m);
    REG(KM_COUNTER, "kvmesh_controller_send_errors_total",
        "Frames that could not be sent (worker not connected, queue full).", NULL,
        c->s_send_errors = km_metric_series(m, NULL));
    REG(KM_COUNTER, "kvmesh_controller_acks_total", "Workers' replies matched to an action.", NULL,
        c->s_acks = km_metric_series(m, NULL));
    REG(KM_COUNTER, "kvmesh_controller_members_forgotten_total",
        "Members removed after --forget-after without a heartbeat.", NULL,
        c->s_forgotten = km_metric_series(m, NULL));
    REG(KM_COUNTER, "kvmesh_controller_views_total", "Views published.", NULL,
        c->s_views = km_metric_series(m, NULL));
#undef REG
    for (int s = 0; s < KM_MEMBER_STATE_COUNT; s++) {
        const char *lv[1] = {km_member_state_name((km_member_state)s)};
        km_gauge_set(km_metric_series(c->m_members, lv), 0);
    }
    return 0;
}

int ctl_controller_create(const ctl_config *cfg, ctl_controller **out, km_errbuf *err)
{
    *out = NULL;
    ctl_controller *c = calloc(1, sizeof *c);
    if (!c) return km_errf(err, KM_ENOMEM, "controller: out of memory");
    c->cfg = *cfg;
    if (!c->cfg.controller_id || !c->cfg.controller_id[0]) c->cfg.controller_id = "controller";
    if (c->cfg.view_interval_ms <= 0) c->cfg.view_interval_ms = 1000;
    km_proto_limits_default(&c->lim);
    c->epoch_ms = km_wall_ms();
    c->wall_minus_mono = (int64_t)c->epoch_ms - (int64_t)mono_ms();
    int rc;
    c->vw = calloc(KM_PROTO_MAX_VIEW_WORKERS, sizeof *c->vw);
    c->vh = calloc((size_t)KM_PROTO_MAX_VIEW_WORKERS * KM_PROTO_MAX_HISTORY, sizeof *c->vh);
    c->logged = calloc(KM_PROTO_MAX_VIEW_WORKERS, sizeof *c->logged);
    c->routes = calloc(KM_PROTO_MAX_VIEW_WORKERS, sizeof *c->routes);
    c->loads = calloc(KM_PROTO_MAX_VIEW_WORKERS, sizeof *c->loads);
    if (!c->vw || !c->vh || !c->logged || !c->routes || !c->loads) {
        rc = km_errf(err, KM_ENOMEM, "controller: out of memory");
        goto fail;
    }
    if ((rc = ctl_policy_create(&c->cfg.policy, KM_PROTO_MAX_VIEW_WORKERS, &c->pol))) {
        km_errf(err, rc, "policy: bad configuration (pressure-low must be <= pressure-high)");
        goto fail;
    }
    if ((rc = ctl_roles_create(&c->cfg.roles, &c->roles))) {
        km_errf(err, rc, "roles: bad configuration");
        goto fail;
    }
    if ((rc = metrics_init(c, err))) goto fail;
    c->zctx = km_zctx_create();
    if (!c->zctx) {
        rc = km_errf(err, KM_ENOMEM, "zmq: cannot create a context");
        goto fail;
    }
    km_zsock_opts ro;
    km_zsock_opts_default(&ro);
    ro.router_mandatory = true;
    if ((rc = km_sec_daemon_start(c->zctx, c->cfg.sec, c->reg, &c->zap, err))) goto fail;
    if ((rc = km_zsock_open(c->zctx, KM_ZROUTER, &ro, &c->router, err))) goto fail;
    if ((rc = km_zsec_server(c->cfg.sec, c->router, KM_ROLE_MEMBER | KM_ROLE_OPERATOR, err)))
        goto fail;
    if ((rc = km_zsock_bind(c->router, c->cfg.listen_url, err))) goto fail;
    if ((rc = km_zsock_last_endpoint(c->router, c->ep_listen, sizeof c->ep_listen, err))) goto fail;
    if ((rc = km_zsock_open(c->zctx, KM_ZPUB, NULL, &c->pub, err))) goto fail;
    if ((rc = km_zsec_server(c->cfg.sec, c->pub, KM_ROLE_MEMBER | KM_ROLE_OPERATOR, err)))
        goto fail;
    if ((rc = km_zsock_bind(c->pub, c->cfg.view_url, err))) goto fail;
    if ((rc = km_zsock_last_endpoint(c->pub, c->ep_view, sizeof c->ep_view, err))) goto fail;
    if (c->cfg.admin_port >= 0) {
        km_admin_opts ao = {.host = c->cfg.admin_host,
                            .port = c->cfg.admin_port,
                            .metrics = c->reg,
                            .ready = ctl_ready,
                            .user = c};
        if ((rc = km_admin_start(&ao, &c->admin, err))) goto fail;
    }
    *out = c;
    return 0;
fail:
    ctl_controller_destroy(c);
    return rc;
}

void ctl_controller_stop(ctl_controller *c)
{
    if (c) c->stop = 1;
}

int ctl_controller_run(ctl_controller *c)
{
    const ctl_policy_cfg *pc = &c->cfg.policy;
    int64_t tick_ms = pc->heartbeat_ms / 4;
    if (tick_ms < 10) tick_ms = 10;
    if (tick_ms > 250) tick_ms = 250;
    c->running = 1;
    KM_INFO("controller_ready",
            "controller=%s listen=%s view=%s admin=%d recovery=%s pressure_high=%.2f "
            "pressure_low=%.2f cooldown_ms=%lld heartbeat_ms=%lld dead_after=%u "
            "roles_follow_load=%s ttft_target_ms=%lld itl_target_ms=%lld role_queue=%.1f "
            "role_window_ms=%lld role_hold_ms=%lld",
            c->cfg.controller_id, c->ep_listen, c->ep_view, ctl_controller_admin_port(c),
            pc->recovery ? "on" : "off", pc->pressure_high, pc->pressure_low,
            (long long)pc->cooldown_ms, (long long)pc->heartbeat_ms, pc->dead_after,
            c->cfg.roles.on ? "on" : "off", (long long)c->cfg.roles.ttft_target_ms,
            (long long)c->cfg.roles.itl_target_ms, c->cfg.roles.queue_target,
            (long long)c->cfg.roles.window_ms, (long long)c->cfg.roles.hold_ms);
    uint64_t now = mono_ms();
    uint64_t next_tick = now + (uint64_t)tick_ms;
    uint64_t next_view = now; /* an (empty) view at once: routers learn the controller is up */
    uint64_t noted_version = ~0ull;
    while (!c->stop) {
        now = mono_ms();
        uint64_t wake = next_tick < next_view ? next_tick : next_view;
        int timeout = wake > now ? (int)(wake - now) : 0;
        if (timeout > 100) timeout = 100;
        km_zpollitem items[1] = {{.sock = c->router, .events = KM_ZPOLLIN}};
        int rc = km_zpoll(items, 1, timeout, NULL);
        if (rc > 0 && (items[0].revents & KM_ZPOLLIN)) {
            for (int i = 0; i < 256; i++) {
                rc = km_zrecv(c->router, &c->in, 0, NULL);
                if (rc == KM_EAGAIN) break;
                if (rc == KM_EPROTO) {
                    count_bad(c, "parts");
                    continue;
                }
                if (rc) break;
                handle_message(c, &c->in);
            }
            km_zmsg_clear(&c->in);
        }
        now = mono_ms();
        if (now >= next_tick) {
            ctl_policy_tick(c->pol, now);
            pending_expire(c, now);
            roles_step(c, now);
            next_tick = now + (uint64_t)tick_ms;
        }
        uint64_t v = ctl_policy_version(c->pol);
        if (v != noted_version) {
            note_changes(c);
            noted_version = v;
        }
        if (v != c->published_version || now >= next_view) {
            publish_view(c);
            next_view = now + (uint64_t)c->cfg.view_interval_ms;
        }
    }
    c->running = 0;
    KM_INFO("controller_stop", "controller=%s members=%d", c->cfg.controller_id,
            ctl_policy_n_members(c->pol));
    return 0;
}

void ctl_controller_destroy(ctl_controller *c)
{
    if (!c) return;
    km_admin_stop(c->admin);
    km_zsock_close(c->router);
    km_zsock_close(c->pub);
    km_zap_stop(c->zap);
    km_zctx_destroy(c->zctx);
    ctl_policy_destroy(c->pol);
    ctl_roles_destroy(c->roles);
    km_metrics_destroy(c->reg);
    km_zmsg_clear(&c->in);
    km_buf_free(&c->out);
    free(c->vw);
    free(c->vh);
    free(c->logged);
    free(c->routes);
    free(c->loads);
    free(c);
}

int ctl_controller_listen_endpoint(const ctl_controller *c, char *buf, size_t cap)
{
    return snprintf(buf, cap, "%s", c->ep_listen) < (int)cap ? 0 : KM_ERANGE;
}

int ctl_controller_view_endpoint(const ctl_controller *c, char *buf, size_t cap)
{
    return snprintf(buf, cap, "%s", c->ep_view) < (int)cap ? 0 : KM_ERANGE;
}

int ctl_controller_admin_port(const ctl_controller *c)
{
    return c->admin ? km_admin_port(c->admin) : -1;
}
