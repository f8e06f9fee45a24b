/*
 * events.c — the store's event ring: every page the prefix index gains (stored), loses
 * (removed) or moves between tiers (tier) becomes one kv_event with a per-store sequence
 * number, kept until the worker drains and publishes them. The ring is bounded; when it is full
 * the oldest event is dropped and counted, and the gap in sequence numbers tells the router to
 * ask for a snapshot instead of trusting an incomplete stream. The same events keep the count
 * of position-free (chunk) pages per tier.
 */
#include <stdlib.h>

#include "kvshard/internal.h"

void kv_event_emit(kv_store *s, kv_event_kind kind, const kv_page *p, kv_tier from, kv_tier to)
{
    const int pf = (p->flags & KV_PAGE_POSFREE) != 0;
    if (pf && kind != KV_EVENT_STORED && s->posfree[from]) s->posfree[from]--;
    if (pf && kind != KV_EVENT_REMOVED) s->posfree[to]++;
    if (!s->ev_cap) return;
    if (s->ev_len == s->ev_cap) {
        s->ev_head = (s->ev_head + 1) % s->ev_cap;
        s->ev_len--;
        s->st.events_dropped++;
    }
    kv_event *e = &s->ev[(s->ev_head + s->ev_len) % s->ev_cap];
    e->seq = s->ev_next++;
    e->kind = kind;
    e->tier = to;
    e->from_tier = from;
    e->shard = p->shard;
    e->hash = p->hash;
    e->position_free = pf;
    s->ev_len++;
}

int kv_store_events_drain(kv_store *s, kv_event *out, int max)
{
    int n = 0;
    while (n < max && s->ev_len) {
        out[n++] = s->ev[s->ev_head];
        s->ev_head = (s->ev_head + 1) % s->ev_cap;
        s->ev_len--;
    }
    return n;
}

uint64_t kv_store_events_next_seq(const kv_store *s)
{
    return s->ev_next;
}

void kv_events_free(kv_store *s)
{
    free(s->ev);
    s->ev = NULL;
    s->ev_cap = s->ev_len = 0;
}
