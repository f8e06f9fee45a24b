/*
 * harness.h — what the multi-process suites (tests/integration/test_*.c) share: a daemon started
 * as a child on ephemeral ports, found through its ports file; every child remembered so that a
 * test that fails half way (Criterion leaves it by longjmp) leaves none running; stops with
 * deadlines; ZeroMQ DEALER sockets speaking km_msg frames; and the admin port's /metrics.
 *
 * Every wait has a deadline and ends the test with a message, never a hang; children are killed
 * by their own pid only, and a child that was waited for is forgotten (its pid may be reused).
 * Paths are relative: the suites run from the repository root (make integration).
 */
#ifndef IT_HARNESS_H
#define IT_HARNESS_H

#include <stdbool.h>
#include <sys/types.h>

#include "common/svc.h"

#define IT_MODEL  "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define IT_WORKER "build/bin/kvmesh-worker"
#define IT_ROUTER "build/bin/kvmesh-router"
#ifndef IT_CONTROLLER /* -DIT_CONTROLLER=... runs the suite against another build (ASan) */
#define IT_CONTROLLER "build/bin/kvmesh-controller"
#endif

/* A daemon run by a test. dir is its own temporary directory (ports file, log, disk tier); the
 * endpoints are what its ports file said (empty when it did not say). */
typedef struct it_proc {
    pid_t pid; /* 0 when not running */
    char dir[64];
    char listen[512], view[512], req[512], ev[512], front[512];
    int admin_port, http_port;
} it_proc;

/* True when every path in the NULL-terminated list exists; otherwise the test is skipped with a
 * message naming what to run (make deps, make build) and false is returned. */
bool it_have(const char *const *paths);
/* Creates p->dir (/tmp/kvmesh-<tag>-XXXXXX) unless it is set already. */
void it_proc_dir(it_proc *p, const char *tag);
/* Starts argv[0] (looked up in PATH when it has no slash) with argv (NULL-terminated) then extra
 * (NULL-terminated, may be NULL), stderr to <dir>/<logname>, and waits up to 30 s for
 * <dir>/ports, which argv must name with --ports-file; fails the test if the child exits
 * first. */
void it_spawn(it_proc *p, const char *const *argv, const char *const *extra, const char *logname);
/* A kvmesh-worker of the default model: requests and KV events on ephemeral ports, the ports
 * file in p's dir (it_proc_dir: a p that ran before keeps its dir, as a restart under a
 * supervisor would), then flags and extra (both NULL-terminated, may be NULL); stderr to
 * <dir>/worker.log. */
void it_start_worker(it_proc *p, const char *tag, const char *const *flags,
                     const char *const *extra);
/* Waits up to timeout_ms for p to exit: its exit status, or -1 (killed by a signal, or killed
 * after the timeout). */
int it_wait_exit(it_proc *p, int timeout_ms);
/* SIGTERM (after SIGCONT, in case it was stopped), then it_wait_exit with 5 s. */
void it_stop(it_proc *p);
/* SIGKILLs every child still running: the suites' fini. */
void it_kill_all(void);

/* The process's ZeroMQ context (created on first use, left to the process's exit: a test that
 * failed half way may leave a socket open, and terminating the context would wait for it). */
void *it_zctx(void);
/* A DEALER connected to ep. */
void *it_dealer(const char *ep);
void it_send_raw(void *s, const void *p, size_t n);
void it_send_msg(void *s, const km_msg *m);
/* Receives one frame within timeout_ms and decodes it into m (fails the test if it does not
 * decode); false on timeout. */
bool it_recv_msg(void *s, km_msg *m, int timeout_ms);

/* GET path on 127.0.0.1:port (HTTP/1.1, Connection: close): the response, headers included,
 * NUL-terminated into out; returns the status code, or -1 when nothing answered. */
int it_http_get(int port, const char *path, char *out, size_t cap);
/* The value of the sample `series` (name and labels exactly, as in the text format) in a
 * /metrics text, or -1 when absent. */
double it_metric_in(const char *text, const char *series);
/* The same, fetching /metrics from the admin port first. */
double it_metric(int admin_port, const char *series);

#endif
