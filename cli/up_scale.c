/*
 * up_scale.c — `kvmesh up`'s side of `kvmesh scale` (cli/scale.c): the number of workers changed
 * at run time through the run directory. `kvmesh up` writes <run-dir>/up.pid (its pid, and whether
 * the cluster has keys and a controller) and takes SIGUSR1; `kvmesh scale` writes
 * <run-dir>/scale ("workers=N", after making the keys of workers to add) and sends SIGUSR1. Workers
 * are w0..w<N-1>: scaling out plans the missing ones as `up` planned the first (the same flags,
 * their keys in the run directory) and supervises them like the others; scaling in sends SIGTERM
 * to the highest ids, which drain (their pages handed to peers) and exit, and are not restarted.
 * The routers find added workers through the controller's view, hence no scaling without one.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/up.h"
#include "common/sec.h"

/* <run-dir>/NAME, from the path of cluster.env. */
static void up_run_path(const up_state *st, const char *name, char *out, size_t cap)
{
    const char *slash = strrchr(st->state_path, '/');
    int dl = slash ? (int)(slash - st->state_path) : 1;
    snprintf(out, cap, "%.*s/%s", dl, slash ? st->state_path : ".", name);
}

/* The table entry of worker wi, or NULL. */
static up_proc *up_worker(up_state *st, int wi)
{
    char name[32];
    snprintf(name, sizeof name, "w%d", wi);
    for (int i = 0; i < st->n; i++)
        if (!strcmp(st->p[i].role, "worker") && !strcmp(st->p[i].name, name)) return &st->p[i];
    return NULL;
}

/* Worker wi joins: an entry removed before comes back, a new one is planned; its key must be in
 * the cluster's key directory already (`kvmesh scale` makes it). */
static void up_scale_add(up_state *st, int wi)
{
    up_proc *p = up_worker(st, wi);
    char name[32];
    snprintf(name, sizeof name, "w%d", wi);
    if (st->o->keydir) {
        km_cert_info ci;
        km_errbuf err = {{0}};
        if (km_keydir_find_worker(st->o->keydir, name, &ci, &err)) {
            fprintf(stderr, "kvmesh up: scale: no key for %s in %s (%s): not started\n", name,
                    st->o->keydir, err.msg);
            return;
        }
    }
    if (p) {
        if (!p->retired) return;
        p->retired = false;
        p->restarts = 0;
        if (p->running) return; /* still draining: it stays */
    } else {
        if (up_plan_worker(st, wi)) {
            fprintf(stderr, "kvmesh up: scale: cannot plan %s\n", name);
            return;
        }
        p = &st->p[st->n - 1];
    }
    fprintf(stderr, "kvmesh up: scale: adding %s\n", name);
    up_start(p);
}

/* Worker wi leaves: SIGTERM (a drain that hands its pages to peers), and no restart. */
static void up_scale_remove(up_state *st, int wi)
{
    up_proc *p = up_worker(st, wi);
    if (!p || p->retired) return;
    p->retired = true;
    uv_timer_stop(&p->backoff);
    fprintf(stderr, "kvmesh up: scale: removing %s (drain)\n", p->name);
    if (p->running) uv_process_kill(&p->proc, SIGTERM);
    up_write_state(st);
}

static void on_scale_signal(uv_signal_t *s, int signo)
{
    (void)signo;
    up_state *st = s->data;
    if (st->stopping) return;
    char path[4300];
    up_run_path(st, "scale", path, sizeof path);
    FILE *f = fopen(path, "r");
    int want = 0;
    if (!f || fscanf(f, "workers=%d", &want) != 1 || want < 1 || want > 64) {
        fprintf(stderr, "kvmesh up: SIGUSR1: %s says no workers=N (1..64); nothing changed\n",
                path);
        if (f) fclose(f);
        return;
    }
    fclose(f);
    fprintf(stderr, "kvmesh up: scale: %d workers wanted\n", want);
    for (int wi = 0; wi < 64; wi++)
        if (wi < want)
            up_scale_add(st, wi);
        else
            up_scale_remove(st, wi);
}

void up_scale_start(up_state *st)
{
    char path[4300];
    up_run_path(st, "up.pid", path, sizeof path);
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "pid=%d keys=%d controller=%d\n", (int)getpid(), st->o->keydir ? 1 : 0,
                st->o->with_controller ? 1 : 0);
        fclose(f);
    }
    uv_signal_init(st->loop, &st->sigscale);
    st->sigscale.data = st;
    uv_signal_start(&st->sigscale, on_scale_signal, SIGUSR1);
}

void up_scale_stop(up_state *st)
{
    char path[4300];
    up_run_path(st, "up.pid", path, sizeof path);
    unlink(path);
}
