/*
 * bench_worker.c — the load generator of `make bench-worker` (docs/benchmarks.md): kvmesh-worker
 * and llama.cpp's llama-server driven with the same prompts, the same completion lengths and the
 * same clock, so that their serving figures can sit side by side.
 *
 *   bench_worker load   (--kvmesh EP | --http HOST:PORT) [--concurrency 1,8,32]
 *                       [--requests-per-client 2] [--min-requests 8] [--max-tokens 64]
 *                       [--prompt-words 48] [--label NAME] [--model NAME]
 *       For each concurrency C: C client threads, each with its own connection, each sending its
 *       requests one after the other (a closed loop). Prints one line per C:
 *       "result server=... conc=C ... tok_s=X ttft_p50=... ttft_p99=... itl_p50=... itl_p99=..."
 *   bench_worker prefix (--kvmesh EP | --http HOST:PORT) [--prompt-words 1600] [--reps 5]
 *       The cached-prefix figure: for each rep a fresh prompt (its first 90% of words a new
 *       "document", the last 10% a question) is sent cold, then the same document with another
 *       question of the same length: the second request finds its first ~90% cached. One token
 *       each, so TTFT is the prefill. Prints medians of both and their ratio.
 *
 * Why it is built this way:
 *  - One thread per client and blocking I/O: what a client measures is then only its own wait,
 *    and both servers see the same arrival pattern.
 *  - The kvmesh side talks to the worker directly over ZeroMQ with libkvmesh (client/kvmesh.h),
 *    streaming `tok` frames; the llama-server side speaks HTTP/1.1 over a plain socket to its
 *    /completion endpoint with "stream": true and reads the SSE `data:` lines (chunked transfer
 *    encoding undone here). TTFT is request sent -> first token received, ITL the gaps between
 *    consecutive tokens as this process receives them, for both alike. The HTTP connection is made
 *    before the clock starts, as the ZeroMQ connection is.
 *  - Greedy sampling (temperature 0) on both. The kvmesh wire protocol has no ignore-EOS switch,
 *    so neither side ignores EOS: max_tokens is fixed and the tokens actually received are counted
 *    (token frames for kvmesh; llama-server's running tokens_predicted for llama-server).
 *  - Prompts are deterministic functions of (concurrency, client, request), so two runs against two
 *    servers send byte-identical text; each starts with its own number, so no two share a cached
 *    prefix beyond a page.
 * A benchmark prints figures; it asserts nothing about time.
 */
#define _GNU_SOURCE /* memmem, strcasestr */
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "client/kvmesh.h"

static double bw_now_ms(void)
{
    return km_now_ns() / 1e6;
}

/* ---------------------------------------------------------------- samples */

typedef struct bw_vec {
    double *v;
    size_t n, cap;
} bw_vec;

static void bw_vec_push(bw_vec *a, double x)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        double *v = realloc(a->v, cap * sizeof *v);
        if (!v) return; /* a lost sample, not a crash */
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
}

static void bw_vec_merge(bw_vec *into, const bw_vec *from)
{
    for (size_t i = 0; i < from->n; i++) bw_vec_push(into, from->v[i]);
}

/* One request as the client saw it. ITL gaps go straight into *itl (NULL: not kept). */
typedef struct bw_req {
    double t0, t_first, t_last;
    uint32_t n_tokens, prompt_tokens, cached_tokens;
    bw_vec *itl;
    int failed;
} bw_req;

static void bw_req_token(bw_req *r, uint32_t k)
{
    double t = bw_now_ms();
    for (uint32_t i = 0; i < k; i++) {
        if (r->n_tokens == 0)
            r->t_first = t;
        else if (r->itl)
            bw_vec_push(r->itl, i == 0 ? t - r->t_last : 0.0);
        r->n_tokens++;
    }
    r->t_last = t;
}

/* ---------------------------------------------------------------- targets */

typedef struct bw_target {
    const char *label;
    const char *endpoint; /* kvmesh: ZeroMQ endpoint */
    char host[64];        /* llama-server: HOST:PORT split */
    int port;
    bool http;
    const char *model;
} bw_target;

typedef struct bw_conn {
    kvm_client *kvm; /* kvmesh side; the HTTP side opens one TCP connection per request */
} bw_conn;

static int bw_conn_open(const bw_target *t, bw_conn *c)
{
    memset(c, 0, sizeof *c);
    if (t->http) return 0;
    km_errbuf err = {{0}};
    kvm_opts o = {.timeout_ms = 600000};
    if (kvm_open(t->endpoint, &o, &c->kvm, &err)) {
        fprintf(stderr, "bench_worker: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static void bw_conn_close(bw_conn *c)
{
    if (c->kvm) kvm_close(c->kvm);
    c->kvm = NULL;
}

/* ---- kvmesh */

static int bw_kvm_on_token(void *user, uint32_t index, int32_t token, const char *text, size_t len)
{
    bw_req_token(user, 1);
    return 0;
}

static int bw_kvm_request(const bw_target *t, bw_conn *c, const char *prompt, int max_tokens,
                          bw_req *r)
{
    km_msg_request q;
    kvm_request_init(&q);
    q.model = t->model;
    q.prompt = prompt;
    q.temperature = 0;
    q.max_tokens = (uint32_t)max_tokens;
    q.stream = true;
    kvm_result res;
    km_errbuf err = {{0}};
    r->t0 = bw_now_ms();
    int rc = kvm_generate(c->kvm, &q, bw_kvm_on_token, r, &res, &err);
    if (rc) {
        fprintf(stderr, "bench_worker: kvmesh request: %s\n", err.msg);
        r->failed = 1;
    } else {
        r->prompt_tokens = res.prompt_tokens;
        r->cached_tokens = res.cached_tokens;
    }
    kvm_result_free(&res);
    return rc ? -1 : 0;
}

/* ---- llama-server: HTTP/1.1, chunked SSE */

typedef struct bw_http {
    km_buf raw;  /* bytes from the socket not yet consumed */
    size_t off;  /* consumed prefix of raw */
    km_buf body; /* de-chunked body not yet split into lines */
    bool headers_done, chunked, done;
    size_t chunk_left; /* bytes left in the current chunk; 0 = a size line comes next */
    bool chunk_crlf;   /* a chunk's trailing CRLF comes next */
    int status;
} bw_http;

/* One SSE line. Returns -1 on a server error. */
static int bw_http_line(bw_http *h, const char *line, size_t n, bw_req *r)
{
    if (n >= 6 && !strncmp(line, "error:", 6)) {
        fprintf(stderr, "bench_worker: llama-server: %.*s\n", (int)n, line);
        return -1;
    }
    if (n < 5 || strncmp(line, "data:", 5)) return 0;
    json_error_t je;
    json_t *o = json_loadb(line + 5, n - 5, 0, &je);
    if (!o) return 0; /* "[DONE]" and such */
    json_int_t pred = json_integer_value(json_object_get(o, "tokens_predicted"));
    if (pred > (json_int_t)r->n_tokens) bw_req_token(r, (uint32_t)(pred - r->n_tokens));
    if (json_is_true(json_object_get(o, "stop"))) {
        r->prompt_tokens = (uint32_t)json_integer_value(json_object_get(o, "tokens_evaluated"));
        json_t *tm = json_object_get(o, "timings");
        r->cached_tokens = (uint32_t)json_integer_value(json_object_get(tm, "cache_n"));
        h->done = true;
    }
    json_decref(o);
    return 0;
}

/* Feeds everything received so far through header parsing, de-chunking and line splitting. */
static int bw_http_feed(bw_http *h, bw_req *r)
{
    char *p = (char *)h->raw.data;
    if (!h->headers_done) {
        char *e = memmem(p, h->raw.len, "\r\n\r\n", 4);
        if (!e) return 0;
        *e = 0;
        if (sscanf(p, "HTTP/1.%*d %d", &h->status) != 1) h->status = 0;
        for (char *l = strstr(p, "\r\n"); l; l = strstr(l + 2, "\r\n"))
            if (!strncasecmp(l + 2, "transfer-encoding:", 18) && strcasestr(l + 2, "chunked"))
                h->chunked = true;
        if (h->status != 200) {
            fprintf(stderr, "bench_worker: llama-server answered %d: %.300s\n", h->status,
                    e + 4 < p + h->raw.len ? e + 4 : "");
            return -1;
        }
        h->headers_done = true;
        h->off = (size_t)(e + 4 - p);
    }
    while (h->off < h->raw.len) {
        char *q = p + h->off;
        size_t avail = h->raw.len - h->off;
        if (!h->chunked) {
            km_buf_append(&h->body, q, avail);
            h->off += avail;
        } else if (h->chunk_crlf) {
            if (avail < 2) break;
            h->off += 2;
            h->chunk_crlf = false;
        } else if (h->chunk_left == 0) {
            char *nl = memmem(q, avail, "\r\n", 2);
            if (!nl) break;
            h->chunk_left = strtoul(q, NULL, 16);
            h->off += (size_t)(nl + 2 - q);
            if (h->chunk_left == 0) { /* last chunk */
                h->done = true;
                h->off = h->raw.len;
            }
        } else {
            size_t k = avail < h->chunk_left ? avail : h->chunk_left;
            km_buf_append(&h->body, q, k);
            h->off += k;
            h->chunk_left -= k;
            if (h->chunk_left == 0) h->chunk_crlf = true;
        }
    }
    /* whole lines of the body */
    size_t start = 0;
    char *b = (char *)h->body.data;
    for (;;) {
        char *nl = start < h->body.len ? memchr(b + start, '\n', h->body.len - start) : NULL;
        if (!nl) break;
        size_t n = (size_t)(nl - (b + start));
        if (n && b[start + n - 1] == '\r') n--;
        if (bw_http_line(h, b + start, n, r)) return -1;
        start = (size_t)(nl - b) + 1;
    }
    if (start) {
        memmove(b, b + start, h->body.len - start);
        h->body.len -= start;
    }
    return 0;
}

static int bw_http_request(const bw_target *t, const char *prompt, int max_tokens, bw_req *r)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {.tv_sec = 600};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)t->port)};
    if (inet_pton(AF_INET, t->host, &sa.sin_addr) != 1 ||
        connect(fd, (struct sockaddr *)&sa, sizeof sa)) {
        fprintf(stderr, "bench_worker: connect %s:%d: %s\n", t->host, t->port, strerror(errno));
        close(fd);
        r->failed = 1;
        return -1;
    }
    json_t *o = json_pack("{s:s, s:i, s:f, s:b, s:b}", "prompt", prompt, "n_predict", max_tokens,
                          "temperature", 0.0, "stream", 1, "cache_prompt", 1);
    char *body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    km_buf req = {0};
    km_buf_printf(&req,
                  "POST /completion HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                  "Accept: text/event-stream\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s",
                  t->host, t->port, strlen(body), body);
    free(body);
    bw_http h = {0};
    int rc = 0;
    r->t0 = bw_now_ms();
    for (size_t sent = 0; sent < req.len;) {
        ssize_t k = send(fd, req.data + sent, req.len - sent, MSG_NOSIGNAL);
        if (k <= 0) {
            rc = -1;
            break;
        }
        sent += (size_t)k;
    }
    while (!rc && !h.done) {
        if (km_buf_reserve(&h.raw, 65536)) {
            rc = -1;
            break;
        }
        ssize_t k = recv(fd, h.raw.data + h.raw.len, 65536, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            fprintf(stderr, "bench_worker: llama-server closed the stream early (%s)\n",
                    k < 0 ? strerror(errno) : "EOF");
            rc = -1;
            break;
        }
        h.raw.len += (size_t)k;
        rc = bw_http_feed(&h, r);
        /* drop what has been consumed */
        if (h.headers_done && h.off) {
            memmove(h.raw.data, h.raw.data + h.off, h.raw.len - h.off);
            h.raw.len -= h.off;
            h.off = 0;
        }
    }
    close(fd);
    km_buf_free(&req);
    km_buf_free(&h.raw);
    km_buf_free(&h.body);
    if (rc) r->failed = 1;
    return rc;
}

static int bw_request(const bw_target *t, bw_conn *c, const char *prompt, int max_tokens, bw_req *r)
{
    return t->http ? bw_http_request(t, prompt, max_tokens, r)
                   : bw_kvm_request(t, c, prompt, max_tokens, r);
}

/* ---------------------------------------------------------------- prompts */

static const char *bw_words[] = {
    "orbit",   "valve",   "ledger",  "harbor", "cobalt", "meadow", "signal", "quartz",
    "lantern", "ferry",   "granite", "velvet", "pixel",  "summit", "tundra", "violet",
    "walnut",  "zephyr",  "river",   "engine", "garden", "candle", "mirror", "forest",
    "copper",  "thunder", "pepper",  "island", "marble", "canyon", "falcon", "ribbon"};

/* n pseudo-random words from seed, with a full stop every 12. */
static void bw_words_append(km_buf *b, uint64_t seed, int n)
{
    uint64_t s = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        km_buf_printf(b, " %s", bw_words[(s >> 33) % (sizeof bw_words / sizeof *bw_words)]);
        if (i % 12 == 11) km_buf_printf(b, ".");
    }
}

/* The prompt of request `seq` of a load run: its number first (so no two share a prefix), a
 * setting made of `words` pseudo-random words, then the opening of a story, which the model
 * continues rather than ending at once (a list of words followed by an instruction made it stop
 * early about half the time). */
static char *bw_load_prompt(uint64_t seq, int words)
{
    km_buf b = {0};
    km_buf_printf(&b, "Chapter %llu. The village kept a list of things:", (unsigned long long)seq);
    bw_words_append(&b, seq, words);
    km_buf_printf(&b, "\nOnce upon a time, in a small village by the sea, there lived an old "
                      "fisherman who");
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

/* ---------------------------------------------------------------- load */

typedef struct bw_client {
    const bw_target *t;
    int conc, index, n_req, max_tokens, words;
    pthread_barrier_t *ready, *go;
    bw_vec ttft, itl;
    uint64_t tokens;
    int failed, done_req;
    double t_end;
} bw_client;

static void *bw_client_main(void *arg)
{
    bw_client *k = arg;
    bw_conn c;
    int ok = bw_conn_open(k->t, &c) == 0;
    if (ok) { /* warm this client's connection and, on llama-server, a slot */
        char *p = bw_load_prompt(900000 + (uint64_t)k->conc * 100 + (uint64_t)k->index, 8);
        bw_req r = {0};
        bw_request(k->t, &c, p, 2, &r);
        free(p);
    }
    pthread_barrier_wait(k->ready);
    pthread_barrier_wait(k->go);
    for (int i = 0; ok && i < k->n_req; i++) {
        uint64_t seq = (uint64_t)k->conc * 100000 + (uint64_t)k->index * 1000 + (uint64_t)i;
        char *p = bw_load_prompt(seq, k->words);
        bw_req r = {.itl = &k->itl};
        if (bw_request(k->t, &c, p, k->max_tokens, &r) || r.n_tokens == 0) {
            k->failed++;
        } else {
            bw_vec_push(&k->ttft, r.t_first - r.t0);
            k->tokens += r.n_tokens;
            k->done_req++;
        }
        free(p);
    }
    if (!ok) k->failed += k->n_req;
    k->t_end = bw_now_ms();
    bw_conn_close(&c);
    return NULL;
}

static int bw_load_one(const bw_target *t, int conc, int n_req_each, int max_tokens, int words)
{
    bw_client *ks = calloc((size_t)conc, sizeof *ks);
    pthread_t *th = calloc((size_t)conc, sizeof *th);
    pthread_barrier_t ready, go;
    pthread_barrier_init(&ready, NULL, (unsigned)conc + 1);
    pthread_barrier_init(&go, NULL, (unsigned)conc + 1);
    for (int i = 0; i < conc; i++) {
        ks[i] = (bw_client){.t = t,
                            .conc = conc,
                            .index = i,
                            .n_req = n_req_each,
                            .max_tokens = max_tokens,
                            .words = words,
                            .ready = &ready,
                            .go = &go};
        pthread_create(&th[i], NULL, bw_client_main, &ks[i]);
    }
    pthread_barrier_wait(&ready); /* every client warmed up */
    double t0 = bw_now_ms();
    pthread_barrier_wait(&go);
    double t_end = t0;
    bw_vec ttft = {0}, itl = {0};
    uint64_t tokens = 0;
    int failed = 0, done = 0;
    for (int i = 0; i < conc; i++) {
        pthread_join(th[i], NULL);
        if (ks[i].t_end > t_end) t_end = ks[i].t_end;
        bw_vec_merge(&ttft, &ks[i].ttft);
        bw_vec_merge(&itl, &ks[i].itl);
        tokens += ks[i].tokens;
        failed += ks[i].failed;
        done += ks[i].done_req;
        free(ks[i].ttft.v);
        free(ks[i].itl.v);
    }
    double wall_s = (t_end - t0) / 1e3;
    printf("result server=%s conc=%d requests=%d failed=%d tokens=%llu tokens_per_req=%.1f "
           "wall_s=%.2f tok_s=%.1f ttft_p50=%.1f ttft_p99=%.1f itl_p50=%.2f itl_p99=%.2f\n",
           t->label, conc, done, failed, (unsigned long long)tokens,
           done ? (double)tokens / done : 0.0, wall_s, wall_s > 0 ? tokens / wall_s : 0.0,
           bench_pct(ttft.v, ttft.n, 0.5), bench_pct(ttft.v, ttft.n, 0.99),
           bench_pct(itl.v, itl.n, 0.5), bench_pct(itl.v, itl.n, 0.99));
    fflush(stdout);
    free(ttft.v);
    free(itl.v);
    pthread_barrier_destroy(&ready);
    pthread_barrier_destroy(&go);
    free(ks);
    free(th);
    return failed ? 1 : 0;
}

static int bw_load(const bw_target *t, int argc, char **argv)
{
    const char *levels = bench_arg(argc, argv, "--concurrency", "1,8,32");
    int per = atoi(bench_arg(argc, argv, "--requests-per-client", "2"));
    int min_req = atoi(bench_arg(argc, argv, "--min-requests", "8"));
    int max_tokens = atoi(bench_arg(argc, argv, "--max-tokens", "64"));
    int words = atoi(bench_arg(argc, argv, "--prompt-words", "48"));
    int rc = 0;
    char *copy = strdup(levels), *save = NULL;
    for (char *s = strtok_r(copy, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
        int conc = atoi(s);
        if (conc < 1) continue;
        int each = per;
        if (conc * each < min_req) each = (min_req + conc - 1) / conc;
        rc |= bw_load_one(t, conc, each, max_tokens, words);
    }
    free(copy);
    return rc;
}

/* ---------------------------------------------------------------- cached prefix */

static int bw_prefix(const bw_target *t, int argc, char **argv)
{
    int words = atoi(bench_arg(argc, argv, "--prompt-words", "1600"));
    int reps = atoi(bench_arg(argc, argv, "--reps", "5"));
    int doc_words = words * 9 / 10, q_words = words - doc_words;
    bw_conn c;
    if (bw_conn_open(t, &c)) return 1;
    double *cold = calloc((size_t)reps, sizeof *cold), *warm = calloc((size_t)reps, sizeof *warm);
    uint32_t ptok = 0, ctok_cold = 0, ctok_warm = 0;
    int rc = 0;
    for (int i = 0; i < reps && !rc; i++) {
        km_buf doc = {0};
        /* a document of its own per (size, rep): nothing of it is cached before its cold run */
        uint64_t seed = 1000000 + (uint64_t)words * 100 + (uint64_t)i;
        km_buf_printf(&doc, "Document %llu.", (unsigned long long)seed);
        bw_words_append(&doc, seed, doc_words);
        double *into[2] = {&cold[i], &warm[i]};
        for (int k = 0; k < 2 && !rc; k++) {
            km_buf p = {0};
            km_buf_append(&p, doc.data, doc.len);
            km_buf_printf(&p, "\nQuestion %c:", 'A' + k);
            bw_words_append(&p, seed * 2 + (uint64_t)k, q_words);
            km_buf_append(&p, "", 1);
            bw_req r = {0};
            rc = bw_request(t, &c, (const char *)p.data, 1, &r);
            if (!rc && r.n_tokens == 0) rc = -1;
            *into[k] = r.t_first - r.t0;
            if (k == 0) {
                ptok = r.prompt_tokens;
                ctok_cold = r.cached_tokens;
            } else {
                ctok_warm = r.cached_tokens;
            }
            km_buf_free(&p);
        }
        km_buf_free(&doc);
    }
    if (!rc) {
        double c50 = bench_pct(cold, (size_t)reps, 0.5), w50 = bench_pct(warm, (size_t)reps, 0.5);
        printf("prefix server=%s prompt_tokens=%u cached_tokens_cold=%u cached_tokens=%u "
               "reps=%d cold_ttft_ms=%.1f cached_ttft_ms=%.1f speedup=%.2f\n",
               t->label, ptok, ctok_cold, ctok_warm, reps, c50, w50, w50 > 0 ? c50 / w50 : 0.0);
    } else {
        fprintf(stderr, "bench_worker: prefix run failed\n");
    }
    free(cold);
    free(warm);
    bw_conn_close(&c);
    return rc ? 1 : 0;
}

/* ---------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "load") && strcmp(argv[1], "prefix"))) {
        fprintf(stderr, "usage: bench_worker load|prefix (--kvmesh EP | --http HOST:PORT) "
                        "[options; see bench/bench_worker.c]\n");
        return 2;
    }
    bw_target t = {.model = bench_arg(argc, argv, "--model", "SmolLM2-135M-Instruct")};
    const char *kep = bench_arg(argc, argv, "--kvmesh", NULL);
    const char *hep = bench_arg(argc, argv, "--http", NULL);
    if (!!kep == !!hep) {
        fprintf(stderr, "bench_worker: give exactly one of --kvmesh EP and --http HOST:PORT\n");
        return 2;
    }
    if (kep) {
        t.endpoint = kep;
        t.label = "kvmesh";
    } else {
        const char *colon = strrchr(hep, ':');
        if (!colon || (size_t)(colon - hep) >= sizeof t.host) {
            fprintf(stderr, "bench_worker: --http wants HOST:PORT\n");
            return 2;
        }
        memcpy(t.host, hep, (size_t)(colon - hep));
        t.port = atoi(colon + 1);
        t.http = true;
        t.label = "llama-server";
    }
    t.label = bench_arg(argc, argv, "--label", t.label);
    if (!strcmp(argv[1], "load")) return bw_load(&t, argc, argv);
    return bw_prefix(&t, argc, argv);
}
