/*
 * service_requests.c — the worker's requests in flight (service_internal.h): a `req` frame
 * becomes a scheduler request (its text prompt tokenized here, its stop strings kept), and the
 * scheduler's callbacks send its `tok` frames and its `done` or `err` back behind the envelope it
 * came with.
 *
 * Stop strings are matched on the detokenized text; a stream holds back the bytes that could
 * still be the start of one, so no token frame ever carries text a stop string later removes,
 * and `done.text` carries what was held back at the end (docs/protocol.md section 6).
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/service_internal.h"

/* ---------------------------------------------------------------- frames out */

static int wk_sreq_env(const wk_sreq *r, km_zframe *env)
{
    size_t off = 0;
    for (int i = 0; i < r->n_env; i++) {
        env[i] = (km_zframe){r->env + off, r->env_len[i]};
        off += r->env_len[i];
    }
    return r->n_env;
}

/* ---------------------------------------------------------------- requests in flight */

void wk_svc_sreq_free(wk_sreq *r)
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

wk_sreq *wk_svc_live_find(wk_service *s, const km_zframe *env, int n_env, uint64_t id)
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

/* A tok frame to the router: a generated token (prompt false) or a prompt token's
 * log-probability (prompt true); lp NULL when the request asked for none. */
static void wk_send_tok(wk_service *s, wk_sreq *r, int index, int32_t token, const char *text,
                        size_t text_len, bool prompt, const en_logprobs *lp)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_TOKEN);
    m.tok.id = r->id;
    m.tok.index = (uint32_t)index;
    m.tok.token = token;
    m.tok.text = text_len ? text : ""; /* the encoder reads text_len 0 as strlen(text) */
    m.tok.text_len = text_len;
    m.tok.prompt = prompt;
    if (lp) { /* -9999: OpenAI's stand-in for a probability of zero (msgpack takes -inf, JSON
               * does not) */
        m.tok.has_logprob = true;
        m.tok.logprob = lp->logprob > -9999.0f ? lp->logprob : -9999.0f;
        m.tok.top = (const km_token_value *)lp->top;
        m.tok.n_top = (uint32_t)lp->n_top;
    }
    if (!km_msg_encode(&m, &s->lim, &s->out, NULL)) {
        km_zframe env[WK_ENV_MAX];
        int n = wk_sreq_env(r, env);
        wk_svc_send(s, s->router, env, n, &s->out);
    }
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
    int w = md_detok_push(s->tok, &r->dt, token, piece, sizeof piece);
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
    if (r->stream) /* every token goes out, the one completing a stop string too */
        wk_send_tok(s, r, index, token, out, out_len, false, en_sched_logprobs(s->sched));
    return stop;
}

/* A prompt token's log-probability (req.prompt_logprobs): a tok frame with prompt set. */
static void wk_on_prompt_logprob(void *ctx, void *user, int pos, const en_logprobs *lp)
{
    wk_sreq *r = user;
    if (r->stream) wk_send_tok(ctx, r, pos, lp->token, "", 0, true, lp); /* as wk_on_token */
}

static void wk_on_done(void *ctx, void *user, km_finish finish, const en_sched_usage *u)
{
    wk_service *s = ctx;
    wk_sreq *r = user;
    km_msg m;
    km_msg_init(&m, KM_MSG_DONE);
    m.done.id = r->id;
    m.done.finish = finish;
    /* The bytes of an incomplete last character, unless a stop string ended the text first. */
    char tail[16];
    int w = md_detok_flush(&r->dt, tail, sizeof tail);
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
    m.done.draft_tokens = (uint32_t)u->draft_tokens;
    m.done.accepted_draft_tokens = (uint32_t)u->accepted_draft_tokens;
    m.done.chunk_tokens = (uint32_t)u->chunk_tokens;
    m.done.queue_ms = u->queue_ms;
    m.done.ttft_ms = u->ttft_ms;
    m.done.total_ms = u->total_ms;
    /* Metrics first: a client that has its done frame finds the request counted. */
    wk_outcome o = finish == KM_FINISH_CANCELED   ? WK_OUT_CANCELED
                   : finish == KM_FINISH_DEADLINE ? WK_OUT_DEADLINE
                                                  : WK_OUT_OK;
    km_counter_inc(s->s_req[o]);
    wk_svc_observe_end(s, u);
    km_zframe env[WK_ENV_MAX];
    int n = wk_sreq_env(r, env);
    if (!km_msg_encode(&m, &s->lim, &s->out, NULL)) wk_svc_send(s, s->router, env, n, &s->out);
    wk_live_remove(s, r);
    wk_svc_sreq_free(r);
}

static void wk_on_error(void *ctx, void *user, int code, const char *message,
                        const en_sched_usage *u)
{
    wk_service *s = ctx;
    wk_sreq *r = user;
    km_zframe env[WK_ENV_MAX];
    int n = wk_sreq_env(r, env);
    if (code == KM_CODE_TOO_LARGE) s->oom_errors++;
    km_counter_inc(s->s_req[code == KM_CODE_UNAVAILABLE ? WK_OUT_HANDED_BACK : WK_OUT_ERROR]);
    wk_svc_observe_end(s, u);
    wk_svc_send_error(s, s->router, env, n, r->id, code,
                      code == KM_CODE_UNAVAILABLE || code == KM_CODE_OVERLOADED ? 250 : 0, message);
    wk_live_remove(s, r);
    wk_svc_sreq_free(r);
}

void wk_svc_callbacks(wk_service *s, en_sched_cb *out)
{
    *out = (en_sched_cb){.on_token = wk_on_token,
                         .on_done = wk_on_done,
                         .on_error = wk_on_error,
                         .ctx = s,
                         .on_prompt_logprob = wk_on_prompt_logprob};
}

/* ---------------------------------------------------------------- requests in */

/* The names a router accepts too ("default": what kvm_request_init and the CLI send). */
static bool wk_model_matches(const wk_service *s, const char *name)
{
    return !strcmp(name, s->model_name) || !strcmp(name, s->model_base) ||
           !strcmp(name, "default") || (s->o.model_alias && !strcmp(name, s->o.model_alias));
}

/* The prompt's token ids: q's own, or its text tokenized into the service's buffer. Returns 0,
 * or a negative km_err after answering the sender. */
static int prompt_tokens(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                         const int32_t **toks, int *n_tok)
{
    *toks = q->tokens;
    *n_tok = (int)q->n_tokens;
    if (!q->prompt) return 0;
    size_t len = q->prompt_len ? q->prompt_len : strlen(q->prompt);
    int need = md_tok_encode(s->tok, q->prompt, len, 1, 1, s->tokbuf, s->tokcap);
    if (need > s->tokcap) {
        int32_t *nb = realloc(s->tokbuf, sizeof *nb * need);
        if (!nb) {
            wk_svc_send_error(s, s->router, env, n_env, q->id, KM_CODE_INTERNAL, 0,
                              "out of memory");
            return KM_ENOMEM;
        }
        s->tokbuf = nb;
        s->tokcap = need;
        need = md_tok_encode(s->tok, q->prompt, len, 1, 1, s->tokbuf, s->tokcap);
    }
    if (need < 1) {
        wk_svc_count_bad(s, WK_BAD_FIELD);
        wk_svc_send_error(s, s->router, env, n_env, q->id, KM_CODE_BAD_REQUEST, 0,
                          "req.prompt: empty after tokenization");
        return KM_EINVAL;
    }
    *toks = s->tokbuf;
    *n_tok = need;
    return 0;
}

/* A request in flight for q, behind a copy of its envelope (not yet live). */
static wk_sreq *sreq_new(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                         uint64_t now)
{
    wk_sreq *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->svc = s;
    r->id = q->id;
    r->stream = q->stream;
    r->arrival_ns = r->last_ns = now;
    r->live_idx = -1;
    md_detok_init(&r->dt);
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
    return r;
}

/* Refused before anything was queued: the sender gets an `err`, nothing else changes. */
static bool refused(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q)
{
    if (wk_svc_state(s) != KM_STATE_READY) {
        km_counter_inc(s->s_req[WK_OUT_REJECTED]);
        wk_svc_send_error(s, s->router, env, n_env, q->id, KM_CODE_UNAVAILABLE, 0,
                          wk_svc_state(s) == KM_STATE_DRAINING
                              ? "worker draining: send it elsewhere"
                              : "worker not ready");
        return true;
    }
    if (!wk_model_matches(s, q->model)) {
        char msg[KM_PROTO_MAX_MESSAGE];
        snprintf(msg, sizeof msg, "req.model: unknown model '%.256s' (this worker serves '%s')",
                 q->model, s->model_base);
        km_counter_inc(s->s_req[WK_OUT_REJECTED]);
        wk_svc_send_error(s, s->router, env, n_env, q->id, KM_CODE_NOT_FOUND, 0, msg);
        return true;
    }
    if (wk_svc_live_find(s, env, n_env, q->id)) {
        wk_svc_count_bad(s, WK_BAD_FIELD);
        wk_svc_send_error(s, s->router, env, n_env, q->id, KM_CODE_BAD_REQUEST, 0,
                          "req.id: a request with this id is already in flight");
        return true;
    }
    size_t env_total = 0;
    for (int i = 0; i < n_env; i++) env_total += env[i].len;
    if (n_env > WK_ENV_MAX || env_total > WK_ENV_BYTES) {
        wk_svc_count_bad(s, WK_BAD_PARTS);
        return true; /* cannot route a reply to it anyway */
    }
    return false;
}

int wk_svc_request_check(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                         const int32_t **toks, int *n_tok)
{
    if (refused(s, env, n_env, q)) return KM_EINVAL;
    return prompt_tokens(s, env, n_env, q, toks, n_tok);
}

void wk_svc_grammars_free(wk_service *s)
{
    for (int i = 0; i < 8; i++) {
        en_grammar_free(s->grammar[i]);
        free(s->grammar_src[i]);
        s->grammar[i] = NULL;
        s->grammar_src[i] = NULL;
    }
}

/* The compiled grammar of q's schema: one of the last few compiled (requests with the same schema
 * share it and its cache of masks), or compiled now. NULL with err filled when it is refused. */
static en_grammar *wk_grammar(wk_service *s, const char *src, km_errbuf *err)
{
    for (int i = 0; i < 8; i++)
        if (s->grammar_src[i] && !strcmp(s->grammar_src[i], src)) return s->grammar[i];
    en_grammar *g;
    if (en_grammar_compile(src, strlen(src), &g, err)) return NULL;
    char *copy = strdup(src);
    if (!copy) {
        en_grammar_free(g);
        km_errf(err, KM_ENOMEM, "out of memory");
        return NULL;
    }
    int at = s->grammar_next++ % 8; /* the requests using the one replaced hold references */
    en_grammar_free(s->grammar[at]);
    free(s->grammar_src[at]);
    s->grammar[at] = g;
    s->grammar_src[at] = copy;
    return g;
}

void wk_svc_admit(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                  const int32_t *toks, int n_tok, uint64_t now)
{
    km_errbuf gerr = {{0}};
    en_grammar *grammar = q->grammar ? wk_grammar(s, q->grammar, &gerr) : NULL;
    if (q->grammar && !grammar) {
        char msg[KM_PROTO_MAX_MESSAGE];
        /* a grammar extension's message names it ("grammar: ...", "regex: ...") */
        snprintf(msg, sizeof msg, "%s%s",
                 q->grammar[0] == '%' ? "" : "response_format: ", gerr.msg);
        wk_svc_count_bad(s, WK_BAD_FIELD);
        km_counter_inc(s->s_req[WK_OUT_REJECTED]);
        wk_svc_send_error(s, s->router, env, n_env, q->id, KM_CODE_BAD_REQUEST, 0, msg);
        return;
    }
    wk_sreq *r = sreq_new(s, env, n_env, q, now);
    if (!r) {
        wk_svc_send_error(s, s->router, env, n_env, q->id, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    en_sched_req sq = {
        .tokens = toks,
        .n_tokens = n_tok,
        .max_tokens = (int)q->max_tokens,
        .priority = q->priority,
        .tenant = km_cache_salt_tenant(q->cache_salt),
        .deadline_ns = q->deadline_ms ? now + wk_ms_ns(q->deadline_ms) : 0,
        .arrival_ns = now,
        .cache_salt = q->cache_salt,
        .cache_salt_len = q->cache_salt ? strlen(q->cache_salt) : 0,
        .speculate = q->speculate == KM_SPECULATE_OFF    ? EN_SPEC_OFF
                     : q->speculate == KM_SPECULATE_AUTO ? EN_SPEC_AUTO
                     : q->speculate == KM_SPECULATE_SELF ? EN_SPEC_SELF
                                                         : EN_SPEC_DEFAULT,
        .max_draft = (int)q->max_draft_tokens,
        .n_generated = (int)q->generated,
        .grammar = grammar,
        .user = r,
    };
    /* the two segment layouts are one: the scheduler copies the chunks at submit */
    _Static_assert(sizeof(km_chunk_seg) == sizeof(en_blend_seg) &&
                       offsetof(km_chunk_seg, n) == offsetof(en_blend_seg, n),
                   "km_chunk_seg and en_blend_seg differ");
    sq.chunks = (const en_blend_seg *)q->chunks;
    sq.n_chunks = (int)q->n_chunks;
    en_sample_params_default(&sq.sample);
    sq.sample.temperature = q->temperature;
    sq.sample.top_k = q->top_k;
    sq.sample.top_p = q->top_p;
    sq.sample.min_p = q->min_p;
    sq.sample.repeat_penalty = q->repeat_penalty;
    sq.sample.repeat_last_n = q->repeat_last_n > 0 ? q->repeat_last_n : 64;
    sq.sample.presence_penalty = q->presence_penalty;
    sq.sample.frequency_penalty = q->frequency_penalty;
    sq.sample.seed = q->has_seed ? q->seed : (now ^ (q->id * 0x9e3779b97f4a7c15ull));
    /* the two (id, number) pairs are one layout: the sampler copies the bias at submit */
    _Static_assert(sizeof(km_token_value) == sizeof(en_token_value) &&
                       offsetof(km_token_value, value) == offsetof(en_token_value, value),
                   "km_token_value and en_token_value differ");
    sq.sample.bias = (const en_token_value *)q->logit_bias;
    sq.sample.n_bias = (int)q->n_logit_bias;
    sq.sample.logprobs = q->logprobs;
    sq.sample.top_logprobs = (int)q->top_logprobs;
    sq.prompt_logprobs = q->logprobs && q->prompt_logprobs;
    int rc = en_sched_submit(s->sched, &sq, &r->rid);
    if (rc) {
        int code = km_proto_code_from_err(rc);
        char fit[128]; /* the counts, as the HTTP front's 413 gives them */
        snprintf(fit, sizeof fit, "prompt of %d tokens exceeds the limit of %d (context %d)", n_tok,
                 (int)s->o.sched.max_ctx - 1, (int)s->o.sched.max_ctx);
        const char *msg = rc == KM_EOVERLOAD ? "queue full"
                          : rc == KM_ERANGE  ? fit
                          : rc == KM_EINVAL && grammar
                              ? "req.tokens: outside the vocabulary, or generated tokens that do "
                                "not fit the grammar"
                          : rc == KM_EINVAL ? "req.tokens: token id outside the vocabulary"
                                            : km_strerror(rc);
        if (rc == KM_EINVAL) wk_svc_count_bad(s, WK_BAD_FIELD);
        km_counter_inc(s->s_req[WK_OUT_REJECTED]);
        wk_svc_send_error(s, s->router, env, n_env, q->id, code, rc == KM_EOVERLOAD ? 250 : 0, msg);
        wk_svc_sreq_free(r);
        return;
    }
    if (s->n_live == s->cap_live) {
        int cap = s->cap_live ? s->cap_live * 2 : 256;
        wk_sreq **nl = realloc(s->live, sizeof *nl * cap);
        if (!nl) {
            en_sched_cancel(s->sched, r->rid); /* ends through the callbacks */
            return;
        }
        s->live = nl;
        s->cap_live = cap;
    }
    r->live_idx = s->n_live;
    s->live[s->n_live++] = r;
}
