/*
 * service_step.c — the engine step on a thread of its own (service_internal.h). Liveness is not
 * progress (issue 12): a prefill step near the end of a long context takes seconds on one loaded
 * thread, and an admin `status` that waited for it made a busy worker look hung to whoever asked.
 *
 * The scheduler runs over the service's en_sched_engine: its step (wk_svc_engine_step) posts the
 * batch to the step thread, which runs en_engine_step (the engine's thread pool included), and
 * meanwhile the loop keeps reading the ROUTER:
 *  - an authorized `status` without an event replay is answered at once, from the figures taken
 *    just before the step (wk_quick: state, KV format, running, queued, KV pages and bytes) and
 *    with the message "answered during an engine step";
 *  - an operator's `drain` or `shutdown` is answered at once too, with the state it will bring
 *    ("accepted during an engine step"), and held: it is carried out when the step is over, in
 *    its place among the frames, so a request that came before it is still admitted and one
 *    that came after it is refused as a drain refuses;
 *  - every other frame is held, in arrival order, up to WK_HELD_MAX (then the socket keeps the
 *    rest), and handled by the loop as soon as the step is over, before anything read later.
 *    Those are the commands whose answer says what they did to the store the step is using
 *    (evict, set_kv_format, pressure): their answer comes after the step, which the step
 *    budget bounds.
 * The step thread touches only the engine and the batch's KV; the loop, during the step, only
 * its sockets, the metrics and `quick`. So the scheduler, the store, the live requests and every
 * socket stay the loop's alone, and the step's results (tokens, ends) still leave from the loop
 * when en_sched_step returns. An eventfd wakes the loop's poll the moment the step is over: the
 * hand-off costs two thread wake-ups per step (tens of microseconds against milliseconds).
 * Controller commands (ctl_loop) are not read during a step: the controller does not wait for
 * their answers (it gives each --action-timeout), and its answer must leave after the heartbeat
 * snapshot shows the command's effect (service.c), which needs the store the step is using.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "worker/service_internal.h"

static void *wk_step_main(void *arg)
{
    wk_service *s = arg;
    pthread_mutex_lock(&s->step_mu);
    for (;;) {
        while (s->step_job != 1 && s->step_job != -1) pthread_cond_wait(&s->step_cv, &s->step_mu);
        if (s->step_job == -1) break;
        const en_batch *b = s->step_b;
        en_engine *e = s->step_e;
        pthread_mutex_unlock(&s->step_mu);
        const float *logits = NULL;
        int rc = en_engine_step(e, b, &logits);
        pthread_mutex_lock(&s->step_mu);
        s->step_rc = rc;
        s->step_logits = logits;
        s->step_job = 2;
        uint64_t one = 1;
        if (write(s->step_fd, &one, sizeof one) != sizeof one) { /* the loop also rechecks */
        }
    }
    pthread_mutex_unlock(&s->step_mu);
    return NULL;
}

int wk_svc_stepper_start(wk_service *s, km_errbuf *err)
{
    pthread_mutex_init(&s->step_mu, NULL);
    pthread_cond_init(&s->step_cv, NULL);
    s->step_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->step_fd < 0) return km_errf(err, KM_EIO, "step thread: eventfd: %s", strerror(errno));
    if (pthread_create(&s->step_thread, NULL, wk_step_main, s))
        return km_errf(err, KM_EIO, "step thread: cannot start it");
    s->step_started = true;
    return 0;
}

void wk_svc_stepper_stop(wk_service *s)
{
    if (s->step_started) {
        pthread_mutex_lock(&s->step_mu);
        s->step_job = -1;
        pthread_cond_signal(&s->step_cv);
        pthread_mutex_unlock(&s->step_mu);
        pthread_join(s->step_thread, NULL);
        s->step_started = false;
    }
    if (s->step_fd > 0) close(s->step_fd);
    s->step_fd = -1;
    for (int i = 0; i < WK_HELD_MAX; i++) km_zmsg_clear(&s->held[i]);
}

/* One ROUTER frame read during a step: answered now (status; drain and shutdown accepted) or
 * held. False when nothing more can be read now (socket empty, or the held frames fill their
 * room). */
static bool wk_step_read(wk_service *s)
{
    if (s->n_held >= WK_HELD_MAX) return false;
    int i = s->n_held;
    km_zmsg *zm = &s->held[i];
    int rc = km_zrecv(s->router, zm, 0, NULL);
    if (rc == KM_EAGAIN) return false;
    if (rc == KM_EPROTO) { /* as wk_pump_socket: counted, nothing held, read on */
        wk_svc_count_bad_from(s, WK_BAD_PARTS, &zm->peer);
        return true;
    }
    if (rc) return false;
    s->held_answered[i] = false;
    const km_zframe *body = km_zmsg_body(zm);
    km_msg m;
    if (body && !km_msg_decode(body->data, body->len, &s->lim, &m, NULL)) {
        /* status may come from members and operators, drain and shutdown from operators
         * (docs/security.md); a sender that may not is held, and answered 403 after the step
         * as always */
        bool status = m.type == KM_MSG_ADMIN && m.admin.cmd == KM_ADMIN_STATUS;
        unsigned roles = status ? KM_ROLE_MEMBER | KM_ROLE_OPERATOR : KM_ROLE_OPERATOR;
        bool answered = m.type == KM_MSG_ADMIN &&
                        !km_zsec_authorize(s->o.sec, &zm->peer, roles, NULL) &&
                        wk_svc_admin_quick(s, s->router, zm->part, zm->n - 1, &m.admin);
        km_msg_clear(&m);
        if (answered && status) return true;
        s->held_answered[i] = answered; /* drain, shutdown: carried out after the step */
    }
    s->n_held++;
    return true;
}

/* One step of engine e on the step thread, the loop reading meanwhile. */
static int wk_svc_step_on(wk_service *s, en_engine *e, const en_batch *b, const float **logits)
{
    if (!s->step_started || !s->router) return en_engine_step(e, b, logits);
    wk_svc_quick_take(s, &s->quick);
    pthread_mutex_lock(&s->step_mu);
    s->step_b = b;
    s->step_e = e;
    s->step_job = 1;
    pthread_cond_signal(&s->step_cv);
    pthread_mutex_unlock(&s->step_mu);
    for (;;) {
        pthread_mutex_lock(&s->step_mu);
        bool done = s->step_job == 2;
        pthread_mutex_unlock(&s->step_mu);
        if (done) break;
        km_zpollitem items[2] = {{.fd = s->step_fd, .events = KM_ZPOLLIN},
                                 {.sock = s->router, .events = KM_ZPOLLIN}};
        /* the ROUTER only while there is room to hold what it brings */
        int n = s->n_held < WK_HELD_MAX ? 2 : 1;
        if (km_zpoll(items, n, 1000, NULL) > 0 && n > 1 && (items[1].revents & KM_ZPOLLIN))
            for (int k = 0; k < 64 && wk_step_read(s); k++) {
            }
    }
    uint64_t v;
    if (read(s->step_fd, &v, sizeof v) < 0) { /* EAGAIN: already read */
    }
    pthread_mutex_lock(&s->step_mu);
    s->step_job = 0;
    int rc = s->step_rc;
    if (logits) *logits = s->step_logits;
    pthread_mutex_unlock(&s->step_mu);
    return rc;
}

int wk_svc_engine_step(void *ctx, const en_batch *b, const float **logits)
{
    wk_service *s = ctx;
    return wk_svc_step_on(s, s->e, b, logits);
}

int wk_svc_draft_step(void *ctx, const en_batch *b, const float **logits)
{
    wk_service *s = ctx;
    return wk_svc_step_on(s, s->o.draft, b, logits);
}

int wk_svc_is_eog(void *ctx, int32_t token)
{
    return md_tok_is_eog(((wk_service *)ctx)->tok, token);
}
