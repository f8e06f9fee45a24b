/*
 * gate.c — the gate: the thread that owns the worker's requests ROUTER (service_internal.h).
 * Liveness is not progress (issue 12): a prefill step near the end of a long context takes
 * seconds, and a `status` that waited for it made a busy worker look hung. So the loop runs its
 * engine steps inline and never reads a socket during one; the gate reads the ROUTER all along.
 *
 *  - Every frame goes to the loop in arrival order through a queue of WK_GATE_QUEUE frames (each
 *    with its sender, km_zpeer, and its src_fd); an eventfd wakes the loop. When the queue is
 *    full the gate stops reading, and frames wait in the ROUTER (back-pressure, as before).
 *  - While the loop is inside a step, an authorized `status` is answered at once from the figures
 *    taken before the step; a `drain` or `shutdown` is accepted at once and still queued, marked,
 *    so the loop carries it out in its place among the frames.
 *  - What the loop sends (replies, tokens, event replays) goes through an inproc PAIR that the
 *    gate forwards to the ROUTER unchanged. Its high-water marks are off: the gate never waits on
 *    the loop, so the pair drains as fast as the ROUTER takes frames, and the ROUTER's per-peer
 *    limit drops what a slow peer cannot take, as it did when the loop sent directly.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "worker/service_internal.h"

typedef struct wk_gate_slot {
    km_zmsg zm;
    int flags; /* WK_GATE_* */
} wk_gate_slot;

struct wk_gate {
    wk_service *s; /* read-only here: options, limits, worker id, the atomic state */
    void *router;  /* the gate's alone */
    void *pair;    /* the gate's end of the pair; s->router is the loop's */
    int ready_fd;  /* eventfd: frames wait for the loop */
    int wake_fd;   /* eventfd: room in the queue again, or stop */
    pthread_t thread;
    bool started;
    atomic_int stop;
    pthread_mutex_t mu; /* guards what follows */
    wk_gate_slot q[WK_GATE_QUEUE];
    int head, n;
    bool in_step;
    wk_quick quick; /* the figures of the step the loop is in */
    int n_answered; /* frames answered here that the loop has not carried out yet */
    km_zmsg in;     /* the gate thread's: the frame being read */
    km_buf out;     /* the gate thread's: its own answers */
};

static void wk_fd_signal(int fd)
{
    uint64_t one = 1;
    if (write(fd, &one, sizeof one) != sizeof one) { /* full counter: already signalled */
    }
}

static void wk_fd_clear(int fd)
{
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0) { /* EAGAIN: nothing to clear */
    }
}

/* Moves what the loop sent on the pair (at most max messages) to the ROUTER, part by part,
 * without copying. A message the ROUTER refuses is dropped and counted (s->gate_send_errors). */
static void wk_gate_forward(wk_gate *g, int max)
{
    for (int i = 0; i < max; i++) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, g->pair, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&part);
            return;
        }
        bool failed = false;
        for (;;) {
            int more = zmq_msg_more(&part);
            if (!failed &&
                zmq_msg_send(&part, g->router, ZMQ_DONTWAIT | (more ? ZMQ_SNDMORE : 0)) < 0)
                failed = true;
            zmq_msg_close(&part); /* empty after a send */
            if (!more) break;
            zmq_msg_init(&part);
            if (zmq_msg_recv(&part, g->pair, 0) < 0) { /* the rest of a message is always there */
                zmq_msg_close(&part);
                failed = true;
                break;
            }
        }
        if (failed) atomic_fetch_add(&g->s->gate_send_errors, 1);
    }
}

/* During a step: answers g->in if it is an authorized status (true), or accepts a drain or
 * shutdown (*flags |= WK_GATE_ANSWERED; it is queued all the same). Under g->mu. */
static bool wk_gate_answer(wk_gate *g, int *flags)
{
    wk_service *s = g->s;
    const km_zframe *body = km_zmsg_body(&g->in);
    km_msg m;
    if (!body || km_msg_decode(body->data, body->len, &s->lim, &m, NULL)) return false;
    bool answered = false, status = false;
    if (m.type == KM_MSG_ADMIN) {
        /* status from members and operators, drain and shutdown from operators
         * (docs/security.md); anyone else is answered 403 by the loop, after the step */
        status = m.admin.cmd == KM_ADMIN_STATUS;
        unsigned roles = status ? KM_ROLE_MEMBER | KM_ROLE_OPERATOR : KM_ROLE_OPERATOR;
        answered = !km_zsec_authorize(s->o.sec, &g->in.peer, roles, NULL) &&
                   wk_svc_admin_quick(s, &g->quick, &m.admin, &g->out);
    }
    km_msg_clear(&m);
    if (!answered) return false;
    wk_gate_forward(g, 1 << 20); /* what the loop sent before stays before the answer */
    km_zframe parts[KM_ZMSG_MAX_PARTS];
    int n = 0;
    for (int i = 0; i + 1 < g->in.n; i++) parts[n++] = g->in.part[i];
    parts[n++] = (km_zframe){g->out.data, g->out.len};
    if (km_zsend(g->router, parts, n, KM_ZDONTWAIT, NULL))
        atomic_fetch_add(&g->s->gate_send_errors, 1);
    if (status) return true;
    *flags |= WK_GATE_ANSWERED;
    g->n_answered++;
    return false;
}

/* Reads the ROUTER while the queue has room (at most max frames). */
static void wk_gate_read(wk_gate *g, int max)
{
    for (int i = 0; i < max; i++) {
        int rc = km_zrecv(g->router, &g->in, 0, NULL);
        if (rc == KM_EAGAIN) return;
        if (rc && rc != KM_EPROTO) return;
        int flags = rc == KM_EPROTO ? WK_GATE_TOO_MANY_PARTS : 0; /* the loop counts it */
        pthread_mutex_lock(&g->mu);
        if (!flags && g->in_step && wk_gate_answer(g, &flags)) {
            pthread_mutex_unlock(&g->mu);
            continue;
        }
        wk_gate_slot *slot = &g->q[(g->head + g->n) % WK_GATE_QUEUE];
        km_zmsg t = slot->zm; /* the slot's buffer becomes the next read's */
        slot->zm = g->in;
        slot->flags = flags;
        g->in = t;
        bool was_empty = g->n++ == 0, full = g->n == WK_GATE_QUEUE;
        pthread_mutex_unlock(&g->mu);
        if (was_empty) wk_fd_signal(g->ready_fd);
        if (full) return;
    }
}

static void *wk_gate_main(void *arg)
{
    wk_gate *g = arg;
    while (!atomic_load(&g->stop)) {
        pthread_mutex_lock(&g->mu);
        bool room = g->n < WK_GATE_QUEUE;
        pthread_mutex_unlock(&g->mu);
        km_zpollitem items[3] = {{.sock = g->pair, .events = KM_ZPOLLIN},
                                 {.fd = g->wake_fd, .events = KM_ZPOLLIN},
                                 {.sock = g->router, .events = KM_ZPOLLIN}};
        if (km_zpoll(items, room ? 3 : 2, 1000, NULL) <= 0) continue;
        if (items[1].revents & KM_ZPOLLIN) wk_fd_clear(g->wake_fd);
        if (items[0].revents & KM_ZPOLLIN) wk_gate_forward(g, 256);
        if (room && (items[2].revents & KM_ZPOLLIN)) wk_gate_read(g, 64);
    }
    wk_gate_forward(g, 1 << 20); /* the loop's last replies */
    return NULL;
}

int wk_gate_start(wk_service *s, void *router, km_errbuf *err)
{
    wk_gate *g = calloc(1, sizeof *g);
    if (!g) {
        km_zsock_close(router);
        return km_errf(err, KM_ENOMEM, "gate: out of memory");
    }
    s->gate = g;
    g->s = s;
    g->router = router;
    g->ready_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    g->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_mutex_init(&g->mu, NULL);
    g->quick.state_after = -1;
    if (g->ready_fd < 0 || g->wake_fd < 0)
        return km_errf(err, KM_EIO, "gate: eventfd: %s", strerror(errno));
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://wk-gate-%p", (void *)g);
    g->pair = zmq_socket(s->zctx, ZMQ_PAIR);
    s->router = zmq_socket(s->zctx, ZMQ_PAIR);
    int zero = 0;
    if (!g->pair || !s->router || zmq_setsockopt(g->pair, ZMQ_RCVHWM, &zero, sizeof zero) ||
        zmq_setsockopt(s->router, ZMQ_SNDHWM, &zero, sizeof zero) || zmq_bind(g->pair, ep) ||
        zmq_connect(s->router, ep))
        return km_errf(err, KM_EIO, "gate: cannot open %s: %s", ep, zmq_strerror(zmq_errno()));
    if (pthread_create(&g->thread, NULL, wk_gate_main, g))
        return km_errf(err, KM_EIO, "gate: cannot start its thread");
    g->started = true;
    return 0;
}

void wk_gate_stop(wk_service *s)
{
    wk_gate *g = s->gate;
    if (!g) return;
    if (g->started) {
        atomic_store(&g->stop, 1);
        wk_fd_signal(g->wake_fd);
        pthread_join(g->thread, NULL);
    }
    int linger = 500; /* let the last replies leave */
    if (g->router) zmq_setsockopt(g->router, ZMQ_LINGER, &linger, sizeof linger);
    km_zsock_close(g->router);
    if (g->pair) zmq_close(g->pair);
    if (s->router) zmq_close(s->router);
    s->router = NULL;
    if (g->ready_fd >= 0) close(g->ready_fd);
    if (g->wake_fd >= 0) close(g->wake_fd);
    for (int i = 0; i < WK_GATE_QUEUE; i++) km_zmsg_clear(&g->q[i].zm);
    km_zmsg_clear(&g->in);
    km_buf_free(&g->out);
    pthread_mutex_destroy(&g->mu);
    free(g);
    s->gate = NULL;
}

int wk_gate_fd(const wk_gate *g)
{
    return g->ready_fd;
}

int wk_gate_next(wk_gate *g, km_zmsg *zm, int *flags)
{
    pthread_mutex_lock(&g->mu);
    if (!g->n) {
        wk_fd_clear(g->ready_fd); /* under the lock: the next frame signals again */
        pthread_mutex_unlock(&g->mu);
        return 0;
    }
    wk_gate_slot *slot = &g->q[g->head];
    km_zmsg t = slot->zm; /* the loop's buffer goes back into the ring */
    slot->zm = *zm;
    *zm = t;
    *flags = slot->flags;
    g->head = (g->head + 1) % WK_GATE_QUEUE;
    bool was_full = g->n-- == WK_GATE_QUEUE;
    pthread_mutex_unlock(&g->mu);
    if (was_full) wk_fd_signal(g->wake_fd); /* the gate reads the ROUTER again */
    return 1;
}

bool wk_gate_step_begin(wk_gate *g, const wk_quick *q, bool force)
{
    pthread_mutex_lock(&g->mu);
    bool go = force || !g->n;
    if (go) {
        int after = g->quick.state_after; /* accepted, not carried out yet */
        g->quick = *q;
        g->quick.state_after = after;
        g->in_step = true;
    }
    pthread_mutex_unlock(&g->mu);
    return go;
}

void wk_gate_step_end(wk_gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->in_step = false;
    pthread_mutex_unlock(&g->mu);
}

void wk_gate_answered_done(wk_gate *g)
{
    pthread_mutex_lock(&g->mu);
    if (g->n_answered > 0 && --g->n_answered == 0) g->quick.state_after = -1;
    pthread_mutex_unlock(&g->mu);
}
