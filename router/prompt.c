/*
 * prompt.c — a text prompt becomes token ids without ever blocking the router's loop
 * (internal.h): its size is checked in bytes before anything else, a short prompt is tokenized
 * on the loop, a long one on libuv's thread pool, and the request starts (rt_rq_start) when its
 * tokens are back; an HTTP request's context check and stream begin first (its front's
 * tokens_ready).
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

/* As encode, piece by piece: the text is cut at the edges of the chunks (byte spans, turned into
 * token spans here), so a chunk's ids are those of its text alone wherever it appears
 * (openai_chunks.c says why). */
static int encode_pieces(const md_tokenizer *tok, const char *text, size_t len, int add_special,
                         km_chunk_seg *c, uint32_t n_c, int32_t **out, int *cap)
{
    if (!n_c) return encode(tok, text, len, add_special, out, cap);
    if (len > (size_t)(INT32_MAX / 2)) return KM_ERANGE;
    *cap = (int)len + 72;
    if (!(*out = malloc(sizeof **out * (size_t)*cap))) return KM_ENOMEM;
    int n = 0;
    if (add_special && md_tok_adds_bos(tok) && md_tok_bos(tok) >= 0) (*out)[n++] = md_tok_bos(tok);
    size_t at = 0;
    for (uint32_t i = 0; i <= n_c; i++) {
        size_t to = i < n_c ? c[i].start : len; /* the text before chunk i, then chunk i */
        for (int half = 0; half < 2; half++) {
            if (to > at) {
                int m = md_tok_encode(tok, text + at, to - at, 0, 1, *out + n, *cap - n);
                if (m < 0 || m > *cap - n) return m < 0 ? m : KM_EINVAL;
                if (half) c[i].start = (uint32_t)n, c[i].n = (uint32_t)m;
                n += m;
            }
            at = to;
            if (i == n_c) break;
            to = c[i].start + (size_t)c[i].n;
        }
    }
    return n;
}

static void tok_work(uv_work_t *w)
{
    rt_tokjob *j = w->data;
    j->n = encode_pieces(j->r->tok, j->text, j->len, j->add_special, j->chunks, j->n_chunks,
                         &j->tokens, &j->cap);
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
    if (rt_chunk_chains(r, q, seed)) {
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
        return KM_ENOMEM;
    }
    /* the rendezvous key: the first page, or (a prompt shorter than a page) its tokens */
    q->key = q->n_chain > 0 ? q->chain[0] : km_pagehash_next(seed, q->tokens, q->n_prompt);
    if (!q->max_tokens) q->max_tokens = r->c.default_max_tokens;
    q->load = rt_fair_tenant(r, q->tenant);
    if (!q->rid) { /* a prompt tokenized on the thread pool is in the table already */
        q->rid = ++r->next_rid;
        rt_rq_link(r, q);
    }
    r->n_requests++;
    uint32_t wait_ms = rt_fair_admit(r, q);
    if (wait_ms) {
        char msg[160];
        snprintf(msg, sizeof msg,
                 "rate limit: this key's tenant used more than %g tokens/s "
                 "(--max-tokens-per-sec-per-key)",
                 r->c.max_tokens_per_sec_per_key);
        rt_rq_fail(r, q, KM_CODE_RATE_LIMIT, wait_ms, msg);
        return KM_EOVERLOAD;
    }
    return rt_dispatch(r, q, false);
}

static int token_piece(void *ctx, int32_t id, char *buf, int cap)
{
    const rt_router *r = ctx;
    return md_tok_piece(r->tok, id, 1, buf, cap);
}

void rt_rq_oai_meta(rt_router *r, rt_rq *q, rt_oai_meta *m, const char *worker)
{
    *m = (rt_oai_meta){.chat = q->http_chat,
                       .id = q->oai_id,
                       .model = r->model_name,
                       .created = q->created,
                       .worker = worker,
                       .piece = token_piece,
                       .piece_ctx = r,
                       .text_offset = q->echo_len,
                       .index = q->choice};
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
    if (q->fops->tokens_ready && q->fops->tokens_ready(r, q)) return; /* answered: too long */
    rt_rq_start(r, q);
}

static void tok_after(uv_work_t *w, int status)
{
    rt_tokjob *j = w->data;
    rt_rq *q = j->q;
    rt_router *r = j->r;
    free(j->text);
    if (q) q->tokjob = NULL;
    if (q && j->chunks) memcpy(q->chunks, j->chunks, sizeof *q->chunks * j->n_chunks);
    if (q) q->chunk_bytes = false;
    free(j->chunks);
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
    const uint32_t n_c = q->chunk_bytes ? q->q.n_chunks : 0;
    if (len <= RT_TOK_LOOP_BYTES) {
        int32_t *tokens = NULL;
        int cap = 0;
        int n = encode_pieces(r->tok, text, len, add_special, q->chunks, n_c, &tokens, &cap);
        q->chunk_bytes = false;
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
    if (n_c && !(j->chunks = malloc(sizeof *j->chunks * n_c))) {
        free(text);
        free(j);
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    if (n_c) memcpy(j->chunks, q->chunks, sizeof *j->chunks * n_c), j->n_chunks = n_c;
    j->work.data = j;
    /* in the table meanwhile, so that a cancel or a disconnect finds it */
    q->rid = ++r->next_rid;
    rt_rq_link(r, q);
    q->tokjob = j;
    if (uv_queue_work(&r->loop, &j->work, tok_work, tok_after)) {
        q->tokjob = NULL;
        free(j->text);
        free(j->chunks);
        free(j);
        rt_rq_fail(r, q, KM_CODE_INTERNAL, 0, "cannot queue the prompt's tokenization");
        return;
    }
    km_counter_inc(r->s_tok_pool);
}
