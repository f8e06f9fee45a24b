/*
 * test_pageplane.c — a kvmesh-worker's page plane (its --peer-listen UCX port) attacked the way
 * issue 31 item 3 describes, by a process that holds no member key and no lease: raw bytes on a
 * TCP connection to the port, and a real libucp client connected straight to the listener that
 * sends fetches with guessed pull ids, places and tokens, forged pages and refusals, malformed
 * active-message headers, messages of every other id, a thousand endpoints, and a million
 * fetches it never reads the answers of. Each time: nothing comes back (no page byte, no
 * refusal), nothing is stored, the worker does not crash, its resident memory and its log stay
 * bounded, it counts what it dropped (kvmesh_kv_page_plane_rejected_total) and it keeps
 * serving requests. That a member reads only its own lease's pages, under the lease's key, is
 * tests/unit/test_xfer_peer.c's.
 *
 * The client uses UCX_TLS=tcp (as between hosts). Run from the repository root after
 * `make build` (make integration); without the default model every test skips.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/svc.h"
#include "peer/ucx_internal.h" /* the wire headers: pr_fetch_hdr, pr_data_hdr, PR_AM_* */
#include "tests/integration/harness.h"

static void suite_init(void)
{
    setenv("UCX_TLS", "tcp", 1);
}

TestSuite(pageplane, .init = suite_init, .fini = it_kill_all, .timeout = 600);

static bool have_model(void)
{
    return it_have((const char *const[]){IT_MODEL, it_worker_bin(), NULL});
}

/* ---------------------------------------------------------------- the worker */

static int g_port; /* the worker's UCX port, from its log (peer_node_open) */

static void start_worker(it_proc *w)
{
    memset(w, 0, sizeof *w);
    const char *flags[] = {"--admin-port=0",     "--threads=1",
                           "--log-level=info",   "--peer-listen=127.0.0.1:0",
                           "--no-peer-prefault", NULL};
    it_start_worker(w, "plane", flags, NULL);
    char path[128], line[512];
    snprintf(path, sizeof path, "%s/worker.log", w->dir);
    g_port = 0;
    const uint64_t end = it_deadline(30000);
    while (!g_port) {
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, "event=peer_node_open");
            if (p && (p = strstr(p, " port="))) g_port = atoi(p + 6);
        }
        if (f) fclose(f);
        if (!g_port) cr_assert(it_poll(end), "the worker never opened its transfer node");
    }
}

static long log_bytes(const it_proc *w)
{
    char path[128];
    struct stat st;
    snprintf(path, sizeof path, "%s/worker.log", w->dir);
    return stat(path, &st) ? -1 : (long)st.st_size;
}

static long rss_kib(const it_proc *w)
{
    char path[64], line[256];
    long kib = -1;
    snprintf(path, sizeof path, "/proc/%d/status", (int)w->pid);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kib = atol(line + 6);
    if (f) fclose(f);
    return kib;
}

static double rejected(const it_proc *w, const char *reason)
{
    char series[128];
    snprintf(series, sizeof series, "kvmesh_kv_page_plane_rejected_total{reason=\"%s\"}", reason);
    double v = it_metric(w->admin_port, series);
    return v < 0 ? 0 : v;
}

/* The worker still answers a greedy request with its tokens, and served no page to anyone. */
static void still_serving(const it_proc *w)
{
    cr_assert_gt(w->pid, 0);
    void *s = it_dealer(w->req);
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    const int32_t toks[] = {1, 2, 3, 4, 5, 6, 7, 8};
    m.req.id = 1;
    m.req.model = "SmolLM2-135M-Instruct";
    m.req.tokens = toks;
    m.req.n_tokens = 8;
    m.req.max_tokens = 4;
    it_send_msg(s, &m);
    bool done = false;
    for (const uint64_t end = it_deadline(60000); !done && it_poll(end);) {
        km_msg r;
        if (!it_recv_msg(s, &r, 200)) continue;
        cr_assert_neq(r.type, KM_MSG_ERROR, "the worker refused a request after the attack");
        done = r.type == KM_MSG_DONE;
        km_msg_clear(&r);
    }
    cr_assert(done, "no answer to a request after the attack");
    km_zsock_close(&s);
    double out = it_metric(w->admin_port, "kvmesh_kv_transfer_bytes_total{direction=\"out\"}");
    cr_assert_leq(out, 0, "the worker served %.0f page bytes to an attacker", out);
}

/* ---------------------------------------------------------------- a bare libucp client */

typedef struct client {
    ucp_context_h ctx;
    ucp_worker_h w;
    long answers;  /* PR_AM_DATA messages that reached us: must stay 0 */
    long inflight; /* our sends not completed */
} client;

static ucs_status_t on_answer(void *arg, const void *header, size_t hlen, void *data, size_t len,
                              const ucp_am_recv_param_t *param)
{
    ((client *)arg)->answers++;
    return UCS_OK;
}

static void client_open(client *c)
{
    memset(c, 0, sizeof *c);
    ucp_params_t prm = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    cr_assert_eq(ucp_init(&prm, NULL, &c->ctx), UCS_OK);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    cr_assert_eq(ucp_worker_create(c->ctx, &wp, &c->w), UCS_OK);
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = PR_AM_DATA,
                                 .cb = on_answer,
                                 .arg = c};
    cr_assert_eq(ucp_worker_set_am_recv_handler(c->w, &hp), UCS_OK);
}

static void ep_err(void *arg, ucp_ep_h ep, ucs_status_t status) {}

static ucp_ep_h client_connect(client *c)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)g_port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {(struct sockaddr *)&sa, sizeof sa},
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {ep_err, NULL}};
    ucp_ep_h h = NULL;
    cr_assert_eq(ucp_ep_create(c->w, &ep, &h), UCS_OK);
    return h;
}

static void sent(void *req, ucs_status_t status, void *arg)
{
    ((client *)arg)->inflight--;
    ucp_request_free(req);
}

/* Sends one active message of id on ep (header hlen bytes, data len bytes); keeps at most a few
 * thousand in flight. */
static void client_send(client *c, ucp_ep_h ep, unsigned id, const void *h, size_t hlen,
                        const void *data, size_t len)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
                               .cb.send = sent,
                               .user_data = c};
    void *r = ucp_am_send_nbx(ep, id, h, hlen, data, len, &prm);
    if (UCS_PTR_IS_PTR(r)) c->inflight++;
    const uint64_t end = it_deadline(60000);
    while (c->inflight > 4096) {
        ucp_worker_progress(c->w);
        cr_assert_lt(km_now_ns(), end, "sends never completed");
    }
}

/* Progresses until every send completed, then for ms more (answers would arrive then). */
static void client_drain(client *c, int ms)
{
    const uint64_t end = it_deadline(60000);
    while (c->inflight > 0) {
        ucp_worker_progress(c->w);
        cr_assert_lt(km_now_ns(), end, "sends never completed");
    }
    const uint64_t quiet = it_deadline(ms);
    while (km_now_ns() < quiet) ucp_worker_progress(c->w);
}

static void client_close(client *c, ucp_ep_h *eps, int n)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    for (int i = 0; i < n; i++) {
        if (!eps[i]) continue;
        void *r = ucp_ep_close_nbx(eps[i], &prm);
        const uint64_t end = it_deadline(10000);
        while (UCS_PTR_IS_PTR(r) && ucp_request_check_status(r) == UCS_INPROGRESS &&
               km_now_ns() < end)
            ucp_worker_progress(c->w);
        if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    }
    ucp_worker_destroy(c->w);
    ucp_cleanup(c->ctx);
}

/* A worker, and a client of its page plane. */
static void attack_begin(it_proc *w, client *c)
{
    start_worker(w);
    client_open(c);
}

/* The client goes; the worker must still serve, then stops. */
static void attack_end(it_proc *w, client *c, ucp_ep_h *eps, int n)
{
    client_close(c, eps, n);
    still_serving(w);
    it_stop(w);
}

/* A fetch as a puller would send it, for a guessed pull id and place, with a made-up token. */
static pr_fetch_hdr guessed_fetch(uint64_t pull_id, uint32_t index, uint64_t salt)
{
    pr_fetch_hdr f = {.pull_id = pull_id,
                      .index = index,
                      .region = 0,
                      .addr = 0x7f0000000000ull + index * 368640ull,
                      .bytes = 368640};
    for (int i = 0; i < PR_TOKEN_BYTES; i++) f.token[i] = (uint8_t)(salt * 31 + i);
    return f;
}

/* ---------------------------------------------------------------- raw bytes */

static void raw_bytes(const void *p, size_t n)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)g_port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
        for (size_t off = 0; off < n;) {
            ssize_t k = send(fd, (const char *)p + off, n - off, MSG_NOSIGNAL);
            if (k <= 0) break; /* the worker may close it: that is fine */
            off += (size_t)k;
        }
    }
    close(fd);
}

Test(pageplane, raw_bytes_on_the_port_crash_nothing)
{
    if (!have_model()) return;
    it_proc w;
    start_worker(&w);
    static uint8_t buf[1 << 20];
    memset(buf, 0, 64);
    raw_bytes(buf, 64);
    memset(buf, 0, 65536);
    raw_bytes(buf, 65536);
    memset(buf, 0xff, 65536);
    raw_bytes(buf, 65536);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < sizeof buf; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (uint8_t)x;
    }
    raw_bytes(buf, sizeof buf);
    for (int i = 0; i < 100; i++) raw_bytes(buf, 8 + (size_t)i); /* half-open handshakes */
    still_serving(&w);
    it_stop(&w);
}

/* ---------------------------------------------------------------- a keyless libucp client */

Test(pageplane, guessed_and_malformed_fetches_read_nothing)
{
    if (!have_model()) return;
    it_proc w;
    client c;
    attack_begin(&w, &c);
    ucp_ep_h ep = client_connect(&c);
    /* guessed fetches: pull ids are small counters, every place of a few pages */
    int sent_fetches = 0;
    for (uint64_t id = 0; id < 256; id++)
        for (uint32_t i = 0; i < 8; i++, sent_fetches++) {
            pr_fetch_hdr f = guessed_fetch(id, i, id);
            client_send(&c, ep, PR_AM_FETCH, &f, sizeof f, NULL, 0);
        }
    /* the same, with an all-zero token (a puller that never got an offer) */
    for (uint64_t id = 0; id < 64; id++, sent_fetches++) {
        pr_fetch_hdr f = guessed_fetch(id, 0, 0);
        memset(f.token, 0, sizeof f.token);
        client_send(&c, ep, PR_AM_FETCH, &f, sizeof f, NULL, 0);
    }
    /* malformed: short, long, with a payload */
    static uint8_t junk[4096];
    memset(junk, 0xa5, sizeof junk);
    const size_t lens[] = {0, 1, 7, 8, sizeof(pr_fetch_hdr) - 1, sizeof(pr_fetch_hdr) + 1, 200};
    for (unsigned i = 0; i < sizeof lens / sizeof lens[0]; i++)
        client_send(&c, ep, PR_AM_FETCH, junk, lens[i], NULL, 0);
    pr_fetch_hdr f = guessed_fetch(1, 0, 7);
    client_send(&c, ep, PR_AM_FETCH, &f, sizeof f, junk, sizeof junk);
    /* forged pages and refusals, for pulls the worker may run: fragments of every kind */
    for (uint64_t id = 0; id < 64; id++) {
        pr_data_hdr h = {.pull_id = id, .index = 0, .offset = 0, .len = sizeof junk};
        client_send(&c, ep, PR_AM_DATA, &h, sizeof h, junk, sizeof junk);
        h.status = 1;
        h.len = 0;
        client_send(&c, ep, PR_AM_DATA, &h, sizeof h, NULL, 0);
        client_send(&c, ep, PR_AM_DATA, junk, 3, junk, 17);
    }
    client_drain(&c, 500);
    cr_assert_eq(c.answers, 0, "a keyless client got %ld answers", c.answers);
    IT_WAIT(rejected(&w, "unkeyed") >= sent_fetches, 10000, "unkeyed fetches: %.0f of %d counted",
            rejected(&w, "unkeyed"), sent_fetches);
    attack_end(&w, &c, &ep, 1);
}

Test(pageplane, messages_of_any_id_neither_log_nor_crash)
{
    if (!have_model()) return;
    it_proc w;
    client c;
    attack_begin(&w, &c);
    ucp_ep_h ep = client_connect(&c);
    uint8_t h[24] = {0};
    client_send(&c, ep, 1, h, sizeof h, NULL, 0); /* the connection up before the log is read */
    client_drain(&c, 200);
    const long log0 = log_bytes(&w);
    const int n = 100000;
    for (int i = 0; i < n; i++) {
        unsigned id = (unsigned)(i * 7919) % PR_AM_IDS;
        if (id == PR_AM_FETCH || id == PR_AM_DATA) continue;
        client_send(&c, ep, id, h, (size_t)(i % 24), NULL, 0);
    }
    client_drain(&c, 200);
    IT_WAIT(rejected(&w, "unknown_am") >= n - 100, 20000, "unknown ids: %.0f counted",
            rejected(&w, "unknown_am"));
    const long grew = log_bytes(&w) - log0;
    cr_assert_lt(grew, 16384, "%d messages of unknown ids grew the log by %ld bytes", n, grew);
    cr_log_info("%d messages of unknown ids grew the log by %ld bytes", n, grew);
    attack_end(&w, &c, &ep, 1);
}

Test(pageplane, a_thousand_endpoints_then_the_worker_serves)
{
    if (!have_model()) return;
    it_proc w;
    client c;
    attack_begin(&w, &c);
    enum { N = 1000 };
    static ucp_ep_h eps[N];
    for (int i = 0; i < N; i++) {
        eps[i] = client_connect(&c);
        pr_fetch_hdr f = guessed_fetch(1, 0, (uint64_t)i);
        client_send(&c, eps[i], PR_AM_FETCH, &f, sizeof f, NULL, 0);
        for (int k = 0; k < 8; k++) ucp_worker_progress(c.w);
    }
    client_drain(&c, 500);
    cr_assert_eq(c.answers, 0);
    attack_end(&w, &c, eps, N);
}

Test(pageplane, a_million_unread_fetches_keep_memory_bounded)
{
    if (!have_model()) return;
    it_proc w;
    client c;
    attack_begin(&w, &c);
    ucp_ep_h ep = client_connect(&c);
    pr_fetch_hdr f = guessed_fetch(1, 0, 1);
    client_send(&c, ep, PR_AM_FETCH, &f, sizeof f, NULL, 0);
    client_drain(&c, 200);
    const long rss0 = rss_kib(&w);
    const int n = 1000000;
    for (int i = 0; i < n; i++) {
        f = guessed_fetch((uint64_t)(i & 1023), (uint32_t)(i & 7), (uint64_t)i);
        client_send(&c, ep, PR_AM_FETCH, &f, sizeof f, NULL, 0);
    }
    client_drain(&c, 200);
    IT_WAIT(rejected(&w, "unkeyed") >= n, 60000, "unkeyed fetches: %.0f of %d counted",
            rejected(&w, "unkeyed"), n);
    const long grew = rss_kib(&w) - rss0;
    cr_assert_eq(c.answers, 0);
    cr_assert_lt(grew, 64 * 1024, "a million unread fetches grew the worker by %ld KiB", grew);
    cr_log_info("a million unread fetches grew the worker by %ld KiB (from %ld)", grew, rss0);
    attack_end(&w, &c, &ep, 1);
}
