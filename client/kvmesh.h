/*
 * kvmesh.h — libkvmesh, the C client of a kvmesh cluster: one DEALER connection to a router (or
 * straight to a worker) speaking docs/protocol.md, synchronous generation with a per-token
 * callback, an asynchronous submit/next pair for many requests in flight, and a small HTTP GET
 * for the router's status page; operator calls (admin frames, the controller's view) and the
 * reader of `kvmesh up`'s cluster state file, shared by the kvmesh command (cli/), the chaos tool
 * and the tests.
 *
 * Contract:
 *  - Prefix: kvm_ (km_ is the common layer's; the wire types km_msg_* come from common/svc.h).
 *  - Every call returns 0 or a negative km_err; an error frame from the server is not a crash
 *    but a result: kvm_generate fills kvm_result.error_code/error and returns KM_EOVERLOAD (529,
 *    retry after result.retry_after_ms), KM_EAGAIN (503), KM_EINVAL (other 4xx) or KM_EIO.
 *  - A connection that breaks while kvm_generate waits (the router died) ends the request at
 *    once with KM_EIO and error_code 0: the request may not have run; send it again (the socket
 *    reconnects by itself, to a restarted router on the same endpoint).
 *  - A client is one thread's: it owns a ZeroMQ context and socket and is not locked.
 *  - Nothing here exits or aborts; a server that stays silent longer than timeout_ms gives
 *    KM_ETIMEDOUT (the request is canceled on the server).
 */
#ifndef KVMESH_H
#define KVMESH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/svc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvm_client kvm_client;

/* A client's CURVE settings (docs/security.md). cert: this client's certificate, NAME.key with
 * NAME.key_secret beside it (KVMESH_CERT in the CLI); NULL: a plain connection, which a secure
 * cluster refuses. server: the server's public key: Z85 (40 characters), a .key file, or a member
 * name ("router", "controller", a worker id) looked up in the key directory that holds cert
 * (DIR/private/NAME.key -> DIR); NULL: the call's usual server ("router" for kvm_open,
 * "controller" for the operator calls). */
typedef struct kvm_sec {
    const char *cert;
    const char *server;
} kvm_sec;

/* Makes sock (before its connect) a CURVE client as s says; nothing when s or s->cert is NULL. */
int kvm_sec_apply(const kvm_sec *s, void *sock, const char *default_server, km_errbuf *err);
/* Loads s's keys as kvm_sec_apply would, on no connection: lets a caller blame a bad path on the
 * key rather than on the endpoint. */
int kvm_sec_check(const kvm_sec *s, const char *default_server, km_errbuf *err);

typedef struct kvm_opts {
    int timeout_ms;       /* longest silence while waiting for a frame; default 120000 */
    const char *identity; /* DEALER routing id; NULL = random */
    kvm_sec sec;          /* CURVE; {0}: plain */
    /* When not NULL: once *cancel is nonzero (a SIGINT handler sets it), kvm_generate cancels
     * its request on the server and returns KM_ECANCELED within ~100 ms. */
    const volatile int *cancel;
} kvm_opts;

/* Connects (lazily, as ZeroMQ does) to endpoint, e.g. "tcp://127.0.0.1:7000". */
int kvm_open(const char *endpoint, const kvm_opts *o, kvm_client **out, km_errbuf *err);
void kvm_close(kvm_client *c);

/* A request with the protocol's defaults (temperature 1, top_p 1, ...), model "default". */
void kvm_request_init(km_msg_request *r);

typedef struct kvm_result {
    int error_code; /* 0 when the request ended with `done` */
    char error[KM_PROTO_MAX_MESSAGE];
    uint32_t retry_after_ms;
    km_finish finish;
    km_buf text;       /* the whole completion (streamed or not) */
    uint32_t n_tokens; /* tokens received */
    uint32_t prompt_tokens, cached_tokens, completion_tokens;
    uint32_t draft_tokens, accepted_draft_tokens; /* speculative decoding (done.usage) */
    double queue_ms, ttft_ms, total_ms;           /* as the server measured */
    double client_ttft_ms, client_total_ms;       /* as this client measured */
    char worker[KM_PROTO_MAX_NAME + 1];           /* `done.worker`, when a router says it */
    uint32_t migrations;                          /* `done.migrations` */
} kvm_result;

void kvm_result_free(kvm_result *r);
/* Decode speed as this client saw it: tokens after the first step over the time after the first
 * token. A step yields one token plus its accepted drafts, so with speculative decoding the first
 * step's tokens all come with the first one and are not counted; the steps are completion_tokens
 * - accepted_draft_tokens, each taken as an average share. 0 when one step made every token. */
double kvm_result_decode_rate(const kvm_result *r);

/* Called for each `tok` frame in order; return nonzero to cancel the request. */
typedef int (*kvm_token_fn)(void *user, uint32_t index, int32_t token, const char *text,
                            size_t len);

/* Sends req (its id is chosen here) and waits for its end. res is initialised by the call. */
int kvm_generate(kvm_client *c, const km_msg_request *req, kvm_token_fn on_token, void *user,
                 kvm_result *res, km_errbuf *err);

/* Asynchronous use: submit any number of requests (each with its own req->id, unique among those
 * in flight), then read frames with kvm_next until each has its `done` or `err`. */
int kvm_submit(kvm_client *c, const km_msg_request *req, km_errbuf *err);
int kvm_cancel(kvm_client *c, uint64_t id);
/* The next frame from the server (km_msg_clear it); every key, done.worker and done.migrations
 * included, is in the decoded km_msg. raw_body/raw_len, when not NULL, receive the frame's bytes
 * as received (valid until the next call). KM_ETIMEDOUT after timeout_ms without one. */
int kvm_next(kvm_client *c, int timeout_ms, km_msg *out, const void **raw_body, size_t *raw_len,
             km_errbuf *err);

/* GET url (http://HOST:PORT/PATH) into body; *status gets the HTTP status. */
int kvm_http_get(const char *url, int timeout_ms, km_buf *body, int *status, km_errbuf *err);
/* The same with "Authorization: Bearer API_KEY" (a router front with --api-keys); NULL: none. */
int kvm_http_get_bearer(const char *url, const char *api_key, int timeout_ms, km_buf *body,
                        int *status, km_errbuf *err);

/* ---------------------------------------------------------------- operator calls
 * Admin frames to a worker (its requests endpoint) or to the controller (its --listen). Each call
 * opens a fresh DEALER, sends one `admin` frame and waits for the answer: an `admin_reply`, or a
 * `view` frame when a controller answers {cmd: status}. A fresh socket per call means the first
 * frame back is the answer; the cost (a connect) is nothing next to an operator's pace. */

/* Sends req (its id is chosen here when 0) and fills out (km_msg_clear it) with the reply.
 * KM_ETIMEDOUT when nothing came back in timeout_ms. A reply with ok=false is not an error of
 * this call: look at out->admin_reply.ok/code/message. */
int kvm_admin_call(const char *endpoint, const kvm_sec *sec, const km_msg_admin *req,
                   int timeout_ms, km_msg *out, km_errbuf *err);

/* The controller's cluster view with every worker's history ({cmd: status}). */
int kvm_view_get(const char *controller, const kvm_sec *sec, int timeout_ms, km_msg *view,
                 km_errbuf *err);

/* A subscription to the controller's --view PUB (two-part ["view", frame] messages). */
typedef struct kvm_view_sub kvm_view_sub;
int kvm_view_sub_open(const char *endpoint, const kvm_sec *sec, kvm_view_sub **out, km_errbuf *err);
/* The next view (km_msg_clear it); KM_ETIMEDOUT after timeout_ms without one. */
int kvm_view_sub_next(kvm_view_sub *s, int timeout_ms, km_msg *view, km_errbuf *err);
void kvm_view_sub_close(kvm_view_sub *s);

/* True when the view lists at least n workers and every one of them is "ready". */
bool kvm_view_all_ready(const km_msg_view *v, uint32_t n);

/* One recovery action of a view, with the worker it was for. */
typedef struct kvm_view_action {
    const km_view_worker *worker;
    const km_recovery_action *action;
    size_t order_; /* private: keeps ties in view order */
} kvm_view_action;
/* Every worker's recovery actions as one list, oldest first (equal times in view order), into
 * out (at most max); returns how many. Pointers are into v. */
size_t kvm_view_history(const km_msg_view *v, kvm_view_action *out, size_t max);

/* ---------------------------------------------------------------- cluster state file
 * `kvmesh up` keeps <run-dir>/cluster.env: one line per process, space-separated key=value pairs,
 * rewritten (atomically: temp file + rename) whenever a process starts or exits:
 *   role=controller id=controller pid=123 restarts=0 listen=tcp://.. view=tcp://.. admin=http://..
 *   role=worker id=w0 pid=124 restarts=1 requests=tcp://.. events=tcp://.. admin=http://..
 *       [peer=HOST:PORT: its UCX transfer node, with --peer-listen]
 *   role=router id=router pid=125 restarts=0 requests=tcp://.. http=http://..
 * pid=0 while a process is down (between an exit and its restart). */
#define KVM_CLUSTER_FILE "cluster.env"
#define KVM_CLUSTER_MAX  72

typedef struct kvm_cluster_proc {
    char role[16], id[64];
    int pid, restarts;
    char requests[128], events[128], admin[128], listen[128], view[128], http[128], peer[128];
} kvm_cluster_proc;

/* Reads a cluster file; returns the number of processes (up to max) or a negative km_err. */
int kvm_cluster_read(const char *path, kvm_cluster_proc *procs, int max, km_errbuf *err);
/* The process with this id in procs[0..n), or NULL. */
const kvm_cluster_proc *kvm_cluster_find(const kvm_cluster_proc *procs, int n, const char *id);

#ifdef __cplusplus
}
#endif
#endif /* KVMESH_H */
