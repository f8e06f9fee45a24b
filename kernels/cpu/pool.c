/*
 * pool.c — the kernel thread pool of kernels.h: a fixed set of threads created once, one job at a
 * time, and a barrier usable inside a job.
 *
 * The engine runs one job per forward step and separates its ~250 operations per token with
 * kn_pool_barrier, so both hand-offs must cost well under a microsecond while threads are busy,
 * yet an idle server must not burn CPU. Every wait therefore spins with _mm_pause for a short,
 * time-bounded while (KN_POOL_SPIN_NS, yielding the CPU after the first few microseconds so that
 * an oversubscribed machine still makes progress) and then sleeps on a Linux futex. A waker only
 * issues the futex_wake system call when somebody has announced that it sleeps (a sleeper counter
 * next to the word), so the spinning fast path is pure shared-memory traffic.
 *
 *  - Jobs: the caller publishes fn/ctx, then bumps job_seq (release); workers wait for job_seq to
 *    change, run fn(ctx, ith, nth), and count themselves into n_done; the caller (worker 0) runs
 *    its own share and then waits for n_done == nth - 1.
 *  - Barrier: a sense-reversing barrier whose "sense" is a generation counter: each arriving
 *    thread reads the generation, increments the arrival count; the last one resets the count and
 *    advances the generation, releasing the others, who wait for the generation to move. The
 *    counter (rather than a single bit) doubles as the futex word.
 *
 * The hot words live on separate cache lines. Nothing is allocated after kn_pool_create. Nested
 * kn_pool_run (from inside a job) is not supported.
 */
#define _GNU_SOURCE
#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define kn_cpu_relax() _mm_pause()
#else
#define kn_cpu_relax() ((void)0)
#endif

#include "kernels/kernels.h"

/* How long a waiter spins before it sleeps. Long enough to cover the gap between two operations
 * of a forward step, short enough that an idle process goes quiet at once. */
#define KN_POOL_SPIN_NS 100000
/* After this long a spinning waiter also yields its CPU between checks. */
#define KN_POOL_YIELD_NS 5000
#define KN_POOL_MAX      1024

/* A 32-bit word that threads wait on, plus the number of threads asleep on it. */
typedef struct kn_wait_word {
    alignas(64) _Atomic uint32_t v;
    _Atomic uint32_t sleepers;
} kn_wait_word;

struct kn_pool {
    int n;
    pthread_t *threads;
    kn_pool_fn fn; /* the current job: written by the caller before job_seq moves */
    void *ctx;
    _Atomic int stop;
    kn_wait_word job_seq; /* bumped once per job (and once to stop) */
    kn_wait_word n_done;  /* workers (not the caller) that finished the current job */
    alignas(64) _Atomic uint32_t bar_count; /* threads arrived at the current barrier */
    kn_wait_word bar_gen;                   /* the barrier's sense: advanced on release */
};

typedef struct kn_worker_arg {
    kn_pool *p;
    int ith;
} kn_worker_arg;

static uint64_t kn_pool_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void kn_futex_wait(_Atomic uint32_t *w, uint32_t val)
{
    /* Returns at once when *w != val; EINTR and spurious wake-ups are handled by the callers'
     * loops, which re-check the condition. */
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void kn_futex_wake_all(_Atomic uint32_t *w)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Waits while w->v == val: spins, then sleeps. Returns the new value (acquire). */
static uint32_t kn_wait_while_eq(kn_wait_word *w, uint32_t val)
{
    uint32_t cur = atomic_load_explicit(&w->v, memory_order_acquire);
    if (cur != val) return cur;
    uint64_t t0 = kn_pool_now_ns();
    for (;;) {
        for (int i = 0; i < 16; i++) {
            kn_cpu_relax();
            cur = atomic_load_explicit(&w->v, memory_order_acquire);
            if (cur != val) return cur;
        }
        uint64_t waited = kn_pool_now_ns() - t0;
        if (waited > KN_POOL_SPIN_NS) break;
        /* Past a few microseconds the thread we wait for may be off CPU (more runnable threads
         * than cores): let it run. Costs one cheap system call when nothing else is runnable. */
        if (waited > KN_POOL_YIELD_NS) sched_yield();
    }
    /* Announce the sleep before re-checking (both seq_cst): a waker that changes v and then sees
     * sleepers == 0 did so before our increment, so the futex sees the new value and returns. */
    atomic_fetch_add_explicit(&w->sleepers, 1, memory_order_seq_cst);
    while ((cur = atomic_load_explicit(&w->v, memory_order_seq_cst)) == val)
        kn_futex_wait(&w->v, val);
    atomic_fetch_sub_explicit(&w->sleepers, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    return cur;
}

/* Wakes every sleeper of w; call after changing w->v. */
static void kn_wake(kn_wait_word *w)
{
    if (atomic_load_explicit(&w->sleepers, memory_order_seq_cst) != 0) kn_futex_wake_all(&w->v);
}

static void *kn_pool_worker(void *arg)
{
    kn_worker_arg *a = arg;
    kn_pool *p = a->p;
    int ith = a->ith;
    uint32_t seen = 0;
    for (;;) {
        seen = kn_wait_while_eq(&p->job_seq, seen);
        if (atomic_load_explicit(&p->stop, memory_order_relaxed)) break;
        p->fn(p->ctx, ith, p->n);
        uint32_t done = atomic_fetch_add_explicit(&p->n_done.v, 1, memory_order_seq_cst) + 1;
        if (done == (uint32_t)(p->n - 1)) kn_wake(&p->n_done);
    }
    return NULL;
}

int kn_pool_create(int n_threads, kn_pool **out)
{
    *out = NULL;
    if (n_threads < 1 || n_threads > KN_POOL_MAX) return KM_EINVAL;
    kn_pool *p = aligned_alloc(64, (sizeof(kn_pool) + 63) & ~(size_t)63);
    if (!p) return KM_ENOMEM;
    memset(p, 0, sizeof *p);
    p->n = n_threads;
    if (n_threads == 1) {
        *out = p;
        return 0;
    }
    /* One block: the thread handles, then each worker's argument. */
    p->threads = calloc((size_t)n_threads, sizeof(pthread_t) + sizeof(kn_worker_arg));
    if (!p->threads) {
        free(p);
        return KM_ENOMEM;
    }
    kn_worker_arg *args = (kn_worker_arg *)(p->threads + n_threads);
    for (int i = 1; i < n_threads; i++) {
        args[i].p = p;
        args[i].ith = i;
        if (pthread_create(&p->threads[i], NULL, kn_pool_worker, &args[i]) != 0) {
            p->n = i; /* destroy joins the ones that started */
            kn_pool_destroy(p);
            return KM_ENOMEM;
        }
        char name[16];
        snprintf(name, sizeof name, "kn-pool-%hu", (unsigned short)i);
        pthread_setname_np(p->threads[i], name);
    }
    *out = p;
    return 0;
}

void kn_pool_destroy(kn_pool *p)
{
    if (!p) return;
    if (p->n > 1) {
        atomic_store_explicit(&p->stop, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->job_seq.v, 1, memory_order_seq_cst);
        kn_wake(&p->job_seq);
        for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    }
    free(p->threads);
    free(p);
}

int kn_pool_size(const kn_pool *p)
{
    return p->n;
}

void kn_pool_run(kn_pool *p, kn_pool_fn fn, void *ctx)
{
    if (p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->n_done.v, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->job_seq.v, 1, memory_order_seq_cst);
    kn_wake(&p->job_seq);
    fn(ctx, 0, p->n);
    uint32_t done = atomic_load_explicit(&p->n_done.v, memory_order_acquire);
    while (done != (uint32_t)(p->n - 1)) done = kn_wait_while_eq(&p->n_done, done);
}

void kn_pool_barrier(kn_pool *p)
{
    if (p->n == 1) return;
    /* The generation cannot move before this thread arrives, so this is the current one. */
    uint32_t gen = atomic_load_explicit(&p->bar_gen.v, memory_order_relaxed);
    uint32_t arrived = atomic_fetch_add_explicit(&p->bar_count, 1, memory_order_acq_rel) + 1;
    if (arrived == (uint32_t)p->n) {
        atomic_store_explicit(&p->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->bar_gen.v, 1, memory_order_seq_cst);
        kn_wake(&p->bar_gen);
        return;
    }
    kn_wait_while_eq(&p->bar_gen, gen);
}
