/*
 * cli_cluster.c — the cluster commands of the `kvmesh` tool (client/kvmesh.h, "CLI"):
 *   kvmesh generate  -p PROMPT [-n N] ...   stream a completion from a router (or a worker)
 *   kvmesh chat      [--system TEXT]        interactive chat, streamed, history kept
 *   kvmesh status    [--http URL]           workers, KV pages per tier, hit ratio
 *   kvmesh up        [--workers N]          a router and N workers on loopback, supervised
 *
 * Why it is built this way: the commands are thin over libkvmesh (generate, chat) and the
 * router's /v1/status JSON (status), so what they show is what any client sees. `up` is a
 * supervisor on a libuv loop: it spawns the daemons with their flags, restarts one that exits
 * (immediately for the restart exit code 75 of a drained worker, with backoff otherwise), and on
 * SIGINT/SIGTERM sends SIGTERM to all, waits for them, then SIGKILLs stragglers — so Ctrl-C
 * leaves no process behind. Options follow the project's table (common/svc.h): each has a
 * KVMESH_ environment twin; -p, -n, -m, -r are short forms of --prompt, --max-tokens, --model,
 * --router.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "client/kvmesh.h"

/* ---------------------------------------------------------------- option plumbing */

/* Parses argv (argv[0] = the command) against opts; returns 0, 1 (help shown) or 2 (error). */
static int parse_opts(const char *cmd, const char *summary, const km_opt *opts, size_t n, int argc,
                      char **argv, km_config **out)
{
    static const char *const shorts[][2] = {
        {"-p", "--prompt"}, {"-n", "--max-tokens"}, {"-m", "--model"},
        {"-r", "--router"}, {"-f", "--file"},
    };
    char **av = calloc((size_t)argc + 1, sizeof *av);
    if (!av) return 2;
    for (int i = 0; i < argc; i++) {
        av[i] = argv[i];
        for (size_t k = 0; k < sizeof shorts / sizeof *shorts; k++)
            if (i > 0 && !strcmp(argv[i], shorts[k][0])) av[i] = (char *)shorts[k][1];
    }
    char prog[64];
    snprintf(prog, sizeof prog, "kvmesh %s", cmd);
    km_errbuf err = {{0}};
    km_config *c = NULL;
    int rc = km_config_create(prog, summary, opts, n, &c, &err);
    if (!rc) rc = km_config_parse(c, argc, av, NULL, &err);
    free(av);
    if (rc) {
        fprintf(stderr, "kvmesh %s: %s\n", cmd, err.msg);
        km_config_destroy(c);
        return 2;
    }
    if (km_config_help_requested(c)) {
        km_buf h = {0};
        km_config_help(c, &h);
        fwrite(h.data, 1, h.len, stdout);
        km_buf_free(&h);
        km_config_destroy(c);
        return 1;
    }
    *out = c;
    return 0;
}

typedef struct gen_args {
    const char *router, *model, *prompt, *file, *salt, *stop, *system;
    int64_t max_tokens, top_k, seed, timeout_ms, priority;
    double temperature, top_p, min_p, repeat_penalty;
    bool stream, quiet, json, raw;
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

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    km_buf b = {0};
    char tmp[65536];
    size_t n;
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) km_buf_append(&b, tmp, n);
    fclose(f);
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

/* ---------------------------------------------------------------- generate */

static int cmd_generate(int argc, char **argv)
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
    int prc = parse_opts("generate", "stream a completion from a kvmesh router", opts,
                         sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    int nargs = 0;
    char *const *args = km_config_args(cfg, &nargs);
    char *file_text = a.file ? read_file(a.file) : NULL;
    const char *prompt = file_text ? file_text : a.prompt ? a.prompt : nargs ? args[0] : NULL;
    if (!prompt || !*prompt) {
        fprintf(stderr, "kvmesh generate: give a prompt (-p TEXT, --file PATH or an argument)\n");
        free(file_text);
        km_config_destroy(cfg);
        return 2;
    }
    km_errbuf err = {{0}};
    kvm_client *c = NULL;
    kvm_opts ko = {.timeout_ms = (int)a.timeout_ms};
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

static int cmd_chat(int argc, char **argv)
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
    int prc = parse_opts("chat",
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
    kvm_opts ko = {.timeout_ms = (int)a.timeout_ms};
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

/* ---------------------------------------------------------------- status */

static int cmd_status(int argc, char **argv)
{
    const char *http = NULL;
    bool json_out = false;
    const km_opt opts[] = {
        {"http", NULL, KM_OPT_STR, "http://127.0.0.1:8080", "the router's HTTP address", &http, 0,
         0},
        {"json", NULL, KM_OPT_BOOL, "false", "print the router's JSON as is", &json_out, 0, 0},
    };
    km_config *cfg = NULL;
    int prc = parse_opts("status", "workers, KV pages per tier and the prefix hit ratio", opts,
                         sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    char url[512];
    snprintf(url, sizeof url, "%s/v1/status", http);
    km_buf body = {0};
    int st = 0;
    km_errbuf err = {{0}};
    int status = 1;
    if (kvm_http_get(url, 5000, &body, &st, &err)) {
        fprintf(stderr, "kvmesh status: %s\n", err.msg);
        goto out;
    }
    if (st != 200) {
        fprintf(stderr, "kvmesh status: %s answered %d\n", url, st);
        goto out;
    }
    if (json_out) {
        fwrite(body.data, 1, body.len, stdout);
        status = 0;
        goto out;
    }
    json_error_t je;
    json_t *o = json_loadb((const char *)body.data, body.len, 0, &je);
    if (!o) {
        fprintf(stderr, "kvmesh status: bad JSON from the router: %s\n", je.text);
        goto out;
    }
    json_t *rt = json_object_get(o, "router");
    printf("model %s (fingerprint %s), routing %s, %lld-token pages\n",
           json_string_value(json_object_get(o, "model")),
           json_string_value(json_object_get(o, "fingerprint")),
           json_string_value(json_object_get(o, "mode")),
           (long long)json_integer_value(json_object_get(o, "page_tokens")));
    printf("router: %lld requests (%lld ok, %lld failed, %lld overloaded), %lld in flight, %lld "
           "queued, %lld migrations\n",
           (long long)json_integer_value(json_object_get(rt, "requests")),
           (long long)json_integer_value(json_object_get(rt, "completed")),
           (long long)json_integer_value(json_object_get(rt, "failed")),
           (long long)json_integer_value(json_object_get(rt, "overloaded")),
           (long long)json_integer_value(json_object_get(rt, "inflight")),
           (long long)json_integer_value(json_object_get(rt, "queued")),
           (long long)json_integer_value(json_object_get(rt, "migrations")));
    printf("prefix hits: %lld of %lld prompt tokens served from cache (hit ratio %.1f%%)\n\n",
           (long long)json_integer_value(json_object_get(rt, "cached_tokens")),
           (long long)json_integer_value(json_object_get(rt, "prompt_tokens")),
           100 * json_number_value(json_object_get(rt, "hit_ratio")));
    printf("%-12s %-5s %8s %8s %8s %9s %9s %9s %8s\n", "WORKER", "UP", "INFLIGHT", "SERVED", "HIT%",
           "KV_HOT", "KV_HOST", "KV_DISK", "EV_SEQ");
    size_t i;
    json_t *w;
    json_array_foreach(json_object_get(o, "workers"), i, w)
    {
        json_t *kv = json_object_get(w, "kv_pages");
        printf("%-12s %-5s %8lld %8lld %7.1f%% %9lld %9lld %9lld %8lld\n",
               json_string_value(json_object_get(w, "id")),
               json_is_true(json_object_get(w, "up"))
                   ? (json_is_true(json_object_get(w, "draining")) ? "drain" : "yes")
                   : "no",
               (long long)json_integer_value(json_object_get(w, "inflight")),
               (long long)json_integer_value(json_object_get(w, "served")),
               100 * json_number_value(json_object_get(w, "hit_ratio")),
               (long long)json_integer_value(json_object_get(kv, "hot")),
               (long long)json_integer_value(json_object_get(kv, "host")),
               (long long)json_integer_value(json_object_get(kv, "disk")),
               (long long)json_integer_value(json_object_get(w, "event_seq")));
    }
    printf("(KV columns are pages, as the workers' events report them)\n");
    json_decref(o);
    status = 0;
out:
    km_buf_free(&body);
    km_config_destroy(cfg);
    return status;
}

/* ---------------------------------------------------------------- up */

#define UP_MAX 65

typedef struct up_proc {
    char name[32];
    char **argv;
    int argc;
    uv_process_t proc;
    bool running, closing;
    int restarts;
    uint64_t started_ms;
    uv_timer_t backoff;
    int log_fd;
    struct up_state *st;
} up_proc;

typedef struct up_state {
    uv_loop_t *loop;
    up_proc p[UP_MAX];
    int n;
    bool stopping;
    int running;
    uv_signal_t sigint, sigterm;
    uv_timer_t kill_timer;
} up_state;

static void up_start(up_proc *p);

static void on_backoff(uv_timer_t *t)
{
    up_proc *p = t->data;
    if (!p->st->stopping) up_start(p);
}

static void on_proc_closed(uv_handle_t *h)
{
    up_proc *p = h->data;
    p->closing = false;
}

static void on_exit_cb(uv_process_t *h, int64_t status, int sig)
{
    up_proc *p = h->data;
    up_state *st = p->st;
    p->running = false;
    st->running--;
    p->closing = true;
    uv_close((uv_handle_t *)h, on_proc_closed);
    uint64_t now = uv_now(st->loop);
    if (st->stopping) {
        fprintf(stderr, "kvmesh up: %s stopped (status %lld%s%s)\n", p->name, (long long)status,
                sig ? ", signal " : "", sig ? strsignal(sig) : "");
        if (st->running == 0) {
            uv_stop(st->loop);
        }
        return;
    }
    /* 75: a drained worker asking to be restarted; anything else is a crash or a kill */
    uint64_t delay = status == 75 ? 0 : 500;
    if (now - p->started_ms < 10000) delay = 500u << (p->restarts < 4 ? p->restarts : 4);
    if (now - p->started_ms > 30000) p->restarts = 0;
    fprintf(stderr, "kvmesh up: %s exited (status %lld%s%s); restarting in %llu ms\n", p->name,
            (long long)status, sig ? ", signal " : "", sig ? strsignal(sig) : "",
            (unsigned long long)delay);
    p->restarts++;
    uv_timer_start(&p->backoff, on_backoff, delay, 0);
}

static void up_start(up_proc *p)
{
    if (p->closing) { /* the old handle is still closing: try again shortly */
        uv_timer_start(&p->backoff, on_backoff, 50, 0);
        return;
    }
    uv_stdio_container_t stdio[3] = {
        {.flags = UV_IGNORE},
        {.flags = UV_INHERIT_FD, .data.fd = p->log_fd >= 0 ? p->log_fd : 1},
        {.flags = UV_INHERIT_FD, .data.fd = p->log_fd >= 0 ? p->log_fd : 2},
    };
    uv_process_options_t o = {.file = p->argv[0],
                              .args = p->argv,
                              .exit_cb = on_exit_cb,
                              .stdio = stdio,
                              .stdio_count = 3};
    memset(&p->proc, 0, sizeof p->proc);
    p->proc.data = p;
    int rc = uv_spawn(p->st->loop, &p->proc, &o);
    if (rc) {
        fprintf(stderr, "kvmesh up: cannot start %s (%s): %s\n", p->name, p->argv[0],
                uv_strerror(rc));
        p->closing = true;
        uv_close((uv_handle_t *)&p->proc, on_proc_closed);
        uv_timer_start(&p->backoff, on_backoff, 2000, 0);
        return;
    }
    p->running = true;
    p->st->running++;
    p->started_ms = uv_now(p->st->loop);
}

static void on_kill_timer(uv_timer_t *t)
{
    up_state *st = t->data;
    for (int i = 0; i < st->n; i++)
        if (st->p[i].running) {
            fprintf(stderr, "kvmesh up: %s did not stop in time: SIGKILL\n", st->p[i].name);
            uv_process_kill(&st->p[i].proc, SIGKILL);
        }
}

static void on_stop_signal(uv_signal_t *s, int signo)
{
    up_state *st = s->data;
    if (st->stopping) { /* second Ctrl-C: no more waiting */
        on_kill_timer(&st->kill_timer);
        return;
    }
    st->stopping = true;
    fprintf(stderr, "\nkvmesh up: stopping %d processes\n", st->running);
    for (int i = 0; i < st->n; i++) {
        uv_timer_stop(&st->p[i].backoff);
        if (st->p[i].running) uv_process_kill(&st->p[i].proc, SIGTERM);
    }
    if (st->running == 0) {
        uv_stop(st->loop);
        return;
    }
    uv_timer_start(&st->kill_timer, on_kill_timer, 10000, 0);
}

static char *xfmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xfmt(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0) s = NULL;
    va_end(ap);
    return s;
}

/* Splits extra arguments on spaces into argv (appended). */
static void push_args(char **argv, int *argc, int max, const char *extra)
{
    if (!extra) return;
    char *copy = strdup(extra);
    for (char *save = NULL, *t = strtok_r(copy, " ", &save); t && *argc < max - 1;
         t = strtok_r(NULL, " ", &save))
        argv[(*argc)++] = strdup(t);
    free(copy);
}

static int cmd_up(int argc, char **argv)
{
    int64_t n_workers, base_port, threads, http_port, cluster_seed, front_port;
    const char *model = NULL, *bin_dir = NULL, *log_dir = NULL, *mode = NULL, *kv_bytes = NULL;
    const char *worker_args = NULL, *router_args = NULL;
    const km_opt opts[] = {
        {"workers", NULL, KM_OPT_INT, "2", "workers to run", &n_workers, 1, 64},
        {"model", NULL, KM_OPT_STR, NULL, "GGUF model (default: the workers' default)", &model, 0,
         0},
        {"threads", NULL, KM_OPT_INT, "0", "threads per worker; 0 = cores / workers", &threads, 0,
         1024},
        {"base-port", NULL, KM_OPT_INT, "7100",
         "worker i listens on base+10i (requests) and base+10i+1 (events)", &base_port, 1024,
         65000},
        {"front-port", NULL, KM_OPT_INT, "7000", "router's ZeroMQ port", &front_port, 1024, 65535},
        {"http-port", NULL, KM_OPT_INT, "8080", "router's OpenAI-compatible HTTP port", &http_port,
         1024, 65535},
        {"cluster-seed", NULL, KM_OPT_INT, "0", "page-hash seed of the cluster", &cluster_seed, 0,
         0},
        {"mode", NULL, KM_OPT_STR, "kv", "routing: kv, round-robin, random", &mode, 0, 0},
        {"kv-bytes", NULL, KM_OPT_STR, NULL, "hot-tier KV budget per worker (e.g. 256M)", &kv_bytes,
         0, 0},
        {"bin-dir", NULL, KM_OPT_STR, NULL,
         "where kvmesh-router and kvmesh-worker are (default: "
         "next to this kvmesh)",
         &bin_dir, 0, 0},
        {"log-dir", NULL, KM_OPT_STR, NULL, "daemon logs go here (default: inherit stderr)",
         &log_dir, 0, 0},
        {"worker-args", NULL, KM_OPT_STR, NULL, "extra worker flags, space-separated", &worker_args,
         0, 0},
        {"router-args", NULL, KM_OPT_STR, NULL, "extra router flags, space-separated", &router_args,
         0, 0},
    };
    km_config *cfg = NULL;
    int prc = parse_opts("up",
                         "a whole local cluster on loopback: a router and N workers, "
                         "restarted when they die, stopped by Ctrl-C",
                         opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    char dir[4096];
    if (bin_dir) {
        snprintf(dir, sizeof dir, "%s", bin_dir);
    } else {
        ssize_t l = readlink("/proc/self/exe", dir, sizeof dir - 1);
        if (l <= 0) l = 0;
        dir[l] = 0;
        char *slash = strrchr(dir, '/');
        if (slash)
            *slash = 0;
        else
            snprintf(dir, sizeof dir, ".");
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (!threads) threads = cores / n_workers > 0 ? cores / n_workers : 1;
    up_state st = {0};
    uv_loop_t loop;
    uv_loop_init(&loop);
    st.loop = &loop;
    if (log_dir) mkdir(log_dir, 0755);
    km_buf wl = {0};
    int status = 0;
    for (int i = 0; i <= n_workers; i++) {
        up_proc *p = &st.p[st.n++];
        p->st = &st;
        p->argv = calloc(64, sizeof *p->argv);
        int k = 0;
        if (i < n_workers) {
            int rp = (int)base_port + 10 * i;
            snprintf(p->name, sizeof p->name, "w%d", i);
            p->argv[k++] = xfmt("%s/kvmesh-worker", dir);
            p->argv[k++] = xfmt("--worker-id=w%d", i);
            p->argv[k++] = xfmt("--listen=tcp://127.0.0.1:%d", rp);
            p->argv[k++] = xfmt("--events=tcp://127.0.0.1:%d", rp + 1);
            p->argv[k++] = xfmt("--admin-port=%d", rp + 2);
            p->argv[k++] = xfmt("--threads=%lld", (long long)threads);
            p->argv[k++] = xfmt("--cluster-seed=%lld", (long long)cluster_seed);
            if (model) p->argv[k++] = xfmt("--model=%s", model);
            if (kv_bytes) p->argv[k++] = xfmt("--kv-bytes=%s", kv_bytes);
            push_args(p->argv, &k, 64, worker_args);
            km_buf_printf(&wl, "%sw%d=tcp://127.0.0.1:%d+tcp://127.0.0.1:%d", i ? "," : "", i, rp,
                          rp + 1);
        } else {
            snprintf(p->name, sizeof p->name, "router");
            p->argv[k++] = xfmt("%s/kvmesh-router", dir);
            p->argv[k++] = xfmt("--workers=%s", (const char *)wl.data);
            p->argv[k++] = xfmt("--front=tcp://127.0.0.1:%lld", (long long)front_port);
            p->argv[k++] = xfmt("--http-port=%lld", (long long)http_port);
            p->argv[k++] = xfmt("--cluster-seed=%lld", (long long)cluster_seed);
            p->argv[k++] = xfmt("--mode=%s", mode);
            if (model) p->argv[k++] = xfmt("--model=%s", model);
            push_args(p->argv, &k, 64, router_args);
        }
        p->argc = k;
        p->log_fd = -1;
        if (log_dir) {
            char path[4200];
            snprintf(path, sizeof path, "%s/%s.log", log_dir, p->name);
            p->log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        }
        uv_timer_init(&loop, &p->backoff);
        p->backoff.data = p;
        if (access(p->argv[0], X_OK)) {
            fprintf(stderr, "kvmesh up: %s not found (build it: make)\n", p->argv[0]);
            status = 1;
        }
    }
    if (status) goto out;
    uv_signal_init(&loop, &st.sigint);
    uv_signal_init(&loop, &st.sigterm);
    st.sigint.data = st.sigterm.data = &st;
    uv_signal_start(&st.sigint, on_stop_signal, SIGINT);
    uv_signal_start(&st.sigterm, on_stop_signal, SIGTERM);
    uv_timer_init(&loop, &st.kill_timer);
    st.kill_timer.data = &st;
    for (int i = 0; i < st.n; i++) up_start(&st.p[i]);
    fprintf(stderr,
            "kvmesh up: router tcp://127.0.0.1:%lld, OpenAI API http://127.0.0.1:%lld/v1, %lld "
            "workers (%lld threads each)%s%s\n"
            "kvmesh up: try  kvmesh generate -p \"Hello\"   |   kvmesh status   |   Ctrl-C stops "
            "everything\n",
            (long long)front_port, (long long)http_port, (long long)n_workers, (long long)threads,
            log_dir ? ", logs in " : "", log_dir ? log_dir : "");
    uv_run(&loop, UV_RUN_DEFAULT);
    fprintf(stderr, "kvmesh up: all processes stopped\n");
out:
    for (int i = 0; i < st.n; i++) {
        up_proc *p = &st.p[i];
        if (!uv_is_closing((uv_handle_t *)&p->backoff)) uv_close((uv_handle_t *)&p->backoff, NULL);
        if (p->running) { /* only on a setup failure */
            uv_process_kill(&p->proc, SIGKILL);
        }
    }
    if (st.sigint.loop) {
        uv_close((uv_handle_t *)&st.sigint, NULL);
        uv_close((uv_handle_t *)&st.sigterm, NULL);
        uv_close((uv_handle_t *)&st.kill_timer, NULL);
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    for (int i = 0; i < st.n; i++) {
        for (int k = 0; k < st.p[i].argc; k++) free(st.p[i].argv[k]);
        free(st.p[i].argv);
        if (st.p[i].log_fd >= 0) close(st.p[i].log_fd);
    }
    km_buf_free(&wl);
    km_config_destroy(cfg);
    return status;
}

/* ---------------------------------------------------------------- dispatch */

int kvm_cli_cluster(const char *cmd, int argc, char **argv)
{
    /* argv[-1] is the command itself: km_config wants a program name first */
    if (!strcmp(cmd, "generate")) return cmd_generate(argc + 1, argv - 1);
    if (!strcmp(cmd, "chat")) return cmd_chat(argc + 1, argv - 1);
    if (!strcmp(cmd, "status")) return cmd_status(argc + 1, argv - 1);
    if (!strcmp(cmd, "up")) return cmd_up(argc + 1, argv - 1);
    return KVM_CLI_UNKNOWN;
}
