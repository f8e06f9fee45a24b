/*
 * main.c — kvmesh-worker: one model replica serving requests over ZeroMQ (docs/operations.md).
 *
 * Parses the options (flags, KVMESH_* environment twins, --config file), loads the model,
 * creates the engine and the service, installs the signal handlers (SIGTERM and SIGINT drain,
 * a second one stops at once) and runs the service loop on this thread. The exit status is 0
 * after a plain shutdown, WK_EXIT_RESTART (75) after a drain or a shutdown that asks for a
 * restart, 1 when the worker could not start, 2 on bad options.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/worker.h"

static wk_service *g_svc; /* for the signal handler only */

static void wk_on_signal(int signo)
{
    if (g_svc) wk_service_signal(g_svc, signo);
}

typedef struct wk_args {
    const char *model, *listen, *events, *controller, *admin_host, *worker_id, *kv_format;
    const char *alias, *ports_file, *log_level, *log_format, *kv_disk_dir, *cluster_secret;
    const char *speculate, *role;
    const char *peer_listen, *peer_advertise, *peer_mode, *peer_view, *peer_encrypt;
    int64_t peer_lease_ms, peer_pull_ms, peer_warm_pages, old_lease_ms, old_pull_ms;
    int64_t threads, admin_port, page_tokens, max_batch, prefill_chunk, max_running, max_queue;
    int64_t decode_prefill, spec_max_draft, tenant_share, tenant_prefill, step_budget_ms,
        self_draft, self_seqs;
    int64_t kv_shards, kv_tok_groups, kv_expert_groups;
    int64_t sparse_attn, sparse_dense_layers, sparse_window, sparse_shallow_attn, sparse_idle;
    int64_t sparse_slices;
    double sparse_radius;
    const char *sparse_budgets;
    const char *kv_shard_key;
    double spec_factor, blend_fraction;
    int64_t max_ctx, default_max_tokens, heartbeat_ms, drain_ms, event_replay, cluster_seed;
    uint64_t kv_bytes, max_frame, kv_host_bytes, kv_disk_bytes, spec_index_bytes;
    bool chaos, peer, peer_prefault;
    km_sec_args sec;
} wk_args;

/* The options (their values land in g_args: a table, not code). */
static wk_args g_args;

static const km_opt g_opts[] = {
    {"model", NULL, KM_OPT_STR, NULL, "GGUF model (default: $KVMESH_MODEL or the SmolLM2 file)",
     &g_args.model, 0, 0},
    {"threads", NULL, KM_OPT_INT, "0", "engine threads; 0 = all cores", &g_args.threads, 0, 1024},
    {"listen", NULL, KM_OPT_STR, "tcp://127.0.0.1:7100",
     "requests/admin ROUTER endpoint (tcp://HOST:* picks a free port)", &g_args.listen, 0, 0},
    {"events", NULL, KM_OPT_STR, "tcp://127.0.0.1:7101", "KV events PUB endpoint; empty = none",
     &g_args.events, 0, 0},
    {"controller", NULL, KM_OPT_STR, NULL, "controller endpoint for heartbeats; unset = none",
     &g_args.controller, 0, 0},
    {"admin-host", NULL, KM_OPT_STR, "127.0.0.1", "admin HTTP host", &g_args.admin_host, 0, 0},
    {"admin-port", NULL, KM_OPT_INT, "9100", "admin HTTP port; 0 = ephemeral, -1 = off",
     &g_args.admin_port, -1, 65535},
    {"worker-id", NULL, KM_OPT_STR, NULL, "worker id; unset = worker-<pid>", &g_args.worker_id, 0,
     0},
    {"model-alias", NULL, KM_OPT_STR, NULL, "another model name requests may use", &g_args.alias, 0,
     0},
    {"kv-bytes", NULL, KM_OPT_SIZE, "0", "hot-tier KV budget; 0 = the engine default",
     &g_args.kv_bytes, 0, 0},
    {"kv-host-bytes", NULL, KM_OPT_SIZE, "0", "host-RAM KV tier budget; 0 = no host tier",
     &g_args.kv_host_bytes, 0, 0},
    {"kv-disk-dir", NULL, KM_OPT_STR, NULL,
     "disk KV tier directory (pages survive restarts); unset = no disk tier", &g_args.kv_disk_dir,
     0, 0},
    {"kv-disk-bytes", NULL, KM_OPT_SIZE, "0", "disk KV tier budget; 0 = 1G when a dir is set",
     &g_args.kv_disk_bytes, 0, 0},
    {"cluster-secret", NULL, KM_OPT_STR, NULL,
     "the cluster secret file (KEYDIR/cluster.secret, mode 0600): disk pages carry a keyed "
     "MAC and a page without a valid one is dropped, never served; unset = checksum only",
     &g_args.cluster_secret, 0, 0},
    {"kv-format", NULL, KM_OPT_STR, "f16", "KV page format: f16, bf16, fp8, int8, int4",
     &g_args.kv_format, 0, 0},
    {"sparse-attn", NULL, KM_OPT_INT, "0",
     "sparse decode attention: tokens per layer and kv head, in the pages whose keys may score "
     "highest (docs/sparse.md); 0 = off, dense; 1536 recommended at 8k contexts",
     &g_args.sparse_attn, 0, 1 << 24},
    {"sparse-dense-layers", NULL, KM_OPT_INT, "0",
     "with --sparse-attn: the first layers kept dense; 0 = 2, -1 = none",
     &g_args.sparse_dense_layers, -1, 4096},
    {"sparse-window", NULL, KM_OPT_INT, "0",
     "with --sparse-attn: recent pages always attended; 0 = 2", &g_args.sparse_window, 0, 4096},
    {"sparse-shallow-attn", NULL, KM_OPT_INT, "0",
     "with --sparse-attn: the first (--sparse-dense-layers) layers attend to this many tokens "
     "instead of all; 0 = dense",
     &g_args.sparse_shallow_attn, 0, 1 << 24},
    {"sparse-idle", NULL, KM_OPT_INT, "0",
     "with --sparse-attn: steps a hot page a sequence holds may go unread before it goes back "
     "down to host RAM or disk (while the hot tier is short); 0 = 16, -1 = never",
     &g_args.sparse_idle, -1, 1 << 20},
    {"sparse-slices", NULL, KM_OPT_INT, "0",
     "with --sparse-attn: layer slices a step may read of a page on host RAM or disk before it "
     "comes up whole; 0 = the model's layer count, -1 = whole at its first read",
     &g_args.sparse_slices, -1, 1 << 20},
    {"sparse-radius", NULL, KM_OPT_FLOAT, "0",
     "with --sparse-attn: weight of the key spread in a page's score (1 = Quest's upper bound); "
     "0 = 0.5, measured (docs/sparse.md)",
     &g_args.sparse_radius, 0, 0},
    {"sparse-budgets", NULL, KM_OPT_STR, NULL,
     "with --sparse-attn: budget shares per (layer, kv head) from `kvmesh sparse-calibrate` "
     "(docs/sparse.md \"Per-head budgets\"); --sparse-attn stays the mean",
     &g_args.sparse_budgets, 0, 0},
    {"kv-shards", NULL, KM_OPT_INT, "1",
     "KV shards: each tier's budget split evenly between them, each with its own eviction",
     &g_args.kv_shards, 1, 1024},
    {"kv-shard-key", NULL, KM_OPT_STR, "hash",
     "how pages spread over the shards: hash (uniform) or expert (MoE models: a full page goes "
     "to the shard of its tokens' dominant routed expert, PiKV style; docs/moe.md)",
     &g_args.kv_shard_key, 0, 0},
    {"kv-tok-groups", NULL, KM_OPT_INT, "0",
     "expert key: PiKV token groups (shard = page index mod this, xor expert group); 0 = "
     "--kv-shards, 1 = the expert alone picks the shard",
     &g_args.kv_tok_groups, 0, 65536},
    {"kv-expert-groups", NULL, KM_OPT_INT, "0",
     "expert key: expert groups (an expert's group is its id mod this); 0 = --kv-shards",
     &g_args.kv_expert_groups, 0, 65536},
    {"page-tokens", NULL, KM_OPT_INT, "16", "tokens per KV page (power of two)",
     &g_args.page_tokens, 1, 4096},
    {"max-batch-tokens", NULL, KM_OPT_INT, "512", "tokens per engine step", &g_args.max_batch, 1,
     65536},
    {"prefill-chunk", NULL, KM_OPT_INT, "256", "most prompt tokens of one sequence per step",
     &g_args.prefill_chunk, 1, 65536},
    {"decode-prefill", NULL, KM_OPT_INT, "0",
     "most prompt tokens in a step that also decodes (caps inter-token latency spikes while "
     "new prompts arrive); 0 = no extra cap",
     &g_args.decode_prefill, 0, 65536},
    {"step-budget", NULL, KM_OPT_DURATION, "1s",
     "time one engine step should take at most: prefill chunks are sized to it from measured "
     "step times; 0 = no bound",
     &g_args.step_budget_ms, 0, 3600000},
    {"max-running", NULL, KM_OPT_INT, "64", "sequences decoded together", &g_args.max_running, 1,
     4096},
    {"max-running-per-tenant", NULL, KM_OPT_INT, "4",
     "sequences of one tenant (API key or client key group) decoded together while another "
     "tenant has requests here or had one end within the last second; the rest wait in the "
     "queue, newest running first; a tenant alone is never held; 0 = no limit",
     &g_args.tenant_share, 0, 4096},
    {"tenant-prefill", NULL, KM_OPT_INT, "128",
     "most prompt tokens in one step while a tenant runs more than --max-running-per-tenant "
     "(alone here), so another tenant's first request waits for a short step, not a burst of "
     "its prefills; 0 = no cap",
     &g_args.tenant_prefill, 0, 65536},
    {"blend-fraction", NULL, KM_OPT_FLOAT, "0.15",
     "share of a reused chunk's tokens recomputed (req.chunks, docs/blend.md): more in the first "
     "layers than the last; the chunk nearest the question is always computed in full; "
     "0 = pure reuse of the others, negative = never reuse chunks",
     &g_args.blend_fraction, 0, 0},
    {"max-queue", NULL, KM_OPT_INT, "1024", "requests waiting for a slot", &g_args.max_queue, 1,
     1 << 20},
    {"max-ctx", NULL, KM_OPT_INT, "4096", "prompt + completion tokens per request", &g_args.max_ctx,
     2, 1 << 20},
    {"default-max-tokens", NULL, KM_OPT_INT, "256", "completion length when a request says 0",
     &g_args.default_max_tokens, 1, 1 << 20},
    {"speculate", NULL, KM_OPT_STR, "auto",
     "speculative decoding for requests that do not say: auto (suffix drafts where the "
     "step-cost budget says they pay; output unchanged), off, or self (the model drafts over a "
     "4-bit copy of the KV; also lets requests ask for it; docs/speculative.md)",
     &g_args.speculate, 0, 0},
    {"self-spec-draft", NULL, KM_OPT_INT, "3",
     "--speculate self: draft tokens (draft steps) per verification", &g_args.self_draft, 1, 15},
    {"self-spec-seqs", NULL, KM_OPT_INT, "4",
     "--speculate self: sequences whose 4-bit KV copy fits at once at --max-ctx (sizes the copy "
     "store; others draft nothing while it is full)",
     &g_args.self_seqs, 1, 4096},
    {"spec-max-draft", NULL, KM_OPT_INT, "16", "draft tokens per request and step at most",
     &g_args.spec_max_draft, 1, 64},
    {"spec-factor", NULL, KM_OPT_FLOAT, "1", "draft length at most this times the match length",
     &g_args.spec_factor, 0, 0},
    {"spec-index-bytes", NULL, KM_OPT_SIZE, "32M",
     "memory of the index over earlier outputs that drafts come from (all tenants; each sees "
     "only its own)",
     &g_args.spec_index_bytes, 0, 0},
    {"heartbeat", NULL, KM_OPT_DURATION, "1s", "heartbeat interval", &g_args.heartbeat_ms, 10,
     3600000},
    {"drain-timeout", NULL, KM_OPT_DURATION, "30s",
     "grace before in-flight requests are handed back on drain", &g_args.drain_ms, 1, 86400000},
    {"event-replay", NULL, KM_OPT_INT, "65536", "KV events kept for replay", &g_args.event_replay,
     16, 1 << 24},
    {"cluster-seed", NULL, KM_OPT_INT, "0", "page-hash seed shared by the cluster",
     &g_args.cluster_seed, 0, 0},
    {"max-frame", NULL, KM_OPT_SIZE, "1M", "largest frame accepted", &g_args.max_frame, 0, 0},
    {"role", NULL, KM_OPT_STR, "both",
     "what this worker computes (docs/disaggregation.md): both; prefill (long prompts, whose "
     "pages decode workers pull as they are sealed); decode (a long prompt's pages come from a "
     "prefill worker); a router disaggregates only when it has both a prefill and a decode worker",
     &g_args.role, 0, 0},
    {"chaos", NULL, KM_OPT_BOOL, "false",
     "accept the fault-injection admin command `pressure` (tests, `kvmesh chaos`)", &g_args.chaos,
     0, 0},
    {"peer", NULL, KM_OPT_BOOL, "true",
     "KV page transfer (docs/transfer.md): run a transfer node, so that peers pull this "
     "worker's pages and it pulls theirs (pull hints, drain handoff, warm-up); --no-peer = none "
     "(pull hints are ignored, the store is not in a page arena)",
     &g_args.peer, 0, 0},
    {"peer-listen", NULL, KM_OPT_STR, NULL,
     "KV page transfer: listen for peers on HOST:PORT (port 0 = ephemeral: the heartbeat "
     "advertises the port bound); unset = --listen's host, port 0 (0.0.0.0 for tcp://*)",
     &g_args.peer_listen, 0, 0},
    {"peer-advertise", NULL, KM_OPT_STR, NULL,
     "KV page transfer: the host peers connect to (this worker's address on their network); "
     "unset = the --peer-listen host, or 127.0.0.1 when that is a wildcard",
     &g_args.peer_advertise, 0, 0},
    {"peer-mode", NULL, KM_OPT_STR, "am",
     "KV page transfer: am (active messages, default) or get (one-sided reads; RDMA)",
     &g_args.peer_mode, 0, 0},
    {"peer-encrypt", NULL, KM_OPT_STR, "auto",
     "KV page transfer: ask peers for pages encrypted: on, off, or auto (when the peer is not on "
     "this host); pages are always authenticated with the lease's key (docs/transfer.md)",
     &g_args.peer_encrypt, 0, 0},
    {"peer-prefault", NULL, KM_OPT_BOOL, "true",
     "KV page transfer: make the hot tier's page memory resident in the background after start "
     "(a tenth of one CPU at most), so that pages pulled from peers do not fault in 4 KiB at a "
     "time; "
     "--no-peer-prefault leaves it to be faulted in as written",
     &g_args.peer_prefault, 0, 0},
    {"peer-lease", NULL, KM_OPT_DURATION, "10s",
     "KV page transfer: how long pages offered to a peer stay pinned (10s, 500ms; a bare number "
     "is ms)",
     &g_args.peer_lease_ms, 1, 3600000},
    {"peer-pull", NULL, KM_OPT_DURATION, "2s",
     "KV page transfer: a pull's budget when its hint names none (then the pages are "
     "computed)",
     &g_args.peer_pull_ms, 1, 3600000},
    /* the old spellings: durations too, whatever the suffix said */
    {"peer-lease-ms", NULL, KM_OPT_DURATION, NULL, "deprecated: --peer-lease", &g_args.old_lease_ms,
     1, 3600000},
    {"peer-pull-ms", NULL, KM_OPT_DURATION, NULL, "deprecated: --peer-pull", &g_args.old_pull_ms, 1,
     3600000},
    {"peer-view", NULL, KM_OPT_STR, NULL,
     "KV page transfer: the controller's view endpoint (its --view); a drain then hands this "
     "worker's cached chains to the ready peers it names (drain handoff); unset = no handoff",
     &g_args.peer_view, 0, 0},
    {"peer-warm-pages", NULL, KM_OPT_INT, "-1",
     "KV page transfer: once ready, pull up to this many of the peers' most recently used "
     "pages (the warm-up of a new worker; needs --peer-view); -1 = a quarter of the store, 0 = "
     "off",
     &g_args.peer_warm_pages, -1, 1 << 20},
    {"ports-file", NULL, KM_OPT_STR, NULL, "write the bound endpoints here once ready",
     &g_args.ports_file, 0, 0},
    KM_SEC_OPT_ROWS(&g_args.sec),
    {"log-level", NULL, KM_OPT_STR, "info", "debug, info, warn, error", &g_args.log_level, 0, 0},
    {"log-format", NULL, KM_OPT_STR, "text", "text or json", &g_args.log_format, 0, 0},
};

/* The transfer node's addresses where the flags leave them unset (the rule --help and
 * docs/transfer.md state): listen on --listen's host with port 0 (0.0.0.0 for `*`, loopback for
 * a non-TCP endpoint), advertise the listening host unless it is a wildcard, then loopback.
 * --no-peer clears --peer-listen: no node. */
static void wk_peer_defaults(wk_args *a, char *listen, size_t lcap, char *adv, size_t acap)
{
    if (!a->peer) {
        a->peer_listen = NULL;
        return;
    }
    if (!a->peer_listen || !a->peer_listen[0]) {
        const char *l = a->listen ? a->listen : "", *h = l + (strncmp(l, "tcp://", 6) ? 0 : 6);
        const char *colon = strrchr(h, ':');
        size_t n = colon ? (size_t)(colon - h) : strlen(h);
        if (n >= 2 && h[0] == '[' && h[n - 1] == ']') h++, n -= 2; /* [v6] */
        if (h == l || !n || n + 3 > lcap)
            snprintf(listen, lcap, "127.0.0.1:0");
        else if (n == 1 && *h == '*')
            snprintf(listen, lcap, "0.0.0.0:0");
        else
            snprintf(listen, lcap, "%.*s:0", (int)n, h);
        a->peer_listen = listen;
    }
    if (!a->peer_advertise || !a->peer_advertise[0]) {
        const char *l = a->peer_listen, *colon = strrchr(l, ':');
        size_t n = colon ? (size_t)(colon - l) : strlen(l);
        bool wild = !n || (n == 7 && !strncmp(l, "0.0.0.0", 7)) || (n == 2 && !strncmp(l, "::", 2));
        if (wild || n >= acap) {
            snprintf(adv, acap, "127.0.0.1");
            KM_WARN("peer_advertise",
                    "msg=\"the transfer node listens on %s: peers on other hosts cannot reach "
                    "the advertised 127.0.0.1; give --peer-advertise\"",
                    l);
        } else {
            snprintf(adv, acap, "%.*s", (int)n, l);
        }
        a->peer_advertise = adv;
    }
}

int main(int argc, char **argv)
{
    wk_args *a = &g_args;
    km_errbuf err = {{0}};
    km_config *cfg = NULL;
    int crc = km_daemon_config("kvmesh-worker", "serve one model replica over ZeroMQ (kvmesh)",
                               g_opts, sizeof g_opts / sizeof g_opts[0], argc, argv, &a->log_level,
                               &a->log_format, &cfg);
    if (crc) return crc == 1 ? 0 : 2;
    const struct {
        const char *old, *now;
        int64_t *from, *to;
    } renamed[] = {{"peer-lease-ms", "peer-lease", &a->old_lease_ms, &a->peer_lease_ms},
                   {"peer-pull-ms", "peer-pull", &a->old_pull_ms, &a->peer_pull_ms}};
    for (size_t i = 0; i < sizeof renamed / sizeof *renamed; i++) {
        const char *src = km_config_source(cfg, renamed[i].old);
        if (!src || !strcmp(src, "unset")) continue;
        fprintf(stderr, "kvmesh-worker: --%s is deprecated: use --%s (a duration: 10s, 500ms)\n",
                renamed[i].old, renamed[i].now);
        const char *now_src = km_config_source(cfg, renamed[i].now);
        if (now_src && !strcmp(now_src, "default")) *renamed[i].to = *renamed[i].from;
    }
    char peer_listen[160], peer_adv[128];
    wk_peer_defaults(a, peer_listen, sizeof peer_listen, peer_adv, sizeof peer_adv);
    kv_format fmt;
    if (kv_format_parse(a->kv_format, &fmt)) {
        fprintf(stderr, "kvmesh-worker: unknown --kv-format %s\n", a->kv_format);
        km_config_destroy(cfg);
        return 2;
    }
    kv_shard_key key = KV_SHARD_KEY_HASH;
    if (!strcmp(a->kv_shard_key, "expert")) {
        key = KV_SHARD_KEY_EXPERT;
    } else if (strcmp(a->kv_shard_key, "hash")) {
        fprintf(stderr, "kvmesh-worker: --kv-shard-key is hash or expert, not '%s'\n",
                a->kv_shard_key);
        km_config_destroy(cfg);
        return 2;
    }
    int spec_mode = !strcmp(a->speculate, "auto")   ? EN_SPEC_AUTO
                    : !strcmp(a->speculate, "off")  ? EN_SPEC_OFF
                    : !strcmp(a->speculate, "self") ? EN_SPEC_SELF
                                                    : 0;
    if (!(a->sparse_radius >= 0 && a->sparse_radius <= 16)) {
        fprintf(stderr, "kvmesh-worker: --sparse-radius is between 0 and 16\n");
        km_config_destroy(cfg);
        return 2;
    }
    if (!(a->blend_fraction <= 1)) {
        fprintf(stderr, "kvmesh-worker: --blend-fraction is at most 1 (negative: never reuse)\n");
        km_config_destroy(cfg);
        return 2;
    }
    if (!spec_mode || !(a->spec_factor > 0) || a->spec_index_bytes < 4096) {
        fprintf(stderr, "kvmesh-worker: --speculate is auto, off or self, --spec-factor > 0, "
                        "--spec-index-bytes >= 4K\n");
        km_config_destroy(cfg);
        return 2;
    }

    km_worker_role role;
    if (km_worker_role_parse(a->role, &role)) {
        fprintf(stderr, "kvmesh-worker: --role is both, prefill or decode, not '%s'\n", a->role);
        km_config_destroy(cfg);
        return 2;
    }
    int status = 1;
    en_model *m = NULL;
    en_engine *e = NULL, *draft = NULL;
    km_zsec *sec = NULL;
    char default_id[32];
    snprintf(default_id, sizeof default_id, "worker-%d", (int)getpid());
    if (km_sec_daemon_open(&a->sec, "kvmesh-worker", a->worker_id ? a->worker_id : default_id, &sec,
                           &err)) {
        fprintf(stderr, "kvmesh-worker: %s\n", err.msg);
        km_config_destroy(cfg);
        return 2;
    }
    uint8_t secret[KM_SECRET_BYTES];
    if (a->cluster_secret && *a->cluster_secret &&
        km_secret_load(a->cluster_secret, secret, &err)) {
        fprintf(stderr, "kvmesh-worker: --cluster-secret: %s\n", err.msg);
        km_zsec_close(sec);
        km_config_destroy(cfg);
        return 2;
    }
    const char *path = a->model ? a->model : en_default_model_path();
    if (en_model_load(path, &m, &err)) {
        KM_ERROR("model_load", "path=%s msg=\"%s\"", path, err.msg);
        goto out;
    }
    float *shares = NULL;
    if (a->sparse_budgets && *a->sparse_budgets &&
        en_sparse_shares_load(a->sparse_budgets, m, &shares, &err)) {
        KM_ERROR("sparse_budgets", "msg=\"%s\"", err.msg);
        goto out;
    }
    en_engine_opts eo = {.n_threads = (int)a->threads,
                         .max_batch_tokens = (int)a->max_batch,
                         .kv_bytes = (size_t)a->kv_bytes,
                         .kv_format = fmt,
                         .page_tokens = (int)a->page_tokens,
                         .kv_host_bytes = (size_t)a->kv_host_bytes,
                         .kv_disk_dir = a->kv_disk_dir,
                         .kv_disk_bytes = (size_t)a->kv_disk_bytes,
                         .kv_disk_secret = a->cluster_secret && *a->cluster_secret ? secret : NULL,
                         .kv_shards = (int)a->kv_shards,
                         .kv_shard_key = key,
                         .kv_tok_groups = (int)a->kv_tok_groups,
                         .kv_expert_groups = (int)a->kv_expert_groups,
                         .kv_arena = a->peer_listen && a->peer_listen[0],
                         .sparse_attn = (int)a->sparse_attn,
                         .sparse_dense_layers = (int)a->sparse_dense_layers,
                         .sparse_window = (int)a->sparse_window,
                         .sparse_shallow_attn = (int)a->sparse_shallow_attn,
                         .sparse_idle = (int)a->sparse_idle,
                         .sparse_slices = (int)a->sparse_slices,
                         .sparse_radius = (float)a->sparse_radius,
                         .sparse_shares = shares};
    int erc = en_engine_create(m, &eo, &e, &err);
    free(shares);
    explicit_bzero(secret, sizeof secret); /* the store derived its page key at create */
    if (erc) {
        KM_ERROR("engine_create", "msg=\"%s\"", err.msg);
        goto out;
    }
    if (spec_mode == EN_SPEC_SELF) { /* the draft engine: the same model over int4 KV copies */
        const en_hparams *hp = en_model_hparams(m);
        const size_t f16_token = (size_t)hp->n_layers * hp->n_head_kv * hp->head_dim * 2 * 2;
        en_engine_opts dopt = {
            .n_threads = en_engine_threads(e),
            .max_batch_tokens = (int)a->max_running,
            .kv_format = KN_KV_INT4,
            .page_tokens = (int)a->page_tokens,
            /* int4 pages take under a third of f16's bytes; the page being filled is f16 */
            .kv_bytes = (size_t)a->self_seqs * f16_token * ((size_t)a->max_ctx / 3 + 64)};
        if (en_engine_create(m, &dopt, &draft, &err)) {
            KM_ERROR("engine_create", "what=self-speculation msg=\"%s\"", err.msg);
            goto out;
        }
    }
    wk_service_opts so = {
        .worker_id = a->worker_id,
        .listen = a->listen,
        .events = a->events,
        .controller = a->controller,
        .admin_host = a->admin_host,
        .admin_port = (int)a->admin_port,
        .model_alias = a->alias,
        .ports_file = a->ports_file,
        .heartbeat_ms = (int)a->heartbeat_ms,
        .drain_timeout_ms = (int)a->drain_ms,
        .event_replay = (int)a->event_replay,
        .max_frame = (int)(a->max_frame > (1u << 30) ? (1u << 30) : a->max_frame),
        .chaos = a->chaos,
        .role = role,
        .sec = sec,
        .peer_listen = a->peer_listen,
        .peer_advertise = a->peer_advertise,
        .peer_mode = a->peer_mode,
        .peer_encrypt = a->peer_encrypt,
        .peer_lease_ms = (int)a->peer_lease_ms,
        .peer_pull_ms = (int)a->peer_pull_ms,
        .peer_view = a->peer_view,
        .peer_warm_pages = (int)a->peer_warm_pages,
        .peer_no_prefault = !a->peer_prefault,
        .draft = draft,
        .sched = {.max_running = (int)a->max_running,
                  .max_queue = (int)a->max_queue,
                  .max_batch_tokens = (int)a->max_batch,
                  .prefill_chunk = (int)a->prefill_chunk,
                  .decode_prefill = (int)a->decode_prefill,
                  .tenant_share = (int)a->tenant_share,
                  .tenant_prefill = (int)a->tenant_prefill,
                  .blend_fraction = (float)a->blend_fraction,
                  .blend_fraction_set = 1,
                  .step_budget_ms = (int)a->step_budget_ms,
                  .max_ctx = (int)a->max_ctx,
                  .default_max_tokens = (int)a->default_max_tokens,
                  .cluster_seed = (uint64_t)a->cluster_seed,
                  .spec = {.mode = spec_mode,
                           .max_draft = (int)a->spec_max_draft,
                           .factor = (float)a->spec_factor,
                           .self_draft = (int)a->self_draft,
                           .index_bytes = (size_t)a->spec_index_bytes}},
    };
    if (wk_service_create(m, e, &so, &g_svc, &err)) {
        KM_ERROR("service_create", "msg=\"%s\"", err.msg);
        goto out;
    }
    KM_INFO("worker_start",
            "model=%s threads=%d isa=%s kv_format=%s kv_pages=%d speculate=%s chaos=%d role=%s",
            path, en_engine_threads(e), en_engine_isa(e), kv_format_name(fmt),
            kv_store_pages_total(en_engine_kv(e)), a->speculate, (int)a->chaos,
            km_worker_role_name(role));
    km_daemon_signals(wk_on_signal);
    status = wk_service_run(g_svc);
    KM_INFO("worker_exit", "status=%d", status);
out:
    explicit_bzero(secret, sizeof secret);
    if (g_svc) {
        wk_service *s = g_svc;
        g_svc = NULL;
        wk_service_destroy(s);
    }
    en_engine_destroy(draft);
    en_engine_destroy(e);
    en_model_free(m);
    km_zsec_close(sec);
    km_config_destroy(cfg);
    return status;
}
