/*
 * test_metrics.c — the metrics registry: the exact Prometheus text for counters, gauges and
 * histograms with and without labels (escaping, float formatting, cumulative buckets), idempotent
 * registration, refusal of bad names and shapes, the series limit, and exact totals under
 * concurrent updates from several threads.
 */
#include "common/svc.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static char *render(km_metrics *r, km_buf *b)
{
    km_buf_reset(b);
    cr_assert_eq(km_metrics_render(r, b), 0);
    cr_assert_eq(km_buf_append(b, "", 1), 0);
    return (char *)b->data;
}

static km_metric *reg(km_metrics *r, km_metric_kind k, const char *name, const char *help,
                      const char *labels, const double *bounds, int n)
{
    km_metric *m = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_metric_register(r, k, name, help, labels, bounds, n, &m, &err), 0, "%s",
                 err.msg);
    return m;
}

Test(metrics, renders_the_exact_exposition_text)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    km_metric *req = reg(r, KM_COUNTER, "requests_total", "Requests received.", "status", NULL, 0);
    km_metric *q = reg(r, KM_GAUGE, "queue_depth", "Requests waiting.", NULL, NULL, 0);
    double bounds[] = {0.005, 0.1, 1};
    km_metric *ttft =
        reg(r, KM_HISTOGRAM, "ttft_seconds", "Time to first token.", "tier", bounds, 3);
    km_metric *up = reg(r, KM_GAUGE, "kvmesh_up", "1 while serving.", NULL, NULL, 0);

    km_counter_add(km_metric_series(req, (const char *[]){"ok"}), 3);
    km_counter_inc(km_metric_series(req, (const char *[]){"bad_frame"}));
    km_gauge_set(km_metric_series(q, NULL), 7);
    km_gauge_add(km_metric_series(q, NULL), -2.5);
    km_series *hot = km_metric_series(ttft, (const char *[]){"hot"});
    km_hist_observe(hot, 0.005); /* on a bound: counted in that bucket (le) */
    km_hist_observe(hot, 0.05);
    km_hist_observe(hot, 2);
    km_hist_observe(hot, NAN); /* ignored */
    km_gauge_set(km_metric_series(up, NULL), 1);

    km_buf b = {0};
    const char *want = "# HELP kvmesh_requests_total Requests received.\n"
                       "# TYPE kvmesh_requests_total counter\n"
                       "kvmesh_requests_total{status=\"ok\"} 3\n"
                       "kvmesh_requests_total{status=\"bad_frame\"} 1\n"
                       "# HELP kvmesh_queue_depth Requests waiting.\n"
                       "# TYPE kvmesh_queue_depth gauge\n"
                       "kvmesh_queue_depth 4.5\n"
                       "# HELP kvmesh_ttft_seconds Time to first token.\n"
                       "# TYPE kvmesh_ttft_seconds histogram\n"
                       "kvmesh_ttft_seconds_bucket{tier=\"hot\",le=\"0.005\"} 1\n"
                       "kvmesh_ttft_seconds_bucket{tier=\"hot\",le=\"0.1\"} 2\n"
                       "kvmesh_ttft_seconds_bucket{tier=\"hot\",le=\"1\"} 2\n"
                       "kvmesh_ttft_seconds_bucket{tier=\"hot\",le=\"+Inf\"} 3\n"
                       "kvmesh_ttft_seconds_sum{tier=\"hot\"} 2.055\n"
                       "kvmesh_ttft_seconds_count{tier=\"hot\"} 3\n"
                       "# HELP kvmesh_up 1 while serving.\n"
                       "# TYPE kvmesh_up gauge\n"
                       "kvmesh_up 1\n";
    cr_assert_str_eq(render(r, &b), want);
    cr_assert_eq(km_hist_count(hot), 3);
    km_buf_free(&b);
    km_metrics_destroy(r);
}

Test(metrics, unlabeled_families_render_zero_before_any_update)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    double bounds[] = {1, 2};
    reg(r, KM_COUNTER, "evictions_total", "Pages evicted.", NULL, NULL, 0);
    reg(r, KM_HISTOGRAM, "batch_size", "Sequences per step.", NULL, bounds, 2);
    reg(r, KM_GAUGE, "pages", "Pages by tier.", "tier", NULL, 0);
    km_buf b = {0};
    const char *want = "# HELP kvmesh_evictions_total Pages evicted.\n"
                       "# TYPE kvmesh_evictions_total counter\n"
                       "kvmesh_evictions_total 0\n"
                       "# HELP kvmesh_batch_size Sequences per step.\n"
                       "# TYPE kvmesh_batch_size histogram\n"
                       "kvmesh_batch_size_bucket{le=\"1\"} 0\n"
                       "kvmesh_batch_size_bucket{le=\"2\"} 0\n"
                       "kvmesh_batch_size_bucket{le=\"+Inf\"} 0\n"
                       "kvmesh_batch_size_sum 0\n"
                       "kvmesh_batch_size_count 0\n"
                       "# HELP kvmesh_pages Pages by tier.\n"
                       "# TYPE kvmesh_pages gauge\n";
    cr_assert_str_eq(render(r, &b), want);
    km_buf_free(&b);
    km_metrics_destroy(r);
}

Test(metrics, label_values_and_help_are_escaped)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    km_metric *m =
        reg(r, KM_COUNTER, "errors_total", "Errors\nby \\kind.", "kind, detail", NULL, 0);
    km_counter_inc(km_metric_series(m, (const char *[]){"a\"b", "c\\d\ne"}));
    km_buf b = {0};
    const char *want = "# HELP kvmesh_errors_total Errors\\nby \\\\kind.\n"
                       "# TYPE kvmesh_errors_total counter\n"
                       "kvmesh_errors_total{kind=\"a\\\"b\",detail=\"c\\\\d\\ne\"} 1\n";
    cr_assert_str_eq(render(r, &b), want);
    km_buf_free(&b);
    km_metrics_destroy(r);
}

Test(metrics, gauge_values_use_the_shortest_exact_float_text)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    km_metric *m = reg(r, KM_GAUGE, "g", "g", "k", NULL, 0);
    km_gauge_set(km_metric_series(m, (const char *[]){"a"}), 0.1);
    km_gauge_set(km_metric_series(m, (const char *[]){"b"}), 1e21);
    km_gauge_set(km_metric_series(m, (const char *[]){"c"}), -INFINITY);
    km_gauge_set(km_metric_series(m, (const char *[]){"d"}), 1.0 / 3.0);
    km_gauge_set(km_metric_series(m, (const char *[]){"e"}), 12345678);
    km_buf b = {0};
    const char *want = "# HELP kvmesh_g g\n"
                       "# TYPE kvmesh_g gauge\n"
                       "kvmesh_g{k=\"a\"} 0.1\n"
                       "kvmesh_g{k=\"b\"} 1e+21\n"
                       "kvmesh_g{k=\"c\"} -Inf\n"
                       "kvmesh_g{k=\"d\"} 0.33333333333333331\n"
                       "kvmesh_g{k=\"e\"} 12345678\n";
    cr_assert_str_eq(render(r, &b), want);
    km_buf_free(&b);
    km_metrics_destroy(r);
}

Test(metrics, registering_twice_returns_the_same_family_or_refuses_a_different_shape)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    km_metric *a = reg(r, KM_COUNTER, "x_total", "x", "tier", NULL, 0);
    km_metric *b = reg(r, KM_COUNTER, "kvmesh_x_total", "other help", "tier", NULL, 0);
    cr_assert_eq(a, b);
    km_metric *c = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_metric_register(r, KM_GAUGE, "x_total", "x", "tier", NULL, 0, &c, &err),
                 KM_EINVAL);
    cr_assert_str_eq(err.msg, "metric kvmesh_x_total: registered before with another shape");
    cr_assert_eq(km_metric_register(r, KM_COUNTER, "x_total", "x", "shard", NULL, 0, &c, &err),
                 KM_EINVAL);
    cr_assert_null(c);
    /* the same series comes back for the same label values */
    cr_assert_eq(km_metric_series(a, (const char *[]){"hot"}),
                 km_metric_series(a, (const char *[]){"hot"}));
    km_metrics_destroy(r);
}

Test(metrics, bad_names_labels_and_bounds_are_refused)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    km_metric *m = NULL;
    km_errbuf err = {{0}};
    double up[] = {1, 2}, down[] = {2, 1};
    cr_assert_eq(km_metric_register(r, KM_COUNTER, "bad-name", "", NULL, NULL, 0, &m, &err),
                 KM_EINVAL);
    cr_assert_str_eq(err.msg, "metric: bad name 'bad-name'");
    cr_assert_eq(km_metric_register(r, KM_COUNTER, "c", "", "__x", NULL, 0, &m, &err), KM_EINVAL);
    cr_assert_eq(km_metric_register(r, KM_COUNTER, "c", "", "a,a", NULL, 0, &m, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "metric: label 'a' repeated");
    cr_assert_eq(km_metric_register(r, KM_HISTOGRAM, "h", "", "le", up, 2, &m, &err), KM_EINVAL);
    cr_assert_eq(km_metric_register(r, KM_HISTOGRAM, "h", "", NULL, down, 2, &m, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "metric kvmesh_h: bounds must be finite and strictly increasing");
    cr_assert_eq(km_metric_register(r, KM_HISTOGRAM, "h", "", NULL, NULL, 0, &m, &err), KM_EINVAL);
    cr_assert_null(m);
    km_metrics_destroy(r);
}

Test(metrics, updates_on_null_or_mismatched_series_are_ignored)
{
    km_counter_inc(NULL);
    km_gauge_set(NULL, 1);
    km_gauge_add(NULL, 1);
    km_hist_observe(NULL, 1);
    cr_assert_eq(km_counter_value(NULL), 0);
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    km_metric *c = reg(r, KM_COUNTER, "c", "", "a", NULL, 0);
    cr_assert_null(km_metric_series(c, NULL), "missing label values");
    cr_assert_null(km_metric_series(c, (const char *[]){NULL}));
    km_series *s = km_metric_series(c, (const char *[]){"x"});
    km_gauge_set(s, 5); /* a gauge update on a counter does nothing */
    cr_assert_eq(km_counter_value(s), 0);
    km_metrics_destroy(r);
}

Test(metrics, label_combinations_stop_at_the_series_limit)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    km_metric *c = reg(r, KM_COUNTER, "c", "", "id", NULL, 0);
    char v[32];
    for (int i = 0; i < KM_METRIC_MAX_SERIES; i++) {
        snprintf(v, sizeof v, "%d", i);
        cr_assert_not_null(km_metric_series(c, (const char *[]){v}));
    }
    cr_assert_null(km_metric_series(c, (const char *[]){"one-too-many"}));
    cr_assert_not_null(km_metric_series(c, (const char *[]){"7"}), "existing series still found");
    km_metrics_destroy(r);
}

typedef struct worker_arg {
    km_metric *c, *g, *h;
} worker_arg;

enum { THREADS = 4, ITERS = 50000 };

static void *hammer(void *p)
{
    worker_arg *a = p;
    km_series *c = km_metric_series(a->c, NULL);
    km_series *g = km_metric_series(a->g, NULL);
    km_series *h = km_metric_series(a->h, NULL);
    for (int i = 0; i < ITERS; i++) {
        km_counter_inc(c);
        km_gauge_add(g, 0.5);
        km_hist_observe(h, (double)(i % 4));
    }
    return NULL;
}

Test(metrics, concurrent_updates_lose_nothing)
{
    km_metrics *r;
    cr_assert_eq(km_metrics_create(&r), 0);
    double bounds[] = {0, 1, 2};
    worker_arg a = {reg(r, KM_COUNTER, "c", "", NULL, NULL, 0),
                    reg(r, KM_GAUGE, "g", "", NULL, NULL, 0),
                    reg(r, KM_HISTOGRAM, "h", "", NULL, bounds, 3)};
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, hammer, &a);
    km_buf b = {0};
    for (int i = 0; i < 20; i++) render(r, &b); /* scrapes while updating */
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    cr_assert_eq(km_counter_value(km_metric_series(a.c, NULL)), THREADS * ITERS);
    cr_assert_eq(km_gauge_value(km_metric_series(a.g, NULL)), THREADS * ITERS * 0.5);
    cr_assert_eq(km_hist_count(km_metric_series(a.h, NULL)), THREADS * ITERS);
    const char *text = render(r, &b);
    cr_assert(strstr(text, "kvmesh_h_bucket{le=\"0\"} 50000\n"), "%s", text);
    cr_assert(strstr(text, "kvmesh_h_bucket{le=\"2\"} 150000\n"), "%s", text);
    cr_assert(strstr(text, "kvmesh_h_sum 300000\n"), "%s", text);
    km_buf_free(&b);
    km_metrics_destroy(r);
}

/* The value of the line "name VALUE" in text, or -1. */
static double line_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : p)
        if (!strncmp(p, name, n) && p[n] == ' ') return atof(p + n + 1);
    return -1;
}

Test(metrics, process_metrics_are_this_process_s_own)
{
    km_buf b = {0};
    /* 32 MiB touched: the resident size must count them */
    size_t big = 32u << 20;
    char *mem = malloc(big);
    cr_assert_not_null(mem);
    memset(mem, 1, big);
    FILE *f = fopen("/proc/self/stat", "r"); /* one more descriptor open while rendering */
    cr_assert_eq(km_metrics_render_process(&b), 0);
    cr_assert_eq(km_buf_append(&b, "", 1), 0);
    const char *t = (const char *)b.data;
    cr_assert(strstr(t, "# TYPE process_resident_memory_bytes gauge\n"), "%s", t);
    cr_assert(strstr(t, "# TYPE process_cpu_seconds_total counter\n"), "%s", t);
    double rss = line_value(t, "process_resident_memory_bytes");
    double vsz = line_value(t, "process_virtual_memory_bytes");
    cr_assert_geq(rss, (double)big, "%s", t);
    cr_assert_geq(vsz, rss, "%s", t);
    cr_assert_geq(line_value(t, "process_cpu_seconds_total"), 0, "%s", t);
    cr_assert_geq(line_value(t, "process_open_fds"), 4, "stdin, stdout, stderr and f: %s", t);
    cr_assert_gt(line_value(t, "process_max_fds"), 0, "%s", t);
    double start = line_value(t, "process_start_time_seconds"), now = (double)time(NULL);
    cr_assert(start > now - 86400 * 365 && start <= now + 1, "start %f, now %f", start, now);
    fclose(f);
    free(mem);
    km_buf_free(&b);
}
