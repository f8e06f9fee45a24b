/*
 * zsec.c — a process's CURVE set-up: its own certificate, the helpers that make a socket a CURVE
 * server (admitting chosen roles) or a CURVE client (of a named server), and reading and checking
 * who sent a message.
 *
 * Why it is built this way:
 *  - Sockets stay libzmq's own (`void *`, as common/zmqx.c makes them): the helpers only set
 *    options, so a daemon adds one call between opening a socket and binding or connecting it.
 *  - Roles travel in the ZAP domain: a server socket's domain is "kvmesh:" + the roles it admits
 *    ("kvmesh:member,operator"), which the ZAP handler reads (common/zap.c). A peer of the wrong
 *    role is refused at the handshake, before it can send a frame; sockets shared by roles
 *    (a router's front takes clients and operators) check each command with km_zsec_authorize.
 *  - ZMQ_ZAP_ENFORCE_DOMAIN makes a server socket whose context has no ZAP handler refuse every
 *    peer. Without it libzmq admits any CURVE key when no handler is bound (shown on libzmq
 *    4.3.4), and a forgotten km_zap_start would silently open the cluster.
 *  - The peer is read from the ZAP User-Id ("ROLE:NAME"), which libzmq takes only from the ZAP
 *    reply, and the worker binding from X-Kvmesh-Worker, which the handler always sets (a peer's
 *    own handshake metadata never overrides a property the ZAP reply carries; one the reply
 *    lacked would show through, which is why the handler never leaves it out).
 */
#include "common/sec.h"
#include "common/svc.h"

#include <czmq.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN                                                                     \
    93 /* a draft option in libzmq 4.3's header, present in the library */
#endif

struct km_zsec {
    bool insecure;
    char *keydir;
    char public_txt[41];
    char secret_txt[41];
    char name[KM_SEC_NAME_MAX + 1];
};

bool km_zsec_insecure(const km_zsec *z)
{
    return !z || z->insecure;
}

const char *km_zsec_public_key(const km_zsec *z)
{
    return km_zsec_insecure(z) ? "" : z->public_txt;
}

const char *km_zsec_keydir(const km_zsec *z)
{
    return z ? z->keydir : NULL;
}

/* The secret half of a certificate must be readable by its owner only. */
static int check_secret_mode(const char *path, km_errbuf *err)
{
    struct stat st;
    if (stat(path, &st))
        return km_errf(err, KM_ENOTFOUND, "no secret certificate %s: %s", path, strerror(errno));
    if (st.st_mode & 077)
        return km_errf(err, KM_EINVAL,
                       "secret certificate %s has mode %03o: others can read it (chmod 600)", path,
                       (unsigned)(st.st_mode & 0777));
    return 0;
}

int km_zsec_open(const km_zsec_opts *o, km_zsec **out, km_errbuf *err)
{
    *out = NULL;
    km_zsec *z = calloc(1, sizeof *z);
    if (!z) return km_errf(err, KM_ENOMEM, "out of memory");
    if (o->insecure) {
        z->insecure = true;
        *out = z;
        return 0;
    }
    int rc = 0;
    if (!o->cert)
        rc = km_errf(err, KM_EINVAL,
                     "security is on but no certificate was given (or run "
                     "insecure on purpose)");
    char secret_path[PATH_MAX];
    size_t n = o->cert ? strlen(o->cert) : 0;
    if (!rc) {
        bool is_secret = n > 7 && !strcmp(o->cert + n - 7, "_secret");
        if (snprintf(secret_path, sizeof secret_path, "%s%s", o->cert,
                     is_secret ? "" : "_secret") >= (int)sizeof secret_path)
            rc = km_errf(err, KM_EINVAL, "certificate path too long");
    }
    if (!rc) rc = check_secret_mode(secret_path, err);
    zcert_t *c = NULL;
    if (!rc && !(c = zcert_load(secret_path)))
        rc = km_errf(err, KM_EFORMAT, "%s: not a CZMQ certificate", secret_path);
    static const uint8_t zero[32];
    if (!rc && !memcmp(zcert_secret_key(c), zero, 32))
        rc = km_errf(err, KM_EFORMAT, "%s holds no secret key", secret_path);
    if (!rc) {
        memcpy(z->public_txt, zcert_public_txt(c), 41);
        memcpy(z->secret_txt, zcert_secret_txt(c), 41);
        const char *nm = zcert_meta(c, "name");
        snprintf(z->name, sizeof z->name, "%s", nm ? nm : "");
    }
    zcert_destroy(&c);
    struct stat st;
    if (!rc && o->keydir) {
        if (stat(o->keydir, &st) || !S_ISDIR(st.st_mode))
            rc = km_errf(err, KM_ENOTFOUND, "key directory %s not found", o->keydir);
        else if (!(z->keydir = strdup(o->keydir)))
            rc = km_errf(err, KM_ENOMEM, "out of memory");
    }
    if (rc) {
        km_zsec_close(z);
        return rc;
    }
    *out = z;
    return 0;
}

void km_zsec_close(km_zsec *z)
{
    if (!z) return;
    free(z->keydir);
    memset(z->secret_txt, 0, sizeof z->secret_txt);
    free(z);
}

static int setopt(void *sock, int opt, const void *v, size_t n, const char *what, km_errbuf *err)
{
    if (zmq_setsockopt(sock, opt, v, n))
        return km_errf(err, KM_EINVAL, "zmq setsockopt %s: %s", what, zmq_strerror(zmq_errno()));
    return 0;
}

int km_zsec_server(const km_zsec *z, void *sock, unsigned roles, km_errbuf *err)
{
    if (km_zsec_insecure(z)) return 0;
    if (!roles || (roles & ~(unsigned)KM_ROLES_ALL))
        return km_errf(err, KM_EINVAL, "a CURVE server must admit at least one known role");
    char domain[64] = "kvmesh:";
    const km_role order[3] = {KM_ROLE_MEMBER, KM_ROLE_OPERATOR, KM_ROLE_CLIENT};
    for (int i = 0, first = 1; i < 3; i++)
        if (roles & order[i]) {
            if (!first) strcat(domain, ",");
            strcat(domain, km_role_name(order[i]));
            first = 0;
        }
    int one = 1;
    int rc = setopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one, "ZMQ_CURVE_SERVER", err);
    if (!rc) rc = setopt(sock, ZMQ_CURVE_SECRETKEY, z->secret_txt, 40, "ZMQ_CURVE_SECRETKEY", err);
    if (!rc) rc = setopt(sock, ZMQ_ZAP_DOMAIN, domain, strlen(domain), "ZMQ_ZAP_DOMAIN", err);
    if (!rc)
        rc = setopt(sock, ZMQ_ZAP_ENFORCE_DOMAIN, &one, sizeof one, "ZMQ_ZAP_ENFORCE_DOMAIN", err);
    return rc;
}

static bool is_z85_key(const char *s)
{
    uint8_t b[32];
    return s && strlen(s) == 40 && zmq_z85_decode(b, s) != NULL;
}

/* The server's public key from what the caller named (see km_zsec_client). */
static int resolve_server(const km_zsec *z, const char *server, char out[41], km_errbuf *err)
{
    if (!server || !*server) return km_errf(err, KM_EINVAL, "a CURVE client needs a server key");
    if (is_z85_key(server)) {
        memcpy(out, server, 41);
        return 0;
    }
    size_t n = strlen(server);
    if (strchr(server, '/') || (n > 4 && !strcmp(server + n - 4, ".key")))
        return km_cert_read_public(server, out, err);
    if (!km_sec_name_ok(server))
        return km_errf(err, KM_EINVAL, "server '%s' is not a key, a file or a name", server);
    if (!z->keydir)
        return km_errf(err, KM_EINVAL,
                       "server '%s' is neither a key nor a certificate file, and there is no "
                       "key directory to look it up in",
                       server);
    km_cert_info info;
    int rc = km_keydir_find_worker(z->keydir, server, &info, NULL);
    if (rc == KM_ENOTFOUND)
        rc = km_keydir_find(z->keydir, KM_ROLE_MEMBER, server, &info, err);
    else if (rc)
        return km_errf(err, rc, "server '%s': several member keys claim that worker id", server);
    if (!rc) memcpy(out, info.public_txt, 41);
    return rc;
}

static int client_keys(const km_zsec *z, void *sock, const char server_key[41], km_errbuf *err)
{
    int rc = setopt(sock, ZMQ_CURVE_SERVERKEY, server_key, 40, "ZMQ_CURVE_SERVERKEY", err);
    if (!rc) rc = setopt(sock, ZMQ_CURVE_PUBLICKEY, z->public_txt, 40, "ZMQ_CURVE_PUBLICKEY", err);
    if (!rc) rc = setopt(sock, ZMQ_CURVE_SECRETKEY, z->secret_txt, 40, "ZMQ_CURVE_SECRETKEY", err);
    return rc;
}

int km_zsec_client(const km_zsec *z, void *sock, const char *server, km_errbuf *err)
{
    if (km_zsec_insecure(z)) return 0;
    char server_key[41];
    int rc = resolve_server(z, server, server_key, err);
    return rc ? rc : client_keys(z, sock, server_key, err);
}

int km_zsec_client_worker(const km_zsec *z, void *sock, const char *worker_id, km_errbuf *err)
{
    if (km_zsec_insecure(z)) return 0;
    if (!worker_id || !km_sec_name_ok(worker_id) || !z->keydir)
        return km_errf(err, KM_EINVAL, "'%.64s' is not a worker id with a key here",
                       worker_id ? worker_id : "");
    km_cert_info info;
    int rc = km_keydir_find_worker(z->keydir, worker_id, &info, err);
    return rc ? rc : client_keys(z, sock, info.public_txt, err);
}

int km_zpeer_from_msg(const void *zmq_msg, km_zpeer *out)
{
    memset(out, 0, sizeof *out);
    zmq_msg_t *m = (zmq_msg_t *)zmq_msg; /* zmq_msg_gets does not change the message */
    const char *uid = zmq_msg_gets(m, "User-Id");
    if (!uid) return KM_ENOTFOUND;
    const char *colon = strchr(uid, ':');
    char role[16];
    km_role r;
    if (!colon || (size_t)(colon - uid) >= sizeof role) return KM_ENOTFOUND;
    memcpy(role, uid, (size_t)(colon - uid));
    role[colon - uid] = '\0';
    if (km_role_parse(role, &r) || !km_sec_name_ok(colon + 1)) return KM_ENOTFOUND;
    out->role = r;
    snprintf(out->name, sizeof out->name, "%s", colon + 1);
    const char *w = zmq_msg_gets(m, "X-Kvmesh-Worker");
    if (w && r == KM_ROLE_MEMBER && km_sec_name_ok(w))
        snprintf(out->worker, sizeof out->worker, "%s", w);
    return 0;
}

int km_zsec_authorize(const km_zsec *z, const km_zpeer *p, unsigned roles, km_errbuf *err)
{
    if (km_zsec_insecure(z)) return 0;
    if (p && (p->role & roles)) return 0;
    return km_errf(err, KM_EACCES, "%s key %s may not do this", km_role_name(p ? p->role : 0),
                   p && p->name[0] ? p->name : "(unknown)");
}

int km_zsec_check_worker(const km_zsec *z, const km_zpeer *p, const char *worker_id, km_errbuf *err)
{
    if (km_zsec_insecure(z)) return 0;
    if (p && p->role == KM_ROLE_MEMBER && p->worker[0] && worker_id &&
        !strcmp(p->worker, worker_id))
        return 0;
    return km_errf(err, KM_EACCES, "key %s (%s, worker '%s') may not act as worker %s",
                   p && p->name[0] ? p->name : "(unknown)", km_role_name(p ? p->role : 0),
                   p ? p->worker : "", worker_id ? worker_id : "(none)");
}

/* ---------------------------------------------------------------- a daemon's security */

int km_sec_daemon_open(const km_sec_args *a, const char *prog, const char *default_name,
                       km_zsec **out, km_errbuf *err)
{
    *out = NULL;
    bool have_keys = a->keydir && a->keydir[0];
    if (a->insecure) {
        if (have_keys)
            return km_errf(err, KM_EINVAL, "--insecure and --keydir %s: choose one", a->keydir);
        km_zsec_opts o = {.insecure = true};
        int rc = km_zsec_open(&o, out, err);
        if (!rc)
            KM_WARN("insecure",
                    "prog=%s msg=\"no CURVE and no ZAP: anyone who reaches a port is "
                    "admitted (docs/security.md)\"",
                    prog);
        return rc;
    }
    if (!have_keys)
        return km_errf(err, KM_EINVAL,
                       "no --keydir: give the cluster key directory (kvmesh keys init DIR), or "
                       "run without security on purpose with --insecure");
    const char *cert = a->cert && a->cert[0] ? a->cert : default_name;
    if (!cert || !cert[0]) return km_errf(err, KM_EINVAL, "no --cert and no default name");
    char path[PATH_MAX];
    size_t n = strlen(cert);
    bool is_path = strchr(cert, '/') || (n > 4 && !strcmp(cert + n - 4, ".key")) ||
                   (n > 11 && !strcmp(cert + n - 11, ".key_secret"));
    if (!is_path && !km_sec_name_ok(cert))
        return km_errf(err, KM_EINVAL, "--cert '%s' is neither a file nor a key name", cert);
    int w = is_path ? snprintf(path, sizeof path, "%s", cert)
                    : snprintf(path, sizeof path, "%s/private/%s.key", a->keydir, cert);
    if (w < 0 || w >= (int)sizeof path) return km_errf(err, KM_EINVAL, "--cert path too long");
    km_zsec_opts o = {.keydir = a->keydir, .cert = path};
    return km_zsec_open(&o, out, err);
}

int km_sec_daemon_start(void *zctx, const km_zsec *z, km_metrics *metrics, km_zap **zap,
                        km_errbuf *err)
{
    *zap = NULL;
    if (metrics) {
        km_metric *g = NULL;
        int rc = km_metric_register(metrics, KM_GAUGE, "insecure",
                                    "1 when the daemon runs without CURVE (--insecure)", NULL, NULL,
                                    0, &g, err);
        if (rc) return rc;
        km_gauge_set(km_metric_series(g, NULL), km_zsec_insecure(z) ? 1 : 0);
    }
    return km_zap_start(zctx, z, metrics, zap, err);
}
