/*
 * apikey.c — HTTP API keys: the key file (format in common/sec.h), the lookup that maps
 * `Authorization: Bearer KEY` to a tenant and role, key generation, and the composition of a
 * request's prefix-cache salt from its tenant's.
 *
 * Why it is built this way:
 *  - Only hashes are stored, so a leaked key file lets no one in. Keys are 256-bit random tokens
 *    made here, which no one can guess, so the hash need not be slow: keyed BLAKE2b
 *    (crypto_generichash) costs a microsecond per request. crypto_pwhash_str (Argon2id) is made
 *    for low-entropy passwords and costs tens of milliseconds and megabytes per call by design,
 *    which on an HTTP front would be a denial of service for free.
 *  - A lookup hashes the presented key once and compares the hash with every entry with
 *    sodium_memcmp (constant time), finishing the scan after a match, so neither the bytes of a
 *    key nor which entry it matched show in the time a request takes beyond the entry count.
 *  - The file is re-read when its inode, size or nanosecond mtime changes (checked at most once
 *    per interval, 1 s by default), so keys are added and revoked without a restart. A line that
 *    does not parse is skipped and logged; a missing file means no key is valid (fail closed).
 *  - A key's cache salt is derived from its hash, so two keys never share cached prefixes unless
 *    the operator gives both the same salt=; km_cache_salt_compose keeps keyed tenants' salts in
 *    a namespace no unkeyed request can name.
 */
#include "common/sec.h"

#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#define HASH_KEY  "kvmesh-apikey-v1" /* 16 bytes: crypto_generichash_KEYBYTES_MIN */
#define SALT_KEY  "kvmesh-cache-salt-v1"
#define MAX_LINE  512
#define MAX_SALT  64
#define MAX_BYTES (16u << 20)

typedef struct apikey_entry {
    uint8_t hash[32];
    km_apikey_match m;
} apikey_entry;

struct km_apikeys {
    char *path;
    pthread_mutex_t mu;
    apikey_entry *e;
    int n;
    bool have_sig;
    struct stat sig;
    uint64_t last_check_ns;
    int interval_ms;
};

static void hash_token(const char *token, size_t len, uint8_t out[32])
{
    km_sodium_ready();
    crypto_generichash(out, 32, (const unsigned char *)token, len, (const unsigned char *)HASH_KEY,
                       sizeof HASH_KEY - 1);
}

int km_apikey_hash(const char *token, size_t len, char *out, size_t cap)
{
    if (cap < 68 || !token || !len || len > KM_APIKEY_TOKEN_MAX) return KM_EINVAL;
    uint8_t h[32];
    hash_token(token, len, h);
    memcpy(out, "b2:", 3);
    sodium_bin2hex(out + 3, cap - 3, h, sizeof h);
    return 0;
}

int km_apikey_generate(char *out, size_t cap)
{
    if (cap < 48 || km_sodium_ready()) return KM_EINVAL;
    uint8_t r[32];
    randombytes_buf(r, sizeof r);
    memcpy(out, "kvm_", 4);
    sodium_bin2base64(out + 4, cap - 4, r, sizeof r, sodium_base64_VARIANT_URLSAFE_NO_PADDING);
    sodium_memzero(r, sizeof r);
    return 0;
}

static bool salt_ok(const char *s)
{
    size_t n = strlen(s);
    if (!n || n > MAX_SALT) return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] <= 32 || s[i] >= 127) return false;
    return true;
}

/* One line into e: 0, 1 for a line with nothing on it, negative for a bad line (why set). */
static int parse_line(char *line, apikey_entry *e, const char **why)
{
    char *save = NULL, *f[5];
    int n = 0;
    for (char *t = strtok_r(line, " \t\r\n", &save); t && n < 5;
         t = strtok_r(NULL, " \t\r\n", &save))
        f[n++] = t;
    if (n == 0 || f[0][0] == '#') return 1;
    memset(e, 0, sizeof *e);
    size_t got = 0;
    *why = NULL;
    if (n < 3 || n > 4)
        *why = "want: b2:HASH TENANT ROLE [salt=SALT]";
    else if (strncmp(f[0], "b2:", 3) || strlen(f[0]) != 67 ||
             sodium_hex2bin(e->hash, 32, f[0] + 3, 64, NULL, &got, NULL) || got != 32)
        *why = "bad hash (want b2: and 64 hex digits)";
    else if (!km_sec_name_ok(f[1]))
        *why = "bad tenant name";
    else if (km_role_parse(f[2], &e->m.role) || e->m.role == KM_ROLE_MEMBER)
        *why = "role must be client or operator";
    else if (n == 4 && (strncmp(f[3], "salt=", 5) || !salt_ok(f[3] + 5)))
        *why = "bad salt= (1..64 visible characters)";
    if (*why) return KM_EFORMAT;
    snprintf(e->m.tenant, sizeof e->m.tenant, "%s", f[1]);
    if (n == 4) {
        snprintf(e->m.salt, sizeof e->m.salt, "s:%s", f[3] + 5);
    } else {
        uint8_t s[16];
        km_sodium_ready();
        crypto_generichash(s, sizeof s, e->hash, sizeof e->hash, (const unsigned char *)SALT_KEY,
                           sizeof SALT_KEY - 1);
        memcpy(e->m.salt, "k:", 2);
        sodium_bin2hex(e->m.salt + 2, sizeof e->m.salt - 2, s, sizeof s);
    }
    return 0;
}

/* Reads the file into a fresh table (NULL, 0 when absent). */
static int load(const char *path, apikey_entry **out, int *n_out)
{
    *out = NULL;
    *n_out = 0;
    FILE *f = fopen(path, "re");
    if (!f) return errno == ENOENT ? 0 : KM_EIO;
    apikey_entry *e = NULL;
    int n = 0, cap = 0, lineno = 0, skipped = 0, rc = 0;
    char line[MAX_LINE + 2];
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') { /* over-long: skip the rest */
            int c;
            while ((c = fgetc(f)) != EOF && c != '\n') {
            }
            KM_WARN("apikeys_bad_line", "path=%s line=%d reason=too_long", path, lineno);
            skipped++;
            continue;
        }
        apikey_entry one;
        const char *why = NULL;
        int r = parse_line(line, &one, &why);
        if (r == 1) continue;
        if (r < 0) {
            KM_WARN("apikeys_bad_line", "path=%s line=%d reason=\"%s\"", path, lineno, why);
            skipped++;
            continue;
        }
        if (n == cap) {
            int nc = cap ? cap * 2 : 16;
            apikey_entry *ne = realloc(e, sizeof *ne * (size_t)nc);
            if (!ne) {
                rc = KM_ENOMEM;
                break;
            }
            e = ne;
            cap = nc;
        }
        e[n++] = one;
    }
    fclose(f);
    if (rc) {
        free(e);
        return rc;
    }
    KM_INFO("apikeys_loaded", "path=%s keys=%d skipped=%d", path, n, skipped);
    *out = e;
    *n_out = n;
    return 0;
}

static bool same_sig(const struct stat *a, const struct stat *b)
{
    return a->st_ino == b->st_ino && a->st_dev == b->st_dev && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
           a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

/* Under k->mu: reloads the table when the file changed. */
static void refresh_locked(km_apikeys *k, bool force)
{
    uint64_t now = km_now_ns();
    if (!force && k->have_sig && now - k->last_check_ns < (uint64_t)k->interval_ms * 1000000u)
        return;
    k->last_check_ns = now;
    struct stat st;
    bool exists = stat(k->path, &st) == 0;
    if (!exists) memset(&st, 0, sizeof st);
    if (k->have_sig && same_sig(&st, &k->sig)) return;
    apikey_entry *e;
    int n;
    if (load(k->path, &e, &n)) {
        KM_ERROR("apikeys_reload_failed", "path=%s keeping=%d", k->path, k->n);
        return; /* try again next interval; the old table stays */
    }
    if (k->e) sodium_memzero(k->e, sizeof *k->e * (size_t)k->n);
    free(k->e);
    k->e = e;
    k->n = n;
    k->sig = st;
    k->have_sig = true;
}

int km_apikeys_open(const char *path, km_apikeys **out, km_errbuf *err)
{
    *out = NULL;
    if (!path) return km_errf(err, KM_EINVAL, "no API key file");
    if (km_sodium_ready()) return km_errf(err, KM_EIO, "libsodium failed to initialise");
    struct stat st;
    if (!stat(path, &st) && (st.st_mode & 077))
        KM_WARN("apikeys_file_mode",
                "path=%s mode=%03o advice=\"chmod 600: hashes only, but "
                "still the list of tenants\"",
                path, (unsigned)(st.st_mode & 0777));
    km_apikeys *k = calloc(1, sizeof *k);
    if (!k || !(k->path = strdup(path))) {
        free(k);
        return km_errf(err, KM_ENOMEM, "out of memory");
    }
    pthread_mutex_init(&k->mu, NULL);
    k->interval_ms = 1000;
    refresh_locked(k, true);
    *out = k;
    return 0;
}

void km_apikeys_close(km_apikeys *k)
{
    if (!k) return;
    free(k->e);
    free(k->path);
    pthread_mutex_destroy(&k->mu);
    free(k);
}

void km_apikeys_set_check_interval(km_apikeys *k, int min_interval_ms)
{
    pthread_mutex_lock(&k->mu);
    k->interval_ms = min_interval_ms < 0 ? 0 : min_interval_ms;
    pthread_mutex_unlock(&k->mu);
}

int km_apikeys_count(km_apikeys *k)
{
    pthread_mutex_lock(&k->mu);
    refresh_locked(k, false);
    int n = k->n;
    pthread_mutex_unlock(&k->mu);
    return n;
}

int km_apikeys_lookup(km_apikeys *k, const char *token, size_t len, km_apikey_match *out)
{
    memset(out, 0, sizeof *out);
    if (!token || !len || len > KM_APIKEY_TOKEN_MAX) return KM_ENOTFOUND;
    uint8_t h[32];
    hash_token(token, len, h);
    pthread_mutex_lock(&k->mu);
    refresh_locked(k, false);
    int found = -1;
    for (int i = 0; i < k->n; i++) {
        int eq = sodium_memcmp(h, k->e[i].hash, sizeof h) == 0;
        if (eq && found < 0) found = i;
    }
    if (found >= 0) *out = k->e[found].m;
    pthread_mutex_unlock(&k->mu);
    return found >= 0 ? 0 : KM_ENOTFOUND;
}

int km_apikeys_check_header(km_apikeys *k, const char *value, size_t len, km_apikey_match *out)
{
    memset(out, 0, sizeof *out);
    if (!value) return KM_EFORMAT;
    size_t i = 0;
    while (i < len && (value[i] == ' ' || value[i] == '\t')) i++;
    if (len - i < 7 || strncasecmp(value + i, "bearer", 6) ||
        (value[i + 6] != ' ' && value[i + 6] != '\t'))
        return KM_EFORMAT;
    i += 6;
    while (i < len && (value[i] == ' ' || value[i] == '\t')) i++;
    size_t end = len;
    while (end > i && (value[end - 1] == ' ' || value[end - 1] == '\t')) end--;
    if (end == i || end - i > KM_APIKEY_TOKEN_MAX) return KM_EFORMAT;
    for (size_t j = i; j < end; j++)
        if ((unsigned char)value[j] <= 32 || (unsigned char)value[j] >= 127) return KM_EFORMAT;
    return km_apikeys_lookup(k, value + i, end - i, out);
}

/* ---------------------------------------------------------------- editing the file */

static int read_all(const char *path, char **out, size_t *len, km_errbuf *err)
{
    *out = NULL;
    *len = 0;
    FILE *f = fopen(path, "re");
    if (!f) return errno == ENOENT ? 0 : km_errf(err, KM_EIO, "cannot read %s", path);
    char *b = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    for (;;) {
        if (n + 4096 > cap) {
            if (cap >= MAX_BYTES) {
                rc = km_errf(err, KM_ERANGE, "%s is larger than %u bytes", path, MAX_BYTES);
                break;
            }
            char *nb = realloc(b, cap = cap ? cap * 2 : 8192);
            if (!nb) {
                rc = km_errf(err, KM_ENOMEM, "out of memory");
                break;
            }
            b = nb;
        }
        size_t r = fread(b + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    fclose(f);
    if (rc) {
        free(b);
        return rc;
    }
    *out = b;
    *len = n;
    return 0;
}

int km_apikeys_add(const char *path, const char *tenant, km_role role, const char *shared_salt,
                   char *token_out, size_t cap, km_errbuf *err)
{
    if (!km_sec_name_ok(tenant)) return km_errf(err, KM_EINVAL, "bad tenant name");
    if (role != KM_ROLE_CLIENT && role != KM_ROLE_OPERATOR)
        return km_errf(err, KM_EINVAL, "an API key's role is client or operator");
    if (shared_salt && !salt_ok(shared_salt))
        return km_errf(err, KM_EINVAL, "bad salt (1..64 visible characters, no spaces)");
    char token[64], hash[72], line[MAX_LINE];
    if (km_apikey_generate(token, sizeof token) ||
        km_apikey_hash(token, strlen(token), hash, sizeof hash))
        return km_errf(err, KM_EIO, "cannot make a key");
    if (strlen(token) + 1 > cap) return km_errf(err, KM_ENOSPC, "key buffer too small");
    int ll = snprintf(line, sizeof line, "%s %s %s%s%s\n", hash, tenant, km_role_name(role),
                      shared_salt ? " salt=" : "", shared_salt ? shared_salt : "");
    char *old;
    size_t n;
    int rc = read_all(path, &old, &n, err);
    if (rc) return rc;
    char *b = malloc(n + (size_t)ll + 2);
    if (!b) {
        free(old);
        return km_errf(err, KM_ENOMEM, "out of memory");
    }
    if (n) memcpy(b, old, n);
    if (n && b[n - 1] != '\n') b[n++] = '\n';
    memcpy(b + n, line, (size_t)ll);
    rc = km_write_file_atomic(path, b, n + (size_t)ll, 0600, err);
    free(old);
    free(b);
    if (!rc) memcpy(token_out, token, strlen(token) + 1);
    sodium_memzero(token, sizeof token);
    return rc;
}

int km_apikeys_remove(const char *path, const char *tenant, km_errbuf *err)
{
    if (!km_sec_name_ok(tenant)) return km_errf(err, KM_EINVAL, "bad tenant name");
    char *old;
    size_t n;
    int rc = read_all(path, &old, &n, err);
    if (rc || !old) return rc;
    char *b = malloc(n + 1);
    if (!b) {
        free(old);
        return km_errf(err, KM_ENOMEM, "out of memory");
    }
    size_t w = 0;
    int removed = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && old[j] != '\n') j++;
        size_t ln = j - i + (j < n);
        /* the tenant is the second field */
        char tmp[MAX_LINE];
        bool drop = false;
        if (j - i < sizeof tmp) {
            memcpy(tmp, old + i, j - i);
            tmp[j - i] = '\0';
            char *save = NULL, *f0 = strtok_r(tmp, " \t\r", &save);
            char *f1 = f0 && f0[0] != '#' ? strtok_r(NULL, " \t\r", &save) : NULL;
            drop = f1 && !strcmp(f1, tenant);
        }
        if (drop)
            removed++;
        else {
            memcpy(b + w, old + i, ln);
            w += ln;
        }
        i += ln;
    }
    if (removed) rc = km_write_file_atomic(path, b, w, 0600, err);
    free(old);
    free(b);
    return rc ? rc : removed;
}

/* ---------------------------------------------------------------- cache salts */

int km_cache_salt_compose(const km_apikey_match *m, const char *req_salt, char *out, size_t cap)
{
    const char *r = req_salt ? req_salt : "";
    int n;
    if (m)
        n = snprintf(out, cap, "kvmesh:t:%s%s%s", m->salt, *r ? "/" : "", r);
    else if (!strncmp(r, "kvmesh:", 7))
        n = snprintf(out, cap, "kvmesh:u:%s", r);
    else
        n = snprintf(out, cap, "%s", r);
    if (n < 0 || (size_t)n >= cap) return KM_ENOSPC;
    return n;
}

uint64_t km_cache_salt_tenant(const char *salt)
{
    if (!salt || strncmp(salt, "kvmesh:t:", 9)) return 0;
    uint64_t h = 14695981039346656037ull; /* FNV-1a over the tenant's part */
    for (const char *c = salt + 9; *c && *c != '/'; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
    return h ? h : 1;
}
