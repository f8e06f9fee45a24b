/*
 * prompt.c — a text prompt becomes token ids without ever blocking the router's loop
 * (internal.h): its size is checked in bytes before anything else, a short prompt is tokenized
 * on the loop, a long one on libuv's thread pool, and the request starts (rt_rq_start) when its
 * tokens are back; an HTTP request's context check and stream begin first (rt_front_tokens_ready).
 *
 * Why: the loop relays every token of every stream and answers every client; tokenizing a 4 MB
 * one-word prompt took it 3.8 s (twice, once to size the buffer), and with six of them in flight
 * an unrelated 2-token request waited 9.4 s (issue 12). Now:
 *  - bytes over --max-prompt-bytes are refused (413) before tokenization: no prompt that size
 *    fits any context, and refusing it costs nothing;
 *  - up to RT_TOK_LOOP_BYTES the tokenizer runs inline (microseconds: cheaper than a thread
 *    hop, and a short request never queues behind long ones on the pool);
 *  - longer prompts go to the thread pool (uv_queue_work; the tokenizer is read-only, so
 *    concurrent encodes are safe), once, into a buffer sized from the byte count (a token
 *    covers at least one byte; specials add at most a few ids).
 * While its prompt is on the pool the request is in the table (it has its router id) with
 * q->tokjob set: a client cancel, an HTTP disconnect or the router's shutdown ends it there and
 * detaches the job, whose result is then thrown away.
 */
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"

/* Prompts up to this many bytes are tokenized on the loop. */
#define RT_TOK_LOOP_BYTES 8192

/* Tokens of text into a buffer with room for the completion too (q->cap). */
static int encode(const md_tokenizer *tok, const char *text, size_t len, int add_special,
                  int32_t **out, int *cap)
{
    if (len > (size_t)(INT32_MAX / 2)) return KM_ERANGE;
    *cap = (int)len + 72; /* ids <= bytes + specials, and 64 tokens of completion to start */
    *out = malloc(sizeof **out * (size_t)*cap);
    if (!*out) return KM_ENOMEM;
    int n = md_tok_encode(tok, text, len, add_special, 1, *out, *cap);
    if (n > *cap) n = KM_EINVAL; /* not expected: a token never covers less than a byte */
    return n;
}

static void tok_work(uv_work_t *w)
{
    rt_tokjob *j = w->data;
    j->n = encode(j->r->tok, j->text, j->len, j->add_special, &j->tokens, &j->cap);
}

/* Everything after the prompt is in q->tokens: the chain, the key, then dispatch. */
int rt_rq_start(rt_router *r, rt_rq *q)
{
    if (q->n_prompt <= 0) {
        rt_rq_fail(r, q, KM_CODE_BAD_REQUEST, 0, "the prompt is empty after tokenization");
        return KM_EINVAL;
    }
    if ((uint32_t)q->n_prompt > r->lim.max_prompt_tok) {
        char m[160];
        snprintf(m, sizeof m, "prompt of %d tokens exceeds the limit of %u", q->n_prompt,
                 r->lim.max_prompt_tok);
        rt_rq_fail(r, q, KM_CODE_TOO_LARGE, 0, m);
        return KM_ERANGE;
    }
    km_pagehash seed = km_pagehash_seed(r->fp, strlen(r->fp), r->c.cluster_seed, q->salt,
                                        q->salt ? strlen(q->salt) : 0);
    int np = q->n_prompt / r->c.page_tokens;
    q->chain = malloc(sizeof *q->chain * (size_t)(np ? np : 1));
    if (!q->chain) {
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
        return KM_ENOMEM;
    }
    q->n_chain =
        np ? km_pagehash_chain(seed, q->tokens, q->n_prompt, r->c.page_tokens, q->chain, np) : 0;
    /* the rendezvous key: the first page, or (a prompt shorter than a page) its tokens */
    q->key = q->n_chain > 0 ? q->chain[0] : km_pagehash_next(seed, q->tokens, q->n_prompt);
    if (!q->max_tokens) q->max_tokens = r->c.default_max_tokens;
    q->load = rt_fair_tenant(r, q->tenant);
    if (!q->rid) { /* a prompt tokenized on the thread pool is in the table already */
        q->rid = ++r->next_rid;
        rt_rq_link(r, q);
    }
    r->n_requests++;
    return rt_dispatch(r, q, false);
}

/* OpenAI's context check, with its counts: a prompt that leaves no room in the context, or one
 * whose max_tokens asked for more than is left, is 400 context_length_exceeded (the workers
 * would otherwise cap the completion silently). True when it answered. */
static bool over_context(rt_router *r, km_http_req *h, const rt_rq *q, uint32_t asked, bool chat)
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
    km_buf b = {0};
    rt_oai_error_json(&b, &e);
    km_http_respond(h, e.status, "application/json", NULL, b.data, b.len);
    km_buf_free(&b);
    return true;
}

void rt_rq_oai_meta(rt_router *r, rt_rq *q, rt_oai_meta *m, const char *worker)
{
    m->chat = q->http_chat;
    m->id = q->oai_id;
    m->model = r->model_name;
    m->created = q->created;
    m->worker = worker;
}

void rt_front_stream_begin(rt_router *r, rt_rq *q)
{
    if (!q->http || !q->http_stream || q->http_began) return;
    km_http_stream_begin(q->http, 200, "text/event-stream");
    q->http_began = true;
    if (q->http_chat) {
        rt_oai_meta m;
        km_buf b = {0};
        rt_rq_oai_meta(r, q, &m, NULL);
        if (!rt_oai_sse_chunk(&b, &m, NULL, 0, NULL)) km_http_stream_write(q->http, b.data, b.len);
        km_buf_free(&b);
    }
}

int rt_front_tokens_ready(rt_router *r, rt_rq *q)
{
    if (over_context(r, q->http, q, q->max_tokens, q->http_chat)) {
        rt_rq_end(r, q);
        return 1;
    }
    /* A constrained stream begins at its first token: a schema the worker refuses is then
     * still a plain 400 (the router leaves judging schemas to the worker's compiler). */
    if (!q->grammar) rt_front_stream_begin(r, q);
    return 0;
}

/* The tokens are in q (or the encode failed): the request goes on, or ends with an error. */
static void start_with(rt_router *r, rt_rq *q, int n, int32_t *tokens, int cap)
{
    if (n < 0) {
        free(tokens);
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "cannot tokenize the prompt");
        return;
    }
    q->tokens = tokens;
    q->cap = cap;
    q->n_prompt = n;
    if (q->fops->origin == RQ_HTTP && rt_front_tokens_ready(r, q)) return; /* answered: too long */
    rt_rq_start(r, q);
}

static void tok_after(uv_work_t *w, int status)
{
    rt_tokjob *j = w->data;
    rt_rq *q = j->q;
    rt_router *r = j->r;
    free(j->text);
    if (q) q->tokjob = NULL;
    if (!q || status || r->stopping) { /* the request ended meanwhile, or the router stops */
        free(j->tokens);
        free(j);
        if (q) rt_rq_fail(r, q, KM_CODE_UNAVAILABLE, 0, "router shutting down");
        return;
    }
    int n = j->n, cap = j->cap;
    int32_t *tokens = j->tokens;
    free(j);
    start_with(r, q, n, tokens, cap);
    rt_pump(r);
}

void rt_rq_prepare(rt_router *r, rt_rq *q, char *text, size_t len, int add_special)
{
    if (r->c.max_prompt_bytes && len > r->c.max_prompt_bytes) {
        char m[160];
        snprintf(m, sizeof m, "prompt of %zu bytes exceeds the limit of %zu bytes", len,
                 r->c.max_prompt_bytes);
        free(text);
        rt_rq_fail(r, q, KM_CODE_TOO_LARGE, 0, m);
        return;
    }
    if (len <= RT_TOK_LOOP_BYTES) {
        int32_t *tokens = NULL;
        int cap = 0;
        int n = encode(r->tok, text, len, add_special, &tokens, &cap);
        free(text);
        km_counter_inc(r->s_tok_loop);
        start_with(r, q, n, tokens, cap);
        return;
    }
    rt_tokjob *j = calloc(1, sizeof *j);
    if (!j) {
        free(text);
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    *j = (rt_tokjob){.r = r, .q = q, .text = text, .len = len, .add_special = add_special};
    j->work.data = j;
    /* in the table meanwhile, so that a cancel or a disconnect finds it */
    q->rid = ++r->next_rid;
    rt_rq_link(r, q);
    q->tokjob = j;
    if (uv_queue_work(&r->loop, &j->work, tok_work, tok_after)) {
        q->tokjob = NULL;
        free(j->text);
        free(j);
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "cannot queue the prompt's tokenization");
        return;
    }
    km_counter_inc(r->s_tok_pool);
}
