/*
 * openai.h — the OpenAI layer of the router's HTTP front, private to router/ (openai.c): JSON in
 * and out of /v1/completions and /v1/chat/completions with jansson. docs/openai.md is the API.
 */
#ifndef RT_OPENAI_H
#define RT_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/svc.h"

/* ---------------------------------------------------------------- OpenAI layer (openai.c)
 * JSON in and out of the HTTP API (jansson): request bodies into a generation spec, token
 * streams into chunk objects and SSE events, errors into OpenAI's error shape. */

typedef struct rt_oai_msg {
    char *role, *content;
    bool chunk; /* extension "kvmesh_chunk": the content is a chunk (openai_chunks.c) */
} rt_oai_msg;

/* One prompt of a completions request: text, or token ids (text NULL). */
typedef struct rt_oai_prompt {
    char *text;
    int32_t *ids;
    int n_ids;
} rt_oai_prompt;

/* Most prompts one completions request may list (the router's --max-n bounds prompts x n). */
#define RT_OAI_MAX_PROMPTS 128
/* Most alternatives per token (top_logprobs, completions' logprobs), as OpenAI. */
#define RT_OAI_MAX_TOP 20

typedef struct rt_oai_req {
    bool chat;              /* /v1/chat/completions */
    char *model;            /* NULL: the router's model */
    rt_oai_prompt *prompts; /* completions: one or more ("prompt" as a list: one choice each) */
    int n_prompts;
    rt_oai_msg *msgs; /* chat */
    int n_msgs;
    int n;                 /* choices per prompt, 1.. (the router bounds prompts x n by --max-n) */
    bool echo;             /* completions: the prompt's text comes before the completion's */
    bool logprobs;         /* per-token log-probabilities of the chosen tokens */
    uint32_t top_logprobs; /* and this many most likely alternatives (0..RT_OAI_MAX_TOP) */
    km_token_value *logit_bias; /* token id -> bias in [-100, 100] */
    int n_logit_bias;
    uint32_t max_tokens; /* 0: absent, the router's default (an explicit 0 is refused) */
    float temperature, top_p, min_p, presence_penalty, frequency_penalty, repeat_penalty;
    int32_t top_k;
    bool has_seed;
    uint64_t seed;
    char *stop[KM_PROTO_MAX_STOP];
    int n_stop;
    bool stream, include_usage;
    char *cache_salt; /* "user" or the extension "cache_salt" */
    int32_t priority;
    km_speculate speculate;    /* extension "speculate": "auto" or "off" (docs/speculative.md) */
    uint32_t max_draft_tokens; /* extension "max_draft_tokens"; 0: the worker's */
    char *grammar; /* response_format json_object/json_schema: the JSON Schema text; NULL: free */
    char *tool_names;  /* tools the reply may call, each name then '\n'; NULL: no tools */
    bool tool_several; /* the reply may be an array of calls (parallel_tool_calls) */
    /* completions, extension "kvmesh": {"chunks": [[start, length], ...]}: spans of the one
     * prompt, in tokens (ids) or bytes (text); NULL: none (openai_chunks.c) */
    km_chunk_seg *chunks;
    int n_chunks;
} rt_oai_req;

typedef struct rt_oai_err {
    int status; /* HTTP status */
    char message[512];
    const char *type;  /* "invalid_request_error", "server_error", ... */
    const char *param; /* offending field or NULL */
    const char *code;  /* machine code or NULL */
} rt_oai_err;

/* Parses a request body. 0 or KM_EFORMAT/KM_EINVAL with e filled (status 400). */
int rt_oai_parse(const char *body, size_t len, bool chat, rt_oai_req *out, rt_oai_err *e);
void rt_oai_req_free(rt_oai_req *r);
struct json_t;
/* response_format of a request body (openai_tools.c) into r->grammar; 0 or KM_EINVAL with e
 * filled (status 400), KM_ENOMEM. */
int rt_oai_response_format(struct json_t *body, rt_oai_req *r, rt_oai_err *e);
/* tools, tool_choice and parallel_tool_calls (openai_tools.c, after the messages and
 * response_format): the functions told to the model in a system turn, r->tool_names set, and
 * for tool_choice required or a named function r->grammar holding the output to a call; the
 * messages' tool turns and assistant tool_calls rendered as text. 0 or KM_EINVAL (e, 400). */
int rt_oai_tools(struct json_t *body, rt_oai_req *r, rt_oai_err *e);
/* "kvmesh": {"chunks": ...} of a completions request into r->chunks, checked against its prompt
 * (chat: refused; messages carry "kvmesh_chunk"). 0 or KM_EINVAL (e, 400), KM_ENOMEM. */
int rt_oai_chunks(struct json_t *body, rt_oai_req *r, rt_oai_err *e);
/* n segments against a prompt of `size` tokens (text NULL) or bytes of text: 0 or KM_EINVAL
 * with e filled (400, param named), saying which segment and why. */
int rt_oai_chunks_check(const km_chunk_seg *c, int n, size_t size, const char *text,
                        const char *param, rt_oai_err *e);
/* The byte spans of a chat's chunk messages in its rendered text (each content where the
 * template wrote it; one not found verbatim is left out): *out malloc'd, NULL when none. 0,
 * KM_ERANGE (too many) or KM_ENOMEM. */
int rt_oai_chat_chunks(const rt_oai_req *r, const char *text, size_t len, km_chunk_seg **out,
                       int *n_out);

/* One generated token's log-probabilities, as its worker computed them. */
typedef struct rt_oai_lp {
    int32_t token;
    float logprob;
    uint32_t n_top;
    km_token_value top[RT_OAI_MAX_TOP]; /* most likely first */
} rt_oai_lp;

/* The bytes of a token (md_tok_piece's contract: the count, which may exceed cap). */
typedef int (*rt_oai_piece_fn)(void *ctx, int32_t id, char *buf, int cap);

/* What the response objects say besides the text. */
typedef struct rt_oai_meta {
    bool chat;
    const char *id; /* "cmpl-..." / "chatcmpl-..." */
    const char *model;
    int64_t created;    /* unix seconds */
    const char *worker; /* extension field "kvmesh": {"worker": ...}; NULL = omitted */
    /* The choice's logprobs object (chat: content[], completions: tokens[] ...) for these
     * tokens; NULL: "logprobs": null. */
    const rt_oai_lp *lp;
    int n_lp;
    rt_oai_piece_fn piece;
    void *piece_ctx;
    size_t text_offset; /* completions: text_offset of lp[0] */
    int index;          /* the choice's index (n > 1, several prompts) */
} rt_oai_meta;

/* One choice of a whole response (rt_oai_response_choices). */
typedef struct rt_oai_choice {
    const char *text;
    size_t len;
    const char *finish;
    const rt_oai_lp *lp; /* NULL: "logprobs": null */
    int n_lp;
    size_t text_offset;
    struct json_t *tool_calls; /* chat: message.tool_calls (content null); NULL: none */
} rt_oai_choice;

typedef struct rt_oai_usage {
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    uint32_t draft_tokens, accepted_draft_tokens; /* speculative decoding; 0: none drafted */
    uint32_t chunk_tokens; /* prompt tokens reused from cached chunks (docs/blend.md) */
} rt_oai_usage;

/* One SSE event "data: {chunk}\n\n" with a text delta (finish NULL) or a finish reason. */
int rt_oai_sse_chunk(km_buf *out, const rt_oai_meta *m, const char *text, size_t len,
                     const char *finish);
/* The usage chunk of stream_options.include_usage (choices: []). */
int rt_oai_sse_usage(km_buf *out, const rt_oai_meta *m, const rt_oai_usage *u);
/* "data: [DONE]\n\n" */
int rt_oai_sse_done(km_buf *out);
/* An SSE event carrying an error object (a stream that fails after it began). */
int rt_oai_sse_error(km_buf *out, const rt_oai_err *e);
/* The whole non-streaming response. */
int rt_oai_response(km_buf *out, const rt_oai_meta *m, const char *text, size_t len,
                    const char *finish, const rt_oai_usage *u);
/* The whole non-streaming response with n choices (index i for c[i]); m's lp is not used. */
int rt_oai_response_choices(km_buf *out, const rt_oai_meta *m, const rt_oai_choice *c, int n,
                            const rt_oai_usage *u);
/* {"error": {"message", "type", "param", "code"}} */
int rt_oai_error_json(km_buf *out, const rt_oai_err *e);
/* An error the HTTP server answers by itself (404, 405, 413, ...) as OpenAI's error object
 * (type invalid_request_error, or server_error from 500 on); a km_http_error_fn (common/http.h):
 * returns the content type. */
const char *rt_oai_http_error(int status, const char *message, km_buf *out);
/* /v1/models, and one model's object (/v1/models/{id}) */
int rt_oai_models(km_buf *out, const char *model, int64_t created);
int rt_oai_model(km_buf *out, const char *model, int64_t created);
/* POST /tokenize (vLLM's shape): {"prompt": string} or {"messages": [...]} (rendered with the
 * chat template, add_generation_prompt default true), add_special_tokens (default: true for a
 * prompt, false for messages, whose template carries its own), return_token_strs. */
typedef struct rt_oai_tokreq {
    rt_oai_req q; /* q.chat: messages; else q.prompt */
    bool add_special, add_generation_prompt, return_token_strs;
} rt_oai_tokreq;
int rt_oai_parse_tokenize(const char *body, size_t len, rt_oai_tokreq *out, rt_oai_err *e);
/* {"count", "max_model_len", "tokens"[, "token_strs"]}; strs NULL: no token_strs. */
int rt_oai_tokenize_response(km_buf *out, const int32_t *ids, int n, uint32_t max_model_len,
                             char *const *strs);
/* POST /detokenize: {"tokens": [ids]} into *ids (malloc'd; each in [0, n_vocab)). */
int rt_oai_parse_detokenize(const char *body, size_t len, int n_vocab, int32_t **ids, int *n,
                            rt_oai_err *e);
/* {"prompt": text} */
int rt_oai_detokenize_response(km_buf *out, const char *text, size_t len);

/* The HTTP status and error type for a protocol error code (529 -> 429 rate_limit_exceeded...). */
void rt_oai_err_from_code(int code, const char *message, rt_oai_err *e);
/* The OpenAI finish_reason for a km_finish ("stop", "length"). */
const char *rt_oai_finish(km_finish f);

/* The tool_calls array (a new reference) when text is a call {"name", "arguments"} of one of
 * names, or (several) an array of 1 to RT_OAI_MAX_CALLS such calls; NULL otherwise. id: the
 * response's, which the calls' ids are made from. */
#define RT_OAI_MAX_CALLS 8
struct json_t *rt_oai_tool_calls(const char *text, size_t len, const char *names, bool several,
                                 const char *id);
/* A response object made by rt_oai_response (sse 0; finish_reason tool_calls) or an SSE chunk
 * made by rt_oai_sse_chunk (sse 1) with the calls put in: message.content null and
 * message.tool_calls, or delta.tool_calls; appended to out. */
int rt_oai_tool_patch(const km_buf *src, int sse, struct json_t *calls, km_buf *out);

#endif /* RT_OPENAI_H */
