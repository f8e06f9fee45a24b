/*
 * bench_long_mem.c — `PART=mem make bench-long`: many long sequences served with sparse attention
 * inside a hot KV budget much smaller than their KV (issue 34 item 5, docs/sparse.md), in the
 * engine with its real kvshard store (hot, host RAM and disk tiers), no sockets.
 *
 * Text: the files of /usr/share/common-licenses in name order, tokenized; sequence k is a window of
 * --ctx tokens starting k * --ctx tokens in (wrapping round), with its own hash seed so that no two
 * share pages. Ingest: each sequence is prefilled, published and released, one after the
 * other, so that eviction sends the older ones down as the hot tier fills. Serve: every
 * sequence is attached again (with sparse attention its pages stay where they are) and all of
 * them decode --gen steps together, one token each a step (the text's next tokens, teacher
 * forced, so every mode computes the same thing). Per mode: decode tokens/s (wall and CPU), KV
 * bytes brought up whole and sent back down per decoded token, bytes read from disk as layer
 * slices per token (--slices N: en_engine_opts.sparse_slices; -1 whole pages only), the hit rate
 * of the selection (of the (layer, page) reads the steps asked for, the share that needed no
 * I/O: hot, or host RAM read in place) and the hot tier at the end. Modes: --hot F gives the hot
 * tier F x the sequences' KV (host RAM --host F of it, disk the rest); --budget 0 is dense
 * attention. Nothing is asserted about time.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "engine/engine.h"

static double now_s(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The licences' tokens, concatenated; their count in *n. */
static int32_t *load_text(const md_tokenizer *t, int *n)
{
    const char *dir = "/usr/share/common-licenses";
    DIR *dp = opendir(dir);
    char *names[64] = {0};
    int nn = 0;
    struct dirent *de;
    while (dp && (de = readdir(dp)) && nn < 64)
        if (de->d_name[0] != '.') names[nn++] = strdup(de->d_name);
    if (dp) closedir(dp);
    qsort(names, (size_t)nn, sizeof *names, by_name);
    int cap = 1 << 18, len = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)cap);
    static char text[1 << 19];
    for (int f = 0; f < nn; f++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, names[f]);
        FILE *fp = fopen(path, "r");
        free(names[f]);
        if (!fp) continue;
        size_t l = fread(text, 1, sizeof text - 1, fp);
        fclose(fp);
        text[l] = 0;
        int k = md_tok_encode(t, text, l, 0, 0, ids + len, cap - len);
        if (k > 0) len += k < cap - len ? k : cap - len;
    }
    *n = len;
    return ids;
}

typedef struct cfg {
    const char *model;
    int seqs, ctx, gen, budget, threads, dense_layers, idle, chunk, slices;
    double hot, host;
} cfg;

/* One mode: ingest, serve, print a line. */
static int run_mode(const cfg *c, en_model *m, const int32_t *text, int n_text, size_t pb)
{
    const int pt = 16, np = c->ctx / pt;
    const size_t all = (size_t)c->seqs * (size_t)(np + 2) * pb;
    char dir[] = "/tmp/kvmesh_longmem_XXXXXX";
    en_engine_opts o = {.n_threads = c->threads,
                        .max_batch_tokens = c->chunk > c->seqs ? c->chunk : c->seqs,
                        .sparse_attn = c->budget,
                        .sparse_dense_layers = c->dense_layers,
                        .sparse_idle = c->idle,
                        .sparse_slices = c->slices};
    const int limited = c->hot < 1.0;
    if (limited) {
        if (!mkdtemp(dir)) return 1;
        o.kv_bytes = (size_t)(c->hot * (double)all);
        o.kv_host_bytes = (size_t)(c->host * (double)all);
        o.kv_disk_dir = dir;
        o.kv_disk_bytes = 2 * all;
    } else {
        o.kv_bytes = all + (size_t)c->chunk * pb;
    }
    en_engine *e;
    km_errbuf err = {{0}};
    if (en_engine_create(m, &o, &e, &err)) {
        fprintf(stderr, "engine: %s\n", err.msg);
        return 1;
    }
    kv_store *kv = en_engine_kv(e);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)c->seqs * (size_t)(c->ctx + c->gen));
    km_pagehash *h = malloc(sizeof(km_pagehash) * (size_t)c->seqs * (size_t)np);
    kv_seq **q = calloc((size_t)c->seqs, sizeof *q);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)o.max_batch_tokens);
    kv_seq **bs = malloc(sizeof(kv_seq *) * (size_t)o.max_batch_tokens);
    int rc = 0;
    const double t_in = now_s(CLOCK_MONOTONIC);
    for (int k = 0; k < c->seqs && !rc; k++) {
        int32_t *s = ids + (size_t)k * (c->ctx + c->gen);
        for (int i = 0; i < c->ctx + c->gen; i++)
            s[i] = text[((size_t)k * c->ctx + (size_t)i) % (size_t)n_text];
        km_pagehash seed = km_pagehash_seed(NULL, 0, (uint64_t)k + 1, NULL, 0);
        km_pagehash_chain(seed, s, c->ctx, pt, h + (size_t)k * np, np);
        kv_seq *sq;
        if ((rc = kv_seq_create(kv, &sq))) break;
        for (int at = 0; at < c->ctx && !rc; at += c->chunk) {
            const int n = c->ctx - at < c->chunk ? c->ctx - at : c->chunk;
            for (int i = 0; i < n; i++) pos[i] = at + i, bs[i] = sq;
            en_batch b = {.n_tokens = n, .tokens = s + at, .pos = pos, .seqs = bs};
            const int r = en_engine_step(e, &b, NULL);
            if (r < 0) fprintf(stderr, "ingest %d at %d: %s\n", k, at, km_strerror(r));
            rc = r < 0;
        }
        if (!rc && kv_seq_publish(kv, sq, h + (size_t)k * np, s, c->ctx) != np) rc = 1;
        kv_seq_destroy(kv, sq);
    }
    const double ingest = now_s(CLOCK_MONOTONIC) - t_in;
    for (int k = 0; k < c->seqs && !rc; k++) {
        if ((rc = kv_seq_create(kv, &q[k]))) break;
        const int32_t *s = ids + (size_t)k * (c->ctx + c->gen);
        if (kv_seq_attach(kv, q[k], h + (size_t)k * np, s, np) != np) {
            fprintf(stderr, "sequence %d: its prefix is not all cached\n", k);
            rc = 1;
        }
    }
    kv_store_stats s0, s1;
    en_sparse_stats e0, e1;
    kv_store_stats_get(kv, &s0);
    en_engine_sparse_stats(e, &e0);
    int cold0 = 0;
    for (int k = 0; k < c->seqs && !rc; k++) cold0 += kv_seq_cold_pages(q[k]);
    const double w0 = now_s(CLOCK_MONOTONIC), c0 = now_s(CLOCK_PROCESS_CPUTIME_ID);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)c->seqs);
    uint8_t *want = malloc((size_t)c->seqs);
    memset(want, 1, (size_t)c->seqs); /* every sequence samples its next token */
    for (int g = 0; g < c->gen && !rc; g++) {
        for (int k = 0; k < c->seqs; k++) {
            tok[k] = ids[(size_t)k * (c->ctx + c->gen) + (size_t)c->ctx + (size_t)g];
            pos[k] = c->ctx + g, bs[k] = q[k];
        }
        en_batch b = {.n_tokens = c->seqs, .tokens = tok, .pos = pos, .seqs = bs, .logits = want};
        const int r = en_engine_step(e, &b, NULL);
        if (r < 0) fprintf(stderr, "decode step %d: %s\n", g, km_strerror(r));
        rc = r < 0;
    }
    const double wall = now_s(CLOCK_MONOTONIC) - w0, cpu = now_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    kv_store_stats_get(kv, &s1);
    en_engine_sparse_stats(e, &e1);
    const double toks = (double)c->seqs * c->gen;
    const double up =
        (double)(s1.promoted_bytes[KV_PROMOTE_READ] - s0.promoted_bytes[KV_PROMOTE_READ]);
    const double down = (double)(s1.held_demoted_bytes - s0.held_demoted_bytes);
    const double wanted = (double)(e1.pages_wanted - e0.pages_wanted);
    const double fetched = (double)(e1.pages_fetched - e0.pages_fetched) +
                           (double)(s1.slice_disk_reads - s0.slice_disk_reads);
    const double sliced = (double)(s1.slice_disk_bytes - s0.slice_disk_bytes);
    const double sel = (double)(e1.pages_selected - e0.pages_selected);
    const double skip = (double)(e1.pages_skipped - e0.pages_skipped);
    if (!rc)
        printf("mem seqs=%d ctx=%d budget=%d dense_layers=%d hot=%.3f host=%.3f kv_mib=%.0f "
               "hot_mib=%.0f "
               "slices=%d ingest_s=%.1f tok_s=%.2f cpu_ms_tok=%.2f up_kib_tok=%.1f "
               "slice_kib_tok=%.1f down_kib_tok=%.1f "
               "hit=%.3f read_frac=%.3f cold_start=%d hot_end_mib=%.0f in_place=%llu load=%.1f\n",
               c->seqs, c->ctx, c->budget, c->dense_layers, c->hot, limited ? c->host : 0.0,
               (double)all / 1048576.0, (double)o.kv_bytes / 1048576.0, c->slices, ingest,
               toks / wall, 1e3 * cpu / toks, up / toks / 1024.0, sliced / toks / 1024.0,
               down / toks / 1024.0, wanted > 0 ? 1.0 - fetched / wanted : 1.0,
               sel + skip > 0 ? sel / (sel + skip) : 1.0, cold0,
               (double)s1.tier[KV_TIER_HOT].bytes / 1048576.0,
               (unsigned long long)(s1.fetch_in_place - s0.fetch_in_place + s1.slice_host_reads -
                                    s0.slice_host_reads),
               bench_load1());
    for (int k = 0; k < c->seqs; k++)
        if (q[k]) kv_seq_destroy(kv, q[k]);
    en_engine_destroy(e);
    if (limited) { /* the disk tier's page files are all at its top */
        DIR *dp = opendir(dir);
        struct dirent *de;
        char p[600];
        while (dp && (de = readdir(dp))) {
            if (de->d_name[0] == '.') continue;
            snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
            unlink(p);
        }
        if (dp) closedir(dp);
        rmdir(dir);
    }
    free(tok);
    free(want);
    free(ids);
    free(h);
    free(q);
    free(pos);
    free(bs);
    return rc;
}

int main(int argc, char **argv)
{
    cfg c = {.model = bench_arg(argc, argv, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
             .seqs = atoi(bench_arg(argc, argv, "--seqs", "8")),
             .ctx = atoi(bench_arg(argc, argv, "--ctx", "2048")),
             .gen = atoi(bench_arg(argc, argv, "--gen", "48")),
             .budget = atoi(bench_arg(argc, argv, "--budget", "512")),
             .threads = atoi(bench_arg(argc, argv, "--threads", "2")),
             .dense_layers = atoi(bench_arg(argc, argv, "--dense-layers", "-1")),
             .idle = atoi(bench_arg(argc, argv, "--idle", "0")),
             .slices = atoi(bench_arg(argc, argv, "--slices", "0")),
             .chunk = 256,
             .hot = atof(bench_arg(argc, argv, "--hot", "0.25")),
             .host = atof(bench_arg(argc, argv, "--host", "0.25"))};
    bench_args_end(argc, argv, "bench_long_mem", 1);
    if (c.seqs < 1 || c.ctx < 64 || c.ctx % 16 || c.gen < 1) {
        fprintf(stderr, "bench_long_mem: --seqs >= 1, --ctx a multiple of 16, --gen >= 1\n");
        return 2;
    }
    en_model *m;
    km_errbuf err = {{0}};
    if (en_model_load(c.model, &m, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    int n_text = 0;
    int32_t *text = load_text(en_model_tokenizer(m), &n_text);
    if (n_text < c.ctx + c.gen) {
        fprintf(stderr, "bench_long_mem: the text has %d tokens\n", n_text);
        return 1;
    }
    en_engine_opts po = {.n_threads = 1, .max_batch_tokens = 16, .kv_bytes = (size_t)8 << 20};
    en_engine *pe;
    if (en_engine_create(m, &po, &pe, &err)) {
        fprintf(stderr, "engine: %s\n", err.msg);
        return 1;
    }
    const size_t pb = kv_store_page_bytes(en_engine_kv(pe));
    en_engine_destroy(pe);
    const int rc = run_mode(&c, m, text, n_text, pb);
    free(text);
    en_model_free(m);
    return rc;
}
