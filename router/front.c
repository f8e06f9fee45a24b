/*
 * front.c — the router's HTTP handlers (router.h, "the router daemon"): health and readiness,
 * /metrics, the status document, and the OpenAI-compatible completions endpoints, which turn a
 * JSON body into a request of the same table the ZeroMQ front fills (internal.h).
 *
 * Why it is its own file: the HTTP server (http.c) is transport, this is what the router answers;
 * the two change for different reasons. A completion request here is tokenized (a chat request
 * through the model's chat template first) and then follows the same path as a ZeroMQ one from
 * rt_rq_start on; only its replies are written as SSE chunks or one JSON body (rt_oai_*).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "router/internal.h"

static void on_http_abort(rt_http_req *h, void *user)
{
    rt_rq *q = user;
    q->http = NULL;
    rt_router *r = q->r;
    if (q->queued) {
        rt_rq_end(r, q);
        return;
    }
    rt_rq_cancel(r, q); /* the worker's done(canceled) ends it */
}

static void http_error(rt_http_req *h, int status, const char *type, const char *param,
                       const char *msg)
{
    rt_oai_err e = {.status = status, .type = type, .param = param};
    snprintf(e.message, sizeof e.message, "%s", msg);
    km_buf b = {0};
    rt_oai_error_json(&b, &e);
    rt_http_respond(h, status, "application/json", b.data, b.len);
    km_buf_free(&b);
}

/* The /v1/status document: the router's counters, the controller's view as the router last saw it,
 * and one entry per worker slot. */
static void status_json(rt_router *r, km_buf *out)
{
    km_buf_printf(out,
                  "{\"model\":\"%s\",\"fingerprint\":\"%s\",\"mode\":\"%s\",\"page_tokens\":%d,"
                  "\"router\":{\"requests\":%llu,\"completed\":%llu,\"failed\":%llu,"
                  "\"inflight\":%d,\"queued\":%d,\"overloaded\":%llu,\"migrations\":%llu,"
                  "\"bad_frames\":%llu,\"prompt_tokens\":%llu,\"cached_tokens\":%llu,"
                  "\"predicted_cached_tokens\":%llu,\"hit_ratio\":%.4f,\"index_pages\":%zu},",
                  r->model_name, r->fp, rt_mode_name(r->c.policy.mode), r->c.page_tokens,
                  (unsigned long long)r->n_requests, (unsigned long long)r->n_ok,
                  (unsigned long long)r->n_err, r->n_inflight, r->n_queued,
                  (unsigned long long)r->n_overloaded, (unsigned long long)r->n_migrations,
                  (unsigned long long)r->n_bad_frames, (unsigned long long)r->prompt_tokens,
                  (unsigned long long)r->cached_tokens, (unsigned long long)r->predicted_tokens,
                  r->prompt_tokens ? (double)r->cached_tokens / (double)r->prompt_tokens : 0.0,
                  rt_index_size(r->index));
    if (!r->vsub) {
        km_buf_printf(out, "\"controller\":null,");
    } else {
        uint64_t now = rt_now_ms();
        km_buf_printf(out,
                      "\"controller\":{\"endpoint\":\"%s\",\"view_timeout_ms\":%u,\"fresh\":%s,"
                      "\"views\":%llu,\"bad_views\":%llu,",
                      r->ctl_url, r->c.view_timeout_ms, r->view_fresh ? "true" : "false",
                      (unsigned long long)r->n_views, (unsigned long long)r->n_bad_views);
        if (r->have_view)
            km_buf_printf(out, "\"id\":\"%s\",\"epoch\":%llu,\"seq\":%llu,\"age_ms\":%llu},",
                          r->ctl_id, (unsigned long long)r->view_epoch,
                          (unsigned long long)r->view_seq,
                          (unsigned long long)(now > r->view_at_ms ? now - r->view_at_ms : 0));
        else
            km_buf_printf(out, "\"id\":null,\"epoch\":null,\"seq\":null,\"age_ms\":null},");
    }
    km_buf_printf(out, "\"workers\":[");
    int ps = 0;
    uint64_t now = rt_now_ms();
    for (int i = 0; i < r->n_w; i++) {
        rt_wk *w = &r->w[i];
        km_buf_printf(out,
                      "%s{\"id\":\"%s\",\"requests\":\"%s\",\"events\":\"%s\",\"up\":%s,"
                      "\"draining\":%s,\"inflight\":%d,\"routed\":%llu,\"served\":%llu,"
                      "\"failed\":%llu,\"migrated_away\":%llu,\"prompt_tokens\":%llu,"
                      "\"cached_tokens\":%llu,\"hit_ratio\":%.4f,"
                      "\"kv_pages\":{\"hot\":%llu,\"host\":%llu,\"disk\":%llu},"
                      "\"page_bytes\":%d,\"event_seq\":%llu,\"event_gaps\":%llu,"
                      "\"resyncs\":%llu,\"snapshots\":%llu,\"connects\":%llu,",
                      i ? "," : "", w->id, w->req_url, w->ev_url, w->connected ? "true" : "false",
                      w->draining ? "true" : "false", w->inflight, (unsigned long long)w->routed,
                      (unsigned long long)w->served, (unsigned long long)w->failed,
                      (unsigned long long)w->migrated_away, (unsigned long long)w->prompt_tokens,
                      (unsigned long long)w->cached_tokens,
                      w->prompt_tokens ? (double)w->cached_tokens / (double)w->prompt_tokens : 0.0,
                      (unsigned long long)rt_index_pages(r->index, i, KM_TIER_HOT),
                      (unsigned long long)rt_index_pages(r->index, i, KM_TIER_HOST),
                      (unsigned long long)rt_index_pages(r->index, i, KM_TIER_DISK), ps,
                      (unsigned long long)rt_evstream_next(w->evs),
                      (unsigned long long)rt_evstream_gaps(w->evs), (unsigned long long)w->resyncs,
                      (unsigned long long)w->snapshots, (unsigned long long)w->connects);
        if (w->in_view)
            km_buf_printf(out, "\"member_state\":\"%s\",\"level\":%u,",
                          km_member_state_name(w->member), w->level);
        else
            km_buf_printf(out, "\"member_state\":null,\"level\":null,");
        if (w->view_id[0])
            km_buf_printf(out, "\"view_id\":\"%s\",", w->view_id);
        else
            km_buf_printf(out, "\"view_id\":null,");
        km_buf_printf(out, "\"from_view\":%s,\"view_migrated\":%llu,\"routable\":%s}",
                      w->from_view ? "true" : "false", (unsigned long long)w->view_migrated,
                      rt_wk_routable(r, w, now) ? "true" : "false");
    }
    km_buf_printf(out, "]}\n");
}

void rt_front_on_http(rt_http_req *h, void *user)
{
    rt_router *r = user;
    const char *path = rt_http_path(h), *method = rt_http_method(h);
    km_counter_inc(r->s_http_req);
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (!strcmp(path, "/healthz") || !strcmp(path, "/readyz")) {
        bool ready = false;
        uint64_t now = rt_now_ms();
        for (int i = 0; i < r->n_w; i++) ready |= rt_wk_routable(r, &r->w[i], now);
        bool ok = !strcmp(path, "/healthz") || ready;
        rt_http_respond(h, ok ? 200 : 503, "text/plain", ok ? "ok\n" : "no worker\n", ok ? 3 : 10);
        return;
    }
    if (!strcmp(path, "/metrics")) {
        km_buf b = {0};
        rt_update_page_gauges(r);
        km_metrics_render(r->metrics, &b);
        rt_http_respond(h, 200, "text/plain; version=0.0.4", b.data, b.len);
        km_buf_free(&b);
        return;
    }
    if (!strcmp(path, "/v1/models")) {
        if (!get) return http_error(h, 405, "invalid_request_error", NULL, "use GET");
        km_buf b = {0};
        rt_oai_models(&b, r->model_name, (int64_t)time(NULL));
        rt_http_respond(h, 200, "application/json", b.data, b.len);
        km_buf_free(&b);
        return;
    }
    if (!strcmp(path, "/v1/status") || !strcmp(path, "/status")) {
        km_buf b = {0};
        status_json(r, &b);
        rt_http_respond(h, 200, "application/json", b.data, b.len);
        km_buf_free(&b);
        return;
    }
    bool chat = !strcmp(path, "/v1/chat/completions");
    if (!chat && strcmp(path, "/v1/completions"))
        return http_error(h, 404, "invalid_request_error", NULL, "no such endpoint");
    if (strcmp(method, "POST"))
        return http_error(h, 405, "invalid_request_error", NULL, "use POST");
    size_t blen;
    const char *body = rt_http_body(h, &blen);
    rt_oai_req oq;
    rt_oai_err e;
    if (rt_oai_parse(body, blen, chat, &oq, &e)) {
        km_buf b = {0};
        rt_oai_error_json(&b, &e);
        rt_http_respond(h, e.status, "application/json", b.data, b.len);
        km_buf_free(&b);
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        return;
    }
    if (oq.model && !rt_model_ok(r, oq.model)) {
        char m[KM_PROTO_MAX_NAME * 2 + 100];
        snprintf(m, sizeof m, "The model '%.200s' does not exist (this server serves '%s')",
                 oq.model, r->model_name);
        rt_oai_req_free(&oq);
        rt_oai_err ne;
        rt_oai_err_from_code(KM_CODE_NOT_FOUND, m, &ne);
        ne.param = "model";
        km_buf b = {0};
        rt_oai_error_json(&b, &ne);
        rt_http_respond(h, ne.status, "application/json", b.data, b.len);
        km_buf_free(&b);
        return;
    }
    rt_rq *q = rt_rq_new(r, RQ_HTTP);
    if (!q) {
        rt_oai_req_free(&oq);
        return http_error(h, 500, "server_error", NULL, "out of memory");
    }
    q->http = h;
    q->http_chat = chat;
    q->http_stream = oq.stream;
    q->include_usage = oq.include_usage;
    q->created = (int64_t)time(NULL);
    snprintf(q->oai_id, sizeof q->oai_id, "%s-%llx%06llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)q->created, (unsigned long long)(r->next_rid + 1));
    km_msg tmp;
    km_msg_init(&tmp, KM_MSG_REQUEST);
    q->q = tmp.req;
    q->q.temperature = oq.temperature;
    q->q.top_p = oq.top_p;
    q->q.top_k = oq.top_k;
    q->q.min_p = oq.min_p;
    q->q.presence_penalty = oq.presence_penalty;
    q->q.frequency_penalty = oq.frequency_penalty;
    q->q.repeat_penalty = oq.repeat_penalty;
    q->q.has_seed = oq.has_seed;
    q->q.seed = oq.seed;
    q->q.priority = oq.priority;
    q->q.n_stop = (uint32_t)oq.n_stop;
    for (int i = 0; i < oq.n_stop; i++) {
        q->stop[i] = oq.stop[i];
        oq.stop[i] = NULL;
    }
    oq.n_stop = 0;
    q->salt = oq.cache_salt;
    oq.cache_salt = NULL;
    q->max_tokens = oq.max_tokens;
    int rc;
    if (chat) {
        km_chat_msg msgs[1024];
        for (int i = 0; i < oq.n_msgs && i < 1024; i++)
            msgs[i] = (km_chat_msg){oq.msgs[i].role, oq.msgs[i].content};
        km_chat_kind kind = r->chat != KM_CHAT_NONE ? r->chat : KM_CHAT_CHATML;
        const char *defsys = strcasestr(r->model_name, "smollm")
                                 ? "You are a helpful AI assistant named SmolLM, trained by "
                                   "Hugging Face"
                                 : NULL;
        int need = km_chat_apply(kind, msgs, oq.n_msgs, 1, defsys, NULL, 0);
        char *txt = need >= 0 ? malloc((size_t)need + 1) : NULL;
        if (txt) km_chat_apply(kind, msgs, oq.n_msgs, 1, defsys, txt, (size_t)need + 1);
        rc = txt ? rt_rq_tokenize(r, q, txt, (size_t)need, 0) : KM_ENOMEM;
        free(txt);
    } else {
        rc = rt_rq_tokenize(r, q, oq.prompt, strlen(oq.prompt), 1);
    }
    rt_oai_req_free(&oq);
    if (rc) {
        rt_rq_free(q);
        return http_error(h, 500, "server_error", NULL, "cannot tokenize the prompt");
    }
    rt_http_on_abort(h, on_http_abort, q);
    if (q->http_stream) {
        rt_http_stream_begin(h, 200, "text/event-stream");
        q->http_began = true;
        if (chat) {
            rt_oai_meta m;
            rt_rq_oai_meta(r, q, &m, NULL);
            km_buf b = {0};
            if (!rt_oai_sse_chunk(&b, &m, NULL, 0, NULL)) rt_http_stream_write(h, b.data, b.len);
            km_buf_free(&b);
        }
    }
    rt_rq_start(r, q);
    rt_pump(r);
}
