/*
 * metrics.c — a registry of counters, gauges and fixed-bucket histograms with labels, rendered
 * in the Prometheus text exposition format (0.0.4) for the admin server's /metrics.
 *
 * Why it is built this way:
 *  - Updates are lock-free atomics on a series the caller holds (counters are integers, gauges
 *    and sums are doubles kept as their bit patterns and updated by compare-and-swap), so the hot
 *    path of a daemon never takes the registry lock. The lock guards only registration, series
 *    lookup and rendering, which all happen off the hot path.
 *  - Histogram buckets are stored per bucket (not cumulative) and the count is derived from them
 *    at render time, so a scrape during concurrent observations can never show a bucket larger
 *    than the count.
 *  - Output order is registration order, then series creation order: deterministic text, exact
 *    tests, stable diffs between scrapes.
 *  - A failure (bad name, too many label combinations, no memory) costs a metric, never the
 *    process: lookups return NULL and every update ignores a NULL series.
 */
#include "common/svc.h"

#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

struct km_series {
    km_metric *fam;
    km_series *next;
    char **values;             /* [fam->n_labels] */
    _Atomic uint64_t value;    /* counter: count; gauge: double bits */
    _Atomic uint64_t sum_bits; /* histogram: sum as double bits */
    _Atomic uint64_t *buckets; /* histogram: [n_bounds + 1], the last is (bound_max, +Inf) */
};

struct km_metric {
    km_metrics *reg;
    km_metric *next;
    km_metric_kind kind;
    char *name, *help;
    int n_labels;
    char *labels[KM_METRIC_MAX_LABELS];
    double *bounds;
    int n_bounds;
    km_series *head, *tail;
    int n_series;
};

struct km_metrics {
    pthread_mutex_t mu;
    km_metric *head, *tail;
};

static uint64_t dbits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

static double bitsd(uint64_t u)
{
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

/* ---------------------------------------------------------------- registry */

int km_metrics_create(km_metrics **out)
{
    km_metrics *r = calloc(1, sizeof *r);
    if (!r) return KM_ENOMEM;
    pthread_mutex_init(&r->mu, NULL);
    *out = r;
    return 0;
}

static void series_free(km_series *s, int n_labels)
{
    if (!s) return;
    if (s->values)
        for (int i = 0; i < n_labels; i++) free(s->values[i]);
    free(s->values);
    free((void *)s->buckets);
    free(s);
}

static void metric_free(km_metric *m)
{
    km_series *s = m->head;
    while (s) {
        km_series *next = s->next;
        series_free(s, m->n_labels);
        s = next;
    }
    for (int i = 0; i < m->n_labels; i++) free(m->labels[i]);
    free(m->name);
    free(m->help);
    free(m->bounds);
    free(m);
}

void km_metrics_destroy(km_metrics *r)
{
    if (!r) return;
    km_metric *m = r->head;
    while (m) {
        km_metric *next = m->next;
        metric_free(m);
        m = next;
    }
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static bool valid_metric_name(const char *s)
{
    if (!*s || isdigit((unsigned char)*s)) return false;
    for (; *s; s++)
        if (!(isalnum((unsigned char)*s) || *s == '_' || *s == ':')) return false;
    return true;
}

static bool valid_label_name(const char *s, size_t n)
{
    if (n == 0 || isdigit((unsigned char)s[0])) return false;
    if (n >= 2 && s[0] == '_' && s[1] == '_') return false; /* reserved by Prometheus */
    for (size_t i = 0; i < n; i++)
        if (!(isalnum((unsigned char)s[i]) || s[i] == '_')) return false;
    return true;
}

/* Parses "tier, shard" into labels[]; returns the count or a negative error. */
static int parse_labels(const char *list, km_metric_kind kind, char *labels[], km_errbuf *err)
{
    int n = 0;
    if (!list) return 0;
    const char *p = list;
    while (*p) {
        while (*p == ' ' || *p == ',') p++;
        if (!*p) break;
        const char *start = p;
        while (*p && *p != ',' && *p != ' ') p++;
        size_t len = (size_t)(p - start);
        int rc = 0;
        if (n == KM_METRIC_MAX_LABELS)
            rc = km_errf(err, KM_EINVAL, "metric: more than %d labels", KM_METRIC_MAX_LABELS);
        else if (!valid_label_name(start, len))
            rc = km_errf(err, KM_EINVAL, "metric: bad label name '%.*s'", (int)len, start);
        else if (kind == KM_HISTOGRAM && len == 2 && memcmp(start, "le", 2) == 0)
            rc = km_errf(err, KM_EINVAL, "metric: 'le' is reserved for histogram buckets");
        for (int i = 0; !rc && i < n; i++)
            if (strlen(labels[i]) == len && memcmp(labels[i], start, len) == 0)
                rc = km_errf(err, KM_EINVAL, "metric: label '%.*s' repeated", (int)len, start);
        if (!rc && !(labels[n] = strndup(start, len))) rc = KM_ENOMEM;
        if (rc) {
            for (int i = 0; i < n; i++) free(labels[i]);
            return rc;
        }
        n++;
    }
    return n;
}

static km_series *series_new(km_metric *m, const char *const *values)
{
    km_series *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->fam = m;
    if (m->n_labels) {
        s->values = calloc((size_t)m->n_labels, sizeof *s->values);
        if (!s->values) goto fail;
        for (int i = 0; i < m->n_labels; i++)
            if (!(s->values[i] = strdup(values[i]))) goto fail;
    }
    if (m->kind == KM_HISTOGRAM) {
        s->buckets = calloc((size_t)m->n_bounds + 1, sizeof *s->buckets);
        if (!s->buckets) goto fail;
    }
    atomic_init(&s->value, m->kind == KM_GAUGE ? dbits(0.0) : 0);
    atomic_init(&s->sum_bits, dbits(0.0));
    return s;
fail:
    series_free(s, m->n_labels);
    return NULL;
}

static void series_link(km_metric *m, km_series *s)
{
    if (m->tail)
        m->tail->next = s;
    else
        m->head = s;
    m->tail = s;
    m->n_series++;
}

static bool same_family(const km_metric *m, km_metric_kind kind, char *const labels[], int n_labels,
                        const double *bounds, int n_bounds)
{
    if (m->kind != kind || m->n_labels != n_labels) return false;
    for (int i = 0; i < n_labels; i++)
        if (strcmp(m->labels[i], labels[i]) != 0) return false;
    if (kind != KM_HISTOGRAM) return true;
    if (m->n_bounds != n_bounds) return false;
    for (int i = 0; i < n_bounds; i++)
        if (m->bounds[i] != bounds[i]) return false;
    return true;
}

int km_metric_register(km_metrics *r, km_metric_kind kind, const char *name, const char *help,
                       const char *label_names, const double *bounds, int n_bounds, km_metric **out,
                       km_errbuf *err)
{
    *out = NULL;
    if (!r || !name || (unsigned)kind > KM_HISTOGRAM)
        return km_errf(err, KM_EINVAL, "metric: bad registry, name or kind");
    char full[256];
    const char *prefix = strncmp(name, "kvmesh_", 7) == 0 ? "" : "kvmesh_";
    if ((size_t)snprintf(full, sizeof full, "%s%s", prefix, name) >= sizeof full ||
        !valid_metric_name(full))
        return km_errf(err, KM_EINVAL, "metric: bad name '%s'", name);
    if (kind == KM_HISTOGRAM) {
        if (!bounds || n_bounds < 1 || n_bounds > KM_METRIC_MAX_BUCKETS)
            return km_errf(err, KM_EINVAL, "metric %s: histograms need 1..%d bounds", full,
                           KM_METRIC_MAX_BUCKETS);
        for (int i = 0; i < n_bounds; i++)
            if (!isfinite(bounds[i]) || (i && bounds[i] <= bounds[i - 1]))
                return km_errf(err, KM_EINVAL,
                               "metric %s: bounds must be finite and strictly increasing", full);
    } else {
        n_bounds = 0;
    }
    char *labels[KM_METRIC_MAX_LABELS];
    int n_labels = parse_labels(label_names, kind, labels, err);
    if (n_labels < 0) return n_labels;

    int rc = 0;
    pthread_mutex_lock(&r->mu);
    for (km_metric *m = r->head; m; m = m->next) {
        if (strcmp(m->name, full) != 0) continue;
        if (same_family(m, kind, labels, n_labels, bounds, n_bounds))
            *out = m;
        else
            rc = km_errf(err, KM_EINVAL, "metric %s: registered before with another shape", full);
        break;
    }
    if (!rc && !*out) {
        km_metric *m = calloc(1, sizeof *m);
        if (m) {
            m->reg = r;
            m->kind = kind;
            m->name = strdup(full);
            m->help = strdup(help ? help : "");
            m->n_labels = n_labels;
            for (int i = 0; i < n_labels; i++) m->labels[i] = labels[i];
            n_labels = 0; /* owned by m now */
            if (n_bounds) {
                m->bounds = malloc((size_t)n_bounds * sizeof *m->bounds);
                if (m->bounds) memcpy(m->bounds, bounds, (size_t)n_bounds * sizeof *bounds);
                m->n_bounds = n_bounds;
            }
        }
        km_series *s = NULL;
        bool ok = m && m->name && m->help && (!n_bounds || m->bounds);
        /* A family without labels has its one series from the start, so it renders as 0. */
        if (ok && m->n_labels == 0) ok = (s = series_new(m, NULL)) != NULL;
        if (!ok) {
            if (m) metric_free(m);
            rc = km_errf(err, KM_ENOMEM, "metric %s: out of memory", full);
        } else {
            if (s) series_link(m, s);
            if (r->tail)
                r->tail->next = m;
            else
                r->head = m;
            r->tail = m;
            *out = m;
        }
    }
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n_labels; i++) free(labels[i]);
    return rc;
}

km_series *km_metric_series(km_metric *m, const char *const *values)
{
    if (!m) return NULL;
    if (m->n_labels) {
        if (!values) return NULL;
        for (int i = 0; i < m->n_labels; i++)
            if (!values[i]) return NULL;
    }
    pthread_mutex_lock(&m->reg->mu);
    km_series *s = m->head;
    for (; s; s = s->next) {
        int i = 0;
        while (i < m->n_labels && strcmp(s->values[i], values[i]) == 0) i++;
        if (i == m->n_labels) break;
    }
    if (!s && m->n_series < KM_METRIC_MAX_SERIES) {
        s = series_new(m, values);
        if (s) series_link(m, s);
    }
    pthread_mutex_unlock(&m->reg->mu);
    return s;
}

/* ---------------------------------------------------------------- updates */

static void atomic_add_double(_Atomic uint64_t *bits, double d)
{
    uint64_t old = atomic_load_explicit(bits, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(bits, &old, dbits(bitsd(old) + d),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

void km_counter_add(km_series *s, uint64_t n)
{
    if (s && s->fam->kind == KM_COUNTER)
        atomic_fetch_add_explicit(&s->value, n, memory_order_relaxed);
}

void km_counter_inc(km_series *s)
{
    km_counter_add(s, 1);
}

void km_gauge_set(km_series *s, double v)
{
    if (s && s->fam->kind == KM_GAUGE)
        atomic_store_explicit(&s->value, dbits(v), memory_order_relaxed);
}

void km_gauge_add(km_series *s, double d)
{
    if (s && s->fam->kind == KM_GAUGE) atomic_add_double(&s->value, d);
}

void km_hist_observe(km_series *s, double v)
{
    if (!s || s->fam->kind != KM_HISTOGRAM || isnan(v)) return;
    const km_metric *m = s->fam;
    int b = 0;
    while (b < m->n_bounds && v > m->bounds[b]) b++;
    atomic_fetch_add_explicit(&s->buckets[b], 1, memory_order_relaxed);
    atomic_add_double(&s->sum_bits, v);
}

uint64_t km_counter_value(const km_series *s)
{
    return s && s->fam->kind == KM_COUNTER ? atomic_load(&((km_series *)s)->value) : 0;
}

double km_gauge_value(const km_series *s)
{
    return s && s->fam->kind == KM_GAUGE ? bitsd(atomic_load(&((km_series *)s)->value)) : 0.0;
}

uint64_t km_hist_count(const km_series *s)
{
    if (!s || s->fam->kind != KM_HISTOGRAM) return 0;
    uint64_t n = 0;
    for (int b = 0; b <= s->fam->n_bounds; b++) n += atomic_load(&((km_series *)s)->buckets[b]);
    return n;
}

/* ---------------------------------------------------------------- rendering */

/* Prometheus floats: the shortest text that reads back to the same double. */
static void fmt_double(char *buf, size_t cap, double v)
{
    if (isnan(v)) {
        snprintf(buf, cap, "NaN");
    } else if (isinf(v)) {
        snprintf(buf, cap, v > 0 ? "+Inf" : "-Inf");
    } else {
        snprintf(buf, cap, "%.15g", v);
        if (strtod(buf, NULL) != v) snprintf(buf, cap, "%.17g", v);
    }
}

static int put_escaped(km_buf *out, const char *s, bool quote)
{
    int rc = 0;
    for (; *s && !rc; s++) {
        if (*s == '\\')
            rc = km_buf_append(out, "\\\\", 2);
        else if (*s == '\n')
            rc = km_buf_append(out, "\\n", 2);
        else if (quote && *s == '"')
            rc = km_buf_append(out, "\\\"", 2);
        else
            rc = km_buf_append(out, s, 1);
    }
    return rc;
}

/* name{a="x",b="y"[,le="..."]} */
static int put_series_name(km_buf *out, const km_metric *m, const char *suffix, const km_series *s,
                           const char *le)
{
    int rc = km_buf_printf(out, "%s%s", m->name, suffix);
    if (rc || (m->n_labels == 0 && !le)) return rc;
    rc = km_buf_append(out, "{", 1);
    for (int i = 0; !rc && i < m->n_labels; i++) {
        rc = km_buf_printf(out, "%s%s=\"", i ? "," : "", m->labels[i]);
        if (!rc) rc = put_escaped(out, s->values[i], true);
        if (!rc) rc = km_buf_append(out, "\"", 1);
    }
    if (!rc && le) rc = km_buf_printf(out, "%sle=\"%s\"", m->n_labels ? "," : "", le);
    if (!rc) rc = km_buf_append(out, "}", 1);
    return rc;
}

static int render_series(km_buf *out, const km_metric *m, km_series *s)
{
    char num[64];
    int rc;
    switch (m->kind) {
    case KM_COUNTER:
        rc = put_series_name(out, m, "", s, NULL);
        return rc ? rc : km_buf_printf(out, " %llu\n", (unsigned long long)atomic_load(&s->value));
    case KM_GAUGE:
        fmt_double(num, sizeof num, bitsd(atomic_load(&s->value)));
        rc = put_series_name(out, m, "", s, NULL);
        return rc ? rc : km_buf_printf(out, " %s\n", num);
    case KM_HISTOGRAM: {
        uint64_t cum = 0;
        for (int b = 0; b <= m->n_bounds; b++) {
            cum += atomic_load(&s->buckets[b]);
            if (b < m->n_bounds)
                fmt_double(num, sizeof num, m->bounds[b]);
            else
                snprintf(num, sizeof num, "+Inf");
            rc = put_series_name(out, m, "_bucket", s, num);
            if (!rc) rc = km_buf_printf(out, " %llu\n", (unsigned long long)cum);
            if (rc) return rc;
        }
        fmt_double(num, sizeof num, bitsd(atomic_load(&s->sum_bits)));
        rc = put_series_name(out, m, "_sum", s, NULL);
        if (!rc) rc = km_buf_printf(out, " %s\n", num);
        if (!rc) rc = put_series_name(out, m, "_count", s, NULL);
        if (!rc) rc = km_buf_printf(out, " %llu\n", (unsigned long long)cum);
        return rc;
    }
    }
    return 0;
}

int km_metrics_render(km_metrics *r, km_buf *out)
{
    static const char *const kinds[] = {"counter", "gauge", "histogram"};
    int rc = 0;
    pthread_mutex_lock(&r->mu);
    for (const km_metric *m = r->head; m && !rc; m = m->next) {
        rc = km_buf_printf(out, "# HELP %s ", m->name);
        if (!rc) rc = put_escaped(out, m->help, false);
        if (!rc) rc = km_buf_printf(out, "\n# TYPE %s %s\n", m->name, kinds[m->kind]);
        for (km_series *s = m->head; s && !rc; s = s->next) rc = render_series(out, m, s);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* ---------------------------------------------------------------- process metrics */

/* Fields 14.. of /proc/self/stat (after the last ')', which ends a name that may hold spaces). */
static bool read_self_stat(double *cpu_s, double *start_ticks, double *vsize, double *rss_pages)
{
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    if (!p) return false;
    unsigned long long ut, st, start, vs;
    long long rss;
    /* state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime
     * cstime priority nice threads itrealvalue starttime vsize rss */
    if (sscanf(p + 1,
               " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d "
               "%llu %llu %lld",
               &ut, &st, &start, &vs, &rss) != 5)
        return false;
    double hz = (double)sysconf(_SC_CLK_TCK);
    *cpu_s = (double)(ut + st) / hz;
    *start_ticks = (double)start / hz;
    *vsize = (double)vs;
    *rss_pages = (double)rss;
    return true;
}

static double boot_time_s(void)
{
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return -1;
    char line[256];
    double bt = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "btime ", 6)) bt = atof(line + 6);
    fclose(f);
    return bt;
}

static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory stream's own */
}

static int put_process_metric(km_buf *out, const char *name, const char *type, const char *help,
                              double v)
{
    char num[64];
    fmt_double(num, sizeof num, v);
    return km_buf_printf(out, "# HELP %s %s\n# TYPE %s %s\n%s %s\n", name, help, name, type, name,
                         num);
}

int km_metrics_render_process(km_buf *out)
{
    int rc = 0;
    double cpu, start, vsize, rss;
    if (read_self_stat(&cpu, &start, &vsize, &rss)) {
        double page = (double)sysconf(_SC_PAGESIZE), bt = boot_time_s();
        rc = put_process_metric(out, "process_cpu_seconds_total", "counter",
                                "Total user and system CPU time spent in seconds.", cpu);
        if (!rc)
            rc = put_process_metric(out, "process_resident_memory_bytes", "gauge",
                                    "Resident memory size in bytes.", rss * page);
        if (!rc)
            rc = put_process_metric(out, "process_virtual_memory_bytes", "gauge",
                                    "Virtual memory size in bytes.", vsize);
        if (!rc && bt >= 0)
            rc = put_process_metric(out, "process_start_time_seconds", "gauge",
                                    "Start time of the process since unix epoch in seconds.",
                                    bt + start);
    }
    int fds = open_fds();
    if (!rc && fds >= 0)
        rc = put_process_metric(out, "process_open_fds", "gauge",
                                "Number of open file descriptors.", fds);
    struct rlimit rl;
    if (!rc && !getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur != RLIM_INFINITY)
        rc = put_process_metric(out, "process_max_fds", "gauge",
                                "Maximum number of open file descriptors.", (double)rl.rlim_cur);
    return rc;
}
