/*
 * harness.h — what the multi-process suites (tests/integration/test_*.c) share: a daemon started
 * as a child on ephemeral ports, found through its ports file; every child remembered so that a
 * test that fails half way (Criterion leaves it by longjmp) leaves none running; stops with
 * deadlines; ZeroMQ DEALER sockets speaking km_msg frames; the admin port's /metrics; and whole
 * local clusters run by `kvmesh up`.
 *
 * Every wait has a deadline and ends the test with a message, never a hang; children are killed
 * by their own pid only, and a child that was waited for is forgotten (its pid may be reused).
 * Paths are relative: the suites run from the repository root (make integration).
 *
 * Across hosts: it_net makes a private network of network namespaces joined by a bridge, and a
 * child may run inside one of them (it_proc.ns), as on another host.
 */
#ifndef IT_HARNESS_H
#define IT_HARNESS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/svc.h"

#define IT_MODEL  "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define IT_WORKER it_bin("kvmesh-worker")
#define IT_ROUTER it_bin("kvmesh-router")
#ifndef IT_CONTROLLER /* -DIT_CONTROLLER=... runs the suite against another build */
#define IT_CONTROLLER it_bin("kvmesh-controller")
#endif

/* The path of daemon `name`: $KVMESH_IT_BIN/name when set (make integration-san points it at
 * the ASan/UBSan daemons, build/san/bin), else build/bin/name. The string lives as long as the
 * process. */
const char *it_bin(const char *name);

/* A daemon run by a test. dir is its own temporary directory (ports file, log, disk tier); the
 * endpoints are what its ports file said (empty when it did not say). */
typedef struct it_proc {
    pid_t pid; /* 0 when not running */
    char dir[64];
    char ns[64];  /* set before it_spawn: the network namespace it runs in (ip netns exec) */
    bool no_wait; /* set before it_spawn: return once forked; it_spawn_wait waits for ports */
    char listen[512], view[512], req[512], ev[512], front[512];
    int admin_port, http_port;
} it_proc;

/* True when every path in the NULL-terminated list exists; otherwise the test is skipped with a
 * message naming what to run (make deps, make build) and false is returned. */
bool it_have(const char *const *paths);
/* True when curl is on the PATH; otherwise the test is skipped with a message and false is
 * returned. */
bool it_have_curl(void);
/* Creates p->dir (/tmp/kvmesh-<tag>-XXXXXX) unless it is set already. */
void it_proc_dir(it_proc *p, const char *tag);
/* Starts argv[0] (looked up in PATH when it has no slash) with argv (NULL-terminated) then extra
 * (NULL-terminated, may be NULL), stderr to <dir>/<logname>, inside network namespace p->ns when
 * it is set, and waits up to 30 s for <dir>/ports, which argv must name with --ports-file; fails
 * the test if the child exits first. The child is killed when the test process dies (a
 * Criterion time-out leaves no daemon behind). */
void it_spawn(it_proc *p, const char *const *argv, const char *const *extra, const char *logname);
/* The wait it_spawn skips when p->no_wait is set: up to 30 s for p's ports file (then read),
 * failing the test when p exits first. Clears p->no_wait. */
void it_spawn_wait(it_proc *p);
/* A kvmesh-worker of the default model: requests and KV events on ephemeral ports, the ports
 * file in p's dir (it_proc_dir: a p that ran before keeps its dir, as a restart under a
 * supervisor would), then flags and extra (both NULL-terminated, may be NULL); stderr to
 * <dir>/worker.log. */
void it_start_worker(it_proc *p, const char *tag, const char *const *flags,
                     const char *const *extra);
/* A router in front of nw kvmesh-workers of the default model, for the suites that drive it over
 * HTTP: w[0..nw) with worker ids w0, w1, ..., `threads` threads each, no admin port; r with its
 * ZeroMQ front and HTTP port ephemeral, then extra router flags (NULL-terminated, may be NULL);
 * both log at warn, in dirs named after tag. Returns once the router's /readyz answers 200 (a
 * worker is routable), failing the test after 30 s; false (skipped) without the model or the
 * daemons. */
bool it_router_http_start(it_proc *r, it_proc *w, int nw, int threads, const char *tag,
                          const char *const *extra);
/* The worker binary it_start_worker runs: $KVMESH_IT_WORKER when set (make unit-tests-tsan runs
 * the heartbeat test against a ThreadSanitizer build so), IT_WORKER otherwise. */
const char *it_worker_bin(void);
/* Waits up to timeout_ms for p to exit: its exit status, or -1 (killed by a signal, or killed
 * after the timeout). */
int it_wait_exit(it_proc *p, int timeout_ms);
/* SIGTERM (after SIGCONT, in case it was stopped), then it_wait_exit with 5 s. */
void it_stop(it_proc *p);
/* SIGKILLs every child still running, then deletes the it_net network if there is one: the
 * suites' fini. */
void it_kill_all(void);

/* ---------------------------------------------------------------- waiting
 * A test waits for a condition, never for a time. IT_WAIT evaluates cond (any expression) again
 * every IT_POLL_MS until it holds, and fails the test with the printf-style message if it still
 * does not after timeout_ms; it_poll is its step, for loops that do more between looks (it
 * sleeps one poll period and says whether the deadline, from it_deadline, is still ahead). */
#define IT_POLL_MS 20
uint64_t it_deadline(int timeout_ms);
bool it_poll(uint64_t deadline);
#define IT_WAIT(cond, timeout_ms, ...)                                                             \
    do {                                                                                           \
        const uint64_t it_end_ = it_deadline(timeout_ms);                                          \
        while (!(cond))                                                                            \
            if (!it_poll(it_end_)) cr_assert_fail(__VA_ARGS__);                                    \
    } while (0)

/* The process's ZeroMQ context (created on first use, left to the process's exit: a test that
 * failed half way may leave a socket open, and terminating the context would wait for it). */
void *it_zctx(void);
/* A DEALER connected to ep. */
void *it_dealer(const char *ep);
/* An XPUB bound to url (its endpoint into ep): a PUB that also hands the test each subscription
 * (ZMQ_XPUB_VERBOSE), so that a test stands in for a publisher (the controller's views) and knows
 * when a subscriber has joined, instead of publishing until it surely has. km_zsock_close. */
void *it_xpub(const char *url, char *ep, size_t cap);
/* Waits up to timeout_ms until n more subscriptions have reached xpub; fails the test if not. */
void it_wait_subscribed(void *xpub, int n, int timeout_ms);
void it_send_raw(void *s, const void *p, size_t n);
void it_send_msg(void *s, const km_msg *m);
/* Receives one frame within timeout_ms and decodes it into m (fails the test if it does not
 * decode); false on timeout. */
bool it_recv_msg(void *s, km_msg *m, int timeout_ms);

/* GET path on host:port (HTTP/1.1, Connection: close): the response, headers included,
 * NUL-terminated into out; returns the status code, or -1 when nothing answered. */
int it_http_get_at(const char *host, int port, const char *path, char *out, size_t cap);
/* The same on 127.0.0.1. */
int it_http_get(int port, const char *path, char *out, size_t cap);
/* The value of the sample `series` (name and labels exactly, as in the text format) in a
 * /metrics text, or -1 when absent. */
double it_metric_in(const char *text, const char *series);
/* The same, fetching /metrics from host:port first (it_metric: 127.0.0.1). */
double it_metric_at(const char *host, int port, const char *series);
double it_metric(int admin_port, const char *series);

/* ---------------------------------------------------------------- across hosts
 * A private network: one network namespace per host, each with one address in 10.250.0.0/24, all
 * joined by a bridge in a namespace of its own; the test process moves into a namespace of its
 * own on the same bridge (it_net_self), so it reaches every host, and so do the children it
 * starts without an it_proc.ns. Nothing else of the machine is touched: no interface or address
 * is added to the namespace the test started in, and no traffic leaves the namespaces (each
 * network is a separate bridge, so parallel runs use the same addresses without meeting). Names
 * carry the test process's pid (kvmesh-it-PID-NAME); it_net_create first deletes what a run
 * that died left (namespaces of a pid no longer running, after SIGKILLing by pid the processes
 * still inside them). One network per test process, made before its first socket. */
#define IT_NET_HOSTS 8

typedef struct it_host {
    char ns[64]; /* the namespace: an it_proc's ns */
    char ip[20]; /* its address */
} it_host;

/* Makes the network with one host per name (NULL-terminated, fewer than IT_NET_HOSTS) into
 * hosts, and moves the test process onto it. False, the test skipped with a message, where
 * `ip netns add` is not permitted (needs root or CAP_SYS_ADMIN) or there is no `ip`. Deleted by
 * it_net_destroy (it_kill_all, and at exit). */
bool it_net_create(const char *const *names, it_host *hosts);
/* The test process's address on the network. */
const char *it_net_self(void);
/* Takes the test process's link to the bridge down (up false: a partition between the test's
 * namespace and every host) or up again. */
void it_net_self_link(bool up);
/* Gives h's namespace (NULL: the test's) a second interface, up, with an address on a network
 * no other host reaches, the same in every namespace (10.251.0.1/30), as a host's second NIC or
 * its container bridge (docker0's 172.17.0.1 on every host): what a transfer layer that opened
 * lanes on every interface would wrongly use. */
void it_net_decoy(const it_host *h);
/* Deletes the namespaces (their links go with them); nothing when there is no network. */
void it_net_destroy(void);
/* Runs a shell command (printf-style); its exit status, -1 when it did not exit. */
int it_sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---------------------------------------------------------------- `kvmesh up` clusters
 * A whole local cluster as `kvmesh up` runs it (a controller, workers, routers), every port
 * ephemeral (--base-port=0): which process runs where is in <dir>/cluster.env (client/kvmesh.h,
 * kvm_cluster_read), kvmesh up's own output in <dir>/up.log, the daemons' logs in <dir>/logs. */
#define IT_KVMESH "build/bin/kvmesh"

typedef struct it_up {
    pid_t pid; /* `kvmesh up`; 0 when not running */
    char dir[64];
    char cluster[96]; /* <dir>/cluster.env */
} it_up;

/* Starts `kvmesh up --base-port=0 --run-dir=<dir> --log-dir=<dir>/logs` then args
 * (NULL-terminated: --workers=N, --insecure, ...) in a new dir /tmp/kvmesh-<tag>-XXXXXX, and
 * returns at once: poll u->cluster for what has started, u->pid for kvmesh up itself. */
void it_up_start(it_up *u, const char *tag, const char *const *args);
/* Runs a shell command as a user would type it: its exit status (-1 when it did not exit), and
 * its stdout and stderr together in *out (the caller frees). */
int it_shell(const char *cmd, char **out);
/* What a shell command printed on its stdout (malloc'd, NUL-terminated; the caller frees). */
char *it_stdout(const char *cmd);
/* POSTs the file body_path as JSON to url with curl (-N: a stream is read to its end), giving up
 * after max_s seconds: the answer's body (malloc'd, NUL-terminated; the caller frees), *status
 * its HTTP status (0 when nothing answered). */
char *it_curl_post(const char *url, const char *body_path, int max_s, int *status);
/* it_shell, and fails the test unless it exits with `status` and its output contains `says`. */
void it_shell_expect(const char *cmd, int status, const char *says);

/* SIGTERM to `kvmesh up` (it stops its daemons), SIGKILL after 20 s; then SIGKILL to every
 * process cluster.env still names. The dir and its logs stay. Nothing when not started. A test
 * killed at its time-out (no fini) SIGTERMs kvmesh up by dying (PR_SET_PDEATHSIG). */
void it_up_stop(it_up *u);

#endif
