/*
 * status.c — `kvmesh status` and `kvmesh recover`: the router's /v1/status JSON as a table (or as
 * is with --json); with --controller, the controller's view (member state, recovery level,
 * pressure and every worker's recovery history); recover sends an admin frame to the controller
 * through kvm_admin_call.
 */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"

static const char *level_name(uint32_t level)
{
    static const char *const names[] = {"normal", "evict", "fp8", "drain"};
    return level < 4 ? names[level] : "?";
}

void cli_fmt_bytes(char *out, size_t cap, uint64_t b)
{
    static const char units[] = "BKMGTP";
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 5) v /= 1024, u++;
    if (u == 0)
        snprintf(out, cap, "%lluB", (unsigned long long)b);
    else
        snprintf(out, cap, "%.1f%c", v, units[u]);
}

/* One line per worker, then every worker's recovery history. */
static void view_print(FILE *f, const km_msg_view *v)
{
    fprintf(f, "controller %s (epoch %llu, view %llu), %u workers\n", v->controller,
            (unsigned long long)v->epoch, (unsigned long long)v->seq, v->n_workers);
    fprintf(f, "%-12s %-10s %-7s %-12s %8s %-6s %7s %7s %9s %9s %9s  %s\n", "WORKER", "STATE",
            "ROLE", "LEVEL", "PRESSURE", "KV", "RUNNING", "QUEUED", "SEEN_MS", "XFER_IN",
            "XFER_OUT", "REQUESTS");
    for (uint32_t i = 0; i < v->n_workers; i++) {
        const km_view_worker *w = &v->workers[i];
        char lv[32], in[16] = "-", out[16] = "-";
        snprintf(lv, sizeof lv, "%u %s", w->level, level_name(w->level));
        if (w->peer_addr) { /* a transfer node: KV page bytes pulled in, read out by peers */
            cli_fmt_bytes(in, sizeof in, w->xfer_bytes_in);
            cli_fmt_bytes(out, sizeof out, w->xfer_bytes_out);
        }
        fprintf(f, "%-12s %-10s %-7s %-12s %7.1f%% %-6s %7u %7u %9llu %9s %9s  %s\n", w->id,
                km_member_state_name(w->state), km_worker_role_name(w->role), lv, 100 * w->pressure,
                w->kv_format ? w->kv_format : "-", w->running, w->queue_depth,
                (unsigned long long)w->last_seen_ms, in, out, w->requests ? w->requests : "-");
    }
    static kvm_view_action hist[KM_PROTO_MAX_VIEW_WORKERS * KM_PROTO_MAX_HISTORY];
    size_t n = kvm_view_history(v, hist, sizeof hist / sizeof *hist);
    if (n) fprintf(f, "\nrecovery history, all workers, oldest first:\n");
    for (size_t k = 0; k < n; k++) {
        const km_recovery_action *a = hist[k].action;
        time_t secs = (time_t)(a->at_ms / 1000);
        struct tm tm;
        char when[32];
        strftime(when, sizeof when, "%H:%M:%S", localtime_r(&secs, &tm));
        fprintf(f, "  %s.%03u  %-12s level %u %-6s %-12s %s\n", when, (unsigned)(a->at_ms % 1000),
                hist[k].worker->id, a->level, level_name(a->level), a->reason,
                a->ok ? "ok" : "not acknowledged");
    }
    if (!n)
        fprintf(f, "\nno recovery actions so far\n");
    else /* LEVEL above is the level in effect; an action is not a pin (kvmesh recover --help) */
        fprintf(f, "(LEVEL is the level in effect: level 1 shows 0 again once pressure is low, "
                   "level 2 reverts after the controller's --revert-after)\n");
}

static int status_controller(const char *endpoint, const kvm_sec *sec, bool json_out)
{
    km_msg v;
    km_errbuf err = {{0}};
    if (kvm_view_get(endpoint, sec, 5000, &v, &err)) {
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
            json_array_append_new(
                ws, json_pack(
                        "{s:s,s:s,s:s,s:i,s:f,s:s?,s:i,s:i,s:I,s:s?,s:o}", "id", w->id, "state",
                        km_member_state_name(w->state), "role", km_worker_role_name(w->role),
                        "level", (int)w->level, "pressure", w->pressure, "kv_format", w->kv_format,
                        "running", (int)w->running, "queued", (int)w->queue_depth, "last_seen_ms",
                        (json_int_t)w->last_seen_ms, "requests", w->requests, "history", hist));
        }
        json_t *o =
            json_pack("{s:s,s:I,s:I,s:o}", "controller", v.view.controller, "epoch",
                      (json_int_t)v.view.epoch, "seq", (json_int_t)v.view.seq, "workers", ws);
        char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(o);
    } else {
        view_print(stdout, &v.view);
    }
    km_msg_clear(&v);
    return 0;
}

int cli_cmd_recover(int argc, char **argv)
{
    const char *controller = NULL, *worker = NULL, *timeout_text = NULL, *run_dir = NULL;
    int64_t level = 0, timeout_ms = 0;
    kvm_sec sec = {0};
    const km_opt opts[] = {
        {"controller", NULL, KM_OPT_STR, NULL,
         "the controller's --listen (default: the run directory's controller, else "
         "tcp://127.0.0.1:7200)",
         &controller, 0, 0},
        CLI_RUN_ROW(&run_dir),
        {"worker", NULL, KM_OPT_STR, NULL, "worker id (required)", &worker, 0, 0},
        {"level", NULL, KM_OPT_INT, NULL,
         "1 = evict 25% of unpinned pages, 2 = KV to fp8, 3 = drain and restart (required). An "
         "action, not a pin: status shows the level in effect, so level 1 (a one-off eviction) "
         "shows 0 again at the first calm heartbeat and level 2 reverts to the base format once "
         "pressure stayed low for the controller's --revert-after (30 s); the history keeps it",
         &level, 1, 3},
        {"timeout", NULL, KM_OPT_STR, "10",
         "seconds to wait for the controller's answer (or 500ms, 2m)", &timeout_text, 0, 0},
        CLI_SEC_ROWS(&sec),
    };
    km_config *cfg = NULL;
    int prc =
        cli_parse_opts("recover", "apply a recovery level to a worker, through the controller",
                       opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    if (cli_parse_seconds("recover", "timeout", timeout_text, &timeout_ms)) {
        km_config_destroy(cfg);
        return 2;
    }
    if (!worker || level < 1) {
        fprintf(stderr, "kvmesh recover: give --worker ID and --level 1..3\n");
        km_config_destroy(cfg);
        return 2;
    }
    static cli_run run; /* large: off the stack */
    char ep[512];
    if (cli_run_read("recover", run_dir, &run) ||
        cli_run_endpoint("recover", &run, controller, "controller", CLI_RUN_LISTEN,
                         "tcp://127.0.0.1:7200", ep, sizeof ep)) {
        km_config_destroy(cfg);
        return 2;
    }
    controller = ep;
    if (!sec.cert && run.admin_cert[0]) sec.cert = run.admin_cert;
    km_msg_admin a = {.cmd = KM_ADMIN_RECOVER, .worker = worker, .level = (uint32_t)level};
    km_msg r;
    km_errbuf err = {{0}};
    int status = 1;
    if (kvm_admin_call(controller, &sec, &a, (int)timeout_ms, &r, &err)) {
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

int cli_cmd_status(int argc, char **argv)
{
    const char *http = NULL, *run_dir = NULL;
    bool json_out = false;
    const char *controller = NULL, *api_key = NULL, *worker = NULL;
    kvm_sec sec = {0};
    const km_opt opts[] = {
        {"http", NULL, KM_OPT_STR, NULL,
         "the router's HTTP address (default: the run directory's router, else "
         "http://127.0.0.1:8080)",
         &http, 0, 0},
        CLI_RUN_ROW(&run_dir),
        {"controller", NULL, KM_OPT_STR, NULL,
         "ask the controller (its --listen, e.g. tcp://127.0.0.1:7200, or `controller` with "
         "--run-dir) instead: each worker's member state, recovery level, pressure and recovery "
         "history",
         &controller, 0, 0},
        {"worker", "KVMESH_STATUS_WORKER", KM_OPT_STR, NULL,
         "show one worker's KV store instead, from its admin HTTP address (its --admin-port; "
         "cluster.env `admin=`, e.g. http://127.0.0.1:9100; or its id with --run-dir): pages, "
         "bytes, hits, demotions and evictions per shard, and per expert group under "
         "--kv-shard-key expert",
         &worker, 0, 0},
        {"json", NULL, KM_OPT_BOOL, "false", "print JSON (the router's as is)", &json_out, 0, 0},
        {"api-key", NULL, KM_OPT_STR, NULL,
         "an operator's HTTP API key, for a router with --api-keys (kvmesh up: "
         "RUN/keys/private/api_key.admin)",
         &api_key, 0, 0},
        CLI_SEC_ROWS(&sec),
    };
    km_config *cfg = NULL;
    int prc = cli_parse_opts("status", "workers, KV pages per tier and the prefix hit ratio", opts,
                             sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    if (!controller)
        controller =
            cli_env_deprecated("status", "KVMESH_STATUS_CONTROLLER", "KVMESH_CONTROLLER", NULL);
    if (!worker)
        worker = cli_env_deprecated("status", "KVMESH_WORKER", "KVMESH_STATUS_WORKER", "http");
    static cli_run run; /* large: off the stack */
    char ep[512];
    if (cli_run_read("status", run_dir, &run)) {
        km_config_destroy(cfg);
        return 2;
    }
    if (!sec.cert && run.admin_cert[0]) sec.cert = run.admin_cert;
    if (!api_key && run.api_key[0]) api_key = run.api_key;
    int rc = 0;
    if (worker)
        rc = cli_run_endpoint("status", &run, worker, "worker", CLI_RUN_ADMIN, "", ep, sizeof ep);
    else if (controller)
        rc = cli_run_endpoint("status", &run, controller, "controller", CLI_RUN_LISTEN, "", ep,
                              sizeof ep);
    else
        rc = cli_run_endpoint("status", &run, http, "router", CLI_RUN_HTTP, "http://127.0.0.1:8080",
                              ep, sizeof ep);
    if (rc || worker || controller) {
        if (!rc) rc = worker ? cli_status_worker(ep) : status_controller(ep, &sec, json_out);
        km_config_destroy(cfg);
        return rc;
    }
    char url[600];
    snprintf(url, sizeof url, "%s/v1/status", ep);
    km_buf body = {0};
    int st = 0;
    km_errbuf err = {{0}};
    int status = 1;
    if (kvm_http_get_bearer(url, api_key, 5000, &body, &st, &err)) {
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
