/*
 * zap.c — the ZAP handler (ZeroMQ RFC 27) of a libzmq context: admits a CURVE peer when the
 * cluster key directory holds its public key under a role the server socket's domain admits,
 * and tells libzmq who the peer is, so every message from it carries its role and name.
 *
 * Why it is its own handler and not CZMQ's zauth (measured on CZMQ 4.2.1 / libzmq 4.3.4):
 *  - zauth answers User-Id = the client's public key, not a role; certificate metadata does
 *    come back as properties, but into a fixed 512-byte buffer with no bounds check.
 *  - zauth binds inproc://zeromq.zap.01 in CZMQ's global context (zsys_init), so it serves only
 *    sockets made through CZMQ; kvmesh's sockets live in their own libzmq context (zmqx.c), where
 *    zauth is never asked. zsys_init also installs its own SIGINT/SIGTERM handlers over the
 *    daemons' (km_daemon_signals).
 *  - zauth reads keys through zcertstore's disk loader (see keydir.c for its two faults: edits
 *    within a second are missed, a duplicate key aborts the process), asserts on a malformed
 *    request and logs in its own format, with no counters.
 *  So the handler here is a thread with a REP socket in kvmesh's context that looks keys up in a
 *  km_keyring (CZMQ certificates and zcertstore underneath), answers per RFC 27, and logs and
 *  counts each decision in kvmesh's format.
 *
 * A decision takes a directory fingerprint (one readdir and a stat per key file) and a hash
 * lookup; it happens once per connection, never per message.
 */
#include "common/sec.h"
#include "common/svc.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define ZAP_ENDPOINT   "inproc://zeromq.zap.01"
#define ZAP_MAX_FRAMES 10
#define LOG_PER_SECOND 20

struct km_zap {
    void *rep, *ctl_thread, *ctl_main;
    pthread_t th;
    km_keyring *ring;
    km_metric *fam;
    _Atomic uint64_t allowed, denied, d_unknown, d_role, d_mech, d_other;
    /* log rate limit (handler thread only) */
    uint64_t win_start_ms;
    int win_lines;
    uint64_t suppressed;
};

typedef struct zap_req {
    zmq_msg_t f[ZAP_MAX_FRAMES];
    int n;
} zap_req;

static int frame_is(const zmq_msg_t *m, const char *s)
{
    size_t n = strlen(s);
    return zmq_msg_size((zmq_msg_t *)m) == n && !memcmp(zmq_msg_data((zmq_msg_t *)m), s, n);
}

/* A frame as text for logs: printable bytes only, truncated. */
static void frame_text(const zmq_msg_t *m, char *out, size_t cap)
{
    size_t n = zmq_msg_size((zmq_msg_t *)m), j = 0;
    const unsigned char *d = zmq_msg_data((zmq_msg_t *)m);
    for (size_t i = 0; i < n && j + 1 < cap; i++)
        out[j++] = d[i] > 32 && d[i] < 127 && d[i] != '"' ? (char)d[i] : '?';
    out[j] = '\0';
}

/* Domain "kvmesh:member,operator,client" -> role mask; 0 when it is not a kvmesh domain. */
static unsigned domain_roles(const zmq_msg_t *m)
{
    char d[64];
    size_t n = zmq_msg_size((zmq_msg_t *)m);
    if (n >= sizeof d || n < 8) return 0;
    memcpy(d, zmq_msg_data((zmq_msg_t *)m), n);
    d[n] = '\0';
    if (strncmp(d, "kvmesh:", 7)) return 0;
    unsigned mask = 0;
    char *save = NULL;
    for (char *t = strtok_r(d + 7, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        km_role r;
        if (km_role_parse(t, &r)) return 0;
        mask |= (unsigned)r;
    }
    return mask;
}

static size_t put_property(uint8_t *p, const char *name, const char *value)
{
    size_t nl = strlen(name), vl = strlen(value);
    p[0] = (uint8_t)nl;
    memcpy(p + 1, name, nl);
    p[1 + nl] = (uint8_t)(vl >> 24);
    p[2 + nl] = (uint8_t)(vl >> 16);
    p[3 + nl] = (uint8_t)(vl >> 8);
    p[4 + nl] = (uint8_t)vl;
    memcpy(p + 5 + nl, value, vl);
    return 5 + nl + vl;
}

static void send_reply(km_zap *a, const zap_req *q, const char *code, const char *text,
                       const char *user_id, const uint8_t *meta, size_t meta_len)
{
    const void *id = q->n > 1 ? zmq_msg_data((zmq_msg_t *)&q->f[1]) : "";
    size_t id_len = q->n > 1 ? zmq_msg_size((zmq_msg_t *)&q->f[1]) : 0;
    zmq_send(a->rep, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(a->rep, id, id_len, ZMQ_SNDMORE);
    zmq_send(a->rep, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(a->rep, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(a->rep, user_id, strlen(user_id), ZMQ_SNDMORE);
    zmq_send(a->rep, meta_len ? (const void *)meta : "", meta_len, 0);
}

/* Whether this decision may be logged now (LOG_PER_SECOND lines a second); *suppressed receives
 * how many were not logged since the last line that was. */
static int log_allowed(km_zap *a, uint64_t *suppressed)
{
    uint64_t now = km_now_ns() / 1000000u;
    if (now - a->win_start_ms >= 1000) {
        a->win_start_ms = now;
        a->win_lines = 0;
    }
    if (a->win_lines >= LOG_PER_SECOND) {
        a->suppressed++;
        return 0;
    }
    a->win_lines++;
    *suppressed = a->suppressed;
    a->suppressed = 0;
    return 1;
}

static void count(km_zap *a, const char *decision, km_role role, const char *reason)
{
    if (!a->fam) return;
    const char *labels[3] = {decision, km_role_name(role), reason};
    km_counter_inc(km_metric_series(a->fam, labels));
}

static void decide(km_zap *a, zap_req *q)
{
    char domain[80] = "", peer[64] = "", key[41] = "";
    const char *reason = NULL;
    km_cert_info info;
    memset(&info, 0, sizeof info);
    if (q->n < 6 || !frame_is(&q->f[0], "1.0")) {
        reason = "bad_request";
    } else {
        frame_text(&q->f[2], domain, sizeof domain);
        frame_text(&q->f[3], peer, sizeof peer);
        unsigned roles = domain_roles(&q->f[2]);
        if (!frame_is(&q->f[5], "CURVE"))
            reason = "mechanism";
        else if (q->n != 7 || zmq_msg_size(&q->f[6]) != 32)
            reason = "bad_request";
        else if (!roles)
            reason = "bad_domain";
        else {
            zmq_z85_encode(key, zmq_msg_data(&q->f[6]), 32);
            int rc = km_keyring_lookup(a->ring, key, &info);
            if (rc == KM_ENOTFOUND)
                reason = "unknown_key";
            else if (rc)
                reason = "ambiguous_key";
            else if (!(info.role & roles))
                reason = "role_not_allowed";
        }
    }
    uint64_t supp = 0;
    if (!reason) {
        char uid[KM_SEC_NAME_MAX + 16];
        snprintf(uid, sizeof uid, "%s:%s", km_role_name(info.role), info.name);
        uint8_t meta[3 * (1 + 16 + 4 + KM_SEC_NAME_MAX + 1)];
        size_t m = put_property(meta, "X-Kvmesh-Role", km_role_name(info.role));
        m += put_property(meta + m, "X-Kvmesh-Name", info.name);
        m += put_property(meta + m, "X-Kvmesh-Worker", info.worker);
        send_reply(a, q, "200", "OK", uid, meta, m);
        atomic_fetch_add(&a->allowed, 1);
        count(a, "allow", info.role, "ok");
        if (log_allowed(a, &supp)) /* every connection: debug, or the log is mostly this */
            KM_DEBUG("zap_allow",
                     "role=%s name=%s worker=%s domain=%s peer=%s key=%.8s suppressed=%llu",
                     km_role_name(info.role), info.name, info.worker[0] ? info.worker : "-", domain,
                     peer, key, (unsigned long long)supp);
        return;
    }
    send_reply(a, q, strcmp(reason, "bad_request") ? "400" : "500",
               strcmp(reason, "bad_request") ? "No access" : "Bad request", "", NULL, 0);
    atomic_fetch_add(&a->denied, 1);
    if (!strcmp(reason, "unknown_key"))
        atomic_fetch_add(&a->d_unknown, 1);
    else if (!strcmp(reason, "role_not_allowed"))
        atomic_fetch_add(&a->d_role, 1);
    else if (!strcmp(reason, "mechanism"))
        atomic_fetch_add(&a->d_mech, 1);
    else
        atomic_fetch_add(&a->d_other, 1);
    count(a, "deny", info.role, reason);
    if (log_allowed(a, &supp))
        KM_WARN("zap_deny", "reason=%s role=%s name=%s domain=%s peer=%s key=%.8s suppressed=%llu",
                reason, km_role_name(info.role), info.name[0] ? info.name : "-", domain, peer,
                key[0] ? key : "-", (unsigned long long)supp);
}

/* Receives one whole request (frames past ZAP_MAX_FRAMES are read and dropped) and answers it. */
static void serve_one(km_zap *a)
{
    zap_req q;
    q.n = 0;
    int more = 1, extra = 0;
    while (more) {
        zmq_msg_t tmp, *m = q.n < ZAP_MAX_FRAMES ? &q.f[q.n] : &tmp;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, a->rep, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(m);
            if (q.n == 0) return; /* spurious wake-up */
            break;
        }
        more = zmq_msg_more(m);
        if (m == &tmp) {
            zmq_msg_close(&tmp);
            extra++;
        } else {
            q.n++;
        }
    }
    int kept = q.n;
    if (extra) q.n = 0; /* an over-long request is malformed */
    decide(a, &q);
    for (int i = 0; i < kept; i++) zmq_msg_close(&q.f[i]);
}

static void *zap_main(void *arg)
{
    km_zap *a = arg;
    for (;;) {
        zmq_pollitem_t it[2] = {{a->rep, 0, ZMQ_POLLIN, 0}, {a->ctl_thread, 0, ZMQ_POLLIN, 0}};
        int r = zmq_poll(it, 2, -1);
        if (r < 0) {
            if (zmq_errno() == EINTR) continue;
            break; /* ETERM: the context is going away */
        }
        if (it[1].revents & ZMQ_POLLIN) break;
        if (it[0].revents & ZMQ_POLLIN) serve_one(a);
    }
    zmq_close(a->rep);
    zmq_close(a->ctl_thread);
    return NULL;
}

int km_zap_start(void *zctx, const km_zsec *z, km_metrics *metrics, km_zap **out, km_errbuf *err)
{
    *out = NULL;
    if (km_zsec_insecure(z)) return 0;
    if (!km_zsec_keydir(z))
        return km_errf(err, KM_EINVAL, "a ZAP handler needs the cluster key directory");
    km_zap *a = calloc(1, sizeof *a);
    if (!a) return km_errf(err, KM_ENOMEM, "out of memory");
    int rc = km_keyring_open(km_zsec_keydir(z), &a->ring, err);
    if (!rc && metrics)
        rc = km_metric_register(metrics, KM_COUNTER, "zap_decisions_total",
                                "CURVE connections admitted or refused by the ZAP handler",
                                "decision,role,reason", NULL, 0, &a->fam, err);
    char ctl[64];
    snprintf(ctl, sizeof ctl, "inproc://km-zap-ctl-%p", (void *)a);
    int zero = 0;
    if (!rc) {
        a->rep = zmq_socket(zctx, ZMQ_REP);
        a->ctl_thread = zmq_socket(zctx, ZMQ_PAIR);
        a->ctl_main = zmq_socket(zctx, ZMQ_PAIR);
        if (!a->rep || !a->ctl_thread || !a->ctl_main)
            rc = km_errf(err, KM_EIO, "zap: cannot open sockets: %s", zmq_strerror(zmq_errno()));
    }
    if (!rc) {
        zmq_setsockopt(a->rep, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(a->ctl_thread, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(a->ctl_main, ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_bind(a->rep, ZAP_ENDPOINT))
            rc = km_errf(err, KM_EIO,
                         "zap: cannot bind %s (a handler already runs in this "
                         "context?): %s",
                         ZAP_ENDPOINT, zmq_strerror(zmq_errno()));
        else if (zmq_bind(a->ctl_thread, ctl) || zmq_connect(a->ctl_main, ctl))
            rc = km_errf(err, KM_EIO, "zap: control pipe: %s", zmq_strerror(zmq_errno()));
    }
    if (!rc && pthread_create(&a->th, NULL, zap_main, a))
        rc = km_errf(err, KM_EIO, "zap: cannot start its thread");
    if (rc) {
        if (a->rep) zmq_close(a->rep);
        if (a->ctl_thread) zmq_close(a->ctl_thread);
        if (a->ctl_main) zmq_close(a->ctl_main);
        km_keyring_close(a->ring);
        free(a);
        return rc;
    }
    KM_INFO("zap_started", "keydir=%s keys=%d", km_zsec_keydir(z), km_keyring_count(a->ring));
    *out = a;
    return 0;
}

void km_zap_stop(km_zap *a)
{
    if (!a) return;
    zmq_send(a->ctl_main, "", 0, 0);
    pthread_join(a->th, NULL);
    zmq_close(a->ctl_main);
    km_keyring_close(a->ring);
    free(a);
}

void km_zap_stats_get(const km_zap *a, km_zap_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!a) return;
    km_zap *m = (km_zap *)a;
    out->allowed = atomic_load(&m->allowed);
    out->denied = atomic_load(&m->denied);
    out->denied_unknown_key = atomic_load(&m->d_unknown);
    out->denied_role = atomic_load(&m->d_role);
    out->denied_mechanism = atomic_load(&m->d_mech);
    out->denied_other = atomic_load(&m->d_other);
}
