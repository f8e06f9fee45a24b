/*
 * service.c — the kvmesh-worker daemon around the scheduler (wk_service_*, worker.h): the
 * ZeroMQ ROUTER that takes requests, cancels and admin commands, the token streams going back,
 * heartbeats to the controller, metrics and the admin HTTP endpoints, drain and shutdown.
 *
 * One thread runs everything that touches the model and the sockets: the loop polls the sockets
 * (not waiting at all while the scheduler has work), handles what arrived, runs one scheduler
 * step, publishes the KV events the step produced, and every so often refreshes gauges and sends
 * a heartbeat. The engine's own thread pool does the heavy lifting inside the step; socket I/O
 * happens between steps, so a step is never interrupted and frames are never read concurrently
 * with the store changing. The admin HTTP server runs on its own libuv thread and reads only the
 * thread-safe metrics registry and an atomic readiness flag, so a scrape never waits for a step.
 *
 * Bad input (undecodable, oversized or wrongly typed frames, unknown models, out-of-range
 * values) gets an `err` reply with the request id when one can be read, is counted in
 * kvmesh_worker_bad_frames_total, and touches nothing else.
 */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "worker/service_internal.h"

enum { WK_ENV_MAX = KM_ZMSG_MAX_PARTS - 1, WK_ENV_BYTES = 1024, WK_LAT_RING = 1024 };

/* One request in flight, from its `req` frame to its `done` or `err`. */
typedef struct wk_sreq {
    struct wk_service *svc;
    uint64_t id, rid;
    uint8_t env[WK_ENV_BYTES]; /* routing envelope, copied */
    size_t env_len[WK_ENV_MAX];
    int n_env;
    bool stream;
    km_detok dt;
    km_buf text;  /* completion text: kept for non-streaming requests and stop strings */
    size_t sent;  /* bytes of text already streamed (stop strings: the rest may begin one) */
    bool stopped; /* a stop string ended it: nothing after the match belongs to the text */
    char *stop[KM_PROTO_MAX_STOP];
    int n_stop;
    uint64_t arrival_ns, last_ns;
    int live_idx;
} wk_sreq;

typedef enum {
    WK_BAD_MALFORMED = 0,
    WK_BAD_TOO_LARGE,
    WK_BAD_VERSION,
    WK_BAD_TYPE,
    WK_BAD_PARTS,
    WK_BAD_FIELD,
    WK_BAD_COUNT
} wk_bad;
static const char *const wk_bad_names[WK_BAD_COUNT] = {"malformed",           "too_large",
                                                       "unsupported_version", "unexpected_type",
                                                       "too_many_parts",      "bad_field"};

typedef enum {
    WK_OUT_OK = 0,
    WK_OUT_CANCELED,
    WK_OUT_DEADLINE,
    WK_OUT_ERROR,
    WK_OUT_REJECTED,
    WK_OUT_HANDED_BACK,
    WK_OUT_COUNT
} wk_outcome;
static const char *const wk_out_names[WK_OUT_COUNT] = {"ok",    "canceled", "deadline",
                                                       "error", "rejected", "handed_back"};

struct wk_service {
    wk_model *m;
    wk_engine *e;
    kv_store *kv;
    const km_tokenizer *tok;
    wk_sched *sched;
    wk_events *ev;
    wk_service_opts o;
    char worker_id[KM_PROTO_MAX_NAME + 1];
    char model_name[KM_PROTO_MAX_NAME + 1], model_base[KM_PROTO_MAX_NAME + 1];
    char fp[33];
    char ep_requests[256], ep_events[256], ep_admin[256];
    km_proto_limits lim;
    void *zctx, *router, *pub, *ctl;
    km_admin *admin;
    km_metrics *reg;
    atomic_int state; /* km_worker_state */
    volatile sig_atomic_t signals;
    int exit_code;
    bool stop_now;
    uint64_t drain_deadline_ns, start_ns;
    kv_format kv_base; /* the format the worker started with: another one = level 2 in effect */
    /* requests in flight */
    wk_sreq **live;
    int n_live, cap_live;
    /* scratch, reused */
    km_buf out;
    int32_t *tokbuf;
    int tokcap;
    km_zmsg in;
    /* heartbeats and rates */
    uint64_t hb_seq, next_hb_ns, next_gauge_ns, last_rate_ns;
    uint64_t last_prefill, last_decode, last_preempt;
    double decode_tps, prefill_tps;
    double ttft_ring[WK_LAT_RING], tpot_ring[WK_LAT_RING], qtmp[WK_LAT_RING];
    int n_ttft, n_tpot;
    uint64_t errors[WK_BAD_COUNT], send_errors, oom_errors;
    /* metrics */
    km_metric *m_kv_bytes, *m_kv_pages, *m_kv_cap;
    km_series *s_req[WK_OUT_COUNT], *s_bad[WK_BAD_COUNT];
    km_series *s_tok_prompt, *s_tok_cached, *s_tok_gen, *s_tok_prefill;
    km_series *s_ttft, *s_itl, *s_queue, *s_e2e, *s_hit, *s_preempt, *s_running, *s_queued;
    km_series *s_steps, *s_events, *s_ready, *s_hb_sent, *s_hb_dropped;
    km_series *s_rec_evict, *s_rec_format, *s_rec_drain, *s_rec_shutdown;
    km_series *s_rec_level[4]; /* kvmesh_recovery_actions_total{level="0".."3"} */
    km_metric *m_kv_pinned;
    km_series *s_ballast;
    /* chaos: the `pressure` command's ballast, a sequence holding real hot pages */
    kv_seq *ballast;
    int ballast_pages;
};

/* ---------------------------------------------------------------- small helpers */

static uint64_t wk_ms_ns(int64_t ms)
{
    return (uint64_t)ms * 1000000ull;
}

static void wk_set_state(wk_service *s, km_worker_state st)
{
    atomic_store(&s->state, (int)st);
    km_gauge_set(s->s_ready, st == KM_STATE_READY);
}

static km_worker_state wk_state(wk_service *s)
{
    return (km_worker_state)atomic_load(&s->state);
}

static bool wk_ready_cb(void *user)
{
    wk_service *s = user;
    return wk_state(s) == KM_STATE_READY;
}

/* Sends body behind an envelope on sock (the ROUTER, or the controller DEALER with no envelope). */
static int wk_send(wk_service *s, void *sock, const km_zframe *env, int n_env, const km_buf *body)
{
    km_zframe parts[KM_ZMSG_MAX_PARTS];
    int n = 0;
    for (int i = 0; i < n_env && n < KM_ZMSG_MAX_PARTS - 1; i++) parts[n++] = env[i];
    parts[n++] = (km_zframe){body->data, body->len};
    int rc = km_zsend(sock, parts, n, KM_ZDONTWAIT, NULL);
    if (rc) s->send_errors++;
    return rc;
}

static int wk_sreq_env(const wk_sreq *r, km_zframe *env)
{
    size_t off = 0;
    for (int i = 0; i < r->n_env; i++) {
        env[i] = (km_zframe){r->env + off, r->env_len[i]};
        off += r->env_len[i];
    }
    return r->n_env;
}

static int wk_send_error(wk_service *s, void *sock, const km_zframe *env, int n_env, uint64_t id,
                         int code, uint32_t retry_ms, const char *msg)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ERROR);
    m.error.id = id;
    m.error.code = code;
    char buf[KM_PROTO_MAX_MESSAGE];
    snprintf(buf, sizeof buf, "%s", msg ? msg : km_proto_code_name(code));
    m.error.message = buf;
    m.error.retry_after_ms = retry_ms;
    if (km_msg_encode(&m, &s->lim, &s->out, NULL)) return KM_EINVAL;
    return wk_send(s, sock, env, n_env, &s->out);
}

static void wk_count_bad(wk_service *s, wk_bad b)
{
    s->errors[b]++;
    km_counter_inc(s->s_bad[b]);
}

/* ---------------------------------------------------------------- requests in flight */

static void wk_sreq_free(wk_sreq *r)
{
    if (!r) return;
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    km_buf_free(&r->text);
    free(r);
}

static void wk_live_remove(wk_service *s, wk_sreq *r)
{
    int i = r->live_idx;
    if (i < 0 || i >= s->n_live || s->live[i] != r) return;
    s->live[i] = s->live[--s->n_live];
    s->live[i]->live_idx = i;
    r->live_idx = -1;
}

static wk_sreq *wk_live_find(wk_service *s, const km_zframe *env, int n_env, uint64_t id)
{
    for (int i = 0; i < s->n_live; i++) {
        wk_sreq *r = s->live[i];
        if (r->id != id || r->n_env != n_env) continue;
        size_t off = 0;
        int same = 1;
        for (int j = 0; j < n_env && same; j++) {
            same = r->env_len[j] == env[j].len && !memcmp(r->env + off, env[j].data, env[j].len);
            off += r->env_len[j];
        }
        if (same) return r;
    }
    return NULL;
}

static double wk_quantile(const double *ring, int n, double q, double *tmp)
{
    if (n <= 0) return 0;
    if (n > WK_LAT_RING) n = WK_LAT_RING;
    memcpy(tmp, ring, sizeof *tmp * n);
    /* insertion sort: at most WK_LAT_RING values, once per heartbeat */
    for (int i = 1; i < n; i++) {
        double v = tmp[i];
        int j = i - 1;
        while (j >= 0 && tmp[j] > v) tmp[j + 1] = tmp[j], j--;
        tmp[j + 1] = v;
    }
    int k = (int)(q * (n - 1) + 0.5);
    return tmp[k];
}

/* ---------------------------------------------------------------- scheduler callbacks */

/* Returns 1 when a stop string now ends the text (the text is cut before it). */
static int wk_stop_match(wk_sreq *r, size_t added)
{
    for (int i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        if (sl > r->text.len) continue;
        /* only matches that end in the newly added bytes are new */
        size_t from = r->text.len > added + sl ? r->text.len - added - sl + 1 : 0;
        for (size_t p = from; p + sl <= r->text.len; p++)
            if (!memcmp(r->text.data + p, r->stop[i], sl)) {
                r->text.len = p;
                return 1;
            }
    }
    return 0;
}

/* Bytes at the end of the text that could still be the beginning of a stop string: the
 * longest suffix that is a proper prefix of one. They are held back from the stream until the
 * next tokens show whether the stop string follows (then they are never sent) or not. */
static size_t wk_stop_holdback(const wk_sreq *r)
{
    size_t best = 0;
    const uint8_t *t = r->text.data;
    for (int i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        if (!sl) continue;
        size_t k = sl - 1 < r->text.len ? sl - 1 : r->text.len;
        for (; k > best; k--)
            if (t[r->text.len - k] == (uint8_t)r->stop[i][0] &&
                !memcmp(t + r->text.len - k, r->stop[i], k))
                break;
        if (k > best) best = k;
    }
    return best;
}

static int wk_on_token(void *ctx, void *user, int index, int32_t token)
{
    wk_service *s = ctx;
    wk_sreq *r = user;
    uint64_t now = km_now_ns();
    if (index == 0) {
        km_hist_observe(s->s_ttft, (now - r->arrival_ns) / 1e9);
    } else {
        km_hist_observe(s->s_itl, (now - r->last_ns) / 1e9);
    }
    r->last_ns = now;
    km_counter_inc(s->s_tok_gen);
    char piece[KM_PROTO_MAX_PIECE];
    int w = km_detok_push(s->tok, &r->dt, token, piece, sizeof piece);
    if (w < 0) w = 0;
    int stop = 0;
    const char *out = piece;
    size_t out_len = (size_t)w;
    if (!r->stream || r->n_stop) {
        km_buf_append(&r->text, piece, (size_t)w);
        stop = wk_stop_match(r, (size_t)w);
        r->stopped = stop;
        if (r->stream) { /* what is now certain not to be part of a stop string */
            size_t safe = stop ? r->text.len : r->text.len - wk_stop_holdback(r);
            if (safe < r->sent) safe = r->sent;
            out = r->text.data ? (const char *)r->text.data + r->sent : "";
            out_len = safe - r->sent;
            r->sent = safe;
        }
    }
    if (!out_len) out = ""; /* the encoder reads text_len 0 as strlen(text); piece is no string */
    if (r->stream) {        /* every token goes out, the one completing a stop string too */
        km_msg m;
        km_msg_init(&m, KM_MSG_TOKEN);
        m.tok.id = r->id;
        m.tok.index = (uint32_t)index;
        m.tok.token = token;
        m.tok.text = out;
        m.tok.text_len = out_len;
        if (!km_msg_encode(&m, &s->lim, &s->out, NULL)) {
            km_zframe env[WK_ENV_MAX];
            int n = wk_sreq_env(r, env);
            wk_send(s, s->router, env, n, &s->out);
        }
    }
    return stop;
}

static void wk_observe_end(wk_service *s, wk_sreq *r, const wk_sched_usage *u)
{
    km_counter_add(s->s_tok_prompt, (uint64_t)u->prompt_tokens);
    km_counter_add(s->s_tok_cached, (uint64_t)u->cached_tokens);
    km_hist_observe(s->s_queue, u->queue_ms / 1e3);
    km_hist_observe(s->s_e2e, u->total_ms / 1e3);
    if (u->completion_tokens > 0) {
        s->ttft_ring[s->n_ttft++ % WK_LAT_RING] = u->ttft_ms;
        if (u->completion_tokens > 1)
            s->tpot_ring[s->n_tpot++ % WK_LAT_RING] =
                (u->total_ms - u->ttft_ms) / (u->completion_tokens - 1);
    }
    (void)r;
}

static void wk_on_done(void *ctx, void *user, km_finish finish, const wk_sched_usage *u)
{
    wk_service *s = ctx;
    wk_sreq *r = user;
    km_msg m;
    km_msg_init(&m, KM_MSG_DONE);
    m.done.id = r->id;
    m.done.finish = finish;
    /* The bytes of an incomplete last character, unless a stop string ended the text first. */
    char tail[16];
    int w = km_detok_flush(&r->dt, tail, sizeof tail);
    if (w > 0 && !r->stopped) km_buf_append(&r->text, tail, (size_t)w);
    if (!r->stream) {
        m.done.text = r->text.data ? (const char *)r->text.data : "";
        m.done.text_len = r->text.len;
        if (!r->text.len) m.done.text = "";
    } else if (r->text.len > r->sent) {
        /* A stream's last bytes that no token frame could carry (held back as the possible
         * start of a stop string, or an incomplete character): pieces + this = the text. */
        m.done.text = (const char *)r->text.data + r->sent;
        m.done.text_len = r->text.len - r->sent;
    }
    m.done.prompt_tokens = (uint32_t)u->prompt_tokens;
    m.done.cached_tokens = (uint32_t)u->cached_tokens;
    m.done.completion_tokens = (uint32_t)u->completion_tokens;
    m.done.queue_ms = u->queue_ms;
    m.done.ttft_ms = u->ttft_ms;
    m.done.total_ms = u->total_ms;
    /* Metrics first: a client that has its done frame finds the request counted. */
    wk_outcome o = finish == KM_FINISH_CANCELED   ? WK_OUT_CANCELED
                   : finish == KM_FINISH_DEADLINE ? WK_OUT_DEADLINE
                                                  : WK_OUT_OK;
    km_counter_inc(s->s_req[o]);
    wk_observe_end(s, r, u);
    km_zframe env[WK_ENV_MAX];
    int n = wk_sreq_env(r, env);
    if (!km_msg_encode(&m, &s->lim, &s->out, NULL)) wk_send(s, s->router, env, n, &s->out);
    wk_live_remove(s, r);
    wk_sreq_free(r);
}

static void wk_on_error(void *ctx, void *user, int code, const char *message,
                        const wk_sched_usage *u)
{
    wk_service *s = ctx;
    wk_sreq *r = user;
    km_zframe env[WK_ENV_MAX];
    int n = wk_sreq_env(r, env);
    if (code == KM_CODE_TOO_LARGE) s->oom_errors++;
    km_counter_inc(s->s_req[code == KM_CODE_UNAVAILABLE ? WK_OUT_HANDED_BACK : WK_OUT_ERROR]);
    wk_observe_end(s, r, u);
    wk_send_error(s, s->router, env, n, r->id, code,
                  code == KM_CODE_UNAVAILABLE || code == KM_CODE_OVERLOADED ? 250 : 0, message);
    wk_live_remove(s, r);
    wk_sreq_free(r);
}

/* ---------------------------------------------------------------- frames in */

static bool wk_model_matches(const wk_service *s, const char *name)
{
    return !strcmp(name, s->model_name) || !strcmp(name, s->model_base) ||
           (s->o.model_alias && !strcmp(name, s->o.model_alias));
}

static void wk_handle_request(wk_service *s, const km_zframe *env, int n_env,
                              const km_msg_request *q)
{
    uint64_t now = km_now_ns();
    if (wk_state(s) != KM_STATE_READY) {
        km_counter_inc(s->s_req[WK_OUT_REJECTED]);
        wk_send_error(s, s->router, env, n_env, q->id, KM_CODE_UNAVAILABLE, 0,
                      wk_state(s) == KM_STATE_DRAINING ? "worker draining: send it elsewhere"
                                                       : "worker not ready");
        return;
    }
    if (!wk_model_matches(s, q->model)) {
        char msg[KM_PROTO_MAX_MESSAGE];
        snprintf(msg, sizeof msg, "req.model: unknown model '%.256s' (this worker serves '%s')",
                 q->model, s->model_base);
        km_counter_inc(s->s_req[WK_OUT_REJECTED]);
        wk_send_error(s, s->router, env, n_env, q->id, KM_CODE_NOT_FOUND, 0, msg);
        return;
    }
    if (wk_live_find(s, env, n_env, q->id)) {
        wk_count_bad(s, WK_BAD_FIELD);
        wk_send_error(s, s->router, env, n_env, q->id, KM_CODE_BAD_REQUEST, 0,
                      "req.id: a request with this id is already in flight");
        return;
    }
    size_t env_total = 0;
    for (int i = 0; i < n_env; i++) env_total += env[i].len;
    if (n_env > WK_ENV_MAX || env_total > WK_ENV_BYTES) {
        wk_count_bad(s, WK_BAD_PARTS);
        return; /* cannot route a reply to it anyway */
    }
    const int32_t *toks = q->tokens;
    int n_tok = (int)q->n_tokens;
    if (q->prompt) {
        size_t len = q->prompt_len ? q->prompt_len : strlen(q->prompt);
        int need = km_tok_encode(s->tok, q->prompt, len, 1, 1, s->tokbuf, s->tokcap);
        if (need > s->tokcap) {
            int32_t *nb = realloc(s->tokbuf, sizeof *nb * need);
            if (!nb) {
                wk_send_error(s, s->router, env, n_env, q->id, KM_CODE_INTERNAL, 0,
                              "out of memory");
                return;
            }
            s->tokbuf = nb;
            s->tokcap = need;
            need = km_tok_encode(s->tok, q->prompt, len, 1, 1, s->tokbuf, s->tokcap);
        }
        if (need < 1) {
            wk_count_bad(s, WK_BAD_FIELD);
            wk_send_error(s, s->router, env, n_env, q->id, KM_CODE_BAD_REQUEST, 0,
                          "req.prompt: empty after tokenization");
            return;
        }
        toks = s->tokbuf;
        n_tok = need;
    }
    wk_sreq *r = calloc(1, sizeof *r);
    if (!r) {
        wk_send_error(s, s->router, env, n_env, q->id, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    r->svc = s;
    r->id = q->id;
    r->stream = q->stream;
    r->arrival_ns = r->last_ns = now;
    r->live_idx = -1;
    km_detok_init(&r->dt);
    size_t off = 0;
    for (int i = 0; i < n_env; i++) {
        memcpy(r->env + off, env[i].data, env[i].len);
        r->env_len[i] = env[i].len;
        off += env[i].len;
    }
    r->n_env = n_env;
    for (uint32_t i = 0; i < q->n_stop && i < KM_PROTO_MAX_STOP; i++) {
        r->stop[i] = strdup(q->stop[i]);
        if (r->stop[i]) r->n_stop++;
    }
    wk_sched_req sq = {
        .tokens = toks,
        .n_tokens = n_tok,
        .max_tokens = (int)q->max_tokens,
        .priority = q->priority,
        .deadline_ns = q->deadline_ms ? now + wk_ms_ns(q->deadline_ms) : 0,
        .arrival_ns = now,
        .cache_salt = q->cache_salt,
        .cache_salt_len = q->cache_salt ? strlen(q->cache_salt) : 0,
        .user = r,
    };
    wk_sample_params_default(&sq.sample);
    sq.sample.temperature = q->temperature;
    sq.sample.top_k = q->top_k;
    sq.sample.top_p = q->top_p;
    sq.sample.min_p = q->min_p;
    sq.sample.repeat_penalty = q->repeat_penalty;
    sq.sample.repeat_last_n = q->repeat_last_n > 0 ? q->repeat_last_n : 64;
    sq.sample.presence_penalty = q->presence_penalty;
    sq.sample.frequency_penalty = q->frequency_penalty;
    sq.sample.seed = q->has_seed ? q->seed : (now ^ (q->id * 0x9e3779b97f4a7c15ull));
    int rc = wk_sched_submit(s->sched, &sq, &r->rid);
    if (rc) {
        int code = km_proto_code_from_err(rc);
        const char *msg = rc == KM_EOVERLOAD ? "queue full"
                          : rc == KM_ERANGE  ? "prompt too long for the context limit"
                          : rc == KM_EINVAL  ? "req.tokens: token id outside the vocabulary"
                                             : km_strerror(rc);
        if (rc == KM_EINVAL) wk_count_bad(s, WK_BAD_FIELD);
        km_counter_inc(s->s_req[WK_OUT_REJECTED]);
        wk_send_error(s, s->router, env, n_env, q->id, code, rc == KM_EOVERLOAD ? 250 : 0, msg);
        wk_sreq_free(r);
        return;
    }
    if (s->n_live == s->cap_live) {
        int cap = s->cap_live ? s->cap_live * 2 : 256;
        wk_sreq **nl = realloc(s->live, sizeof *nl * cap);
        if (!nl) {
            wk_sched_cancel(s->sched, r->rid); /* ends through the callbacks */
            return;
        }
        s->live = nl;
        s->cap_live = cap;
    }
    r->live_idx = s->n_live;
    s->live[s->n_live++] = r;
}

static void wk_kv_totals(wk_service *s, uint64_t *pages, uint64_t *bytes)
{
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    *pages = *bytes = 0;
    for (int t = 0; t < KV_TIER_COUNT; t++) {
        *pages += st.tier[t].pages;
        *bytes += st.tier[t].bytes;
    }
}

static kv_format wk_kv_format(wk_service *s)
{
    kv_shard_stats sh;
    if (kv_store_shard_stats(s->kv, 0, &sh)) return KN_KV_F16;
    return sh.format;
}

static void wk_ballast_release(wk_service *s);

static void wk_start_drain(wk_service *s, int64_t timeout_ms, const char *why)
{
    if (wk_state(s) != KM_STATE_READY) return;
    if (timeout_ms <= 0) timeout_ms = s->o.drain_timeout_ms;
    s->drain_deadline_ns = km_now_ns() + wk_ms_ns(timeout_ms);
    wk_set_state(s, KM_STATE_DRAINING);
    wk_ballast_release(s); /* in-flight requests get its pages; the next process starts clean */
    km_counter_inc(s->s_rec_drain);
    KM_INFO("drain_start", "worker=%s reason=%s timeout_ms=%lld inflight=%d", s->worker_id, why,
            (long long)timeout_ms, wk_sched_pending(s->sched));
}

/* Hot-tier bytes held by live sequences over the hot budget, all shards: pressure as the
 * controller computes it from heartbeats (logged with every recovery action). */
static double wk_hot_pressure(wk_service *s)
{
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    const kv_tier_stats *h = &st.tier[KV_TIER_HOT];
    return h->budget ? (double)h->pinned_bytes / (double)h->budget : 0.0;
}

/* One recovery action carried out: counted by level and logged as one event=recovery line. */
static void wk_recovery_log(wk_service *s, int level, const char *action, bool ok,
                            const char *detail)
{
    if (level >= 0 && level <= 3) km_counter_inc(s->s_rec_level[level]);
    KM_INFO("recovery", "level=%d action=%s worker=%s ok=%d pressure=%.3f %s", level, action,
            s->worker_id, (int)ok, wk_hot_pressure(s), detail ? detail : "");
}

/* Bytes of one ballast page: the current format's (int4 pages are written in f16 and only
 * sealed once full, which ballast pages never are). */
static size_t wk_ballast_page_bytes(wk_service *s)
{
    kv_format f = wk_kv_format(s);
    return kv_store_format_page_bytes(s->kv, f == KN_KV_INT4 ? KN_KV_F16 : f);
}

static size_t wk_ballast_bytes(wk_service *s)
{
    return (size_t)s->ballast_pages * wk_ballast_page_bytes(s);
}

static void wk_ballast_release(wk_service *s)
{
    if (!s->ballast) return;
    kv_seq_destroy(s->kv, s->ballast);
    s->ballast = NULL;
    s->ballast_pages = 0;
    km_gauge_set(s->s_ballast, 0);
}

/* chaos `pressure`: pins round(fraction x hot budget / page bytes) real pages in a ballast
 * sequence, replacing the previous one (0 only releases it). Pages come from the pool like any
 * sequence's: room is made from cached pages only, never from running sequences, and when the
 * pool runs out the ballast keeps what it got. Returns the pages pinned; msg says what. */
static int wk_ballast_set(wk_service *s, double fraction, char *msg, size_t cap)
{
    wk_ballast_release(s);
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    const size_t pb = wk_ballast_page_bytes(s);
    const int pt = kv_store_page_tokens(s->kv);
    double want_d = fraction * (double)st.tier[KV_TIER_HOT].budget / (double)pb + 0.5;
    int want = want_d > (double)(INT32_MAX / pt) ? INT32_MAX / pt : (int)want_d;
    int got = 0, rc = 0;
    if (want > 0 && !(rc = kv_seq_create(s->kv, &s->ballast)))
        while (got < want && !(rc = kv_seq_reserve(s->kv, s->ballast, (got + 1) * pt))) got++;
    s->ballast_pages = got;
    if (s->ballast && !got) wk_ballast_release(s);
    km_gauge_set(s->s_ballast, (double)wk_ballast_bytes(s));
    if (!want)
        snprintf(msg, cap, "ballast released");
    else if (got < want)
        snprintf(msg, cap, "pinned %d of %d ballast pages (%zu bytes): %s", got, want,
                 wk_ballast_bytes(s),
                 rc == KM_ENOSPC ? "the KV pool has no more room" : km_strerror(rc));
    else
        snprintf(msg, cap, "pinned %d ballast pages (%zu bytes)", got, wk_ballast_bytes(s));
    KM_INFO("chaos_pressure", "worker=%s fraction=%.3f wanted=%d pinned=%d bytes=%zu pressure=%.3f",
            s->worker_id, fraction, want, got, wk_ballast_bytes(s), wk_hot_pressure(s));
    return got;
}

static void wk_handle_admin(wk_service *s, void *sock, const km_zframe *env, int n_env,
                            const km_msg_admin *a)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN_REPLY);
    km_msg_admin_reply *rp = &m.admin_reply;
    rp->id = a->id;
    rp->cmd = a->cmd;
    rp->ok = true;
    char msg[KM_PROTO_MAX_MESSAGE] = "";
    /* `worker` names the target: a frame meant for another worker changes nothing here. */
    km_admin_cmd cmd = a->cmd;
    if (a->worker && a->worker[0] && strcmp(a->worker, s->worker_id)) {
        rp->ok = false;
        rp->code = KM_CODE_NOT_FOUND;
        snprintf(msg, sizeof msg, "not this worker");
        cmd = KM_ADMIN_CMD_COUNT; /* nothing to do */
    }
    switch (cmd) {
    case KM_ADMIN_CMD_COUNT:
        break;
    case KM_ADMIN_STATUS:
        if (a->has_events_since || a->events_snapshot) { /* a KV event replay (section 9) */
            wk_events_pump(s->ev);
            bool was_snap = false;
            int frames = wk_events_replay(s->ev, sock, env, n_env, a->events_since,
                                          a->events_snapshot, &was_snap);
            snprintf(msg, sizeof msg, "%s: %d kv frames sent", was_snap ? "snapshot" : "replay",
                     frames);
            rp->has_events_next = true;
            rp->events_next = wk_events_next_seq(s->ev);
            rp->events_snapshot = was_snap;
        }
        break;
    case KM_ADMIN_EVICT: {
        uint64_t p0, b0, p1, b1;
        kv_store_stats st0, st1;
        kv_store_stats_get(s->kv, &st0);
        wk_kv_totals(s, &p0, &b0);
        int n = kv_store_evict_oldest_fraction(s->kv, a->fraction);
        kv_store_stats_get(s->kv, &st1);
        wk_kv_totals(s, &p1, &b1);
        (void)p0, (void)p1, (void)b0, (void)b1;
        rp->evicted_pages = n > 0 ? (uint64_t)n : 0;
        rp->freed_bytes = st0.tier[KV_TIER_HOT].bytes > st1.tier[KV_TIER_HOT].bytes
                              ? st0.tier[KV_TIER_HOT].bytes - st1.tier[KV_TIER_HOT].bytes
                              : 0;
        km_counter_inc(s->s_rec_evict);
        char d[128];
        snprintf(d, sizeof d, "fraction=%.3f pages=%d freed_bytes=%llu", a->fraction, n,
                 (unsigned long long)rp->freed_bytes);
        wk_recovery_log(s, 1, "evict", n >= 0, d);
        break;
    }
    case KM_ADMIN_SET_KV_FORMAT: {
        kv_format f;
        if (kv_format_parse(a->format, &f)) {
            rp->ok = false;
            rp->code = KM_CODE_BAD_REQUEST;
            snprintf(msg, sizeof msg, "admin.format: unknown KV format '%.64s'", a->format);
            break;
        }
        kv_format before = wk_kv_format(s);
        int n = kv_store_convert(s->kv, f);
        km_gauge_set(s->s_ballast, (double)wk_ballast_bytes(s));
        if (n < 0) {
            rp->ok = false;
            rp->code = km_proto_code_from_err(n);
            snprintf(msg, sizeof msg, "conversion to %s stopped: %s", a->format, km_strerror(n));
        } else {
            rp->converted_pages = (uint64_t)n;
        }
        km_counter_inc(s->s_rec_format);
        /* Level 2 shrinks the pages; going back to f16 is its revert (level 0). */
        int level =
            f == KN_KV_F16 ? 0
            : kv_store_format_page_bytes(s->kv, f) < kv_store_format_page_bytes(s->kv, KN_KV_F16)
                ? 2
                : -1;
        char d[128];
        snprintf(d, sizeof d, "from=%s format=%s converted=%d", kv_format_name(before), a->format,
                 n);
        if (level >= 0)
            wk_recovery_log(s, level, "set_kv_format", n >= 0, d);
        else
            KM_INFO("set_kv_format", "worker=%s %s", s->worker_id, d);
        break;
    }
    case KM_ADMIN_DRAIN:
        if (wk_state(s) == KM_STATE_READY) {
            char d[96];
            snprintf(d, sizeof d, "timeout_ms=%u inflight=%d", a->timeout_ms,
                     wk_sched_pending(s->sched));
            wk_recovery_log(s, 3, "drain", true, d);
            wk_start_drain(s, a->timeout_ms, "admin");
        } else
            snprintf(msg, sizeof msg, "already %s", km_worker_state_name(wk_state(s)));
        break;
    case KM_ADMIN_SHUTDOWN:
        km_counter_inc(s->s_rec_shutdown);
        s->stop_now = true;
        s->exit_code = a->restart ? WK_EXIT_RESTART : 0;
        wk_set_state(s, KM_STATE_STOPPING);
        KM_INFO("shutdown", "worker=%s restart=%d", s->worker_id, (int)a->restart);
        break;
    case KM_ADMIN_PRESSURE:
        if (!s->o.chaos) {
            rp->ok = false;
            rp->code = KM_CODE_BAD_REQUEST;
            snprintf(msg, sizeof msg, "pressure needs --chaos");
            break;
        }
        if (wk_state(s) != KM_STATE_READY) {
            rp->ok = false;
            rp->code = KM_CODE_UNAVAILABLE;
            snprintf(msg, sizeof msg, "worker %s: no ballast now",
                     km_worker_state_name(wk_state(s)));
            break;
        }
        wk_ballast_set(s, a->fraction, msg, sizeof msg);
        break;
    default:
        rp->ok = false;
        rp->code = KM_CODE_BAD_REQUEST;
        snprintf(msg, sizeof msg, "unknown admin command");
    }
    wk_sched_stats st;
    wk_sched_stats_get(s->sched, &st);
    rp->state = wk_state(s);
    rp->kv_format = kv_format_name(wk_kv_format(s));
    rp->inflight = (uint32_t)st.running;
    rp->queued = (uint32_t)st.queued;
    wk_kv_totals(s, &rp->kv_pages, &rp->kv_bytes);
    if (msg[0]) rp->message = msg;
    if (km_msg_encode(&m, &s->lim, &s->out, NULL)) return;
    wk_send(s, sock, env, n_env, &s->out);
}

/* One message from the ROUTER (envelope + body) or from the controller DEALER (body only). */
static void wk_handle_message(wk_service *s, void *sock, const km_zmsg *zm)
{
    const km_zframe *body = km_zmsg_body(zm);
    if (!body) return;
    int n_env = zm->n - 1;
    const km_zframe *env = zm->part;
    km_msg m;
    km_errbuf err = {{0}};
    int rc = km_msg_decode(body->data, body->len, &s->lim, &m, &err);
    if (rc) {
        wk_bad b = rc == KM_ERANGE         ? WK_BAD_TOO_LARGE
                   : rc == KM_EUNSUPPORTED ? WK_BAD_VERSION
                                           : WK_BAD_MALFORMED;
        wk_count_bad(s, b);
        KM_DEBUG("bad_frame", "reason=%s bytes=%zu msg=\"%s\"", wk_bad_names[b], body->len,
                 err.msg);
        wk_send_error(s, sock, env, n_env, m.rejected_id, km_proto_code_from_err(rc), 0, err.msg);
        return;
    }
    switch (m.type) {
    case KM_MSG_REQUEST:
        wk_handle_request(s, env, n_env, &m.req);
        break;
    case KM_MSG_CANCEL: {
        wk_sreq *r = wk_live_find(s, env, n_env, m.cancel.id);
        if (r) wk_sched_cancel(s->sched, r->rid);
        break;
    }
    case KM_MSG_ADMIN:
        wk_handle_admin(s, sock, env, n_env, &m.admin);
        break;
    default: {
        char msg[128];
        snprintf(msg, sizeof msg, "a worker does not take '%s' frames", km_msg_type_name(m.type));
        wk_count_bad(s, WK_BAD_TYPE);
        wk_send_error(s, sock, env, n_env, 0, KM_CODE_BAD_REQUEST, 0, msg);
    }
    }
    km_msg_clear(&m);
}

/* Reads what is waiting on sock, at most max messages. */
static void wk_pump_socket(wk_service *s, void *sock, int max)
{
    for (int i = 0; i < max; i++) {
        int rc = km_zrecv(sock, &s->in, 0, NULL);
        if (rc == KM_EAGAIN) break;
        if (rc == KM_EPROTO) {
            wk_count_bad(s, WK_BAD_PARTS);
            continue;
        }
        if (rc) break;
        wk_handle_message(s, sock, &s->in);
    }
    km_zmsg_clear(&s->in);
}

/* ---------------------------------------------------------------- gauges and heartbeats */

static void wk_update_gauges(wk_service *s)
{
    int n_shards = kv_store_n_shards(s->kv);
    for (int sh = 0; sh < n_shards; sh++) {
        kv_shard_stats st;
        if (kv_store_shard_stats(s->kv, sh, &st)) continue;
        char shard[16];
        snprintf(shard, sizeof shard, "%d", sh);
        for (int t = 0; t < KV_TIER_COUNT; t++) {
            if (!st.tier[t].budget && !st.tier[t].pages) continue;
            for (int f = 0; f < KV_FORMAT_COUNT; f++) {
                const char *lv[3] = {kv_tier_name((kv_tier)t), shard, kv_format_name(f)};
                bool cur = (kv_format)f == st.format;
                km_series *b = km_metric_series(s->m_kv_bytes, lv);
                if (!cur && !km_gauge_value(b)) continue; /* never had that format */
                km_gauge_set(b, cur ? (double)st.tier[t].bytes : 0);
                km_gauge_set(km_metric_series(s->m_kv_pages, lv),
                             cur ? (double)st.tier[t].pages : 0);
                km_gauge_set(km_metric_series(s->m_kv_cap, lv),
                             cur ? (double)st.tier[t].budget : 0);
                km_gauge_set(km_metric_series(s->m_kv_pinned, lv),
                             cur ? (double)st.tier[t].pinned_bytes : 0);
            }
        }
    }
    wk_sched_stats ss;
    wk_sched_stats_get(s->sched, &ss);
    km_gauge_set(s->s_running, ss.running);
    km_gauge_set(s->s_ballast, (double)wk_ballast_bytes(s));
    km_gauge_set(s->s_queued, ss.queued);
    km_gauge_set(s->s_hit, ss.prompt_tokens ? (double)ss.cached_tokens / ss.prompt_tokens : 0);
    if (ss.preemptions > s->last_preempt)
        km_counter_add(s->s_preempt, ss.preemptions - s->last_preempt);
    s->last_preempt = ss.preemptions;
    uint64_t now = km_now_ns();
    double dt = (now - s->last_rate_ns) / 1e9;
    if (dt >= 0.5) {
        s->decode_tps = (ss.decode_tokens - s->last_decode) / dt;
        s->prefill_tps = (ss.prefill_tokens - s->last_prefill) / dt;
        km_counter_add(s->s_tok_prefill, ss.prefill_tokens - s->last_prefill);
        s->last_decode = ss.decode_tokens;
        s->last_prefill = ss.prefill_tokens;
        s->last_rate_ns = now;
    }
}

static uint64_t wk_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long pages = 0, rss = 0;
    int n = fscanf(f, "%lu %lu", &pages, &rss);
    fclose(f);
    return n == 2 ? (uint64_t)rss * (uint64_t)sysconf(_SC_PAGESIZE) : 0;
}

static void wk_heartbeat(wk_service *s)
{
    if (!s->ctl) return;
    km_msg m;
    km_msg_init(&m, KM_MSG_HEARTBEAT);
    km_msg_heartbeat *hb = &m.hb;
    hb->worker = s->worker_id;
    hb->seq = ++s->hb_seq;
    hb->uptime_ms = (km_now_ns() - s->start_ns) / 1000000ull;
    hb->kv_format_base = kv_format_name(s->kv_base);
    hb->state = wk_state(s);
    km_endpoint eps[3];
    int ne = 0;
    eps[ne++] = (km_endpoint){"requests", s->ep_requests};
    if (s->ep_events[0]) eps[ne++] = (km_endpoint){"events", s->ep_events};
    if (s->ep_admin[0]) eps[ne++] = (km_endpoint){"admin", s->ep_admin};
    hb->endpoints = eps;
    hb->n_endpoints = (uint32_t)ne;
    hb->model = s->model_base;
    hb->fingerprint = s->fp;
    hb->slots = (uint32_t)s->o.sched.max_running;
    hb->max_ctx = (uint32_t)s->o.sched.max_ctx;
    hb->page_tokens = (uint32_t)kv_store_page_tokens(s->kv);
    km_kv_usage kv[KM_PROTO_MAX_KV_ENTRIES];
    int nk = 0;
    int n_shards = kv_store_n_shards(s->kv);
    for (int sh = 0; sh < n_shards && nk < KM_PROTO_MAX_KV_ENTRIES - KV_TIER_COUNT; sh++) {
        kv_shard_stats st;
        if (kv_store_shard_stats(s->kv, sh, &st)) continue;
        for (int t = 0; t < KV_TIER_COUNT; t++) {
            if (!st.tier[t].budget && !st.tier[t].pages) continue;
            kv[nk++] = (km_kv_usage){.shard = (uint32_t)sh,
                                     .tier = (km_tier)t,
                                     .format = kv_format_name(st.format),
                                     .pages = st.tier[t].pages,
                                     .bytes = st.tier[t].bytes,
                                     .capacity_bytes = st.tier[t].budget,
                                     .pinned_bytes = st.tier[t].pinned_bytes};
        }
    }
    hb->kv = kv;
    hb->n_kv = (uint32_t)nk;
    hb->rss_bytes = wk_rss_bytes();
    wk_sched_stats ss;
    wk_sched_stats_get(s->sched, &ss);
    hb->queue_depth = (uint32_t)ss.queued;
    hb->running = (uint32_t)ss.running;
    hb->decode_tps = s->decode_tps;
    hb->prefill_tps = s->prefill_tps;
    hb->tokens_total = ss.prefill_tokens + ss.decode_tokens;
    double *tmp = s->qtmp;
    const double qs[3] = {0.5, 0.9, 0.99};
    km_latency_q lat[3];
    for (int i = 0; i < 3; i++)
        lat[i] = (km_latency_q){.q = qs[i],
                                .ttft_ms = wk_quantile(s->ttft_ring, s->n_ttft, qs[i], tmp),
                                .tpot_ms = wk_quantile(s->tpot_ring, s->n_tpot, qs[i], tmp)};
    hb->latency = lat;
    hb->n_latency = 3;
    km_error_count errs[WK_BAD_COUNT + 4];
    int nerr = 0;
    for (int i = 0; i < WK_BAD_COUNT; i++)
        if (s->errors[i]) errs[nerr++] = (km_error_count){wk_bad_names[i], s->errors[i]};
    if (s->send_errors) errs[nerr++] = (km_error_count){"send", s->send_errors};
    if (s->oom_errors) errs[nerr++] = (km_error_count){"oom", s->oom_errors};
    if (ss.engine_errors) errs[nerr++] = (km_error_count){"engine", ss.engine_errors};
    if (ss.kv_full) errs[nerr++] = (km_error_count){"kv_full", ss.kv_full};
    hb->errors = errs;
    hb->n_errors = (uint32_t)nerr;
    km_errbuf err = {{0}};
    if (km_msg_encode(&m, &s->lim, &s->out, &err)) {
        KM_WARN("heartbeat_encode", "msg=\"%s\"", err.msg);
        return;
    }
    km_zframe f = {s->out.data, s->out.len};
    if (km_zsend(s->ctl, &f, 1, KM_ZDONTWAIT, NULL))
        km_counter_inc(s->s_hb_dropped);
    else
        km_counter_inc(s->s_hb_sent);
}

/* ---------------------------------------------------------------- create / run */

static int wk_metrics_init(wk_service *s, km_errbuf *err)
{
    int rc = km_metrics_create(&s->reg);
    if (rc) return km_errf(err, rc, "metrics: cannot create the registry");
    km_metric *m;
#define REG(kind, name, help, labels, bounds, nb)                                                  \
    do {                                                                                           \
        rc = km_metric_register(s->reg, kind, name, help, labels, bounds, nb, &m, err);            \
        if (rc) return rc;                                                                         \
    } while (0)
    static const double lat_b[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.25,  0.5,    1,     2.5,  5,     10,   30};
    static const double itl_b[] = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
                                   0.05,   0.1,   0.2,   0.5,   1,    2.5};
    int nlat = sizeof lat_b / sizeof lat_b[0], nitl = sizeof itl_b / sizeof itl_b[0];
    REG(KM_COUNTER, "kvmesh_worker_requests_total",
        "Requests ended, by outcome (ok, canceled, deadline, error, rejected, handed_back).",
        "outcome", NULL, 0);
    for (int i = 0; i < WK_OUT_COUNT; i++) s->s_req[i] = km_metric_series(m, &wk_out_names[i]);
    REG(KM_COUNTER, "kvmesh_worker_tokens_total",
        "Tokens by kind: prompt (received), cached (prompt tokens served from cached KV), "
        "prefill (computed prompt tokens), generated.",
        "kind", NULL, 0);
    const char *k[4] = {"prompt", "cached", "prefill", "generated"};
    s->s_tok_prompt = km_metric_series(m, &k[0]);
    s->s_tok_cached = km_metric_series(m, &k[1]);
    s->s_tok_prefill = km_metric_series(m, &k[2]);
    s->s_tok_gen = km_metric_series(m, &k[3]);
    REG(KM_HISTOGRAM, "kvmesh_worker_ttft_seconds", "Time from arrival to the first token.", NULL,
        lat_b, nlat);
    s->s_ttft = km_metric_series(m, NULL);
    REG(KM_HISTOGRAM, "kvmesh_worker_itl_seconds", "Time between consecutive tokens of a stream.",
        NULL, itl_b, nitl);
    s->s_itl = km_metric_series(m, NULL);
    REG(KM_HISTOGRAM, "kvmesh_worker_queue_seconds", "Time from arrival to admission.", NULL, lat_b,
        nlat);
    s->s_queue = km_metric_series(m, NULL);
    REG(KM_HISTOGRAM, "kvmesh_worker_request_seconds", "Time from arrival to the end.", NULL, lat_b,
        nlat);
    s->s_e2e = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_kv_bytes", "KV bytes held, per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_bytes = m;
    REG(KM_GAUGE, "kvmesh_worker_kv_pages", "KV pages held, per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_pages = m;
    REG(KM_GAUGE, "kvmesh_worker_kv_capacity_bytes", "KV byte budget, per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_cap = m;
    REG(KM_GAUGE, "kvmesh_kv_pinned_bytes",
        "KV bytes held by live sequences (not reclaimable), per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_pinned = m;
    REG(KM_GAUGE, "kvmesh_worker_prefix_hit_ratio",
        "Prompt tokens served from cached KV over prompt tokens, since start.", NULL, NULL, 0);
    s->s_hit = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_preemptions_total",
        "Sequences preempted because KV pages ran out.", NULL, NULL, 0);
    s->s_preempt = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_recovery_actions_total",
        "Recovery actions taken, by action (evict, set_kv_format, drain, shutdown).", "action",
        NULL, 0);
    const char *ra[4] = {"evict", "set_kv_format", "drain", "shutdown"};
    s->s_rec_evict = km_metric_series(m, &ra[0]);
    s->s_rec_format = km_metric_series(m, &ra[1]);
    s->s_rec_drain = km_metric_series(m, &ra[2]);
    s->s_rec_shutdown = km_metric_series(m, &ra[3]);
    REG(KM_COUNTER, "kvmesh_recovery_actions_total",
        "Recovery actions carried out by this worker, by level: 1 evict, 2 set_kv_format to a "
        "smaller format, 3 drain, 0 the revert to f16.",
        "level", NULL, 0);
    const char *lv[4] = {"0", "1", "2", "3"};
    for (int i = 0; i < 4; i++) s->s_rec_level[i] = km_metric_series(m, &lv[i]);
    REG(KM_GAUGE, "kvmesh_worker_ballast_bytes",
        "KV bytes pinned by the chaos `pressure` command's ballast (--chaos).", NULL, NULL, 0);
    s->s_ballast = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_bad_frames_total", "Frames rejected, by reason.", "reason", NULL,
        0);
    for (int i = 0; i < WK_BAD_COUNT; i++) s->s_bad[i] = km_metric_series(m, &wk_bad_names[i]);
    REG(KM_GAUGE, "kvmesh_worker_running", "Sequences running.", NULL, NULL, 0);
    s->s_running = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_queue_depth", "Requests waiting for a slot.", NULL, NULL, 0);
    s->s_queued = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_steps_total", "Engine steps run.", NULL, NULL, 0);
    s->s_steps = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_kv_event_frames_total", "KV event frames published.", NULL, NULL,
        0);
    s->s_events = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_ready", "1 while the worker takes new requests.", NULL, NULL, 0);
    s->s_ready = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_heartbeats_total", "Heartbeats, by result (sent, dropped).",
        "result", NULL, 0);
    const char *hr[2] = {"sent", "dropped"};
    s->s_hb_sent = km_metric_series(m, &hr[0]);
    s->s_hb_dropped = km_metric_series(m, &hr[1]);
#undef REG
    return 0;
}

static int wk_write_ports(wk_service *s, km_errbuf *err)
{
    if (!s->o.ports_file) return 0;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", s->o.ports_file);
    FILE *f = fopen(tmp, "w");
    if (!f) return km_errf(err, KM_EIO, "cannot write %s", tmp);
    fprintf(f, "requests=%s\nevents=%s\nadmin=%s\npid=%d\n", s->ep_requests, s->ep_events,
            s->ep_admin, (int)getpid());
    int bad = fclose(f);
    if (bad || rename(tmp, s->o.ports_file))
        return km_errf(err, KM_EIO, "cannot write %s", s->o.ports_file);
    return 0;
}

int wk_service_create(wk_model *m, wk_engine *e, const wk_service_opts *o, wk_service **out,
                      km_errbuf *err)
{
    *out = NULL;
    wk_service *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "service: out of memory");
    s->m = m;
    s->e = e;
    s->kv = wk_engine_kv(e);
    s->tok = wk_model_tokenizer(m);
    s->o = *o;
    if (s->o.heartbeat_ms <= 0) s->o.heartbeat_ms = 1000;
    if (s->o.drain_timeout_ms <= 0) s->o.drain_timeout_ms = 30000;
    if (s->o.sched.max_running <= 0) s->o.sched.max_running = 64;
    if (s->o.sched.max_ctx <= 0) s->o.sched.max_ctx = 4096;
    s->start_ns = s->last_rate_ns = km_now_ns();
    s->kv_base = wk_kv_format(s);
    atomic_init(&s->state, KM_STATE_STARTING);
    if (o->worker_id)
        snprintf(s->worker_id, sizeof s->worker_id, "%s", o->worker_id);
    else
        snprintf(s->worker_id, sizeof s->worker_id, "worker-%d", (int)getpid());
    snprintf(s->model_name, sizeof s->model_name, "%s", wk_model_name(m));
    snprintf(s->model_base, sizeof s->model_base, "%s", wk_model_name(m));
    char *dot = strrchr(s->model_base, '.');
    if (dot) *dot = 0;
    wk_model_fingerprint_hex(m, s->fp);
    km_proto_limits_default(&s->lim);
    if (o->max_frame > 0) s->lim.max_frame = (size_t)o->max_frame;
    int rc = wk_metrics_init(s, err);
    if (rc) goto fail;
    wk_sched_cb cb = {
        .on_token = wk_on_token, .on_done = wk_on_done, .on_error = wk_on_error, .ctx = s};
    if ((rc = wk_sched_create(e, m, &s->o.sched, &cb, &s->sched, err))) goto fail;
    s->zctx = km_zctx_create();
    if (!s->zctx) {
        rc = km_errf(err, KM_EIO, "zmq: cannot create a context");
        goto fail;
    }
    km_zsock_opts zo;
    km_zsock_opts_default(&zo);
    zo.max_msg_size = (int64_t)s->lim.max_frame + 4096;
    if ((rc = km_zsock_open(s->zctx, KM_ZROUTER, &zo, &s->router, err))) goto fail;
    if ((rc = km_zsock_bind(s->router, o->listen ? o->listen : "tcp://127.0.0.1:7100", err)))
        goto fail;
    if ((rc = km_zsock_last_endpoint(s->router, s->ep_requests, sizeof s->ep_requests, err)))
        goto fail;
    void *pub = NULL;
    if (o->events && o->events[0]) {
        if ((rc = km_zsock_open(s->zctx, KM_ZPUB, NULL, &s->pub, err))) goto fail;
        if ((rc = km_zsock_bind(s->pub, o->events, err))) goto fail;
        if ((rc = km_zsock_last_endpoint(s->pub, s->ep_events, sizeof s->ep_events, err)))
            goto fail;
        pub = s->pub;
    }
    if ((rc = wk_events_create(s->kv, pub, s->worker_id, o->event_replay, &s->ev))) {
        km_errf(err, rc, "events: cannot allocate");
        goto fail;
    }
    if (o->controller && o->controller[0]) {
        km_zsock_opts co;
        km_zsock_opts_default(&co);
        co.routing_id = s->worker_id;
        co.sndhwm = 8; /* a heartbeat that cannot leave soon is stale: drop it */
        if ((rc = km_zsock_open(s->zctx, KM_ZDEALER, &co, &s->ctl, err))) goto fail;
        if ((rc = km_zsock_connect(s->ctl, o->controller, err))) goto fail;
    }
    if (o->admin_port >= 0) {
        km_admin_opts ao = {.host = o->admin_host,
                            .port = o->admin_port,
                            .metrics = s->reg,
                            .ready = wk_ready_cb,
                            .user = s};
        if ((rc = km_admin_start(&ao, &s->admin, err))) goto fail;
        snprintf(s->ep_admin, sizeof s->ep_admin, "http://%s:%d",
                 o->admin_host ? o->admin_host : "127.0.0.1", km_admin_port(s->admin));
    }
    *out = s;
    return 0;
fail:
    wk_service_destroy(s);
    return rc;
}

void wk_service_destroy(wk_service *s)
{
    if (!s) return;
    km_admin_stop(s->admin);
    if (s->ballast) kv_seq_destroy(s->kv, s->ballast);
    if (s->sched) wk_sched_destroy(s->sched);
    for (int i = 0; i < s->n_live; i++) wk_sreq_free(s->live[i]);
    free(s->live);
    wk_events_destroy(s->ev);
    int linger = 500; /* let the last replies leave */
    if (s->router) zmq_setsockopt(s->router, ZMQ_LINGER, &linger, sizeof linger);
    if (s->pub) zmq_setsockopt(s->pub, ZMQ_LINGER, &linger, sizeof linger);
    km_zsock_close(s->router);
    km_zsock_close(s->pub);
    km_zsock_close(s->ctl);
    if (s->zctx) km_zctx_destroy(s->zctx);
    km_metrics_destroy(s->reg);
    km_buf_free(&s->out);
    km_zmsg_clear(&s->in);
    free(s->tokbuf);
    free(s);
}

void wk_service_signal(wk_service *s, int signo)
{
    (void)signo;
    s->signals = s->signals + 1;
}

/* End of a drain: hand back what is left, persist the cached pages, stop. With a disk tier every
 * page still in RAM (hot or host: both die with the process) gets a disk copy, parents first,
 * within the disk budget and what is left of the drain's time (at least 2 s more), so the next
 * process re-indexes them and comes back warm. Without one, hot pages are demoted to host RAM
 * as before (it only helps a process that is not about to exit, but costs nothing). */
static void wk_finish_drain(wk_service *s)
{
    int left = wk_sched_pending(s->sched);
    if (left)
        wk_sched_abort_all(s->sched, KM_CODE_UNAVAILABLE,
                           "worker drained: request handed back for migration");
    wk_ballast_release(s);
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    int moved, persisted = 0;
    if (st.tier[KV_TIER_DISK].budget) {
        uint64_t now = km_now_ns(), until = now + wk_ms_ns(2000);
        if (s->drain_deadline_ns > until) until = s->drain_deadline_ns;
        moved = kv_store_persist(s->kv, until);
        persisted = 1;
    } else {
        moved = kv_store_evict_oldest_fraction(s->kv, 1.0);
    }
    wk_events_pump(s->ev);
    wk_set_state(s, KM_STATE_STOPPING);
    KM_INFO("drain_done", "worker=%s handed_back=%d %s=%d", s->worker_id, left,
            persisted ? "pages_persisted" : "pages_demoted", moved);
    s->stop_now = true;
    s->exit_code = WK_EXIT_RESTART;
}

int wk_service_run(wk_service *s)
{
    km_errbuf err = {{0}};
    wk_events_pump(s->ev); /* the disk tier's pages, re-indexed at open */
    wk_set_state(s, KM_STATE_READY);
    if (wk_write_ports(s, &err)) KM_WARN("ports_file", "msg=\"%s\"", err.msg);
    KM_INFO("worker_ready", "worker=%s requests=%s events=%s admin=%s model=%s", s->worker_id,
            s->ep_requests, s->ep_events[0] ? s->ep_events : "-",
            s->ep_admin[0] ? s->ep_admin : "-", s->model_base);
    int handled_signals = 0;
    while (!s->stop_now) {
        int sig = s->signals;
        if (sig != handled_signals) {
            handled_signals = sig;
            if (sig >= 2 || wk_state(s) != KM_STATE_READY) {
                KM_INFO("signal_stop", "worker=%s", s->worker_id);
                wk_sched_abort_all(s->sched, KM_CODE_UNAVAILABLE, "worker stopping");
                s->exit_code = WK_EXIT_RESTART;
                break;
            }
            wk_start_drain(s, 0, "signal");
        }
        uint64_t now = km_now_ns();
        int pending = wk_sched_pending(s->sched);
        int timeout = 0;
        if (!pending) {
            int64_t to_hb = s->ctl ? (int64_t)(s->next_hb_ns - now) / 1000000 : 100;
            timeout = to_hb < 0 ? 0 : to_hb > 100 ? 100 : (int)to_hb;
        }
        km_zpollitem items[2] = {{.sock = s->router, .events = KM_ZPOLLIN},
                                 {.sock = s->ctl, .events = KM_ZPOLLIN}};
        int n_items = s->ctl ? 2 : 1;
        int rc = km_zpoll(items, n_items, timeout, NULL);
        if (rc > 0) {
            if (items[0].revents & KM_ZPOLLIN) wk_pump_socket(s, s->router, 256);
            if (n_items > 1 && (items[1].revents & KM_ZPOLLIN)) wk_pump_socket(s, s->ctl, 64);
        }
        if (s->stop_now) break;
        if (wk_sched_pending(s->sched)) {
            rc = wk_sched_step(s->sched);
            if (rc > 0)
                km_counter_inc(s->s_steps);
            else if (rc < 0)
                KM_ERROR("step_failed", "err=%s", km_strerror(rc));
        }
        int frames = wk_events_pump(s->ev);
        if (frames) km_counter_add(s->s_events, (uint64_t)frames);
        now = km_now_ns();
        if (wk_state(s) == KM_STATE_DRAINING &&
            (!wk_sched_pending(s->sched) || now >= s->drain_deadline_ns))
            wk_finish_drain(s);
        if (now >= s->next_gauge_ns) {
            wk_update_gauges(s);
            s->next_gauge_ns = now + wk_ms_ns(250);
        }
        if (s->ctl && now >= s->next_hb_ns) {
            wk_heartbeat(s);
            s->next_hb_ns = now + wk_ms_ns(s->o.heartbeat_ms);
        }
    }
    if (wk_sched_pending(s->sched))
        wk_sched_abort_all(s->sched, KM_CODE_UNAVAILABLE, "worker stopping");
    wk_set_state(s, KM_STATE_STOPPING);
    wk_events_pump(s->ev);
    wk_update_gauges(s);
    if (s->ctl) wk_heartbeat(s); /* tells the controller it is stopping */
    return s->exit_code;
}
