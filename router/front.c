/*
 * front.c — the router's HTTP handlers (router.h, "the router daemon"): health and readiness,
 * /metrics, the status document, and the OpenAI-compatible completions endpoints, which turn a
 * JSON body into a request of the same table the ZeroMQ front fills (internal.h).
 *
 * Why it is its own file: the HTTP server (common/http.h, the one every daemon runs) is transport,
 * this is what the router answers, one handler per row of the route table at the end; the two
 * change for different reasons. A completion request here is tokenized (a chat request
 * through the model's chat template first) and then follows the same path as a ZeroMQ one from
 * rt_rq_start on; only its replies are written as SSE chunks or one JSON body (rt_oai_*).
 */
#define _GNU_SOURCE
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "router/internal.h"

static void on_http_abort(km_http_req *h, void *user)
{
    rt_rq *q = user;
    q->http = NULL;
    rt_rq_abandon(q->r, q); /* ends now: no migration may resurrect it (issue 12) */
}

/* ---------------------------------------------------------------- replies (rt_front_http) */

static void http_token(rt_router *r, rt_rq *q, int32_t token, const char *text, size_t len)
{
    (void)token;
    if (!q->http) return;
    if (!q->http_stream || q->tool_names) { /* a reply that may be a call is read whole */
        km_buf_append(&q->text, text, len);
        return;
    }
    if (len == 0) return;
    rt_front_stream_begin(r, q);
    rt_oai_meta m;
    rt_rq_oai_meta(r, q, &m, NULL);
    km_buf b = {0};
    if (!rt_oai_sse_chunk(&b, &m, text, len, NULL)) km_http_stream_write(q->http, b.data, b.len);
    km_buf_free(&b);
}

static void http_done(rt_router *r, rt_rq *q, const rt_rq_done *d)
{
    if (!q->http) return;
    rt_oai_meta m;
    rt_rq_oai_meta(r, q, &m, d->worker);
    rt_oai_usage u = {.prompt_tokens = (uint32_t)q->n_prompt,
                      .completion_tokens = (uint32_t)q->n_gen,
                      .cached_tokens = d->cached,
                      .draft_tokens = q->draft_tokens,
                      .accepted_draft_tokens = q->accepted_draft_tokens};
    km_buf b = {0};
    json_t *calls =
        q->tool_names && q->text.len
            ? rt_oai_tool_calls((const char *)q->text.data, q->text.len, q->tool_names, q->oai_id)
            : NULL;
    if (calls && q->http_stream) {
        rt_front_stream_begin(r, q);
        km_buf one = {0};
        if (!rt_oai_sse_chunk(&one, &m, NULL, 0, NULL)) rt_oai_tool_patch(&one, 1, calls, &b);
        km_buf_free(&one);
        rt_oai_sse_chunk(&b, &m, NULL, 0, "tool_calls");
        if (q->include_usage) rt_oai_sse_usage(&b, &m, &u);
        rt_oai_sse_done(&b);
        km_http_stream_write(q->http, b.data, b.len);
        km_http_stream_end(q->http);
    } else if (calls) {
        km_buf whole = {0};
        if (!rt_oai_response(&whole, &m, "", 0, "tool_calls", &u))
            rt_oai_tool_patch(&whole, 0, calls, &b);
        km_buf_free(&whole);
        char extra[KM_PROTO_MAX_NAME + 64];
        snprintf(extra, sizeof extra, "X-Kvmesh-Worker: %s\r\n", d->worker ? d->worker : "");
        km_http_respond(q->http, 200, "application/json", extra, b.data, b.len);
    } else if (q->http_stream) {
        rt_front_stream_begin(r, q);
        if (q->text.len) { /* the tail: held-back bytes (as the ZeroMQ front's done.text) */
            rt_rq_oai_meta(r, q, &m, NULL);
            rt_oai_sse_chunk(&b, &m, (const char *)q->text.data, q->text.len, NULL);
            rt_rq_oai_meta(r, q, &m, d->worker);
        }
        rt_oai_sse_chunk(&b, &m, NULL, 0, rt_oai_finish(d->finish));
        if (q->include_usage) rt_oai_sse_usage(&b, &m, &u);
        rt_oai_sse_done(&b);
        km_http_stream_write(q->http, b.data, b.len);
        km_http_stream_end(q->http);
    } else {
        rt_oai_response(&b, &m, q->text.data ? (const char *)q->text.data : "", q->text.len,
                        rt_oai_finish(d->finish), &u);
        char extra[KM_PROTO_MAX_NAME + 64];
        snprintf(extra, sizeof extra, "X-Kvmesh-Worker: %s\r\n", d->worker ? d->worker : "");
        km_http_respond(q->http, 200, "application/json", extra, b.data, b.len);
    }
    km_buf_free(&b);
    json_decref(calls);
}

static void http_reply_error(rt_router *r, rt_rq *q, int code, uint32_t retry_after,
                             const char *msg)
{
    if (!q->http) return;
    rt_oai_err e;
    rt_oai_err_from_code(code, msg, &e);
    km_buf b = {0};
    if (q->http_began) {
        rt_oai_sse_error(&b, &e);
        km_http_stream_write(q->http, b.data, b.len);
        km_buf_reset(&b);
        rt_oai_sse_done(&b);
        km_http_stream_write(q->http, b.data, b.len);
        km_http_stream_end(q->http);
    } else {
        rt_oai_error_json(&b, &e);
        char extra[64] = "";
        if (retry_after)
            snprintf(extra, sizeof extra, "Retry-After: %u\r\n", (retry_after + 999) / 1000);
        km_http_respond(q->http, e.status, "application/json", extra, b.data, b.len);
    }
    km_buf_free(&b);
}

/* q ends: its connection must no longer call on_http_abort with it. */
static void http_release(rt_rq *q)
{
    if (q->http) km_http_on_abort(q->http, NULL, NULL);
}

const rt_front_ops rt_front_http = {
    .origin = RQ_HTTP,
    .name = "http",
    .token = http_token,
    .done = http_done,
    .error = http_reply_error,
    .release = http_release,
};

static void http_error(km_http_req *h, int status, const char *type, const char *param,
                       const char *msg)
{
    rt_oai_err e = {.status = status, .type = type, .param = param};
    snprintf(e.message, sizeof e.message, "%s", msg);
    km_buf b = {0};
    rt_oai_error_json(&b, &e);
    km_http_respond(h, status, "application/json", NULL, b.data, b.len);
    km_buf_free(&b);
}

/* A JSON string of s (NULL: null). Names and endpoints come from flags and file names, which need
 * not be UTF-8; JSON strings must be, so a byte outside ASCII in one that is not becomes '?'. */
static json_t *jstr(const char *s)
{
    if (!s) return json_null();
    json_t *j = json_string(s);
    if (j) return j;
    char *c = strdup(s);
    if (!c) return NULL;
    for (char *p = c; *p; p++)
        if ((unsigned char)*p >= 0x80) *p = '?';
    j = json_string(c);
    free(c);
    return j;
}

/* cached / prompt, to 4 decimals (0 when nothing was prompted). */
static double hit_ratio(uint64_t cached, uint64_t prompt)
{
    return prompt ? round(1e4 * (double)cached / (double)prompt) / 1e4 : 0.0;
}

static json_t *status_router(rt_router *r)
{
    return json_pack(
        "{s:I,s:I,s:I,s:i,s:i,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:I}", "requests",
        (json_int_t)r->n_requests, "completed", (json_int_t)r->n_ok, "failed", (json_int_t)r->n_err,
        "inflight", r->n_inflight, "queued", r->n_queued, "overloaded", (json_int_t)r->n_overloaded,
        "migrations", (json_int_t)r->n_migrations, "bad_frames", (json_int_t)r->n_bad_frames,
        "prompt_tokens", (json_int_t)r->prompt_tokens, "cached_tokens",
        (json_int_t)r->cached_tokens, "predicted_cached_tokens", (json_int_t)r->predicted_tokens,
        "hit_ratio", hit_ratio(r->cached_tokens, r->prompt_tokens), "index_pages",
        (json_int_t)rt_index_size(r->index));
}

/* The controller's view as the router last saw it; null without --controller. */
static json_t *status_controller(rt_router *r, uint64_t now)
{
    if (!r->vsub) return json_null();
    json_t *o = json_pack("{s:o,s:I,s:b,s:I,s:I}", "endpoint", jstr(r->ctl_url), "view_timeout_ms",
                          (json_int_t)r->c.view_timeout_ms, "fresh", r->view_fresh, "views",
                          (json_int_t)r->n_views, "bad_views", (json_int_t)r->n_bad_views);
    if (!o) return NULL;
    if (r->have_view)
        json_object_update_new(
            o, json_pack("{s:o,s:I,s:I,s:I}", "id", jstr(r->ctl_id), "epoch",
                         (json_int_t)r->view_epoch, "seq", (json_int_t)r->view_seq, "age_ms",
                         (json_int_t)(now > r->view_at_ms ? now - r->view_at_ms : 0)));
    else
        json_object_update_new(o, json_pack("{s:n,s:n,s:n,s:n}", "id", "epoch", "seq", "age_ms"));
    return o;
}

static json_t *status_worker(rt_router *r, int i, uint64_t now)
{
    rt_wk *w = &r->w[i];
    json_t *o = json_pack(
        "{s:o,s:o,s:o,s:b,s:b,s:i,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:{s:I,s:I,s:I},s:i,s:I,s:I,s:I,s:I,"
        "s:I}",
        "id", jstr(w->id), "requests", jstr(w->req_url), "events", jstr(w->ev_url), "up",
        w->connected, "draining", w->draining, "inflight", w->inflight, "routed",
        (json_int_t)w->routed, "served", (json_int_t)w->served, "failed", (json_int_t)w->failed,
        "migrated_away", (json_int_t)w->migrated_away, "prompt_tokens",
        (json_int_t)w->prompt_tokens, "cached_tokens", (json_int_t)w->cached_tokens, "hit_ratio",
        hit_ratio(w->cached_tokens, w->prompt_tokens), "kv_pages", "hot",
        (json_int_t)rt_index_pages(r->index, i, KM_TIER_HOT), "host",
        (json_int_t)rt_index_pages(r->index, i, KM_TIER_HOST), "disk",
        (json_int_t)rt_index_pages(r->index, i, KM_TIER_DISK), "page_bytes", 0, "event_seq",
        (json_int_t)rt_evstream_next(w->evs), "event_gaps", (json_int_t)rt_evstream_gaps(w->evs),
        "resyncs", (json_int_t)w->resyncs, "snapshots", (json_int_t)w->snapshots, "connects",
        (json_int_t)w->connects);
    if (!o) return NULL;
    if (w->in_view)
        json_object_update_new(o,
                               json_pack("{s:s,s:i}", "member_state",
                                         km_member_state_name(w->member), "level", (int)w->level));
    else
        json_object_update_new(o, json_pack("{s:n,s:n}", "member_state", "level"));
    json_object_set_new(o, "view_id", w->view_id[0] ? jstr(w->view_id) : json_null());
    json_object_update_new(o, json_pack("{s:b,s:I,s:b}", "from_view", w->from_view, "view_migrated",
                                        (json_int_t)w->view_migrated, "routable",
                                        rt_wk_routable(r, w, now)));
    return o;
}

/* The /v1/status document: the router's counters, the controller's view as the router last saw it,
 * and one entry per worker slot. Built with jansson, so every name is escaped: a model, worker or
 * endpoint name with a quote in it made the document invalid JSON when it was printed with %s. */
static int status_json(rt_router *r, km_buf *out)
{
    uint64_t now = rt_now_ms();
    json_t *workers = json_array();
    for (int i = 0; workers && i < r->n_w; i++)
        if (!r->w[i].free && json_array_append_new(workers, status_worker(r, i, now))) {
            json_decref(workers);
            workers = NULL;
        }
    json_t *o = json_pack("{s:o,s:o,s:s,s:i,s:o,s:o,s:o}", "model", jstr(r->model_name),
                          "fingerprint", jstr(r->fp), "mode", rt_mode_name(r->c.policy.mode),
                          "page_tokens", r->c.page_tokens, "router", status_router(r), "controller",
                          status_controller(r, now), "workers", workers);
    char *s = o ? json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(6)) : NULL;
    json_decref(o);
    int rc = s ? km_buf_printf(out, "%s\n", s) : KM_ENOMEM;
    free(s);
    return rc;
}

/* ---------------------------------------------------------------- API keys */

/* The caller's API key when the front has a key file (docs/security.md, "HTTP API keys"): true
 * with *m filled (*keyed says whether there was a file at all), or false after answering 401
 * (no valid key: OpenAI's invalid_api_key) or 403 (a key of a role not in `roles`). */
static bool http_auth(rt_router *r, km_http_req *h, unsigned roles, km_apikey_match *m, bool *keyed)
{
    memset(m, 0, sizeof *m);
    *keyed = r->apikeys != NULL;
    if (!r->apikeys) return true;
    const char *hv = km_http_header(h, "Authorization");
    int rc = km_apikeys_check_header(r->apikeys, hv ? hv : "", hv ? strlen(hv) : 0, m);
    rt_oai_err e = {.type = "invalid_request_error"};
    if (rc) {
        e.status = 401;
        e.code = "invalid_api_key";
        snprintf(e.message, sizeof e.message, "%s",
                 hv ? "Incorrect API key provided."
                    : "You didn't provide an API key. Provide it in the Authorization header as "
                      "Bearer KEY.");
        km_counter_inc(r->s_http_unauthorized);
    } else if (!(m->role & roles)) {
        e.status = 403;
        e.code = "insufficient_permissions";
        snprintf(e.message, sizeof e.message, "This API key (tenant %s, role %s) may not use %s.",
                 m->tenant, km_role_name(m->role), km_http_path(h));
        km_counter_inc(r->s_http_forbidden);
    } else {
        return true;
    }
    km_buf b = {0};
    rt_oai_error_json(&b, &e);
    km_http_respond(h, e.status, "application/json",
                    e.status == 401 ? "WWW-Authenticate: Bearer\r\n" : NULL, b.data, b.len);
    km_buf_free(&b);
    return false;
}

/* The server's on_head hook: with keys on, a request for anything but the health probes needs
 * a valid key before its body is read, so a keyless client costs one head of memory and work,
 * whatever body it announces (issue 41). Roles are checked by each route, as before. */
static void on_front_head(km_http_req *h, void *user)
{
    rt_router *r = user;
    const char *path = km_http_path(h);
    if (!r->apikeys || !strcmp(path, "/healthz") || !strcmp(path, "/readyz")) return;
    km_apikey_match m;
    bool keyed;
    http_auth(r, h, KM_ROLES_ALL, &m, &keyed);
}

/* ---------------------------------------------------------------- the routes */

static void on_healthz(km_http_req *h, void *user)
{
    km_http_respond(h, 200, "text/plain", NULL, "ok\n", 3);
}

/* Ready while at least one worker may get new requests. */
static void on_readyz(km_http_req *h, void *user)
{
    rt_router *r = user;
    bool ready = false;
    uint64_t now = rt_now_ms();
    for (int i = 0; i < r->n_w; i++) ready |= rt_wk_routable(r, &r->w[i], now);
    km_http_respond(h, ready ? 200 : 503, "text/plain", NULL, ready ? "ok\n" : "no worker\n",
                    ready ? 3 : 10);
}

static void on_metrics(km_http_req *h, void *user)
{
    rt_router *r = user;
    km_apikey_match m;
    bool keyed;
    if (!http_auth(r, h, KM_ROLE_OPERATOR, &m, &keyed)) return;
    km_buf b = {0};
    rt_update_page_gauges(r);
    km_metrics_render(r->metrics, &b);
    km_http_respond(h, 200, "text/plain; version=0.0.4", NULL, b.data, b.len);
    km_buf_free(&b);
}

static void on_models(km_http_req *h, void *user)
{
    rt_router *r = user;
    km_apikey_match m;
    bool keyed;
    if (!http_auth(r, h, KM_ROLE_CLIENT | KM_ROLE_OPERATOR, &m, &keyed)) return;
    km_buf b = {0};
    rt_oai_models(&b, r->model_name, (int64_t)time(NULL));
    km_http_respond(h, 200, "application/json", NULL, b.data, b.len);
    km_buf_free(&b);
}

/* GET /v1/models/{id} (the SDKs' models.retrieve): the model when id names it, else 404
 * model_not_found. The id is percent-decoded ("org%2Fname"). */
static void on_model(km_http_req *h, void *user)
{
    rt_router *r = user;
    km_apikey_match am;
    bool keyed;
    if (!http_auth(r, h, KM_ROLE_CLIENT | KM_ROLE_OPERATOR, &am, &keyed)) return;
    const char *p = km_http_path(h) + strlen("/v1/models/");
    char id[KM_PROTO_MAX_NAME + 1];
    size_t n = 0;
    for (; *p && n < sizeof id - 1; n++) {
        unsigned hex;
        if (p[0] == '%' && sscanf(p + 1, "%2x", &hex) == 1 && p[1] && p[2]) {
            id[n] = (char)hex;
            p += 3;
        } else {
            id[n] = *p++;
        }
    }
    id[n] = 0;
    km_buf b = {0};
    if (*p || memchr(id, 0, n) || !rt_model_ok(r, id)) {
        char m[KM_PROTO_MAX_NAME * 2 + 100];
        snprintf(m, sizeof m, "The model '%.200s' does not exist (this server serves '%s')", id,
                 r->model_name);
        rt_oai_err e;
        rt_oai_err_from_code(KM_CODE_NOT_FOUND, m, &e);
        e.param = "model";
        rt_oai_error_json(&b, &e);
        km_http_respond(h, e.status, "application/json", NULL, b.data, b.len);
    } else {
        rt_oai_model(&b, r->model_name, (int64_t)time(NULL));
        km_http_respond(h, 200, "application/json", NULL, b.data, b.len);
    }
    km_buf_free(&b);
}

/* The cluster's topology (every worker's endpoints): operators only when keys are on. */
static void on_status(km_http_req *h, void *user)
{
    rt_router *r = user;
    km_apikey_match m;
    bool keyed;
    if (!http_auth(r, h, KM_ROLE_OPERATOR, &m, &keyed)) return;
    km_buf b = {0};
    if (status_json(r, &b))
        http_error(h, 500, "server_error", NULL, "out of memory");
    else
        km_http_respond(h, 200, "application/json", NULL, b.data, b.len);
    km_buf_free(&b);
}

/* The OpenAI request's sampling parameters, stop strings and salt into q (taken from oq). */
static void rq_from_oai(rt_rq *q, rt_oai_req *oq)
{
    km_msg tmp;
    km_msg_init(&tmp, KM_MSG_REQUEST);
    q->q = tmp.req;
    q->q.temperature = oq->temperature;
    q->q.top_p = oq->top_p;
    q->q.top_k = oq->top_k;
    q->q.min_p = oq->min_p;
    q->q.presence_penalty = oq->presence_penalty;
    q->q.frequency_penalty = oq->frequency_penalty;
    q->q.repeat_penalty = oq->repeat_penalty;
    q->q.has_seed = oq->has_seed;
    q->q.seed = oq->seed;
    q->q.priority = oq->priority;
    q->q.speculate = oq->speculate;
    q->q.max_draft_tokens = oq->max_draft_tokens;
    q->q.n_stop = (uint32_t)oq->n_stop;
    for (int i = 0; i < oq->n_stop; i++) {
        q->stop[i] = oq->stop[i];
        oq->stop[i] = NULL;
    }
    oq->n_stop = 0;
    q->salt = oq->cache_salt;
    oq->cache_salt = NULL;
    q->grammar = oq->grammar;
    oq->grammar = NULL;
    q->tool_names = oq->tool_names;
    oq->tool_names = NULL;
    q->max_tokens = oq->max_tokens;
}

/* The prompt's text (malloc'd, *len bytes; NULL when out of memory): a completion's prompt as
 * is, a chat's messages through the model's chat template (ChatML when the model names none). */
static char *prompt_text(rt_router *r, const rt_oai_req *oq, bool chat, size_t *len)
{
    if (!chat) {
        *len = strlen(oq->prompt);
        return strdup(oq->prompt);
    }
    md_chat_msg msgs[1024];
    for (int i = 0; i < oq->n_msgs && i < 1024; i++)
        msgs[i] = (md_chat_msg){oq->msgs[i].role, oq->msgs[i].content};
    md_chat_kind kind = r->chat != MD_CHAT_NONE ? r->chat : MD_CHAT_CHATML;
    const char *defsys = strcasestr(r->model_name, "smollm")
                             ? "You are a helpful AI assistant named SmolLM, trained by "
                               "Hugging Face"
                             : NULL;
    int need = md_chat_apply(kind, msgs, oq->n_msgs, 1, defsys, NULL, 0);
    char *txt = need >= 0 ? malloc((size_t)need + 1) : NULL;
    if (txt) md_chat_apply(kind, msgs, oq->n_msgs, 1, defsys, txt, (size_t)need + 1);
    *len = need >= 0 ? (size_t)need : 0;
    return txt;
}

/* POST /v1/completions or /v1/chat/completions: a request of the router's table, answered as
 * SSE chunks or one JSON body. */
static void on_completion(rt_router *r, km_http_req *h, bool chat)
{
    km_apikey_match key;
    bool keyed;
    if (!http_auth(r, h, KM_ROLE_CLIENT | KM_ROLE_OPERATOR, &key, &keyed)) return;
    size_t blen;
    const char *body = km_http_body(h, &blen);
    rt_oai_req oq;
    rt_oai_err e;
    km_buf b = {0};
    if (rt_oai_parse(body, blen, chat, &oq, &e)) {
        rt_oai_error_json(&b, &e);
        km_http_respond(h, e.status, "application/json", NULL, b.data, b.len);
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
        rt_oai_error_json(&b, &ne);
        km_http_respond(h, ne.status, "application/json", NULL, b.data, b.len);
        km_buf_free(&b);
        return;
    }
    rt_rq *q = rt_rq_new(r, &rt_front_http);
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
    rq_from_oai(q, &oq);
    if (keyed) snprintf(q->tenant, sizeof q->tenant, "h:%s", key.tenant);
    int rc = rt_rq_compose_salt(q, keyed ? &key : NULL);
    if (rc == KM_ERANGE) {
        rt_oai_req_free(&oq);
        rt_rq_free(q);
        return http_error(h, 400, "invalid_request_error", "cache_salt",
                          "'cache_salt' is too long for this API key's tenant salt");
    }
    size_t len = 0;
    char *text = rc ? NULL : prompt_text(r, &oq, chat, &len);
    rt_oai_req_free(&oq);
    if (!text) {
        rt_rq_free(q);
        return http_error(h, 500, "server_error", NULL, "cannot render the prompt");
    }
    km_http_on_abort(h, on_http_abort, q);
    /* tokenized on or off the loop (prompt.c), then rt_front_tokens_ready, then started */
    rt_rq_prepare(r, q, text, len, chat ? 0 : 1); /* a rendered template carries its BOS */
    rt_pump(r);
}

static void on_completions(km_http_req *h, void *user)
{
    on_completion(user, h, false);
}

static void on_chat_completions(km_http_req *h, void *user)
{
    on_completion(user, h, true);
}

/* The router's HTTP API. GET admits HEAD; a path not here is 404, a method not listed 405 (with
 * Allow), both as OpenAI error objects. */
static const km_http_route front_routes[] = {
    {"/healthz", 0, on_healthz},
    {"/readyz", 0, on_readyz},
    {"/metrics", 0, on_metrics},
    {"/v1/models", KM_HTTP_GET, on_models},
    {"/v1/models/", KM_HTTP_GET, on_model},
    {"/v1/status", 0, on_status},
    {"/status", 0, on_status},
    {"/v1/completions", KM_HTTP_POST, on_completions},
    {"/v1/chat/completions", KM_HTTP_POST, on_chat_completions},
};

int rt_front_start(rt_router *r, km_errbuf *err)
{
    const rt_config *c = &r->c;
    if (!c->http_host || c->http_port < 0) return 0;
    km_http_opts o = {
        .host = c->http_host,
        .port = c->http_port,
        .routes = front_routes,
        .n_routes = sizeof front_routes / sizeof *front_routes,
        .user = r,
        .error_body = rt_oai_http_error,
        .lim = {.max_head = 16384, .max_body = c->max_http_body ? c->max_http_body : 4u << 20},
        .requests = r->s_http_req,
        .on_head = on_front_head,
        .max_buffered = c->max_http_buffered,
        .buffer_refusals = r->s_http_buffer_full,
        .tls_failures = r->s_tls_fail,
        .tls_cert = c->tls_cert,
        .tls_key = c->tls_key};
    km_errbuf herr = {{0}};
    int rc = km_http_server_start(&r->loop, &o, &r->http, &herr);
    if (rc) return km_errf(err, rc, "http: cannot listen on %s", herr.msg);
    return 0;
}
