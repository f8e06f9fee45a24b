/*
 * up_procs.c — the supervisor of `kvmesh up` on a libuv loop: it spawns every process of the
 * plan, restarts one that exits (immediately for the restart exit code 75 of a worker drained by
 * recovery level 3, with backoff otherwise), and on SIGINT/SIGTERM sends SIGTERM to all, waits
 * for them, then SIGKILLs stragglers, so Ctrl-C leaves no process behind. After every start and
 * exit it rewrites <run-dir>/cluster.env (every process's role, id, pid and endpoints), so that
 * tools such as `kvmesh chaos` find the processes.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/up.h"

/* Rewrites <run-dir>/cluster.env (client/kvmesh.h) after every start and exit, atomically, so a
 * reader never sees half a file. */
void up_write_state(up_state *st)
{
    if (!st->state_path[0]) return;
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp", st->state_path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    for (int i = 0; i < st->n; i++) {
        const up_proc *p = &st->p[i];
        if (p->retired && !p->running) continue; /* scaled in, and gone */
        fprintf(f, "role=%s id=%s pid=%d restarts=%d", p->role, p->name, p->running ? p->pid : 0,
                p->restarts);
        const char *keys[] = {"requests", "events", "admin", "listen", "view", "http", "peer"};
        const char *vals[] = {p->requests, p->events, p->admin, p->listen,
                              p->view,     p->http,   p->peer};
        for (int k = 0; k < 7; k++)
            if (vals[k][0]) fprintf(f, " %s=%s", keys[k], vals[k]);
        fprintf(f, "\n");
    }
    if (fclose(f) == 0) rename(tmp, st->state_path);
}

static void on_backoff(uv_timer_t *t)
{
    up_proc *p = t->data;
    if (!p->st->stopping && !p->retired) up_start(p);
}

static void on_proc_closed(uv_handle_t *h)
{
    up_proc *p = h->data;
    p->closing = false;
}

/* "exit status 1" or "killed by signal 9 (Killed)": a signal death has no exit status. */
static const char *exit_text(char *buf, size_t cap, int64_t status, int sig)
{
    if (sig)
        snprintf(buf, cap, "killed by signal %d (%s)", sig, strsignal(sig));
    else
        snprintf(buf, cap, "exit status %lld", (long long)status);
    return buf;
}

static void on_exit_cb(uv_process_t *h, int64_t status, int sig)
{
    char how[96];
    up_proc *p = h->data;
    up_state *st = p->st;
    p->running = false;
    st->running--;
    p->closing = true;
    uv_close((uv_handle_t *)h, on_proc_closed);
    up_write_state(st);
    uint64_t now = uv_now(st->loop);
    if (st->stopping) {
        fprintf(stderr, "kvmesh up: %s stopped (%s)\n", p->name,
                exit_text(how, sizeof how, status, sig));
        if (st->running == 0) uv_stop(st->loop);
        return;
    }
    if (p->retired) { /* `kvmesh scale` removed it: drained and gone for good */
        fprintf(stderr, "kvmesh up: %s left the cluster (%s)\n", p->name,
                exit_text(how, sizeof how, status, sig));
        return;
    }
    /* 75: a drained worker asking to be restarted (recovery level 3): at once. Anything else is
     * a crash or a kill: after 0.5 s, doubling (up to 8 s) while it keeps dying young. */
    if (now - p->started_ms > 30000) p->restarts = 0;
    uint64_t delay = 500;
    if (status == 75 && !sig)
        delay = 0;
    else if (now - p->started_ms < 10000)
        delay = 500u << (p->restarts < 4 ? p->restarts : 4);
    fprintf(stderr, "kvmesh up: %s exited (%s); restarting in %llu ms\n", p->name,
            exit_text(how, sizeof how, status, sig), (unsigned long long)delay);
    p->restarts++;
    uv_timer_start(&p->backoff, on_backoff, delay, 0);
}

void up_start(up_proc *p)
{
    if (p->closing) { /* the old handle is still closing: try again shortly */
        uv_timer_start(&p->backoff, on_backoff, 50, 0);
        return;
    }
    uv_stdio_container_t stdio[3] = {
        {.flags = UV_IGNORE},
        {.flags = UV_INHERIT_FD, .data.fd = p->log_fd >= 0 ? p->log_fd : 1},
        {.flags = UV_INHERIT_FD, .data.fd = p->log_fd >= 0 ? p->log_fd : 2},
    };
    uv_process_options_t o = {.file = p->argv[0],
                              .args = p->argv,
                              .exit_cb = on_exit_cb,
                              .stdio = stdio,
                              .stdio_count = 3};
    memset(&p->proc, 0, sizeof p->proc);
    p->proc.data = p;
    int rc = uv_spawn(p->st->loop, &p->proc, &o);
    if (rc) {
        fprintf(stderr, "kvmesh up: cannot start %s (%s): %s\n", p->name, p->argv[0],
                uv_strerror(rc));
        p->closing = true;
        uv_close((uv_handle_t *)&p->proc, on_proc_closed);
        uv_timer_start(&p->backoff, on_backoff, 2000, 0);
        return;
    }
    p->running = true;
    p->pid = p->proc.pid;
    p->st->running++;
    p->started_ms = uv_now(p->st->loop);
    up_write_state(p->st);
}

static void on_kill_timer(uv_timer_t *t)
{
    up_state *st = t->data;
    for (int i = 0; i < st->n; i++)
        if (st->p[i].running) {
            fprintf(stderr, "kvmesh up: %s did not stop in time: SIGKILL\n", st->p[i].name);
            uv_process_kill(&st->p[i].proc, SIGKILL);
        }
}

static void on_stop_signal(uv_signal_t *s, int signo)
{
    up_state *st = s->data;
    if (st->stopping) { /* second Ctrl-C: no more waiting */
        on_kill_timer(&st->kill_timer);
        return;
    }
    st->stopping = true;
    fprintf(stderr, "\nkvmesh up: stopping %d processes\n", st->running);
    for (int i = 0; i < st->n; i++) {
        uv_timer_stop(&st->p[i].backoff);
        if (st->p[i].running) uv_process_kill(&st->p[i].proc, SIGTERM);
    }
    if (st->running == 0) {
        uv_stop(st->loop);
        return;
    }
    uv_timer_start(&st->kill_timer, on_kill_timer,
                   (uint64_t)(st->stop_ms > 0 ? st->stop_ms : 10000), 0);
}

/* The cluster is ready when every worker's admin port and every router's HTTP front answer
 * /readyz with 200 (a worker: model loaded; a router: a routable worker). */
static bool up_ready(const up_state *st)
{
    for (int i = 0; i < st->n; i++) {
        const up_proc *p = &st->p[i];
        const char *base = !strcmp(p->role, "worker")   ? p->admin
                           : !strcmp(p->role, "router") ? p->http
                                                        : NULL;
        if (!base || p->retired) continue;
        if (!p->running || !base[0]) return false;
        char url[256];
        snprintf(url, sizeof url, "%s/readyz", base);
        km_buf body = {0};
        int status = 0;
        int rc = kvm_http_get(url, 300, &body, &status, NULL);
        km_buf_free(&body);
        if (rc || status != 200) return false;
    }
    return true;
}

static void on_ready_poll(uv_timer_t *t)
{
    up_state *st = t->data;
    if (st->stopping || !up_ready(st)) return;
    fputs(st->ready_msg, stderr);
    uv_timer_stop(t);
}

void up_start_all(up_state *st)
{
    uv_signal_init(st->loop, &st->sigint);
    uv_signal_init(st->loop, &st->sigterm);
    st->sigint.data = st->sigterm.data = st;
    uv_signal_start(&st->sigint, on_stop_signal, SIGINT);
    uv_signal_start(&st->sigterm, on_stop_signal, SIGTERM);
    uv_timer_init(st->loop, &st->kill_timer);
    st->kill_timer.data = st;
    uv_timer_init(st->loop, &st->ready_timer);
    st->ready_timer.data = st;
    if (st->ready_msg[0]) uv_timer_start(&st->ready_timer, on_ready_poll, 200, 200);
    for (int i = 0; i < st->n; i++) up_start(&st->p[i]);
}

void up_wait(up_state *st)
{
    uv_run(st->loop, UV_RUN_DEFAULT);
    up_write_state(st);
}

void up_cleanup(up_state *st)
{
    for (int i = 0; i < st->n; i++) {
        up_proc *p = &st->p[i];
        if (!uv_is_closing((uv_handle_t *)&p->backoff)) uv_close((uv_handle_t *)&p->backoff, NULL);
        if (p->running) { /* only on a setup failure */
            uv_process_kill(&p->proc, SIGKILL);
        }
    }
    if (st->sigint.loop) {
        uv_close((uv_handle_t *)&st->sigint, NULL);
        uv_close((uv_handle_t *)&st->sigterm, NULL);
        uv_close((uv_handle_t *)&st->kill_timer, NULL);
        uv_close((uv_handle_t *)&st->ready_timer, NULL);
    }
    if (st->sigscale.loop) uv_close((uv_handle_t *)&st->sigscale, NULL);
    uv_run(st->loop, UV_RUN_DEFAULT);
    for (int i = 0; i < st->n; i++) {
        for (int k = 0; k < st->p[i].argc; k++) free(st->p[i].argv[k]);
        free(st->p[i].argv);
        if (st->p[i].log_fd >= 0) close(st->p[i].log_fd);
    }
}
