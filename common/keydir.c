/*
 * keydir.c — the cluster key directory (layout in common/sec.h): making, admitting, removing and
 * listing certificates, and the keyring, the in-memory view the ZAP handler looks keys up in.
 *
 * Why it is built this way:
 *  - Certificates are CZMQ's zcert files and are read with zcert_load, so `kvmesh keys`, CZMQ's
 *    own tools and any CZMQ program agree on the format. CZMQ's zcertstore holds the loaded keys
 *    (a hash by Z85 public key), but it is filled here, not by its own disk loader, because that
 *    loader (CZMQ 4.2.1) has two faults that matter for a cluster's key directory:
 *      1. it notices a change only by the newest file mtime in whole seconds, the file count and
 *         the total size, so replacing a key by one of the same size within the same second is
 *         missed: the old key stays admitted and the new one refused until some later change;
 *      2. two files holding the same public key make it abort the whole process (an assertion in
 *         zcertstore_insert), e.g. after an operator copies alice.key to alice-old.key.
 *    The keyring below fingerprints each directory by nanosecond mtimes, inodes and sizes of the
 *    directory and every entry, reloads a changed one into a fresh store, and skips (and logs) a
 *    duplicate or malformed file instead of dying on it.
 *  - The role of a key is the directory it is in. Metadata written by the key's owner is checked
 *    against it (a file in clients/ that says role=member is refused, not promoted), and only
 *    members/ may bind a key to a worker id.
 *  - Files are followed through symlinks, and names starting with '.' are skipped: a Kubernetes
 *    Secret volume is a directory of symlinks into a hidden ..data directory, swapped atomically.
 */
#include "common/sec.h"

#include <czmq.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

static const km_role role_order[3] = {KM_ROLE_MEMBER, KM_ROLE_OPERATOR, KM_ROLE_CLIENT};

const char *km_role_name(km_role r)
{
    switch (r) {
    case KM_ROLE_MEMBER:
        return "member";
    case KM_ROLE_OPERATOR:
        return "operator";
    case KM_ROLE_CLIENT:
        return "client";
    default:
        return "none";
    }
}

int km_role_parse(const char *s, km_role *out)
{
    for (int i = 0; i < 3; i++)
        if (s && !strcmp(s, km_role_name(role_order[i]))) {
            *out = role_order[i];
            return 0;
        }
    return KM_EINVAL;
}

const char *km_role_dir(km_role r)
{
    switch (r) {
    case KM_ROLE_MEMBER:
        return "members";
    case KM_ROLE_OPERATOR:
        return "operators";
    case KM_ROLE_CLIENT:
        return "clients";
    default:
        return NULL;
    }
}

bool km_sec_name_ok(const char *s)
{
    if (!s || !*s || *s == '.') return false;
    size_t n = 0;
    for (; s[n]; n++) {
        char c = s[n];
        if (n >= KM_SEC_NAME_MAX) return false;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return false;
    }
    return true;
}

static bool is_single_role(km_role r)
{
    return r == KM_ROLE_MEMBER || r == KM_ROLE_OPERATOR || r == KM_ROLE_CLIENT;
}

static int path_of(char *out, size_t cap, const char *dir, const char *sub, const char *name,
                   const char *suffix)
{
    int n = snprintf(out, cap, "%s/%s%s%s%s", dir, sub, name ? "/" : "", name ? name : "",
                     suffix ? suffix : "");
    return n < 0 || (size_t)n >= cap ? KM_EINVAL : 0;
}

/* Whether `name` ends in ".key" with a valid key name before it; the name goes to out. */
static bool key_file_name(const char *file, char out[KM_SEC_NAME_MAX + 1])
{
    size_t n = strlen(file);
    if (n <= 4 || n - 4 > KM_SEC_NAME_MAX || strcmp(file + n - 4, ".key")) return false;
    memcpy(out, file, n - 4);
    out[n - 4] = '\0';
    return km_sec_name_ok(out);
}

/* Loads one certificate file and checks it against the directory it came from. *cert_out (when
 * not NULL) receives the loaded zcert with its name set in metadata. why: a reason on failure. */
static int cert_load_checked(const char *path, km_role role, const char *name, km_cert_info *info,
                             zcert_t **cert_out, const char **why)
{
    *why = NULL;
    zcert_t *c = zcert_load(path);
    if (!c) {
        *why = "unreadable_or_malformed";
        return KM_EFORMAT;
    }
    static const uint8_t zero[32];
    const char *mrole = zcert_meta(c, "role"), *worker = zcert_meta(c, "worker");
    km_role r = KM_ROLE_NONE;
    if (!memcmp(zcert_public_key(c), zero, 32))
        *why = "no_public_key";
    else if (mrole && (km_role_parse(mrole, &r) || r != role))
        *why = "role_mismatch";
    else if (worker && *worker && role != KM_ROLE_MEMBER)
        *why = "worker_binding_outside_members";
    else if (worker && *worker && !km_sec_name_ok(worker))
        *why = "bad_worker_id";
    if (*why) {
        zcert_destroy(&c);
        return KM_EFORMAT;
    }
    memset(info, 0, sizeof *info);
    info->role = role;
    snprintf(info->name, sizeof info->name, "%s", name);
    snprintf(info->worker, sizeof info->worker, "%s", worker ? worker : "");
    memcpy(info->public_txt, zcert_public_txt(c), 41);
    if (cert_out) {
        zcert_set_meta(c, "name", "%s", name);
        zcert_set_meta(c, "role", "%s", km_role_name(role));
        *cert_out = c;
    } else {
        zcert_destroy(&c);
    }
    return 0;
}

int km_cert_read_public(const char *path, char out[41], km_errbuf *err)
{
    zcert_t *c = zcert_load(path);
    if (!c) return km_errf(err, KM_EFORMAT, "%s: not a CZMQ certificate", path);
    memcpy(out, zcert_public_txt(c), 41);
    zcert_destroy(&c);
    return 0;
}

/* ---------------------------------------------------------------- making the directory */

static int mkdir_mode(const char *path, unsigned mode, km_errbuf *err)
{
    if (mkdir(path, mode) && errno != EEXIST)
        return km_errf(err, KM_EIO, "cannot create %s: %s", path, strerror(errno));
    struct stat st;
    if (stat(path, &st) || !S_ISDIR(st.st_mode))
        return km_errf(err, KM_EIO, "%s is not a directory", path);
    return 0;
}

int km_keydir_init(const char *dir, km_errbuf *err)
{
    char p[PATH_MAX];
    /* parents as `mkdir -p` would make them; the directory itself 0700 */
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
        return km_errf(err, KM_EINVAL, "key directory path too long");
    for (char *c = p + 1; *c; c++)
        if (*c == '/') {
            *c = '\0';
            mkdir(p, 0755);
            *c = '/';
        }
    int rc = mkdir_mode(dir, 0700, err);
    for (int i = 0; i < 3 && !rc; i++)
        if (!(rc = path_of(p, sizeof p, dir, km_role_dir(role_order[i]), NULL, NULL)))
            rc = mkdir_mode(p, 0755, err);
    if (!rc && !(rc = path_of(p, sizeof p, dir, "private", NULL, NULL)))
        rc = mkdir_mode(p, 0700, err);
    if (!rc && !(rc = path_of(p, sizeof p, dir, "cluster.secret", NULL, NULL))) {
        struct stat st;
        if (stat(p, &st)) rc = km_secret_generate_file(p, err);
    }
    if (rc == KM_EINVAL && err && !err->msg[0]) km_errf(err, rc, "key directory path too long");
    return rc;
}

/* KM_EINVAL when NAME is taken under any role or in private/. */
static int name_free(const char *dir, const char *name, km_errbuf *err)
{
    char p[PATH_MAX];
    struct stat st;
    for (int i = 0; i < 3; i++) {
        if (path_of(p, sizeof p, dir, km_role_dir(role_order[i]), name, ".key"))
            return km_errf(err, KM_EINVAL, "key directory path too long");
        if (!stat(p, &st))
            return km_errf(err, KM_EINVAL, "key %s exists (%s)", name, km_role_name(role_order[i]));
    }
    if (!path_of(p, sizeof p, dir, "private", name, ".key") && !stat(p, &st))
        return km_errf(err, KM_EINVAL, "key %s exists (private)", name);
    return 0;
}

static int check_new(const char *dir, km_role role, const char *name, const char *worker,
                     km_errbuf *err)
{
    if (!dir || !is_single_role(role))
        return km_errf(err, KM_EINVAL, "a key needs a directory and one role");
    if (!km_sec_name_ok(name))
        return km_errf(err, KM_EINVAL, "bad key name '%s' (1..64 of A-Z a-z 0-9 . _ -)",
                       name ? name : "");
    if (worker && *worker && (role != KM_ROLE_MEMBER || !km_sec_name_ok(worker)))
        return km_errf(err, KM_EINVAL,
                       "a worker id (%s) binds member keys only, and must be a "
                       "valid name",
                       worker);
    return name_free(dir, name, err);
}

static void set_meta(zcert_t *c, km_role role, const char *name, const char *worker)
{
    zcert_set_meta(c, "role", "%s", km_role_name(role));
    zcert_set_meta(c, "name", "%s", name);
    if (worker && *worker) zcert_set_meta(c, "worker", "%s", worker);
    zcert_set_meta(c, "created-by", "kvmesh");
}

/* Writes the public half to ROLE/NAME.key through a hidden temporary and a rename, so the ZAP
 * handler never loads half a file. */
static int save_public(const char *dir, km_role role, const char *name, zcert_t *c, km_errbuf *err)
{
    char tmp[PATH_MAX], p[PATH_MAX], base[KM_SEC_NAME_MAX + 16];
    snprintf(base, sizeof base, ".%s.key.tmp", name);
    if (path_of(tmp, sizeof tmp, dir, km_role_dir(role), base, NULL) ||
        path_of(p, sizeof p, dir, km_role_dir(role), name, ".key"))
        return km_errf(err, KM_EINVAL, "key directory path too long");
    if (zcert_save_public(c, tmp)) return km_errf(err, KM_EIO, "cannot write %s", tmp);
    if (rename(tmp, p)) {
        unlink(tmp);
        return km_errf(err, KM_EIO, "cannot rename %s: %s", tmp, strerror(errno));
    }
    return 0;
}

int km_keydir_new_cert(const char *dir, km_role role, const char *name, const char *worker,
                       km_errbuf *err)
{
    int rc = check_new(dir, role, name, worker, err);
    if (rc) return rc;
    zcert_t *c = zcert_new();
    if (!c) return km_errf(err, KM_ENOMEM, "cannot make a key pair");
    set_meta(c, role, name, worker);
    char p[PATH_MAX], ps[PATH_MAX];
    if (path_of(p, sizeof p, dir, "private", name, ".key") ||
        path_of(ps, sizeof ps, dir, "private", name, ".key_secret"))
        rc = km_errf(err, KM_EINVAL, "key directory path too long");
    /* zcert_save writes NAME.key and NAME.key_secret, the latter under a 077 umask */
    if (!rc && zcert_save(c, p)) rc = km_errf(err, KM_EIO, "cannot write %s", p);
    if (!rc && chmod(ps, 0600)) rc = km_errf(err, KM_EIO, "cannot chmod %s", ps);
    if (!rc) rc = save_public(dir, role, name, c, err);
    if (rc) {
        unlink(p);
        unlink(ps);
    }
    zcert_destroy(&c);
    return rc;
}

int km_keydir_init_cluster(const char *dir, const char *const *workers, int n_workers,
                           km_errbuf *err)
{
    typedef struct want_key {
        km_role role;
        const char *name, *worker;
    } want_key;
    want_key want[4 + 256];
    if (n_workers < 0 || n_workers > 256)
        return km_errf(err, KM_ERANGE, "%d workers (at most 256)", n_workers);
    int rc = km_keydir_init(dir, err), made = 0, n = 0;
    want[n++] = (want_key){KM_ROLE_MEMBER, "controller", NULL};
    want[n++] = (want_key){KM_ROLE_MEMBER, "router", NULL};
    for (int i = 0; i < n_workers; i++)
        want[n++] = (want_key){KM_ROLE_MEMBER, workers[i], workers[i]};
    want[n++] = (want_key){KM_ROLE_OPERATOR, "admin", NULL};
    want[n++] = (want_key){KM_ROLE_CLIENT, "client", NULL};
    for (int i = 0; i < n && !rc; i++) {
        km_cert_info have;
        if (!km_keydir_find(dir, want[i].role, want[i].name, &have, NULL)) {
            if (want[i].worker && strcmp(have.worker, want[i].worker))
                rc = km_errf(err, KM_EINVAL, "member key %s exists but is bound to worker '%s'",
                             want[i].name, have.worker);
            continue;
        }
        rc = km_keydir_new_cert(dir, want[i].role, want[i].name, want[i].worker, err);
        if (!rc) made++;
    }
    return rc ? rc : made;
}

int km_keydir_add_public(const char *dir, km_role role, const char *name, const char *public_txt,
                         const char *worker, km_errbuf *err)
{
    int rc = check_new(dir, role, name, worker, err);
    if (rc) return rc;
    uint8_t pub[32], sec[32] = {0};
    if (!public_txt || strlen(public_txt) != 40 || !zmq_z85_decode(pub, public_txt))
        return km_errf(err, KM_EINVAL, "not a Z85 public key (40 characters)");
    km_cert_info other;
    int n = km_keydir_list(dir, KM_ROLES_ALL, NULL, 0, NULL);
    km_cert_info *all = n > 0 ? calloc((size_t)n, sizeof *all) : NULL;
    if (n > 0 && !all) return km_errf(err, KM_ENOMEM, "out of memory");
    if (n > 0) n = km_keydir_list(dir, KM_ROLES_ALL, all, n, NULL);
    for (int i = 0; i < n && !rc; i++)
        if (!strcmp(all[i].public_txt, public_txt)) {
            other = all[i];
            rc = km_errf(err, KM_EINVAL, "that public key is already %s %s",
                         km_role_name(other.role), other.name);
        }
    free(all);
    if (rc) return rc;
    zcert_t *c = zcert_new_from(pub, sec);
    if (!c) return km_errf(err, KM_ENOMEM, "out of memory");
    set_meta(c, role, name, worker);
    rc = save_public(dir, role, name, c, err);
    zcert_destroy(&c);
    return rc;
}

int km_keydir_remove(const char *dir, const char *name, km_errbuf *err)
{
    if (!km_sec_name_ok(name)) return km_errf(err, KM_EINVAL, "bad key name");
    char p[PATH_MAX];
    int removed = 0;
    for (int i = 0; i < 3; i++)
        if (!path_of(p, sizeof p, dir, km_role_dir(role_order[i]), name, ".key") && !unlink(p))
            removed++;
    if (!path_of(p, sizeof p, dir, "private", name, ".key") && !unlink(p)) removed++;
    if (!path_of(p, sizeof p, dir, "private", name, ".key_secret") && !unlink(p)) removed++;
    return removed ? 0 : km_errf(err, KM_ENOTFOUND, "no key named %s", name);
}

/* ---------------------------------------------------------------- reading the directory */

static int info_cmp(const void *a, const void *b)
{
    const km_cert_info *x = a, *y = b;
    if (x->role != y->role) return x->role < y->role ? -1 : 1;
    return strcmp(x->name, y->name);
}

int km_keydir_list(const char *dir, unsigned role_mask, km_cert_info *out, int max, km_errbuf *err)
{
    int total = 0;
    for (int i = 0; i < 3; i++) {
        if (!(role_mask & role_order[i])) continue;
        char p[PATH_MAX], name[KM_SEC_NAME_MAX + 1];
        if (path_of(p, sizeof p, dir, km_role_dir(role_order[i]), NULL, NULL))
            return km_errf(err, KM_EINVAL, "key directory path too long");
        DIR *d = opendir(p);
        if (!d) continue;
        struct dirent *de;
        while ((de = readdir(d))) {
            if (!key_file_name(de->d_name, name)) continue;
            char f[PATH_MAX];
            km_cert_info info;
            const char *why;
            if (path_of(f, sizeof f, p, de->d_name, NULL, NULL) ||
                cert_load_checked(f, role_order[i], name, &info, NULL, &why))
                continue;
            if (total < max) out[total] = info;
            total++;
        }
        closedir(d);
    }
    if (out && max > 0) qsort(out, (size_t)(total < max ? total : max), sizeof *out, info_cmp);
    return total;
}

int km_keydir_find(const char *dir, km_role role, const char *name, km_cert_info *out,
                   km_errbuf *err)
{
    if (!km_sec_name_ok(name)) return km_errf(err, KM_EINVAL, "bad key name");
    for (int i = 0; i < 3; i++) {
        if (role && role != role_order[i]) continue;
        char p[PATH_MAX];
        struct stat st;
        const char *why;
        if (path_of(p, sizeof p, dir, km_role_dir(role_order[i]), name, ".key") || stat(p, &st))
            continue;
        if (cert_load_checked(p, role_order[i], name, out, NULL, &why))
            return km_errf(err, KM_EFORMAT, "%s: refused (%s)", p, why);
        return 0;
    }
    return km_errf(err, KM_ENOTFOUND, "no %s key named %s in %s", role ? km_role_name(role) : "",
                   name, dir);
}

int km_keydir_find_worker(const char *dir, const char *worker, km_cert_info *out, km_errbuf *err)
{
    if (!km_sec_name_ok(worker)) return km_errf(err, KM_EINVAL, "bad worker id");
    int n = km_keydir_list(dir, KM_ROLE_MEMBER, NULL, 0, err);
    if (n < 0) return n;
    km_cert_info *all = calloc((size_t)(n ? n : 1), sizeof *all);
    if (!all) return km_errf(err, KM_ENOMEM, "out of memory");
    n = km_keydir_list(dir, KM_ROLE_MEMBER, all, n, err);
    int found = 0;
    for (int i = 0; i < n; i++)
        if (!strcmp(all[i].worker, worker)) {
            if (!found) *out = all[i];
            found++;
        }
    free(all);
    if (found > 1)
        return km_errf(err, KM_EINVAL, "%d member keys are bound to worker %s", found, worker);
    return found ? 0 : km_errf(err, KM_ENOTFOUND, "no member key bound to worker %s", worker);
}

/* ---------------------------------------------------------------- keyring */

typedef struct role_store {
    zcertstore_t *store;
    uint64_t fp;
    bool loaded;
    int n;
} role_store;

struct km_keyring {
    char *dir;
    role_store r[3];
};

/* A fingerprint of a directory and its entries: equal fingerprints mean nothing was added,
 * removed, renamed or rewritten (inode, size and mtime/ctime in nanoseconds of each). Entries are
 * combined by a sum, so readdir order does not matter. */
static uint64_t dir_fingerprint(const char *path)
{
    struct stat st;
    if (stat(path, &st)) return 1; /* absent: a value no real directory yields in practice */
    uint64_t v[5] = {(uint64_t)st.st_ino, (uint64_t)st.st_mtim.tv_sec, (uint64_t)st.st_mtim.tv_nsec,
                     (uint64_t)st.st_ctim.tv_sec, (uint64_t)st.st_ctim.tv_nsec};
    uint64_t fp = XXH3_64bits(v, sizeof v), n = 0;
    DIR *d = opendir(path);
    if (!d) return fp ^ 2;
    struct dirent *de;
    char f[PATH_MAX];
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        if (path_of(f, sizeof f, path, de->d_name, NULL, NULL)) continue;
        uint64_t e[6] = {0};
        if (!stat(f, &st)) {
            e[0] = (uint64_t)st.st_ino;
            e[1] = (uint64_t)st.st_size;
            e[2] = (uint64_t)st.st_mtim.tv_sec;
            e[3] = (uint64_t)st.st_mtim.tv_nsec;
            e[4] = (uint64_t)st.st_ctim.tv_sec;
            e[5] = (uint64_t)st.st_ctim.tv_nsec;
        }
        fp += XXH3_64bits_withSeed(e, sizeof e, XXH3_64bits(de->d_name, strlen(de->d_name)));
        n++;
    }
    closedir(d);
    return fp + n * 0x9E3779B97F4A7C15ull;
}

static void store_load(km_keyring *k, int i)
{
    km_role role = role_order[i];
    role_store *rs = &k->r[i];
    char p[PATH_MAX];
    if (path_of(p, sizeof p, k->dir, km_role_dir(role), NULL, NULL)) return;
    zcertstore_t *st = zcertstore_new(NULL);
    if (!st) return; /* keep the old store: out of memory is not a reason to lock everyone out */
    int n = 0;
    DIR *d = opendir(p);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char name[KM_SEC_NAME_MAX + 1], f[PATH_MAX];
        const char *nm = de->d_name;
        if (nm[0] == '.') continue;
        size_t len = strlen(nm);
        if (len > 7 && !strcmp(nm + len - 7, "_secret")) {
            KM_WARN("keyring_bad_file", "dir=%s file=%s reason=secret_key_in_public_directory", p,
                    nm);
            continue;
        }
        if (!key_file_name(nm, name) || path_of(f, sizeof f, p, nm, NULL, NULL)) continue;
        zcert_t *c = NULL;
        km_cert_info info;
        const char *why = NULL;
        if (cert_load_checked(f, role, name, &info, &c, &why)) {
            KM_WARN("keyring_bad_file", "dir=%s file=%s reason=%s", p, nm, why);
            continue;
        }
        zcert_t *dup = zcertstore_lookup(st, info.public_txt);
        if (dup) {
            KM_WARN("keyring_bad_file", "dir=%s file=%s reason=duplicate_key of=%s", p, nm,
                    zcert_meta(dup, "name"));
            zcert_destroy(&c);
            continue;
        }
        zcertstore_insert(st, &c);
        n++;
    }
    if (d) closedir(d);
    zcertstore_destroy(&rs->store);
    rs->store = st;
    rs->n = n;
}

int km_keyring_refresh(km_keyring *k)
{
    int changed = 0;
    for (int i = 0; i < 3; i++) {
        char p[PATH_MAX];
        if (path_of(p, sizeof p, k->dir, km_role_dir(role_order[i]), NULL, NULL)) continue;
        uint64_t fp = dir_fingerprint(p);
        if (k->r[i].loaded && fp == k->r[i].fp) continue;
        store_load(k, i);
        /* A file written between the fingerprint and the load shows up as a change next time. */
        k->r[i].fp = fp;
        k->r[i].loaded = true;
        changed = 1;
        KM_INFO("keyring_loaded", "dir=%s role=%s keys=%d", p, km_role_name(role_order[i]),
                k->r[i].n);
    }
    return changed;
}

int km_keyring_open(const char *dir, km_keyring **out, km_errbuf *err)
{
    *out = NULL;
    struct stat st;
    if (!dir || stat(dir, &st) || !S_ISDIR(st.st_mode))
        return km_errf(err, KM_ENOTFOUND, "key directory %s not found", dir ? dir : "(none)");
    km_keyring *k = calloc(1, sizeof *k);
    if (!k || !(k->dir = strdup(dir))) {
        free(k);
        return km_errf(err, KM_ENOMEM, "out of memory");
    }
    km_keyring_refresh(k);
    *out = k;
    return 0;
}

void km_keyring_close(km_keyring *k)
{
    if (!k) return;
    for (int i = 0; i < 3; i++) zcertstore_destroy(&k->r[i].store);
    free(k->dir);
    free(k);
}

int km_keyring_count(const km_keyring *k)
{
    return k->r[0].n + k->r[1].n + k->r[2].n;
}

int km_keyring_lookup(km_keyring *k, const char *public_txt, km_cert_info *out)
{
    km_keyring_refresh(k);
    int found = 0;
    memset(out, 0, sizeof *out);
    for (int i = 0; i < 3; i++) {
        zcert_t *c = k->r[i].store ? zcertstore_lookup(k->r[i].store, public_txt) : NULL;
        if (!c) continue;
        if (!found++) {
            const char *w = zcert_meta(c, "worker"), *nm = zcert_meta(c, "name");
            out->role = role_order[i];
            snprintf(out->name, sizeof out->name, "%s", nm ? nm : "");
            snprintf(out->worker, sizeof out->worker, "%s", w ? w : "");
            memcpy(out->public_txt, zcert_public_txt(c), 41);
        }
    }
    if (found > 1) return KM_EINVAL;
    return found ? 0 : KM_ENOTFOUND;
}
