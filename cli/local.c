/*
 * local.c — the `kvmesh` commands that load the model in-process and need no cluster:
 *   kvmesh run        -m MODEL -p PROMPT -n N     generate text, print speeds
 *   kvmesh perplexity -m MODEL -f FILE --ctx 512  llama.cpp-compatible perplexity
 *   kvmesh bench      -m MODEL --prompt 512 ...   engine speed (make bench-engine)
 *   kvmesh tokenize   -m MODEL -p TEXT            token ids
 *   kvmesh sparse-calibrate -m MODEL -f TEXT -o FILE  sparse budget shares per (layer, kv head)
 * Every option has an environment twin (KVMESH_MODEL, KVMESH_THREADS, ...); `kvmesh CMD --help`
 * lists them with defaults. These are the only commands that link the engine (worker/worker.h).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "worker/worker.h"

typedef struct local_opts {
    const char *model;
    const char *prompt;
    const char *file;
    const char *system;
    const char *kv_format;
    const char *batches;
    int n_predict;
    int threads;
    int ctx;
    int n_batch;
    int prompt_tokens;
    int gen_tokens;
    int reps;
    int chat;
    int ignore_eos;
    int show_ids;
    int raw;
    int sparse_attn, sparse_dense_layers, sparse_window, sparse_shallow; /* en_engine_opts */
    float sparse_radius;
    const char *sparse_budgets; /* --sparse-budgets FILE: en_engine_opts.sparse_shares */
    const char *out;            /* sparse-calibrate: the shares file written */
    int probe;                  /* sparse-calibrate: tokens at the end of the text measured */
    int head_probe_from;        /* en_engine_opts.head_probe_from */
    int depth;                  /* bench: context filled before decoding */
    int chunks;                 /* perplexity: chunks scored at most (0: all) */
    en_sample_params sp;
} local_opts;

static void local_usage(const char *cmd)
{
    printf("usage: kvmesh %s [options]\n\n", cmd);
    printf("options (environment twin in brackets):\n"
           "  -m, --model PATH        GGUF model [KVMESH_MODEL] (default %s)\n"
           "  -t, --threads N         threads [KVMESH_THREADS] (default: all cores)\n"
           "      --kv-format F       f16|bf16 [KVMESH_KV_FORMAT] (default f16)\n",
           en_default_model_path());
    if (strcmp(cmd, "tokenize"))
        printf(
            "      --sparse-attn N     attend to at most N tokens per layer and kv head, in the\n"
            "                          pages whose keys may score highest (docs/sparse.md;\n"
            "                          default 0 = off, dense; 1536 recommended at 8k)\n"
            "      --sparse-dense-layers N  first layers kept dense (default 2, -1 = none)\n"
            "      --sparse-window N   recent pages always attended (default 2)\n"
            "      --sparse-shallow-attn N  those first layers attend to N tokens instead\n"
            "                          (more than --sparse-attn; default 0 = dense)\n"
            "      --sparse-radius R   weight of the key spread in a page's score (1 = Quest's\n"
            "                          upper bound; default 0 = 0.5, measured)\n"
            "      --sparse-budgets FILE  budgets per (layer, kv head) around the mean\n"
            "                          --sparse-attn, from `kvmesh sparse-calibrate` (the\n"
            "                          default model's: bench/sparse_shares_smollm2_135m.txt)\n");
    if (!strcmp(cmd, "run") || !strcmp(cmd, "tokenize"))
        printf("  -p, --prompt TEXT       the prompt (or -f FILE)\n"
               "  -f, --file PATH         read the prompt from a file\n");
    if (!strcmp(cmd, "run"))
        printf("  -n, --n-predict N       tokens to generate (default 128)\n"
               "      --chat              wrap the prompt in the model's chat template\n"
               "      --system TEXT       system message for --chat\n"
               "      --temperature T     0 = greedy (default 0.8)\n"
               "      --top-k K           (default 40, 0 = off)\n"
               "      --top-p P           (default 0.95, 1 = off)\n"
               "      --min-p P           (default 0.05, 0 = off)\n"
               "      --repeat-penalty R  (default 1.0 = off)\n"
               "      --repeat-last-n N   (default 64)\n"
               "      --presence-penalty P, --frequency-penalty P (default 0)\n"
               "      --seed S            (default fixed; same seed and prompt, same text)\n"
               "      --ignore-eos        keep generating past end-of-generation tokens\n"
               "      --ids               print the generated token ids too\n");
    if (!strcmp(cmd, "perplexity"))
        printf("  -f, --file PATH         text to score (required)\n"
               "  -c, --ctx N             context per chunk (default 512)\n"
               "  -b, --batch N           tokens per forward step (default = ctx)\n"
               "      --chunks N          score the first N chunks only (default: all)\n");
    if (!strcmp(cmd, "bench"))
        printf("      --prompt N          prefill length (default 512)\n"
               "      --gen N             decode steps (default 128)\n"
               "      --batch LIST        decode batch sizes (default 1,8,32)\n"
               "      --reps N            repetitions, median reported (default 3)\n"
               "      --depth N           context each sequence holds before decoding (default: 0\n"
               "                          at batch 1, 128 above)\n");
    if (!strcmp(cmd, "sparse-calibrate"))
        printf("  -f, --file PATH         calibration text (not the text you evaluate on)\n"
               "  -o, --out PATH          the budget-shares file written (--sparse-budgets)\n"
               "  -c, --ctx N             tokens of the text prefilled (default 4096, <= 8192)\n"
               "      --probe N           tokens at its end whose attention is measured (512)\n"
               "      --sparse-attn N     the mean budget the shares are fitted to (1024)\n");
    if (!strcmp(cmd, "tokenize"))
        printf("      --raw               do not parse special-token texts\n");
}

static int local_int(const char *s, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < -2147483647L || v > 2147483647L) return -1;
    *out = (int)v;
    return 0;
}

static int local_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || end == s) return -1;
    *out = v;
    return 0;
}

static int local_parse(const char *cmd, int argc, char **argv, local_opts *c)
{
    memset(c, 0, sizeof *c);
    c->model = en_default_model_path();
    c->n_predict = 128;
    c->ctx = 512;
    c->prompt_tokens = 512;
    c->gen_tokens = 128;
    c->reps = 3;
    c->batches = "1,8,32";
    en_sample_params_default(&c->sp);
    const char *env;
    if ((env = getenv("KVMESH_THREADS")) && local_int(env, &c->threads)) {
        fprintf(stderr, "kvmesh: KVMESH_THREADS=%s is not an integer\n", env);
        return -1;
    }
    if ((env = getenv("KVMESH_KV_FORMAT"))) c->kv_format = env;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, used = 1;
#define KM_IS(s1, s2) (!strcmp(a, s1) || !strcmp(a, s2))
        if (KM_IS("-h", "--help")) {
            local_usage(cmd);
            exit(0);
        } else if (KM_IS("--chat", "--chat"))
            c->chat = 1, used = 0;
        else if (KM_IS("--ignore-eos", "--ignore-eos"))
            c->ignore_eos = 1, used = 0;
        else if (KM_IS("--ids", "--ids"))
            c->show_ids = 1, used = 0;
        else if (KM_IS("--raw", "--raw"))
            c->raw = 1, used = 0;
        else if (!v) {
            fprintf(stderr, "kvmesh %s: unknown option or missing value: %s (see --help)\n", cmd,
                    a);
            return -1;
        } else if (KM_IS("-m", "--model"))
            c->model = v;
        else if (KM_IS("-p", "--prompt"))
            c->prompt = v;
        else if (KM_IS("-f", "--file"))
            c->file = v;
        else if (KM_IS("--system", "--system"))
            c->system = v;
        else if (KM_IS("--kv-format", "--kv-format"))
            c->kv_format = v;
        else if (KM_IS("--sparse-attn", "--sparse-attn"))
            bad = local_int(v, &c->sparse_attn) || c->sparse_attn < 0;
        else if (KM_IS("--sparse-dense-layers", "--sparse-dense-layers"))
            bad = local_int(v, &c->sparse_dense_layers) || c->sparse_dense_layers < -1;
        else if (KM_IS("--sparse-window", "--sparse-window"))
            bad = local_int(v, &c->sparse_window) || c->sparse_window < 0;
        else if (KM_IS("--sparse-shallow-attn", "--sparse-shallow-attn"))
            bad = local_int(v, &c->sparse_shallow) || c->sparse_shallow < 0;
        else if (KM_IS("--sparse-radius", "--sparse-radius"))
            bad = local_float(v, &c->sparse_radius) || !(c->sparse_radius >= 0) ||
                  c->sparse_radius > 16;
        else if (KM_IS("--sparse-budgets", "--sparse-budgets"))
            c->sparse_budgets = v;
        else if (KM_IS("-o", "--out") && !strcmp(cmd, "sparse-calibrate"))
            c->out = v;
        else if (KM_IS("--probe", "--probe") && !strcmp(cmd, "sparse-calibrate"))
            bad = local_int(v, &c->probe) || c->probe < 1;
        else if (KM_IS("--chunks", "--chunks") && !strcmp(cmd, "perplexity"))
            bad = local_int(v, &c->chunks) || c->chunks < 0;
        else if (KM_IS("--depth", "--depth") && !strcmp(cmd, "bench"))
            bad = local_int(v, &c->depth) || c->depth < 0;
        else if (KM_IS("--batch", "--batch") && !strcmp(cmd, "bench"))
            c->batches = v;
        else if (KM_IS("-n", "--n-predict"))
            bad = local_int(v, &c->n_predict);
        else if (KM_IS("-t", "--threads"))
            bad = local_int(v, &c->threads);
        else if (KM_IS("-c", "--ctx"))
            bad = local_int(v, &c->ctx);
        else if (KM_IS("-b", "--batch"))
            bad = local_int(v, &c->n_batch);
        else if (KM_IS("--prompt", "--prompt"))
            bad = local_int(v, &c->prompt_tokens);
        else if (KM_IS("--gen", "--gen"))
            bad = local_int(v, &c->gen_tokens);
        else if (KM_IS("--reps", "--reps"))
            bad = local_int(v, &c->reps);
        else if (KM_IS("--temperature", "--temp"))
            bad = local_float(v, &c->sp.temperature);
        else if (KM_IS("--top-k", "--top-k"))
            bad = local_int(v, &c->sp.top_k);
        else if (KM_IS("--top-p", "--top-p"))
            bad = local_float(v, &c->sp.top_p);
        else if (KM_IS("--min-p", "--min-p"))
            bad = local_float(v, &c->sp.min_p);
        else if (KM_IS("--repeat-penalty", "--repeat-penalty"))
            bad = local_float(v, &c->sp.repeat_penalty);
        else if (KM_IS("--repeat-last-n", "--repeat-last-n"))
            bad = local_int(v, &c->sp.repeat_last_n);
        else if (KM_IS("--presence-penalty", "--presence-penalty"))
            bad = local_float(v, &c->sp.presence_penalty);
        else if (KM_IS("--frequency-penalty", "--frequency-penalty"))
            bad = local_float(v, &c->sp.frequency_penalty);
        else if (KM_IS("--seed", "--seed")) {
            char *end;
            c->sp.seed = strtoull(v, &end, 10);
            bad = *end != 0;
        } else {
            fprintf(stderr, "kvmesh %s: unknown option %s (see --help)\n", cmd, a);
            return -1;
        }
#undef KM_IS
        if (bad) {
            fprintf(stderr, "kvmesh %s: bad value for %s: %s\n", cmd, a, v);
            return -1;
        }
        i += used;
    }
    return 0;
}

/* Loads the model and builds an engine; prints the reason and returns -1 on failure. */
static int local_open_engine(const local_opts *c, int max_batch, en_model **m, en_engine **e)
{
    km_errbuf err = {{0}};
    int rc = en_model_load(c->model, m, &err);
    if (rc) {
        fprintf(stderr, "kvmesh: %s\n", err.msg);
        if (rc == KM_EIO) fprintf(stderr, "kvmesh: hint: `make deps` fetches the default model\n");
        return -1;
    }
    en_engine_opts o = {.n_threads = c->threads,
                        .max_batch_tokens = max_batch,
                        .sparse_attn = c->sparse_attn,
                        .sparse_dense_layers = c->sparse_dense_layers,
                        .sparse_window = c->sparse_window,
                        .sparse_shallow_attn = c->sparse_shallow,
                        .sparse_radius = c->sparse_radius,
                        .head_probe_from = c->head_probe_from};
    float *shares = NULL;
    if (c->sparse_budgets && (rc = en_sparse_shares_load(c->sparse_budgets, *m, &shares, &err))) {
        fprintf(stderr, "kvmesh: %s\n", err.msg);
        return -1;
    }
    if (shares && !c->sparse_attn)
        fprintf(stderr, "kvmesh: --sparse-budgets without --sparse-attn: attention stays dense\n");
    o.sparse_shares = shares;
    if (c->kv_format && kv_format_parse(c->kv_format, &o.kv_format)) {
        fprintf(stderr, "kvmesh: unknown --kv-format %s\n", c->kv_format);
        free(shares);
        return -1;
    }
    rc = en_engine_create(*m, &o, e, &err);
    free(shares);
    if (rc) {
        fprintf(stderr, "kvmesh: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int32_t *local_tokenize(const md_tokenizer *tok, const char *text, size_t len,
                               int add_special, int parse_special, int *n_out)
{
    int n = md_tok_encode(tok, text, len, add_special, parse_special, NULL, 0);
    if (n < 0) return NULL;
    int32_t *ids = malloc(sizeof(int32_t) * (n + 1));
    if (!ids) return NULL;
    *n_out = md_tok_encode(tok, text, len, add_special, parse_special, ids, n + 1);
    return ids;
}

/* Feeds tokens [0, n) of one sequence through the engine in chunks; leaves the logits of the
 * last token in *last. */
static int local_prefill(en_engine *e, kv_seq *seq, const int32_t *ids, int n, int chunk,
                         const float **last)
{
    int32_t pos[4096];
    kv_seq *seqs[4096];
    if (chunk > 4096) chunk = 4096;
    for (int start = 0; start < n; start += chunk) {
        int len = n - start < chunk ? n - start : chunk;
        for (int i = 0; i < len; i++) pos[i] = start + i, seqs[i] = seq;
        en_batch b = {.n_tokens = len, .tokens = ids + start, .pos = pos, .seqs = seqs};
        int rc = en_engine_step(e, &b, last);
        if (rc < 0) return rc;
    }
    return 0;
}

int cli_cmd_run(int argc, char **argv)
{
    local_opts c;
    if (local_parse("run", argc - 1, argv + 1, &c)) return 2;
    size_t plen = 0;
    char *owned = NULL;
    const char *prompt = c.prompt;
    if (c.file) {
        if (!(owned = cli_read_file(c.file, &plen))) return 1;
        prompt = owned;
    }
    if (!prompt) {
        fprintf(stderr, "kvmesh run: give a prompt with -p TEXT or -f FILE\n");
        return 2;
    }
    en_model *m = NULL;
    en_engine *e = NULL;
    if (local_open_engine(&c, 512, &m, &e)) return 1;
    const md_tokenizer *tok = en_model_tokenizer(m);
    char *templated = NULL;
    if (c.chat) {
        md_chat_kind kind = en_model_chat_kind(m);
        if (kind == MD_CHAT_NONE) kind = MD_CHAT_CHATML;
        md_chat_msg msgs[2];
        int nm = 0;
        if (c.system) msgs[nm++] = (md_chat_msg){"system", c.system};
        msgs[nm++] = (md_chat_msg){"user", prompt};
        const char *defsys = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
        int need = md_chat_apply(kind, msgs, nm, 1, defsys, NULL, 0);
        templated = malloc(need + 1);
        md_chat_apply(kind, msgs, nm, 1, defsys, templated, need + 1);
        prompt = templated;
    }
    int n_prompt = 0;
    /* A rendered chat template already carries its BOS (Llama 3 writes <|begin_of_text|>). */
    int32_t *ids = local_tokenize(tok, prompt, strlen(prompt), !c.chat, 1, &n_prompt);
    if (!ids || n_prompt <= 0) {
        fprintf(stderr, "kvmesh run: the prompt tokenizes to nothing\n");
        return 1;
    }
    en_sampler *smp = NULL;
    kv_seq *seq = NULL;
    en_sampler_create(&c.sp, en_model_hparams(m)->n_vocab, &smp);
    kv_seq_create(en_engine_kv(e), &seq);
    for (int i = 0; i < n_prompt; i++) en_sampler_accept(smp, ids[i]);

    const float *logits;
    uint64_t t0 = km_now_ns();
    int rc = local_prefill(e, seq, ids, n_prompt, 512, &logits);
    uint64_t t1 = km_now_ns();
    if (rc < 0) {
        fprintf(stderr, "kvmesh run: forward failed: %s\n", km_strerror(rc));
        return 1;
    }
    md_detok dt;
    md_detok_init(&dt);
    char piece[1024];
    int n_gen = 0, pos = n_prompt;
    int32_t *gen = malloc(sizeof(int32_t) * (c.n_predict + 1));
    if (!c.chat) fwrite(prompt, 1, strlen(prompt), stdout);
    for (; n_gen < c.n_predict; n_gen++) {
        int32_t id = en_sampler_sample(smp, logits);
        if (!c.ignore_eos && md_tok_is_eog(tok, id)) break;
        gen[n_gen] = id;
        en_sampler_accept(smp, id);
        int w = md_detok_push(tok, &dt, id, piece, sizeof piece);
        if (w > 0) fwrite(piece, 1, w, stdout), fflush(stdout);
        if (n_gen + 1 == c.n_predict) {
            n_gen++;
            break;
        }
        en_batch b = {.n_tokens = 1, .tokens = &id, .pos = &pos, .seqs = &seq};
        if ((rc = en_engine_step(e, &b, &logits)) < 0) {
            fprintf(stderr, "\nkvmesh run: forward failed at position %d: %s\n", pos,
                    km_strerror(rc));
            break;
        }
        pos++;
    }
    uint64_t t2 = km_now_ns();
    int w = md_detok_flush(&dt, piece, sizeof piece);
    if (w > 0) fwrite(piece, 1, w, stdout);
    printf("\n");
    fflush(stdout); /* the text ends before the statistics line starts (stderr is unbuffered) */
    if (c.show_ids) {
        printf("ids:");
        for (int i = 0; i < n_gen; i++) printf(" %d", gen[i]);
        printf("\n");
    }
    double pp = (t1 - t0) / 1e9, tg = (t2 - t1) / 1e9;
    fprintf(stderr,
            "kvmesh run: model=%s threads=%d isa=%s prompt=%d tokens %.1f tok/s, "
            "generation=%d tokens %.1f tok/s\n",
            en_model_name(m), en_engine_threads(e), en_engine_isa(e), n_prompt,
            n_prompt / (pp > 0 ? pp : 1e-9), n_gen, n_gen / (tg > 0 ? tg : 1e-9));
    kv_seq_destroy(en_engine_kv(e), seq);
    en_sampler_destroy(smp);
    en_engine_destroy(e);
    en_model_free(m);
    free(ids);
    free(gen);
    free(templated);
    free(owned);
    return rc < 0 ? 1 : 0;
}

/* llama.cpp's perplexity: the text is cut into n_ctx-token chunks (BOS first when the model adds
 * one); each chunk is evaluated from an empty cache and only its second half is scored, so every
 * scored token sees at least n_ctx/2 tokens of context. */
int cli_cmd_perplexity(int argc, char **argv)
{
    local_opts c;
    if (local_parse("perplexity", argc - 1, argv + 1, &c)) return 2;
    if (!c.file) {
        fprintf(stderr, "kvmesh perplexity: give the text with -f FILE\n");
        return 2;
    }
    if (c.ctx < 8 || c.ctx > 8192) {
        fprintf(stderr, "kvmesh perplexity: --ctx must be in [8, 8192]\n");
        return 2;
    }
    int n_batch = c.n_batch > 0 && c.n_batch < c.ctx ? c.n_batch : c.ctx;
    size_t len;
    char *text = cli_read_file(c.file, &len);
    if (!text) return 1;
    /* As llama-perplexity reads its file: one trailing newline is dropped. */
    if (len > 0 && text[len - 1] == '\n') text[--len] = 0;
    en_model *m = NULL;
    en_engine *e = NULL;
    if (local_open_engine(&c, n_batch, &m, &e)) return 1;
    const md_tokenizer *tok = en_model_tokenizer(m);
    int n_tok = 0;
    int32_t *ids = local_tokenize(tok, text, len, 1, 0, &n_tok);
    int n_ctx = c.ctx, n_chunk = n_tok / n_ctx, n_vocab = en_model_hparams(m)->n_vocab;
    if (n_tok < 2 * n_ctx) {
        fprintf(stderr, "kvmesh perplexity: %d tokens; need at least 2 x ctx = %d (as llama.cpp)\n",
                n_tok, 2 * n_ctx);
        return 1;
    }
    if (c.chunks && c.chunks < n_chunk) n_chunk = c.chunks;
    fprintf(stderr, "kvmesh perplexity: %d tokens, %d chunks of %d, batch %d, kv %s, sparse %d\n",
            n_tok, n_chunk, n_ctx, n_batch, c.kv_format ? c.kv_format : "f16", c.sparse_attn);
    int first = n_ctx / 2;
    double nll = 0, nll2 = 0;
    long count = 0;
    int32_t *chunk = malloc(sizeof(int32_t) * n_ctx), *pos = malloc(sizeof(int32_t) * n_ctx);
    kv_seq **seqs = malloc(sizeof(kv_seq *) * n_ctx);
    uint8_t *want = malloc(n_ctx);
    uint64_t t0 = km_now_ns();
    for (int ch = 0; ch < n_chunk; ch++) {
        memcpy(chunk, ids + (size_t)ch * n_ctx, sizeof(int32_t) * n_ctx);
        if (md_tok_adds_bos(tok) && md_tok_bos(tok) >= 0) chunk[0] = md_tok_bos(tok);
        kv_seq *seq;
        kv_seq_create(en_engine_kv(e), &seq);
        for (int s = 0; s < n_ctx; s += n_batch) {
            int nb = n_ctx - s < n_batch ? n_ctx - s : n_batch;
            for (int i = 0; i < nb; i++) {
                pos[i] = s + i;
                seqs[i] = seq;
                want[i] = s + i >= first && s + i < n_ctx - 1;
            }
            en_batch b = {
                .n_tokens = nb, .tokens = chunk + s, .pos = pos, .seqs = seqs, .logits = want};
            const float *lg;
            int n_out = en_engine_step(e, &b, &lg);
            if (n_out < 0) {
                fprintf(stderr, "kvmesh perplexity: forward failed: %s\n", km_strerror(n_out));
                return 1;
            }
            int r = 0;
            for (int i = 0; i < nb; i++) {
                if (!want[i]) continue;
                double l = en_token_nll(lg + (size_t)r++ * n_vocab, n_vocab, chunk[s + i + 1]);
                nll += l;
                nll2 += l * l;
                count++;
            }
        }
        kv_seq_destroy(en_engine_kv(e), seq);
        printf("[%d]%.4f%s", ch + 1, exp(nll / count), ch + 1 < n_chunk ? "," : "\n");
        fflush(stdout);
    }
    double secs = (km_now_ns() - t0) / 1e9;
    double mean = nll / count, var = nll2 / count - mean * mean;
    double ppl = exp(mean), err = var > 0 ? ppl * sqrt(var / (count - 1)) : 0;
    printf("Final estimate: PPL = %.4f +/- %.5f\n", ppl, err);
    fprintf(stderr, "kvmesh perplexity: %.1f s, %.1f tok/s\n", secs, n_chunk * n_ctx / secs);
    free(chunk);
    free(pos);
    free(seqs);
    free(want);
    free(ids);
    free(text);
    en_engine_destroy(e);
    en_model_free(m);
    return 0;
}

/* CPU seconds the process has used (all its threads): what a step costs on a busy machine. */
static double local_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int local_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double local_median(double *v, int n)
{
    qsort(v, n, sizeof *v, local_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Speed of the engine alone, shaped like llama.cpp's benchmarks so the figures compare:
 * prefill = llama-bench pp (random tokens, one sequence, from an empty cache); decode batch 1 =
 * llama-bench tg (one token per step from position 0); decode batch B > 1 = llama-batched-bench
 * S_TG (B sequences, each with a 128-token prompt, then `gen` steps of B tokens). */
int cli_cmd_bench(int argc, char **argv)
{
    local_opts c;
    if (local_parse("bench", argc - 1, argv + 1, &c)) return 2;
    int batches[16], nb = 0;
    for (const char *p = c.batches; *p && nb < 16;) {
        batches[nb++] = atoi(p);
        while (*p && *p != ',') p++;
        if (*p == ',') p++;
    }
    int maxb = c.prompt_tokens > 128 ? c.prompt_tokens : 128;
    for (int i = 0; i < nb; i++) {
        if (batches[i] < 1 || batches[i] > 256) {
            fprintf(stderr, "kvmesh bench: batch sizes must be in [1, 256]\n");
            return 2;
        }
        if (batches[i] > maxb) maxb = batches[i];
    }
    en_model *m = NULL;
    en_engine *e = NULL;
    if (local_open_engine(&c, maxb, &m, &e)) return 1;
    int n_vocab = en_model_hparams(m)->n_vocab;
    kv_store *kv = en_engine_kv(e);
    int32_t *tok = malloc(sizeof(int32_t) * maxb), *pos = malloc(sizeof(int32_t) * maxb);
    kv_seq **seqs = malloc(sizeof(kv_seq *) * maxb);
    uint64_t rng = 42;
    for (int i = 0; i < maxb; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((rng >> 33) % n_vocab);
    }
    double times[32] = {0}, cpu[32] = {0};
    int reps = c.reps < 1 ? 1 : c.reps > 32 ? 32 : c.reps;
    const float *lg;
    fprintf(stderr, "kvmesh bench: model=%s threads=%d isa=%s sparse=%d depth=%d\n",
            en_model_name(m), en_engine_threads(e), en_engine_isa(e), c.sparse_attn, c.depth);
    /* prefill */
    for (int r = -1; r < reps; r++) {
        kv_seq *s;
        kv_seq_create(kv, &s);
        for (int i = 0; i < c.prompt_tokens; i++) pos[i] = i, seqs[i] = s;
        en_batch b = {.n_tokens = c.prompt_tokens, .tokens = tok, .pos = pos, .seqs = seqs};
        uint64_t t0 = km_now_ns();
        if (en_engine_step(e, &b, &lg) < 0) return 1;
        if (r >= 0) times[r] = (km_now_ns() - t0) / 1e9;
        kv_seq_destroy(kv, s);
    }
    printf("bench prefill tokens=%d tok_s=%.1f\n", c.prompt_tokens,
           c.prompt_tokens / local_median(times, reps));
    fflush(stdout);
    /* decode */
    for (int bi = 0; bi < nb; bi++) {
        int B = batches[bi], npp = c.depth ? c.depth : B == 1 ? 0 : 128;
        for (int r = -1; r < reps; r++) {
            kv_seq *ss[256];
            for (int j = 0; j < B; j++) {
                kv_seq_create(kv, &ss[j]);
                for (int p0 = 0; p0 < npp; p0 += maxb) { /* the depth, in steps of maxb */
                    const int n = npp - p0 < maxb ? npp - p0 : maxb;
                    for (int i = 0; i < n; i++) pos[i] = p0 + i, seqs[i] = ss[j];
                    en_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seqs = seqs};
                    if (en_engine_step(e, &b, &lg) < 0) return 1;
                }
            }
            uint64_t t0 = km_now_ns();
            const double c0 = local_cpu_s();
            for (int g = 0; g < c.gen_tokens; g++) {
                for (int j = 0; j < B; j++) pos[j] = npp + g, seqs[j] = ss[j];
                uint8_t want[256];
                memset(want, 1, sizeof want);
                en_batch b = {
                    .n_tokens = B, .tokens = tok, .pos = pos, .seqs = seqs, .logits = want};
                int rc = en_engine_step(e, &b, &lg);
                if (rc < 0) {
                    fprintf(stderr, "kvmesh bench: step failed: %s\n", km_strerror(rc));
                    return 1;
                }
            }
            if (r >= 0) times[r] = (km_now_ns() - t0) / 1e9, cpu[r] = local_cpu_s() - c0;
            for (int j = 0; j < B; j++) kv_seq_destroy(kv, ss[j]);
        }
        const double med = local_median(times, reps);
        printf("bench decode batch=%d depth=%d tok_s=%.1f step_ms=%.2f step_cpu_ms=%.2f\n", B, npp,
               (double)B * c.gen_tokens / med, 1e3 * med / c.gen_tokens,
               1e3 * local_median(cpu, reps) / c.gen_tokens);
        fflush(stdout);
    }
    free(tok);
    free(pos);
    free(seqs);
    en_engine_destroy(e);
    en_model_free(m);
    return 0;
}

int cli_cmd_tokenize(int argc, char **argv)
{
    local_opts c;
    if (local_parse("tokenize", argc - 1, argv + 1, &c)) return 2;
    size_t len = 0;
    char *owned = NULL;
    const char *text = c.prompt;
    if (c.file) {
        if (!(owned = cli_read_file(c.file, &len))) return 1;
        text = owned;
    } else if (text) {
        len = strlen(text);
    } else {
        fprintf(stderr, "kvmesh tokenize: give the text with -p TEXT or -f FILE\n");
        return 2;
    }
    km_errbuf err = {{0}};
    md_gguf *g = NULL;
    md_tokenizer *tok = NULL;
    if (md_gguf_open(c.model, &g, &err) || md_tok_create(g, &tok, &err)) {
        fprintf(stderr, "kvmesh tokenize: %s\n", err.msg);
        return 1;
    }
    int n = 0;
    int32_t *ids = local_tokenize(tok, text, len, 1, !c.raw, &n);
    for (int i = 0; i < n; i++) printf("%d%s", ids[i], i + 1 < n ? " " : "\n");
    free(ids);
    free(owned);
    md_tok_destroy(tok);
    md_gguf_close(g);
    return 0;
}

/* Pages of a mean rank curve that hold `cover` of the attention with the sink and window. */
static int local_pages_for(double local, const double *rank, int max_pages, double cover)
{
    int k = 0;
    for (double got = local; got < cover && k < max_pages; k++) got += rank[k];
    return EN_PROBE_SINK + EN_PROBE_WINDOW + k;
}

/* Measures where each (layer, kv head)'s dense attention lies over the last --probe tokens of a
 * --ctx prefix of the text, and writes the budget shares fitted to the mean --sparse-attn
 * (docs/sparse.md "Per-head budgets"). */
int cli_cmd_sparse_calibrate(int argc, char **argv)
{
    local_opts c;
    if (local_parse("sparse-calibrate", argc - 1, argv + 1, &c)) return 2;
    if (!c.file || !c.out) {
        fprintf(stderr, "kvmesh sparse-calibrate: give the text with -f FILE and -o OUT\n");
        return 2;
    }
    int ctx = c.ctx == 512 ? 4096 : c.ctx, probe = c.probe ? c.probe : 512;
    const int budget = c.sparse_attn ? c.sparse_attn : 1024;
    if (ctx < 64 || ctx > 8192 || probe >= ctx) {
        fprintf(stderr, "kvmesh sparse-calibrate: --ctx in [64, 8192], --probe below it\n");
        return 2;
    }
    size_t len;
    char *text = cli_read_file(c.file, &len);
    if (!text) return 1;
    c.sparse_attn = budget; /* the pages keep summaries: the probe ranks pages as a step would */
    c.sparse_budgets = NULL;
    c.head_probe_from = ctx - probe;
    const int n_batch = 512;
    en_model *m = NULL;
    en_engine *e = NULL;
    if (local_open_engine(&c, n_batch, &m, &e)) return 1;
    en_engine_set_sparse(e, 0); /* attention dense, measured */
    int n_tok = 0;
    int32_t *ids = local_tokenize(en_model_tokenizer(m), text, len, 1, 0, &n_tok);
    if (n_tok < ctx) {
        fprintf(stderr, "kvmesh sparse-calibrate: %s has %d tokens, fewer than --ctx %d\n", c.file,
                n_tok, ctx);
        return 1;
    }
    const en_hparams *hp = en_model_hparams(m);
    const int heads = hp->n_layers * hp->n_head_kv, pt = kv_store_page_tokens(en_engine_kv(e));
    const int max_pages = (ctx + pt - 1) / pt;
    fprintf(stderr, "kvmesh sparse-calibrate: %d tokens prefilled, the last %d measured\n", ctx,
            probe);
    int32_t pos[512];
    kv_seq *seqs[512], *seq;
    uint8_t want[512] = {0};
    kv_seq_create(en_engine_kv(e), &seq);
    for (int s = 0; s < ctx; s += n_batch) {
        const int nb = ctx - s < n_batch ? ctx - s : n_batch;
        for (int i = 0; i < nb; i++) pos[i] = s + i, seqs[i] = seq;
        en_batch b = {.n_tokens = nb, .tokens = ids + s, .pos = pos, .seqs = seqs, .logits = want};
        const float *lg;
        const int rc = en_engine_step(e, &b, &lg);
        if (rc < 0) {
            fprintf(stderr, "kvmesh sparse-calibrate: forward failed: %s\n", km_strerror(rc));
            return 1;
        }
    }
    double *local = malloc(sizeof(double) * heads);
    double *rank = malloc(sizeof(double) * heads * (size_t)max_pages);
    double *found = malloc(sizeof(double) * heads * (size_t)max_pages);
    float *shares = malloc(sizeof(float) * heads);
    en_engine_head_probe(e, max_pages, local, rank, found);
    en_sparse_shares_from_probe(local, found, heads, max_pages, (budget + pt - 1) / pt, shares);
    char note[256];
    snprintf(note, sizeof note, "calibrated on %d tokens of %s (the last %d measured), mean %d",
             ctx, c.file, probe, budget);
    FILE *f = fopen(c.out, "w");
    int rc = !f || en_sparse_shares_write(f, m, shares, note) || fclose(f) ? 1 : 0;
    if (rc) fprintf(stderr, "kvmesh sparse-calibrate: cannot write %s\n", c.out);
    /* local: mass on sink and window; pagesNN: pages that hold NN% of it at best; uniform and
     * share: the mass the summaries' ranking finds within the mean budget and the share */
    printf("layer head  local  pages90  pages95  uniform  share  found\n");
    for (int i = 0; i < heads; i++) {
        const double *r = rank + (size_t)i * max_pages, *fd = found + (size_t)i * max_pages;
        double fu = local[i], fs = local[i];
        for (int k = 0; k < max_pages; k++) {
            fu += k + EN_PROBE_SINK + EN_PROBE_WINDOW < (budget + pt - 1) / pt ? fd[k] : 0;
            fs += k + EN_PROBE_SINK + EN_PROBE_WINDOW < shares[i] ? fd[k] : 0;
        }
        printf("%5d %4d  %5.3f  %7d  %7d  %7.3f  %5.0f  %5.3f\n", i / hp->n_head_kv,
               i % hp->n_head_kv, local[i], local_pages_for(local[i], r, max_pages, 0.90),
               local_pages_for(local[i], r, max_pages, 0.95), fu, shares[i], fs);
    }
    kv_seq_destroy(en_engine_kv(e), seq);
    free(local), free(rank), free(found), free(shares), free(ids), free(text);
    en_engine_destroy(e);
    en_model_free(m);
    return rc;
}
