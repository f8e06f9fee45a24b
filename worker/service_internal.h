/*
 * service_internal.h — what the worker daemon's files share (service.c: the loop, requests and
 * admin commands; events.c: KV events, replay and snapshots). Private to worker/.
 */
#ifndef WK_SERVICE_INTERNAL_H
#define WK_SERVICE_INTERNAL_H

#include "worker/worker.h"

/* ---------------------------------------------------------------- KV events (events.c)
 *
 * The store's events are regrouped into `kv` frames (consecutive events of the same kind and
 * tiers share a frame) numbered per worker from 1; a ring of recent events keeps their frame
 * numbers for replay, and a mirror of the store's index (page hash -> tier, fed by the same
 * events) answers snapshots. */
typedef struct wk_events wk_events;

/* pub may be NULL (no events endpoint): events are still numbered, mirrored and replayable. */
int wk_events_create(kv_store *kv, void *pub, const char *worker, int replay_cap, wk_events **out);
void wk_events_destroy(wk_events *ev);
/* Drains the store's pending events and publishes them; returns how many frames went out. */
int wk_events_pump(wk_events *ev);
/* The seq the next frame will carry. */
uint64_t wk_events_next_seq(const wk_events *ev);
uint64_t wk_events_frames(const wk_events *ev);
/* Sends, as `kv` frames on sock behind the envelope, every frame with seq >= since (replay), or
 * the whole index as `stored` frames carrying seq next-1 (snapshot: when snapshot is set or
 * since is older than the ring). Returns the number of frames sent; *was_snapshot says which. */
int wk_events_replay(wk_events *ev, void *sock, const km_zframe *env, int n_env, uint64_t since,
                     bool snapshot, bool *was_snapshot);

#endif
