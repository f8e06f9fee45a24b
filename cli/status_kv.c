/*
 * status_kv.c — `kvmesh status --worker URL`: one worker's KV store by shard and, under the
 * `expert` shard key, by expert group, as tables read from its admin /metrics (the series of
 * docs/operations.md: kvmesh_worker_kv_{pages,bytes,capacity_bytes}, kvmesh_kv_shard_events_total,
 * kvmesh_kv_expert_group_{pages,events_total}, kvmesh_kv_placements_total). It adds nothing to
 * the worker: what the table shows is what Prometheus scrapes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"

enum { KV_MAX_ROWS = 1024, KV_COLS = 8 };

/* One table: rows by index (shard or group), columns by name. */
typedef struct kv_table {
    double v[KV_MAX_ROWS][KV_COLS];
    int n; /* rows seen: 1 + the largest index */
} kv_table;

/* The value of label `key` in a series' label text ({a="x",b="y"}), or "" when absent. */
static void label_of(const char *labels, const char *end, const char *key, char *out, size_t cap)
{
    char pat[32];
    snprintf(pat, sizeof pat, "%s=\"", key);
    out[0] = 0;
    size_t pl = strlen(pat);
    for (const char *p = labels; p + pl < end; p++)
        if ((p == labels || p[-1] == '{' || p[-1] == ',') && !memcmp(p, pat, pl)) {
            const char *v = p + pl, *q = memchr(v, '"', (size_t)(end - v));
            size_t n = q ? (size_t)(q - v) : 0;
            if (n >= cap) n = cap - 1;
            memcpy(out, v, n);
            out[n] = 0;
            return;
        }
}

static int col_of(const char *name, const char *const *cols)
{
    for (int i = 0; cols[i]; i++)
        if (!strcmp(cols[i], name)) return i;
    return -1;
}

/* Adds a series' value to t[row = label row_key][base + the index of label col_key in cols]. */
static void table_add(kv_table *t, const char *labels, const char *end, const char *row_key,
                      const char *col_key, const char *const *cols, int base, double v)
{
    char r[32], c[32];
    label_of(labels, end, row_key, r, sizeof r);
    label_of(labels, end, col_key, c, sizeof c);
    char *e;
    long i = strtol(r, &e, 10);
    int j = col_of(c, cols);
    if (!r[0] || *e || i < 0 || i >= KV_MAX_ROWS || j < 0 || base + j >= KV_COLS) return;
    t->v[i][base + j] += v;
    if (i + 1 > t->n) t->n = (int)i + 1;
}

typedef struct kv_status {
    kv_table shard, group;
    double moved, stayed;
} kv_status;

/* Shard columns: pages on each tier (0-2), hot bytes (3) and budget (4), hits, demotions,
 * evictions (5-7). Group columns: pages on each tier (0-2), hits, demotions, evictions, placed
 * (3-6). */
static const char *const g_tiers[] = {"hot", "host", "disk", NULL};
static const char *const g_hot[] = {"hot", NULL};
static const char *const g_events[] = {"hit", "demotion", "eviction", "placed", NULL};

static void parse_line(kv_status *st, const char *line, const char *end)
{
    const char *br = memchr(line, '{', (size_t)(end - line));
    if (!br) return; /* every series read here has labels */
    const char *close = memchr(br, '}', (size_t)(end - br));
    if (!close || close + 1 >= end) return;
    double v = strtod(close + 1, NULL);
    size_t nl = (size_t)(br - line);
#define IS(name) (nl == sizeof(name) - 1 && !memcmp(line, name, nl))
    if (IS("kvmesh_worker_kv_pages"))
        table_add(&st->shard, br, close, "shard", "tier", g_tiers, 0, v);
    else if (IS("kvmesh_worker_kv_bytes"))
        table_add(&st->shard, br, close, "shard", "tier", g_hot, 3, v);
    else if (IS("kvmesh_worker_kv_capacity_bytes"))
        table_add(&st->shard, br, close, "shard", "tier", g_hot, 4, v);
    else if (IS("kvmesh_kv_shard_events_total"))
        table_add(&st->shard, br, close, "shard", "event", g_events, 5, v);
    else if (IS("kvmesh_kv_expert_group_pages"))
        table_add(&st->group, br, close, "group", "tier", g_tiers, 0, v);
    else if (IS("kvmesh_kv_expert_group_events_total"))
        table_add(&st->group, br, close, "group", "event", g_events, 3, v);
    else if (IS("kvmesh_kv_placements_total")) {
        char r[16];
        label_of(br, close, "result", r, sizeof r);
        if (!strcmp(r, "moved")) st->moved += v;
        if (!strcmp(r, "stayed")) st->stayed += v;
    }
#undef IS
}

/* max/mean of column c over the rows (PiKV's shard balance); 0 when empty. */
static double balance(const kv_table *t, int c)
{
    double mx = 0, sum = 0;
    for (int i = 0; i < t->n; i++) {
        sum += t->v[i][c];
        if (t->v[i][c] > mx) mx = t->v[i][c];
    }
    return sum > 0 ? mx / (sum / t->n) : 0;
}

static void print_status(const char *url, const kv_status *st)
{
    const kv_table *s = &st->shard, *g = &st->group;
    printf("worker %s: %d KV shard%s\n", url, s->n, s->n == 1 ? "" : "s");
    printf("%-6s %9s %9s %9s %10s %10s %9s %10s %10s\n", "SHARD", "HOT", "HOST", "DISK",
           "HOT_BYTES", "HOT_CAP", "HITS", "DEMOTIONS", "EVICTIONS");
    for (int i = 0; i < s->n; i++) {
        char b[16], c[16];
        cli_fmt_bytes(b, sizeof b, (uint64_t)s->v[i][3]);
        cli_fmt_bytes(c, sizeof c, (uint64_t)s->v[i][4]);
        printf("%-6d %9.0f %9.0f %9.0f %10s %10s %9.0f %10.0f %10.0f\n", i, s->v[i][0], s->v[i][1],
               s->v[i][2], b, c, s->v[i][5], s->v[i][6], s->v[i][7]);
    }
    if (s->n > 1) printf("hot pages max/mean over the shards: %.2f\n", balance(s, 0));
    if (!g->n) {
        printf("no expert groups (the worker's --kv-shard-key is hash)\n");
        return;
    }
    printf("\nexpert groups (--kv-shard-key expert): %.0f pages placed, %.0f moved to their "
           "expert's shard, %.0f stayed\n",
           st->moved + st->stayed, st->moved, st->stayed);
    printf("%-6s %9s %9s %9s %9s %9s %10s %10s\n", "GROUP", "HOT", "HOST", "DISK", "PLACED", "HITS",
           "DEMOTIONS", "EVICTIONS");
    for (int i = 0; i < g->n; i++)
        printf("%-6d %9.0f %9.0f %9.0f %9.0f %9.0f %10.0f %10.0f\n", i, g->v[i][0], g->v[i][1],
               g->v[i][2], g->v[i][6], g->v[i][3], g->v[i][4], g->v[i][5]);
}

int cli_status_worker(const char *url)
{
    char full[512];
    snprintf(full, sizeof full, "%s/metrics", url);
    km_buf body = {0};
    int code = 0;
    km_errbuf err = {{0}};
    if (kvm_http_get_bearer(full, NULL, 5000, &body, &code, &err)) {
        fprintf(stderr, "kvmesh status: %s\n", err.msg);
        km_buf_free(&body);
        return 1;
    }
    if (code != 200) {
        fprintf(stderr, "kvmesh status: %s answered %d (give the worker's admin HTTP address)\n",
                full, code);
        km_buf_free(&body);
        return 1;
    }
    kv_status *st = calloc(1, sizeof *st);
    if (!st) {
        km_buf_free(&body);
        return 1;
    }
    const char *text = (const char *)body.data, *end = text + body.len;
    for (const char *line = text; line && line < end;) {
        const char *nl = memchr(line, '\n', (size_t)(end - line));
        if (*line != '#') parse_line(st, line, nl ? nl : end);
        line = nl ? nl + 1 : NULL;
    }
    int rc = 0;
    if (!st->shard.n) {
        fprintf(stderr, "kvmesh status: %s has no kvmesh_worker_kv_pages: not a worker?\n", full);
        rc = 1;
    } else {
        print_status(url, st);
    }
    free(st);
    km_buf_free(&body);
    return rc;
}
