/*
 * tenants.c — the cache namespace of a ZeroMQ client (internal.h), bound to its CURVE key as the
 * HTTP front binds it to an API key: every key is a tenant of its own ("z:k:NAME"), unless the
 * --client-tenants file puts several keys in one tenant on purpose ("z:t:TENANT"). The salt a
 * request names is appended inside that namespace (km_cache_salt_compose), so a client may narrow
 * its own cache but never reach another's. The name is the one the ZAP handler admitted the key
 * under (its file in the key directory), never anything the client wrote.
 *
 * The file: one `KEYNAME TENANT` pair a line, '#' comments; re-read when it changes (looked at
 * most once a second). A line that does not parse is skipped with a log line; a file that cannot
 * be read leaves every key in a tenant of its own (never in a shared one).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "router/internal.h"

typedef struct rt_tenant_entry {
    char key[KM_SEC_NAME_MAX + 1], tenant[KM_SEC_NAME_MAX + 1];
} rt_tenant_entry;

struct rt_tenants {
    char *path;
    rt_tenant_entry *e;
    int n;
    struct timespec mtime;
    off_t size;
    uint64_t checked_ms;
};

static void tenants_load(rt_tenants *t)
{
    struct stat st;
    if (stat(t->path, &st)) {
        t->n = 0;
        return;
    }
    if (st.st_mtim.tv_sec == t->mtime.tv_sec && st.st_mtim.tv_nsec == t->mtime.tv_nsec &&
        st.st_size == t->size)
        return;
    t->mtime = st.st_mtim;
    t->size = st.st_size;
    t->n = 0;
    FILE *f = fopen(t->path, "r");
    if (!f) return;
    char line[512];
    int ln = 0, cap = 0;
    while (fgets(line, sizeof line, f)) {
        ln++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char key[80], tenant[80], extra[8];
        int k = sscanf(line, "%79s %79s %7s", key, tenant, extra);
        if (k <= 0) continue;
        if (k != 2 || !km_sec_name_ok(key) || !km_sec_name_ok(tenant)) {
            KM_WARN("client_tenants_line", "file=%s line=%d why=\"want: KEYNAME TENANT\"", t->path,
                    ln);
            continue;
        }
        if (t->n == cap) {
            int nc = cap ? cap * 2 : 16;
            rt_tenant_entry *ne = realloc(t->e, sizeof *ne * (size_t)nc);
            if (!ne) break;
            t->e = ne;
            cap = nc;
        }
        memcpy(t->e[t->n].key, key, strlen(key) + 1); /* km_sec_name_ok: 64 bytes at most */
        memcpy(t->e[t->n].tenant, tenant, strlen(tenant) + 1);
        t->n++;
    }
    fclose(f);
    KM_INFO("client_tenants", "file=%s keys=%d", t->path, t->n);
}

int rt_tenants_open(const char *path, rt_tenants **out, km_errbuf *err)
{
    *out = NULL;
    if (!path || !*path) return 0;
    rt_tenants *t = calloc(1, sizeof *t);
    if (!t || !(t->path = strdup(path))) {
        free(t);
        return km_errf(err, KM_ENOMEM, "router: out of memory");
    }
    struct stat st;
    if (stat(path, &st)) {
        rt_tenants_close(t);
        return km_errf(err, KM_ENOTFOUND, "--client-tenants %s: cannot read it", path);
    }
    tenants_load(t);
    t->checked_ms = rt_now_ms();
    *out = t;
    return 0;
}

void rt_tenants_close(rt_tenants *t)
{
    if (!t) return;
    free(t->e);
    free(t->path);
    free(t);
}

bool rt_tenant_of(rt_tenants *t, const km_zpeer *peer, km_apikey_match *m)
{
    if (!peer || peer->role == KM_ROLE_NONE || !peer->name[0]) return false;
    memset(m, 0, sizeof *m);
    m->role = peer->role;
    if (t) {
        uint64_t now = rt_now_ms();
        if (now - t->checked_ms >= 1000) {
            t->checked_ms = now;
            tenants_load(t);
        }
        for (int i = 0; i < t->n; i++)
            if (!strcmp(t->e[i].key, peer->name)) {
                snprintf(m->tenant, sizeof m->tenant, "%s", t->e[i].tenant);
                snprintf(m->salt, sizeof m->salt, "z:t:%s", t->e[i].tenant);
                return true;
            }
    }
    snprintf(m->tenant, sizeof m->tenant, "%s", peer->name);
    snprintf(m->salt, sizeof m->salt, "z:k:%s", peer->name);
    return true;
}
