/*
 * test_engine_sparse.c — sparse decode attention in the engine (docs/sparse.md) with the real
 * model: positions whose context fits the budget get the dense engine's logits bit for bit; past
 * it they stay finite (their quality is bench/bench_long.sh's business); and a token gets the same
 * logits whether it is decoded alone (lane mode) or inside a prefill chunk (every token picks its
 * own pages), as perplexity assumes. A long prefix cached on disk or host RAM and attached again
 * stays there but for the pages a decode step reads (kv_seq_fetch), and that step's logits are
 * the all-hot engine's bit for bit.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tests/unit/model_fixture.h"
#include "kvshard/internal.h" /* kv_store_check */

#define N      160
#define BUDGET 64

/* Logits of every position of ids, n_chunk tokens per step: [N][n_vocab]; set >= 0: the
 * engine's budget is set to it (en_engine_set_sparse) before the first step. */
static float *run_set(en_engine_opts o, int set, int n_chunk, const int32_t *ids)
{
    const int nv = en_model_hparams(g_model)->n_vocab;
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    if (set >= 0) cr_assert_eq(en_engine_set_sparse(e, set), 0);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(en_engine_kv(e), &q), 0);
    float *out = malloc(sizeof(float) * N * nv);
    int32_t pos[N];
    kv_seq *seqs[N];
    uint8_t want[N];
    for (int s = 0; s < N; s += n_chunk) {
        const int n = N - s < n_chunk ? N - s : n_chunk;
        for (int i = 0; i < n; i++) pos[i] = s + i, seqs[i] = q, want[i] = 1;
        en_batch b = {.n_tokens = n, .tokens = ids + s, .pos = pos, .seqs = seqs, .logits = want};
        const float *lg;
        cr_assert_eq(en_engine_step(e, &b, &lg), n);
        memcpy(out + (size_t)s * nv, lg, sizeof(float) * n * nv);
    }
    kv_seq_destroy(en_engine_kv(e), q);
    en_engine_destroy(e);
    return out;
}

static float *run_opts(en_engine_opts o, int n_chunk, const int32_t *ids)
{
    return run_set(o, -1, n_chunk, ids);
}

static float *run(int sparse, int n_chunk, const int32_t *ids)
{
    en_engine_opts o = {
        .n_threads = 2, .max_batch_tokens = N, .sparse_attn = sparse, .sparse_dense_layers = -1};
    return run_opts(o, n_chunk, ids);
}

Test(engine_sparse, fits_the_budget_dense_past_it_close_and_decode_equals_prefill, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const int nv = en_model_hparams(g_model)->n_vocab;
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 7919u + 13u) % 20000u) + 100;
    int changed = 0;
    float *dense = run(0, N, ids), *pre = run(BUDGET, N, ids), *dec = run(BUDGET, 1, ids);
    for (int t = 0; t < N; t++) {
        const float *d = dense + (size_t)t * nv, *p = pre + (size_t)t * nv,
                    *g = dec + (size_t)t * nv;
        if (t < BUDGET)
            cr_assert_arr_eq(p, d, sizeof(float) * nv, "position %d fits the budget", t);
        double diff = 0;
        for (int v = 0; v < nv; v++) {
            cr_assert(isfinite(p[v]));
            cr_assert_float_eq(g[v], p[v], 1e-3f, "position %d: decode and prefill agree", t);
            diff += fabs((double)p[v] - d[v]);
        }
        if (t >= BUDGET + 2 * 16) changed += diff > 0;
    }
    cr_assert_gt(changed, 0, "past the budget, attention left pages out");
    free(dense);
    free(pre);
    free(dec);
}

/* en_engine_set_sparse (bench_long_dec's modes over one KV): an engine created with one budget
 * and set to 0 computes the dense engine's logits, and set to another budget that budget's
 * engine's, bit for bit; an engine created dense refuses it. */
Test(engine_sparse, the_budget_set_on_a_running_engine_is_the_budget_created_with, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const int nv = en_model_hparams(g_model)->n_vocab;
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 7919u + 13u) % 20000u) + 100;
    en_engine_opts o = {.n_threads = 2,
                        .max_batch_tokens = N,
                        .sparse_attn = 2 * BUDGET,
                        .sparse_dense_layers = -1};
    float *dense = run(0, N, ids), *set0 = run_set(o, 0, N, ids);
    cr_assert_arr_eq(set0, dense, sizeof(float) * N * nv);
    float *sparse = run(BUDGET, N, ids), *set = run_set(o, BUDGET, N, ids);
    cr_assert_arr_eq(set, sparse, sizeof(float) * N * nv);
    en_engine *e;
    km_errbuf err = {{0}};
    o.sparse_attn = 0;
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_set_sparse(e, BUDGET), KM_EINVAL);
    en_engine_destroy(e);
    free(dense);
    free(set0);
    free(sparse);
    free(set);
}

/* --sparse-shallow-attn: the first two layers attend within twice the budget instead of densely,
 * so positions within it get the default engine's logits (those layers dense) bit for bit, and
 * some past it do not. */
Test(engine_sparse, shallow_layers_have_their_own_budget, .init = setup, .fini = teardown,
     .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const int nv = en_model_hparams(g_model)->n_vocab;
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 7919u + 13u) % 20000u) + 100;
    en_engine_opts o = {.n_threads = 2, .max_batch_tokens = N, .sparse_attn = BUDGET};
    float *dense2 = run_opts(o, N, ids);
    o.sparse_shallow_attn = 2 * BUDGET;
    float *shallow = run_opts(o, N, ids);
    int changed = 0;
    for (int t = 0; t < N; t++) {
        const size_t at = (size_t)t * nv;
        if (t < 2 * BUDGET)
            cr_assert_arr_eq(shallow + at, dense2 + at, sizeof(float) * nv, "position %d", t);
        else
            changed += memcmp(shallow + at, dense2 + at, sizeof(float) * nv) != 0;
    }
    cr_assert_gt(changed, 0, "past their budget the first layers left pages out");
    free(dense2);
    free(shallow);
}

#define LONG 512 /* tokens of the cached prefix: 32 pages of 16 */

/* Removes the disk tier's directory (its page files are all at its top). */
static void rm_dir(const char *d)
{
    DIR *dir = opendir(d);
    struct dirent *de;
    char p[512];
    while (dir && (de = readdir(dir))) {
        if (de->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s", d, de->d_name);
        unlink(p);
    }
    if (dir) closedir(dir);
    rmdir(d);
}

/* Prefills ids[0, LONG) into q, 256 tokens a step. */
static void prefill(en_engine *e, kv_seq *q, const int32_t *ids)
{
    int32_t pos[256];
    kv_seq *seqs[256];
    for (int s = 0; s < LONG; s += 256) {
        for (int i = 0; i < 256; i++) pos[i] = s + i, seqs[i] = q;
        en_batch b = {.n_tokens = 256, .tokens = ids + s, .pos = pos, .seqs = seqs};
        cr_assert_eq(en_engine_step(e, &b, NULL), 1);
    }
}

/* One decode step of q at position at: its logits [n_vocab], the caller's to free. */
static float *decode_at(en_engine *e, kv_seq *q, const int32_t *ids, int32_t at)
{
    const int nv = en_model_hparams(g_model)->n_vocab;
    int32_t pos = at;
    en_batch b = {.n_tokens = 1, .tokens = ids + at, .pos = &pos, .seqs = &q};
    const float *lg;
    cr_assert_eq(en_engine_step(e, &b, &lg), 1);
    float *out = malloc(sizeof(float) * nv);
    memcpy(out, lg, sizeof(float) * nv);
    return out;
}

static float *decode(en_engine *e, kv_seq *q, const int32_t *ids)
{
    return decode_at(e, q, ids, LONG);
}

/* The prefix demoted to tier `to` (disk, or host RAM), attached again and decoded one token:
 * with slices, the step reads the layer slices it selects and brings up nothing; without, a
 * selected page comes up whole. Returns the bytes the step read from the cold tier. */
static uint64_t cold_prefix(kv_tier to, int slices)
{
    const int nv = en_model_hparams(g_model)->n_vocab, np = LONG / 16;
    int32_t ids[LONG + 1];
    for (int i = 0; i <= LONG; i++) ids[i] = (int32_t)((i * 7919u + 13u) % 20000u) + 100;
    km_pagehash seed = km_pagehash_seed(NULL, 0, 7, NULL, 0), h[LONG / 16];
    cr_assert_eq(km_pagehash_chain(seed, ids, LONG, 16, h, np), np);

    en_engine_opts o = {
        .n_threads = 2, .max_batch_tokens = 256, .sparse_attn = BUDGET, .sparse_dense_layers = -1};
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(en_engine_kv(e), &q), 0);
    prefill(e, q, ids);
    float *hot = decode(e, q, ids);
    kv_seq_destroy(en_engine_kv(e), q);
    en_engine_destroy(e);

    o.sparse_slices = slices ? 0 : -1;
    char dir[] = "/tmp/kvmesh_sparse_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    if (to == KV_TIER_DISK)
        o.kv_disk_dir = dir;
    else
        o.kv_host_bytes = (size_t)64 << 20;
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    kv_store *kv = en_engine_kv(e);
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    prefill(e, q, ids);
    cr_assert_eq(kv_seq_publish(kv, q, h, ids, LONG), np);
    kv_seq_destroy(kv, q);
    cr_assert_eq(kv_store_evict_oldest_fraction(kv, 1.0), np);
    kv_store_stats st;
    kv_store_stats_get(kv, &st);
    cr_assert_eq(st.tier[to].pages, (uint64_t)np, "the prefix is on %s", kv_tier_name(to));
    cr_assert_eq(st.tier[KV_TIER_HOT].pages, 0);

    cr_assert_eq(kv_seq_create(kv, &q), 0);
    cr_assert_eq(kv_seq_attach(kv, q, h, ids, np), np);
    cr_assert_eq(kv_seq_cold_pages(q), np, "attached where it was: nothing came up");
    float *cold = decode(e, q, ids);
    en_sparse_stats ss;
    en_engine_sparse_stats(e, &ss);
    kv_store_stats_get(kv, &st);
    cr_assert_arr_eq(cold, hot, sizeof(float) * nv, "the same pages attended as when all hot");
    cr_assert_gt(ss.pages_skipped, 0);
    const uint64_t layer_bytes =
        kv_store_page_bytes(kv) / (uint64_t)en_model_hparams(g_model)->n_layers;
    if (slices) {
        cr_assert_eq(st.promoted_pages[KV_PROMOTE_READ], 0, "nothing came up whole");
        cr_assert_eq(kv_seq_cold_pages(q), np, "every page is where it was");
        cr_assert_eq(st.tier[to].pages, (uint64_t)np);
        const uint64_t n = to == KV_TIER_DISK ? st.slice_disk_reads : st.slice_host_reads;
        cr_assert_gt(n, 0);
        cr_assert_lt(n, (uint64_t)np * en_model_hparams(g_model)->n_layers,
                     "a step read its selection's slices, not every layer of every page");
        cr_assert_eq(st.slice_disk_bytes, to == KV_TIER_DISK ? n * layer_bytes : 0);
        km_errbuf cerr = {{0}};
        cr_assert_eq(kv_store_check(kv, &cerr), 0, "%s", cerr.msg);
        cr_log_info("%s: %llu of %d layer slices read, nothing came up", kv_tier_name(to),
                    (unsigned long long)n, np * en_model_hparams(g_model)->n_layers);
        kv_seq_destroy(kv, q);
        en_engine_destroy(e);
        free(hot);
        free(cold);
        rm_dir(dir);
        return st.slice_disk_bytes;
    }
    cr_assert_eq(st.slice_disk_reads + st.slice_host_reads, 0);
    const int up = (int)st.promoted_pages[KV_PROMOTE_READ];
    cr_assert_gt(up, 0);
    cr_assert_eq((uint64_t)up, ss.pages_fetched);
    cr_assert_eq(st.promoted_pages[KV_PROMOTE_PREFIX], 0);
    cr_assert_eq(st.promoted_bytes[KV_PROMOTE_READ], (uint64_t)up * kv_store_page_bytes(kv));
    cr_assert_eq(kv_seq_cold_pages(q), np - up, "the pages it did not read stayed down");
    cr_assert_lt(up, np, "a step read a selection, not the whole prefix (%d of %d pages)", up, np);
    cr_log_info("%s: %d of %d pages came up", kv_tier_name(to), up, np);

    const uint64_t read = to == KV_TIER_DISK ? (uint64_t)up * kv_store_page_bytes(kv) : 0;
    km_errbuf cerr = {{0}};
    cr_assert_eq(kv_store_check(kv, &cerr), 0, "%s", cerr.msg);
    kv_seq_destroy(kv, q);
    en_engine_destroy(e);
    free(hot);
    free(cold);
    rm_dir(dir);
    return read;
}

Test(engine_sparse, a_prefix_on_disk_comes_up_only_where_a_step_reads_it, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    cold_prefix(KV_TIER_DISK, 0);
}

Test(engine_sparse, a_prefix_on_host_ram_comes_up_only_where_a_step_reads_it, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    cold_prefix(KV_TIER_HOST, 0);
}

/* Layer slices (kv_config.fetch_slices, the engine's default): a long prefix on disk, a step
 * reads from disk only the layers of the pages it selects, fewer bytes than the pages whole, and
 * its logits equal the all-hot engine's. */
Test(engine_sparse, a_prefix_on_disk_is_read_only_in_the_layer_slices_a_step_selects, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const uint64_t sliced = cold_prefix(KV_TIER_DISK, 1);
    const uint64_t whole = cold_prefix(KV_TIER_DISK, 0);
    cr_assert_lt(sliced, whole, "slices %llu bytes, whole pages %llu", (unsigned long long)sliced,
                 (unsigned long long)whole);
    cr_log_info("disk bytes read by one step: slices %llu, whole pages %llu",
                (unsigned long long)sliced, (unsigned long long)whole);
}

Test(engine_sparse, a_prefix_on_host_ram_is_read_in_place_by_layer, .init = setup, .fini = teardown,
     .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    cold_prefix(KV_TIER_HOST, 1);
}

#define STEPS 6 /* decode steps after the cold attach */

/* Pages a sparse sequence brought up and then stopped reading go back down while the hot tier
 * is short (a budget of 33 pages for a 33-page sequence), and every step's logits stay those of
 * the all-hot engine: a page sent down comes up again when a step selects it. */
Test(engine_sparse, held_pages_no_step_reads_go_back_down, .init = setup, .fini = teardown,
     .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const int nv = en_model_hparams(g_model)->n_vocab, np = LONG / 16;
    int32_t ids[LONG + STEPS];
    for (int i = 0; i < LONG + STEPS; i++) ids[i] = (int32_t)((i * 7919u + 13u) % 20000u) + 100;
    km_pagehash seed = km_pagehash_seed(NULL, 0, 7, NULL, 0), h[LONG / 16];
    cr_assert_eq(km_pagehash_chain(seed, ids, LONG, 16, h, np), np);

    en_engine_opts o = {
        .n_threads = 2, .max_batch_tokens = 256, .sparse_attn = BUDGET, .sparse_dense_layers = -1};
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(en_engine_kv(e), &q), 0);
    prefill(e, q, ids);
    float *hot[STEPS];
    for (int t = 0; t < STEPS; t++) hot[t] = decode_at(e, q, ids, LONG + t);
    const size_t pb = kv_store_page_bytes(en_engine_kv(e));
    kv_seq_destroy(en_engine_kv(e), q);
    en_engine_destroy(e);

    o.kv_bytes = (size_t)(np + 1) * pb;
    o.kv_host_bytes = (size_t)64 << 20;
    o.sparse_slices = 2; /* a page comes up whole at its third layer read, as held pages do */
    o.sparse_idle = 1;
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    kv_store *kv = en_engine_kv(e);
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    prefill(e, q, ids);
    cr_assert_eq(kv_seq_publish(kv, q, h, ids, LONG), np);
    kv_seq_destroy(kv, q);
    kv_store_evict_oldest_fraction(kv, 1.0); /* some went down already: the budget is short */
    kv_store_stats st;
    kv_store_stats_get(kv, &st);
    cr_assert_eq(st.tier[KV_TIER_HOST].pages, (uint64_t)np, "the prefix is on host RAM");
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    cr_assert_eq(kv_seq_attach(kv, q, h, ids, np), np);
    for (int t = 0; t < STEPS; t++) {
        float *cold = decode_at(e, q, ids, LONG + t);
        cr_assert_arr_eq(cold, hot[t], sizeof(float) * nv, "step %d: the all-hot logits", t);
        free(cold);
        free(hot[t]);
        km_errbuf cerr = {{0}};
        cr_assert_eq(kv_store_check(kv, &cerr), 0, "step %d: %s", t, cerr.msg);
    }
    kv_store_stats_get(kv, &st);
    en_sparse_stats ss;
    en_engine_sparse_stats(e, &ss);
    cr_assert_gt(st.held_demoted_pages, 0, "pages no step read went back down");
    cr_assert_eq(st.held_demoted_bytes, st.held_demoted_pages * pb);
    cr_assert_gt(kv_seq_cold_pages(q), 0);
    cr_assert_geq(ss.pages_wanted, ss.pages_fetched);
    cr_log_info("%llu pages up, %llu sent back down, %llu asked for",
                (unsigned long long)st.promoted_pages[KV_PROMOTE_READ],
                (unsigned long long)st.held_demoted_pages, (unsigned long long)ss.pages_wanted);
    kv_seq_destroy(kv, q);
    en_engine_destroy(e);
}
