/*
 * clients.c — the router's ZeroMQ front (internal.h): client `req` frames become requests
 * (their prompt tokenized, or their token ids checked against the vocabulary), client `cancel`
 * frames cancel them (text prompts are tokenized by prompt.c), and anything else gets an `err`
 * (with the frame's id when it had one, km_msg.rejected_id). rt_rq_start (prompt.c), shared with
 * the HTTP front, computes the page-hash chain that routing keys on and hands the request on.
 *
 * The router forwards every request as token ids with stream=true, whatever the client asked:
 * the worker then never tokenizes differently from the router's page-hash chain, and the router
 * always knows the tokens generated so far, which is what migration needs.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "router/internal.h"

/* The generation of the client connection on descriptor fd (0: none known). */
static uint64_t conn_gen_of(const rt_router *r, int fd)
{
    return fd >= 0 && fd < r->n_conn_gen ? r->conn_gen[fd] : 0;
}

/* ---------------------------------------------------------------- replies (rt_front_zmq) */

int rt_zsend_env(void *sock, const km_zframe *env, int n_env, const km_buf *body)
{
    km_zframe parts[KM_ZMSG_MAX_PARTS];
    int n = 0;
    for (int i = 0; i < n_env && n < KM_ZMSG_MAX_PARTS - 1; i++) parts[n++] = env[i];
    parts[n++] = (km_zframe){body->data, body->len};
    return km_zsend(sock, parts, n, KM_ZDONTWAIT, NULL);
}

void rt_send_error_env(rt_router *r, const km_zframe *env, int n_env, uint64_t id, int code,
                       uint32_t retry_after, const char *fmt, ...)
{
    char msg[KM_PROTO_MAX_MESSAGE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    km_msg m;
    km_msg_init(&m, KM_MSG_ERROR);
    m.error.id = id;
    m.error.code = code;
    m.error.message = msg;
    m.error.retry_after_ms = retry_after;
    if (!km_msg_encode(&m, &r->lim, &r->out, NULL)) rt_zsend_env(r->front, env, n_env, &r->out);
}

static void zmq_token(rt_router *r, rt_rq *q, int32_t token, const char *text, size_t len)
{
    if (!q->client_stream) {
        km_buf_append(&q->text, text, len);
        return;
    }
    km_msg m;
    km_msg_init(&m, KM_MSG_TOKEN);
    m.tok.id = q->cid;
    m.tok.index = (uint32_t)(q->n_gen - 1);
    m.tok.token = token;
    m.tok.text = text;
    m.tok.text_len = len;
    if (q->cur_tok && q->cur_tok->has_logprob) { /* relayed as the worker computed them */
        m.tok.has_logprob = true;
        m.tok.logprob = q->cur_tok->logprob;
        m.tok.top = q->cur_tok->top;
        m.tok.n_top = q->cur_tok->n_top;
    }
    if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
        rt_zsend_env(r->front, q->env, q->n_env, &r->out);
}

static void zmq_done(rt_router *r, rt_rq *q, const rt_rq_done *d)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_DONE);
    m.done.id = q->cid;
    m.done.finish = d->finish;
    /* A stream's done.text is its tail: bytes no token frame could carry (held back for a
     * possible stop string, or an incomplete last character); NULL when there are none. */
    if (!q->client_stream || q->text.len) {
        m.done.text = q->text.data ? (const char *)q->text.data : "";
        m.done.text_len = q->text.len;
    }
    m.done.prompt_tokens = (uint32_t)q->n_prompt;
    m.done.cached_tokens = d->cached;
    m.done.completion_tokens = (uint32_t)q->n_gen;
    m.done.draft_tokens = q->draft_tokens;
    m.done.accepted_draft_tokens = q->accepted_draft_tokens;
    m.done.chunk_tokens = q->chunk_tokens;
    m.done.queue_ms = d->queue_ms;
    m.done.ttft_ms = d->ttft_ms;
    m.done.total_ms = d->total_ms;
    m.done.worker = d->worker;
    m.done.migrations = (uint32_t)q->migrations;
    if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
        rt_zsend_env(r->front, q->env, q->n_env, &r->out);
}

static void zmq_error(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg)
{
    rt_send_error_env(r, q->env, q->n_env, q->cid, code, retry_after, "%s", msg);
}

static void zmq_release(rt_rq *q)
{
    (void)q; /* the envelope is the request's own memory (rt_rq_free) */
}

const rt_front_ops rt_front_zmq = {
    .origin = RQ_ZMQ,
    .name = "zmq",
    .token = zmq_token,
    .done = zmq_done,
    .error = zmq_error,
    .release = zmq_release,
};

/* ---------------------------------------------------------------- requests */

bool rt_model_ok(rt_router *r, const char *model)
{
    const char *dot = strrchr(r->model_name, '.');
    if (dot && strlen(model) == (size_t)(dot - r->model_name) &&
        !strncmp(model, r->model_name, (size_t)(dot - r->model_name)))
        return true;
    return !strcmp(model, r->model_name) || !strcmp(model, "default") ||
           (r->c.model_name && !strcmp(model, r->c.model_name)) || !strcmp(model, r->fp);
}

int rt_rq_compose_salt(rt_rq *q, const km_apikey_match *key)
{
    if (!key && (!q->salt || strncmp(q->salt, "kvmesh:", 7))) return 0; /* as it came */
    char buf[KM_PROTO_MAX_NAME + 1];
    int n = km_cache_salt_compose(key, q->salt, buf, sizeof buf);
    if (n < 0 || n > KM_PROTO_MAX_NAME) return KM_ERANGE;
    char *s = strdup(buf);
    if (!s) return KM_ENOMEM;
    free(q->salt);
    q->salt = s;
    return 0;
}

/* A client's request into q, field by field from a whitelist: the sampling parameters, and
 * copies of the strings and arrays q keeps (stop strings, salt, logit bias, chunks: checked
 * against the token prompt by the frame's decoding). Nothing else a client
 * sent reaches a worker: the pull hint, `generated`, `stream` and ids are the router's to set
 * (docs/security.md), and q->q holds no pointer into the decoded frame, which is freed when this
 * returns. peer: who sent it (its key names the cache namespace, tenants.c). */
static int rq_copy_params(rt_router *r, rt_rq *q, const km_msg_request *src, const km_zpeer *peer)
{
    km_msg tmp;
    km_msg_init(&tmp, KM_MSG_REQUEST);
    q->q = tmp.req;
    q->q.temperature = src->temperature;
    q->q.top_k = src->top_k;
    q->q.top_p = src->top_p;
    q->q.min_p = src->min_p;
    q->q.repeat_penalty = src->repeat_penalty;
    q->q.repeat_last_n = src->repeat_last_n;
    q->q.presence_penalty = src->presence_penalty;
    q->q.frequency_penalty = src->frequency_penalty;
    q->q.has_seed = src->has_seed;
    q->q.seed = src->seed;
    q->q.priority = src->priority;
    q->q.speculate = src->speculate;
    q->q.max_draft_tokens = src->max_draft_tokens;
    q->q.logprobs = src->logprobs;
    q->q.top_logprobs = src->top_logprobs;
    if (src->n_logit_bias) { /* owned by q (the frame's memory goes when this returns) */
        if (!(q->bias = malloc(sizeof *q->bias * src->n_logit_bias))) return KM_ENOMEM;
        memcpy(q->bias, src->logit_bias, sizeof *q->bias * src->n_logit_bias);
        q->q.n_logit_bias = src->n_logit_bias;
    }
    if (src->n_chunks) {
        if (!(q->chunks = malloc(sizeof *q->chunks * src->n_chunks))) return KM_ENOMEM;
        memcpy(q->chunks, src->chunks, sizeof *q->chunks * src->n_chunks);
        q->q.n_chunks = src->n_chunks;
    }
    q->q.n_stop = src->n_stop;
    for (uint32_t i = 0; i < src->n_stop && i < KM_PROTO_MAX_STOP; i++)
        if (!(q->stop[i] = strdup(src->stop[i]))) return KM_ENOMEM;
    if (src->cache_salt && !(q->salt = strdup(src->cache_salt))) return KM_ENOMEM;
    if (src->grammar && !(q->grammar = strdup(src->grammar))) return KM_ENOMEM;
    km_apikey_match key;
    bool keyed = rt_tenant_of(r->tenants, peer, &key);
    if (keyed) snprintf(q->tenant, sizeof q->tenant, "z:%s", key.tenant);
    int rc = rt_rq_compose_salt(q, keyed ? &key : NULL);
    if (rc) return rc;
    q->max_tokens = src->max_tokens;
    q->client_stream = src->stream;
    if (src->deadline_ms) q->deadline_ns = q->t_arrive + (uint64_t)src->deadline_ms * 1000000ull;
    return 0;
}

static bool env_eq(const rt_rq *q, const km_zmsg *zm);

/* The client's request with this id still in flight, or NULL (ids are unique among a client's
 * requests in flight: a second one would interleave with the first, docs/protocol.md §15). */
static rt_rq *client_rq_find(rt_router *r, const km_zmsg *zm, uint64_t cid)
{
    for (int b = 0; b < RT_RQ_BUCKETS; b++)
        for (rt_rq *q = r->buckets[b]; q; q = q->hnext)
            if (q->cid == cid && env_eq(q, zm)) return q;
    return NULL;
}

static void on_client_request(rt_router *r, const km_zmsg *zm, const km_msg_request *req)
{
    const km_zframe *env = zm->part;
    int n_env = zm->n - 1;
    if (client_rq_find(r, zm, req->id)) {
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        rt_send_error_env(r, env, n_env, req->id, KM_CODE_BAD_REQUEST, 0,
                          "req.id: %llu is already in flight from this client (ids must be "
                          "unique among a client's requests in flight)",
                          (unsigned long long)req->id);
        return;
    }
    if (!rt_model_ok(r, req->model)) {
        rt_send_error_env(r, env, n_env, req->id, KM_CODE_NOT_FOUND, 0,
                          "req.model: unknown model '%.256s' (this router serves '%s')", req->model,
                          r->model_name);
        return;
    }
    rt_rq *q = rt_rq_new(r, &rt_front_zmq);
    if (!q) {
        rt_send_error_env(r, env, n_env, req->id, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    q->cid = req->id;
    q->src_fd = zm->src_fd;
    q->src_gen = conn_gen_of(r, zm->src_fd);
    for (int i = 0; i < n_env; i++) km_buf_append(&q->env_mem, env[i].data, env[i].len);
    size_t off = 0;
    for (int i = 0; i < n_env; i++) {
        q->env[i] = (km_zframe){q->env_mem.data + off, env[i].len};
        off += env[i].len;
    }
    q->n_env = n_env;
    int rc = rq_copy_params(r, q, req, &zm->peer);
    if (rc == KM_ERANGE) {
        rt_send_error_env(r, env, n_env, req->id, KM_CODE_BAD_REQUEST, 0,
                          "req.cache_salt: too long once put in this key's namespace, or a "
                          "reserved 'kvmesh:' salt longer than %d bytes",
                          KM_PROTO_MAX_NAME - 9);
        rt_rq_free(q);
        return;
    }
    if (!rc && req->tokens && req->n_tokens) {
        q->cap = (int)req->n_tokens + 64;
        q->tokens = malloc(sizeof *q->tokens * (size_t)q->cap);
        if (!q->tokens)
            rc = KM_ENOMEM;
        else {
            memcpy(q->tokens, req->tokens, sizeof *q->tokens * req->n_tokens);
            q->n_prompt = (int)req->n_tokens;
            int nv = md_tok_n_vocab(r->tok);
            for (int i = 0; i < q->n_prompt; i++)
                if (q->tokens[i] >= nv) {
                    rt_send_error_env(r, env, n_env, req->id, KM_CODE_BAD_REQUEST, 0,
                                      "req.tokens[%d]: id %d outside the vocabulary (%d)", i,
                                      q->tokens[i], nv);
                    rt_rq_free(q);
                    return;
                }
        }
    }
    if (rc) {
        rt_send_error_env(r, env, n_env, req->id, KM_CODE_INTERNAL, 0, "cannot prepare: %s",
                          km_strerror(rc));
        rt_rq_free(q);
        return;
    }
    if (q->tokens) {
        rt_rq_start(r, q);
        return;
    }
    /* a text prompt: its bytes checked, then tokenized on or off the loop (prompt.c) */
    size_t len = req->prompt_len ? req->prompt_len : strlen(req->prompt);
    char *text = malloc(len + 1);
    if (!text) {
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    memcpy(text, req->prompt, len);
    text[len] = 0;
    rt_rq_prepare(r, q, text, len, 1);
}

static bool env_eq(const rt_rq *q, const km_zmsg *zm)
{
    if (q->fops != &rt_front_zmq || q->n_env != zm->n - 1) return false;
    for (int i = 0; i < q->n_env; i++)
        if (q->env[i].len != zm->part[i].len ||
            memcmp(q->env[i].data, zm->part[i].data, q->env[i].len))
            return false;
    return true;
}

void rt_rq_cancel(rt_router *r, rt_rq *q)
{
    if (q->queued || q->parked || q->tokjob) {
        rt_rq_unpark(q);
        rt_queue_remove(r, q);
        if (q->fops == &rt_front_zmq) {
            km_msg m;
            km_msg_init(&m, KM_MSG_DONE);
            m.done.id = q->cid;
            m.done.finish = KM_FINISH_CANCELED;
            m.done.prompt_tokens = (uint32_t)q->n_prompt;
            m.done.completion_tokens = (uint32_t)q->n_gen;
            if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
                rt_zsend_env(r->front, q->env, q->n_env, &r->out);
        }
        rt_rq_end(r, q);
        return;
    }
    q->canceled = true; /* should its worker die first, it is not migrated but ends */
    if (q->worker >= 0) rt_send_cancel(r, &r->w[q->worker], q->rid);
}

void rt_rq_abandon(rt_router *r, rt_rq *q)
{
    if (q->worker >= 0) rt_send_cancel(r, &r->w[q->worker], q->rid);
    km_counter_inc(r->s_abandoned);
    KM_INFO("request_abandoned", "rid=%llu worker=%s generated=%d origin=%s",
            (unsigned long long)q->rid, q->worker >= 0 ? r->w[q->worker].id : "-", q->n_gen,
            q->fops->name);
    rt_rq_end(r, q);
}

/* ---------------------------------------------------------------- client connections
 *
 * libzmq does not tell a ROUTER which peer left (ZMQ_ROUTER_NOTIFY is a draft API, not in the
 * libzmq builds we link), but its socket monitor reports each accepted and each lost connection
 * with its descriptor, and every message carries the descriptor it came in on (ZMQ_SRCFD). A
 * request remembers its connection as (descriptor, generation): ACCEPTED gives a descriptor a new
 * generation, DISCONNECTED abandons the requests of the current one. libzmq emits a connection's
 * DISCONNECTED before its descriptor is closed (so before a new connection can get the number)
 * and a connection's ACCEPTED before any message of it; the router drains the monitor before
 * every message it reads from the front, so a request is always recorded under the generation
 * of the connection it really came on, and a reused descriptor is never mistaken for the
 * connection that had it before. */

int rt_front_monitor_open(rt_router *r, km_errbuf *err)
{
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://rt-front-mon-%p", (void *)r);
    int rc = rt_monitor_open(r, r->front, ep, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED, &r->fmon,
                             err);
    return rc ? rc : rt_open_poll(r, &r->p_fmon, r->fmon, err);
}

static void client_disconnected(rt_router *r, int fd)
{
    uint64_t gen = conn_gen_of(r, fd);
    if (!gen) return;
    r->conn_gen[fd] = 0;
    /* every one of them, however many: one scan per abandon would be quadratic, and abandoning
     * one may dispatch its waiters (a new rid, another bucket), so the rids are collected first
     * and what remains is looked for again */
    int total = 0;
    for (;;) {
        uint64_t rids[256];
        int n = 0;
        for (int b = 0; b < RT_RQ_BUCKETS && n < 256; b++)
            for (rt_rq *q = r->buckets[b]; q && n < 256; q = q->hnext)
                if (q->fops == &rt_front_zmq && q->src_fd == fd && q->src_gen == gen)
                    rids[n++] = q->rid;
        for (int i = 0; i < n; i++) {
            rt_rq *q = rt_rq_find(r, rids[i]);
            if (q) rt_rq_abandon(r, q);
        }
        total += n;
        if (n < 256) break;
    }
    if (total) KM_INFO("client_gone", "fd=%d requests_abandoned=%d", fd, total);
}

void rt_read_front_monitor(rt_router *r)
{
    uint16_t event;
    uint32_t value;
    while (r->fmon && rt_monitor_next(r->fmon, &event, &value)) {
        int fd = (int)value;
        if (event == ZMQ_EVENT_ACCEPTED && fd >= 0 && fd < (1 << 24)) {
            if (fd >= r->n_conn_gen) {
                int n = fd + 64;
                uint64_t *g = realloc(r->conn_gen, sizeof *g * (size_t)n);
                if (!g) continue;
                memset(g + r->n_conn_gen, 0, sizeof *g * (size_t)(n - r->n_conn_gen));
                r->conn_gen = g;
                r->n_conn_gen = n;
            }
            r->conn_gen[fd] = ++r->next_conn_gen;
        } else if (event == ZMQ_EVENT_DISCONNECTED) {
            client_disconnected(r, fd);
        }
    }
}

static void on_client_cancel(rt_router *r, const km_zmsg *zm, uint64_t cid)
{
    rt_rq *q = client_rq_find(r, zm, cid);
    if (q) rt_rq_cancel(r, q);
}

void rt_on_front_message(rt_router *r, const km_zmsg *zm)
{
    const km_zframe *body = km_zmsg_body(zm);
    if (!body || zm->n < 2) return; /* a ROUTER always sees identity + body */
    km_msg m;
    km_errbuf err = {{0}};
    int rc = km_msg_decode(body->data, body->len, &r->lim, &m, &err);
    if (rc) {
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        int code = rc == KM_EUNSUPPORTED ? KM_CODE_VERSION
                   : rc == KM_ERANGE     ? KM_CODE_TOO_LARGE
                                         : KM_CODE_BAD_REQUEST;
        /* the id, when the frame had a readable one, makes the error attributable */
        rt_send_error_env(r, zm->part, zm->n - 1, m.rejected_id, code, 0, "%s", err.msg);
        KM_DEBUG("bad_frame", "code=%d msg=\"%s\"", code, err.msg);
        return;
    }
    /* admin is for operators (docs/security.md): a client's gets 403 and nothing happens (an
     * operator's gets the 400 below: a router carries out no admin command itself) */
    if (m.type == KM_MSG_ADMIN && km_zsec_authorize(r->c.sec, &zm->peer, KM_ROLE_OPERATOR, &err)) {
        km_counter_inc(r->s_forbidden);
        KM_WARN("forbidden", "type=admin cmd=%s role=%s key=%s", km_admin_cmd_name(m.admin.cmd),
                km_role_name(zm->peer.role), zm->peer.name);
        rt_send_error_env(r, zm->part, zm->n - 1, m.admin.id, KM_CODE_FORBIDDEN, 0, "%s", err.msg);
        km_msg_clear(&m);
        return;
    }
    switch (m.type) {
    case KM_MSG_REQUEST:
        on_client_request(r, zm, &m.req);
        break;
    case KM_MSG_CANCEL:
        on_client_cancel(r, zm, m.cancel.id);
        break;
    default:
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        rt_send_error_env(r, zm->part, zm->n - 1, km_msg_id(&m), KM_CODE_BAD_REQUEST, 0,
                          "a router does not take '%s' frames from clients",
                          km_msg_type_name(m.type));
        break;
    }
    km_msg_clear(&m);
}
