/*
 * bench_transfer.c — page transfer between two processes on this host (peer/), next to
 * ucx_perftest on the same transport and message size, in one run (make bench-transfer;
 * figures in docs/benchmarks.md and docs/transfer.md).
 *
 * For each transport setting (UCX_TLS=tcp, the default, the default with UCX's shared-memory
 * error handling on) and each pull size (1, 16, 256 pages of the default model: 30 layers x 3
 * kv heads x 64 x 16 tokens, 368,640 bytes in f16), interleaved: a pull in GET mode, the same
 * size as ucx_perftest ucp_get with as many reads outstanding as the pull keeps in flight, a
 * pull in AM mode, ucx_perftest ucp_am_bw and tag_bw. ucp_am_bw's receiver does not copy an
 * eager message anywhere (its handler only counts it), so it moves bytes without landing them;
 * tag_bw receives every message into the receiver's buffer, as a pull must land each page in its
 * destination: the second reference column. The third is ucx_perftest -e: endpoints with peer
 * error handling, as every pull's are, under which UCX 1.13 leaves shared memory out on one host
 * as it does for the pull (the same-transport reference for the default setting). The "1 x 8"
 * rows run CONC one-page pulls at once (CONC requests whose one-page prefixes sit on the same
 * peer) next to ucx_perftest with the same window. A pull is timed end to end (request, the
 * holder's lease and offer, the reads, the checksum of every page, the import into the store: what
 * a worker waits for) and also from the offer to the last byte (the read phase, what ucx_perftest
 * measures). The single one-page AM pull is measured a second time with both owner loops (this
 * process's and the holder's) polling without sleeping, as ucx_perftest's loops do ("1, owners
 * spin"), and the header gives the round trip of a small message between the two sides sleeping
 * and spinning: a one-page pull is a latency, and those rows show how much of it is wake-ups.
 * The header also gives memcpy of 1, 16 and 256 distinct pages on the reader's CPU: the most any
 * same-host path could land, next to ucx_perftest's shared memory, which reuses one buffer; and
 * what a first write to anonymous memory costs against a second (peer/node.c's prefault).
 * The load average is printed with every row: the machine is shared. Prints figures; asserts
 * nothing.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <sched.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "bench/bench_util.h"
#include "peer/ucx_internal.h" /* seal.c, for what a tag costs one CPU */
#include "tests/xfer_harness.h"

static const xh_shape SMOL = {30, 3, 64, 16};
#define MAX_PAGES 256
#define INFLIGHT  32
#define MAX_REPS  4096
#define CONC      8 /* one-page pulls at once in the "1 x 8" rows */

typedef struct tls_setting {
    const char *name, *tls, *mm_err;
} tls_setting;

static const tls_setting SETTINGS[] = {
    {"tcp", "tcp", NULL},
    {"default", NULL, NULL},
    {"default, UCX_MM_ERROR_HANDLING=y", NULL, "y"},
};

static void apply(const tls_setting *t)
{
    if (t->tls)
        setenv("UCX_TLS", t->tls, 1);
    else
        unsetenv("UCX_TLS");
    if (t->mm_err)
        setenv("UCX_MM_ERROR_HANDLING", t->mm_err, 1);
    else
        unsetenv("UCX_MM_ERROR_HANDLING");
}

/* ---------------------------------------------------------------- CPU placement */

/* Where two CPUs or more are online, the holder side of every measurement (our holder process,
 * ucx_perftest's server) runs on CPU 0 and the reader side (this process with its progress
 * thread, ucx_perftest's client) on CPU 1. Left to the scheduler on a 2-CPU VM, the two busy
 * sides sometimes share one CPU for a whole run, and a run then reads about half, for the pull
 * and for ucx_perftest alike but not always in the same row (docs/benchmarks.md, "Figures
 * behind code comments"). */
static int g_pin = -1;         /* -1: not pinned */
static int g_fragment = 0;     /* the holder's pr_config.am_fragment (--fragment) */
static long long g_stream = 0; /* the reader's pr_config.stream_bytes (--stream-bytes) */
/* The owner loops (this process's and the holder's) poll without sleeping, as ucx_perftest's
 * do, in the "owners spin" rows; otherwise they sleep in poll as a worker's loop does. */
static int g_spin = 0;
/* The reader's pr_config.encrypt and no_auth for the sides opened next (the "page plane" table). */
static pr_encrypt g_encrypt = PR_ENCRYPT_AUTO;
static int g_no_auth = 0;

static void pin_to(int cpu)
{
    if (g_pin < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set))
        fprintf(stderr, "bench_transfer: cannot pin to CPU %d\n", cpu);
}

/* ---------------------------------------------------------------- our pulls */

typedef struct side {
    xh_child holder;
    kv_store *s;
    pr_node *n;
    pr_peer *peer;
    int32_t toks[MAX_PAGES * 16];
    km_pagehash hs[MAX_PAGES];
    int32_t ctoks[CONC][16]; /* CONC one-page chains, as the holder has them */
    km_pagehash chs[CONC];
    uint8_t *buf;
} side;

/* Holders are forked before this process starts any UCX context (a child forked from a
 * process with a live context cannot use UCX reliably). */
static void side_spawn(side *x, pr_mode mode)
{
    xh_role r = {SMOL, KN_KV_F16, MAX_PAGES, mode, 0, g_fragment, g_stream, CONC, 0, 0};
    pin_to(0); /* the child keeps it */
    x->holder = xh_spawn_holder(&r);
    pin_to(1);
}

static int side_open(side *x, pr_mode mode)
{
    xh_role r = {SMOL,       KN_KV_F16, MAX_PAGES, mode,      0,
                 g_fragment, g_stream,  CONC,      g_encrypt, g_no_auth};
    x->buf = malloc(XH_MSGCAP);
    ssize_t len = x->holder.fd >= 0 ? xh_recv(x->holder.fd, x->buf, 120000) : -1;
    if (len <= 8 || xh_type(x->buf) != XH_ADDR) return -1;
    x->s = xh_store(SMOL, KN_KV_F16, MAX_PAGES + CONC + 8);
    x->n = x->s ? xh_node(x->s, &r) : NULL;
    km_errbuf err;
    if (!x->n || pr_peer_connect(x->n, x->buf + 8, (size_t)len - 8, &x->peer, &err)) return -1;
    xh_chain(x->toks, x->hs, MAX_PAGES, SMOL.pt, 0);
    for (int c = 0; c < CONC; c++) xh_chain(x->ctoks[c], &x->chs[c], 1, SMOL.pt, c + 1);
    return 0;
}

static void side_close(side *x)
{
    if (x->n) {
        if (x->peer) pr_peer_release(x->n, x->peer);
        pr_node_destroy(x->n);
    }
    if (x->s) kv_store_destroy(x->s);
    xh_reap(&x->holder, 0);
    free(x->buf);
}

/* Both owner loops spin (1) or sleep in poll (0) from now on. */
static void set_spin(side *x, int on)
{
    g_spin = on;
    xh_send(x->holder.fd, XH_SPIN, &on, sizeof on, NULL, 0, NULL, 0);
}

/* The holder's offer into x->buf: its length, or -1 (the channel closed, or a minute passed). */
static ssize_t recv_offer(side *x)
{
    const uint64_t end = xh_after(60);
    for (;;) {
        ssize_t len = xh_recv(x->holder.fd, x->buf, g_spin ? 0 : 60000);
        if (len > 0 && xh_type(x->buf) == XH_OFFER) return len;
        if (len == 0 || (len < 0 && !g_spin) || km_now_ns() > end) return -1;
        if (len < 0) sched_yield(); /* the progress thread shares this CPU */
    }
}

/* Waits for the node's wait fd as the owner loop does (sleeping in poll, or spinning). */
static void wait_node(side *x, struct pollfd *pfd, int n, int sleep_ms)
{
    if (poll(pfd, n, g_spin ? 0 : sleep_ms) <= 0 && g_spin) sched_yield();
    if (pfd[0].revents & POLLIN) pr_node_poll(x->n, NULL, 0);
}

/* One pull of the first n pages: end-to-end and read-phase nanoseconds; pages imported. */
static int one_pull(side *x, int n, uint64_t *e2e, uint64_t *read)
{
    kv_store_evict_oldest_fraction(x->s, 1.0); /* the pages must move again */
    uint64_t t0 = km_now_ns();
    pr_pull *p;
    pr_pull_req req;
    int k = pr_pull_start(x->n, x->peer, x->hs, x->toks, n, xh_after(60), &p, &req);
    if (k != 0 || !p) {
        fprintf(stderr, "bench_transfer: cannot start a pull: %s\n",
                k < 0 ? km_strerror(k) : "pages already here");
        return -1;
    }
    xh_send_req(x->holder.fd, &req);
    if (recv_offer(x) < 0) return -1;
    pr_offer o;
    xh_parse_offer(x->buf, &o);
    uint64_t t1 = km_now_ns();
    pr_pull_offer(x->n, p, &o);
    /* Sleep in poll on the node's wait fd, as a worker's loop does, not spin: with two CPUs a
     * third busy thread beside the two progress threads would take a CPU from them
     * (ucx_perftest runs two). */
    struct pollfd pfd = {.fd = pr_node_wait_fd(x->n), .events = POLLIN};
    while (!pr_pull_done_yet(x->n, p)) wait_node(x, &pfd, 1, 100);
    uint64_t t2 = km_now_ns();
    pr_pull_done done;
    pr_pull_result res;
    int got = pr_pull_finish(x->n, p, &res, &done);
    if (got != n)
        fprintf(stderr, "bench_transfer: pull of %d pages: %d imported (%s, offered %d)\n", n, got,
                km_strerror(res.status), res.pages_offered);
    *e2e = km_now_ns() - t0;
    *read = t2 - t1;
    if (done.lease_id) xh_send(x->holder.fd, XH_DONE, &done, sizeof done, NULL, 0, NULL, 0);
    return got;
}

typedef struct figures {
    double gbps, pages_s, read_gbps, best_gbps;
    int ok;
} figures;

static figures measure(side *x, int n, int reps, size_t page_bytes)
{
    figures f = {0};
    static uint64_t e[MAX_REPS], r[MAX_REPS];
    uint64_t a, b;
    for (int w = 0; w < 2; w++)
        if (one_pull(x, n, &a, &b) != n) return f;
    for (int i = 0; i < reps; i++)
        if (one_pull(x, n, &e[i], &r[i]) != n) return f;
    qsort(e, reps, sizeof *e, bench_cmp_u64);
    qsort(r, reps, sizeof *r, bench_cmp_u64);
    double bytes = (double)n * (double)page_bytes;
    f.gbps = bytes / (double)e[reps / 2];
    f.best_gbps = bytes / (double)e[0];
    f.read_gbps = bytes / (double)r[reps / 2];
    f.pages_s = n * 1e9 / (double)e[reps / 2];
    f.ok = 1;
    return f;
}

/* CONC one-page pulls at once, of CONC one-page chains (as a worker serving CONC requests
 * whose one-page prefixes sit on the same peer): nanoseconds from the first start to the last
 * finish; -1 when one failed. Offers are matched to pulls by id, in whatever order they come. */
static int64_t conc_pulls(side *x)
{
    kv_store_evict_oldest_fraction(x->s, 1.0);
    pr_pull *p[CONC];
    pr_pull_req req[CONC];
    int left = CONC, ok = 1;
    uint64_t t0 = km_now_ns();
    for (int c = 0; c < CONC; c++) {
        int k =
            pr_pull_start(x->n, x->peer, &x->chs[c], x->ctoks[c], 1, xh_after(60), &p[c], &req[c]);
        if (k != 0 || !p[c]) return -1;
        xh_send_req(x->holder.fd, &req[c]);
    }
    int offered = 0;
    struct pollfd pfd[2] = {{.fd = pr_node_wait_fd(x->n), .events = POLLIN},
                            {.fd = x->holder.fd, .events = POLLIN}};
    int done[CONC] = {0};
    uint64_t end = xh_after(60);
    while (left && km_now_ns() < end) {
        pfd[1].revents = 0;
        wait_node(x, pfd, offered < CONC ? 2 : 1, 100);
        if (pfd[1].revents & POLLIN) {
            ssize_t len = xh_recv(x->holder.fd, x->buf, 0);
            if (len > 0 && xh_type(x->buf) == XH_OFFER) {
                pr_offer o;
                xh_parse_offer(x->buf, &o);
                for (int c = 0; c < CONC; c++)
                    if (req[c].pull_id == o.pull_id) pr_pull_offer(x->n, p[c], &o), offered++;
            }
        }
        for (int c = 0; c < CONC; c++) {
            if (done[c] || !pr_pull_done_yet(x->n, p[c])) continue;
            pr_pull_done d;
            ok &= pr_pull_finish(x->n, p[c], NULL, &d) == 1;
            if (d.lease_id) xh_send(x->holder.fd, XH_DONE, &d, sizeof d, NULL, 0, NULL, 0);
            done[c] = 1;
            left--;
        }
    }
    for (int c = 0; c < CONC; c++)
        if (!done[c]) pr_pull_finish(x->n, p[c], NULL, &(pr_pull_done){0}), ok = 0;
    return ok ? (int64_t)(km_now_ns() - t0) : -1;
}

static figures measure_conc(side *x, int reps, size_t page_bytes)
{
    figures f = {0};
    static uint64_t e[MAX_REPS];
    for (int i = -2; i < reps; i++) { /* two warm-up rounds */
        int64_t ns = conc_pulls(x);
        if (ns < 0) return f;
        if (i >= 0) e[i] = (uint64_t)ns;
    }
    qsort(e, reps, sizeof *e, bench_cmp_u64);
    f.gbps = CONC * (double)page_bytes / (double)e[reps / 2];
    f.best_gbps = CONC * (double)page_bytes / (double)e[0];
    f.read_gbps = 0; /* several pulls overlap: no single read phase */
    f.pages_s = CONC * 1e9 / (double)e[reps / 2];
    f.ok = 1;
    return f;
}

/* ---------------------------------------------------------------- ucx_perftest */

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    int port = 0;
    if (fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof a) &&
        !getsockname(fd, (struct sockaddr *)&a, &l))
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

/* ucx_perftest's overall bandwidth (GB/s) and message rate, or 0 when it could not run. */
static int perftest(const char *test, size_t bytes, int outstanding, int iters, int eh,
                    double *gbps, double *rate)
{
    char size[32], out[16], it[16], warm[16], port[16];
    snprintf(size, sizeof size, "%zu", bytes);
    snprintf(out, sizeof out, "%d", outstanding);
    snprintf(it, sizeof it, "%d", iters);
    snprintf(warm, sizeof warm, "%d", iters / 10 + 1);
    for (int attempt = 0; attempt < 3; attempt++) {
        snprintf(port, sizeof port, "%d", free_port());
        pid_t srv = fork();
        if (srv == 0) {
            pin_to(0); /* the client, from popen, has this process's CPU */
            int devnull = open("/dev/null", 1);
            dup2(devnull, 1);
            dup2(devnull, 2);
            execlp("ucx_perftest", "ucx_perftest", "-p", port, "-t", test, "-s", size, "-n", it,
                   "-w", warm, "-O", out, eh ? "-e" : (char *)NULL, (char *)NULL);
            _exit(127);
        }
        km_sleep_ms(300);
        char cmd[512];
        snprintf(cmd, sizeof cmd,
                 "timeout 120 ucx_perftest 127.0.0.1 -p %s -t %s -s %s -n %s -w %s -O %s %s -v "
                 "2>/dev/null | tail -1",
                 port, test, size, it, warm, out, eh ? "-e" : "");
        FILE *f = popen(cmd, "r");
        char line[512] = "";
        if (f) {
            if (!fgets(line, sizeof line, f)) line[0] = 0;
            pclose(f);
        }
        kill(srv, SIGKILL);
        waitpid(srv, NULL, 0);
        double v[8];
        if (sscanf(line, " %lf,%lf,%lf,%lf,%lf,%lf,%lf,%lf", &v[0], &v[1], &v[2], &v[3], &v[4],
                   &v[5], &v[6], &v[7]) == 8) {
            *gbps = v[5] * 1048576.0 / 1e9; /* its MB/s are MiB/s */
            *rate = v[7];
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- what a wake-up costs */

/* The median round trip of a small message between CPU 0 and CPU 1 over a socketpair, both
 * ends sleeping in poll (as the owner loops of a pull do) or both polling without sleeping (as
 * ucx_perftest does), in microseconds; 0 when it could not run. A one-page pull has two such
 * hops between processes (request, offer) and two between its own threads: on a VM whose
 * sleeping round trip is tens of microseconds, that, not the bytes, is what it waits for. */
static double wake_rtt_us(int spin)
{
    enum { ROUNDS = 2000 };
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv)) return 0;
    static uint8_t in[XH_MSGCAP];
    const char b[8] = {0};
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        pin_to(0);
        const uint64_t end = xh_after(20);
        while (km_now_ns() < end) {
            ssize_t r = xh_recv(sv[1], in, spin ? 0 : 1000);
            if (r == 0) break;
            if (r > 0 && send(sv[1], b, 8, 0) < 0) break;
        }
        _exit(0);
    }
    close(sv[1]);
    pin_to(1);
    static uint64_t t[ROUNDS];
    int k = 0;
    const uint64_t end = xh_after(10);
    for (; pid > 0 && k < ROUNDS && km_now_ns() < end; k++) {
        const uint64_t t0 = km_now_ns();
        if (send(sv[0], b, 8, 0) < 0) break;
        ssize_t r;
        while ((r = xh_recv(sv[0], in, spin ? 0 : 1000)) < 0 && km_now_ns() < end) continue;
        if (r <= 0) break;
        t[k] = km_now_ns() - t0;
    }
    close(sv[0]);
    if (pid > 0) {
        xh_child c = {pid, -1};
        xh_reap(&c, 0);
    }
    if (k < ROUNDS) return 0;
    qsort(t, ROUNDS, sizeof *t, bench_cmp_u64);
    return (double)t[ROUNDS / 2] / 1e3;
}

/* ---------------------------------------------------------------- what copying costs */

/* GB/s of memcpy of n distinct pages into n other pages on this CPU, the sources unchanged
 * between rounds (best of five): the most any same-host path can land, before any check. On a
 * VM whose caches hold a few megabytes it is far below a ucx_perftest that moves one buffer
 * around in the cache (shared memory; docs/benchmarks.md has both). 0 when out of memory. */
static double memcpy_gbps(int n, size_t page)
{
    uint8_t *src = malloc(page * n), *dst = malloc(page * n);
    double best = 0;
    if (src && dst) {
        memset(src, 1, page * n);
        memset(dst, 2, page * n);
        const int reps = n == 1 ? 4000 : n == 16 ? 400 : 20;
        for (int r = 0; r < 5; r++) {
            const uint64_t t0 = km_now_ns();
            for (int k = 0; k < reps; k++)
                for (int i = 0; i < n; i++)
                    memcpy(dst + (size_t)i * page, src + (size_t)i * page, page);
            const double gbps = (double)page * n * reps / (double)(km_now_ns() - t0);
            if (gbps > best) best = gbps;
        }
    }
    free(src);
    free(dst);
    return best;
}

/* What a first write to anonymous memory costs here, the reason a transfer node prefaults its
 * arena (peer/node.c): GB/s of memset into 1 GiB never touched, of MADV_POPULATE_WRITE of
 * another GiB (what the prefault does), and of memset into the first again (resident). On a VM
 * the first two depend on whether the guest has used that much memory before (docs/transfer.md,
 * "Tuning", prefault_bytes). */
static void fault_gbps(double *fresh, double *populate, double *again)
{
    const size_t b = (size_t)1 << 30;
    *fresh = *populate = *again = 0;
    uint8_t *m = mmap(NULL, b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t *p = mmap(NULL, b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED && p != MAP_FAILED) {
        uint64_t t0 = km_now_ns();
        memset(m, 1, b);
        uint64_t t1 = km_now_ns();
        const int pop = madvise(p, b, 23 /* MADV_POPULATE_WRITE, Linux 5.14 */);
        uint64_t t2 = km_now_ns();
        memset(m, 2, b);
        uint64_t t3 = km_now_ns();
        *fresh = (double)b / (double)(t1 - t0);
        *populate = pop ? 0 : (double)b / (double)(t2 - t1);
        *again = (double)b / (double)(t3 - t2);
    }
    if (m != MAP_FAILED) munmap(m, b);
    if (p != MAP_FAILED) munmap(p, b);
}

/* ---------------------------------------------------------------- what the page plane costs */

/* GB/s one CPU lands 16 pages at (best of five, in this thread's CPU time, so that other jobs
 * on the machine do not count), in 61,440-byte fragments a 16 KiB piece at a time as
 * peer/ucx_io.c does: untagged (copy, checksum), authenticated (copy, tag), encrypted (decrypt
 * into the page); and what the holder's CPU tags or encrypts them at, with the checksum it
 * takes in the same pass. What the pull's figures cost in CPU, away from the load. */
static uint64_t cpu_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void seal_gbps(size_t page, double out[5])
{
    enum { PAGES = 16, FRAG = 61440, CHUNK = 16384 };
    const size_t bytes = PAGES * page;
    uint8_t *src = malloc(bytes), *dst = malloc(bytes), key[PR_KEY_BYTES] = {1};
    pr_seal s;
    memset(out, 0, sizeof(double) * 5);
    if (!src || !dst || pr_seal_init(&s)) {
        free(src);
        free(dst);
        return;
    }
    memset(src, 3, bytes);
    kv_xfer_page d = {.bytes = page};
    for (int way = 0; way < 5; way++) {
        uint64_t best = UINT64_MAX;
        for (int round = 0; round < 5; round++) {
            const uint64_t t0 = cpu_ns();
            for (size_t p = 0; p < PAGES; p++) {
                kv_xfer_sum sum;
                memset(&sum, 0, sizeof sum);
                kv_xfer_sum_begin(&sum, &d, 16);
                for (size_t off = 0; off < page; off += FRAG) {
                    const size_t len = page - off < FRAG ? page - off : FRAG;
                    pr_data_hdr h = {.index = (uint32_t)p, .offset = off, .len = (uint32_t)len};
                    h.flags = way == 2 || way == 4 ? PR_DATA_ENCRYPTED : 0;
                    if (way) pr_seal_begin(&s, key, &h, way <= 2);
                    for (size_t at = 0; at < len; at += CHUNK) {
                        const size_t c = len - at < CHUNK ? len - at : CHUNK;
                        const uint8_t *in = src + p * page + off + at;
                        uint8_t *to = dst + p * page + off + at;
                        if (way == 0 || way == 1) memcpy(to, in, c);
                        if (way) pr_seal_update(&s, in, to, c);
                        if (way == 0) kv_xfer_sum_update(&sum, to, c); /* the reader's */
                        if (way >= 3) kv_xfer_sum_update(&sum, in, c); /* the holder's */
                    }
                    if (way) pr_seal_end(&s, h.tag); /* opening: fails, as no one sealed it */
                }
                (void)kv_xfer_sum_end(&sum);
            }
            const uint64_t ns = cpu_ns() - t0;
            if (ns < best) best = ns;
        }
        out[way] = (double)bytes / (double)best;
    }
    pr_seal_free(&s);
    free(src);
    free(dst);
}

/* AM pulls over TCP of 16 and 256 pages by four readers, each with its own holder: one that
 * takes answers untagged (pr_config.no_auth: what a pull cost before pages were authenticated),
 * one that checks every answer's tag (the default between processes of one host), one that
 * asks for them encrypted (the default between hosts) and one whose two ends tag with OpenSSL's
 * GHASH only (KVMESH_PEER_GHASH=openssl: as before peer/gmac.c). The four take turns, `rounds`
 * rounds (--rounds, 5) of `reps` pulls each; the medians of the rounds are printed, and each
 * ratio is the median of the rounds' ratios. */
#define PLANE_ROUNDS 64 /* --rounds: the most turns of the plane table */

static double median(double *a, int n) /* sorts a handful in place */
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && a[j] < a[j - 1]; j--) {
            const double t = a[j];
            a[j] = a[j - 1];
            a[j - 1] = t;
        }
    return n > 0 ? a[n / 2] : 0;
}

static void plane_rows(int quick, int reps_arg, int rounds_arg, size_t page_bytes)
{
    enum { V = 4 };
    static const char *names[V] = {"untagged", "authenticated", "encrypted",
                                   "authenticated, OpenSSL's GHASH"};
    apply(&SETTINGS[0]);
    side sides[V];
    memset(sides, 0, sizeof sides);
    /* the fourth pair computes its tags as before gmac.c (peer/seal.c), both ends */
    for (int v = 0; v < V; v++) {
        if (v == 3) setenv("KVMESH_PEER_GHASH", "openssl", 1);
        side_spawn(&sides[v], PR_MODE_AM);
        unsetenv("KVMESH_PEER_GHASH");
    }
    int ok = 1;
    for (int v = 0; v < V && ok; v++) {
        g_no_auth = v == 0;
        g_encrypt = v == 2 ? PR_ENCRYPT_ON : PR_ENCRYPT_OFF;
        if (v == 3) setenv("KVMESH_PEER_GHASH", "openssl", 1);
        ok = side_open(&sides[v], PR_MODE_AM) == 0;
        unsetenv("KVMESH_PEER_GHASH");
    }
    g_no_auth = 0;
    g_encrypt = PR_ENCRYPT_AUTO;
    double c[5], o[5];
    seal_gbps(page_bytes, c);
    setenv("KVMESH_PEER_GHASH", "openssl", 1);
    seal_gbps(page_bytes, o);
    unsetenv("KVMESH_PEER_GHASH");
    printf(
        "# in CPU time one CPU lands 16 pages at %.2f GB/s untagged (copy, checksum), %.2f "
        "authenticated\n"
        "# (copy, tag; %.2f with OpenSSL's GHASH), %.2f encrypted (decrypt); the holder tags and\n"
        "# checksums at %.2f GB/s (%.2f with OpenSSL's GHASH), encrypts and checksums at %.2f\n\n",
        c[0], c[1], o[1], c[2], c[3], o[3], c[4]);
    printf("| pages | untagged GB/s | authenticated GB/s | authenticated / untagged | "
           "authenticated, OpenSSL's GHASH GB/s | its ratio | encrypted GB/s | encrypted / "
           "untagged | load |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int s = 0; ok && s < 2; s++) {
        const int n = s ? 256 : 16, rounds = quick ? 1 : rounds_arg ? rounds_arg : 5;
        const int reps = reps_arg ? reps_arg : quick ? 3 : n == 16 ? 20 : 4;
        double g[V][PLANE_ROUNDS] = {{0}};
        const double ld = bench_load1();
        for (int r = 0; r < rounds; r++)
            for (int v = 0; v < V; v++) g[v][r] = measure(&sides[v], n, reps, page_bytes).gbps;
        /* each way against the untagged pull of the same round (next to it in time), then
         * the medians: the machine's load moves between rounds far more than within one */
        double med[V], rel[V];
        for (int v = 0; v < V; v++) {
            double q[PLANE_ROUNDS];
            for (int r = 0; r < rounds; r++) q[r] = g[0][r] > 0 ? g[v][r] / g[0][r] : 0;
            rel[v] = median(q, rounds);
        }
        for (int v = 0; v < V; v++) med[v] = median(g[v], rounds);
        printf("| %d | %.2f | %.2f | %.0f%% | %.2f | %.0f%% | %.2f | %.0f%% | %.1f–%.1f |\n", n,
               med[0], med[1], 100 * rel[1], med[3], 100 * rel[3], med[2], 100 * rel[2], ld,
               bench_load1());
        fflush(stdout);
    }
    if (!ok) printf("| – | could not set up (%s) | | | | | | | |\n", names[0]);
    for (int v = 0; v < V; v++) side_close(&sides[v]);
    printf("\n");
}

/* ---------------------------------------------------------------- the run */

typedef struct refs {
    int have, have_e, have_tag;
    double pg, pr, eg, tg; /* perftest GB/s and msgs/s; with -e; tag_bw */
} refs;

static void print_row(const char *setting, const char *pages, int m, int conc, const figures *fg,
                      const refs *rf, double ld)
{
    char ours[96], ref[64] = "n/a | n/a", ratio[48] = "", rratio[48] = "";
    char tag[64] = "n/a | ", eref[64] = "n/a | ";
    if (fg->ok && conc)
        snprintf(ours, sizeof ours, "%.2f | %.0f | –", fg->gbps, fg->pages_s);
    else if (fg->ok)
        snprintf(ours, sizeof ours, "%.2f | %.0f | %.2f", fg->gbps, fg->pages_s, fg->read_gbps);
    else
        snprintf(ours, sizeof ours, "failed | | ");
    if (rf->have) snprintf(ref, sizeof ref, "%.2f | %.0f", rf->pg, rf->pr);
    if (rf->have && fg->ok && rf->pg > 0) {
        snprintf(ratio, sizeof ratio, "%.0f%%", 100.0 * fg->gbps / rf->pg);
        if (!conc) snprintf(rratio, sizeof rratio, "%.0f%%", 100.0 * fg->read_gbps / rf->pg);
    }
    if (rf->have_tag)
        snprintf(tag, sizeof tag, "%.2f | %.0f%%", rf->tg,
                 fg->ok && rf->tg > 0 ? 100.0 * fg->gbps / rf->tg : 0.0);
    if (rf->have_e)
        snprintf(eref, sizeof eref, "%.2f | %.0f%%", rf->eg,
                 fg->ok && rf->eg > 0 ? 100.0 * fg->gbps / rf->eg : 0.0);
    printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %.1f–%.1f |\n", setting, pages,
           m == 0 ? "get" : "am", ours, ref, ratio, rratio, tag, eref, ld, bench_load1());
    fflush(stdout);
}

static void usage(void)
{
    fprintf(
        stderr,
        "usage: bench_transfer [--quick] [--reps N] [--rounds N] [--no-pin] [--fragment BYTES|-1]\n"
        "                      [--stream-bytes BYTES|-1]\n"
        "                      [--only-tls tcp|default|mm]"
        " [--only-pages N] [--only-mode get|am] [--no-perftest]\n"
        "                      [--no-spin] [--only-plane | --no-plane]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    int quick = 0, only_pages = 0, only_mode = -1, no_ref = 0, reps_arg = 0, pin = 1, no_spin = 0;
    int rounds_arg = 0;
    int only_plane = 0, no_plane = 0;
    const char *only_tls = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--no-perftest"))
            no_ref = 1;
        else if (!strcmp(argv[i], "--no-pin"))
            pin = 0;
        else if (!strcmp(argv[i], "--no-spin"))
            no_spin = 1;
        else if (!strcmp(argv[i], "--only-plane"))
            only_plane = 1;
        else if (!strcmp(argv[i], "--no-plane"))
            no_plane = 1;
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc && atoi(argv[i + 1]) > 0 &&
                 atoi(argv[i + 1]) <= PLANE_ROUNDS)
            rounds_arg = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc && atoi(argv[i + 1]) > 0 &&
                 atoi(argv[i + 1]) <= MAX_REPS)
            reps_arg = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--fragment") && i + 1 < argc)
            g_fragment = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stream-bytes") && i + 1 < argc)
            g_stream = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--only-tls") && i + 1 < argc)
            only_tls = argv[++i];
        else if (!strcmp(argv[i], "--only-pages") && i + 1 < argc)
            only_pages = atoi(argv[++i]); /* 1: also the "1 x 8" rows */
        else if (!strcmp(argv[i], "--only-mode") && i + 1 < argc)
            only_mode = !strcmp(argv[++i], "am");
        else
            usage();
    }
    km_log_set_level(KM_LOG_WARN);
    if (pin && sysconf(_SC_NPROCESSORS_ONLN) >= 2) g_pin = 1;
    char model[512] = "unknown";
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            snprintf(model, sizeof model, "%s", c ? c + 2 : line);
            model[strcspn(model, "\n")] = 0;
            break;
        }
    if (f) fclose(f);
    const size_t page_bytes = (size_t)SMOL.layers * SMOL.heads * SMOL.hd * SMOL.pt * 2 * 2;
    printf("# bench-transfer: %s, %ld CPUs, UCX %s, load average %.2f at start\n", model,
           sysconf(_SC_NPROCESSORS_ONLN), ucp_get_version_string(), bench_load1());
    printf("# pages of the default model's KV in f16: %zu bytes; %d reads in flight per pull;"
           " median of the timed pulls; %s\n",
           page_bytes, INFLIGHT,
           g_pin < 0 ? "placement left to the scheduler"
                     : "holder and ucx_perftest's server on CPU 0, reader and client on CPU 1");
    printf("# a round trip between the two sides over a socketpair, median: %.1f us with both\n"
           "# sleeping in poll (a pull's owner loops), %.1f us with both polling without sleep\n"
           "# (ucx_perftest's loops): the wake-ups a one-page pull waits for, beside its bytes\n",
           wake_rtt_us(0), wake_rtt_us(1));
    printf("# memcpy of 1, 16 and 256 distinct pages into others on one CPU: %.1f, %.1f and\n"
           "# %.1f GB/s (the most any same-host path could land, before its checks)\n",
           memcpy_gbps(1, page_bytes), memcpy_gbps(16, page_bytes), memcpy_gbps(256, page_bytes));
    double fresh, populate, again;
    fault_gbps(&fresh, &populate, &again);
    printf("# a first write to anonymous memory: %.2f GB/s (memset), populating it %.2f GB/s,\n"
           "# writing it again %.1f GB/s (why a transfer node prefaults its arena)\n\n",
           fresh, populate, again);
    if (!no_plane) { /* first: its holders are forked before this process has a UCX context */
        printf("## What the page plane costs: AM pulls over TCP, untagged (the baseline), "
               "authenticated (AES-256-GCM tags), encrypted, and authenticated with OpenSSL's "
               "GHASH (KVMESH_PEER_GHASH=openssl)\n\n");
        plane_rows(quick, reps_arg, rounds_arg, page_bytes);
    }
    if (only_plane) return 0;
    printf("| transport | pages | mode | pull GB/s | pages/s | read phase GB/s | ucx_perftest "
           "GB/s | ucx_perftest msgs/s | pull / perftest | read phase / perftest | tag_bw GB/s "
           "(lands) | pull / tag_bw | ucx_perftest -e GB/s | pull / perftest -e | load |\n");
    printf("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    fflush(stdout);
    static const char *short_names[] = {"tcp", "default", "mm"};
    for (size_t t = 0; t < sizeof SETTINGS / sizeof *SETTINGS; t++) {
        if (only_tls && strcmp(only_tls, short_names[t])) continue;
        apply(&SETTINGS[t]);
        side sides[2];
        memset(sides, 0, sizeof sides);
        side_spawn(&sides[0], PR_MODE_GET);
        side_spawn(&sides[1], PR_MODE_AM);
        if (side_open(&sides[0], PR_MODE_GET) || side_open(&sides[1], PR_MODE_AM)) {
            printf("| %s | – | – | could not set up | | | | | | | |\n", SETTINGS[t].name);
            side_close(&sides[0]);
            side_close(&sides[1]);
            continue;
        }
        /* 1, 16 and 256 pages in one pull; then CONC one-page pulls at once ("1 x 8") */
        for (int s = 0; s < 4; s++) {
            const int conc = s == 3;
            const int n = conc ? 1 : s == 0 ? 1 : s == 1 ? 16 : 256;
            if (only_pages && n != only_pages) continue;
            int reps = reps_arg ? reps_arg : quick ? 3 : n == 1 ? 200 : n == 16 ? 40 : 8;
            int iters = quick ? 50 : n == 1 ? 2000 : n == 16 ? 2000 : 1500;
            int outstanding = conc ? CONC : n < INFLIGHT ? n : INFLIGHT;
            for (int m = 0; m < 2; m++) {
                if (only_mode >= 0 && m != only_mode) continue;
                double ld = bench_load1();
                figures fg = conc ? measure_conc(&sides[m], reps, page_bytes)
                                  : measure(&sides[m], n, reps, page_bytes);
                const char *test = m == 0 ? "ucp_get" : "ucp_am_bw";
                double pg = 0, pr = 0, eg = 0, er = 0, tg = 0, tr = 0;
                int have = !no_ref && perftest(test, page_bytes, outstanding, iters, 0, &pg, &pr);
                /* the same with peer error handling, which every pull's endpoint has: on one
                 * host UCX 1.13 then leaves shared memory out, as it does for the pull */
                int have_e = !no_ref && perftest(test, page_bytes, outstanding, iters, 1, &eg, &er);
                /* AM rows: the landing reference (tag_bw), same size and window */
                int have_tag = m == 1 && !no_ref &&
                               perftest("tag_bw", page_bytes, outstanding, iters, 0, &tg, &tr);
                refs rf = {have, have_e, have_tag, pg, pr, eg, tg};
                char pages[16];
                snprintf(pages, sizeof pages, conc ? "1 x %d" : "%d", conc ? CONC : n);
                print_row(SETTINGS[t].name, pages, m, conc, &fg, &rf, ld);
                /* the single one-page AM pull again with both owner loops spinning, as
                 * ucx_perftest's do: what is left once no thread sleeps between hops */
                if (n == 1 && !conc && m == 1 && !no_spin) {
                    ld = bench_load1();
                    set_spin(&sides[m], 1);
                    fg = measure(&sides[m], n, reps, page_bytes);
                    set_spin(&sides[m], 0);
                    print_row(SETTINGS[t].name, "1, owners spin", m, conc, &fg, &rf, ld);
                }
                fflush(stdout);
            }
        }
        side_close(&sides[0]);
        side_close(&sides[1]);
    }
    printf("\n# load average %.2f at the end\n", bench_load1());
    return 0;
}
