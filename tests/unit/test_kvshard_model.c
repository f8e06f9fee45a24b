/*
 * test_kvshard_model.c — thousands of random operations (create, append, publish, attach,
 * fork, truncate, destroy, evict, maintain, live format conversion) against a plain reference
 * model of what every sequence must read back, across all three tiers.
 *
 * The K/V of a position is a function of the whole token prefix up to it (as in a real model),
 * so a page reused under the wrong prefix, a torn disk page, a lost copy-on-write or a stale
 * pointer after a move all read back wrong values and fail the check after every operation.
 * After every operation kv_store_check also holds the store's bookkeeping (references, tiers,
 * byte accounting, cached lists, index) to its invariants, wrong values read back or not.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvshard/internal.h"
#include "kvshard/kvshard.h"

#define L     2
#define H     1
#define HD    8
#define PT    4
#define MAXQ  8
#define MAXT  48
#define NBASE 6

typedef struct mseq {
    kv_seq *q;
    int n;
    int lossy; /* a streaming policy drops its pages: its content is not checked */
    int32_t tok[MAXT];
    uint32_t ph[MAXT]; /* prefix hash through each position */
} mseq;

static uint32_t g_r;
static uint32_t rnd(uint32_t n)
{
    g_r ^= g_r << 13;
    g_r ^= g_r >> 17;
    g_r ^= g_r << 5;
    return g_r % n;
}

static uint32_t mix(uint32_t h, int32_t t)
{
    return (h ^ (uint32_t)t) * 16777619u + 0x9e37u;
}

/* Exact in f16 and in every format's range: a multiple of 1/8 in [-2, 2). */
static float val(uint32_t ph, int l, int c, int v)
{
    return (float)((ph >> (c + l * 3 + v * 7)) % 32) / 8.0f - 2.0f;
}

static void set_tokens(mseq *m, int from, const int32_t *t, int n)
{
    for (int i = 0; i < n; i++) {
        m->tok[from + i] = t[i];
        m->ph[from + i] = mix(from + i ? m->ph[from + i - 1] : 2166136261u, t[i]);
    }
}

static int append(kv_store *s, mseq *m, const int32_t *t, int n)
{
    if (m->n + n > MAXT) n = MAXT - m->n;
    if (n <= 0) return 0;
    int rc = kv_seq_reserve(s, m->q, m->n + n);
    if (rc) return rc;
    set_tokens(m, m->n, t, n);
    float k[H * HD], v[H * HD];
    for (int p = m->n; p < m->n + n; p++)
        for (int l = 0; l < L; l++) {
            for (int c = 0; c < HD; c++) {
                k[c] = val(m->ph[p], l, c, 0);
                v[c] = val(m->ph[p], l, c, 1);
            }
            kv_seq_write(s, m->q, l, p, k, v);
        }
    m->n += n;
    return 0;
}

static void verify(kv_store *s, const mseq *m, float tol, int op)
{
    float k[HD], v[HD];
    if (m->lossy) return;
    for (int p = 0; p < m->n; p++)
        for (int l = 0; l < L; l++) {
            cr_assert_eq(kv_seq_read(s, m->q, l, 0, p, k, v), 0, "op %d pos %d", op, p);
            for (int c = 0; c < HD; c++) {
                cr_assert_leq(fabsf(k[c] - val(m->ph[p], l, c, 0)), tol,
                              "op %d: pos %d layer %d ch %d reads %g, wrote %g", op, p, l, c, k[c],
                              val(m->ph[p], l, c, 0));
                cr_assert_leq(fabsf(v[c] - val(m->ph[p], l, c, 1)), tol, "op %d V", op);
            }
        }
}

static km_pagehash g_seed;

static void run_model(uint32_t seed, kv_format fmt, int ops, float tol, int with_convert)
{
    g_r = seed;
    char dir[] = "/tmp/kvshard-model-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    size_t pb = (size_t)PT * HD * 2 * 2 * L * H;
    kv_config c = {.n_layers = L,
                   .n_kv_heads = H,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .format = fmt,
                   .hot_bytes = 40 * pb,
                   .host_bytes = 12 * pb,
                   .disk_dir = dir,
                   .disk_bytes = 30 * (pb + 200),
                   .n_shards = 2,
                   .evict = seed & 1 ? KV_EVICT_LRU_PRIORITY : KV_EVICT_LRU,
                   /* and pages placed by (random) experts as an MoE engine places them */
                   .shard_key = seed & 2 ? KV_SHARD_KEY_EXPERT : KV_SHARD_KEY_HASH,
                   .n_tok_groups = 1,
                   .n_expert_groups = 3};
    kv_store *s;
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    g_seed = km_pagehash_seed("model", 5, seed, NULL, 0);
    /* A few base prompts that requests extend, so prefixes repeat. */
    int32_t base[NBASE][MAXT];
    for (int b = 0; b < NBASE; b++)
        for (int i = 0; i < MAXT; i++) base[b][i] = (int32_t)(b < 3 ? rnd(3) : rnd(1000));
    mseq ms[MAXQ];
    int nq = 0, attached = 0, enospc = 0;
    kv_store_stats st0;
    for (int op = 0; op < ops; op++) {
        int kind = (int)rnd(100);
        if (getenv("KV_MODEL_TRACE")) fprintf(stderr, "op %d kind %d nq %d\n", op, kind, nq);
        if (kind < 15 && nq < MAXQ) { /* a request: attach the longest cached prefix */
            mseq *m = &ms[nq];
            memset(m, 0, sizeof *m);
            cr_assert_eq(kv_seq_create(s, &m->q), 0);
            const int32_t *b = base[rnd(NBASE)];
            int len = (int)rnd(MAXT / PT) * PT;
            km_pagehash h[MAXT / PT];
            int np = km_pagehash_chain(g_seed, b, len, PT, h, MAXT / PT);
            int got = kv_seq_attach(s, m->q, h, b, np);
            if (got == KM_ENOSPC) got = 0;
            cr_assert_geq(got, 0, "op %d attach: %s", op, km_strerror(got));
            set_tokens(m, 0, b, got * PT);
            m->n = got * PT;
            attached += got;
            if (got >= 3 && !rnd(3)) { /* drops attached pages while it holds later ones */
                kv_seq_policy po = {.kind = KV_SEQ_STREAMING, .sink_pages = 1, .window_pages = 1};
                cr_assert_eq(kv_seq_set_policy(s, m->q, &po), 0);
                m->lossy = 1;
            }
            int32_t rest[MAXT];
            for (int i = 0; i < MAXT; i++)
                rest[i] = i + m->n < MAXT && rnd(4) ? b[i + m->n] : (int32_t)rnd(1000);
            if (append(s, m, rest, (int)rnd(12) + 1) == KM_ENOSPC) enospc++;
            nq++;
        } else if (kind < 45 && nq) { /* decode or prefill more */
            mseq *m = &ms[rnd(nq)];
            int32_t t[MAXT];
            for (int i = 0; i < MAXT; i++) t[i] = (int32_t)rnd(3);
            if (append(s, m, t, (int)rnd(6) + 1) == KM_ENOSPC) enospc++;
        } else if (kind < 60 && nq) { /* publish what is complete */
            mseq *m = &ms[rnd(nq)];
            km_pagehash h[MAXT / PT];
            int np = km_pagehash_chain(g_seed, m->tok, m->n, PT, h, MAXT / PT);
            for (int i = 0; c.shard_key == KV_SHARD_KEY_EXPERT && !m->lossy && i < np; i++)
                if (i >= kv_seq_dropped_pages(m->q))
                    cr_assert_geq(kv_seq_place(s, m->q, i * PT, (int)rnd(8)), 0, "op %d place", op);
            cr_assert_geq(kv_seq_publish(s, m->q, h, m->tok, np * PT), 0);
        } else if (kind < 68 && nq && nq < MAXQ) { /* fork */
            mseq *m = &ms[rnd(nq)], *f = &ms[nq];
            *f = *m;
            cr_assert_eq(kv_seq_fork(s, m->q, &f->q), 0);
            nq++;
        } else if (kind < 74 && nq) { /* truncate */
            mseq *m = &ms[rnd(nq)];
            m->n = m->n ? (int)rnd((uint32_t)m->n) : 0;
            kv_seq_truncate(s, m->q, m->n);
        } else if (kind < 88 && nq) { /* request done */
            int i = (int)rnd(nq);
            kv_seq_destroy(s, ms[i].q);
            ms[i] = ms[--nq];
        } else if (kind < 93) {
            kv_store_evict_oldest_fraction(s, rnd(5) / 4.0);
        } else if (kind < 96) {
            kv_store_maintain(s);
        } else if (with_convert) {
            int r = kv_store_convert(s, rnd(2) ? KN_KV_FP8 : KN_KV_F16);
            cr_assert(r >= 0 || r == KM_ENOSPC, "op %d convert: %s", op, km_strerror(r));
            tol = 0.13f; /* fp8 from now on: 3 mantissa bits on values below 2 */
        }
        for (int i = 0; i < nq; i++) verify(s, &ms[i], tol, op);
        cr_assert_eq(kv_store_check(s, &err), 0, "op %d: %s", op, err.msg);
        kv_store_stats st;
        kv_store_stats_get(s, &st);
        cr_assert_eq(st.corrupt_pages, 0);
        cr_assert_leq(st.tier[KV_TIER_HOST].bytes, st.tier[KV_TIER_HOST].budget);
    }
    cr_assert_gt(attached, 0, "the workload reused prefixes");
    kv_store_stats_get(s, &st0);
    cr_assert_gt(st0.dropped_seq_pages, 0, "lossy sequences dropped attached pages");
    for (int i = 0; i < nq; i++) kv_seq_destroy(s, ms[i].q);
    cr_assert_eq(kv_store_check(s, &err), 0, "after the last destroy: %s", err.msg);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].bytes > 0, st.tier[KV_TIER_HOT].pages > 0);
    if (c.shard_key == KV_SHARD_KEY_EXPERT)
        cr_assert_gt(st.placed_pages, st.place_fallbacks, "pages moved to their experts' shards");
    kv_store_destroy(s);
    /* A restart serves what the disk kept, still exactly. */
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_store_check(s, &err), 0, "after the restart: %s", err.msg);
    kv_store_destroy(s);
    DIR *d = opendir(dir);
    struct dirent *de;
    char p[600];
    while ((de = readdir(d)))
        if (de->d_name[0] != '.' || de->d_name[1] == 't') {
            snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(dir);
    (void)enospc;
}

Test(kvshard_model, random_operations_match_the_reference_f16, .timeout = 120)
{
    run_model(0x1234567u, KN_KV_F16, 3000, 0.0f, 0);
}

Test(kvshard_model, random_operations_match_the_reference_int8_lru_priority, .timeout = 120)
{
    run_model(0x7654321u, KN_KV_INT8, 2000, 0.02f, 0);
}

Test(kvshard_model, random_operations_with_live_fp8_conversions, .timeout = 120)
{
    run_model(0x2468ace1u, KN_KV_F16, 2000, 0.0f, 1);
}

Test(kvshard_model, random_operations_on_int4_pages, .timeout = 120)
{
    run_model(0x13579bdfu, KN_KV_INT4, 1500, 0.3f, 0);
}
