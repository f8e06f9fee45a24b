/*
 * main.c — the kvmesh-router binary: flags (each with a KVMESH_ environment twin and an optional
 * config file, common/svc.h), the worker list, signals, and rt_router_run. Everything else is in
 * the other files of router/ (internal.h has the map); see router.h for the contract and
 * docs/router.md for operation.
 *
 * Workers are given as --workers ID=REQUESTS_URL+EVENTS_URL,... (e.g.
 * w0=tcp://127.0.0.1:7100+tcp://127.0.0.1:7101); `kvmesh up` writes this list for a local
 * cluster. With --controller (the controller's view PUB) the list may be empty: the view names
 * the workers, and workers it names later are connected as they come (scale-out without a
 * restart). SIGINT/SIGTERM stop the loop; requests still held get a 503 so no client hangs.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/router.h"

static rt_router *g_router;

static void on_signal(int signo)
{
    (void)signo;
    if (g_router) rt_router_stop(g_router); /* uv_async_send: async-signal-safe */
}

/* Splits "id=req+ev,id=req+ev" in place. */
static int parse_workers(char *s, rt_worker_cfg *out, int max, km_errbuf *err)
{
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(s, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        if (!*tok) continue;
        if (n == max) return km_errf(err, KM_ERANGE, "--workers: more than %d workers", max);
        char *eq = strchr(tok, '=');
        if (!eq || eq == tok)
            return km_errf(err, KM_EINVAL, "--workers: '%s' is not ID=REQUESTS_URL+EVENTS_URL",
                           tok);
        *eq = 0;
        char *plus = strchr(eq + 1, '+');
        if (plus) *plus = 0;
        out[n].id = tok;
        out[n].requests_url = eq + 1;
        out[n].events_url = plus ? plus + 1 : NULL;
        if (!*out[n].requests_url)
            return km_errf(err, KM_EINVAL, "--workers: worker '%s' has no requests URL", tok);
        n++;
    }
    if (!n) return km_errf(err, KM_EINVAL, "--workers: no worker given");
    return n;
}

/* The bound endpoints, for whoever started the router on ephemeral ports (written atomically). */
static void write_ports(const rt_router *r, const char *path)
{
    char ep[256] = "";
    rt_router_front_endpoint(r, ep, sizeof ep);
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "front=%s\nhttp=%d\nadmin=%d\n", ep, rt_router_http_port(r),
            rt_router_admin_port(r));
    fclose(f);
    rename(tmp, path);
}

/* Creates the router, runs it until a signal stops it, destroys it: the exit status. */
static int serve(const rt_config *c, const char *ports_file)
{
    km_errbuf err = {{0}};
    if (rt_router_create(c, &g_router, &err)) {
        KM_ERROR("router_create", "msg=\"%s\"", err.msg);
        return 1;
    }
    if (ports_file) write_ports(g_router, ports_file);
    km_daemon_signals(on_signal);
    rt_router_run(g_router);
    KM_INFO("router_exit", "status=%d", 0);
    rt_router *r = g_router;
    g_router = NULL;
    rt_router_destroy(r);
    return 0;
}

/* Everything the options set (their table below points into g_args: a table, not code). */
typedef struct rt_args {
    rt_config c;
    const char *workers, *mode, *log_level, *log_format, *ports_file;
    int64_t max_queue_per_key, max_inflight_per_key;
    int64_t http_port, admin_port, page_tokens, slots, max_inflight, max_queue, attempts, dmax,
        max_ctx;
    int64_t max_n;
    int64_t sync_ms, ttl_ms, queue_ms, cluster_seed, index_pages, view_ms, request_ms;
    uint64_t max_body, max_prompt_bytes, max_buffered;
    km_sec_args sec_args;
} rt_args;

static rt_args g_args;

static const km_opt g_opts[] = {
    {"model", NULL, KM_OPT_STR, NULL,
     "GGUF model: tokenizer, chat template, fingerprint (default: $KVMESH_MODEL or the SmolLM2 "
     "file)",
     &g_args.c.model_path, 0, 0},
    {"model-name", NULL, KM_OPT_STR, NULL, "another model name clients may use",
     &g_args.c.model_name, 0, 0},
    {"fingerprint", NULL, KM_OPT_STR, NULL,
     "model fingerprint override (hex); default: computed like the workers", &g_args.c.fingerprint,
     0, 0},
    {"cluster-seed", NULL, KM_OPT_INT, "0", "page-hash seed; must equal the workers'",
     &g_args.cluster_seed, 0, 0},
    {"page-tokens", NULL, KM_OPT_INT, "16", "tokens per KV page; must equal the workers'",
     &g_args.page_tokens, 1, 4096},
    {"front", NULL, KM_OPT_STR, "tcp://127.0.0.1:7000", "ZeroMQ ROUTER endpoint for clients",
     &g_args.c.front_url, 0, 0},
    {"http-host", NULL, KM_OPT_STR, "127.0.0.1", "OpenAI-compatible HTTP host", &g_args.c.http_host,
     0, 0},
    {"http-port", NULL, KM_OPT_INT, "8080", "HTTP port; 0 = ephemeral, -1 = off", &g_args.http_port,
     -1, 65535},
    {"admin-host", NULL, KM_OPT_STR, "127.0.0.1", "admin HTTP host", &g_args.c.admin_host, 0, 0},
    {"admin-port", NULL, KM_OPT_INT, "-1",
     "separate admin HTTP port (/metrics, /healthz, /readyz); -1 = off (the HTTP port serves "
     "them too)",
     &g_args.admin_port, -1, 65535},
    {"workers", NULL, KM_OPT_STR, NULL,
     "workers: ID=REQUESTS_URL+EVENTS_URL,... (required unless --controller is given)",
     &g_args.workers, 0, 0},
    {"controller", NULL, KM_OPT_STR, NULL,
     "the controller's cluster-view PUB endpoint (its --view); unset = no controller: route "
     "by the router's own liveness checks alone",
     &g_args.c.controller_url, 0, 0},
    {"view-timeout", NULL, KM_OPT_DURATION, "5s",
     "a controller view older than this is ignored (the router falls back to its own "
     "liveness checks)",
     &g_args.view_ms, 1, 3600000},
    {"mode", NULL, KM_OPT_STR, "kv", "routing: kv, round-robin or random", &g_args.mode, 0, 0},
    {"w-prefill", NULL, KM_OPT_FLOAT, "1", "cost of one uncached prompt token",
     &g_args.c.policy.w_prefill, 0, 1e9},
    {"w-decode", NULL, KM_OPT_FLOAT, "32", "cost of one running request on a worker",
     &g_args.c.policy.w_decode, 0, 1e9},
    {"w-queue", NULL, KM_OPT_FLOAT, "256", "cost of one request waiting on a worker",
     &g_args.c.policy.w_queue, 0, 1e9},
    {"tie-band", NULL, KM_OPT_FLOAT, "16", "costs within this are ties (rendezvous decides)",
     &g_args.c.policy.tie_band, 0, 1e9},
    {"credit-host", NULL, KM_OPT_FLOAT, "0.8", "fraction of a host-RAM page counted cached",
     &g_args.c.policy.tier_credit[KM_TIER_HOST], 0, 1},
    {"pull-margin", NULL, KM_OPT_FLOAT, "0.8",
     "tell a worker to pull a prefix another holds when pulling costs less than recomputing "
     "times this (docs/transfer.md)",
     &g_args.c.policy.pull_margin, 0, 10},
    {"pull-default-rate", NULL, KM_OPT_FLOAT, "1e9",
     "pull rate in bytes/s assumed until workers have measured one (a pull between workers "
     "of one host, end to end; measured rates replace it); 0 = none (recompute until measured)",
     &g_args.c.policy.pull_default_bps, 0, 1e12},
    {"pd-min-tokens", NULL, KM_OPT_INT, "512",
     "prefill/decode disaggregation (docs/disaggregation.md): with a prefill and a decode worker "
     "in the controller's view, a prompt with at least this many tokens uncached on the decode "
     "worker chosen is computed by a prefill worker and its pages pulled as they are sealed; "
     "0 = never",
     &g_args.c.policy.pd_min_tokens, 0, 1 << 24},
    {"chunk-credit", NULL, KM_OPT_FLOAT, "0.5",
     "share of the tokens of a request's chunks (docs/blend.md) a worker holding their pages is "
     "credited as cached (the rest is the recompute that repairs them); 0 = chunks not credited",
     &g_args.c.policy.chunk_credit, 0, 1},
    {"credit-disk", NULL, KM_OPT_FLOAT, "0.5", "fraction of a disk page counted cached",
     &g_args.c.policy.tier_credit[KM_TIER_DISK], 0, 1},
    {"worker-slots", NULL, KM_OPT_INT, "8", "requests a worker runs at once (cost model)",
     &g_args.slots, 1, 1 << 20},
    {"max-inflight", NULL, KM_OPT_INT, "64",
     "requests this router sends one worker; more wait in the router", &g_args.max_inflight, 1,
     1 << 20},
    {"max-queue-per-key", NULL, KM_OPT_INT, "256",
     "queued requests of one key's tenant (ZeroMQ client key or API key); beyond it that tenant "
     "gets 429 rate_limit_exceeded; 0 = no limit but --max-queue",
     &g_args.max_queue_per_key, 0, 1 << 24},
    {"max-inflight-per-key", NULL, KM_OPT_INT, "4",
     "requests of one key's tenant at workers at once while another tenant is active; more "
     "wait in the router queue (even with a worker free); a key alone is never held; 0 = no "
     "limit but --max-inflight (docs/router.md, \"Tenants\")",
     &g_args.max_inflight_per_key, 0, 1 << 24},
    {"max-tokens-per-sec-per-key", NULL, KM_OPT_FLOAT, "0",
     "prompt + generated tokens per second of one key's tenant (a token bucket one second "
     "deep); past it: 429 with Retry-After; 0 = no limit",
     &g_args.c.max_tokens_per_sec_per_key, 0, 1e12},
    {"max-queue", NULL, KM_OPT_INT, "1024", "router queue; beyond it: 529 overloaded",
     &g_args.max_queue, 0, 1 << 24},
    {"max-attempts", NULL, KM_OPT_INT, "3",
     "a request fails when this many different workers failed it, or this many attempts in "
     "a row gave no token",
     &g_args.attempts, 1, 100},
    {"default-max-tokens", NULL, KM_OPT_INT, "256", "completion length when a request says 0",
     &g_args.dmax, 1, 1 << 20},
    {"max-ctx", NULL, KM_OPT_INT, "4096",
     "prompt + completion tokens per request, as the workers' --max-ctx (HTTP requests "
     "asking for more get 400; 0: not checked)",
     &g_args.max_ctx, 0, 1 << 24},
    {"sync-timeout", NULL, KM_OPT_DURATION, "3s",
     "wait for a KV event replay before forgetting the worker's pages", &g_args.sync_ms, 1,
     3600000},
    {"pending-ttl", NULL, KM_OPT_DURATION, "30s",
     "how long a routed, unconfirmed prefix counts as cached", &g_args.ttl_ms, 1, 86400000},
    {"queue-timeout", NULL, KM_OPT_DURATION, "60s",
     "a request waiting longer in the router queue gets 503", &g_args.queue_ms, 1, 86400000},
    {"migrate-replay", NULL, KM_OPT_BOOL, "false",
     "migrate greedy/seeded requests by regenerating the streamed tokens from the prompt; "
     "off (default): every migration continues from prompt + streamed tokens (the same "
     "output, without redoing the work)",
     &g_args.c.migrate_replay, 0, 0},
    {"index-pages", NULL, KM_OPT_INT, "262144", "pages the prefix index holds (64 B each)",
     &g_args.index_pages, 16, 1 << 28},
    {"max-body", NULL, KM_OPT_SIZE, "4M", "largest HTTP request body", &g_args.max_body, 0, 0},
    {"max-http-buffered", NULL, KM_OPT_SIZE, "256M",
     "request bytes the HTTP front holds across all connections; a read over it gets 503 and "
     "its connection closes",
     &g_args.max_buffered, 0, 0},
    {"max-prompt-bytes", NULL, KM_OPT_SIZE, "1M",
     "a text prompt (a chat: its rendered template) longer than this gets 413 before it is "
     "tokenized; 0 = no limit",
     &g_args.max_prompt_bytes, 0, 0},
    {"request-timeout", NULL, KM_OPT_DURATION, "10m",
     "every request ends by then at the latest: 504, and a cancel to its worker (a request's "
     "own deadline_ms ends it earlier); 0 = none",
     &g_args.request_ms, 0, 86400000},
    {"ports-file", NULL, KM_OPT_STR, NULL, "write the bound endpoints here once ready",
     &g_args.ports_file, 0, 0},
    KM_SEC_OPT_ROWS(&g_args.sec_args),
    {"api-keys", NULL, KM_OPT_STR, NULL,
     "HTTP API key file (kvmesh keys api-add): every HTTP request but /healthz and /readyz "
     "needs a Bearer key; required for the HTTP front unless --insecure",
     &g_args.c.api_keys, 0, 0},
    {"client-tenants", NULL, KM_OPT_STR, NULL,
     "ZeroMQ client tenants: `KEYNAME TENANT` lines putting client keys in one tenant, which "
     "share cached prefixes; every other key is a tenant of its own (docs/security.md)",
     &g_args.c.client_tenants, 0, 0},
    {"tls-cert", NULL, KM_OPT_STR, NULL,
     "PEM certificate chain: the OpenAI HTTP front speaks HTTPS only (TLS 1.2 or later); "
     "needs --tls-key",
     &g_args.c.tls_cert, 0, 0},
    {"tls-key", NULL, KM_OPT_STR, NULL, "PEM private key of --tls-cert", &g_args.c.tls_key, 0, 0},
    {"cors-origins", NULL, KM_OPT_STR, NULL,
     "browser origins that may call the HTTP front (CORS): \"*\" or ORIGIN,...; unset = no "
     "CORS headers, preflights refused",
     &g_args.c.cors_origins, 0, 0},
    {"max-n", NULL, KM_OPT_INT, "8",
     "most choices one OpenAI request may ask for (n, or a list of prompts)", &g_args.max_n, 1,
     128},
    {"log-level", NULL, KM_OPT_STR, "info", "debug, info, warn, error", &g_args.log_level, 0, 0},
    {"log-format", NULL, KM_OPT_STR, "text", "text or json", &g_args.log_format, 0, 0},
};

/* The options' values that rt_config keeps in its own types. */
static void args_to_config(rt_args *a)
{
    rt_config *c = &a->c;
    c->cluster_seed = (uint64_t)a->cluster_seed;
    c->page_tokens = (int)a->page_tokens;
    c->http_port = (int)a->http_port;
    c->admin_port = (int)a->admin_port;
    c->worker_slots = (int)a->slots;
    c->max_inflight = (int)a->max_inflight;
    c->max_queue = (int)a->max_queue;
    c->max_queue_per_key = (int)a->max_queue_per_key;
    c->max_inflight_per_key = (int)a->max_inflight_per_key;
    c->max_attempts = (int)a->attempts;
    c->default_max_tokens = (uint32_t)a->dmax;
    c->max_ctx = (uint32_t)a->max_ctx;
    c->sync_timeout_ms = (uint32_t)a->sync_ms;
    c->pending_ttl_ms = (uint32_t)a->ttl_ms;
    c->queue_timeout_ms = (uint32_t)a->queue_ms;
    c->index_pages = (size_t)a->index_pages;
    c->max_http_body = (size_t)a->max_body;
    c->max_http_buffered = (size_t)a->max_buffered;
    c->max_prompt_bytes = (size_t)a->max_prompt_bytes;
    c->request_timeout_ms = (uint32_t)a->request_ms;
    c->view_timeout_ms = (uint32_t)a->view_ms;
    c->max_n = (int)a->max_n;
}

int main(int argc, char **argv)
{
    rt_args *a = &g_args;
    rt_config_default(&a->c);
    km_errbuf err = {{0}};
    km_config *cfg = NULL;
    int crc = km_daemon_config("kvmesh-router", "KV-aware request router of a kvmesh cluster",
                               g_opts, sizeof g_opts / sizeof g_opts[0], argc, argv, &a->log_level,
                               &a->log_format, &cfg);
    if (crc) return crc == 1 ? 0 : 2;
    if (rt_mode_parse(a->mode, &a->c.policy.mode)) {
        fprintf(stderr, "kvmesh-router: --mode must be kv, round-robin or random\n");
        km_config_destroy(cfg);
        return 2;
    }
    if (a->c.controller_url && !*a->c.controller_url) a->c.controller_url = NULL;
    if (a->workers && !*a->workers && a->c.controller_url) a->workers = NULL;
    if (!a->workers && !a->c.controller_url) {
        fprintf(stderr, "kvmesh-router: --workers is required (ID=REQUESTS_URL+EVENTS_URL,...) "
                        "unless --controller is given\n");
        km_config_destroy(cfg);
        return 2;
    }
    if (a->c.api_keys && !*a->c.api_keys) a->c.api_keys = NULL;
    if (a->c.tls_cert && !*a->c.tls_cert) a->c.tls_cert = NULL;
    if (a->c.tls_key && !*a->c.tls_key) a->c.tls_key = NULL;
    if (a->c.cors_origins && !*a->c.cors_origins) a->c.cors_origins = NULL;
    if (!a->c.tls_cert != !a->c.tls_key) {
        fprintf(stderr, "kvmesh-router: --tls-cert and --tls-key go together\n");
        km_config_destroy(cfg);
        return 2;
    }
    if (!a->sec_args.insecure && a->http_port >= 0 && !a->c.api_keys) {
        fprintf(stderr, "kvmesh-router: the OpenAI HTTP front needs --api-keys FILE (kvmesh keys "
                        "api-add FILE TENANT), or --http-port -1, or --insecure\n");
        km_config_destroy(cfg);
        return 2;
    }
    km_zsec *sec = NULL;
    if (km_sec_daemon_open(&a->sec_args, "kvmesh-router", "router", &sec, &err)) {
        fprintf(stderr, "kvmesh-router: %s\n", err.msg);
        km_config_destroy(cfg);
        return 2;
    }
    a->c.sec = sec;
    char *wl = a->workers ? strdup(a->workers) : NULL;
    rt_worker_cfg wc[RT_MAX_WORKERS];
    int nw = !a->workers ? 0 : wl ? parse_workers(wl, wc, RT_MAX_WORKERS, &err) : KM_ENOMEM;
    if (nw < 0) {
        fprintf(stderr, "kvmesh-router: %s\n", err.msg);
        km_zsec_close(sec);
        free(wl);
        km_config_destroy(cfg);
        return 2;
    }
    a->c.workers = wc;
    a->c.n_workers = nw;
    args_to_config(a);
    int status = serve(&a->c, a->ports_file);
    km_zsec_close(sec);
    free(wl);
    km_config_destroy(cfg);
    return status;
}
