/*
 * bench_spec.c — the load generator of `make bench-spec` (docs/speculative.md): the same prompts
 * sent to one kvmesh-worker with speculative decoding off and on ("speculate": "off" / "auto" per
 * request), one phase after the other on the same worker.
 *
 *   bench_spec --kvmesh EP --prompts FILE [--label NAME] [--max-tokens 128] [--concurrency 1,8]
 *              [--temperature 0] [--seed 7] [--model NAME] [--mode auto|self]
 *
 * --mode self: the second phase asks for self-speculation ("speculate": "self"; the worker must
 * run --speculate self, else its requests draft from suffixes) instead of suffix drafts; the
 * result line's auto_* figures are then that mode's (mode=self says so).
 *
 * For each concurrency C: C client threads, each with its own connection, send every prompt of
 * the file in turn (client k starts at prompt k), all with speculation off, then (after every
 * client finished) all with it on, so that no batch mixes the two; tokens/s is a phase's
 * completion tokens over its wall time. Prints one line per C:
 *   "result label=... conc=C off_tok_s=X auto_tok_s=Y ratio=Y/X drafted=D accepted=A
 *    accept_rate=A/D identical=I/N failed=F off_decode_tok_s=X' auto_decode_tok_s=Y'
 *    decode_ratio=Y'/X' mean_prompt_tokens=P"
 * where the decode figures count each request's tokens after its first over the server's time
 * from its first token to its end (total_ms - ttft_ms): decode speed without the prefill, which
 * is what a long prompt's tokens/s would otherwise mostly measure.
 * Every request has its own cache_salt (tenant), so neither a cached prefix nor another
 * request's output helps either mode: drafts come from the request's own prompt and output.
 * identical counts requests whose text was byte for byte the same in both modes: speculation is
 * exact (docs/speculative.md), so anything below N is a bug, reported as "MISMATCH" lines with
 * the prompt's number and a nonzero exit status. Greedy by default; with --temperature > 0 every
 * request carries --seed, so the outputs are still fixed and still compared.
 *
 * Prompts file: one prompt per line, "\n" "\t" "\\" escapes, '#' lines skipped (the format of
 * tests/fixtures/llamacpp/prompts.txt). A benchmark prints figures; it asserts nothing about time.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/kvmesh.h"

#define BS_MAX_PROMPTS 256
#define BS_MAX_CONC    64

typedef struct bs_args {
    const char *ep, *prompts, *label, *model;
    int max_tokens;
    float temperature;
    uint64_t seed;
    int conc[8], n_conc;
    km_speculate on; /* the second phase's "speculate": auto (suffix drafts) or self */
} bs_args;

typedef struct bs_mode_sum {
    uint64_t tokens, drafted, accepted;
    uint64_t decode_tokens, prompt_tokens; /* tokens after each request's first; prompts' */
    double decode_s; /* the server's total - ttft of each request: its decode time */
} bs_mode_sum;

typedef struct bs_client {
    const bs_args *a;
    char **prompts;
    int n_prompts, first, reps, conc;
    bs_mode_sum sum[2]; /* [0] off, [1] auto */
    int same, compared, failed;
    char msg[KM_PROTO_MAX_MESSAGE + 16];
} bs_client;

static int bs_load_prompts(const char *path, char **out, int max)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int n = 0;
    while (n < max && (len = getline(&line, &cap, f)) >= 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (!len || line[0] == '#') continue;
        char *p = malloc((size_t)len + 1), *w = p;
        if (!p) break;
        for (ssize_t i = 0; i < len; i++) {
            if (line[i] == '\\' && i + 1 < len) {
                char c = line[++i];
                *w++ = c == 'n' ? '\n' : c == 't' ? '\t' : c;
            } else {
                *w++ = line[i];
            }
        }
        *w = 0;
        out[n++] = p;
    }
    free(line);
    fclose(f);
    return n;
}

static int bs_one(bs_client *c, kvm_client *k, int r, const char *prompt, km_speculate mode,
                  kvm_result *res)
{
    /* Each request its own tenant: no cached prefix and no earlier output of another request
     * helps either mode; drafts come only from the request's own prompt and output. */
    char salt[64];
    snprintf(salt, sizeof salt, "bench-spec-%d-%d-%d-%d", (int)mode, c->conc, c->first, r);
    km_msg_request q;
    kvm_request_init(&q);
    if (c->a->model) q.model = c->a->model;
    q.prompt = prompt;
    q.max_tokens = (uint32_t)c->a->max_tokens;
    q.temperature = c->a->temperature;
    q.has_seed = true;
    q.seed = c->a->seed;
    q.speculate = mode;
    q.cache_salt = salt;
    km_errbuf err = {0};
    int rc = kvm_generate(k, &q, NULL, NULL, res, &err);
    if (rc < 0 || res->error_code) {
        snprintf(c->msg, sizeof c->msg, "%.1000s", res->error_code ? res->error : err.msg);
        return -1;
    }
    bs_mode_sum *s = &c->sum[mode != KM_SPECULATE_OFF];
    s->tokens += res->completion_tokens;
    s->drafted += res->draft_tokens;
    s->accepted += res->accepted_draft_tokens;
    s->prompt_tokens += res->prompt_tokens;
    if (res->completion_tokens > 1 && res->total_ms > res->ttft_ms) {
        s->decode_tokens += res->completion_tokens - 1;
        s->decode_s += (res->total_ms - res->ttft_ms) / 1e3;
    }
    return 0;
}

static pthread_barrier_t bs_bar;

static void *bs_client_run(void *arg)
{
    bs_client *c = arg;
    kvm_client *k = NULL;
    km_errbuf err = {0};
    kvm_opts o = {.timeout_ms = 300000};
    int ok = kvm_open(c->a->ep, &o, &k, &err) == 0;
    if (!ok) {
        snprintf(c->msg, sizeof c->msg, "connect: %.900s", err.msg);
        c->failed++;
    }
    km_buf *ref = calloc((size_t)c->reps, sizeof *ref); /* the texts without speculation */
    for (int m = 0; m < 2; m++) {
        pthread_barrier_wait(&bs_bar); /* the phase starts for every client at once */
        for (int r = 0; ok && r < c->reps; r++) {
            int i = (c->first + r) % c->n_prompts;
            kvm_result res;
            if (bs_one(c, k, r, c->prompts[i], m ? c->a->on : KM_SPECULATE_OFF, &res)) {
                c->failed++;
            } else if (!m) {
                km_buf_append(&ref[r], res.text.data, res.text.len);
            } else {
                c->compared++;
                if (ref[r].len == res.text.len && !memcmp(ref[r].data, res.text.data, ref[r].len))
                    c->same++;
                else
                    fprintf(stderr, "MISMATCH prompt=%d off=%zu bytes auto=%zu bytes\n", i,
                            ref[r].len, res.text.len);
            }
            kvm_result_free(&res);
        }
        pthread_barrier_wait(&bs_bar);
    }
    for (int r = 0; r < c->reps; r++) km_buf_free(&ref[r]);
    free(ref);
    if (k) kvm_close(k);
    return NULL;
}

static int bs_level(const bs_args *a, char **prompts, int n_prompts, int conc)
{
    bs_client cl[BS_MAX_CONC];
    pthread_t th[BS_MAX_CONC];
    pthread_barrier_init(&bs_bar, NULL, (unsigned)conc + 1);
    for (int i = 0; i < conc; i++) {
        cl[i] = (bs_client){.a = a,
                            .prompts = prompts,
                            .n_prompts = n_prompts,
                            .first = i,
                            .reps = n_prompts,
                            .conc = conc}; /* every client sends every prompt once */
        pthread_create(&th[i], NULL, bs_client_run, &cl[i]);
    }
    double wall[2];
    for (int m = 0; m < 2; m++) { /* off, then auto: never both in one batch */
        pthread_barrier_wait(&bs_bar);
        uint64_t t0 = km_now_ns();
        pthread_barrier_wait(&bs_bar);
        wall[m] = (km_now_ns() - t0) / 1e9;
    }
    bs_mode_sum tot[2] = {{0}};
    int same = 0, compared = 0, failed = 0;
    for (int i = 0; i < conc; i++) {
        pthread_join(th[i], NULL);
        for (int m = 0; m < 2; m++) {
            tot[m].tokens += cl[i].sum[m].tokens;
            tot[m].drafted += cl[i].sum[m].drafted;
            tot[m].accepted += cl[i].sum[m].accepted;
            tot[m].decode_tokens += cl[i].sum[m].decode_tokens;
            tot[m].prompt_tokens += cl[i].sum[m].prompt_tokens;
            tot[m].decode_s += cl[i].sum[m].decode_s;
        }
        same += cl[i].same;
        compared += cl[i].compared;
        failed += cl[i].failed;
        if (cl[i].failed) fprintf(stderr, "bench_spec: client %d: %s\n", i, cl[i].msg);
    }
    pthread_barrier_destroy(&bs_bar);
    double off = wall[0] > 0 ? tot[0].tokens / wall[0] : 0;
    double on = wall[1] > 0 ? tot[1].tokens / wall[1] : 0;
    double doff = tot[0].decode_s > 0 ? tot[0].decode_tokens / tot[0].decode_s : 0;
    double don = tot[1].decode_s > 0 ? tot[1].decode_tokens / tot[1].decode_s : 0;
    printf("result label=%s mode=%s conc=%d requests=%d off_tok_s=%.1f auto_tok_s=%.1f ratio=%.2f "
           "off_tokens=%llu auto_tokens=%llu drafted=%llu accepted=%llu accept_rate=%.2f "
           "identical=%d/%d failed=%d off_decode_tok_s=%.1f auto_decode_tok_s=%.1f "
           "decode_ratio=%.2f mean_prompt_tokens=%.0f\n",
           a->label, km_speculate_name(a->on), conc, compared, off, on, off > 0 ? on / off : 0,
           (unsigned long long)tot[0].tokens, (unsigned long long)tot[1].tokens,
           (unsigned long long)tot[1].drafted, (unsigned long long)tot[1].accepted,
           tot[1].drafted ? (double)tot[1].accepted / (double)tot[1].drafted : 0, same, compared,
           failed, doff, don, doff > 0 ? don / doff : 0,
           compared ? (double)tot[1].prompt_tokens / compared : 0);
    fflush(stdout);
    return same == compared && !failed ? 0 : 1;
}

static void bs_usage(FILE *f)
{
    fprintf(f, "usage: bench_spec --kvmesh EP --prompts FILE [--label NAME] [--max-tokens 128]\n"
               "                  [--concurrency 1,8] [--temperature 0] [--seed 7] [--model "
               "SmolLM2-135M-Instruct]\n"
               "                  [--mode auto|self]\n"
               "Sends every prompt with speculation off and on, interleaved; prints tokens/s of\n"
               "both, the draft acceptance and how many outputs were identical (all must be).\n");
}

int main(int argc, char **argv)
{
    bs_args a = {.label = "prompts",
                 .model = "SmolLM2-135M-Instruct",
                 .max_tokens = 128,
                 .seed = 7,
                 .conc = {1, 8},
                 .n_conc = 2,
                 .on = KM_SPECULATE_AUTO};
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            bs_usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "bench_spec: %s needs a value\n", o);
            return 2;
        }
        i++;
        if (!strcmp(o, "--kvmesh"))
            a.ep = v;
        else if (!strcmp(o, "--prompts"))
            a.prompts = v;
        else if (!strcmp(o, "--label"))
            a.label = v;
        else if (!strcmp(o, "--model"))
            a.model = v;
        else if (!strcmp(o, "--mode") && (!strcmp(v, "auto") || !strcmp(v, "self")))
            a.on = !strcmp(v, "self") ? KM_SPECULATE_SELF : KM_SPECULATE_AUTO;
        else if (!strcmp(o, "--max-tokens"))
            a.max_tokens = atoi(v);
        else if (!strcmp(o, "--temperature"))
            a.temperature = strtof(v, NULL);
        else if (!strcmp(o, "--seed"))
            a.seed = strtoull(v, NULL, 10);
        else if (!strcmp(o, "--concurrency")) {
            a.n_conc = 0;
            for (char *s = (char *)v; *s && a.n_conc < 8;) {
                int c = (int)strtol(s, &s, 10);
                if (c < 1 || c > BS_MAX_CONC) {
                    fprintf(stderr, "bench_spec: concurrency in [1, %d]\n", BS_MAX_CONC);
                    return 2;
                }
                a.conc[a.n_conc++] = c;
                if (*s == ',') s++;
            }
        } else {
            fprintf(stderr, "bench_spec: unknown option %s\n", o);
            bs_usage(stderr);
            return 2;
        }
    }
    if (!a.ep || !a.prompts || a.max_tokens < 1 || a.n_conc < 1) {
        bs_usage(stderr);
        return 2;
    }
    char *prompts[BS_MAX_PROMPTS];
    int n = bs_load_prompts(a.prompts, prompts, BS_MAX_PROMPTS);
    if (n <= 0) {
        fprintf(stderr, "bench_spec: no prompts in %s\n", a.prompts);
        return 2;
    }
    int bad = 0;
    for (int i = 0; i < a.n_conc; i++) bad |= bs_level(&a, prompts, n, a.conc[i]);
    for (int i = 0; i < n; i++) free(prompts[i]);
    return bad;
}
