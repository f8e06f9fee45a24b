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
#include <time.h>

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
/* The process's CPU time so far, in ms (every thread's). */
static inline double bench_cpu_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static inline double bench_pct(double *v, size_t n, double p)
{
    if (!n) return 0;
    qsort(v, n, sizeof *v, bench_cmp_double);
    return v[(size_t)(p * (double)(n - 1) + 0.5)];
}

/* The options bench_arg was asked for, with their defaults, for bench_args_end. */
#define BENCH_MAX_ARGS 48
typedef struct bench_known {
    const char *name[BENCH_MAX_ARGS], *def[BENCH_MAX_ARGS];
    int n;
} bench_known;

static inline bench_known *bench_known_args(void)
{
    static bench_known k;
    return &k;
}

/* The value after `name` in argv, or def. */
static inline const char *bench_arg(int argc, char **argv, const char *name, const char *def)
{
    bench_known *k = bench_known_args();
    int seen = 0;
    for (int i = 0; i < k->n && !seen; i++) seen = !strcmp(k->name[i], name);
    if (!seen && k->n < BENCH_MAX_ARGS) {
        k->name[k->n] = name;
        k->def[k->n++] = def;
    }
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], name)) return argv[i + 1];
    return def;
}

/* Called after a program's last bench_arg, argv[first..] being its `--name value` pairs:
 * `-h`/`--help` lists the options read, with their defaults, and exits 0; an option never
 * read, or one without its value, is an error (exit 2), not a run with the defaults. */
static inline void bench_args_end(int argc, char **argv, const char *prog, int first)
{
    const bench_known *k = bench_known_args();
    for (int i = first; i < argc; i += 2) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: %s [option value]...\n", prog);
            for (int j = 0; j < k->n; j++)
                printf("  %-22s default %s\n", k->name[j], k->def[j] ? k->def[j] : "(none)");
            exit(0);
        }
        int known = 0;
        for (int j = 0; j < k->n && !known; j++) known = !strcmp(k->name[j], argv[i]);
        if (!known || i + 1 >= argc) {
            fprintf(stderr, "%s: %s %s (--help lists the options)\n", prog,
                    known ? "no value for" : "unknown option", argv[i]);
            exit(2);
        }
    }
}

#endif
