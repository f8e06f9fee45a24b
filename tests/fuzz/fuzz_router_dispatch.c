/*
 * fuzz_router_dispatch.c — libFuzzer target for a router's whole request path: client frames
 * go through rt_on_front_message (decode, the field whitelist, salts, tokenization on or off the
 * loop, the page-hash chain), dispatch and the router queue, out to two workers and back
 * through the relay, as in the daemon; not only the parsers (fuzz_proto does those).
 *
 * The router is the real one (rt_router_create) on inproc endpoints, with no HTTP or admin
 * port, insecure, --max-inflight 1 and a queue of 8, so most requests wait in the queue and are
 * dispatched later: the path of issue 41's use-after-free (strings a queued request kept
 * pointing into a freed frame). Each frame is delivered as the router's loop would deliver one
 * from its front, with a client identity and key name (the salt's namespace). The two workers
 * are ROUTER sockets here that answer every request with one token and a `done` (every cancel
 * with a canceled `done`); after each input the loop runs until no request is left, and the
 * few that a bounded run leaves (a prompt on the thread pool) are abandoned, so no state but
 * the prefix index carries over between inputs.
 *
 * Input: records of [client byte][length, 2 bytes little-endian][frame]. Seeds
 * (tests/fuzz/corpus/fuzz_router_dispatch) are such records of valid `req` frames (text and
 * token prompts, stop strings, salts, pull hints) and `cancel`s. Needs the default model (make
 * deps) for the tokenizer; run from the repository root.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"

#define FZ_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static rt_router *g_r;
static km_zsec *g_sec;
static void *g_wk[2]; /* the workers' ROUTER sockets */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    km_log_set_level(KM_LOG_ERROR); /* quiet: every frame would log */
    km_errbuf err = {{0}};
    km_zsec_opts so = {.insecure = true};
    if (km_zsec_open(&so, &g_sec, &err)) abort();
    rt_worker_cfg w[2] = {{"w0", "inproc://fz-w0", "inproc://fz-w0-ev"},
                          {"w1", "inproc://fz-w1", "inproc://fz-w1-ev"}};
    rt_config c;
    rt_config_default(&c);
    c.model_path = FZ_MODEL;
    c.model_name = "smol";
    c.page_tokens = 16;
    c.front_url = "inproc://fz-front";
    c.http_port = -1;
    c.admin_port = -1;
    c.workers = w;
    c.n_workers = 2;
    c.max_inflight = 1;
    c.max_queue = 8;
    c.sec = g_sec;
    if (rt_router_create(&c, &g_r, &err)) {
        fprintf(stderr, "fuzz_router_dispatch: %s (make deps; run from the repository root)\n",
                err.msg);
        abort();
    }
    for (int i = 0; i < 2; i++) {
        if (km_zsock_open(g_r->zctx, KM_ZROUTER, NULL, &g_wk[i], &err) ||
            km_zsock_bind(g_wk[i], w[i].requests_url, &err))
            abort();
        g_r->w[i].connected = true; /* inproc connections have no monitor events */
    }
    return 0;
}

/* Requests in the router's table. */
static int requests_left(rt_router *r)
{
    int n = 0;
    for (int b = 0; b < RT_RQ_BUCKETS; b++)
        for (rt_rq *q = r->buckets[b]; q; q = q->hnext) n++;
    return n;
}

/* One frame to worker socket s's peer env. */
static void answer(void *s, const km_zframe *env, km_msg *m)
{
    km_buf b = {0};
    if (!km_msg_encode(m, NULL, &b, NULL)) {
        km_zframe parts[2] = {env[0], {b.data, b.len}};
        km_zsend(s, parts, 2, KM_ZDONTWAIT, NULL);
    }
    km_buf_free(&b);
}

/* What the fake workers got: a token and a done per request, a canceled done per cancel. */
static int workers_answer(void)
{
    int n = 0;
    km_zmsg z = {0};
    for (int i = 0; i < 2; i++)
        while (!km_zrecv(g_wk[i], &z, 0, NULL)) {
            const km_zframe *body = km_zmsg_body(&z);
            km_msg m, a;
            if (z.n != 2 || !body || km_msg_decode(body->data, body->len, NULL, &m, NULL))
                abort(); /* the router sent a frame no worker could read */
            n++;
            uint64_t id = m.type == KM_MSG_REQUEST ? m.req.id : m.cancel.id;
            if (m.type == KM_MSG_REQUEST) {
                if (m.req.pull_from && (m.req.pull_from[0] != 'w' || !m.req.pull_addr_len))
                    abort(); /* a hint the router did not make */
                km_msg_init(&a, KM_MSG_TOKEN);
                a.tok = (km_msg_token){.id = id, .index = 0, .token = 42, .text = "x"};
                answer(g_wk[i], z.part, &a);
            }
            km_msg_init(&a, KM_MSG_DONE);
            a.done.id = id;
            a.done.finish = m.type == KM_MSG_REQUEST ? KM_FINISH_LENGTH : KM_FINISH_CANCELED;
            a.done.completion_tokens = m.type == KM_MSG_REQUEST;
            if (m.type == KM_MSG_REQUEST || m.type == KM_MSG_CANCEL) answer(g_wk[i], z.part, &a);
            km_msg_clear(&m);
        }
    km_zmsg_clear(&z);
    return n;
}

static void drive(rt_router *r)
{
    for (int round = 0; round < 256 && requests_left(r); round++) {
        uv_run(&r->loop, UV_RUN_NOWAIT); /* tokenizations finished on the thread pool */
        rt_pump(r);
        if (!workers_answer()) continue;
        rt_pump(r);
    }
    /* an abandon may dispatch the requests parked behind it: until none is left */
    for (int k = 0; k < 16 && requests_left(r); k++) {
        for (int b = 0; b < RT_RQ_BUCKETS; b++)
            while (r->buckets[b]) rt_rq_abandon(r, r->buckets[b]);
        workers_answer(); /* the cancels the abandons sent */
        rt_pump(r);
    }
    if (requests_left(r)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t at = 0;
    while (at + 3 <= size) {
        uint8_t who = data[at];
        size_t len = (size_t)data[at + 1] | (size_t)data[at + 2] << 8;
        at += 3;
        if (len > size - at) len = size - at;
        char ident[2] = {'c', (char)('0' + (who & 1))};
        km_zmsg zm = {0};
        zm.part[0] = (km_zframe){ident, sizeof ident};
        zm.part[1] = (km_zframe){data + at, len};
        zm.n = 2;
        zm.src_fd = -1;
        zm.peer.role = who & 2 ? KM_ROLE_OPERATOR : KM_ROLE_CLIENT;
        snprintf(zm.peer.name, sizeof zm.peer.name, "client%d", who & 1);
        rt_on_front_message(g_r, &zm);
        at += len;
        if (who & 4) drive(g_r); /* else the next frame comes while these are queued */
    }
    drive(g_r);
    return 0;
}
