/*
 * bench_long_dec.c — `PART=step|passkey make bench-long` (docs/sparse.md): decoding at a long
 * context, dense vs sparse attention, every mode from the same KV. The prompt is prefilled once
 * with dense attention (the engine keeps its pages' summaries: en_engine_set_sparse), then each
 * mode decodes from it; what differs between the modes is the decode alone.
 *
 * step: --depth tokens of --text (default: the licences bench_long.sh concatenates) prefilled
 * into one sequence, copied into --batch - 1 more (each with its own pages, summarized), then
 * every mode decodes --gen steps of the whole batch (one token per sequence a step, the text's
 * next tokens, teacher forced) and the sequences are cut back to the depth; the modes take turns
 * --rounds times. Per mode: wall and CPU ms per step, and the CPU ms of the attention phases
 * (rope, K/V writes, summaries, attention: en_engine_opts.attn_timer) against the rest (the
 * matrices), with their speedups over the first mode of --budgets (0: dense, the default).
 *
 * passkey: for each of --depths depths, bench_long.sh's passkey prompt of about --ctx tokens
 * (the key at the middle of one of --depths equal slices), its tokens but the last prefilled
 * densely once, then each mode forks the sequence, steps the last prompt token and decodes 7
 * more greedily; correct when the answer starts with the key. Nothing is asserted about time.
 *
 * --shares FILE: every sparse mode spreads its budget over the (layer, kv head)s by the shares
 * of a `kvmesh sparse-calibrate` file (docs/sparse.md "Per-head budgets"), its mean the mode's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "engine/engine.h"

#define MAX_MODES 8

static double now_s(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct cfg {
    const char *model, *text, *part, *shares;
    int depth, gen, rounds, threads, ctx, depths, dense_layers, shallow;
    float radius;
    int budget[MAX_MODES], n_modes, batch[MAX_MODES], n_batches, max_batch;
} cfg;

/* The tokens of a file (BOS first, as the CLI's prompts); their count in *n. */
static int32_t *tokenize_file(const md_tokenizer *t, const char *path, int *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)len + 1);
    const size_t got = s ? fread(s, 1, (size_t)len, f) : 0;
    fclose(f);
    if (!s) return NULL;
    s[got] = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (got + 2));
    *n = ids ? md_tok_encode(t, s, got, 1, 0, ids, (int)got + 2) : 0;
    free(s);
    return ids;
}

/* Steps tokens [from, to) of sequence q through the engine in chunks of 512. */
static int prefill(en_engine *e, kv_seq *q, const int32_t *tok, int from, int to,
                   const float **logits)
{
    int32_t pos[512];
    kv_seq *seqs[512];
    for (int at = from; at < to; at += 512) {
        const int n = to - at < 512 ? to - at : 512;
        for (int i = 0; i < n; i++) pos[i] = at + i, seqs[i] = q;
        en_batch b = {.n_tokens = n, .tokens = tok + at, .pos = pos, .seqs = seqs};
        const int r = en_engine_step(e, &b, logits);
        if (r < 0) return r;
    }
    return 0;
}

/* The decode steps of every mode over the first B sequences of q, each at the depth. */
static int step_modes(const cfg *c, en_engine *e, kv_seq **q, int B, const int32_t *text)
{
    kv_store *kv = en_engine_kv(e);
    int rc = 0;
    const int D = c->depth, G = c->gen;
    double cpu[MAX_MODES] = {0}, wall[MAX_MODES] = {0}, attn[MAX_MODES] = {0};
    int32_t tok[256], pos[256];
    for (int r = 0; r < c->rounds && !rc; r++)
        for (int m = 0; m < c->n_modes && !rc; m++) {
            en_engine_set_sparse(e, c->budget[m]);
            en_sparse_stats s0, s1;
            en_engine_sparse_stats(e, &s0);
            const double w0 = now_s(CLOCK_MONOTONIC), c0 = now_s(CLOCK_PROCESS_CPUTIME_ID);
            for (int g = 0; g < G && !rc; g++) {
                for (int k = 0; k < B; k++) tok[k] = text[D + g], pos[k] = D + g;
                en_batch b = {.n_tokens = B, .tokens = tok, .pos = pos, .seqs = q};
                const int n = en_engine_step(e, &b, NULL);
                rc = n < 0 ? n : 0;
            }
            const double dc = now_s(CLOCK_PROCESS_CPUTIME_ID) - c0,
                         dw = now_s(CLOCK_MONOTONIC) - w0;
            en_engine_sparse_stats(e, &s1);
            const double da = (double)(s1.attn_ns - s0.attn_ns) * 1e-9;
            for (int k = 0; k < B; k++) kv_seq_truncate(kv, q[k], D);
            cpu[m] += dc, wall[m] += dw, attn[m] += da;
            printf("step round=%d depth=%d batch=%d sparse=%d step_ms=%.2f step_cpu_ms=%.2f "
                   "attn_cpu_ms=%.2f rest_cpu_ms=%.2f load=%.1f\n",
                   r, D, B, c->budget[m], dw * 1e3 / G, dc * 1e3 / G, da * 1e3 / G,
                   (dc - da) * 1e3 / G, bench_load1());
            fflush(stdout);
        }
    const double n = (double)c->rounds * G;
    for (int m = 0; m < c->n_modes && !rc; m++)
        printf("step depth=%d batch=%d sparse=%d step_cpu_ms=%.2f attn_cpu_ms=%.2f "
               "rest_cpu_ms=%.2f step_ms=%.2f step_speedup=%.2f attn_speedup=%.2f\n",
               D, B, c->budget[m], cpu[m] * 1e3 / n, attn[m] * 1e3 / n,
               (cpu[m] - attn[m]) * 1e3 / n, wall[m] * 1e3 / n, cpu[0] / cpu[m], attn[0] / attn[m]);
    return rc;
}

static int part_step(const cfg *c, en_engine *e, const md_tokenizer *tk, const en_hparams *hp)
{
    kv_store *kv = en_engine_kv(e);
    int n_text = 0;
    int32_t *text = tokenize_file(tk, c->text, &n_text);
    if (!text || n_text < c->depth + c->gen) {
        fprintf(stderr, "bench_long_dec: %s has %d tokens, fewer than depth + gen\n", c->text,
                n_text);
        free(text);
        return 1;
    }
    kv_seq *q[256] = {0};
    int rc = 0, B = c->max_batch, D = c->depth;
    for (int k = 0; k < B && !rc; k++) rc = kv_seq_create(kv, &q[k]);
    en_engine_set_sparse(e, 0);
    const double t0 = now_s(CLOCK_MONOTONIC);
    if (!rc) rc = prefill(e, q[0], text, 0, D, NULL);
    for (int k = 1; k < B && !rc; k++) { /* own pages, same KV; summarized as the engine does */
        rc = en_blend_copy(e, q[0], 0, q[k], 0, D);
        for (int l = 0; !rc && l < hp->n_layers; l++)
            for (int p = 15; p < D; p += 16) kv_seq_summarize(kv, q[k], l, p);
    }
    fprintf(stderr, "bench_long_dec: depth %d prefilled and copied %d times in %.1f s\n", D, B - 1,
            now_s(CLOCK_MONOTONIC) - t0);
    for (int i = 0; i < c->n_batches && !rc; i++) rc = step_modes(c, e, q, c->batch[i], text);
    for (int k = 0; k < B; k++)
        if (q[k]) kv_seq_destroy(kv, q[k]);
    free(text);
    return rc != 0;
}

/* bench_long.sh's passkey prompt: the filler with the key at permille/1000 of it, the question. */
static char *passkey_prompt(int tokens, int permille, int key)
{
    static const char fill[] = "The grass is green. The sky is blue. The sun is yellow. Here we "
                               "go. There and back again. ";
    const int reps = tokens / 25, at = tokens / 25 * permille / 1000;
    char *s = malloc((size_t)reps * sizeof fill + 512), *p = s;
    if (!s) return NULL;
    p += sprintf(p, "There is an important info hidden inside a lot of irrelevant text. Find it "
                    "and memorize it. I will quiz you about the important information there.\n");
    for (int i = 0; i < reps; i++) {
        if (i == at)
            p += sprintf(p, "The pass key is %d. Remember it. %d is the pass key. ", key, key);
        p += sprintf(p, "%s", fill);
    }
    sprintf(p, "\nWhat is the pass key? The pass key is");
    return s;
}

static int32_t argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int part_passkey(const cfg *c, en_engine *e, const md_tokenizer *tk, const en_hparams *hp)
{
    kv_store *kv = en_engine_kv(e);
    int ok[MAX_MODES] = {0}, rc = 0;
    for (int j = 0; j < c->depths && !rc; j++) {
        const int key = (j * 7919 + 10007) % 90000 + 10000;
        char *pr = passkey_prompt(c->ctx, (2 * j + 1) * 500 / c->depths, key);
        int32_t *ids = pr ? malloc(sizeof(int32_t) * (strlen(pr) + 2)) : NULL;
        const int n = ids ? md_tok_encode(tk, pr, strlen(pr), 1, 0, ids, (int)strlen(pr) + 2) : 0;
        kv_seq *p = NULL;
        rc = n < 2 ? 1 : kv_seq_create(kv, &p);
        en_engine_set_sparse(e, 0);
        if (!rc) rc = prefill(e, p, ids, 0, n - 1, NULL);
        printf("passkey ctx=%d tokens=%d depth=%d/%d key=%d", c->ctx, n, j + 1, c->depths, key);
        for (int m = 0; m < c->n_modes && !rc; m++) {
            kv_seq *f = NULL;
            if ((rc = kv_seq_fork(kv, p, &f))) break;
            en_engine_set_sparse(e, c->budget[m]);
            const float *logits;
            char out[256] = "";
            size_t len = 0;
            md_detok dt;
            md_detok_init(&dt);
            int32_t t = ids[n - 1], pos = n - 1;
            for (int g = 0; g < 8 && !rc; g++, pos++) {
                en_batch b = {.n_tokens = 1, .tokens = &t, .pos = &pos, .seqs = &f};
                const int r = en_engine_step(e, &b, &logits);
                if (r < 0) {
                    rc = r;
                    break;
                }
                t = argmax(logits, hp->n_vocab);
                len += (size_t)md_detok_push(tk, &dt, t, out + len, (int)(sizeof out - 1 - len));
            }
            len += (size_t)md_detok_flush(&dt, out + len, (int)(sizeof out - 1 - len));
            out[len] = 0;
            char want[16];
            snprintf(want, sizeof want, " %d", key);
            const int hit = !strncmp(out, want, strlen(want));
            ok[m] += hit;
            printf(" sparse%d=%s", c->budget[m], hit ? "ok" : "miss");
            kv_seq_destroy(kv, f);
        }
        printf("\n");
        fflush(stdout);
        if (p) kv_seq_destroy(kv, p);
        free(ids);
        free(pr);
    }
    for (int m = 0; m < c->n_modes && !rc; m++)
        printf("passkey ctx=%d sparse=%d correct=%d/%d\n", c->ctx, c->budget[m], ok[m], c->depths);
    return rc != 0;
}

int main(int argc, char **argv)
{
    cfg c = {.model = en_default_model_path(),
             .text = "/tmp/kvmesh-long.txt",
             .part = "step",
             .depth = 8192,
             .gen = 16,
             .rounds = 2,
             .threads = 1,
             .ctx = 8192,
             .depths = 20};
    const char *budgets = "0,512,1024,2048", *batches = "1";
    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            printf("usage: bench_long_dec [option value]... (options: the file's head)\n");
            return 0;
        }
        if (!v) {
            fprintf(stderr, "bench_long_dec: no value for %s\n", k);
            return 2;
        }
        if (!strcmp(k, "--model"))
            c.model = v;
        else if (!strcmp(k, "--text"))
            c.text = v;
        else if (!strcmp(k, "--part"))
            c.part = v;
        else if (!strcmp(k, "--budgets"))
            budgets = v;
        else if (!strcmp(k, "--depth"))
            c.depth = atoi(v);
        else if (!strcmp(k, "--batch"))
            batches = v;
        else if (!strcmp(k, "--gen"))
            c.gen = atoi(v);
        else if (!strcmp(k, "--rounds"))
            c.rounds = atoi(v);
        else if (!strcmp(k, "--threads"))
            c.threads = atoi(v);
        else if (!strcmp(k, "--ctx"))
            c.ctx = atoi(v);
        else if (!strcmp(k, "--depths"))
            c.depths = atoi(v);
        else if (!strcmp(k, "--dense-layers"))
            c.dense_layers = atoi(v);
        else if (!strcmp(k, "--shallow"))
            c.shallow = atoi(v);
        else if (!strcmp(k, "--radius"))
            c.radius = (float)atof(v);
        else if (!strcmp(k, "--shares"))
            c.shares = v;
        else {
            fprintf(stderr, "bench_long_dec: unknown option %s (see the file's head)\n", k);
            return 2;
        }
    }
    for (const char *p = budgets; *p && c.n_modes < MAX_MODES; p += strcspn(p, ","), p += !!*p)
        c.budget[c.n_modes++] = atoi(p);
    for (const char *p = batches; *p && c.n_batches < MAX_MODES; p += strcspn(p, ","), p += !!*p) {
        c.batch[c.n_batches] = atoi(p);
        if (c.batch[c.n_batches] < 1 || c.batch[c.n_batches] > 256) c.max_batch = 257;
        if (c.batch[c.n_batches] > c.max_batch) c.max_batch = c.batch[c.n_batches];
        c.n_batches++;
    }
    int top = 0;
    for (int m = 0; m < c.n_modes; m++) top = c.budget[m] > top ? c.budget[m] : top;
    if (c.max_batch < 1 || c.max_batch > 256 || c.gen < 1 || c.depth < 16 || !top) {
        fprintf(stderr, "bench_long_dec: --batch sizes in [1, 256], --budgets holding a sparse "
                        "one (0: dense)\n");
        return 2;
    }
    en_model *m;
    km_errbuf err;
    if (en_model_load(c.model, &m, &err)) {
        fprintf(stderr, "bench_long_dec: %s\n", err.msg);
        return 1;
    }
    const en_hparams *hp = en_model_hparams(m);
    const int ctx = (!strcmp(c.part, "step") ? c.depth + c.gen : c.ctx + 64) + 16;
    const size_t tok_bytes = (size_t)hp->n_layers * hp->n_head_kv * hp->head_dim * 2 * 2;
    const int seqs = !strcmp(c.part, "step") ? c.max_batch : 2;
    float *shares = NULL;
    if (c.shares && en_sparse_shares_load(c.shares, m, &shares, &err)) {
        fprintf(stderr, "bench_long_dec: %s\n", err.msg);
        en_model_free(m);
        return 1;
    }
    en_engine_opts o = {.n_threads = c.threads,
                        .kv_bytes = tok_bytes * (size_t)ctx * (size_t)seqs * 5 / 4,
                        .sparse_attn = top,
                        .sparse_dense_layers = c.dense_layers,
                        .sparse_shallow_attn = c.shallow,
                        .sparse_radius = c.radius,
                        .sparse_shares = shares,
                        .attn_timer = 1};
    en_engine *e;
    const int crc = en_engine_create(m, &o, &e, &err);
    free(shares);
    if (crc) {
        fprintf(stderr, "bench_long_dec: %s\n", err.msg);
        en_model_free(m);
        return 1;
    }
    printf("cpu threads=%d isa=%s model=%s load=%.1f shares=%s\n", c.threads, en_engine_isa(e),
           en_model_name(m), bench_load1(), c.shares ? c.shares : "uniform");
    const md_tokenizer *tk = en_model_tokenizer(m);
    const int rc = !strcmp(c.part, "step") ? part_step(&c, e, tk, hp) : part_passkey(&c, e, tk, hp);
    en_engine_destroy(e);
    en_model_free(m);
    return rc;
}
