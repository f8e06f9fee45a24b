/*
 * bench_util.h — the small helpers every benchmark program shares: the machine's load average
 * (printed next to each figure, since these machines are shared), sorting and quantiles of
 * samples, and `--name value` arguments. Header-only: each bench is one program.
 */
#ifndef KVMESH_BENCH_UTIL_H
#define KVMESH_BENCH_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The 1-minute load average, -1 when /proc/loadavg cannot be read. */
static inline double bench_load1(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}

/* qsort comparators. */
static inline int bench_cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static inline int bench_cmp_u64(const void *a, const void *b)
{
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* p-quantile of v[0..n) by nearest rank; sorts v. 0 for no samples. */
static inline double bench_pct(double *v, size_t n, double p)
{
    if (!n) return 0;
    qsort(v, n, sizeof *v, bench_cmp_double);
    return v[(size_t)(p * (double)(n - 1) + 0.5)];
}

/* The value after `name` in argv, or def. */
static inline const char *bench_arg(int argc, char **argv, const char *name, const char *def)
{
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], name)) return argv[i + 1];
    return def;
}

#endif
