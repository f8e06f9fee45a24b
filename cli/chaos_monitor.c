/*
 * chaos_monitor.c — what the controller says during a chaos scenario: a thread on its --view PUB
 * (and a status poll, since published views may leave the histories out) that records the
 * recovery actions, the member state changes since the fault began, and the moment the cluster
 * is all ready again.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/chaos.h"

static void mon_merge(chaos_run *r, const km_view_worker *w)
{
    for (uint32_t h = 0; h < w->n_history; h++) {
        const km_recovery_action *a = &w->history[h];
        /* the same action comes again in every view; its at_ms may move by a few ms (the
         * controller derives wall time from its own clock each time), so match loosely */
        bool seen = false;
        for (int i = 0; i < r->n_acts && !seen; i++) {
            chaos_action *c = &r->acts[i];
            uint64_t d = c->at_ms > a->at_ms ? c->at_ms - a->at_ms : a->at_ms - c->at_ms;
            seen = d < 250 && c->level == a->level && !strcmp(c->worker, w->id) &&
                   !strcmp(c->reason, a->reason ? a->reason : "?");
            if (seen) c->ok |= a->ok;
        }
        if (seen || r->n_acts == CHAOS_MAX_ACT) continue;
        chaos_action *c = &r->acts[r->n_acts++];
        snprintf(c->worker, sizeof c->worker, "%s", w->id);
        snprintf(c->reason, sizeof c->reason, "%s", a->reason ? a->reason : "?");
        c->at_ms = a->at_ms;
        c->level = a->level;
        c->ok = a->ok;
    }
}

/* Remembers member state changes (ready -> dead -> ready, ...) once the fault has begun. */
static void mon_state(chaos_run *r, const km_view_worker *w, uint64_t now)
{
    const char *st = km_member_state_name(w->state);
    int slot = -1;
    for (int i = 0; i < CHAOS_WORKERS + 2 && slot < 0; i++)
        if (!strcmp(r->last_state[i][0], w->id) || !r->last_state[i][0][0]) slot = i;
    if (slot < 0) return;
    bool changed = strcmp(r->last_state[slot][1], st) != 0;
    snprintf(r->last_state[slot][0], 64, "%s", w->id);
    snprintf(r->last_state[slot][1], 64, "%s", st);
    if (!changed || !r->armed || r->n_trans == 32) return;
    snprintf(r->trans[r->n_trans].worker, 64, "%s", w->id);
    snprintf(r->trans[r->n_trans].state, 16, "%s", st);
    r->trans[r->n_trans++].at_ms = now;
}

static void mon_on_view(chaos_run *r, const km_msg_view *v)
{
    uint64_t now = km_wall_ms();
    pthread_mutex_lock(&r->mu);
    r->views++;
    r->last_view_ms = now;
    r->epoch = v->epoch;
    r->all_ready = kvm_view_all_ready(v, CHAOS_WORKERS);
    for (uint32_t i = 0; i < v->n_workers; i++) {
        mon_merge(r, &v->workers[i]);
        mon_state(r, &v->workers[i], now);
        if (!strcmp(v->workers[i].id, CHAOS_TARGET)) {
            snprintf(r->target_state, sizeof r->target_state, "%s",
                     km_member_state_name(v->workers[i].state));
            r->target_level = v->workers[i].level;
            r->target_pressure = v->workers[i].pressure;
        }
    }
    if (r->armed && !r->all_ready) r->degraded_seen = true;
    if (r->armed && r->fault_end_ms && !r->ready_at_ms && r->all_ready) {
        bool ok = true;
        if (r->sc->recover_when == RECOVER_AFTER_DEGRADED) ok = r->degraded_seen;
        if (r->sc->recover_when == RECOVER_NEW_EPOCH) ok = r->epoch != r->pre_epoch;
        if (ok) r->ready_at_ms = now;
    }
    pthread_mutex_unlock(&r->mu);
}

void *chaos_monitor_main(void *arg)
{
    chaos_run *r = arg;
    kvm_view_sub *sub = NULL;
    km_errbuf err = {{0}};
    kvm_sec sec = {.cert = r->op_cert};
    if (kvm_view_sub_open(r->ctl_view, &sec, &sub, &err)) {
        fprintf(stderr, "kvmesh chaos: view subscription: %s\n", err.msg);
        return NULL;
    }
    uint64_t last_poll = 0;
    while (!atomic_load(&r->mon_stop)) {
        km_msg v;
        if (!kvm_view_sub_next(sub, 100, &v, NULL)) {
            mon_on_view(r, &v.view);
            km_msg_clear(&v);
        }
        /* published views may leave the histories out; the status reply carries them */
        if (km_now_ns() - last_poll > 250000000u) {
            last_poll = km_now_ns();
            if (!kvm_view_get(r->ctl_listen, &sec, 1000, &v, NULL)) {
                pthread_mutex_lock(&r->mu);
                for (uint32_t i = 0; i < v.view.n_workers; i++) mon_merge(r, &v.view.workers[i]);
                pthread_mutex_unlock(&r->mu);
                km_msg_clear(&v);
            }
        }
    }
    kvm_view_sub_close(sub);
    return NULL;
}

/* The recovery levels that fired on worker (any when NULL) since `since`, oldest first. */
int chaos_actions_since(chaos_run *r, uint64_t since, const char *worker, chaos_action *out,
                        int max)
{
    pthread_mutex_lock(&r->mu);
    int n = 0;
    for (int i = 0; i < r->n_acts && n < max; i++)
        if (r->acts[i].at_ms + 1000 >= since && (!worker || !strcmp(r->acts[i].worker, worker)))
            out[n++] = r->acts[i];
    pthread_mutex_unlock(&r->mu);
    for (int i = 1; i < n; i++) /* insertion sort by time */
        for (int j = i; j > 0 && out[j].at_ms < out[j - 1].at_ms; j--) {
            chaos_action t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return n;
}

/* Waits until worker has had an action of `level` since `since` (true) or timeout_ms passed. */
bool chaos_wait_level(chaos_run *r, const char *worker, uint32_t level, uint64_t since,
                      int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 100) {
        chaos_action a[CHAOS_MAX_ACT];
        int n = chaos_actions_since(r, since, worker, a, CHAOS_MAX_ACT);
        for (int i = 0; i < n; i++)
            if (a[i].level == level) return true;
        km_sleep_ms(100);
    }
    return false;
}

void chaos_format_levels(chaos_run *r, chaos_result *res)
{
    chaos_action a[CHAOS_MAX_ACT];
    int n = chaos_actions_since(r, r->fault_ms, NULL, a, CHAOS_MAX_ACT);
    res->levels[0] = 0;
    size_t off = 0;
    for (int i = 0; i < n && off < sizeof res->levels - 64; i++)
        off += (size_t)snprintf(res->levels + off, sizeof res->levels - off, "%s%s:L%u(%s)%s",
                                i ? " -> " : "", a[i].worker, a[i].level, a[i].reason,
                                a[i].ok ? "" : "!ack");
    if (!n) snprintf(res->levels, sizeof res->levels, "none");
    pthread_mutex_lock(&r->mu);
    off = 0;
    res->states[0] = 0;
    for (int i = 0; i < r->n_trans && off < sizeof res->states - 64; i++)
        off += (size_t)snprintf(res->states + off, sizeof res->states - off, "%s%s %s (+%.1f s)",
                                i ? ", " : "", r->trans[i].worker, r->trans[i].state,
                                (r->trans[i].at_ms - r->fault_ms) / 1e3);
    if (!r->n_trans) snprintf(res->states, sizeof res->states, "no change");
    pthread_mutex_unlock(&r->mu);
    /* the pressure scenario's promise: the first 1, 2 and 3 on the target come in that order */
    uint64_t first[4] = {0};
    for (int i = 0; i < n; i++)
        if (!strcmp(a[i].worker, CHAOS_TARGET) && a[i].level >= 1 && a[i].level <= 3 &&
            !first[a[i].level])
            first[a[i].level] = a[i].at_ms;
    res->order_ok =
        first[1] && first[2] && first[3] && first[1] <= first[2] && first[2] <= first[3];
}
