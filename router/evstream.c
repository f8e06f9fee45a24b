/*
 * evstream.c — puts one worker's KV events in sequence order for the prefix index (router.h,
 * "event streams").
 *
 * Why it is built this way: events reach the router by two paths, the worker's PUB socket (live)
 * and the replies to a `kv_sync` (replay, on the request connection), and PUB/SUB drops messages
 * when a subscriber is slow or joins late. Applying an old "stored" after a newer "removed" would
 * leave the index claiming a page the worker no longer has, so events are applied strictly in
 * sequence: anything past a gap is held (copied, bounded) until the replay fills the gap or the
 * router gives up and forgets the worker. The state machine is pure (no sockets) so the unit
 * tests drive every path.
 */
#include <stdlib.h>
#include <string.h>

#include "router/route.h"

typedef struct held_ev {
    km_msg_kv_event ev;
    uint8_t *hashes;
    char *worker;
} held_ev;

struct rt_evstream {
    uint64_t next;
    bool adopt;   /* take the next event's seq as the expected one */
    bool waiting; /* a replay was asked for */
    uint64_t gaps;
    held_ev *held; /* sorted by seq, no duplicates */
    int n_held, cap;
};

int rt_evstream_create(int cap, rt_evstream **out)
{
    *out = NULL;
    if (cap < 1) return KM_EINVAL;
    rt_evstream *s = calloc(1, sizeof *s);
    if (!s) return KM_ENOMEM;
    s->held = calloc((size_t)cap, sizeof *s->held);
    if (!s->held) {
        free(s);
        return KM_ENOMEM;
    }
    s->cap = cap;
    *out = s;
    return 0;
}

static void held_free(held_ev *h)
{
    free(h->hashes);
    free(h->worker);
    memset(h, 0, sizeof *h);
}

static void drop_held(rt_evstream *s)
{
    for (int i = 0; i < s->n_held; i++) held_free(&s->held[i]);
    s->n_held = 0;
}

void rt_evstream_destroy(rt_evstream *s)
{
    if (!s) return;
    drop_held(s);
    free(s->held);
    free(s);
}

/* Applies held events that are now in sequence; drops held ones already covered. */
static int drain(rt_evstream *s, rt_ev_apply_fn apply, void *user)
{
    int applied = 0, i = 0;
    for (; i < s->n_held && s->held[i].ev.seq <= s->next; i++) {
        if (s->held[i].ev.seq == s->next) {
            apply(user, &s->held[i].ev);
            s->next++;
            applied++;
        }
        held_free(&s->held[i]);
    }
    if (i) {
        memmove(s->held, s->held + i, (size_t)(s->n_held - i) * sizeof *s->held);
        memset(s->held + (s->n_held - i), 0, (size_t)i * sizeof *s->held);
        s->n_held -= i;
    }
    if (s->n_held == 0) s->waiting = false;
    return applied;
}

/* Copies ev into the sorted held list; false when out of room or memory. */
static bool hold(rt_evstream *s, const km_msg_kv_event *ev)
{
    int pos = s->n_held;
    while (pos > 0 && s->held[pos - 1].ev.seq > ev->seq) pos--;
    if (pos > 0 && s->held[pos - 1].ev.seq == ev->seq) return true; /* already held */
    if (s->n_held >= s->cap) return false;
    held_ev h = {.ev = *ev};
    size_t nb = (size_t)ev->n_hashes * 16;
    h.hashes = malloc(nb ? nb : 1);
    h.worker = strdup(ev->worker ? ev->worker : "");
    if (!h.hashes || !h.worker) {
        held_free(&h);
        return false;
    }
    if (nb) memcpy(h.hashes, ev->hashes, nb);
    h.ev.hashes = h.hashes;
    h.ev.worker = h.worker;
    memmove(s->held + pos + 1, s->held + pos, (size_t)(s->n_held - pos) * sizeof *s->held);
    s->held[pos] = h;
    s->n_held++;
    return true;
}

rt_ev_result rt_evstream_push(rt_evstream *s, const km_msg_kv_event *ev, rt_ev_apply_fn apply,
                              void *user)
{
    if (s->adopt) {
        s->adopt = false;
        if (ev->seq > s->next) s->next = ev->seq;
    }
    if (ev->seq < s->next) return RT_EV_DUPLICATE;
    if (ev->seq == s->next) {
        apply(user, ev);
        s->next++;
        drain(s, apply, user);
        return RT_EV_APPLIED;
    }
    if (!hold(s, ev)) return RT_EV_OVERFLOW;
    if (s->waiting) return RT_EV_HELD;
    s->waiting = true;
    s->gaps++;
    return RT_EV_GAP;
}

uint64_t rt_evstream_next(const rt_evstream *s)
{
    return s->next;
}

bool rt_evstream_waiting(const rt_evstream *s)
{
    return s->waiting;
}

void rt_evstream_set_waiting(rt_evstream *s, bool waiting)
{
    s->waiting = waiting;
}

int rt_evstream_resync(rt_evstream *s, rt_ev_apply_fn apply, void *user)
{
    s->waiting = false;
    if (s->n_held == 0) {
        s->adopt = true;
        return 0;
    }
    s->next = s->held[0].ev.seq;
    return drain(s, apply, user);
}

int rt_evstream_jump(rt_evstream *s, uint64_t next, rt_ev_apply_fn apply, void *user)
{
    s->adopt = false;
    if (next > s->next) s->next = next;
    s->waiting = true; /* cleared by drain when nothing is left held */
    return drain(s, apply, user);
}

void rt_evstream_reset(rt_evstream *s)
{
    drop_held(s);
    s->next = 0;
    s->adopt = false;
    s->waiting = false;
}

uint64_t rt_evstream_gaps(const rt_evstream *s)
{
    return s->gaps;
}
