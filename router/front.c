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

static void stream_begin(rt_router *r, rt_rq *q);

/* The token's logprobs from its worker frame into lp; false when it carries none. */
static bool token_lp(const rt_rq *q, int32_t token, rt_oai_lp *lp)
{
    const km_msg_token *t = q->cur_tok;
    if (!q->q.logprobs || !t || !t->has_logprob) return false;
    memset(lp, 0, sizeof *lp);
    lp->token = token;
    lp->logprob = t->logprob;
    lp->n_top = t->n_top < q->q.top_logprobs ? t->n_top : q->q.top_logprobs;
    if (lp->n_top > RT_OAI_MAX_TOP) lp->n_top = RT_OAI_MAX_TOP;
    memcpy(lp->top, t->top, sizeof *lp->top * lp->n_top);
    return true;
}

/* echo with logprobs: the prompt's entries (the first without one: null, as OpenAI's) then
 * lp[0, n), in a new array of *n_all entries; NULL when out of memory. */
static rt_oai_lp *echo_lps(const rt_rq *q, const rt_oai_lp *lp, int n, int *n_all)
{
    int np = (int)(q->plp.len / sizeof(rt_oai_lp));
    rt_oai_lp *all = calloc((size_t)(1 + np + n), sizeof *all);
    if (!all) return NULL;
    all[0].token = q->n_prompt > 0 ? q->tokens[0] : 0;
    all[0].logprob = NAN;
    if (np) memcpy(all + 1, q->plp.data, sizeof *all * (size_t)np);
    if (n) memcpy(all + 1 + np, lp, sizeof *all * (size_t)n);
    *n_all = 1 + np + n;
    return all;
}

static void http_token(rt_router *r, rt_rq *q, int32_t token, const char *text, size_t len)
{
    if (!q->http) return;
    rt_oai_lp lp;
    bool has_lp = token_lp(q, token, &lp);
    if (!q->http_stream || q->tool_names) { /* a reply that may be a call is read whole */
        km_buf_append(&q->text, text, len);
        if (has_lp) km_buf_append(&q->lp, &lp, sizeof lp);
        return;
    }
    if (len == 0 && !has_lp) return;
    stream_begin(r, q);
    rt_oai_meta m;
    rt_rq_oai_meta(r, q, &m, NULL);
    if (has_lp) {
        m.lp = &lp;
        m.n_lp = 1;
        m.text_offset = q->lp_off;
        char p[KM_PROTO_MAX_PIECE];
        int n = m.piece(m.piece_ctx, token, p, sizeof p);
        q->lp_off += n > 0 && n <= (int)sizeof p ? (size_t)n : 0;
    }
    km_buf b = {0};
    if (!rt_oai_sse_chunk(&b, &m, text, len, NULL)) km_http_stream_write(q->http, b.data, b.len);
    km_buf_free(&b);
}

/* One choice of a group is complete: its finish chunk goes out (stream) or its result is kept;
 * the last one ends the response. */
static void group_done(rt_router *r, rt_rq *q, const rt_rq_done *d)
{
    rt_hgroup *g = q->grp;
    if (g->failed || !g->http) return;
    if (q->choice % g->per == 0) { /* the prompt's tokens count once per prompt */
        g->u.prompt_tokens += (uint32_t)q->n_prompt;
        g->u.cached_tokens += d->cached;
        g->u.chunk_tokens += q->chunk_tokens;
    }
    g->u.completion_tokens += (uint32_t)q->n_gen;
    g->u.draft_tokens += q->draft_tokens;
    g->u.accepted_draft_tokens += q->accepted_draft_tokens;
    snprintf(g->worker, sizeof g->worker, "%s", d->worker ? d->worker : "");
    bool last = ++g->n_done == g->n;
    rt_oai_meta m;
    km_buf b = {0};
    /* a reply that may be a call was read whole (http_token): each choice its own call */
    char cid[64];
    snprintf(cid, sizeof cid, "%s_%d", q->oai_id, q->choice);
    json_t *calls = q->tool_names && q->text.len
                        ? rt_oai_tool_calls((const char *)q->text.data, q->text.len, q->tool_names,
                                            q->tool_several, cid)
                        : NULL;
    if (g->stream) {
        stream_begin(r, q);
        rt_rq_oai_meta(r, q, &m, NULL);
        km_buf one = {0};
        if (calls && !rt_oai_sse_chunk(&one, &m, NULL, 0, NULL))
            rt_oai_tool_patch(&one, 1, calls, &b);
        else if (q->text.len)
            rt_oai_sse_chunk(&b, &m, (const char *)q->text.data, q->text.len, NULL);
        km_buf_free(&one);
        const char *finish = calls ? "tool_calls" : rt_oai_finish(d->finish);
        json_decref(calls);
        rt_rq_oai_meta(r, q, &m, d->worker);
        rt_oai_sse_chunk(&b, &m, NULL, 0, finish);
        if (last && q->include_usage) rt_oai_sse_usage(&b, &m, &g->u);
        if (last) rt_oai_sse_done(&b);
        km_http_stream_write(g->http, b.data, b.len);
        if (last) km_http_stream_end(g->http);
        km_buf_free(&b);
        return;
    }
    rt_oai_choice *c = &g->c[q->choice];
    km_buf all = {0}; /* echo: the prompt's text first */
    if (q->echo_text) km_buf_append(&all, q->echo_text, q->echo_len);
    km_buf_append(&all, q->text.data ? (const char *)q->text.data : "", q->text.len);
    km_buf_append(&all, "", 1);
    c->text = (const char *)all.data;
    c->len = all.len ? all.len - 1 : 0;
    c->finish = calls ? "tool_calls" : rt_oai_finish(d->finish);
    c->text_offset = q->echo_len;
    c->tool_calls = calls;
    if (q->q.logprobs) { /* taken from q, which ends after this */
        c->n_lp = (int)(q->lp.len / sizeof(rt_oai_lp));
        c->lp = q->lp.data ? (const rt_oai_lp *)q->lp.data : calloc(1, sizeof(rt_oai_lp));
        memset(&q->lp, 0, sizeof q->lp);
        int n_all = 0; /* echo: the prompt's logprobs first */
        rt_oai_lp *plps = q->q.prompt_logprobs ? echo_lps(q, c->lp, c->n_lp, &n_all) : NULL;
        if (plps) {
            free((void *)c->lp);
            c->lp = plps, c->n_lp = n_all, c->text_offset = 0;
        }
    }
    if (!last) return;
    rt_rq_oai_meta(r, q, &m, g->worker);
    rt_oai_response_choices(&b, &m, g->c, g->n, &g->u);
    char extra[KM_PROTO_MAX_NAME + 64];
    snprintf(extra, sizeof extra, "X-Kvmesh-Worker: %s\r\n", g->worker);
    km_http_respond(g->http, 200, "application/json", extra, b.data, b.len);
    km_buf_free(&b);
}

static void http_done(rt_router *r, rt_rq *q, const rt_rq_done *d)
{
    if (!q->http) return;
    if (q->grp) return group_done(r, q, d);
    rt_oai_meta m;
    rt_rq_oai_meta(r, q, &m, d->worker);
    rt_oai_usage u = {.prompt_tokens = (uint32_t)q->n_prompt,
                      .completion_tokens = (uint32_t)q->n_gen,
                      .cached_tokens = d->cached,
                      .draft_tokens = q->draft_tokens,
                      .accepted_draft_tokens = q->accepted_draft_tokens,
                      .chunk_tokens = q->chunk_tokens};
    km_buf b = {0};
    json_t *calls = q->tool_names && q->text.len
                        ? rt_oai_tool_calls((const char *)q->text.data, q->text.len, q->tool_names,
                                            q->tool_several, q->oai_id)
                        : NULL;
    if (calls && q->http_stream) {
        stream_begin(r, q);
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
        stream_begin(r, q);
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
        rt_oai_lp *plps = NULL; /* echo: the prompt's logprobs first */
        if (q->q.logprobs) {
            m.lp = q->lp.data ? (const rt_oai_lp *)q->lp.data : (const rt_oai_lp *)"";
            m.n_lp = (int)(q->lp.len / sizeof(rt_oai_lp));
            if (q->q.prompt_logprobs && (plps = echo_lps(q, m.lp, m.n_lp, &m.n_lp)))
                m.lp = plps, m.text_offset = 0;
        }
        km_buf all = {0}; /* echo: the prompt's text first */
        if (q->echo_text) km_buf_append(&all, q->echo_text, q->echo_len);
        km_buf_append(&all, q->text.data ? (const char *)q->text.data : "", q->text.len);
        rt_oai_response(&b, &m, all.data ? (const char *)all.data : "", all.len,
                        rt_oai_finish(d->finish), &u);
        km_buf_free(&all);
        free(plps);
        char extra[KM_PROTO_MAX_NAME + 64];
        snprintf(extra, sizeof extra, "X-Kvmesh-Worker: %s\r\n", d->worker ? d->worker : "");
        km_http_respond(q->http, 200, "application/json", extra, b.data, b.len);
    }
    km_buf_free(&b);
    json_decref(calls);
}

/* The answer to h is error e: a JSON body, or (the stream began) an SSE error event and the end. */
static void respond_error(km_http_req *h, bool began, const rt_oai_err *e, uint32_t retry_after)
{
    km_buf b = {0};
    if (began) {
        rt_oai_sse_error(&b, e);
        km_http_stream_write(h, b.data, b.len);
        km_buf_reset(&b);
        rt_oai_sse_done(&b);
        km_http_stream_write(h, b.data, b.len);
        km_http_stream_end(h);
    } else {
        rt_oai_error_json(&b, e);
        char extra[64] = "";
        if (retry_after)
            snprintf(extra, sizeof extra, "Retry-After: %u\r\n", (retry_after + 999) / 1000);
        km_http_respond(h, e->status, "application/json", extra, b.data, b.len);
    }
    km_buf_free(&b);
}

static void group_unref(rt_hgroup *g)
{
    if (--g->refs > 0) return;
    if (g->http) km_http_on_abort(g->http, NULL, NULL);
    for (int i = 0; g->c && i < g->n; i++) {
        free((char *)g->c[i].text);
        free((void *)g->c[i].lp);
        json_decref(g->c[i].tool_calls);
    }
    free(g->c);
    free(g->m);
    free(g);
}

/* Every member of g but keep ends now, without a reply (the client is gone, or answered). */
static void group_abandon(rt_hgroup *g, const rt_rq *keep)
{
    g->refs++; /* an abandoned member's release must not free g under this loop */
    for (int i = 0; i < g->n; i++) {
        rt_rq *q = g->m[i];
        if (!q || q == keep) continue;
        q->http = NULL;
        rt_rq_abandon(g->r, q);
    }
    group_unref(g);
}

static void on_group_abort(km_http_req *h, void *user)
{
    rt_hgroup *g = user;
    g->http = NULL;
    group_abandon(g, NULL);
}

/* A choice failed: the whole response is that error, and the other choices end. */
static void group_fail(rt_router *r, rt_rq *q, const rt_oai_err *e, uint32_t retry_after)
{
    rt_hgroup *g = q->grp;
    q->http = NULL;
    if (g->failed || !g->http) return;
    g->failed = true;
    respond_error(g->http, g->began, e, retry_after);
    group_abandon(g, q);
}

/* The HTTP request of q ends with e (a group: every other choice abandoned). */
static void http_fail(rt_router *r, rt_rq *q, const rt_oai_err *e)
{
    if (q->grp)
        group_fail(r, q, e, 0);
    else if (q->http)
        respond_error(q->http, q->http_began, e, 0);
}

/* Whether q is the first of its response to begin the SSE stream (false for later choices). */
static bool stream_first(rt_rq *q)
{
    if (!q->grp) return true;
    bool first = !q->grp->began;
    q->grp->began = true;
    return first;
}

/* The SSE response of a streaming HTTP request begins (once): the chat role chunk, and echo's
 * prompt text as the first content. */
static void stream_begin(rt_router *r, rt_rq *q)
{
    if (!q->http || !q->http_stream || q->http_began) return;
    if (stream_first(q)) km_http_stream_begin(q->http, 200, "text/event-stream");
    q->http_began = true;
    if (q->http_chat) {
        rt_oai_meta m;
        km_buf b = {0};
        rt_rq_oai_meta(r, q, &m, NULL);
        if (!rt_oai_sse_chunk(&b, &m, NULL, 0, NULL)) km_http_stream_write(q->http, b.data, b.len);
        km_buf_free(&b);
    }
    if (q->echo_text && q->echo_len) { /* echo: the prompt's text is the first chunk */
        rt_oai_meta m;
        km_buf b = {0};
        rt_rq_oai_meta(r, q, &m, NULL);
        int n_all = 0; /* with logprobs, the prompt's (they came before the first token) */
        rt_oai_lp *all = q->q.prompt_logprobs ? echo_lps(q, NULL, 0, &n_all) : NULL;
        if (all) m.lp = all, m.n_lp = n_all, m.text_offset = 0;
        if (!rt_oai_sse_chunk(&b, &m, q->echo_text, q->echo_len, NULL))
            km_http_stream_write(q->http, b.data, b.len);
        km_buf_free(&b);
        free(all);
    }
    q->lp_off = q->echo_len;
}

/* OpenAI's context check, with its counts: a prompt that leaves no room in the context, or one
 * whose max_tokens asked for more than is left, is 400 context_length_exceeded (the workers
 * would otherwise cap the completion silently). True when it answered. */
static bool over_context(rt_router *r, rt_rq *q, uint32_t asked, bool chat)
{
    uint32_t ctx = r->c.max_ctx, np = (uint32_t)q->n_prompt;
    if (!ctx || (np < ctx && (uint64_t)np + asked <= ctx)) return false;
    const char *what = chat ? "messages" : "prompt";
    char m[400];
    if (np >= ctx)
        snprintf(m, sizeof m,
                 "This model's maximum context length is %u tokens. However, your %s resulted "
                 "in %u tokens. Please reduce the length of the %s.",
                 ctx, what, np, what);
    else
        snprintf(m, sizeof m,
                 "This model's maximum context length is %u tokens. However, you requested %llu "
                 "tokens (%u in the %s, %u in the completion). Please reduce the length of the "
                 "%s or completion.",
                 ctx, (unsigned long long)np + asked, np, what, asked, what);
    rt_oai_err e;
    rt_oai_err_from_code(KM_CODE_TOO_LARGE, m, &e);
    e.param = what;
    http_fail(r, q, &e);
    return true;
}

/* An HTTP request's prompt is tokenized: a prompt + max_tokens over the context is answered 400
 * here (q ended, 1); otherwise a streaming response begins and 0 (the caller starts q). */
static int http_tokens_ready(rt_router *r, rt_rq *q)
{
    if (over_context(r, q, q->max_tokens, q->http_chat)) {
        rt_rq_end(r, q);
        return 1;
    }
    /* A constrained stream begins at its first token: a schema the worker refuses is then still
     * a plain 400 (the router leaves judging schemas to the worker's compiler). So does echo with
     * logprobs: the prompt's logprobs, which go with the echo chunk, come before that token. */
    if (!q->grammar && !q->q.prompt_logprobs) stream_begin(r, q);
    return 0;
}

static void http_reply_error(rt_router *r, rt_rq *q, int code, uint32_t retry_after,
                             const char *msg)
{
    if (!q->http) return;
    rt_oai_err e;
    rt_oai_err_from_code(code, msg, &e);
    if (q->grp)
        group_fail(r, q, &e, retry_after);
    else
        respond_error(q->http, q->http_began, &e, retry_after);
}

/* q ends: its connection must no longer call on_http_abort with it (a group: once its last
 * member ends). */
static void http_release(rt_rq *q)
{
    rt_hgroup *g = q->grp;
    if (g) {
        g->m[q->choice] = NULL;
        q->grp = NULL;
        group_unref(g);
    } else if (q->http) {
        km_http_on_abort(q->http, NULL, NULL);
    }
}

const rt_front_ops rt_front_http = {
    .origin = RQ_HTTP,
    .name = "http",
    .token = http_token,
    .done = http_done,
    .error = http_reply_error,
    .release = http_release,
    .tokens_ready = http_tokens_ready,
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

/* Whether origin is one of --cors-origins ("*": any). */
static bool cors_allowed(const char *list, const char *origin)
{
    if (!list || !origin || !*origin) return false;
    size_t n = strlen(origin);
    for (const char *p = list; *p;) {
        while (*p == ' ' || *p == ',') p++;
        size_t k = strcspn(p, ",");
        while (k && p[k - 1] == ' ') k--;
        if ((k == 1 && *p == '*') || (k == n && !strncmp(p, origin, n))) return true;
        p += strcspn(p, ",");
    }
    return false;
}

/* CORS (--cors-origins): a request from an allowed browser origin gets Access-Control-Allow-
 * Origin on whatever answers it; its preflight (OPTIONS with Access-Control-Request-Method) is
 * answered here, before any key is asked for (browsers send none with it). True when it
 * answered. Off (no header, preflights 405) without --cors-origins. */
static bool cors(rt_router *r, km_http_req *h)
{
    const char *origin = km_http_header(h, "Origin");
    if (!cors_allowed(r->c.cors_origins, origin) || strpbrk(origin, "\r\n")) return false;
    char line[KM_PROTO_MAX_NAME + 160];
    snprintf(line, sizeof line, "Access-Control-Allow-Origin: %.*s\r\nVary: Origin\r\n",
             KM_PROTO_MAX_NAME, origin);
    km_http_add_headers(h, line);
    if (strcmp(km_http_method(h), "OPTIONS") || !km_http_header(h, "Access-Control-Request-Method"))
        return false;
    const char *want = km_http_header(h, "Access-Control-Request-Headers");
    char extra[1024];
    snprintf(extra, sizeof extra,
             "Access-Control-Allow-Methods: GET, POST, OPTIONS\r\n"
             "Access-Control-Allow-Headers: %.512s\r\nAccess-Control-Max-Age: 600\r\n",
             want && !strpbrk(want, "\r\n") ? want : "Authorization, Content-Type");
    km_http_respond(h, 200, "text/plain", extra, "", 0);
    return true;
}

/* The server's on_head hook: with keys on, a request for anything but the health probes needs
 * a valid key before its body is read, so a keyless client costs one head of memory and work,
 * whatever body it announces (issue 41). Roles are checked by each route, as before. */
static void on_front_head(km_http_req *h, void *user)
{
    rt_router *r = user;
    const char *path = km_http_path(h);
    if (cors(r, h)) return; /* a preflight, answered */
    if (!r->apikeys || !strcmp(path, "/healthz") || !strcmp(path, "/readyz") ||
        !strcmp(path, "/health"))
        return;
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
    km_metrics_render_process(&b);
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
static int rq_from_oai(rt_rq *q, const rt_oai_req *oq)
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
    q->q.logprobs = oq->logprobs;
    q->q.top_logprobs = oq->top_logprobs;
    q->echo = oq->echo;
    q->q.prompt_logprobs = oq->echo && oq->logprobs; /* OpenAI's echo: the prompt's too */
    if (oq->grammar && !(q->grammar = strdup(oq->grammar))) return KM_ENOMEM;
    if (oq->tool_names && !(q->tool_names = strdup(oq->tool_names))) return KM_ENOMEM;
    q->tool_several = oq->tool_several;
    q->max_tokens = oq->max_tokens;
    if (oq->n_logit_bias) {
        if (!(q->bias = malloc(sizeof *q->bias * (size_t)oq->n_logit_bias))) return KM_ENOMEM;
        memcpy(q->bias, oq->logit_bias, sizeof *q->bias * (size_t)oq->n_logit_bias);
        q->q.n_logit_bias = (uint32_t)oq->n_logit_bias;
    }
    q->q.n_stop = (uint32_t)oq->n_stop;
    for (int i = 0; i < oq->n_stop; i++)
        if (!(q->stop[i] = strdup(oq->stop[i]))) return KM_ENOMEM;
    if (oq->cache_salt && !(q->salt = strdup(oq->cache_salt))) return KM_ENOMEM;
    return 0;
}

/* The prompt's text (malloc'd, *len bytes; NULL when out of memory): a completion's prompt as
 * is, a chat's messages through the model's chat template (ChatML when the model names none). */
static char *prompt_text(rt_router *r, const rt_oai_req *oq, bool chat, bool add_assistant,
                         size_t *len)
{
    if (!chat) {
        *len = strlen(oq->prompts[0].text);
        return strdup(oq->prompts[0].text);
    }
    md_chat_msg msgs[1024];
    for (int i = 0; i < oq->n_msgs && i < 1024; i++)
        msgs[i] = (md_chat_msg){oq->msgs[i].role, oq->msgs[i].content};
    md_chat_kind kind = r->chat != MD_CHAT_NONE ? r->chat : MD_CHAT_CHATML;
    const char *defsys = strcasestr(r->model_name, "smollm")
                             ? "You are a helpful AI assistant named SmolLM, trained by "
                               "Hugging Face"
                             : NULL;
    int need = md_chat_apply(kind, msgs, oq->n_msgs, add_assistant, defsys, NULL, 0);
    char *txt = need >= 0 ? malloc((size_t)need + 1) : NULL;
    if (txt) md_chat_apply(kind, msgs, oq->n_msgs, add_assistant, defsys, txt, (size_t)need + 1);
    *len = need >= 0 ? (size_t)need : 0;
    return txt;
}

/* The text of token ids (malloc'd, *len bytes; NULL when out of memory). */
static char *ids_text(rt_router *r, const int32_t *ids, int n, size_t *len)
{
    km_buf b = {0};
    md_detok dt;
    md_detok_init(&dt);
    char piece[KM_PROTO_MAX_PIECE + 64];
    for (int i = 0; i < n; i++) {
        int w = md_detok_push(r->tok, &dt, ids[i], piece, sizeof piece);
        if (w > 0 && km_buf_append(&b, piece, (size_t)w)) goto oom;
    }
    int w = md_detok_flush(&dt, piece, sizeof piece);
    if ((w > 0 && km_buf_append(&b, piece, (size_t)w)) || km_buf_append(&b, "", 1)) goto oom;
    *len = b.len - 1;
    return (char *)b.data;
oom:
    km_buf_free(&b);
    return NULL;
}

/* A prompt of token ids into q (its text too when it echoes). */
static int rq_take_ids(rt_router *r, rt_rq *q, const rt_oai_prompt *p)
{
    q->cap = p->n_ids + 64;
    if (!(q->tokens = malloc(sizeof *q->tokens * (size_t)q->cap))) return KM_ENOMEM;
    memcpy(q->tokens, p->ids, sizeof *q->tokens * (size_t)p->n_ids);
    q->n_prompt = p->n_ids;
    if (q->echo && !(q->echo_text = ids_text(r, p->ids, p->n_ids, &q->echo_len))) return KM_ENOMEM;
    return 0;
}

/* A 400 naming param when an id of ids is not in the vocabulary; true when it answered. */
static bool bad_ids(rt_router *r, km_http_req *h, const char *param, const int32_t *ids, int n,
                    size_t stride)
{
    int nv = md_tok_n_vocab(r->tok);
    for (int i = 0; i < n; i++) {
        int32_t id = *(const int32_t *)((const char *)ids + stride * (size_t)i);
        if (id >= nv) {
            char m[160];
            snprintf(m, sizeof m, "'%s' names token id %d, outside the vocabulary (%d ids)", param,
                     id, nv);
            http_error(h, 400, "invalid_request_error", param, m);
            return true;
        }
    }
    return false;
}

/* One choice's request (a group's member when g is not NULL): q, or NULL after answering h. */
static rt_rq *member_new(rt_router *r, km_http_req *h, const rt_oai_req *oq, const char *id,
                         int64_t created, const km_apikey_match *key, rt_hgroup *g, int choice)
{
    rt_rq *q = rt_rq_new(r, &rt_front_http);
    int rc = q ? rq_from_oai(q, oq) : KM_ENOMEM;
    if (!rc) {
        q->http = h;
        q->http_chat = oq->chat;
        q->http_stream = oq->stream;
        q->include_usage = oq->include_usage;
        q->created = created;
        snprintf(q->oai_id, sizeof q->oai_id, "%s", id);
        q->grp = g;
        q->choice = choice;
        if (q->q.has_seed) q->q.seed += (uint64_t)(choice % oq->n); /* n seeded: reproducible */
        if (key) snprintf(q->tenant, sizeof q->tenant, "h:%s", key->tenant);
        rc = rt_rq_compose_salt(q, key);
    }
    if (!rc) return q;
    rt_rq_free(q);
    if (rc == KM_ERANGE)
        http_error(h, 400, "invalid_request_error", "cache_salt",
                   "'cache_salt' is too long for this API key's tenant salt");
    else
        http_error(h, 500, "server_error", NULL, "out of memory");
    return NULL;
}

/* q's prompt (p, or a chat's rendered text) is tokenized and q starts: it is in the router's
 * table from here, and answers for itself. ck: its chunks (token spans over ids, byte spans over
 * text: prompt.c turns those into token spans). */
static void member_start(rt_router *r, rt_rq *q, const rt_oai_prompt *p, const char *chat_text,
                         size_t chat_len, const km_chunk_seg *ck, int n_ck)
{
    if (n_ck && (q->chunks = malloc(sizeof *q->chunks * (size_t)n_ck))) {
        memcpy(q->chunks, ck, sizeof *q->chunks * (size_t)n_ck);
        q->q.n_chunks = (uint32_t)n_ck;
        q->chunk_bytes = !(p && p->ids);
    }
    if (p && p->ids) { /* token ids: no tokenizing */
        if (rq_take_ids(r, q, p)) {
            rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
            return;
        }
        if (!http_tokens_ready(r, q)) rt_rq_start(r, q);
        return;
    }
    size_t len = p ? strlen(p->text) : chat_len;
    char *text = strndup(p ? p->text : chat_text, len);
    if (text && q->echo && !(q->echo_text = strndup(text, len))) {
        free(text);
        text = NULL;
    }
    if (!text) {
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    q->echo_len = q->echo_text ? len : 0;
    /* tokenized on or off the loop (prompt.c), then http_tokens_ready, then started */
    rt_rq_prepare(r, q, text, len, p ? 1 : 0); /* a rendered template carries its BOS */
}

/* The group of choices, or NULL (answered 500) when out of memory. */
static rt_hgroup *group_new(rt_router *r, km_http_req *h, const rt_oai_req *oq, int choices)
{
    rt_hgroup *g = calloc(1, sizeof *g);
    if (g && (!(g->m = calloc((size_t)choices, sizeof *g->m)) ||
              !(g->c = calloc((size_t)choices, sizeof *g->c)))) {
        free(g->m);
        free(g);
        g = NULL;
    }
    if (!g) {
        http_error(h, 500, "server_error", NULL, "out of memory");
        return NULL;
    }
    *g = (rt_hgroup){.r = r,
                     .http = h,
                     .n = choices,
                     .per = oq->n,
                     .stream = oq->stream,
                     .refs = 1,
                     .m = g->m,
                     .c = g->c};
    return g;
}

/* POST /v1/completions or /v1/chat/completions: a request of the router's table per choice (n
 * times each prompt), answered as SSE chunks or one JSON body. */
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
    int np = chat ? 1 : oq.n_prompts, choices = np * oq.n;
    bool bad = false;
    if (choices > r->c.max_n) {
        char m[200];
        snprintf(m, sizeof m,
                 "%d choices asked (n x prompts); this server gives at most %d per request",
                 choices, r->c.max_n);
        http_error(h, 400, "invalid_request_error", oq.n > 1 ? "n" : "prompt", m);
        bad = true;
    }
    bad = bad || bad_ids(r, h, "logit_bias", oq.logit_bias ? &oq.logit_bias[0].token : NULL,
                         oq.n_logit_bias, sizeof *oq.logit_bias);
    for (int i = 0; !chat && !bad && i < np; i++)
        bad = bad_ids(r, h, "prompt", oq.prompts[i].ids, oq.prompts[i].n_ids, sizeof(int32_t));
    size_t chat_len = 0;
    char *chat_text = !bad && chat ? prompt_text(r, &oq, true, true, &chat_len) : NULL;
    if (!bad && chat && !chat_text) {
        http_error(h, 500, "server_error", NULL, "cannot render the prompt");
        bad = true;
    }
    km_chunk_seg *chat_ck = NULL;
    int n_chat_ck = 0;
    if (!bad && chat && rt_oai_chat_chunks(&oq, chat_text, chat_len, &chat_ck, &n_chat_ck)) {
        http_error(h, 400, "invalid_request_error", "messages",
                   "too many messages marked kvmesh_chunk (limit 64)");
        bad = true;
    }
    rt_hgroup *g = !bad && choices > 1 ? group_new(r, h, &oq, choices) : NULL;
    if (bad || (choices > 1 && !g)) {
        free(chat_ck);
        free(chat_text);
        rt_oai_req_free(&oq);
        return;
    }
    int64_t created = (int64_t)time(NULL);
    char id[48];
    snprintf(id, sizeof id, "%s-%llx%06llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)created, (unsigned long long)(r->next_rid + 1));
    rt_rq *one = NULL;
    for (int i = 0; i < choices; i++) {
        rt_rq *q = member_new(r, h, &oq, id, created, keyed ? &key : NULL, g, i);
        if (!q) { /* answered: the members made so far never started */
            for (int k = 0; g && k < i; k++) rt_rq_free(g->m[k]);
            if (g) {
                g->refs = 1;
                g->http = NULL;
                group_unref(g);
            }
            free(chat_text);
            free(chat_ck);
            rt_oai_req_free(&oq);
            return;
        }
        if (g) {
            g->m[i] = q;
            g->refs++;
        } else {
            one = q;
        }
    }
    if (g)
        km_http_on_abort(h, on_group_abort, g);
    else
        km_http_on_abort(h, on_http_abort, one);
    for (int i = 0; i < choices; i++) {
        rt_rq *q = g ? g->m[i] : one;
        if (!q) continue; /* ended with the group (another choice failed) */
        member_start(r, q, chat ? NULL : &oq.prompts[i / oq.n], chat_text, chat_len,
                     chat ? chat_ck : oq.chunks, chat ? n_chat_ck : oq.n_chunks);
    }
    free(chat_ck);
    free(chat_text);
    rt_oai_req_free(&oq);
    if (g) group_unref(g);
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

/* The body's error (e) as the answer to h. */
static void answer_error(km_http_req *h, const rt_oai_err *e)
{
    km_buf b = {0};
    rt_oai_error_json(&b, e);
    km_http_respond(h, e->status, "application/json", NULL, b.data, b.len);
    km_buf_free(&b);
}

/* Prompts /tokenize takes: tokenized on the loop, so bounded well below --max-prompt-bytes. */
#define RT_TOKENIZE_MAX_BYTES (64u << 10)

/* POST /tokenize (vLLM's): the prompt's (or the rendered chat's) token ids. */
static void on_tokenize(km_http_req *h, void *user)
{
    rt_router *r = user;
    km_apikey_match key;
    bool keyed;
    if (!http_auth(r, h, KM_ROLE_CLIENT | KM_ROLE_OPERATOR, &key, &keyed)) return;
    size_t blen;
    const char *body = km_http_body(h, &blen);
    rt_oai_tokreq tq;
    rt_oai_err e;
    if (rt_oai_parse_tokenize(body, blen, &tq, &e)) return answer_error(h, &e);
    size_t len = 0;
    char *text = prompt_text(r, &tq.q, tq.q.chat, tq.add_generation_prompt, &len);
    rt_oai_req_free(&tq.q);
    if (!text) return http_error(h, 500, "server_error", NULL, "cannot render the prompt");
    if (len > RT_TOKENIZE_MAX_BYTES) {
        free(text);
        char m[120];
        snprintf(m, sizeof m, "/tokenize takes prompts of at most %u bytes", RT_TOKENIZE_MAX_BYTES);
        return http_error(h, 413, "invalid_request_error", "prompt", m);
    }
    int cap = (int)len + 8;
    int32_t *ids = malloc(sizeof *ids * (size_t)cap);
    int n = ids ? md_tok_encode(r->tok, text, len, tq.add_special ? 1 : 0, 1, ids, cap) : -1;
    free(text);
    char **strs = n >= 0 && tq.return_token_strs ? calloc((size_t)n + 1, sizeof *strs) : NULL;
    for (int i = 0; strs && i < n; i++) {
        char p[KM_PROTO_MAX_PIECE];
        int w = md_tok_piece(r->tok, ids[i], 1, p, sizeof p);
        strs[i] = strndup(p, w > 0 && w <= (int)sizeof p ? (size_t)w : 0);
    }
    km_buf b = {0};
    if (n < 0 || n > cap || (tq.return_token_strs && !strs) ||
        rt_oai_tokenize_response(&b, ids, n, r->c.max_ctx, strs))
        http_error(h, 500, "server_error", NULL, "cannot tokenize the prompt");
    else
        km_http_respond(h, 200, "application/json", NULL, b.data, b.len);
    for (int i = 0; strs && i < n; i++) free(strs[i]);
    free(strs);
    free(ids);
    km_buf_free(&b);
}

/* POST /detokenize (vLLM's): token ids back to text. */
static void on_detokenize(km_http_req *h, void *user)
{
    rt_router *r = user;
    km_apikey_match key;
    bool keyed;
    if (!http_auth(r, h, KM_ROLE_CLIENT | KM_ROLE_OPERATOR, &key, &keyed)) return;
    size_t blen;
    const char *body = km_http_body(h, &blen);
    int32_t *ids;
    int n;
    rt_oai_err e;
    if (rt_oai_parse_detokenize(body, blen, md_tok_n_vocab(r->tok), &ids, &n, &e))
        return answer_error(h, &e);
    size_t len = 0;
    char *text = ids_text(r, ids, n, &len);
    free(ids);
    km_buf b = {0};
    if (!text || rt_oai_detokenize_response(&b, text, len))
        http_error(h, 500, "server_error", NULL, "out of memory");
    else
        km_http_respond(h, 200, "application/json", NULL, b.data, b.len);
    free(text);
    km_buf_free(&b);
}

/* GET /health (vLLM's liveness probe): 200, empty, no key needed. */
static void on_health(km_http_req *h, void *user)
{
    km_http_respond(h, 200, "text/plain", NULL, "", 0);
}

/* The router's HTTP API. GET admits HEAD; a path not here is 404, a method not listed 405 (with
 * Allow), both as OpenAI error objects. */
static const km_http_route front_routes[] = {
    {"/healthz", 0, on_healthz},
    {"/health", 0, on_health},
    {"/tokenize", KM_HTTP_POST, on_tokenize},
    {"/detokenize", KM_HTTP_POST, on_detokenize},
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
