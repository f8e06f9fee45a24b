/*
 * bench_blend.c — `make bench-blend`: chunk reuse (engine/blend.c, docs/blend.md) on a RAG-style
 * set, in the engine (no sockets), one request at a time.
 *
 * Documents: --docs slices of 300 to 1,000 tokens, one from the middle of each text of
 * /usr/share/common-licenses and of a few of /usr/share/doc, in turn. Each prompt is a system line
 * (one page), 4 to 8 of those documents in a shuffled order (documents come back across prompts),
 * and a question asking to repeat a passage of one of them: its first 8 tokens are given, the
 * reference continuation is the next 32 (a copy from the context, which only attention to the
 * reused KV can make likely). Modes, each on a fresh engine over the same prompts:
 *   full     every prompt token computed;
 *   prefix   prefix caching (verified page chains, as the scheduler does): only the system line
 *            comes back at the same position;
 *   blend f  the documents were cached at ingestion (timed apart), each after the system line
 *            (--preamble); each prompt attaches its documents' pages, re-rotates them and
 *            recomputes with fraction f, the last document in full ("f r": reused too), as
 *            the scheduler does: the last document is then not attached; the first, right
 *            after the system line it was computed after, is exact and taken as a prefix
 *            (--exact-first 0: repaired like the others).
 * Per mode: TTFT (the prefill up to the first token's logits) p50/p90, tokens reused and
 * recomputed, the perplexity of the reference continuations (teacher-forced after the prompt),
 * and greedy agreement with full (of the first 32 greedy tokens: how many before the first
 * difference, and how many equal position by position); --verbose 1: per prompt too.
 * --interleave 1 runs each prompt through every mode in turn (every mode's engine open), so that
 * on a shared machine the modes' times see the same load. Nothing is asserted about time.
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "engine/engine.h"

#define MAX_DOCS    32
#define MAX_PROMPT  8448
#define MAX_SEG     8
#define N_REF       32
#define N_CUE       8
#define N_GREEDY    32
#define MAX_MODES   10
#define MAX_PROMPTS 64

typedef struct doc {
    int32_t *ids;
    int n;
} doc;

typedef struct prompt {
    int32_t ids[MAX_PROMPT + N_REF];
    int n; /* prompt tokens; the reference follows at ids[n] */
    en_blend_seg seg[MAX_SEG];
    int doc[MAX_SEG], n_seg, src_seg;
    int32_t greedy[N_GREEDY];
} prompt;

#define SYS_LINE                                                                                   \
    "<|im_start|>system\nAnswer the question from the documents below, quoting them.<|im_end|>\n"
static int g_probe, g_max_docs = MAX_SEG, g_verbose, g_exact;
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

static int32_t g_sys[64];
static int g_nsys;

static int encode(const md_tokenizer *t, const char *s, int32_t *out, int max)
{
    int n = md_tok_encode(t, s, strlen(s), 0, 1, out, max);
    return n < 0 ? 0 : n < max ? n : max;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Prose from /usr/share/doc (skipped where absent), taken in turn with the licences. */
static const char *const k_doc_files[] = {
    "/usr/share/doc/dpkg/spec/triggers.txt",
    "/usr/share/doc/git/contrib/subtree/git-subtree.txt",
    "/usr/share/doc/dpkg/spec/rootless-builds.txt",
    "/usr/share/doc/gcc-12-base/README.Bugs",
    "/usr/share/doc/git/RelNotes/2.28.0.txt",
    "/usr/share/doc/git/RelNotes/2.33.0.txt",
    "/usr/share/doc/git/RelNotes/2.36.0.txt",
    "/usr/share/doc/git/RelNotes/2.0.0.txt",
};

/* One slice of 300 to 1,000 tokens from the middle of each file, licences and /usr/share/doc
 * files alternating, in a fixed order. */
static int load_docs(const md_tokenizer *t, int want, doc *d)
{
    const char *dir = "/usr/share/common-licenses";
    char *lic[64] = {0}, *paths[96];
    int nl = 0, np = 0;
    DIR *dp = opendir(dir);
    struct dirent *de;
    while (dp && (de = readdir(dp)) && nl < 64)
        if (de->d_name[0] != '.') {
            char path[512];
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            lic[nl++] = strdup(path);
        }
    if (dp) closedir(dp);
    qsort(lic, (size_t)nl, sizeof *lic, by_name);
    const int nf = (int)(sizeof k_doc_files / sizeof k_doc_files[0]);
    for (int i = 0; i < nl || i < nf; i++) {
        if (i < nl) paths[np++] = lic[i];
        if (i < nf) paths[np++] = (char *)k_doc_files[i];
    }
    int nd = 0;
    static int32_t buf[1 << 17];
    static char text[1 << 19];
    for (int f = 0; f < np && nd < want; f++) {
        FILE *fp = fopen(paths[f], "r");
        if (!fp) continue;
        size_t len = fread(text, 1, sizeof text - 1, fp);
        fclose(fp);
        text[len] = 0;
        const int n = encode(t, text, buf, (int)(sizeof buf / sizeof buf[0]));
        const int dl = 300 + (int)(rnd() % 701), at = n / 3;
        if (at + dl > n) continue;
        d[nd].ids = malloc(sizeof(int32_t) * dl);
        memcpy(d[nd].ids, buf + at, sizeof(int32_t) * dl);
        d[nd++].n = dl;
    }
    for (int i = 0; i < nl; i++) free(lic[i]);
    return nd;
}

static void build_prompt(const md_tokenizer *t, const doc *d, int nd, prompt *p)
{
    int k = 4 + (int)(rnd() % 5), pick[MAX_SEG];
    if (k > g_max_docs) k = g_max_docs;
    for (int i = 0; i < k; i++) {
        int again;
        do {
            pick[i] = (int)(rnd() % nd), again = 0;
            for (int j = 0; j < i; j++) again |= pick[j] == pick[i];
        } while (again);
    }
    memcpy(p->ids, g_sys, sizeof(int32_t) * g_nsys);
    p->n = g_nsys;
    p->n_seg = 0;
    for (int i = 0; i < k; i++) {
        if (p->n_seg && p->n + d[pick[i]].n + 200 > MAX_PROMPT) break;
        memcpy(p->ids + p->n, d[pick[i]].ids, sizeof(int32_t) * d[pick[i]].n);
        p->seg[p->n_seg] = (en_blend_seg){p->n, d[pick[i]].n};
        p->doc[p->n_seg++] = pick[i];
        p->n += d[pick[i]].n;
    }
    /* the passage: somewhere in one of the documents */
    const int s = p->n_seg > 1 ? (int)(rnd() % (uint32_t)p->n_seg) : 0;
    const doc *src = &d[p->doc[s]];
    p->src_seg = s;
    const int at = (int)(rnd() % (src->n - N_CUE - N_REF));
    p->n += encode(t,
                   "\nQuestion: repeat, word for word, the passage that starts as follows. "
                   "Answer:",
                   p->ids + p->n, 64);
    memcpy(p->ids + p->n, src->ids + at, sizeof(int32_t) * N_CUE);
    p->n += N_CUE;
    memcpy(p->ids + p->n, src->ids + at + N_CUE, sizeof(int32_t) * N_REF);
}

typedef struct result {
    double ttft[MAX_PROMPTS], nll, ingest_ms, nll_p[MAX_PROMPTS];
    long reused, recomputed, computed, token_layers, n_nll;
    int agree_prefix, agree_pos;
} result;

/* The reference's NLL after the prompt, then N_GREEDY greedy tokens, from the prompt's logits. */
static int continue_prompt(en_engine *e, kv_seq *q, prompt *p, int ip, const float *last, int nv,
                           result *r, int32_t *greedy)
{
    float *row = malloc(sizeof(float) * nv);
    memcpy(row, last, sizeof(float) * nv);
    const double nll0 = r->nll;
    r->nll += en_token_nll(row, nv, p->ids[p->n]);
    int32_t pos[N_REF];
    kv_seq *seqs[N_REF];
    uint8_t want[N_REF];
    for (int i = 0; i < N_REF - 1; i++) pos[i] = p->n + i, seqs[i] = q, want[i] = 1;
    en_batch b = {
        .n_tokens = N_REF - 1, .tokens = p->ids + p->n, .pos = pos, .seqs = seqs, .logits = want};
    const float *lg;
    int rc = en_engine_step(e, &b, &lg);
    if (rc < 0) {
        free(row);
        return rc;
    }
    for (int i = 0; i < N_REF - 1; i++)
        r->nll += en_token_nll(lg + (size_t)i * nv, nv, p->ids[p->n + 1 + i]);
    r->n_nll += N_REF;
    r->nll_p[ip] = r->nll - nll0;
    kv_seq_truncate(en_engine_kv(e), q, p->n);
    int32_t tok = en_argmax(row, nv);
    for (int i = 0; i < N_GREEDY; i++) {
        greedy[i] = tok;
        const int32_t ps = p->n + i;
        en_batch g = {.n_tokens = 1, .tokens = &tok, .pos = &ps, .seqs = &q};
        if ((rc = en_engine_step(e, &g, &lg)) < 0) break;
        tok = en_argmax(lg, nv);
    }
    free(row);
    return rc < 0 ? rc : 0;
}

/* One mode on its own engine: fraction < 0 is full (-1) or prefix (-2). */
typedef struct mode_run {
    en_engine *e;
    km_pagehash tenant;
    en_blend_key key;
    float fraction;
    int reuse_last, nv;
} mode_run;

static int mode_open(const en_model *m, int threads, const doc *d, int nd, float fraction,
                     int reuse_last, const int32_t *pre, mode_run *mr, result *r)
{
    en_engine_opts o = {.n_threads = threads, .max_batch_tokens = 512, .kv_bytes = (size_t)1 << 30};
    km_errbuf err = {{0}};
    memset(mr, 0, sizeof *mr);
    if (en_engine_create(m, &o, &mr->e, &err)) {
        fprintf(stderr, "bench_blend: %s\n", err.msg);
        return -1;
    }
    const int pt = kv_store_page_tokens(en_engine_kv(mr->e));
    mr->tenant = km_pagehash_seed(NULL, 0, 1, NULL, 0);
    mr->key = (en_blend_key){en_blend_chunk_seed(mr->tenant), pre,
                             pre ? (pre == g_sys ? g_nsys : pt) : 0};
    mr->fraction = fraction, mr->reuse_last = reuse_last;
    mr->nv = en_model_hparams(m)->n_vocab;
    memset(r, 0, sizeof *r);
    int rc = 0;
    if (fraction >= 0) { /* ingestion: every document cached alone */
        const uint64_t t0 = km_now_ns();
        for (int i = 0; i < nd && !rc; i++)
            rc = en_blend_chunk_store(mr->e, &mr->key, d[i].ids, d[i].n);
        r->ingest_ms = (double)(km_now_ns() - t0) / 1e6;
    }
    return rc;
}

/* Prompt i of the mode: TTFT, then the reference's NLL and the greedy tokens. */
static int mode_prompt(mode_run *mr, prompt *p, int i, result *r, int32_t *greedy)
{
    en_engine *e = mr->e;
    kv_store *kv = en_engine_kv(e);
    const km_pagehash tenant = mr->tenant;
    const en_blend_key key = mr->key;
    const float fraction = mr->fraction;
    const int reuse_last = mr->reuse_last, nv = mr->nv, pt = kv_store_page_tokens(kv);
    int rc = 0;
    static km_pagehash h[MAX_PROMPT / 16 + 1];
    {
        kv_seq *q, *c[MAX_SEG] = {0};
        if ((rc = kv_seq_create(kv, &q))) return rc;
        const uint64_t t0 = km_now_ns();
        int done = 0;
        const int nh = km_pagehash_chain(tenant, p->ids, p->n - 1, pt, h, MAX_PROMPT / 16 + 1);
        if (fraction != -1) done = kv_seq_attach(kv, q, h, p->ids, nh) * pt;
        if (done < 0) done = 0;
        en_blend_seg seg[MAX_SEG];
        int ns = 0;
        /* as the scheduler: the last document, computed in full unless reuse_last, is not
         * attached; a document right after the preamble it was computed after, at the position
         * it was computed at, is exact, as a prefix */
        const int n_seg = reuse_last ? p->n_seg : p->n_seg - 1;
        for (int s = 0; fraction >= 0 && s < n_seg && !rc; s++) {
            if (p->seg[s].start < done) continue;
            const int held =
                en_blend_chunk_attach(e, &key, p->ids + p->seg[s].start, p->seg[s].n, &c[s]);
            if (held <= 0) continue;
            rc = en_blend_copy(e, c[s], key.n_pre, q, p->seg[s].start, held);
            if (g_exact && p->seg[s].start == done && done == key.n_pre && key.pre == g_sys)
                done += held;
            else
                seg[ns++] = (en_blend_seg){p->seg[s].start, held};
        }
        const en_blend_opts bo = {
            .fraction = fraction > 0 ? fraction : 0, .probe_layer = g_probe, .reuse_last = 1};
        en_blend_stats st;
        const float *lg = NULL;
        if (!rc) rc = en_blend_prefill(e, q, p->ids, p->n, done, seg, ns, &bo, &st, &lg);
        r->ttft[i] = (double)(km_now_ns() - t0) / 1e6;
        if (rc) return rc;
        r->reused += st.reused + done, r->recomputed += st.recomputed;
        r->computed += st.computed, r->token_layers += st.token_layers;
        /* blended pages are not what full recomputation gives: only those before the first
         * reused chunk are published as a prefix */
        const int exact = fraction == -2 ? nh : ns ? seg[0].start / pt : nh;
        if (fraction != -1) kv_seq_publish(kv, q, h, p->ids, exact * pt);
        for (int s = 0; s < p->n_seg; s++)
            if (c[s]) kv_seq_destroy(kv, c[s]);
        rc = continue_prompt(e, q, p, i, lg, nv, r, greedy);
        kv_seq_destroy(kv, q);
    }
    return rc;
}

int main(int argc, char **argv)
{
    const char *model = bench_arg(argc, argv, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    const int threads = atoi(bench_arg(argc, argv, "--threads", "2"));
    const int quick = atoi(bench_arg(argc, argv, "--quick", "0"));
    int np = atoi(bench_arg(argc, argv, "--prompts", "8"));
    const int want_docs = atoi(bench_arg(argc, argv, "--docs", "16"));
    const char *fr =
        bench_arg(argc, argv, "--fractions", quick ? "0r,0.15" : "0r,0,0.15,0.3,0.5,0.15r");
    if (quick && np > 2) np = 2;
    g_max_docs = quick ? 4 : MAX_SEG;
    const int use_pre = atoi(bench_arg(argc, argv, "--preamble", "2"));
    const int probe = atoi(bench_arg(argc, argv, "--probe", "0"));
    g_probe = probe;
    g_verbose = atoi(bench_arg(argc, argv, "--verbose", "0"));
    g_exact = atoi(bench_arg(argc, argv, "--exact-first", "1"));
    const int inter = atoi(bench_arg(argc, argv, "--interleave", "0"));
    bench_args_end(argc, argv, "bench_blend", 1);
    if (np > MAX_PROMPTS) np = MAX_PROMPTS;
    en_model *m;
    km_errbuf err = {{0}};
    if (en_model_load(model, &m, &err)) {
        fprintf(stderr, "bench_blend: %s\n", err.msg);
        return 1;
    }
    const md_tokenizer *t = en_model_tokenizer(m);
    static doc d[MAX_DOCS];
    const int nd = load_docs(t, want_docs < MAX_DOCS ? want_docs : MAX_DOCS, d);
    if (nd < 6) {
        fprintf(stderr, "bench_blend: only %d documents from /usr/share\n", nd);
        return 1;
    }
    /* what chunks are computed after: the prompts' system line (--preamble 2), a page of a
     * neutral line (1) or nothing (0) */
    int32_t pre[64];
    const int n_pre = encode(t,
                             "The text below is one of several documents retrieved for the "
                             "question that follows them all.",
                             pre, 64);
    if (n_pre < 16) return 1;
    g_nsys = encode(t, SYS_LINE, g_sys, 64);
    const int32_t *pre_ids = pre;
    if (use_pre == 2) {
        if (g_nsys % 16) return 1;
        pre_ids = g_sys;
    }
    prompt *ps = calloc((size_t)np, sizeof *ps);
    long tokens = 0;
    for (int i = 0; i < np; i++) build_prompt(t, d, nd, &ps[i]), tokens += ps[i].n;
    float modes[MAX_MODES] = {-1, -2};
    int nm = 2, last[MAX_MODES] = {0};
    for (const char *s = fr; *s && nm < MAX_MODES;) {
        modes[nm++] = strtof(s, (char **)&s);
        if (*s == 'r') last[nm - 1] = 1, s++;
        if (*s == ',')
            s++;
        else if (*s)
            break;
    }
    printf("bench_blend: %s, %d threads, %d documents, %d prompts (%ld tokens, mean %ld), "
           "chunks computed after: %s, load %.2f\n",
           en_model_name(m), threads, nd, np, tokens, tokens / np,
           use_pre == 2 ? "the system line"
           : use_pre    ? "a neutral page"
                        : "nothing",
           bench_load1());
    printf("%-12s %9s %9s %8s %10s %10s %12s %8s %9s %9s %9s\n", "mode", "ttft_p50", "ttft_p90",
           "speedup", "reused", "recomputed", "token_layers", "ppl", "ppl_vs", "agree_pre",
           "agree_pos");
    static int32_t greedy[MAX_MODES][MAX_PROMPTS][N_GREEDY];
    double full_ppl = 0, prefix_p50 = 0;
    /* --interleave 1: every mode's engine open at once, each prompt through every mode in turn,
     * so that the modes share the machine's state (its load) prompt by prompt */
    static result res[MAX_MODES];
    static mode_run mr[MAX_MODES];
    for (int k0 = 0; k0 < nm; k0 = inter ? nm : k0 + 1) {
        const int k1 = inter ? nm : k0 + 1;
        int rc = 0;
        for (int k = k0; k < k1 && !rc; k++)
            rc = mode_open(m, threads, d, nd, modes[k], last[k], use_pre ? pre_ids : NULL, &mr[k],
                           &res[k]);
        for (int i = 0; i < np && !rc; i++)
            for (int k = k0; k < k1 && !rc; k++)
                rc = mode_prompt(&mr[k], &ps[i], i, &res[k], greedy[k][i]);
        for (int k = k0; k < k1; k++)
            if (mr[k].e) en_engine_destroy(mr[k].e);
        if (rc) {
            fprintf(stderr, "bench_blend: a mode failed\n");
            return 1;
        }
    }
    for (int k = 0; k < nm; k++) {
        result r = res[k];
        int lead = 0, pos = 0;
        for (int i = 0; i < np; i++) {
            int j = 0;
            while (j < N_GREEDY && greedy[k][i][j] == greedy[0][i][j]) j++;
            lead += j;
            for (j = 0; j < N_GREEDY; j++) pos += greedy[k][i][j] == greedy[0][i][j];
        }
        const double ppl = exp(r.nll / (double)r.n_nll);
        if (k == 0) full_ppl = ppl;
        double sorted[MAX_PROMPTS]; /* bench_pct sorts: the per-prompt times stay in order */
        memcpy(sorted, r.ttft, sizeof(double) * (size_t)np);
        const double p90 = bench_pct(sorted, (size_t)np, 0.9),
                     p50 = bench_pct(sorted, (size_t)np, 0.5);
        if (k == 1) prefix_p50 = p50;
        char name[32];
        if (k == 0)
            snprintf(name, sizeof name, "full");
        else if (k == 1)
            snprintf(name, sizeof name, "prefix");
        else
            snprintf(name, sizeof name, "blend %.2f%s", modes[k], last[k] ? "r" : "");
        printf("%-12s %7.0fms %7.0fms %7.2fx %10ld %10ld %12ld %8.3f %+8.2f%% %8.1f%% %8.1f%%\n",
               name, p50, p90, k ? prefix_p50 / p50 : 0.0, r.reused, r.recomputed, r.token_layers,
               ppl, 100 * (ppl / full_ppl - 1), 100.0 * lead / (np * N_GREEDY),
               100.0 * pos / (np * N_GREEDY));
        if (k >= 2) printf("%-12s ingest %.0f ms for %d documents\n", "", r.ingest_ms, nd);
        if (g_verbose) {
            printf("%-12s per prompt (tokens, documents, passage in, ttft ms, mean nll):", "");
            for (int i = 0; i < np; i++)
                printf(" [%d %d %d/%d %.0f %.3f]", ps[i].n, ps[i].n_seg, ps[i].src_seg + 1,
                       ps[i].n_seg, r.ttft[i], r.nll_p[i] / N_REF);
            printf("\n");
        }
        fflush(stdout);
    }
    printf("speedup: prefix p50 / this p50; ppl_vs: perplexity against full's; agree_pre/pos: "
           "greedy tokens equal to full's before the first difference / by position (of %d); "
           "r: the last chunk reused too (en_blend_opts.reuse_last), else computed in full\n",
           N_GREEDY);
    for (int i = 0; i < nd; i++) free(d[i].ids);
    free(ps);
    en_model_free(m);
    return 0;
}
