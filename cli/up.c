/*
 * up.c — `kvmesh up`: a whole local cluster on one machine, a controller, N workers and the
 * router(s), restarted when they die, stopped by Ctrl-C. This file is the command: its options,
 * the directories it uses, and the run; up_plan.c decides what runs where, up_procs.c supervises
 * the processes and keeps <run-dir>/cluster.env (client/kvmesh.h) so that tools such as
 * `kvmesh chaos` find them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/up.h"
#include "model/model.h"

/* The option table; 0, 1 (help shown) or 2 (bad usage). */
static int up_parse(int argc, char **argv, up_opts *o, km_config **cfg)
{
    memset(o, 0, sizeof *o);
    o->with_controller = true;
    const km_opt opts[] = {
        {"workers", NULL, KM_OPT_INT, "2", "workers to run", &o->n_workers, 1, 64},
        {"prefill-workers", NULL, KM_OPT_INT, "0",
         "workers w0.. that run --role=prefill (docs/disaggregation.md); with this or "
         "--decode-workers, the cluster has prefill + decode workers and --workers is not used",
         &o->n_prefill, 0, 32},
        {"decode-workers", NULL, KM_OPT_INT, "0",
         "workers after the prefill ones that run --role=decode", &o->n_decode, 0, 32},
        {"routers", NULL, KM_OPT_INT, "1", "router replicas (router, router1, ...)", &o->n_routers,
         1, 4},
        {"model", NULL, KM_OPT_STR, NULL, "GGUF model (default: the workers' default)", &o->model,
         0, 0},
        {"threads", NULL, KM_OPT_INT, "0", "threads per worker; 0 = cores / workers", &o->threads,
         0, 1024},
        {"base-port", NULL, KM_OPT_INT, "7100",
         "worker i listens on base+10i (requests), base+10i+1 (events), base+10i+2 (admin); 0 = "
         "every port of the cluster picked free at random (see cluster.env)",
         &o->base_port, 0, 65000},
        {"front-port", NULL, KM_OPT_INT, "7000", "router's ZeroMQ port (router i: +i)",
         &o->front_port, 1024, 65535},
        {"http-port", NULL, KM_OPT_INT, "8080",
         "router's OpenAI-compatible HTTP port (router i: +i)", &o->http_port, 1024, 65535},
        {"controller", "KVMESH_UP_CONTROLLER", KM_OPT_BOOL, "true",
         "run a kvmesh-controller (--no-controller: workers and routers without one)",
         &o->with_controller, 0, 0},
        {"controller-port", NULL, KM_OPT_INT, "7200",
         "controller's --listen port (workers' heartbeats, operators); --view is this + 1",
         &o->ctl_port, 1024, 65534},
        {"controller-admin-port", NULL, KM_OPT_INT, "9200", "controller's admin HTTP port",
         &o->ctl_admin_port, 1024, 65535},
        {"controller-args", NULL, KM_OPT_STR, NULL,
         "extra controller flags, space-separated (e.g. \"--cooldown=2s\")", &o->ctl_args, 0, 0},
        {"cluster-seed", NULL, KM_OPT_INT, "0", "page-hash seed of the cluster", &o->cluster_seed,
         0, 0},
        {"mode", NULL, KM_OPT_STR, "kv", "routing: kv, round-robin, random", &o->mode, 0, 0},
        {"kv-bytes", NULL, KM_OPT_STR, NULL, "hot-tier KV budget per worker (e.g. 256M)",
         &o->kv_bytes, 0, 0},
        {"bin-dir", NULL, KM_OPT_STR, NULL,
         "where kvmesh-router, kvmesh-worker and kvmesh-controller are (default: next to this "
         "kvmesh)",
         &o->bin_dir, 0, 0},
        {"run-dir", NULL, KM_OPT_STR, NULL,
         "where cluster.env (every process's role, id, pid, endpoints) is kept (default: a new "
         "/tmp/kvmesh-up-XXXXXX)",
         &o->run_dir, 0, 0},
        {"log-dir", NULL, KM_OPT_STR, NULL, "daemon logs go here (default: inherit stderr)",
         &o->log_dir, 0, 0},
        {"worker-args", NULL, KM_OPT_STR, NULL,
         "extra flags for every worker, space-separated (e.g. \"--chaos --kv-format=fp8\"); "
         "each worker runs a KV transfer node on 127.0.0.1 (a planned port, cluster.env's "
         "peer=) unless they say --no-peer or their own --peer-listen",
         &o->worker_args, 0, 0},
        {"worker-args-for", NULL, KM_OPT_STR, NULL,
         "extra flags for some workers: \"ID:FLAGS;ID:FLAGS\" (e.g. \"w1:--chaos\")",
         &o->worker_args_for, 0, 0},
        {"router-args", NULL, KM_OPT_STR, NULL, "extra router flags, space-separated",
         &o->router_args, 0, 0},
        {"insecure", "KVMESH_UP_INSECURE", KM_OPT_BOOL, "false",
         "run every daemon without CURVE (anyone who reaches a port is admitted); by default the "
         "cluster's keys are made in <run-dir>/keys and every socket is CURVE",
         &o->insecure, 0, 0},
        {"netns", NULL, KM_OPT_STR, NULL,
         "run one worker in a network namespace: ID=NETNS,WORKER_ADDR,HOST_ADDR (kvmesh chaos "
         "partition makes it)",
         &o->netns_spec, 0, 0},
    };
    int prc = cli_parse_opts("up",
                             "a whole local cluster: a controller, N workers and the router(s), "
                             "restarted when they die, stopped by Ctrl-C (kvmesh scale changes "
                             "the number of workers while it runs)",
                             opts, sizeof opts / sizeof *opts, argc, argv, cfg);
    if (prc) return prc;
    if (o->n_prefill + o->n_decode > 0) o->n_workers = o->n_prefill + o->n_decode;
    int ns = up_parse_netns(o->netns_spec, &o->ns);
    if (ns < 0) {
        fprintf(stderr, "kvmesh up: --netns wants ID=NETNS,WORKER_ADDR,HOST_ADDR\n");
        km_config_destroy(*cfg);
        *cfg = NULL;
        return 2;
    }
    o->has_ns = ns == 1;
    /* a model that is not there would only show as workers restarting forever */
    const char *model = o->model ? o->model : md_default_model_path();
    bool own_model = (o->worker_args && strstr(o->worker_args, "--model")) ||
                     (o->worker_args_for && strstr(o->worker_args_for, "--model"));
    if (!own_model && access(model, R_OK)) {
        fprintf(stderr, "kvmesh up: model %s: %s (give --model PATH or set KVMESH_MODEL)\n", model,
                strerror(errno));
        km_config_destroy(*cfg);
        *cfg = NULL;
        return 2;
    }
    return 0;
}

/* How long Ctrl-C waits before SIGKILL: the workers' drain time-out (--drain-timeout in
 * --worker-args or --worker-args-for, else the workers' default 30 s), plus 10 s: a worker with a
 * transfer node may linger up to 5 s after its drain while peers pull its pages
 * (docs/transfer.md), then persists or demotes them. */
static int64_t up_stop_ms(const up_opts *o)
{
    int64_t drain = -1;
    const char *lists[] = {o->worker_args, o->worker_args_for};
    for (int i = 0; i < 2; i++)
        for (const char *p = lists[i]; p && (p = strstr(p, "--drain-timeout")); p++) {
            char v[32] = "";
            sscanf(p + strlen("--drain-timeout"), "%*[= ]%31[^ ;]", v);
            int64_t ms;
            if (!km_parse_duration_ms(v, &ms) && ms > drain) drain = ms;
        }
    return (drain < 0 ? 30000 : drain) + 10000;
}

/* The daemons: --bin-dir, or the directory of this kvmesh. */
static void up_bin_dir(const up_opts *o, char *dir, size_t cap)
{
    if (o->bin_dir) {
        snprintf(dir, cap, "%s", o->bin_dir);
        return;
    }
    ssize_t l = readlink("/proc/self/exe", dir, cap - 1);
    if (l <= 0) l = 0;
    dir[l] = 0;
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = 0;
    else
        snprintf(dir, cap, ".");
}

/* --run-dir (made if missing), or a new /tmp/kvmesh-up-XXXXXX. */
static int up_run_dir(const up_opts *o, char *dir, size_t cap)
{
    if (o->run_dir) {
        snprintf(dir, cap, "%s", o->run_dir);
        mkdir(dir, 0755);
        return 0;
    }
    snprintf(dir, cap, "/tmp/kvmesh-up-XXXXXX");
    if (mkdtemp(dir)) return 0;
    fprintf(stderr, "kvmesh up: cannot make a run directory: %s\n", strerror(errno));
    return -1;
}

/* What up prints at once, and the "cluster ready" text it prints when every worker and router is
 * ready: commands that reach this cluster as they are, through its run directory. */
static void up_banner(up_state *st, const up_opts *o, const char *run_dir)
{
    const up_proc *r0 = &st->p[st->n - (int)o->n_routers];
    const char *ctl_listen = o->with_controller ? st->p[0].listen : "";
    fprintf(stderr,
            "kvmesh up: router %s, OpenAI API %s/v1, %lld workers (%lld threads each)%s%s%s%s\n"
            "kvmesh up: processes and endpoints in %s; starting (a \"cluster ready\" line "
            "follows)\n",
            r0->requests, r0->http, (long long)o->n_workers, (long long)o->threads,
            o->with_controller ? ", controller " : "", ctl_listen, o->log_dir ? ", logs in " : "",
            o->log_dir ? o->log_dir : "", st->state_path);
    if (o->keydir)
        fprintf(stderr,
                "kvmesh up: keys in %s; HTTP API keys in %s/private/api_key.client (completions) "
                "and api_key.admin (also /v1/status: kvmesh status --api-key)\n",
                o->keydir, o->keydir);
    char ctl[3600] = "", curl[1400] = "";
    if (o->with_controller)
        snprintf(ctl, sizeof ctl,
                 "  kvmesh status --run-dir %.1000s --controller controller   (members, recovery)\n"
                 "  kvmesh recover --run-dir %.1000s --worker w0 --level 1\n"
                 "  kvmesh scale --run-dir %.1000s --workers %lld   (add or remove workers)\n",
                 run_dir, run_dir, run_dir, (long long)o->n_workers + 1);
    snprintf(curl, sizeof curl, "  curl %s%.1000s%s%s/v1/models\n",
             o->keydir ? "-H \"Authorization: Bearer $(cat " : "", o->keydir ? o->keydir : "",
             o->keydir ? "/private/api_key.client)\" " : "", r0->http);
    snprintf(st->ready_msg, sizeof st->ready_msg,
             "kvmesh up: cluster ready: %lld workers, %lld router%s; these commands reach it "
             "(export KVMESH_RUN_DIR=%.1000s to leave out --run-dir):\n"
             "  kvmesh generate --run-dir %.1000s -p \"Hello\"\n"
             "  kvmesh status --run-dir %.1000s\n"
             "%s%s"
             "kvmesh up: Ctrl-C stops everything\n",
             (long long)o->n_workers, (long long)o->n_routers, o->n_routers > 1 ? "s" : "", run_dir,
             run_dir, run_dir, ctl, curl);
}

/* Security on by default: the cluster's keys in <run-dir>/keys (kept when they exist, so a
 * restarted `kvmesh up` with the same --run-dir keeps its keys; workers are added), or one
 * warning with --insecure. */
static int up_keys(up_opts *o, const char *keydir)
{
    if (o->insecure) {
        fprintf(stderr, "kvmesh up: WARNING: --insecure: no CURVE and no keys, anyone who reaches "
                        "a port is admitted\n");
        return 0;
    }
    char names[64][8];
    const char *ids[64];
    for (int i = 0; i < o->n_workers && i < 64; i++) {
        snprintf(names[i], sizeof names[i], "w%d", i);
        ids[i] = names[i];
    }
    km_errbuf err = {{0}};
    if (km_keydir_init_cluster(keydir, ids, (int)o->n_workers, &err) < 0) {
        fprintf(stderr, "kvmesh up: cannot make the cluster's keys in %s: %s\n", keydir, err.msg);
        return -1;
    }
    o->keydir = keydir;
    /* HTTP API keys for the OpenAI front: a client's and an operator's (for /v1/status), the
     * keys themselves in private/api_key.NAME (0600) since they are shown only once */
    snprintf(o->api_keys, sizeof o->api_keys, "%s/api_keys", keydir);
    if (access(o->api_keys, F_OK) == 0) return 0;
    const struct {
        const char *tenant;
        km_role role;
    } keys[] = {{"client", KM_ROLE_CLIENT}, {"admin", KM_ROLE_OPERATOR}};
    for (int i = 0; i < 2; i++) {
        char tok[KM_APIKEY_TOKEN_MAX], path[4300];
        snprintf(path, sizeof path, "%s/private/api_key.%s", keydir, keys[i].tenant);
        if (km_apikeys_add(o->api_keys, keys[i].tenant, keys[i].role, NULL, tok, sizeof tok,
                           &err) ||
            km_write_file_atomic(path, tok, strlen(tok), 0600, &err)) {
            fprintf(stderr, "kvmesh up: cannot make the HTTP API keys: %s\n", err.msg);
            return -1;
        }
    }
    return 0;
}

int cli_cmd_up(int argc, char **argv)
{
    up_opts o;
    km_config *cfg = NULL;
    int prc = up_parse(argc, argv, &o, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    char dir[4096], rdir[4096];
    up_bin_dir(&o, dir, sizeof dir);
    if (up_run_dir(&o, rdir, sizeof rdir)) {
        km_config_destroy(cfg);
        return 1;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (!o.threads) o.threads = cores / o.n_workers > 0 ? cores / o.n_workers : 1;
    srandom((unsigned)(getpid() ^ (km_now_ns() >> 10)));
    up_state st = {.o = &o, .bin_dir = dir};
    st.stop_ms = up_stop_ms(&o);
    snprintf(st.state_path, sizeof st.state_path, "%s/%s", rdir, KVM_CLUSTER_FILE);
    uv_loop_t loop;
    uv_loop_init(&loop);
    st.loop = &loop;
    if (o.log_dir) mkdir(o.log_dir, 0755);
    char keydir[4200];
    snprintf(keydir, sizeof keydir, "%s/keys", rdir);
    if (up_keys(&o, keydir)) {
        uv_loop_close(&loop);
        km_config_destroy(cfg);
        return 1;
    }
    int status = up_plan(&st, &o, dir);
    if (status == 0) {
        up_banner(&st, &o, rdir);
        up_start_all(&st);
        up_scale_start(&st);
        up_wait(&st);
        up_scale_stop(&st);
        fprintf(stderr, "kvmesh up: all processes stopped\n");
    }
    up_cleanup(&st);
    uv_loop_close(&loop);
    km_config_destroy(cfg);
    return status;
}
