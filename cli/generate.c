/*
 * generate.c — `kvmesh generate` and `kvmesh chat`: completions streamed from a router (or a
 * worker) with libkvmesh, so what they show is what any client sees. chat resends the whole
 * conversation every turn; the router sends it to the worker that holds the previous turns'
 * pages, so only the new turn is computed.
 */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"

typedef struct gen_args {
    const char *router, *model, *prompt, *file, *salt, *stop, *system;
    int64_t max_tokens, top_k, seed, timeout_ms, priority;
    double temperature, top_p, min_p, repeat_penalty;
    bool stream, quiet, json, raw;
    kvm_sec sec;
} gen_args;

#define GEN_OPTS(a)                                                                                  \
    {"router",    NULL, KM_OPT_STR, "tcp://127.0.0.1:7000", "router (or worker) endpoint",           \
     &(a).router, 0,    0},                                                                          \
        {"model", "KVMESH_MODEL_NAME", KM_OPT_STR, "default", "model name", &(a).model, 0, 0},       \
        {"max-tokens",    NULL, KM_OPT_INT, "128", "tokens to generate (0 = server default)",        \
         &(a).max_tokens, 0,    1 << 20},                                                            \
        {"temperature", NULL, KM_OPT_FLOAT, "0", "0 = greedy", &(a).temperature, 0, 100},            \
        {"top-k", NULL, KM_OPT_INT, "0", "0 = off", &(a).top_k, 0, 1 << 20},                         \
        {"top-p", NULL, KM_OPT_FLOAT, "1", "1 = off", &(a).top_p, 0, 1},                             \
        {"min-p", NULL, KM_OPT_FLOAT, "0", "0 = off", &(a).min_p, 0, 1},                             \
        {"repeat-penalty", NULL, KM_OPT_FLOAT, "1", "1 = off", &(a).repeat_penalty, 0.01, 100},      \
        {"seed", NULL, KM_OPT_INT, "-1", "sampling seed; -1 = random", &(a).seed, -1, 0},            \
        {"cache-salt", NULL, KM_OPT_STR, NULL, "tenant isolation of cached pages", &(a).salt, 0, 0}, \
        {"stop", NULL, KM_OPT_STR, NULL, "a stop string", &(a).stop, 0, 0},                          \
        {"priority", NULL, KM_OPT_INT, "0", "-100..100, higher first", &(a).priority, -100, 100},    \
        {"timeout",       NULL, KM_OPT_DURATION, "120s", "longest silence from the server",          \
         &(a).timeout_ms, 1,    86400000},                                                           \
        CLI_SEC_ROWS(&(a).sec),                                                                      \
    {                                                                                                \
        "quiet", NULL, KM_OPT_BOOL, "false", "no statistics line", &(a).quiet, 0, 0                  \
    }

static void fill_request(const gen_args *a, km_msg_request *q, const char **stop)
{
    kvm_request_init(q);
    q->model = a->model;
    q->max_tokens = (uint32_t)a->max_tokens;
    q->temperature = (float)a->temperature;
    q->top_k = (int32_t)a->top_k;
    q->top_p = (float)a->top_p;
    q->min_p = (float)a->min_p;
    q->repeat_penalty = (float)a->repeat_penalty;
    if (a->seed >= 0) {
        q->has_seed = true;
        q->seed = (uint64_t)a->seed;
    }
    q->cache_salt = a->salt;
    q->priority = (int32_t)a->priority;
    q->stream = a->stream;
    if (a->stop) {
        stop[0] = a->stop;
        q->stop = stop;
        q->n_stop = 1;
    }
}

static int print_token(void *user, uint32_t index, int32_t token, const char *text, size_t len)
{
    (void)user, (void)index, (void)token;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0;
}

static void print_stats(const kvm_result *res)
{
    double gen_s = (res->client_total_ms - res->client_ttft_ms) / 1e3;
    double tps = res->completion_tokens > 1 && gen_s > 0 ? (res->completion_tokens - 1) / gen_s : 0;
    fprintf(stderr,
            "[worker %s | prompt %u tokens, %u cached (%.0f%%) | %u tokens | TTFT %.1f ms | "
            "%.1f tok/s | %s%s]\n",
            res->worker[0] ? res->worker : "-", res->prompt_tokens, res->cached_tokens,
            res->prompt_tokens ? 100.0 * res->cached_tokens / res->prompt_tokens : 0.0,
            res->completion_tokens, res->client_ttft_ms, tps, km_finish_name(res->finish),
            res->migrations ? " | migrated" : "");
}

/* ---------------------------------------------------------------- generate */

int cli_cmd_generate(int argc, char **argv)
{
    gen_args a = {0};
    const km_opt opts[] = {
        GEN_OPTS(a),
        {"prompt", NULL, KM_OPT_STR, NULL, "the prompt (or --file)", &a.prompt, 0, 0},
        {"file", NULL, KM_OPT_STR, NULL, "read the prompt from a file", &a.file, 0, 0},
        {"stream", NULL, KM_OPT_BOOL, "true",
         "stream tokens (--no-stream: the whole text at the end)", &a.stream, 0, 0},
        {"json", NULL, KM_OPT_BOOL, "false", "print the result as one JSON object", &a.json, 0, 0},
    };
    km_config *cfg = NULL;
    int prc = cli_parse_opts("generate", "stream a completion from a kvmesh router", opts,
                             sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    int nargs = 0;
    char *const *args = km_config_args(cfg, &nargs);
    char *file_text = a.file ? cli_read_file(a.file, NULL) : NULL;
    const char *prompt = file_text ? file_text : a.prompt ? a.prompt : nargs ? args[0] : NULL;
    if (!prompt || !*prompt) {
        fprintf(stderr, "kvmesh generate: give a prompt (-p TEXT, --file PATH or an argument)\n");
        free(file_text);
        km_config_destroy(cfg);
        return 2;
    }
    km_errbuf err = {{0}};
    kvm_client *c = NULL;
    kvm_opts ko = {.timeout_ms = (int)a.timeout_ms, .sec = a.sec};
    if (kvm_open(a.router, &ko, &c, &err)) {
        fprintf(stderr, "kvmesh generate: %s\n", err.msg);
        free(file_text);
        km_config_destroy(cfg);
        return 1;
    }
    km_msg_request q;
    const char *stop[1];
    fill_request(&a, &q, stop);
    q.prompt = prompt;
    kvm_result res;
    int rc = kvm_generate(c, &q, a.json || !a.stream ? NULL : print_token, NULL, &res, &err);
    int status = 0;
    if (rc) {
        fprintf(stderr, "\nkvmesh generate: %s\n", err.msg);
        if (res.retry_after_ms) fprintf(stderr, "retry after %u ms\n", res.retry_after_ms);
        status = 1;
    } else if (a.json) {
        json_t *o = json_pack("{s:s%,s:s,s:s,s:i,s:i,s:i,s:f,s:f,s:i}", "text",
                              res.text.data ? (const char *)res.text.data : "", res.text.len,
                              "finish", km_finish_name(res.finish), "worker", res.worker,
                              "prompt_tokens", (int)res.prompt_tokens, "cached_tokens",
                              (int)res.cached_tokens, "completion_tokens",
                              (int)res.completion_tokens, "ttft_ms", res.client_ttft_ms, "total_ms",
                              res.client_total_ms, "migrations", (int)res.migrations);
        char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(o);
    } else {
        if (!a.stream) fwrite(res.text.data, 1, res.text.len, stdout);
        printf("\n");
        fflush(stdout);
        if (!a.quiet) print_stats(&res);
    }
    kvm_result_free(&res);
    kvm_close(c);
    free(file_text);
    km_config_destroy(cfg);
    return status;
}

/* ---------------------------------------------------------------- chat */

int cli_cmd_chat(int argc, char **argv)
{
    gen_args a = {0};
    const char *template_name = NULL;
    const km_opt opts[] = {
        GEN_OPTS(a),
        {"system", NULL, KM_OPT_STR, NULL, "system message", &a.system, 0, 0},
        {"template", NULL, KM_OPT_STR, "chatml", "chat template: chatml or llama3", &template_name,
         0, 0},
        {"stream", NULL, KM_OPT_BOOL, "true", "stream tokens", &a.stream, 0, 0},
    };
    km_config *cfg = NULL;
    int prc = cli_parse_opts("chat",
                             "chat with a kvmesh cluster (one line per turn; empty line or EOF "
                             "ends)",
                             opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    km_chat_kind kind = km_chat_parse(template_name);
    if (kind == KM_CHAT_NONE) {
        fprintf(stderr, "kvmesh chat: unknown --template %s\n", template_name);
        km_config_destroy(cfg);
        return 2;
    }
    km_errbuf err = {{0}};
    kvm_client *c = NULL;
    kvm_opts ko = {.timeout_ms = (int)a.timeout_ms, .sec = a.sec};
    if (kvm_open(a.router, &ko, &c, &err)) {
        fprintf(stderr, "kvmesh chat: %s\n", err.msg);
        km_config_destroy(cfg);
        return 1;
    }
    /* Every turn resends the whole conversation; the router sends it to the worker that holds
     * the previous turns' pages, so only the new turn is computed. */
    km_chat_msg msgs[256];
    char *owned[256];
    int n = 0, n_owned = 0, status = 0;
    if (a.system) msgs[n++] = (km_chat_msg){"system", a.system};
    bool tty = isatty(0);
    char *line = NULL;
    size_t cap = 0;
    for (;;) {
        if (tty) {
            fprintf(stderr, "> ");
            fflush(stderr);
        }
        ssize_t len = getline(&line, &cap, stdin);
        if (len <= 0) break;
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (!len) break;
        if (n + 2 > 256 || n_owned + 2 > 256) {
            fprintf(stderr, "kvmesh chat: conversation too long\n");
            break;
        }
        owned[n_owned] = strdup(line);
        msgs[n++] = (km_chat_msg){"user", owned[n_owned++]};
        int need = km_chat_apply(kind, msgs, n, 1, NULL, NULL, 0);
        char *prompt = malloc((size_t)need + 1);
        if (!prompt) break;
        km_chat_apply(kind, msgs, n, 1, NULL, prompt, (size_t)need + 1);
        km_msg_request q;
        const char *stop[1];
        fill_request(&a, &q, stop);
        q.prompt = prompt;
        kvm_result res;
        int rc = kvm_generate(c, &q, print_token, NULL, &res, &err);
        free(prompt);
        printf("\n");
        fflush(stdout);
        if (rc) {
            fprintf(stderr, "kvmesh chat: %s\n", err.msg);
            kvm_result_free(&res);
            n--;
            status = 1;
            continue;
        }
        if (!a.quiet) print_stats(&res);
        owned[n_owned] = strndup(res.text.data ? (const char *)res.text.data : "", res.text.len);
        msgs[n++] = (km_chat_msg){"assistant", owned[n_owned++]};
        kvm_result_free(&res);
    }
    free(line);
    for (int i = 0; i < n_owned; i++) free(owned[i]);
    kvm_close(c);
    km_config_destroy(cfg);
    return status;
}
