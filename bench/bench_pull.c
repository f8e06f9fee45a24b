/*
 * bench_pull.c — time to first token of a long prompt whose prefix sits on a peer: pulled over
 * UCX vs computed (issue 14, point 7; make bench-pull, figures in docs/transfer.md).
 *
 * Two kvmesh-worker processes with transfer nodes (UCX_TLS=tcp unless the environment says
 * otherwise). Each round takes two fresh prompts of the same length (default 2,048 tokens, 128
 * pages): A computes both (they are A's prefix); then B gets the first with a pull hint naming A
 * and the second without one, interleaved, so the machine's load falls on both alike. TTFT is
 * the worker's own figure (done.ttft_ms: arrival to first token, the pull included); the pull's
 * own time comes from B's log. Prints the median and every round with the load average; asserts
 * nothing.
 *
 *   build/bench/bench_pull [--tokens N] [--rounds R] [--threads T]
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "common/svc.h"

#define WORKER "build/bin/kvmesh-worker"

typedef struct bproc {
    pid_t pid;
    char dir[64], req[512];
} bproc;

static void *g_ctx;

static int start(bproc *w, const char *id, const char *ctl, const char *view, const char *threads)
{
    memset(w, 0, sizeof *w);
    snprintf(w->dir, sizeof w->dir, "/tmp/kvmesh-bpull-XXXXXX");
    if (!mkdtemp(w->dir)) return -1;
    char ports[128], log[128];
    snprintf(ports, sizeof ports, "%s/ports", w->dir);
    snprintf(log, sizeof log, "%s/worker.log", w->dir);
    const char *argv[] = {WORKER,
                          "--listen",
                          "tcp://127.0.0.1:*",
                          "--events",
                          "",
                          "--admin-port",
                          "-1",
                          "--ports-file",
                          ports,
                          "--threads",
                          threads,
                          "--worker-id",
                          id,
                          "--controller",
                          ctl,
                          "--heartbeat",
                          "100",
                          "--peer-listen",
                          "127.0.0.1:0",
                          "--peer-view", /* a hint's holder is one the view names */
                          view,
                          "--peer-warm-pages",
                          "0",
                          "--max-ctx",
                          "8192",
                          "--kv-bytes",
                          "1G",
                          "--insecure",
                          NULL};
    w->pid = fork();
    if (w->pid < 0) return -1;
    if (w->pid == 0) {
        FILE *f = freopen(log, "w", stderr);
        (void)f;
        setenv("UCX_TLS", "tcp", 0);
        execv(WORKER, (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; i < 1200; i++) {
        FILE *f = fopen(ports, "r");
        if (f) {
            char line[512];
            while (fgets(line, sizeof line, f))
                if (!strncmp(line, "requests=", 9)) {
                    line[strcspn(line, "\n")] = 0;
                    snprintf(w->req, sizeof w->req, "%s", line + 9);
                }
            fclose(f);
            return w->req[0] ? 0 : -1;
        }
        usleep(50000);
    }
    return -1;
}

static void *sock(int type, const char *ep, bool bind)
{
    void *s = NULL;
    if (km_zsock_open(g_ctx, type, NULL, &s, NULL)) return NULL;
    if ((bind ? km_zsock_bind(s, ep, NULL) : km_zsock_connect(s, ep, NULL))) {
        km_zsock_close(s);
        return NULL;
    }
    return s;
}

/* The view a controller would publish: wa, where its requests and transfer node are. */
static void publish_view(void *pub, uint64_t seq, const char *req, const uint8_t *addr,
                         uint32_t len)
{
    km_view_worker vw = {.id = "wa",
                         .state = KM_MEMBER_READY,
                         .requests = req,
                         .peer_addr = addr,
                         .peer_addr_len = len};
    km_msg m;
    km_msg_init(&m, KM_MSG_VIEW);
    m.view = (km_msg_view){
        .controller = "bench", .epoch = 1, .seq = seq, .workers = &vw, .n_workers = 1};
    km_buf b = {0};
    if (!km_msg_encode(&m, NULL, &b, NULL)) {
        km_zframe parts[2] = {{"view", 4}, {b.data, b.len}};
        km_zsend(pub, parts, 2, KM_ZDONTWAIT, NULL);
    }
    km_buf_free(&b);
}

static uint32_t peer_addr(void *ctl, const char *id, uint8_t *addr)
{
    for (uint64_t t0 = km_now_ns(); km_now_ns() - t0 < 60000000000ull;) {
        km_zmsg z = {0};
        uint32_t n = 0;
        if (!km_zrecv(ctl, &z, 200, NULL)) {
            const km_zframe *b = km_zmsg_body(&z);
            km_msg m;
            if (b && !km_msg_decode(b->data, b->len, NULL, &m, NULL)) {
                if (m.type == KM_MSG_HEARTBEAT && !strcmp(m.hb.worker, id) && m.hb.peer_addr) {
                    n = m.hb.peer_addr_len;
                    memcpy(addr, m.hb.peer_addr, n);
                }
                km_msg_clear(&m);
            }
        }
        km_zmsg_clear(&z);
        if (n) return n;
    }
    return 0;
}

/* One greedy request (8 tokens); its done's ttft_ms and cached tokens, or -1. */
static double ask(const char *ep, uint64_t id, const int32_t *p, int n, const char *from,
                  const char *from_ep, const uint8_t *addr, uint32_t addr_len, uint32_t *cached)
{
    void *s = sock(KM_ZDEALER, ep, false);
    if (!s) return -1;
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    m.req = (km_msg_request){.id = id,
                             .model = "SmolLM2-135M-Instruct",
                             .tokens = p,
                             .n_tokens = (uint32_t)n,
                             .top_p = 1,
                             .repeat_penalty = 1,
                             .max_tokens = 8,
                             .stream = false};
    if (from) {
        m.req.pull_from = from;
        m.req.pull_endpoint = from_ep;
        m.req.pull_addr = addr;
        m.req.pull_addr_len = addr_len;
        m.req.pull_pages = (uint32_t)(n / 16);
        m.req.pull_ms = 60000;
    }
    km_buf b = {0};
    double ttft = -1;
    if (!km_msg_encode(&m, NULL, &b, NULL) &&
        !km_zsend(s, &(km_zframe){b.data, b.len}, 1, 0, NULL)) {
        km_zmsg z = {0};
        for (uint64_t t0 = km_now_ns(); ttft < 0 && km_now_ns() - t0 < 600000000000ull;) {
            if (km_zrecv(s, &z, 500, NULL)) continue;
            const km_zframe *body = km_zmsg_body(&z);
            km_msg a;
            if (body && !km_msg_decode(body->data, body->len, NULL, &a, NULL)) {
                if (a.type == KM_MSG_DONE) {
                    ttft = a.done.ttft_ms;
                    *cached = a.done.cached_tokens;
                } else if (a.type == KM_MSG_ERROR) {
                    fprintf(stderr, "request %llu: error %d %s\n", (unsigned long long)id,
                            a.error.code, a.error.message);
                    ttft = -2;
                }
                km_msg_clear(&a);
            }
        }
        km_zmsg_clear(&z);
    }
    km_buf_free(&b);
    km_zsock_close(s);
    return ttft;
}

int main(int argc, char **argv)
{
    int n = 2048, rounds = 3;
    const char *threads = "1";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--tokens")) n = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--threads")) threads = argv[i + 1];
    }
    if (n < 32 || n > 8000 || rounds < 1 || rounds > 50) return 2;
    char cpu[256] = "?";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10)) {
                snprintf(cpu, sizeof cpu, "%s", strchr(line, ':') ? strchr(line, ':') + 2 : line);
                cpu[strcspn(cpu, "\n")] = 0;
                break;
            }
        fclose(f);
    }
    g_ctx = km_zctx_create();
    void *ctl = sock(KM_ZROUTER, "tcp://127.0.0.1:*", true);
    char ctl_ep[256];
    if (!ctl || km_zsock_last_endpoint(ctl, ctl_ep, sizeof ctl_ep, NULL)) return 1;
    void *pub = sock(KM_ZPUB, "tcp://127.0.0.1:*", true);
    char view_ep[256];
    if (!pub || km_zsock_last_endpoint(pub, view_ep, sizeof view_ep, NULL)) return 1;
    bproc a, b;
    if (start(&a, "wa", ctl_ep, view_ep, threads) || start(&b, "wb", ctl_ep, view_ep, threads)) {
        fprintf(stderr, "bench_pull: workers did not start (make build; models/)\n");
        return 1;
    }
    static uint8_t addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t addr_len = peer_addr(ctl, "wa", addr);
    publish_view(pub, 0, a.req, addr, addr_len);
    printf("bench_pull: %d-token prompt (%d pages), %d rounds, worker threads %s, UCX_TLS=%s\n", n,
           n / 16, rounds, threads, getenv("UCX_TLS") ? getenv("UCX_TLS") : "tcp");
    printf("cpu: %s\n", cpu);
    printf("%5s %12s %9s %14s %9s %12s\n", "round", "pull ttft ms", "cached", "compute ttft ms",
           "cached", "load");
    double tp[50], tc[50];
    int32_t *p1 = malloc(sizeof *p1 * n), *p2 = malloc(sizeof *p2 * n);
    uint64_t seed = 99;
    for (int r = 0; r < rounds && addr_len; r++) {
        for (int i = 0; i < n; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            p1[i] = 200 + (int32_t)((seed >> 33) % 40000);
            p2[i] = 200 + (int32_t)((seed >> 13) % 40000);
        }
        uint32_t c1 = 0, c2 = 0, ca = 0;
        double l0 = bench_load1();
        ask(a.req, 1000 + 2 * (uint64_t)r, p1, n, NULL, NULL, NULL, 0, &ca);
        ask(a.req, 1001 + 2 * (uint64_t)r, p2, n, NULL, NULL, NULL, 0, &ca);
        /* B has long been subscribed: A's two prompts took seconds */
        publish_view(pub, 1 + (uint64_t)r, a.req, addr, addr_len);
        tp[r] = ask(b.req, 2000 + (uint64_t)r, p1, n, "wa", a.req, addr, addr_len, &c1);
        tc[r] = ask(b.req, 3000 + (uint64_t)r, p2, n, NULL, NULL, NULL, 0, &c2);
        printf("%5d %12.1f %9u %14.1f %9u %5.1f-%-5.1f\n", r, tp[r], c1, tc[r], c2, l0,
               bench_load1());
        fflush(stdout);
    }
    if (addr_len) {
        qsort(tp, (size_t)rounds, sizeof *tp, bench_cmp_double);
        qsort(tc, (size_t)rounds, sizeof *tc, bench_cmp_double);
        printf("median: pull %.1f ms, compute %.1f ms: %.1fx lower with the pull\n", tp[rounds / 2],
               tc[rounds / 2], tp[rounds / 2] > 0 ? tc[rounds / 2] / tp[rounds / 2] : 0);
    }
    kill(a.pid, SIGTERM);
    kill(b.pid, SIGTERM);
    int st;
    waitpid(a.pid, &st, 0);
    waitpid(b.pid, &st, 0);
    printf("pull times (B's log): grep pull_done %s/worker.log\n", b.dir);
    free(p1);
    free(p2);
    return addr_len ? 0 : 1;
}
