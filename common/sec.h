/*
 * sec.h — kvmesh's security building blocks (docs/security.md): the cluster key directory
 * (CZMQ certificates with roles), the ZAP handler that admits CURVE peers by key, the helpers
 * that make a socket a CURVE server or client and read who sent a message, HTTP API keys, and
 * the cluster secret with the keyed MAC of disk pages.
 *
 * Contract:
 *  - Roles: a key is a *member* (controller, router, worker: may register, publish, command), an
 *    *operator* (admin and recovery commands) or a *client* (generate, cancel, read status). The
 *    role of a key is the directory it sits in (members/, operators/, clients/), never what the
 *    key's owner wrote into it, so a client cannot promote itself by editing its own file. A
 *    worker's member key is bound to one worker id (certificate metadata `worker`).
 *  - A CURVE server socket made by km_zsec_server admits only keys of the roles it names, decided
 *    by the ZAP handler (km_zap_start) of its libzmq context before the peer can send a frame;
 *    without a running handler the socket admits nobody (ZMQ_ZAP_ENFORCE_DOMAIN), never everybody.
 *  - Every message from an admitted peer carries the peer's role and name (ZAP User-Id
 *    "ROLE:NAME") and worker binding; km_zpeer_from_msg reads them and a daemon checks them per
 *    command with km_zsec_authorize and km_zsec_check_worker (KM_EACCES: answer 403).
 *  - Insecure mode is explicit (km_zsec_opts.insecure): the socket helpers do nothing and every
 *    authorisation passes. There is no implicit fallback from secure to insecure.
 *  - Key files are re-read when their directory changes (nanosecond mtimes, names, sizes), so
 *    adding a public key lets it in and removing one refuses its new connections, without a
 *    restart. Connections already open stay open (CURVE authenticates at connect).
 *  - Secret files (certificates' _secret halves, cluster.secret, API key files) are written mode
 *    0600, and loading one that others can read is refused.
 *  - This header includes no third-party header; sockets and messages are libzmq's `void *`.
 *  - Errors: 0 or a negative km_err, with a one-line message in the caller's km_errbuf.
 */
#ifndef KM_SEC_H
#define KM_SEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/km.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_metrics km_metrics; /* common/svc.h */
typedef struct km_zap km_zap;         /* the ZAP handler, below */

/* ---------------------------------------------------------------- roles */

typedef enum km_role {
    KM_ROLE_NONE = 0,
    KM_ROLE_MEMBER = 1,
    KM_ROLE_OPERATOR = 2,
    KM_ROLE_CLIENT = 4,
} km_role;
#define KM_ROLES_ALL (KM_ROLE_MEMBER | KM_ROLE_OPERATOR | KM_ROLE_CLIENT)

/* "member", "operator", "client"; "none" for anything else. */
const char *km_role_name(km_role r);
/* The inverse of km_role_name (no "none"); KM_EINVAL for anything else. */
int km_role_parse(const char *s, km_role *out);
/* The directory of a role inside a key directory: "members", "operators", "clients". */
const char *km_role_dir(km_role r);

/* Names of keys, tenants and worker ids: 1..64 of [A-Za-z0-9._-], not starting with '.'. */
#define KM_SEC_NAME_MAX 64
bool km_sec_name_ok(const char *s);

/* ---------------------------------------------------------------- key directory (keydir.c)
 *
 *   DIR/              0700
 *     members/        public certificates (NAME.key) of the controller, routers and workers
 *     operators/      public certificates of operators
 *     clients/        public certificates of clients
 *     private/        0700: NAME.key + NAME.key_secret (0600) of the certificates made here, to
 *                     hand to their owners (a host keeps only its own)
 *     cluster.secret  0600: 32 random bytes, hex (disk page MACs)
 * Certificates are CZMQ's zcert files; their metadata carries role, name and, for a worker's
 * member key, worker. Names are unique across the three roles.
 */

typedef struct km_cert_info {
    km_role role;
    char name[KM_SEC_NAME_MAX + 1];
    char worker[KM_SEC_NAME_MAX + 1]; /* "" unless a worker's member key */
    char public_txt[41];              /* Z85 */
} km_cert_info;

/* Creates DIR with its layout and cluster.secret; leaves what already exists as it is. */
int km_keydir_init(const char *dir, km_errbuf *err);
/* A whole cluster's keys, for `kvmesh keys init` and `kvmesh up`: the layout and cluster.secret,
 * member keys "controller" and "router", a member key per worker id (named by it and bound to
 * it), an operator key "admin" and a client key "client". Keys that exist are kept, so it can run
 * again to add workers. Returns how many keys it made. */
int km_keydir_init_cluster(const char *dir, const char *const *workers, int n_workers,
                           km_errbuf *err);
/* A new key pair NAME: private/NAME.key(_secret) and ROLE/NAME.key. worker: NULL or a worker id
 * (members only). KM_EINVAL when NAME exists under any role. */
int km_keydir_new_cert(const char *dir, km_role role, const char *name, const char *worker,
                       km_errbuf *err);
/* Admits a public key made elsewhere (Z85, 40 characters) as ROLE/NAME.key. */
int km_keydir_add_public(const char *dir, km_role role, const char *name, const char *public_txt,
                         const char *worker, km_errbuf *err);
/* Removes NAME (its public file and any private copy). KM_ENOTFOUND when there is none. */
int km_keydir_remove(const char *dir, const char *name, km_errbuf *err);
/* The keys of the roles in role_mask, sorted by role then name: writes up to max and returns the
 * total count. */
int km_keydir_list(const char *dir, unsigned role_mask, km_cert_info *out, int max, km_errbuf *err);
/* The member key bound to worker id `worker` (for a router's CURVE server key of that worker). */
int km_keydir_find_worker(const char *dir, const char *worker, km_cert_info *out, km_errbuf *err);
/* The key ROLE/NAME (role 0: any role). */
int km_keydir_find(const char *dir, km_role role, const char *name, km_cert_info *out,
                   km_errbuf *err);
/* The public key of a certificate file (NAME.key or NAME.key_secret). */
int km_cert_read_public(const char *path, char out[41], km_errbuf *err);

/* The in-memory view of a key directory's three role directories that the ZAP handler looks keys
 * up in. It is reloaded when a directory changed since the last look (a change is any entry
 * added, removed, renamed or rewritten; nanosecond mtimes, so two edits in one second are seen).
 * Bad files (unreadable, malformed, a role or worker binding that does not fit the directory, a
 * key already seen) are skipped with a log line; one bad file never locks out the others. */
typedef struct km_keyring km_keyring;

int km_keyring_open(const char *dir, km_keyring **out, km_errbuf *err);
void km_keyring_close(km_keyring *k);
/* Reloads what changed: 1 when something was reloaded, 0 when nothing changed. */
int km_keyring_refresh(km_keyring *k);
/* Refreshes, then finds the key: 0, KM_ENOTFOUND, or KM_EINVAL when the key sits under two
 * roles (refused: ambiguous). */
int km_keyring_lookup(km_keyring *k, const char *public_txt, km_cert_info *out);
/* Keys currently loaded (after the last refresh). */
int km_keyring_count(const km_keyring *k);

/* ---------------------------------------------------------------- a process's CURVE set-up
 * (zsec.c) */

typedef struct km_zsec_opts {
    bool insecure;      /* explicit: no CURVE, no ZAP, every authorisation passes */
    const char *keydir; /* the cluster key directory: ZAP lookups and member server keys; may be
                         * NULL for a pure client (then servers are named by key or file) */
    const char *cert;   /* this process's certificate: NAME.key with NAME.key_secret beside it */
} km_zsec_opts;

typedef struct km_zsec km_zsec;

/* Loads the certificate (refusing a secret file that others can read) and checks the key
 * directory. In insecure mode nothing is loaded. */
int km_zsec_open(const km_zsec_opts *o, km_zsec **out, km_errbuf *err);
void km_zsec_close(km_zsec *z);
bool km_zsec_insecure(const km_zsec *z);
/* This process's public key (Z85), "" in insecure mode. */
const char *km_zsec_public_key(const km_zsec *z);
const char *km_zsec_keydir(const km_zsec *z);

/* Makes a socket (before its bind or connect) a CURVE server that admits keys of `roles`: sets
 * ZMQ_CURVE_SERVER, the secret key, ZMQ_ZAP_DOMAIN "kvmesh:ROLES" and ZMQ_ZAP_ENFORCE_DOMAIN. */
int km_zsec_server(const km_zsec *z, void *sock, unsigned roles, km_errbuf *err);
/* Makes a socket a CURVE client of `server`: a Z85 public key (40 characters), a certificate
 * file path (contains '/' or ends in ".key"), a worker id bound to a member key, or a member
 * name ("controller", "router") in the key directory. */
int km_zsec_client(const km_zsec *z, void *sock, const char *server, km_errbuf *err);
/* The same for a server named only by a worker id: the member key bound to it in the key
 * directory, never a key or a file (for ids that came in a frame). */
int km_zsec_client_worker(const km_zsec *z, void *sock, const char *worker_id, km_errbuf *err);

/* Who sent a message, as the ZAP handler admitted it. */
typedef struct km_zpeer {
    km_role role;                     /* KM_ROLE_NONE when not authenticated */
    char name[KM_SEC_NAME_MAX + 1];   /* the key's name */
    char worker[KM_SEC_NAME_MAX + 1]; /* worker id bound to the key, "" if none */
} km_zpeer;

/* Reads the peer of a received message part (a zmq_msg_t *): every part that came from the peer
 * carries it, but not the routing-id part a ROUTER socket puts in front, so read the body. 0, or
 * KM_ENOTFOUND when it carries no kvmesh User-Id (insecure socket, or no kvmesh ZAP handler);
 * out is then cleared (role NONE). */
int km_zpeer_from_msg(const void *zmq_msg, km_zpeer *out);
/* 0 when the peer has one of `roles`, KM_EACCES otherwise; always 0 in insecure mode. */
int km_zsec_authorize(const km_zsec *z, const km_zpeer *p, unsigned roles, km_errbuf *err);
/* 0 when the peer is a member bound to worker_id, KM_EACCES otherwise (no one beats for another's
 * id); always 0 in insecure mode. */
int km_zsec_check_worker(const km_zsec *z, const km_zpeer *p, const char *worker_id,
                         km_errbuf *err);

/* ---------------------------------------------------------------- a daemon's security
 * (zsec.c): the same three options and the same start-up in every daemon.
 *
 *   --keydir DIR   the cluster key directory (env KVMESH_KEYDIR)
 *   --cert C       this daemon's certificate: a path to NAME.key (its NAME.key_secret beside
 *                  it), or a NAME meaning DIR/private/NAME.key; default: the daemon's own
 *                  name ("controller", "router", the worker id) (env KVMESH_CERT)
 *   --insecure     no CURVE, no ZAP: anyone who reaches a port is admitted (env
 *                  KVMESH_INSECURE)
 * Neither --keydir nor --insecure is an error: security is never off by accident. */
typedef struct km_sec_args {
    const char *keydir, *cert;
    bool insecure;
} km_sec_args;

/* The three option-table rows (common/svc.h km_opt) for a km_sec_args *a. */
#define KM_SEC_OPT_ROWS(a)                                                                         \
    {"keydir",                                                                                     \
     NULL,                                                                                         \
     KM_OPT_STR,                                                                                   \
     NULL,                                                                                         \
     "cluster key directory (docs/security.md); required unless --insecure",                       \
     &(a)->keydir,                                                                                 \
     0,                                                                                            \
     0},                                                                                           \
        {"cert",                                                                                   \
         NULL,                                                                                     \
         KM_OPT_STR,                                                                               \
         NULL,                                                                                     \
         "this daemon's certificate: PATH/NAME.key or a NAME in KEYDIR/private (default: the "     \
         "daemon's own name)",                                                                     \
         &(a)->cert,                                                                               \
         0,                                                                                        \
         0},                                                                                       \
    {                                                                                              \
        "insecure", NULL, KM_OPT_BOOL, "false",                                                    \
            "no CURVE encryption or authentication: anyone who reaches a port is admitted",        \
            &(a)->insecure, 0, 0                                                                   \
    }

/* Opens a daemon's security from its options: insecure (one warning line, event=insecure) or
 * the key directory and certificate (default_name: the certificate's NAME when --cert is
 * unset). KM_EINVAL, with a message naming both choices, when neither was given. */
int km_sec_daemon_open(const km_sec_args *a, const char *prog, const char *default_name,
                       km_zsec **out, km_errbuf *err);
/* The daemon's ZAP handler in zctx (start it before any bind; *zap stays NULL when insecure)
 * and the gauge kvmesh_insecure (1 when insecure, 0 otherwise) in metrics. */
int km_sec_daemon_start(void *zctx, const km_zsec *z, km_metrics *metrics, km_zap **zap,
                        km_errbuf *err);

/* ---------------------------------------------------------------- ZAP handler (zap.c) */

/* The ZAP handler (RFC 27) of a libzmq context: a thread with a REP socket on
 * inproc://zeromq.zap.01 that admits a CURVE key when the key directory holds it under a role
 * the server socket's domain names. Every decision is one log line (event=zap_allow or zap_deny;
 * denials are rate-limited to 20 lines a second, the rest counted in the next line) and a counter
 * kvmesh_zap_decisions_total{decision,role,reason}. An admitted peer gets User-Id "ROLE:NAME" and
 * the properties X-Kvmesh-Role, X-Kvmesh-Name and X-Kvmesh-Worker (always all three, so a peer
 * cannot supply its own). Start it before any server socket binds; stop it before the context
 * is destroyed. In insecure mode it starts nothing (*out = NULL). metrics may be NULL. */

typedef struct km_zap_stats {
    uint64_t allowed, denied;
    uint64_t denied_unknown_key, denied_role, denied_mechanism, denied_other;
} km_zap_stats;

int km_zap_start(void *zctx, const km_zsec *z, km_metrics *metrics, km_zap **out, km_errbuf *err);
void km_zap_stop(km_zap *a);
void km_zap_stats_get(const km_zap *a, km_zap_stats *out);

/* ---------------------------------------------------------------- HTTP API keys (apikey.c)
 *
 * A key file holds one key per line: `b2:HASH TENANT ROLE [salt=SALT]`, '#' comments, where HASH
 * is 64 hex digits of BLAKE2b-256 (keyed with a fixed domain string) of the key, ROLE is client
 * or operator, and salt=SALT, when given, is a prefix-cache salt the operator shares on purpose
 * (otherwise each key's salt is derived from its hash, so two keys never share cached prefixes).
 * Keys are random 256-bit tokens ("kvm_" + 43 base64url characters), so one fast hash suffices;
 * a slow password hash would only make every request cost it. The file is re-read when it
 * changes; bad lines are skipped with a log line.
 */

typedef struct km_apikeys km_apikeys;

typedef struct km_apikey_match {
    char tenant[KM_SEC_NAME_MAX + 1];
    km_role role;   /* KM_ROLE_CLIENT or KM_ROLE_OPERATOR */
    char salt[100]; /* the tenant's cache salt (derived or shared), not yet composed */
} km_apikey_match;

#define KM_APIKEY_TOKEN_MAX 256

int km_apikeys_open(const char *path, km_apikeys **out, km_errbuf *err);
void km_apikeys_close(km_apikeys *k);
/* Re-reads the file when it changed (at most once per min_interval_ms; 0: every call). */
void km_apikeys_set_check_interval(km_apikeys *k, int min_interval_ms);
int km_apikeys_count(km_apikeys *k);
/* Maps a token to its tenant: hashes it once, then compares the hash with every entry in
 * constant time (sodium_memcmp), whether or not one matched. 0 or KM_ENOTFOUND. Thread-safe. */
int km_apikeys_lookup(km_apikeys *k, const char *token, size_t len, km_apikey_match *out);
/* The same from an Authorization header value ("Bearer TOKEN", case-insensitive scheme):
 * KM_EFORMAT for a missing or malformed header, KM_ENOTFOUND for an unknown key. */
int km_apikeys_check_header(km_apikeys *k, const char *value, size_t len, km_apikey_match *out);

/* A new random key ("kvm_" + 43 base64url characters), NUL-terminated; cap >= 48. */
int km_apikey_generate(char *out, size_t cap);
/* The stored form of a key: "b2:" + 64 hex digits; cap >= 68. */
int km_apikey_hash(const char *token, size_t len, char *out, size_t cap);
/* Appends a line for a new key of TENANT (role client or operator; shared_salt NULL for a
 * derived one) to the key file, creating it 0600, and returns the key (shown once). */
int km_apikeys_add(const char *path, const char *tenant, km_role role, const char *shared_salt,
                   char *token_out, size_t cap, km_errbuf *err);
/* Removes every line of TENANT; returns how many were removed (0 is not an error). */
int km_apikeys_remove(const char *path, const char *tenant, km_errbuf *err);

/* The cache_salt a request is hashed under: keyed requests get "kvmesh:t:" + the tenant's salt
 * (+ "/" + the request's own salt), so they can narrow their cache but never join another
 * tenant's; an unkeyed request keeps its salt, except one that starts with "kvmesh:", which gets
 * "kvmesh:u:" in front, so no unkeyed request can name a keyed tenant's cache. m NULL: unkeyed.
 * Returns the length, KM_ENOSPC when cap is too small. */
int km_cache_salt_compose(const km_apikey_match *m, const char *req_salt, char *out, size_t cap);
/* The tenant a composed cache salt belongs to, as a number for the worker's fair share: a keyed
 * salt's "kvmesh:t:" and tenant salt, without the request's own part; 0 for an unkeyed salt or
 * none (everyone unkeyed is one tenant, as at the router). Never 0 for a keyed one. */
uint64_t km_cache_salt_tenant(const char *salt);

/* ---------------------------------------------------------------- cluster secret and MACs
 * (secret.c) */

#define KM_SECRET_BYTES 32
#define KM_MAC_BYTES    32

/* Initialises libsodium once (thread-safe): 0, or KM_EIO when it cannot. */
int km_sodium_ready(void);
/* Writes 32 random bytes as hex to path (mode 0600, created atomically; KM_EINVAL if it exists). */
int km_secret_generate_file(const char *path, km_errbuf *err);
/* Reads a secret file (64 hex digits); refuses one that group or others can read. */
int km_secret_load(const char *path, uint8_t out[KM_SECRET_BYTES], km_errbuf *err);
/* A key for one purpose from the cluster secret (libsodium crypto_kdf, BLAKE2b): context is
 * exactly 8 characters ("kvmpage1"), id tells keys of one context apart. */
void km_secret_derive(const uint8_t secret[KM_SECRET_BYTES], const char *context, uint64_t id,
                      uint8_t out[KM_SECRET_BYTES]);
/* Keyed BLAKE2b-256 (crypto_generichash with a key) of data. */
void km_mac(const uint8_t key[KM_SECRET_BYTES], const void *data, size_t len,
            uint8_t out[KM_MAC_BYTES]);
/* 0 when tag is the MAC of data under key (compared in constant time), KM_ECORRUPT otherwise. */
int km_mac_verify(const uint8_t key[KM_SECRET_BYTES], const void *data, size_t len,
                  const uint8_t tag[KM_MAC_BYTES]);
#define KM_SEAL_NONCE_BYTES 24
#define KM_SEAL_TAG_BYTES   16
/* Authenticated encryption (libsodium's XChaCha20-Poly1305, IETF): msg[0, len) is encrypted in
 * place under key, a fresh random nonce written to nonce and the tag, which also covers ad
 * (authenticated, not encrypted), to tag. */
void km_seal(const uint8_t key[KM_SECRET_BYTES], const void *ad, size_t ad_len, uint8_t *msg,
             size_t len, uint8_t nonce[KM_SEAL_NONCE_BYTES], uint8_t tag[KM_SEAL_TAG_BYTES]);
/* Decrypts in place what km_seal made: 0, or KM_ECORRUPT (msg left as it was) when the tag does
 * not verify under key, nonce and ad. */
int km_unseal(const uint8_t key[KM_SECRET_BYTES], const void *ad, size_t ad_len, uint8_t *msg,
              size_t len, const uint8_t nonce[KM_SEAL_NONCE_BYTES],
              const uint8_t tag[KM_SEAL_TAG_BYTES]);
/* Writes a file atomically (temporary in the same directory, fsync, rename) with `mode`. */
int km_write_file_atomic(const char *path, const void *data, size_t len, unsigned mode,
                         km_errbuf *err);

#ifdef __cplusplus
}
#endif
#endif /* KM_SEC_H */
