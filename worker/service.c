/*
 * service.c — the kvmesh-worker daemon around the scheduler (wk_service_*, worker.h): create and
 * destroy (sockets, events, metrics, admin HTTP), the loop, frames in, drain and shutdown. The
 * requests, the admin commands and the heartbeats are in service_requests.c, service_admin.c and
 * service_heartbeat.c (service_internal.h has the map).
 *
 * One thread, the loop, runs everything that touches the model, the store and the scheduler: it
 * takes the frames the gate hands it (gate.c, which owns the requests ROUTER), handles them, runs
 * one scheduler step with the engine inline (the engine's own pool does the heavy lifting), then
 * publishes the step's KV events and now and then refreshes gauges and the heartbeat snapshot.
 * Frames are handled between steps, never during one, so the store never changes under a frame.
 * Three threads never wait for a step: the gate answers `status` (and accepts drain and
 * shutdown) while the loop is inside one; the pulse (service_heartbeat.c) sends the heartbeats;
 * the admin HTTP server reads only the metrics registry and the atomic state. Steps are bounded
 * in time by the scheduler's step budget. docs/architecture.md draws the threads.
 *
 * Bad input (undecodable, oversized or wrongly typed frames, unknown models, out-of-range
 * values) gets an `err` reply with the request id when one can be read (km_msg.rejected_id), is
 * counted in kvmesh_worker_bad_frames_total, and touches nothing else.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "worker/service_internal.h"

/* ---------------------------------------------------------------- state */

static bool wk_ready_cb(void *user)
{
    wk_service *s = user;
    return wk_svc_state(s) == KM_STATE_READY;
}

/* ---------------------------------------------------------------- frames in */

/* True when the peer's role may not send m on the ROUTER: it was answered 403 and counted. */
static bool wk_forbidden(wk_service *s, void *sock, const km_zframe *env, int n_env,
                         const km_zpeer *peer, const km_msg *m)
{
    unsigned roles = KM_ROLE_MEMBER;
    uint64_t id = 0;
    if (m->type == KM_MSG_ADMIN) {
        id = m->admin.id;
        roles =
            m->admin.cmd == KM_ADMIN_STATUS ? KM_ROLE_MEMBER | KM_ROLE_OPERATOR : KM_ROLE_OPERATOR;
    } else if (m->type == KM_MSG_REQUEST) {
        id = m->req.id;
    } else if (m->type == KM_MSG_CANCEL) {
        id = m->cancel.id;
    }
    km_errbuf err = {{0}};
    if (!km_zsec_authorize(s->o.sec, peer, roles, &err)) return false;
    km_counter_inc(s->s_forbidden);
    KM_WARN("forbidden", "type=%s role=%s key=%s", km_msg_type_name(m->type),
            km_role_name(peer->role), peer->name);
    wk_svc_send_error(s, sock, env, n_env, id, KM_CODE_FORBIDDEN, 0, err.msg);
    return true;
}

/* A `req`: checked and tokenized (service_requests.c), then held while the pages of its pull
 * hint are pulled (service_peer.c) or admitted now. */
static void wk_request_in(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                          const km_zpeer *peer)
{
    uint64_t now = km_now_ns();
    const int32_t *toks;
    int n_tok;
    if (wk_svc_request_check(s, env, n_env, q, &toks, &n_tok)) return;
    if (q->pull_from && wk_peer_park(s, env, n_env, q, peer, toks, n_tok, now)) return;
    wk_svc_admit(s, env, n_env, q, toks, n_tok, now);
}

/* One message from the ROUTER (envelope + body) or from the controller DEALER (body only). */
static void wk_handle_message(wk_service *s, void *sock, const km_zmsg *zm)
{
    const km_zframe *body = km_zmsg_body(zm);
    if (!body) return;
    int n_env = zm->n - 1;
    const km_zframe *env = zm->part;
    km_msg m;
    km_errbuf err = {{0}};
    int rc = km_msg_decode(body->data, body->len, &s->lim, &m, &err);
    if (rc) {
        wk_bad b = rc == KM_ERANGE         ? WK_BAD_TOO_LARGE
                   : rc == KM_EUNSUPPORTED ? WK_BAD_VERSION
                                           : WK_BAD_MALFORMED;
        wk_svc_count_bad_from(s, b, sock == s->router ? &zm->peer : NULL);
        KM_DEBUG("bad_frame", "reason=%s bytes=%zu msg=\"%s\"", wk_bad_names[b], body->len,
                 err.msg);
        wk_svc_send_error(s, sock, env, n_env, m.rejected_id, km_proto_code_from_err(rc), 0,
                          err.msg);
        return;
    }
    /* Roles (docs/security.md): the controller's DEALER is pinned to its key; on the ROUTER,
     * requests come from members (routers), status from members and operators, and the other
     * admin commands from operators only. */
    if (sock == s->router && wk_forbidden(s, sock, env, n_env, &zm->peer, &m)) {
        km_msg_clear(&m);
        return;
    }
    switch (m.type) {
    case KM_MSG_REQUEST:
        wk_request_in(s, env, n_env, &m.req, sock == s->router ? &zm->peer : NULL);
        break;
    case KM_MSG_CANCEL: {
        wk_sreq *r = wk_svc_live_find(s, env, n_env, m.cancel.id);
        if (r)
            en_sched_cancel(s->sched, r->rid);
        else
            wk_peer_cancel(s, env, n_env, m.cancel.id); /* held for a pull */
        break;
    }
    case KM_MSG_ADMIN:
        /* A controller's command changes what the heartbeats report (an fp8 conversion of a
         * large cache takes seconds): no heartbeat from the state before it while it runs, as the
         * controller expects (its --action-timeout covers the silence); engine steps never hold
         * heartbeats back. */
        if (sock == s->ctl_loop) atomic_store(&s->in_command, 1);
        wk_svc_handle_admin(s, sock, env, n_env, &m.admin);
        atomic_store(&s->in_command, 0);
        if (s->ctl) wk_svc_snapshot(s); /* the next heartbeat shows what it changed */
        break;
    case KM_MSG_KV_PULL:
    case KM_MSG_KV_PULL_DONE:
    case KM_MSG_KV_PUSH:
    case KM_MSG_KV_WARM:
        wk_peer_handle(s, sock, env, n_env, &m);
        break;
    default: {
        char msg[128];
        snprintf(msg, sizeof msg, "a worker does not take '%s' frames", km_msg_type_name(m.type));
        wk_svc_count_bad_from(s, WK_BAD_TYPE, sock == s->router ? &zm->peer : NULL);
        wk_svc_send_error(s, sock, env, n_env, 0, KM_CODE_BAD_REQUEST, 0, msg);
    }
    }
    km_msg_clear(&m);
}

/* The frames the gate has queued, in their order, at most max. A drain or shutdown the gate
 * already answered during a step is carried out without a second reply. */
static void wk_take_frames(wk_service *s, int max)
{
    int flags;
    for (int i = 0; i < max && !s->stop_now && wk_gate_next(s->gate, &s->in, &flags); i++) {
        if (flags & WK_GATE_TOO_MANY_PARTS) {
            wk_svc_count_bad_from(s, WK_BAD_PARTS, &s->in.peer);
            continue;
        }
        s->reply_sent = flags & WK_GATE_ANSWERED;
        wk_handle_message(s, s->router, &s->in);
        s->reply_sent = false;
        if (flags & WK_GATE_ANSWERED) wk_gate_answered_done(s->gate);
    }
}

/* Reads what is waiting on sock (the controller's pair), at most max messages. */
static void wk_pump_socket(wk_service *s, void *sock, int max)
{
    for (int i = 0; i < max; i++) {
        int rc = km_zrecv(sock, &s->in, 0, NULL);
        if (rc == KM_EAGAIN) break;
        if (rc == KM_EPROTO) {
            wk_svc_count_bad_from(s, WK_BAD_PARTS, NULL);
            continue;
        }
        if (rc) break;
        wk_handle_message(s, sock, &s->in);
    }
    km_zmsg_clear(&s->in);
}

/* ---------------------------------------------------------------- create / destroy */

static int wk_write_ports(wk_service *s, km_errbuf *err)
{
    if (!s->o.ports_file) return 0;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", s->o.ports_file);
    FILE *f = fopen(tmp, "w");
    if (!f) return km_errf(err, KM_EIO, "cannot write %s", tmp);
    fprintf(f, "requests=%s\nevents=%s\nadmin=%s\npid=%d\n", s->ep_requests, s->ep_events,
            s->ep_admin, (int)getpid());
    int bad = fclose(f);
    if (bad || rename(tmp, s->o.ports_file))
        return km_errf(err, KM_EIO, "cannot write %s", s->o.ports_file);
    return 0;
}

int wk_service_create(en_model *m, en_engine *e, const wk_service_opts *o, wk_service **out,
                      km_errbuf *err)
{
    *out = NULL;
    wk_service *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "service: out of memory");
    s->m = m;
    s->e = e;
    s->kv = en_engine_kv(e);
    s->tok = en_model_tokenizer(m);
    s->o = *o;
    if (s->o.heartbeat_ms <= 0) s->o.heartbeat_ms = 1000;
    if (s->o.drain_timeout_ms <= 0) s->o.drain_timeout_ms = 30000;
    if (s->o.sched.max_running <= 0) s->o.sched.max_running = 64;
    if (s->o.sched.max_ctx <= 0) s->o.sched.max_ctx = 4096;
    s->start_ns = s->last_rate_ns = km_now_ns();
    s->kv_base = wk_svc_kv_format(s);
    atomic_init(&s->state, KM_STATE_STARTING);
    atomic_init(&s->hb_stop, 0);
    atomic_init(&s->in_command, 0);
    pthread_mutex_init(&s->hb_mu, NULL);
    if (o->worker_id)
        snprintf(s->worker_id, sizeof s->worker_id, "%s", o->worker_id);
    else
        snprintf(s->worker_id, sizeof s->worker_id, "worker-%d", (int)getpid());
    snprintf(s->model_name, sizeof s->model_name, "%s", en_model_name(m));
    snprintf(s->model_base, sizeof s->model_base, "%s", en_model_name(m));
    char *dot = strrchr(s->model_base, '.');
    if (dot) *dot = 0;
    en_model_fingerprint_hex(m, s->fp);
    km_proto_limits_default(&s->lim);
    if (o->max_frame > 0) s->lim.max_frame = (size_t)o->max_frame;
    int rc = wk_svc_metrics_init(s, err);
    if (rc) goto fail;
    en_sched_cb cb;
    wk_svc_callbacks(s, &cb);
    if ((rc = en_sched_create(e, m, &s->o.sched, &cb, &s->sched, err))) goto fail;
    if (o->draft) en_sched_set_draft(s->sched, o->draft); /* self-speculation */
    s->zctx = km_zctx_create();
    if (!s->zctx) {
        rc = km_errf(err, KM_EIO, "zmq: cannot create a context");
        goto fail;
    }
    km_zsock_opts zo;
    km_zsock_opts_default(&zo);
    zo.max_msg_size = (int64_t)s->lim.max_frame + 4096;
    if ((rc = km_sec_daemon_start(s->zctx, o->sec, s->reg, &s->zap, err))) goto fail;
    void *router = NULL; /* the gate's from wk_gate_start on */
    if ((rc = km_zsock_open(s->zctx, KM_ZROUTER, &zo, &router, err)) ||
        (rc = km_zsec_server(o->sec, router, KM_ROLE_MEMBER | KM_ROLE_OPERATOR, err)) ||
        (rc = km_zsock_bind(router, o->listen ? o->listen : "tcp://127.0.0.1:7100", err)) ||
        (rc = km_zsock_last_endpoint(router, s->ep_requests, sizeof s->ep_requests, err))) {
        km_zsock_close(router);
        goto fail;
    }
    if ((rc = wk_gate_start(s, router, err))) goto fail;
    void *pub = NULL;
    if (o->events && o->events[0]) {
        if ((rc = km_zsock_open(s->zctx, KM_ZPUB, NULL, &s->pub, err))) goto fail;
        if ((rc = km_zsec_server(o->sec, s->pub, KM_ROLE_MEMBER, err))) goto fail;
        if ((rc = km_zsock_bind(s->pub, o->events, err))) goto fail;
        if ((rc = km_zsock_last_endpoint(s->pub, s->ep_events, sizeof s->ep_events, err)))
            goto fail;
        pub = s->pub;
    }
    if ((rc = wk_events_create(s->kv, pub, s->worker_id, o->event_replay, &s->ev))) {
        km_errf(err, rc, "events: cannot allocate");
        goto fail;
    }
    if ((rc = wk_peer_create(s, err))) goto fail;
    if (o->controller && o->controller[0]) {
        km_zsock_opts co;
        km_zsock_opts_default(&co);
        /* no routing id of our own: the controller routes our commands to the connection our
         * heartbeats arrive on (controller.c, ctl_route) */
        co.sndhwm = 8; /* a heartbeat that cannot leave soon is stale: drop it */
        if ((rc = km_zsock_open(s->zctx, KM_ZDEALER, &co, &s->ctl, err))) goto fail;
        if ((rc = km_zsec_client(o->sec, s->ctl, "controller", err))) goto fail;
        if ((rc = km_zsock_connect(s->ctl, o->controller, err))) goto fail;
    }
    if (o->admin_port >= 0) {
        km_admin_opts ao = {.host = o->admin_host,
                            .port = o->admin_port,
                            .metrics = s->reg,
                            .ready = wk_ready_cb,
                            .user = s};
        if ((rc = km_admin_start(&ao, &s->admin, err))) goto fail;
        snprintf(s->ep_admin, sizeof s->ep_admin, "http://%s:%d",
                 o->admin_host ? o->admin_host : "127.0.0.1", km_admin_port(s->admin));
    }
    *out = s;
    return 0;
fail:
    wk_service_destroy(s);
    return rc;
}

void wk_service_destroy(wk_service *s)
{
    if (!s) return;
    wk_gate_stop(s); /* the loop's last replies leave first */
    wk_svc_pulse_stop(s);
    km_admin_stop(s->admin);
    if (s->ballast) kv_seq_destroy(s->kv, s->ballast);
    if (s->sched) en_sched_destroy(s->sched);
    wk_svc_grammars_free(s);
    for (int i = 0; i < s->n_live; i++) wk_svc_sreq_free(s->live[i]);
    free(s->live);
    wk_peer_destroy(s);
    wk_events_destroy(s->ev);
    int linger = 500; /* let the last events leave */
    if (s->pub) zmq_setsockopt(s->pub, ZMQ_LINGER, &linger, sizeof linger);
    km_zsock_close(s->pub);
    km_zsock_close(s->ctl);
    if (s->ctl_loop) zmq_close(s->ctl_loop);
    if (s->ctl_pulse) zmq_close(s->ctl_pulse);
    km_zap_stop(s->zap);
    if (s->zctx) km_zctx_destroy(s->zctx);
    km_metrics_destroy(s->reg);
    km_buf_free(&s->out);
    km_zmsg_clear(&s->in);
    free(s->tokbuf);
    pthread_mutex_destroy(&s->hb_mu);
    free(s);
}

void wk_service_signal(wk_service *s, int signo)
{
    (void)signo;
    s->signals = s->signals + 1;
}

/* ---------------------------------------------------------------- the loop */

/* How long a drained worker with a transfer node waits for the first kv_pull of a request it
 * handed back (the router migrates it, the next worker asks for its pages), and at most how long
 * it lingers serving them. */
enum { WK_LINGER_QUIET_MS = 1000, WK_LINGER_MAX_MS = 5000 };
/* When a lingering worker looks for peers that pulled none of the chains it pushed them
 * (wk_peer_handoff_again): a live peer starts its first pull within milliseconds. */
enum { WK_LINGER_AGAIN_MS = 500 };

/* End of a drain, step 1: hand back what is left, and hand the cached chains to the peers
 * (wk_peer_handoff: they pull them). With requests handed back or chains pushed the worker
 * lingers (state stopping: nothing new is routed to it) while the workers those requests migrate
 * to pull their pages, so they continue without recomputing the prompt (migration with KV,
 * docs/transfer.md), and while the peers pull the chains; wk_end_drain follows when no pull is
 * left or after WK_LINGER_MAX_MS. */
static void wk_end_drain(wk_service *s);
static void wk_finish_drain(wk_service *s)
{
    wk_peer_admit_all(s); /* held for a pull: handed back below like every other request */
    int left = en_sched_pending(s->sched);
    if (left)
        en_sched_abort_all(s->sched, KM_CODE_UNAVAILABLE,
                           "worker drained: request handed back for migration");
    s->handed_back = left;
    int pushed = wk_peer_handoff(s);
    if ((left || pushed) && s->peer) {
        wk_events_pump(s->ev); /* the pages those requests published, for every router */
        wk_svc_set_state(s, KM_STATE_STOPPING);
        s->linger_start_ns = km_now_ns();
        s->linger_until_ns = s->linger_start_ns + wk_ms_ns(WK_LINGER_MAX_MS);
        KM_INFO("drain_linger", "worker=%s handed_back=%d chains_pushed=%d max_ms=%d", s->worker_id,
                left, pushed, WK_LINGER_MAX_MS);
        return;
    }
    wk_end_drain(s);
}

/* End of a drain, step 2: persist the cached pages, stop. With a disk tier every page still in
 * RAM (hot or host: both die with the process) gets a disk copy, parents first, within the disk
 * budget and what is left of the drain's time (at least 2 s more), so the next process
 * re-indexes them and comes back warm. Without one, hot pages are demoted to host RAM as before
 * (it only helps a process that is not about to exit, but costs nothing). */
static void wk_end_drain(wk_service *s)
{
    int left = s->handed_back;
    s->linger_until_ns = 0;
    wk_svc_ballast_release(s);
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    int moved, persisted = 0;
    int ram = (int)(st.tier[KV_TIER_HOT].pages + st.tier[KV_TIER_HOST].pages);
    if (st.tier[KV_TIER_DISK].budget) {
        uint64_t now = km_now_ns(), until = now + wk_ms_ns(2000);
        if (s->drain_deadline_ns > until) until = s->drain_deadline_ns;
        moved = kv_store_persist(s->kv, until);
        persisted = 1;
    } else {
        moved = kv_store_evict_oldest_fraction(s->kv, 1.0);
    }
    wk_events_pump(s->ev);
    wk_svc_set_state(s, KM_STATE_STOPPING);
    KM_INFO("drain_done", "worker=%s handed_back=%d %s=%d pages_dropped=%d", s->worker_id, left,
            persisted ? "pages_persisted" : "pages_demoted", moved,
            wk_svc_drain_dropped(s, ram, persisted ? moved : -1));
    s->stop_now = true;
    s->exit_code = WK_EXIT_RESTART;
}

/* Requests held, or chunks of ended ones waiting to be stored (done between requests, as steps). */
static int wk_has_work(wk_service *s)
{
    return en_sched_pending(s->sched) || en_sched_chunks_waiting(s->sched);
}

/* One scheduler step, the engine inline. Before it, the scheduler admits what it will run and
 * the figures a `status` during the step reports are handed to the gate; frames that came
 * meanwhile are handled first (a few rounds at most), so that none waits for the step. */
static void wk_step(wk_service *s)
{
    for (int round = 0;; round++) {
        en_sched_prepare(s->sched);
        wk_quick q = {.state_after = -1};
        wk_svc_quick_take(s, &q);
        if (wk_gate_step_begin(s->gate, &q, round >= 3)) break;
        wk_take_frames(s, WK_GATE_QUEUE);
        if (s->stop_now || !wk_has_work(s)) return;
    }
    uint64_t t0 = km_now_ns();
    int rc = en_sched_step(s->sched);
    wk_gate_step_end(s->gate);
    if (rc > 0) {
        km_counter_inc(s->s_steps);
        km_hist_observe(s->s_step_time, (km_now_ns() - t0) / 1e9);
        if (s->ctl) wk_svc_snapshot(s); /* progress, for the next heartbeat */
    } else if (rc < 0) {
        KM_ERROR("step_failed", "err=%s", km_strerror(rc));
    }
}

int wk_service_run(wk_service *s)
{
    km_errbuf err = {{0}};
    wk_events_pump(s->ev); /* the disk tier's pages, re-indexed at open */
    wk_svc_set_state(s, KM_STATE_READY);
    if (wk_svc_pulse_start(s, &err)) {
        KM_ERROR("heartbeat", "msg=\"%s\"", err.msg);
        return 1;
    }
    if (wk_write_ports(s, &err)) KM_WARN("ports_file", "msg=\"%s\"", err.msg);
    KM_INFO("worker_ready", "worker=%s requests=%s events=%s admin=%s model=%s", s->worker_id,
            s->ep_requests, s->ep_events[0] ? s->ep_events : "-",
            s->ep_admin[0] ? s->ep_admin : "-", s->model_base);
    int handled_signals = 0;
    while (!s->stop_now) {
        int sig = s->signals;
        if (sig != handled_signals) {
            handled_signals = sig;
            if (sig >= 2 || wk_svc_state(s) != KM_STATE_READY) {
                KM_INFO("signal_stop", "worker=%s", s->worker_id);
                en_sched_abort_all(s->sched, KM_CODE_UNAVAILABLE, "worker stopping");
                s->exit_code = WK_EXIT_RESTART;
                break;
            }
            wk_svc_start_drain(s, 0, "signal");
        }
        uint64_t now = km_now_ns();
        int pending = wk_has_work(s);
        int timeout = 0;
        if (!pending) {
            int64_t to_gauge = (int64_t)(s->next_gauge_ns - now) / 1000000;
            timeout = to_gauge < 0 ? 0 : to_gauge > 100 ? 100 : (int)to_gauge;
            if ((wk_peer_held(s) || s->linger_until_ns) && timeout > 1)
                timeout = 1; /* pulls in flight, or pages being handed over */
        }
        km_zpollitem items[2 + WK_PEER_POLL_MAX] = {
            {.fd = wk_gate_fd(s->gate), .events = KM_ZPOLLIN},
            {.sock = s->ctl_loop, .events = KM_ZPOLLIN}};
        const int cap = (int)(sizeof items / sizeof items[0]);
        int n_items = s->ctl_loop ? 2 : 1;
        n_items += wk_peer_poll_items(s, items + n_items, cap - n_items); /* read by wk_peer_poll */
        int rc = km_zpoll(items, n_items, timeout, NULL);
        if (rc > 0) {
            if (items[0].revents & KM_ZPOLLIN) wk_take_frames(s, 256);
            if (s->ctl_loop && (items[1].revents & KM_ZPOLLIN)) wk_pump_socket(s, s->ctl_loop, 64);
        }
        if (s->stop_now) break;
        wk_peer_poll(s);
        if (wk_has_work(s)) wk_step(s);
        if (s->stop_now) break;
        int frames = wk_events_pump(s->ev);
        if (frames) km_counter_add(s->s_events, (uint64_t)frames);
        now = km_now_ns();
        if (wk_svc_state(s) == KM_STATE_DRAINING &&
            (!(en_sched_pending(s->sched) + wk_peer_held(s)) || now >= s->drain_deadline_ns))
            wk_finish_drain(s);
        else if (s->linger_until_ns && now - s->linger_start_ns >= wk_ms_ns(WK_LINGER_AGAIN_MS) &&
                 wk_peer_handoff_again(s) > 0)
            s->linger_start_ns = now; /* the quiet wait starts again for the peers now pulling */
        else if (s->linger_until_ns && (now >= s->linger_until_ns ||
                                        (now - s->linger_start_ns >= wk_ms_ns(WK_LINGER_QUIET_MS) &&
                                         !wk_peer_serving(s, now, wk_ms_ns(WK_LINGER_QUIET_MS)))))
            wk_end_drain(s);
        if (now >= s->next_gauge_ns) {
            wk_svc_update_gauges(s);
            if (s->ctl) wk_svc_snapshot(s);
            s->next_gauge_ns = now + wk_ms_ns(250);
        }
    }
    wk_peer_admit_all(s);
    if (en_sched_pending(s->sched))
        en_sched_abort_all(s->sched, KM_CODE_UNAVAILABLE, "worker stopping");
    wk_svc_set_state(s, KM_STATE_STOPPING);
    wk_events_pump(s->ev);
    wk_svc_update_gauges(s);
    wk_svc_pulse_stop(s); /* its last heartbeat tells the controller it is stopping */
    return s->exit_code;
}
