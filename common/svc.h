/*
 * svc.h — the service plumbing every kvmesh daemon shares: ZeroMQ socket helpers, the declarative
 * option table (flags, environment, config file), the metrics registry, and the admin HTTP server
 * (/metrics, /healthz, /readyz). It includes the wire protocol (common/proto.h), which every
 * daemon speaks over these sockets.
 *
 * Contract:
 *  - Every function that can fail returns 0 (or a count) on success and a negative km_err on
 *    failure, with a one-line message in the caller's km_errbuf when one is passed.
 *  - Nothing here aborts or exits on input from outside: an unknown option, a bad value, a broken
 *    HTTP request are error codes and messages.
 *  - This header includes no third-party header: sockets are `void *` (libzmq's own handles),
 *    buffers are km_buf, the admin server and registries are opaque.
 *  - Ownership: whoever creates, destroys.
 *  - Thread safety: metric updates (km_counter_add, km_gauge_*, km_hist_observe) and rendering are
 *    safe from any thread; sockets and configs belong to one thread at a time.
 */
#ifndef KM_SVC_H
#define KM_SVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/km.h"
#include "common/proto.h"
#include "common/sec.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- ZeroMQ (zmqx.c) */

typedef enum km_zsock_type { KM_ZROUTER = 0, KM_ZDEALER, KM_ZPUB, KM_ZSUB } km_zsock_type;

typedef struct km_zsock_opts {
    int sndhwm, rcvhwm;   /* messages; default 10000 */
    int linger_ms;        /* on close; default 0 (drop unsent) */
    int64_t max_msg_size; /* ZMQ_MAXMSGSIZE, bytes of one frame; default 1 MiB + 4 KiB, -1 off */
    int heartbeat_ivl_ms; /* ZMTP ping interval; default 1000, 0 off */
    int heartbeat_timeout_ms; /* default 3 * ivl */
    const char *routing_id;   /* DEALER: identity seen by the ROUTER; NULL = random */
    bool router_mandatory;    /* ROUTER: sending to an unknown peer fails (KM_ENOTFOUND) */
} km_zsock_opts;

void km_zsock_opts_default(km_zsock_opts *o);

/* A libzmq context (zmq_ctx_new); destroy after every socket is closed. */
void *km_zctx_create(void);
void km_zctx_destroy(void *zctx);

/* Opens a socket of `type` with o (NULL = defaults) applied. */
int km_zsock_open(void *zctx, km_zsock_type type, const km_zsock_opts *o, void **out,
                  km_errbuf *err);
void km_zsock_close(void *s);
int km_zsock_bind(void *s, const char *endpoint, km_errbuf *err);
int km_zsock_connect(void *s, const char *endpoint, km_errbuf *err);
/* The endpoint last bound (resolves tcp://127.0.0.1:* to the real port). */
int km_zsock_last_endpoint(void *s, char *buf, size_t cap, km_errbuf *err);
/* SUB: subscribe to a prefix (len 0 = everything). */
int km_zsock_subscribe(void *s, const void *prefix, size_t len, km_errbuf *err);
/* The file descriptor to watch from another event loop (edge-triggered: after it fires, call
 * km_zsock_readable until it returns 0). */
int km_zsock_fd(void *s, int *fd, km_errbuf *err);
int km_zsock_readable(void *s); /* 1 when a message can be received now, 0 otherwise */

typedef struct km_zframe {
    const void *data;
    size_t len;
} km_zframe;

#define KM_ZMSG_MAX_PARTS 8

/* A received multipart message: the parts are copies owned by the message. By convention the
 * last part is the body (one msgpack frame) and the parts before it are the routing envelope
 * (a ROUTER sees the peer's identity first). peer is who sent it as the ZAP handler admitted it
 * (read from the body part: common/sec.h); role KM_ROLE_NONE on an insecure socket, a CURVE
 * client socket (the server was pinned by its key instead) or a socket with no ZAP handler. */
typedef struct km_zmsg {
    km_zframe part[KM_ZMSG_MAX_PARTS];
    int n;
    km_zpeer peer;
    int src_fd; /* the descriptor of the connection it came in on (libzmq's ZMQ_SRCFD), -1 when
                 * none (inproc): with a socket monitor's DISCONNECTED events, a ROUTER learns
                 * which of its requests came from a peer that is gone */
    km_buf mem_;
} km_zmsg;

enum { KM_ZDONTWAIT = 1 };

/* Sends n parts as one message. With KM_ZDONTWAIT a full queue gives KM_EAGAIN. A ROUTER with
 * router_mandatory gives KM_ENOTFOUND for an unknown identity. */
int km_zsend(void *s, const km_zframe *parts, int n, int flags, km_errbuf *err);
/* Receives one whole message, waiting at most timeout_ms (-1 forever, 0 not at all): 0 and the
 * message, KM_EAGAIN on timeout, KM_EPROTO when it has more than KM_ZMSG_MAX_PARTS parts (the
 * message is consumed and dropped). m is reset first; km_zmsg_clear it when done. */
int km_zrecv(void *s, km_zmsg *m, int timeout_ms, km_errbuf *err);
void km_zmsg_clear(km_zmsg *m);
/* The last part, or NULL when the message is empty. */
const km_zframe *km_zmsg_body(const km_zmsg *m);

enum { KM_ZPOLLIN = 1, KM_ZPOLLOUT = 2 };

typedef struct km_zpollitem {
    void *sock; /* a zmq socket, or NULL to watch fd */
    int fd;
    short events, revents;
} km_zpollitem;

/* Waits up to timeout_ms (-1 forever) for any item: the number ready (0 on timeout), or KM_EAGAIN
 * when a signal interrupted the wait. */
int km_zpoll(km_zpollitem *items, int n, int timeout_ms, km_errbuf *err);

/* ---------------------------------------------------------------- options (config.c) */

typedef enum km_opt_type {
    KM_OPT_STR = 0, /* dest: const char ** (owned by the km_config) */
    KM_OPT_INT,     /* dest: int64_t * */
    KM_OPT_FLOAT,   /* dest: double * */
    KM_OPT_BOOL,    /* dest: bool *; --name, --no-name, --name=true|false|1|0|yes|no|on|off
                     * (a bool flag never takes the next argument as its value) */
    KM_OPT_SIZE,    /* dest: uint64_t *, bytes; 512, 64K, 1.5M, 2G, 1T (powers of 1024; B, iB ok) */
    KM_OPT_DURATION /* dest: int64_t *, milliseconds; 250ms, 2s, 1.5m, 1h; a bare number is ms */
} km_opt_type;

typedef struct km_opt {
    const char *name; /* long name: "admin-port" -> --admin-port, file key admin-port/admin_port */
    const char *env;  /* environment twin; NULL = KVMESH_ + NAME with '-' as '_' */
    km_opt_type type;
    const char *def; /* default, written as on the command line; NULL = unset: a string dest
                      * becomes NULL, other dests keep what the caller put there */
    const char *help;
    void *dest;
    double min, max; /* numeric range, checked when min < max */
} km_opt;

typedef struct km_config km_config;

/* The table must outlive the config. Besides the table's options every program accepts --help
 * (-h) and --config PATH (env KVMESH_CONFIG): a file of `name = value` lines, '#' comments. */
int km_config_create(const char *prog, const char *summary, const km_opt *opts, size_t n_opts,
                     km_config **out, km_errbuf *err);
void km_config_destroy(km_config *c);
/* Fills every dest with precedence flags > environment > file > default. envp NULL = environ.
 * Positional arguments (and everything after "--") are kept for km_config_args. */
int km_config_parse(km_config *c, int argc, char *const *argv, char *const *envp, km_errbuf *err);
bool km_config_help_requested(const km_config *c);
/* The --help text: usage, summary and every option with its type, default and env twin. */
int km_config_help(const km_config *c, km_buf *out);
/* Where an option's value came from: "flag", "env", "file", "default" or "unset"; NULL if no such
 * option. */
const char *km_config_source(const km_config *c, const char *name);
char *const *km_config_args(const km_config *c, int *n);

/* The start of every daemon's main: creates the config, parses argv (and the environment), prints
 * --help, then applies the log level and format from *log_level / *log_format (option dests of
 * the table; NULL pointers skip that step). Returns 0 with *out to use and destroy, 1 when help
 * was printed (exit 0), 2 after printing "PROG: reason" to stderr (exit 2). */
int km_daemon_config(const char *prog, const char *summary, const km_opt *opts, size_t n_opts,
                     int argc, char *const *argv, const char *const *log_level,
                     const char *const *log_format, km_config **out);

/* A daemon's signals: SIGTERM and SIGINT call on_stop (async-signal-safe code only: set a flag,
 * wake a loop), SIGPIPE is ignored (a peer that went away is an error return, not a death). */
void km_daemon_signals(void (*on_stop)(int));

/* Value parsers the table uses, exposed for other text inputs. */
int km_parse_size(const char *s, uint64_t *out);
int km_parse_duration_ms(const char *s, int64_t *out);
int km_parse_bool(const char *s, bool *out);

/* ---------------------------------------------------------------- metrics (metrics.c) */

typedef enum km_metric_kind { KM_COUNTER = 0, KM_GAUGE, KM_HISTOGRAM } km_metric_kind;

typedef struct km_metrics km_metrics; /* a registry */
typedef struct km_metric km_metric;   /* a family: name, help, label names */
typedef struct km_series km_series;   /* one time series: a family plus label values */

#define KM_METRIC_MAX_LABELS  8
#define KM_METRIC_MAX_BUCKETS 32
#define KM_METRIC_MAX_SERIES  4096 /* per family; more label combinations give NULL series */

int km_metrics_create(km_metrics **out);
void km_metrics_destroy(km_metrics *r);

/* Registers a family. name gets the "kvmesh_" prefix unless it has it; label_names is a
 * comma-separated list ("tier,shard") or NULL. Registering the same name again with the same
 * kind and labels returns the existing family; anything else is KM_EINVAL. Histogram bounds are
 * strictly increasing upper bounds (+Inf is implicit); NULL for the others. */
int km_metric_register(km_metrics *r, km_metric_kind kind, const char *name, const char *help,
                       const char *label_names, const double *bounds, int n_bounds, km_metric **out,
                       km_errbuf *err);
/* The series for these label values (as many as the family has labels; NULL when it has none),
 * created on first use. NULL on a bad argument, at the series limit or out of memory; every
 * update below ignores a NULL series, so a failure costs a metric, never the process. Lookup
 * takes a lock: keep the pointer for hot paths. */
km_series *km_metric_series(km_metric *m, const char *const *label_values);

void km_counter_add(km_series *s, uint64_t n);
void km_counter_inc(km_series *s);
void km_gauge_set(km_series *s, double v);
void km_gauge_add(km_series *s, double d);
void km_hist_observe(km_series *s, double v);

/* Reads for tests and health logic. */
uint64_t km_counter_value(const km_series *s);
double km_gauge_value(const km_series *s);
uint64_t km_hist_count(const km_series *s);

/* Appends the Prometheus text exposition (format 0.0.4) of every family in registration order,
 * series in creation order. */
int km_metrics_render(km_metrics *r, km_buf *out);
/* Appends the calling process's standard Prometheus process metrics, read from /proc/self at
 * the call: process_resident_memory_bytes, process_virtual_memory_bytes, process_open_fds,
 * process_max_fds, process_cpu_seconds_total, process_start_time_seconds. What cannot be read
 * is left out. Every daemon's /metrics ends with them. */
int km_metrics_render_process(km_buf *out);

/* ---------------------------------------------------------------- admin HTTP (admin_http.c)
 * The common HTTP server (common/http.h) with /metrics, /healthz and /readyz, on a thread. */

typedef struct km_admin km_admin;

typedef struct km_admin_opts {
    const char *host;    /* default "127.0.0.1" */
    int port;            /* 0 = an ephemeral port (see km_admin_port) */
    km_metrics *metrics; /* rendered on /metrics; NULL = empty */
    /* /readyz: 200 when it returns true, 503 otherwise; NULL = always ready. Called on the admin
     * thread. */
    bool (*ready)(void *user);
    void *user;
} km_admin_opts;

/* Binds and listens (errors come back here), then serves on a thread with its own uv loop. */
int km_admin_start(const km_admin_opts *o, km_admin **out, km_errbuf *err);
int km_admin_port(const km_admin *a);
/* Closes every connection, stops the loop, joins the thread and frees a (NULL is fine). */
void km_admin_stop(km_admin *a);

#ifdef __cplusplus
}
#endif
#endif /* KM_SVC_H */
