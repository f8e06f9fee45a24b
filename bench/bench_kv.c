/*
 * bench_kv.c — figures for the KV store (`make bench-kv`): prefix lookup and insert (publish)
 * operations per second, demotion and promotion bandwidth between tiers, and attention
 * throughput over each KV format at 1k, 4k and 16k context against f16. Prints, asserts nothing.
 *
 *   bench_kv                       everything above
 *   bench_kv --ppl FILE [--ctx 512] [--batch 16] [--kv-format f16] [--policy streaming|h2o]
 *            [--sink 1] [--window 15] [--budget 16] [--model PATH]
 *                                  perplexity with a lossy in-sequence policy (llama.cpp's
 *                                  method, as `kvmesh perplexity`), to measure its quality cost
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvshard/kvshard.h"
#include "worker/worker.h"

static double now_s(void)
{
    return km_now_ns() / 1e9;
}

static uint32_t g_r = 1;
static float frand(void)
{
    g_r = g_r * 1664525u + 1013904223u;
    return ((g_r >> 8) / 16777216.0f) * 2.0f - 1.0f;
}

/* The default model's KV shape. */
#define NL 30
#define NH 3
#define HD 64
#define PT 16

static kv_store *mk(kv_format f, size_t hot, size_t host, const char *disk, int layers)
{
    kv_config c = {.n_layers = layers,
                   .n_kv_heads = NH,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .format = f,
                   .hot_bytes = hot,
                   .host_bytes = host,
                   .disk_dir = disk,
                   .disk_bytes = (size_t)4 << 30};
    kv_store *s;
    km_errbuf err;
    if (kv_store_create(&c, &s, &err)) {
        fprintf(stderr, "bench_kv: %s\n", err.msg);
        exit(1);
    }
    return s;
}

static void fill(kv_store *s, kv_seq *q, int from, int to, int layers)
{
    static float k[NH * HD], v[NH * HD];
    if (kv_seq_reserve(s, q, to)) {
        fprintf(stderr, "bench_kv: store full\n");
        exit(1);
    }
    for (int p = from; p < to; p++)
        for (int l = 0; l < layers; l++) {
            for (int i = 0; i < NH * HD; i++) {
                k[i] = frand() * (i % 16 == 3 ? 6.0f : 1.0f);
                v[i] = frand();
            }
            kv_seq_write(s, q, l, p, k, v);
        }
}

static void bench_index(void)
{
    const int n_seq = 256, pages = 16, layers = 2;
    kv_store *s =
        mk(KN_KV_F16, (size_t)n_seq * pages * 2 * NH * 2 * PT * HD * 2 * 2, 0, NULL, layers);
    km_pagehash seed = km_pagehash_seed("bench", 5, 1, NULL, 0);
    int32_t *tok = malloc(sizeof(int32_t) * n_seq * pages * PT);
    km_pagehash *h = malloc(sizeof(km_pagehash) * n_seq * pages);
    for (int i = 0; i < n_seq * pages * PT; i++)
        tok[i] = (int32_t)(g_r = g_r * 1664525u + 1013904223u) % 49152;
    kv_seq **qs = malloc(sizeof(kv_seq *) * n_seq);
    for (int i = 0; i < n_seq; i++) {
        km_pagehash_chain(seed, tok + (size_t)i * pages * PT, pages * PT, PT, h + i * pages, pages);
        kv_seq_create(s, &qs[i]);
        fill(s, qs[i], 0, pages * PT, layers);
    }
    double t0 = now_s();
    int added = 0;
    for (int i = 0; i < n_seq; i++)
        added += kv_seq_publish(s, qs[i], h + i * pages, tok + (size_t)i * pages * PT, pages * PT);
    double t_ins = now_s() - t0;
    for (int i = 0; i < n_seq; i++) kv_seq_destroy(s, qs[i]);
    int iters = 200000, hits = 0;
    t0 = now_s();
    for (int it = 0; it < iters; it++) {
        int i = it % n_seq;
        hits += kv_store_lookup(s, h + i * pages, tok + (size_t)i * pages * PT, pages, NULL);
    }
    double t_lk = now_s() - t0;
    double t_hash0 = now_s();
    km_pagehash hh[16];
    for (int it = 0; it < iters / 10; it++)
        km_pagehash_chain(seed, tok + (size_t)(it % n_seq) * pages * PT, pages * PT, PT, hh, 16);
    double t_hash = now_s() - t_hash0;
    printf("index  insert (publish)       %9.0f pages/s   (%d pages)\n", added / t_ins, added);
    printf("index  lookup, 16-page chain  %9.0f lookups/s  %9.0f pages verified/s\n", iters / t_lk,
           (double)hits / t_lk);
    printf("index  page-hash chain        %9.0f pages/s (XXH3-128, %d tokens per page)\n",
           iters / 10 * 16 / t_hash, PT);
    free(tok);
    free(h);
    free(qs);
    kv_store_destroy(s);
}

static void bench_tiers(void)
{
    const int n_pages = 256;
    size_t pb;
    {
        kv_store *t = mk(KN_KV_F16, (size_t)64 << 20, 0, NULL, NL);
        pb = kv_store_page_bytes(t);
        kv_store_destroy(t);
    }
    char dir[] = "/tmp/bench-kv-XXXXXX";
    if (!mkdtemp(dir)) return;
    for (int disk = 0; disk < 2; disk++) {
        kv_store *s = mk(KN_KV_F16, pb * (n_pages + 8) * 2, disk ? 0 : pb * (n_pages + 8) * 2,
                         disk ? dir : NULL, NL);
        km_pagehash seed = km_pagehash_seed("bench", 5, 2, NULL, 0);
        int32_t *tok = malloc(sizeof(int32_t) * n_pages * PT);
        for (int i = 0; i < n_pages * PT; i++) tok[i] = i;
        km_pagehash *h = malloc(sizeof(km_pagehash) * n_pages);
        km_pagehash_chain(seed, tok, n_pages * PT, PT, h, n_pages);
        kv_seq *q;
        kv_seq_create(s, &q);
        fill(s, q, 0, n_pages * PT, NL);
        kv_seq_publish(s, q, h, tok, n_pages * PT);
        kv_seq_destroy(s, q);
        double t0 = now_s();
        int moved = kv_store_evict_oldest_fraction(s, 1.0);
        double t_dem = now_s() - t0;
        kv_seq_create(s, &q);
        t0 = now_s();
        int got = kv_seq_attach(s, q, h, tok, n_pages);
        double t_sub = now_s() - t0;
        kv_seq_wait_ready(s, q);
        double t_pro = now_s() - t0;
        double gb = (double)pb * moved / 1e9;
        printf("tier   hot->%-4s demote  %6.2f GB/s  (%d pages of %zu KiB%s)\n",
               disk ? "disk" : "host", gb / t_dem, moved, pb / 1024,
               disk ? ", temp file + fsync + rename each" : "");
        printf("tier   %-4s->hot promote %6.2f GB/s  (%d pages; attach returned after %.1f ms%s)\n",
               disk ? "disk" : "host", (double)pb * got / 1e9 / t_pro, got, t_sub * 1e3,
               disk ? ", checksum verified" : ", then layer by layer in the background");
        kv_seq_destroy(s, q);
        kv_store_destroy(s);
        free(tok);
        free(h);
        if (disk) { /* clean the directory */
            char cmd[128];
            snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
            if (system(cmd)) fprintf(stderr, "bench_kv: could not remove %s\n", dir);
        }
    }
}

static void bench_attention(void)
{
    const kn_ops *ops = kn_ops_best();
    const int ctxs[] = {1024, 4096, 16384};
    printf("attention  n_q=3 head_dim=64 page_tokens=16, one kv head, %s (bytes = K+V+scales)\n",
           ops->name);
    printf("  ctx   format   us/call    GB/s   tokens/us  vs f16  bytes/token(all layers)\n");
    for (int ci = 0; ci < 3; ci++) {
        int ctx = ctxs[ci];
        double f16_us = 0;
        for (int f = 0; f < KV_FORMAT_COUNT; f++) {
            kv_store *s =
                mk((kv_format)f, (size_t)ctx * 2 * NH * HD * 2 * 2 + (64 << 20), 0, NULL, 1);
            kv_seq *q;
            kv_seq_create(s, &q);
            fill(s, q, 0, ctx, 1);
            kv_seq_reserve(s, q, ctx); /* seals int4 */
            kn_kv_view v;
            kv_seq_view(s, q, 0, 0, ctx, &v);
            float qv[3 * HD], out[3 * HD];
            for (int i = 0; i < 3 * HD; i++) qv[i] = frand();
            /* The best of several short runs: the figure of an unloaded core. */
            int iters = (int)(4e5 / ctx) + 2;
            double us = 1e30;
            ops->attention(&v, HD, qv, 3, 0.125f, out);
            for (int rep = 0; rep < 15; rep++) {
                double t0 = now_s();
                for (int it = 0; it < iters; it++) ops->attention(&v, HD, qv, 3, 0.125f, out);
                double u = (now_s() - t0) / iters * 1e6;
                us = u < us ? u : us;
            }
            if (!f) f16_us = us;
            size_t unit = kv_store_format_page_bytes(s, (kv_format)f) / NH; /* one head, 1 layer */
            double bytes = (double)unit * ((ctx + PT - 1) / PT);
            printf("  %5d %-6s %9.1f %8.2f %9.1f %7.2fx %8.0f\n", ctx, kv_format_name((kv_format)f),
                   us, bytes / us / 1e3, ctx / us, f16_us / us,
                   (double)kv_store_format_page_bytes(s, (kv_format)f) / PT * NL / 1.0);
            kv_seq_destroy(s, q);
            kv_store_destroy(s);
        }
    }
    printf("  (bytes/token(all layers) is for the default model: %d layers x %d kv heads)\n", NL,
           NH);
}

/* ------------------------------------------------------------------ perplexity with a policy */

static int bench_ppl(int argc, char **argv)
{
    const char *file = NULL, *model = en_default_model_path(), *fmt = "f16", *pol = "none";
    int ctx = 512, batch = 16, sink = 1, window = 15, budget = 16, threads = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--ppl"))
            file = argv[i + 1];
        else if (!strcmp(argv[i], "--ctx"))
            ctx = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch"))
            batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv-format"))
            fmt = argv[i + 1];
        else if (!strcmp(argv[i], "--policy"))
            pol = argv[i + 1];
        else if (!strcmp(argv[i], "--sink"))
            sink = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--window"))
            window = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--budget"))
            budget = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--model"))
            model = argv[i + 1];
        else if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
    }
    kv_seq_policy policy = {0};
    if (!strcmp(pol, "streaming"))
        policy =
            (kv_seq_policy){.kind = KV_SEQ_STREAMING, .sink_pages = sink, .window_pages = window};
    else if (!strcmp(pol, "h2o"))
        policy =
            (kv_seq_policy){.kind = KV_SEQ_H2O, .window_pages = window, .budget_pages = budget};
    km_errbuf err;
    en_model *m;
    if (en_model_load(model, &m, &err)) {
        fprintf(stderr, "bench_kv: %s\n", err.msg);
        return 1;
    }
    en_engine_opts o = {.n_threads = threads, .max_batch_tokens = batch};
    if (kv_format_parse(fmt, &o.kv_format)) return 2;
    en_engine *e;
    if (en_engine_create(m, &o, &e, &err)) {
        fprintf(stderr, "bench_kv: %s\n", err.msg);
        return 1;
    }
    FILE *fp = fopen(file, "rb");
    if (!fp) return 1;
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (fread(text, 1, (size_t)len, fp) != (size_t)len) return 1;
    fclose(fp);
    const md_tokenizer *tok = en_model_tokenizer(m);
    int n_tok = md_tok_encode(tok, text, (size_t)len, 0, 0, NULL, 0);
    int32_t *ids = malloc(sizeof(int32_t) * (n_tok + 1));
    md_tok_encode(tok, text, (size_t)len, 0, 0, ids, n_tok);
    int n_chunk = n_tok / ctx, n_vocab = en_model_hparams(m)->n_vocab, first = ctx / 2;
    int32_t *chunk = malloc(sizeof(int32_t) * ctx), *pos = malloc(sizeof(int32_t) * ctx);
    kv_seq **seqs = malloc(sizeof(kv_seq *) * ctx);
    uint8_t *want = malloc(ctx);
    double nll = 0;
    long count = 0;
    kv_store *kv = en_engine_kv(e);
    for (int ch = 0; ch < n_chunk; ch++) {
        memcpy(chunk, ids + (size_t)ch * ctx, sizeof(int32_t) * ctx);
        if (md_tok_adds_bos(tok) && md_tok_bos(tok) >= 0) chunk[0] = md_tok_bos(tok);
        kv_seq *seq;
        kv_seq_create(kv, &seq);
        if (policy.kind) kv_seq_set_policy(kv, seq, &policy);
        for (int s0 = 0; s0 < ctx; s0 += batch) {
            int nb = ctx - s0 < batch ? ctx - s0 : batch;
            for (int i = 0; i < nb; i++) {
                pos[i] = s0 + i;
                seqs[i] = seq;
                want[i] = s0 + i >= first && s0 + i < ctx - 1;
            }
            en_batch b = {
                .n_tokens = nb, .tokens = chunk + s0, .pos = pos, .seqs = seqs, .logits = want};
            const float *lg;
            int n_out = en_engine_step(e, &b, &lg);
            if (n_out < 0) {
                fprintf(stderr, "bench_kv: step failed: %s\n", km_strerror(n_out));
                return 1;
            }
            int r = 0;
            for (int i = 0; i < nb; i++) {
                if (!want[i]) continue;
                nll += en_token_nll(lg + (size_t)r++ * n_vocab, n_vocab, chunk[s0 + i + 1]);
                count++;
            }
        }
        kv_seq_destroy(kv, seq);
        fprintf(stderr, "[%d]%.4f ", ch + 1, exp(nll / count));
    }
    kv_store_stats st;
    kv_store_stats_get(kv, &st);
    fprintf(stderr, "\nkv: sealed int4 pages %llu, dropped pages %llu\n",
            (unsigned long long)st.sealed_pages, (unsigned long long)st.dropped_seq_pages);
    printf("\nppl file=%s ctx=%d batch=%d kv=%s policy=%s sink=%d window=%d budget=%d "
           "PPL=%.4f\n",
           file, ctx, batch, fmt, pol, sink, window, budget, exp(nll / count));
    en_engine_destroy(e);
    en_model_free(m);
    free(text);
    free(ids);
    free(chunk);
    free(pos);
    free(seqs);
    free(want);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 2 && !strcmp(argv[1], "--ppl")) return bench_ppl(argc, argv);
    km_log_set_level(KM_LOG_WARN);
    printf("kvshard bench (%s)\n", kn_ops_best()->name);
    bench_index();
    bench_tiers();
    bench_attention();
    return 0;
}
