/*
 * cli_cluster.c — the cluster commands of the `kvmesh` tool (client/kvmesh.h, "CLI"):
 *   kvmesh generate  -p PROMPT [-n N] ...   stream a completion from a router (or a worker)
 *   kvmesh chat      [--system TEXT]        interactive chat, streamed, history kept
 *   kvmesh status    [--http URL]           workers, KV pages per tier, hit ratio
 *   kvmesh status    --controller ENDPOINT  member state, recovery level, pressure, history
 *   kvmesh recover   --worker W --level N   force a recovery level through the controller
 *   kvmesh up        [--workers N]          a controller, N workers and a router, supervised
 *
 * Why it is built this way: the commands are thin over libkvmesh (generate, chat), the router's
 * /v1/status JSON (status) and the controller's view (status --controller; recover sends an admin
 * frame through kvm_admin_call), so what they show is what any client sees. `up` is a supervisor
 * on a libuv loop: it spawns the controller, the workers (--controller = its --listen) and the
 * routers (--controller = its --view), restarts one that exits (immediately for the restart exit
 * code 75 of a worker drained by recovery level 3, with backoff otherwise), and on SIGINT/SIGTERM
 * sends SIGTERM to all, waits for them, then SIGKILLs stragglers, so Ctrl-C leaves no process
 * behind. It keeps <run-dir>/cluster.env (every process's role, id, pid and endpoints, rewritten
 * on every start and exit) so that tools such as `kvmesh chaos` find the processes; with
 * --base-port 0 every port is picked free, so clusters can run side by side. Options follow the
 * project's table (common/svc.h): each has a KVMESH_ environment twin; -p, -n, -m, -r are short
 * forms of --prompt, --max-tokens, --model, --router.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
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
    km_config *c = NULL;
    int rc = km_daemon_config(prog, summary, opts, n, argc, av, NULL, NULL, &c);
    free(av);
    if (rc) return rc;
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

/* ---------------------------------------------------------------- controller: status, recover */

static const char *level_name(uint32_t level)
{
    static const char *const names[] = {"normal", "evict", "fp8", "drain"};
    return level < 4 ? names[level] : "?";
}

void kvm_view_print(FILE *f, const km_msg_view *v)
{
    fprintf(f, "controller %s (epoch %llu, view %llu), %u workers\n", v->controller,
            (unsigned long long)v->epoch, (unsigned long long)v->seq, v->n_workers);
    fprintf(f, "%-12s %-10s %-12s %8s %-6s %7s %7s %9s  %s\n", "WORKER", "STATE", "LEVEL",
            "PRESSURE", "KV", "RUNNING", "QUEUED", "SEEN_MS", "REQUESTS");
    for (uint32_t i = 0; i < v->n_workers; i++) {
        const km_view_worker *w = &v->workers[i];
        char lv[32];
        snprintf(lv, sizeof lv, "%u %s", w->level, level_name(w->level));
        fprintf(f, "%-12s %-10s %-12s %7.1f%% %-6s %7u %7u %9llu  %s\n", w->id,
                km_member_state_name(w->state), lv, 100 * w->pressure,
                w->kv_format ? w->kv_format : "-", w->running, w->queue_depth,
                (unsigned long long)w->last_seen_ms, w->requests ? w->requests : "-");
    }
    bool any = false;
    for (uint32_t i = 0; i < v->n_workers; i++) {
        const km_view_worker *w = &v->workers[i];
        for (uint32_t h = 0; h < w->n_history; h++) {
            const km_recovery_action *a = &w->history[h];
            if (!any) fprintf(f, "\nrecovery history (oldest first):\n");
            any = true;
            time_t secs = (time_t)(a->at_ms / 1000);
            struct tm tm;
            char when[32];
            strftime(when, sizeof when, "%H:%M:%S", localtime_r(&secs, &tm));
            fprintf(f, "  %s.%03u  %-12s level %u %-6s %-12s %s\n", when,
                    (unsigned)(a->at_ms % 1000), w->id, a->level, level_name(a->level), a->reason,
                    a->ok ? "ok" : "not acknowledged");
        }
    }
    if (!any) fprintf(f, "\nno recovery actions so far\n");
}

static int status_controller(const char *endpoint, bool json_out)
{
    km_msg v;
    km_errbuf err = {{0}};
    if (kvm_view_get(endpoint, 5000, &v, &err)) {
        fprintf(stderr, "kvmesh status: %s\n", err.msg);
        return 1;
    }
    if (json_out) {
        json_t *ws = json_array();
        for (uint32_t i = 0; i < v.view.n_workers; i++) {
            const km_view_worker *w = &v.view.workers[i];
            json_t *hist = json_array();
            for (uint32_t h = 0; h < w->n_history; h++)
                json_array_append_new(
                    hist, json_pack("{s:I,s:i,s:s,s:b}", "at_ms", (json_int_t)w->history[h].at_ms,
                                    "level", (int)w->history[h].level, "reason",
                                    w->history[h].reason, "ok", w->history[h].ok));
            json_array_append_new(ws, json_pack("{s:s,s:s,s:i,s:f,s:s?,s:i,s:i,s:I,s:s?,s:o}", "id",
                                                w->id, "state", km_member_state_name(w->state),
                                                "level", (int)w->level, "pressure", w->pressure,
                                                "kv_format", w->kv_format, "running",
                                                (int)w->running, "queued", (int)w->queue_depth,
                                                "last_seen_ms", (json_int_t)w->last_seen_ms,
                                                "requests", w->requests, "history", hist));
        }
        json_t *o =
            json_pack("{s:s,s:I,s:I,s:o}", "controller", v.view.controller, "epoch",
                      (json_int_t)v.view.epoch, "seq", (json_int_t)v.view.seq, "workers", ws);
        char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(o);
    } else {
        kvm_view_print(stdout, &v.view);
    }
    km_msg_clear(&v);
    return 0;
}

static int cmd_recover(int argc, char **argv)
{
    const char *controller = NULL, *worker = NULL;
    int64_t level = 0, timeout_ms = 0;
    const km_opt opts[] = {
        {"controller", NULL, KM_OPT_STR, "tcp://127.0.0.1:7200", "the controller's --listen",
         &controller, 0, 0},
        {"worker", NULL, KM_OPT_STR, NULL, "worker id (required)", &worker, 0, 0},
        {"level", NULL, KM_OPT_INT, "0",
         "1 = evict 25% of unpinned pages, 2 = KV to fp8, 3 = drain and restart (required)", &level,
         0, 3},
        {"timeout", NULL, KM_OPT_DURATION, "10s", "how long to wait for the controller's answer",
         &timeout_ms, 1, 600000},
    };
    km_config *cfg = NULL;
    int prc = parse_opts("recover", "apply a recovery level to a worker, through the controller",
                         opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    if (!worker || level < 1) {
        fprintf(stderr, "kvmesh recover: give --worker ID and --level 1..3\n");
        km_config_destroy(cfg);
        return 2;
    }
    km_msg_admin a = {.cmd = KM_ADMIN_RECOVER, .worker = worker, .level = (uint32_t)level};
    km_msg r;
    km_errbuf err = {{0}};
    int status = 1;
    if (kvm_admin_call(controller, &a, (int)timeout_ms, &r, &err)) {
        fprintf(stderr, "kvmesh recover: %s\n", err.msg);
    } else if (r.type != KM_MSG_ADMIN_REPLY) {
        fprintf(stderr, "kvmesh recover: unexpected %s frame from %s\n", km_msg_type_name(r.type),
                controller);
    } else if (!r.admin_reply.ok) {
        fprintf(stderr, "kvmesh recover: %s level %lld refused: %d %s%s%s\n", worker,
                (long long)level, r.admin_reply.code, km_proto_code_name(r.admin_reply.code),
                r.admin_reply.message ? ": " : "",
                r.admin_reply.message ? r.admin_reply.message : "");
    } else {
        printf("%s: level %lld (%s) applied%s%s\n", worker, (long long)level,
               level_name((uint32_t)level), r.admin_reply.message ? ": " : "",
               r.admin_reply.message ? r.admin_reply.message : "");
        status = 0;
    }
    km_msg_clear(&r);
    km_config_destroy(cfg);
    return status;
}

/* ---------------------------------------------------------------- status */

static int cmd_status(int argc, char **argv)
{
    const char *http = NULL;
    bool json_out = false;
    const char *controller = NULL;
    const km_opt opts[] = {
        {"http", NULL, KM_OPT_STR, "http://127.0.0.1:8080", "the router's HTTP address", &http, 0,
         0},
        {"controller", "KVMESH_STATUS_CONTROLLER", KM_OPT_STR, NULL,
         "ask the controller (its --listen, e.g. tcp://127.0.0.1:7200) instead: each worker's "
         "member state, recovery level, pressure and recovery history",
         &controller, 0, 0},
        {"json", NULL, KM_OPT_BOOL, "false", "print JSON (the router's as is)", &json_out, 0, 0},
    };
    km_config *cfg = NULL;
    int prc = parse_opts("status", "workers, KV pages per tier and the prefix hit ratio", opts,
                         sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    if (controller) {
        int rc = status_controller(controller, json_out);
        km_config_destroy(cfg);
        return rc;
    }
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
    printf("%-12s %-5s %-10s %5s %8s %8s %8s %9s %9s %9s %8s\n", "WORKER", "UP", "MEMBER", "LEVEL",
           "INFLIGHT", "SERVED", "HIT%", "KV_HOT", "KV_HOST", "KV_DISK", "EV_SEQ");
    size_t i;
    json_t *w;
    json_array_foreach(json_object_get(o, "workers"), i, w)
    {
        json_t *kv = json_object_get(w, "kv_pages");
        /* the controller's view of it, when the router follows one ("-" otherwise) */
        const char *member = json_string_value(json_object_get(w, "member_state"));
        json_t *level = json_object_get(w, "level");
        char lv[16] = "-";
        if (member && json_is_integer(level))
            snprintf(lv, sizeof lv, "%lld", (long long)json_integer_value(level));
        printf("%-12s %-5s %-10s %5s %8lld %8lld %7.1f%% %9lld %9lld %9lld %8lld\n",
               json_string_value(json_object_get(w, "id")),
               json_is_true(json_object_get(w, "up"))
                   ? (json_is_true(json_object_get(w, "draining")) ? "drain" : "yes")
                   : "no",
               member ? member : "-", lv,
               (long long)json_integer_value(json_object_get(w, "inflight")),
               (long long)json_integer_value(json_object_get(w, "served")),
               100 * json_number_value(json_object_get(w, "hit_ratio")),
               (long long)json_integer_value(json_object_get(kv, "hot")),
               (long long)json_integer_value(json_object_get(kv, "host")),
               (long long)json_integer_value(json_object_get(kv, "disk")),
               (long long)json_integer_value(json_object_get(w, "event_seq")));
    }
    printf("(KV columns are pages, as the workers' events report them; MEMBER and LEVEL are the "
           "controller's view: kvmesh status --controller has the recovery history)\n");
    json_decref(o);
    status = 0;
out:
    km_buf_free(&body);
    km_config_destroy(cfg);
    return status;
}

/* ---------------------------------------------------------------- up */

#define UP_MAX 72

typedef struct up_proc {
    char name[32]; /* the id: controller, w0.., router, router1.. */
    const char *role;
    char **argv;
    int argc;
    uv_process_t proc;
    bool running, closing;
    int restarts, pid;
    uint64_t started_ms;
    uv_timer_t backoff;
    int log_fd;
    char requests[128], events[128], admin[128], listen[128], view[128], http[128];
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
    char state_path[4200]; /* <run-dir>/cluster.env; "" = none */
} up_state;

static void up_start(up_proc *p);

/* Rewrites <run-dir>/cluster.env (client/kvmesh.h) after every start and exit, atomically, so a
 * reader never sees half a file. */
static void up_write_state(up_state *st)
{
    if (!st->state_path[0]) return;
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp", st->state_path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    for (int i = 0; i < st->n; i++) {
        const up_proc *p = &st->p[i];
        fprintf(f, "role=%s id=%s pid=%d restarts=%d", p->role, p->name, p->running ? p->pid : 0,
                p->restarts);
        const char *keys[] = {"requests", "events", "admin", "listen", "view", "http"};
        const char *vals[] = {p->requests, p->events, p->admin, p->listen, p->view, p->http};
        for (int k = 0; k < 6; k++)
            if (vals[k][0]) fprintf(f, " %s=%s", keys[k], vals[k]);
        fprintf(f, "\n");
    }
    if (fclose(f) == 0) rename(tmp, st->state_path);
}

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
    up_write_state(st);
    uint64_t now = uv_now(st->loop);
    if (st->stopping) {
        fprintf(stderr, "kvmesh up: %s stopped (status %lld%s%s)\n", p->name, (long long)status,
                sig ? ", signal " : "", sig ? strsignal(sig) : "");
        if (st->running == 0) uv_stop(st->loop);
        return;
    }
    /* 75: a drained worker asking to be restarted (recovery level 3): at once. Anything else is
     * a crash or a kill: after 0.5 s, doubling (up to 8 s) while it keeps dying young. */
    if (now - p->started_ms > 30000) p->restarts = 0;
    uint64_t delay = 500;
    if (status == 75 && !sig)
        delay = 0;
    else if (now - p->started_ms < 10000)
        delay = 500u << (p->restarts < 4 ? p->restarts : 4);
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
    p->pid = p->proc.pid;
    p->st->running++;
    p->started_ms = uv_now(p->st->loop);
    up_write_state(p->st);
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

/* The flags of `spec` ("ID:FLAGS;ID:FLAGS...") that belong to worker id, appended. */
static void push_args_for(char **argv, int *argc, int max, const char *spec, const char *id)
{
    if (!spec) return;
    char *copy = strdup(spec);
    size_t idl = strlen(id);
    for (char *save = NULL, *t = strtok_r(copy, ";", &save); t; t = strtok_r(NULL, ";", &save)) {
        while (*t == ' ') t++;
        if (!strncmp(t, id, idl) && t[idl] == ':') push_args(argv, argc, max, t + idl + 1);
    }
    free(copy);
}

/* A TCP port that nothing on 127.0.0.1 holds now, for --base-port 0. It is drawn below the
 * kernel's ephemeral range (32768 and up), so the tcp://127.0.0.1:* sockets that tests and other
 * clusters bind cannot take it between this look and the daemon's bind, and at random, so two
 * clusters started at once do not pick the same ones. */
static int up_pick_port(const int *taken, int n_taken)
{
    for (int tries = 0; tries < 2000; tries++) {
        int port = 20000 + (int)(random() % 12000);
        bool dup = false;
        for (int i = 0; i < n_taken; i++) dup |= taken[i] == port;
        if (dup) continue;
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
        close(fd);
        if (ok) return port;
    }
    return -1;
}

typedef struct up_ports {
    bool autopick;
    int taken[256], n;
} up_ports;

/* fixed when the user gave ports, a free one otherwise */
static int up_port(up_ports *pp, int fixed)
{
    int port = pp->autopick ? up_pick_port(pp->taken, pp->n) : fixed;
    if (pp->n < 256) pp->taken[pp->n++] = port;
    return port;
}

/* --netns ID=NETNS,WORKER_ADDR,HOST_ADDR: worker ID runs inside network namespace NETNS (made by
 * the caller: `kvmesh chaos partition`), bound to WORKER_ADDR; the controller then listens on
 * HOST_ADDR (the host end of the namespace's veth pair) so that every worker reaches it. */
typedef struct up_netns {
    char worker[64], ns[64], worker_addr[64], host_addr[64];
} up_netns;

static int parse_netns(const char *spec, up_netns *out)
{
    memset(out, 0, sizeof *out);
    if (!spec) return 0;
    if (sscanf(spec, "%63[^=]=%63[^,],%63[^,],%63s", out->worker, out->ns, out->worker_addr,
               out->host_addr) != 4)
        return -1;
    return 1;
}

static int cmd_up(int argc, char **argv)
{
    int64_t n_workers, n_routers, base_port, threads, http_port, cluster_seed, front_port;
    int64_t ctl_port, ctl_admin_port;
    bool with_controller = true;
    const char *model = NULL, *bin_dir = NULL, *log_dir = NULL, *mode = NULL, *kv_bytes = NULL;
    const char *worker_args = NULL, *worker_args_for = NULL, *router_args = NULL;
    const char *ctl_args = NULL, *run_dir = NULL, *netns_spec = NULL;
    const km_opt opts[] = {
        {"workers", NULL, KM_OPT_INT, "2", "workers to run", &n_workers, 1, 64},
        {"routers", NULL, KM_OPT_INT, "1", "router replicas (router, router1, ...)", &n_routers, 1,
         4},
        {"model", NULL, KM_OPT_STR, NULL, "GGUF model (default: the workers' default)", &model, 0,
         0},
        {"threads", NULL, KM_OPT_INT, "0", "threads per worker; 0 = cores / workers", &threads, 0,
         1024},
        {"base-port", NULL, KM_OPT_INT, "7100",
         "worker i listens on base+10i (requests), base+10i+1 (events), base+10i+2 (admin); 0 = "
         "every port of the cluster picked free at random (see cluster.env)",
         &base_port, 0, 65000},
        {"front-port", NULL, KM_OPT_INT, "7000", "router's ZeroMQ port (router i: +i)", &front_port,
         1024, 65535},
        {"http-port", NULL, KM_OPT_INT, "8080",
         "router's OpenAI-compatible HTTP port (router i: +i)", &http_port, 1024, 65535},
        {"controller", "KVMESH_UP_CONTROLLER", KM_OPT_BOOL, "true",
         "run a kvmesh-controller (--no-controller: workers and routers without one)",
         &with_controller, 0, 0},
        {"controller-port", NULL, KM_OPT_INT, "7200",
         "controller's --listen port (workers' heartbeats, operators); --view is this + 1",
         &ctl_port, 1024, 65534},
        {"controller-admin-port", NULL, KM_OPT_INT, "9200", "controller's admin HTTP port",
         &ctl_admin_port, 1024, 65535},
        {"controller-args", NULL, KM_OPT_STR, NULL,
         "extra controller flags, space-separated (e.g. \"--cooldown=2s\")", &ctl_args, 0, 0},
        {"cluster-seed", NULL, KM_OPT_INT, "0", "page-hash seed of the cluster", &cluster_seed, 0,
         0},
        {"mode", NULL, KM_OPT_STR, "kv", "routing: kv, round-robin, random", &mode, 0, 0},
        {"kv-bytes", NULL, KM_OPT_STR, NULL, "hot-tier KV budget per worker (e.g. 256M)", &kv_bytes,
         0, 0},
        {"bin-dir", NULL, KM_OPT_STR, NULL,
         "where kvmesh-router, kvmesh-worker and kvmesh-controller are (default: next to this "
         "kvmesh)",
         &bin_dir, 0, 0},
        {"run-dir", NULL, KM_OPT_STR, NULL,
         "where cluster.env (every process's role, id, pid, endpoints) is kept (default: a new "
         "/tmp/kvmesh-up-XXXXXX)",
         &run_dir, 0, 0},
        {"log-dir", NULL, KM_OPT_STR, NULL, "daemon logs go here (default: inherit stderr)",
         &log_dir, 0, 0},
        {"worker-args", NULL, KM_OPT_STR, NULL,
         "extra flags for every worker, space-separated (e.g. \"--chaos --kv-format=fp8\")",
         &worker_args, 0, 0},
        {"worker-args-for", NULL, KM_OPT_STR, NULL,
         "extra flags for some workers: \"ID:FLAGS;ID:FLAGS\" (e.g. \"w1:--chaos\")",
         &worker_args_for, 0, 0},
        {"router-args", NULL, KM_OPT_STR, NULL, "extra router flags, space-separated", &router_args,
         0, 0},
        {"netns", NULL, KM_OPT_STR, NULL,
         "run one worker in a network namespace: ID=NETNS,WORKER_ADDR,HOST_ADDR (kvmesh chaos "
         "partition makes it)",
         &netns_spec, 0, 0},
    };
    km_config *cfg = NULL;
    int prc = parse_opts("up",
                         "a whole local cluster: a controller, N workers and the router(s), "
                         "restarted when they die, stopped by Ctrl-C",
                         opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    up_netns nsx;
    int has_ns = parse_netns(netns_spec, &nsx);
    if (has_ns < 0) {
        fprintf(stderr, "kvmesh up: --netns wants ID=NETNS,WORKER_ADDR,HOST_ADDR\n");
        km_config_destroy(cfg);
        return 2;
    }
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
    char rdir[4096];
    if (run_dir) {
        snprintf(rdir, sizeof rdir, "%s", run_dir);
        mkdir(rdir, 0755);
    } else {
        snprintf(rdir, sizeof rdir, "/tmp/kvmesh-up-XXXXXX");
        if (!mkdtemp(rdir)) {
            fprintf(stderr, "kvmesh up: cannot make a run directory: %s\n", strerror(errno));
            km_config_destroy(cfg);
            return 1;
        }
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (!threads) threads = cores / n_workers > 0 ? cores / n_workers : 1;
    srandom((unsigned)(getpid() ^ (km_now_ns() >> 10)));
    up_ports pp = {.autopick = base_port == 0};
    up_state st = {0};
    snprintf(st.state_path, sizeof st.state_path, "%s/%s", rdir, KVM_CLUSTER_FILE);
    uv_loop_t loop;
    uv_loop_init(&loop);
    st.loop = &loop;
    if (log_dir) mkdir(log_dir, 0755);
    km_buf wl = {0};
    int status = 0;
    const char *ctl_host = has_ns ? nsx.host_addr : "127.0.0.1";
    char ctl_listen[128] = "", ctl_view[128] = "";
    /* processes: the controller (first, so that workers' first heartbeats find it), the
     * workers, then the routers (which need the workers' endpoints) */
    int total = (with_controller ? 1 : 0) + (int)n_workers + (int)n_routers;
    for (int i = 0; i < total && status == 0; i++) {
        int wi = i - (with_controller ? 1 : 0);
        up_proc *p = &st.p[st.n++];
        p->st = &st;
        p->argv = calloc(96, sizeof *p->argv);
        int k = 0;
        if (wi < 0) {
            int lp = up_port(&pp, (int)ctl_port), vp = up_port(&pp, (int)ctl_port + 1);
            int ap = up_port(&pp, (int)ctl_admin_port);
            p->role = "controller";
            snprintf(p->name, sizeof p->name, "controller");
            snprintf(ctl_listen, sizeof ctl_listen, "tcp://%s:%d", ctl_host, lp);
            snprintf(ctl_view, sizeof ctl_view, "tcp://127.0.0.1:%d", vp);
            snprintf(p->listen, sizeof p->listen, "%s", ctl_listen);
            snprintf(p->view, sizeof p->view, "%s", ctl_view);
            snprintf(p->admin, sizeof p->admin, "http://127.0.0.1:%d", ap);
            p->argv[k++] = xfmt("%s/kvmesh-controller", dir);
            p->argv[k++] = xfmt("--listen=%s", ctl_listen);
            p->argv[k++] = xfmt("--view=%s", ctl_view);
            p->argv[k++] = xfmt("--admin-port=%d", ap);
            p->argv[k++] = xfmt("--controller-id=controller");
            push_args(p->argv, &k, 96, ctl_args);
        } else if (wi < n_workers) {
            int rp = up_port(&pp, (int)base_port + 10 * wi);
            int ep = up_port(&pp, (int)base_port + 10 * wi + 1);
            int ap = up_port(&pp, (int)base_port + 10 * wi + 2);
            p->role = "worker";
            snprintf(p->name, sizeof p->name, "w%d", wi);
            bool in_ns = has_ns && !strcmp(nsx.worker, p->name);
            const char *host = in_ns ? nsx.worker_addr : "127.0.0.1";
            snprintf(p->requests, sizeof p->requests, "tcp://%s:%d", host, rp);
            snprintf(p->events, sizeof p->events, "tcp://%s:%d", host, ep);
            snprintf(p->admin, sizeof p->admin, "http://%s:%d", host, ap);
            if (in_ns) {
                p->argv[k++] = strdup("/usr/sbin/ip");
                if (access(p->argv[0], X_OK)) {
                    free(p->argv[0]);
                    p->argv[0] = strdup("/sbin/ip");
                }
                p->argv[k++] = strdup("netns");
                p->argv[k++] = strdup("exec");
                p->argv[k++] = strdup(nsx.ns);
            }
            p->argv[k++] = xfmt("%s/kvmesh-worker", dir);
            p->argv[k++] = xfmt("--worker-id=%s", p->name);
            p->argv[k++] = xfmt("--listen=%s", p->requests);
            p->argv[k++] = xfmt("--events=%s", p->events);
            p->argv[k++] = xfmt("--admin-host=%s", host);
            p->argv[k++] = xfmt("--admin-port=%d", ap);
            p->argv[k++] = xfmt("--threads=%lld", (long long)threads);
            p->argv[k++] = xfmt("--cluster-seed=%lld", (long long)cluster_seed);
            if (with_controller) p->argv[k++] = xfmt("--controller=%s", ctl_listen);
            if (model) p->argv[k++] = xfmt("--model=%s", model);
            if (kv_bytes) p->argv[k++] = xfmt("--kv-bytes=%s", kv_bytes);
            push_args(p->argv, &k, 96, worker_args);
            push_args_for(p->argv, &k, 96, worker_args_for, p->name);
            km_buf_printf(&wl, "%s%s=%s+%s", wi ? "," : "", p->name, p->requests, p->events);
        } else {
            int ri = wi - (int)n_workers;
            int fp = up_port(&pp, (int)front_port + ri), hp = up_port(&pp, (int)http_port + ri);
            p->role = "router";
            if (ri)
                snprintf(p->name, sizeof p->name, "router%d", ri);
            else
                snprintf(p->name, sizeof p->name, "router");
            snprintf(p->requests, sizeof p->requests, "tcp://127.0.0.1:%d", fp);
            snprintf(p->http, sizeof p->http, "http://127.0.0.1:%d", hp);
            p->argv[k++] = xfmt("%s/kvmesh-router", dir);
            p->argv[k++] = xfmt("--workers=%s", (const char *)wl.data);
            p->argv[k++] = xfmt("--front=%s", p->requests);
            p->argv[k++] = xfmt("--http-port=%d", hp);
            p->argv[k++] = xfmt("--cluster-seed=%lld", (long long)cluster_seed);
            p->argv[k++] = xfmt("--mode=%s", mode);
            if (with_controller) p->argv[k++] = xfmt("--controller=%s", ctl_view);
            if (model) p->argv[k++] = xfmt("--model=%s", model);
            push_args(p->argv, &k, 96, router_args);
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
        const char *bin = p->argv[0];
        for (int a = 0; a < k; a++)
            if (strstr(p->argv[a], "/kvmesh-")) bin = p->argv[a];
        if (access(bin, X_OK)) {
            fprintf(stderr, "kvmesh up: %s not found (build it: make%s)\n", bin,
                    wi < 0 ? "; or run without one: --no-controller" : "");
            status = 1;
        }
        for (int a = 0; a < pp.n; a++)
            if (pp.taken[a] < 0) {
                fprintf(stderr, "kvmesh up: no free port found\n");
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
    const up_proc *r0 = &st.p[st.n - (int)n_routers];
    fprintf(stderr,
            "kvmesh up: router %s, OpenAI API %s/v1, %lld workers (%lld threads each)%s%s%s%s\n"
            "kvmesh up: processes and endpoints in %s\n"
            "kvmesh up: try  kvmesh generate -r %s -p \"Hello\"   |   kvmesh status%s%s   |   "
            "Ctrl-C stops everything\n",
            r0->requests, r0->http, (long long)n_workers, (long long)threads,
            with_controller ? ", controller " : "", with_controller ? ctl_listen : "",
            log_dir ? ", logs in " : "", log_dir ? log_dir : "", st.state_path, r0->requests,
            with_controller ? " --controller " : "", with_controller ? ctl_listen : "");
    uv_run(&loop, UV_RUN_DEFAULT);
    up_write_state(&st);
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
    if (!strcmp(cmd, "recover")) return cmd_recover(argc + 1, argv - 1);
    if (!strcmp(cmd, "chaos")) return kvm_cli_chaos(argc + 1, argv - 1);
    return KVM_CLI_UNKNOWN;
}
