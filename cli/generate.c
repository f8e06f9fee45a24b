/*
 * generate.c — `kvmesh generate` and `kvmesh chat`: completions streamed from a router (or a
 * worker) with libkvmesh, so what they show is what any client sees. chat resends the whole
 * conversation every turn; the router sends it to the worker that holds the previous turns'
 * pages, so only the new turn is computed.
 */
#define _GNU_SOURCE
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "model/model.h"

typedef struct gen_args {
    const char *router, *model, *prompt, *file, *salt, *stop, *system, *seed_text, *timeout_text;
    const char *run_dir;
    int64_t max_tokens, top_k, timeout_ms, priority;
    double temperature, top_p, min_p, repeat_penalty;
    bool stream, quiet, json, raw;
    kvm_sec sec;
    /* from the table's strings and argv (gen_finish) */
    bool has_seed;
    uint64_t seed;
    const char *stops[KM_PROTO_MAX_STOP];
    int n_stop;
    char endpoint[512];
    char cert[4200];      /* the run directory's client key, when --cert is not given */
    char model_name[256]; /* --model given as a GGUF path: the name it is served under */
} gen_args;

/* Ctrl-C: the request in flight is canceled on the server (kvm_opts.cancel), not abandoned. */
static volatile int g_interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    g_interrupted = 1;
}

static void catch_sigint(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint; /* no SA_RESTART: a blocking read returns */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

#define GEN_OPTS(a)                                                                                  \
    {"router",                                                                                       \
     NULL,                                                                                           \
     KM_OPT_STR,                                                                                     \
     NULL,                                                                                           \
     "router (or worker) endpoint (default: the run directory's router, else "                       \
     "tcp://127.0.0.1:7000)",                                                                        \
     &(a).router,                                                                                    \
     0,                                                                                              \
     0},                                                                                             \
        CLI_RUN_ROW(&(a).run_dir),                                                                   \
        {"model",                                                                                    \
         "KVMESH_MODEL_NAME",                                                                        \
         KM_OPT_STR,                                                                                 \
         "default",                                                                                  \
         "the served model's name, or a GGUF path (as for kvmesh run: its file name without "        \
         ".gguf is the name a worker serves it under)",                                              \
         &(a).model,                                                                                 \
         0,                                                                                          \
         0},                                                                                         \
        {"max-tokens",    NULL, KM_OPT_INT, "128", "tokens to generate (0 = server default)",        \
         &(a).max_tokens, 0,    1 << 20},                                                            \
        {"temperature", NULL, KM_OPT_FLOAT, "0", "0 = greedy", &(a).temperature, 0, 100},            \
        {"top-k", NULL, KM_OPT_INT, "0", "0 = off", &(a).top_k, 0, 1 << 20},                         \
        {"top-p", NULL, KM_OPT_FLOAT, "1", "1 = off", &(a).top_p, 0, 1},                             \
        {"min-p", NULL, KM_OPT_FLOAT, "0", "0 = off", &(a).min_p, 0, 1},                             \
        {"repeat-penalty", NULL, KM_OPT_FLOAT, "1", "1 = off", &(a).repeat_penalty, 0.01, 100},      \
        {"seed",         NULL, KM_OPT_STR, "-1", "sampling seed 0..2^64-1; -1 = random",             \
         &(a).seed_text, 0,    0},                                                                   \
        {"cache-salt", NULL, KM_OPT_STR, NULL, "tenant isolation of cached pages", &(a).salt, 0, 0}, \
        {"stop", NULL, KM_OPT_STR, NULL, "a stop string (repeatable, up to 16)", &(a).stop, 0, 0},   \
        {"priority", NULL, KM_OPT_INT, "0", "-100..100, higher first", &(a).priority, -100, 100},    \
        {"timeout",                                                                                  \
         NULL,                                                                                       \
         KM_OPT_STR,                                                                                 \
         "120",                                                                                      \
         "seconds of silence from the server before giving up (or 500ms, 2m)",                       \
         &(a).timeout_text,                                                                          \
         0,                                                                                          \
         0},                                                                                         \
        CLI_SEC_ROWS(&(a).sec),                                                                      \
    {                                                                                                \
        "quiet", NULL, KM_OPT_BOOL, "false", "no statistics line", &(a).quiet, 0, 0                  \
    }

/* What the option table cannot say: seed and time-out parsed, every --stop, the endpoint. 0, or
 * 2 after saying why. */
static int gen_finish(const char *cmd, gen_args *a, int argc, char **argv)
{
    if (cli_parse_seed(cmd, a->seed_text, &a->has_seed, &a->seed)) return 2;
    if (cli_parse_seconds(cmd, "timeout", a->timeout_text, &a->timeout_ms)) return 2;
    a->n_stop = cli_repeated(argc, argv, "--stop", a->stops, KM_PROTO_MAX_STOP);
    if (a->n_stop < 0) {
        fprintf(stderr, "kvmesh %s: at most %d --stop strings\n", cmd, KM_PROTO_MAX_STOP);
        return 2;
    }
    if (a->n_stop == 0 && a->stop) a->stops[a->n_stop++] = a->stop; /* from KVMESH_STOP */
    /* -m means a model file everywhere else (run, up): a path names the model its file serves */
    if (a->model && (strchr(a->model, '/') || strstr(a->model, ".gguf"))) {
        md_model_display_name(a->model, a->model_name, sizeof a->model_name);
        a->model = a->model_name;
    }
    static cli_run run; /* large: off the stack */
    if (cli_run_read(cmd, a->run_dir, &run) ||
        cli_run_endpoint(cmd, &run, a->router, "router", CLI_RUN_REQUESTS, "tcp://127.0.0.1:7000",
                         a->endpoint, sizeof a->endpoint))
        return 2;
    if (!a->sec.cert && run.client_cert[0])
        snprintf(a->cert, sizeof a->cert, "%s", run.client_cert);
    if (a->cert[0]) a->sec.cert = a->cert;
    return 0;
}

/* kvm_open with the user's endpoint explained when ZeroMQ refuses it. */
static kvm_client *gen_open(const char *cmd, const gen_args *a)
{
    km_errbuf err = {{0}};
    kvm_client *c = NULL;
    kvm_opts ko = {.timeout_ms = (int)a->timeout_ms, .sec = a->sec, .cancel = &g_interrupted};
    if (kvm_sec_check(&a->sec, "router", &err)) {
        fprintf(stderr, "kvmesh %s: --cert %s: %s\n", cmd, a->sec.cert, err.msg);
        return NULL;
    }
    if (kvm_open(a->endpoint, &ko, &c, &err)) {
        fprintf(stderr, "kvmesh %s: --router %s: %s (%s)\n", cmd, a->endpoint, err.msg,
                cli_endpoint_hint(a->endpoint));
        return NULL;
    }
    catch_sigint();
    return c;
}

static void fill_request(const gen_args *a, km_msg_request *q)
{
    kvm_request_init(q);
    q->model = a->model;
    q->max_tokens = (uint32_t)a->max_tokens;
    q->temperature = (float)a->temperature;
    q->top_k = (int32_t)a->top_k;
    q->top_p = (float)a->top_p;
    q->min_p = (float)a->min_p;
    q->repeat_penalty = (float)a->repeat_penalty;
    q->has_seed = a->has_seed;
    q->seed = a->seed;
    q->cache_salt = a->salt;
    q->priority = (int32_t)a->priority;
    q->stream = a->stream;
    q->stop = a->n_stop ? a->stops : NULL;
    q->n_stop = (uint32_t)a->n_stop;
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
    double tps = kvm_result_decode_rate(res);
    char rate[48] = "- tok/s (one step)";
    if (tps > 0) snprintf(rate, sizeof rate, "%.1f tok/s", tps);
    fprintf(stderr,
            "[worker %s | prompt %u tokens, %u cached (%.0f%%) | %u tokens | TTFT %.1f ms | %s | "
            "%s%s]\n",
            res->worker[0] ? res->worker : "-", res->prompt_tokens, res->cached_tokens,
            res->prompt_tokens ? 100.0 * res->cached_tokens / res->prompt_tokens : 0.0,
            res->completion_tokens, res->client_ttft_ms, rate, km_finish_name(res->finish),
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
    if (gen_finish("generate", &a, argc, argv)) {
        km_config_destroy(cfg);
        return 2;
    }
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
    kvm_client *c = gen_open("generate", &a);
    if (!c) {
        free(file_text);
        km_config_destroy(cfg);
        return 1;
    }
    km_msg_request q;
    fill_request(&a, &q);
    q.prompt = prompt;
    kvm_result res;
    int rc = kvm_generate(c, &q, a.json || !a.stream ? NULL : print_token, NULL, &res, &err);
    int status = 0;
    if (rc == KM_ECANCELED && g_interrupted) {
        fflush(stdout);
        fprintf(stderr, "\nkvmesh generate: interrupted; the request was canceled\n");
        status = 130;
    } else if (rc) {
        fflush(stdout);
        fprintf(stderr, "\nkvmesh generate: %s\n", err.msg);
        if (res.retry_after_ms) fprintf(stderr, "retry after %u ms\n", res.retry_after_ms);
        status = 1;
    } else if (a.json) {
        /* times to the microsecond, printed short (888.901, not 888.90060300000005) */
        json_t *o = json_pack(
            "{s:s%,s:s,s:s,s:i,s:i,s:i,s:f,s:f,s:i}", "text",
            res.text.data ? (const char *)res.text.data : "", res.text.len, "finish",
            km_finish_name(res.finish), "worker", res.worker, "prompt_tokens",
            (int)res.prompt_tokens, "cached_tokens", (int)res.cached_tokens, "completion_tokens",
            (int)res.completion_tokens, "ttft_ms", round(res.client_ttft_ms * 1e3) / 1e3,
            "total_ms", round(res.client_total_ms * 1e3) / 1e3, "migrations", (int)res.migrations);
        char *s = o ? json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(12)) : NULL;
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

/* The template chat renders with: the model file's, as the router applies it to OpenAI chat
 * requests (with SmolLM2's default system message), unless --template says otherwise, which is
 * warned about when it differs from the model's. MD_CHAT_NONE after saying why. */
static md_chat_kind chat_template(const char *name, const char *model_file, const char **defsys)
{
    md_chat_kind asked = name ? md_chat_parse(name) : MD_CHAT_NONE, model = MD_CHAT_NONE;
    if (name && asked == MD_CHAT_NONE) {
        fprintf(stderr, "kvmesh chat: unknown --template %s (chatml or llama3)\n", name);
        return MD_CHAT_NONE;
    }
    const char *path = model_file ? model_file : md_default_model_path();
    md_model_info *mi = NULL;
    km_errbuf err = {{0}};
    if (md_model_info_open(path, &mi, &err) == 0) {
        model = md_model_info_chat(mi);
        if (model == MD_CHAT_NONE) model = MD_CHAT_CHATML; /* the router's fallback */
        if (strcasestr(md_model_info_name(mi), "smollm"))
            *defsys = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
        md_model_info_close(mi);
    }
    if (asked == MD_CHAT_NONE && model == MD_CHAT_NONE) {
        fprintf(stderr,
                "kvmesh chat: warning: cannot read the model's chat template (%s); using chatml "
                "(--model-file PATH or --template NAME)\n",
                err.msg);
        return MD_CHAT_CHATML;
    }
    if (asked != MD_CHAT_NONE && model != MD_CHAT_NONE && asked != model)
        fprintf(stderr,
                "kvmesh chat: warning: --template %s differs from the model's (%s): the model "
                "may answer badly\n",
                name, model == MD_CHAT_LLAMA3 ? "llama3" : "chatml");
    return asked != MD_CHAT_NONE ? asked : model;
}

int cli_cmd_chat(int argc, char **argv)
{
    gen_args a = {0};
    const char *template_name = NULL, *model_file = NULL;
    const km_opt opts[] = {
        GEN_OPTS(a),
        {"system", NULL, KM_OPT_STR, NULL, "system message", &a.system, 0, 0},
        {"template", NULL, KM_OPT_STR, NULL,
         "chat template: chatml or llama3 (default: the model file's, as the router uses)",
         &template_name, 0, 0},
        {"model-file", "KVMESH_MODEL", KM_OPT_STR, NULL,
         "the cluster's GGUF, read for its chat template (default: "
         "models/SmolLM2-135M-Instruct.Q4_1.gguf)",
         &model_file, 0, 0},
        {"stream", NULL, KM_OPT_BOOL, "true", "stream tokens", &a.stream, 0, 0},
    };
    km_config *cfg = NULL;
    int prc = cli_parse_opts("chat",
                             "chat with a kvmesh cluster (one line per turn; empty line or EOF "
                             "ends)",
                             opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    const char *defsys = NULL;
    md_chat_kind kind = gen_finish("chat", &a, argc, argv)
                            ? MD_CHAT_NONE
                            : chat_template(template_name, model_file, &defsys);
    if (kind == MD_CHAT_NONE) {
        km_config_destroy(cfg);
        return 2;
    }
    km_errbuf err = {{0}};
    kvm_client *c = gen_open("chat", &a);
    if (!c) {
        km_config_destroy(cfg);
        return 1;
    }
    /* Every turn resends the whole conversation; the router sends it to the worker that holds
     * the previous turns' pages, so only the new turn is computed. */
    md_chat_msg msgs[256];
    char *owned[256];
    int n = 0, n_owned = 0, status = 0;
    if (a.system) msgs[n++] = (md_chat_msg){"system", a.system};
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
        msgs[n++] = (md_chat_msg){"user", owned[n_owned++]};
        int need = md_chat_apply(kind, msgs, n, 1, defsys, NULL, 0);
        char *prompt = malloc((size_t)need + 1);
        if (!prompt) break;
        md_chat_apply(kind, msgs, n, 1, defsys, prompt, (size_t)need + 1);
        km_msg_request q;
        fill_request(&a, &q);
        q.prompt = prompt;
        kvm_result res;
        g_interrupted = 0;
        int rc = kvm_generate(c, &q, print_token, NULL, &res, &err);
        free(prompt);
        printf("\n");
        fflush(stdout);
        if (rc == KM_ECANCELED && g_interrupted) { /* Ctrl-C ends the turn, not the chat */
            fprintf(stderr, "kvmesh chat: interrupted; the request was canceled\n");
            g_interrupted = 0;
            kvm_result_free(&res);
            free(owned[--n_owned]);
            n--;
            continue;
        }
        if (rc) {
            fprintf(stderr, "kvmesh chat: %s\n", err.msg);
            kvm_result_free(&res);
            n--;
            status = 1;
            continue;
        }
        if (!a.quiet) print_stats(&res);
        owned[n_owned] = strndup(res.text.data ? (const char *)res.text.data : "", res.text.len);
        msgs[n++] = (md_chat_msg){"assistant", owned[n_owned++]};
        kvm_result_free(&res);
    }
    free(line);
    for (int i = 0; i < n_owned; i++) free(owned[i]);
    kvm_close(c);
    km_config_destroy(cfg);
    return status;
}
