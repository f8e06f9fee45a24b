/*
 * test_pool.c — the kernel thread pool (kernels.h): every thread runs each job exactly once with
 * its own ith, barriers separate phases (no thread sees a later phase's writes early or an
 * earlier phase's late), jobs can be run many times back to back and after the workers went to
 * sleep, a pool of one thread needs no other thread, and an idle pool burns no CPU.
 *
 * The pool's latency figures (ns per barrier and per empty job) are a benchmark, not a test:
 * `build/bench/bench_kernels -p` prints them.
 *
 * Only barriers_order_phases carries a .timeout (a deadlocked barrier would hang there): with
 * Criterion 2.4, two tests with timeouts that overlap under --jobs 2 make its runner leak 48
 * bytes, which fails the ASan build.
 */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/kernels.h"

static double now_s(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

Test(pool, rejects_bad_sizes)
{
    kn_pool *p = (kn_pool *)1;
    cr_assert_eq(kn_pool_create(0, &p), KM_EINVAL);
    cr_assert_null(p);
    cr_assert_eq(kn_pool_create(-3, &p), KM_EINVAL);
    kn_pool_destroy(NULL); /* harmless */
}

typedef struct count_ctx {
    _Atomic int runs[16];
    _Atomic int bad_nth;
    int nth;
} count_ctx;

static void count_job(void *ctx, int ith, int nth)
{
    count_ctx *c = ctx;
    if (nth != c->nth || ith < 0 || ith >= nth)
        atomic_fetch_add(&c->bad_nth, 1);
    else
        atomic_fetch_add(&c->runs[ith], 1);
}

Test(pool, every_thread_runs_each_job_once)
{
    const int sizes[] = {1, 2, 3, 4, 8};
    for (int s = 0; s < 5; s++) {
        kn_pool *p;
        cr_assert_eq(kn_pool_create(sizes[s], &p), 0);
        cr_assert_eq(kn_pool_size(p), sizes[s]);
        count_ctx c;
        memset(&c, 0, sizeof c);
        c.nth = sizes[s];
        for (int r = 0; r < 50; r++) kn_pool_run(p, count_job, &c);
        cr_assert_eq(atomic_load(&c.bad_nth), 0);
        for (int i = 0; i < sizes[s]; i++)
            cr_assert_eq(atomic_load(&c.runs[i]), 50, "pool of %d: thread %d ran %d times",
                         sizes[s], i, atomic_load(&c.runs[i]));
        kn_pool_destroy(p);
    }
}

/* Round r: each thread writes its slot and bumps a shared counter; after a barrier every thread
 * must see all slots == r and the counter at (r+1)*nth; a second barrier keeps the next round's
 * writes from racing with this round's reads. */
typedef struct phase_ctx {
    kn_pool *p;
    int rounds;
    _Atomic int slots[16];
    _Atomic int counter;
    _Atomic int errors;
} phase_ctx;

static void phase_job(void *ctx, int ith, int nth)
{
    phase_ctx *c = ctx;
    for (int r = 0; r < c->rounds; r++) {
        atomic_store_explicit(&c->slots[ith], r, memory_order_relaxed);
        atomic_fetch_add_explicit(&c->counter, 1, memory_order_relaxed);
        kn_pool_barrier(c->p);
        for (int j = 0; j < nth; j++)
            if (atomic_load_explicit(&c->slots[j], memory_order_relaxed) != r)
                atomic_fetch_add(&c->errors, 1);
        if (atomic_load_explicit(&c->counter, memory_order_relaxed) != (r + 1) * nth)
            atomic_fetch_add(&c->errors, 1);
        kn_pool_barrier(c->p);
    }
}

// cppcheck-suppress unknownMacro
Test(pool, barriers_order_phases, .timeout = 120)
{
    const int sizes[] = {1, 2, 3, 4, 7};
    for (int s = 0; s < 5; s++) {
        phase_ctx c;
        memset(&c, 0, sizeof c);
        cr_assert_eq(kn_pool_create(sizes[s], &c.p), 0);
        c.rounds = 2000;
        for (int rep = 0; rep < 3; rep++) {
            atomic_store(&c.counter, 0);
            for (int j = 0; j < 16; j++) atomic_store(&c.slots[j], -1);
            kn_pool_run(c.p, phase_job, &c);
            cr_assert_eq(atomic_load(&c.errors), 0, "pool of %d: %d ordering errors", sizes[s],
                         atomic_load(&c.errors));
            cr_assert_eq(atomic_load(&c.counter), c.rounds * sizes[s]);
        }
        kn_pool_destroy(c.p);
    }
}

/* Plain (non-atomic) data handed across a barrier: what ThreadSanitizer checks. */
typedef struct data_ctx {
    kn_pool *p;
    long part[8];
    long total[8];
} data_ctx;

static void data_job(void *ctx, int ith, int nth)
{
    data_ctx *c = ctx;
    c->part[ith] = (ith + 1) * 1000;
    kn_pool_barrier(c->p);
    long t = 0;
    for (int j = 0; j < nth; j++) t += c->part[j];
    c->total[ith] = t;
}

Test(pool, plain_writes_are_visible_after_barrier_and_after_run)
{
    data_ctx c;
    memset(&c, 0, sizeof c);
    cr_assert_eq(kn_pool_create(4, &c.p), 0);
    for (int r = 0; r < 1000; r++) {
        kn_pool_run(c.p, data_job, &c);
        for (int i = 0; i < 4; i++) cr_assert_eq(c.total[i], 10000);
        memset(c.total, 0, sizeof c.total);
    }
    kn_pool_destroy(c.p);
}

static void sum_job(void *ctx, int ith, int nth)
{
    long *acc = ctx;
    int64_t lo, hi;
    kn_split(1000, ith, nth, &lo, &hi);
    long s = 0;
    for (int64_t i = lo; i < hi; i++) s += i;
    acc[ith] = s;
}

Test(pool, run_many_times_back_to_back)
{
    kn_pool *p;
    cr_assert_eq(kn_pool_create(3, &p), 0);
    long acc[3];
    for (int r = 0; r < 20000; r++) {
        acc[0] = acc[1] = acc[2] = -1;
        kn_pool_run(p, sum_job, acc);
        cr_assert_eq(acc[0] + acc[1] + acc[2], 999L * 1000 / 2, "round %d", r);
    }
    kn_pool_destroy(p);
}

typedef struct sleepy_ctx {
    kn_pool *p;
    _Atomic int after;
} sleepy_ctx;

static void sleepy_job(void *ctx, int ith, int nth)
{
    sleepy_ctx *c = ctx;
    if (ith == nth - 1) usleep(5000); /* the others give up spinning and sleep in the barrier */
    kn_pool_barrier(c->p);
    atomic_fetch_add(&c->after, 1);
    if (ith == 0) usleep(5000); /* the workers sleep waiting for the caller to finish */
}

Test(pool, wakes_threads_that_went_to_sleep)
{
    sleepy_ctx c = {0};
    cr_assert_eq(kn_pool_create(3, &c.p), 0);
    for (int r = 0; r < 5; r++) {
        usleep(5000); /* workers stop spinning between jobs and sleep */
        kn_pool_run(c.p, sleepy_job, &c);
        cr_assert_eq(atomic_load(&c.after), 3 * (r + 1));
    }
    kn_pool_destroy(c.p);
}

static void nop_job(void *ctx, int ith, int nth)
{
    (void)ctx, (void)ith, (void)nth;
}

Test(pool, single_thread_pool_runs_on_caller)
{
    kn_pool *p;
    cr_assert_eq(kn_pool_create(1, &p), 0);
    count_ctx c;
    memset(&c, 0, sizeof c);
    c.nth = 1;
    kn_pool_run(p, count_job, &c);
    cr_assert_eq(atomic_load(&c.runs[0]), 1);
    kn_pool_barrier(p); /* a no-op outside and inside a job */
    phase_ctx ph;
    memset(&ph, 0, sizeof ph);
    ph.p = p, ph.rounds = 10;
    kn_pool_run(p, phase_job, &ph);
    cr_assert_eq(atomic_load(&ph.errors), 0);
    kn_pool_destroy(p);
}

Test(pool, idle_pool_uses_no_cpu)
{
    kn_pool *p;
    cr_assert_eq(kn_pool_create(3, &p), 0);
    kn_pool_run(p, nop_job, NULL);
    usleep(20000); /* past the spin window */
    double c0 = now_s(CLOCK_PROCESS_CPUTIME_ID), w0 = now_s(CLOCK_MONOTONIC);
    usleep(200000);
    double cpu = now_s(CLOCK_PROCESS_CPUTIME_ID) - c0, wall = now_s(CLOCK_MONOTONIC) - w0;
    /* Spinning workers would burn about 2 * wall; sleeping ones next to nothing. */
    cr_assert_lt(cpu, 0.25 * wall, "idle pool used %.1f ms of CPU in %.1f ms", cpu * 1e3,
                 wall * 1e3);
    kn_pool_destroy(p);
}
