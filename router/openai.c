/*
 * openai.c — the JSON of the router's OpenAI-compatible API (router.h, "OpenAI layer";
 * docs/openai.md): request bodies of /v1/completions and /v1/chat/completions into a generation
 * spec, and the response objects back: whole responses, SSE chunks, usage (with cached prompt
 * tokens), /v1/models and errors in OpenAI's shape.
 *
 * Why it is built this way: JSON goes through jansson (a maintained library, Debian's
 * libjansson-dev), never string pasting, so escaping is always right; this file knows nothing of
 * sockets, so its tests are plain input/output checks. Model text is UTF-8 from the tokenizer,
 * but a byte-level vocabulary can produce invalid sequences (a stream cut inside a character),
 * and jansson refuses those: text is sanitised here (invalid bytes become U+FFFD) before it is
 * put in JSON. Unknown request fields are ignored, as OpenAI does; fields that ask for something
 * the server cannot do (suffix, best_of > 1) are a 400 that names the field.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/openai.h"

/* ---------------------------------------------------------------- helpers */

static int fail(rt_oai_err *e, const char *param, const char *fmt, const char *arg)
{
    e->status = 400;
    e->type = "invalid_request_error";
    e->param = param;
    e->code = NULL;
    if (arg) /* fmt has one %s */
        snprintf(e->message, sizeof e->message, fmt, arg);
    else
        snprintf(e->message, sizeof e->message, "%s", fmt);
    return KM_EFORMAT;
}

/* Copies s (n bytes) replacing invalid UTF-8 with U+FFFD; NULL on out of memory. */
static char *utf8_clean(const char *s, size_t n, size_t *out_len)
{
    char *o = malloc(n * 3 + 1);
    if (!o) return NULL;
    size_t j = 0;
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + (size_t)len <= n && c != 0;
        for (int k = 1; ok && k < len; k++) ok = (p[i + k] & 0xc0) == 0x80;
        if (ok && len == 2) ok = c >= 0xc2;
        if (ok && len == 3) {
            unsigned v = ((c & 0x0f) << 12) | ((p[i + 1] & 0x3f) << 6) | (p[i + 2] & 0x3f);
            ok = v >= 0x800 && (v < 0xd800 || v > 0xdfff);
        }
        if (ok && len == 4) {
            unsigned v = ((c & 0x07) << 18) | ((p[i + 1] & 0x3f) << 12) | ((p[i + 2] & 0x3f) << 6) |
                         (p[i + 3] & 0x3f);
            ok = v >= 0x10000 && v <= 0x10ffff;
        }
        if (ok) {
            memcpy(o + j, p + i, (size_t)len);
            j += (size_t)len;
            i += (size_t)len;
        } else {
            memcpy(o + j, "\xef\xbf\xbd", 3);
            j += 3;
            i++;
        }
    }
    o[j] = 0;
    *out_len = j;
    return o;
}

static json_t *jstr(const char *s, size_t n)
{
    size_t m;
    char *c = utf8_clean(s ? s : "", s ? n : 0, &m);
    if (!c) return NULL;
    json_t *j = json_stringn(c, m);
    free(c);
    return j;
}

static char *dup_str(const json_t *v)
{
    return strndup(json_string_value(v), json_string_length(v));
}

static bool is_num(const json_t *v)
{
    return json_is_integer(v) || json_is_real(v);
}

static int get_float(json_t *o, const char *key, double lo, double hi, float *out, rt_oai_err *e)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!is_num(v)) return fail(e, key, "'%s' must be a number", key);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi) {
        char m[160];
        snprintf(m, sizeof m, "'%s' must be in [%g, %g]", key, lo, hi);
        return fail(e, key, "%s", m);
    }
    *out = (float)x;
    return 0;
}

static int get_int(json_t *o, const char *key, long long lo, long long hi, long long *out,
                   bool *present, rt_oai_err *e)
{
    json_t *v = json_object_get(o, key);
    if (present) *present = false;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v)) return fail(e, key, "'%s' must be an integer", key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi) {
        char m[160];
        snprintf(m, sizeof m, "'%s' must be in [%lld, %lld]", key, lo, hi);
        return fail(e, key, "%s", m);
    }
    *out = x;
    if (present) *present = true;
    return 0;
}

/* A message's content: a string, or an array of {"type":"text","text":...} parts. */
static char *content_text(json_t *c, rt_oai_err *e)
{
    if (json_is_string(c)) return dup_str(c);
    if (json_is_null(c)) return strdup("");
    if (!json_is_array(c)) {
        fail(e, "messages", "message content must be a string or an array of text parts", NULL);
        return NULL;
    }
    km_buf b = {0};
    size_t i;
    json_t *part;
    json_array_foreach(c, i, part)
    {
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") ||
            !json_is_string(text)) {
            km_buf_free(&b);
            fail(e, "messages", "only text content parts are supported", NULL);
            return NULL;
        }
        if (km_buf_append(&b, json_string_value(text), json_string_length(text))) {
            km_buf_free(&b);
            return NULL;
        }
    }
    char *s = strndup(b.data ? (const char *)b.data : "", b.len);
    km_buf_free(&b);
    return s;
}

/* ---------------------------------------------------------------- requests */

/* Token ids of a JSON array into p; false when one is not an id. */
static bool prompt_ids(json_t *a, rt_oai_prompt *p)
{
    size_t n = json_array_size(a);
    if (!n || !(p->ids = malloc(sizeof *p->ids * n))) return false;
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX)
            return false;
        p->ids[i] = (int32_t)json_integer_value(x);
    }
    p->n_ids = (int)n;
    return true;
}

/* "prompt": a string, an array of strings, an array of token ids, or an array of arrays of
 * token ids; each prompt of a list is a choice of its own. */
static int parse_prompts(json_t *v, rt_oai_req *r, rt_oai_err *e)
{
    static const char *const shape = "'prompt' must be a string, an array of strings, an array "
                                     "of token ids or an array of arrays of token ids";
    if (json_is_string(v)) {
        if (!(r->prompts = calloc(1, sizeof *r->prompts))) return KM_ENOMEM;
        r->n_prompts = 1;
        return (r->prompts[0].text = dup_str(v)) ? 0 : KM_ENOMEM;
    }
    if (!json_is_array(v) || json_array_size(v) == 0) return fail(e, "prompt", "%s", shape);
    json_t *first = json_array_get(v, 0);
    size_t n = json_is_integer(first) ? 1 : json_array_size(v);
    if (n > RT_OAI_MAX_PROMPTS)
        return fail(e, "prompt", "too many prompts in one request (limit 128)", NULL);
    if (!(r->prompts = calloc(n, sizeof *r->prompts))) return KM_ENOMEM;
    r->n_prompts = (int)n;
    if (json_is_integer(first))
        return prompt_ids(v, &r->prompts[0]) ? 0 : fail(e, "prompt", "%s", shape);
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        if (json_is_string(x) && json_is_string(first)) {
            if (!(r->prompts[i].text = dup_str(x))) return KM_ENOMEM;
        } else if (!json_is_array(x) || !json_is_array(first) || !prompt_ids(x, &r->prompts[i])) {
            return fail(e, "prompt", "%s", shape);
        }
    }
    return 0;
}

/* "logit_bias": {"token id": bias in [-100, 100], ...} */
static int parse_logit_bias(json_t *v, rt_oai_req *r, rt_oai_err *e)
{
    if (!v || json_is_null(v)) return 0;
    if (!json_is_object(v))
        return fail(e, "logit_bias", "'logit_bias' must map token ids to numbers", NULL);
    size_t n = json_object_size(v);
    if (n > KM_PROTO_MAX_BIAS)
        return fail(e, "logit_bias", "'logit_bias' has more than 1024 entries", NULL);
    if (!n) return 0;
    if (!(r->logit_bias = calloc(n, sizeof *r->logit_bias))) return KM_ENOMEM;
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x)
    {
        char *end;
        long id = strtol(k, &end, 10);
        if (!*k || *end || id < 0 || id > INT32_MAX)
            return fail(e, "logit_bias", "'logit_bias' key '%s' is not a token id", k);
        double b = is_num(x) ? json_number_value(x) : NAN;
        if (!(b >= -100 && b <= 100))
            return fail(e, "logit_bias", "'logit_bias' values must be numbers in [-100, 100]",
                        NULL);
        r->logit_bias[r->n_logit_bias++] = (km_token_value){(int32_t)id, (float)b};
    }
    return 0;
}

/* logprobs / top_logprobs (chat: a boolean and 0..20; completions: logprobs 0..20 alternatives)
 * and echo (completions), with what cannot go together. */
static int parse_logprobs(json_t *o, bool chat, rt_oai_req *r, rt_oai_err *e)
{
    json_t *v = json_object_get(o, "logprobs");
    long long x = 0;
    bool has = false;
    int rc;
    if (chat) {
        if (v && !json_is_null(v) && !json_is_boolean(v))
            return fail(e, "logprobs", "'logprobs' must be a boolean", NULL);
        r->logprobs = json_is_true(v);
        if ((rc = get_int(o, "top_logprobs", 0, RT_OAI_MAX_TOP, &x, &has, e))) return rc;
        if (has && !r->logprobs)
            return fail(e, "top_logprobs", "'top_logprobs' needs 'logprobs': true", NULL);
        r->top_logprobs = (uint32_t)x;
    } else {
        if ((rc = get_int(o, "logprobs", 0, RT_OAI_MAX_TOP, &x, &has, e))) return rc;
        r->logprobs = has;
        r->top_logprobs = (uint32_t)x;
        v = json_object_get(o, "echo");
        if (v && !json_is_null(v) && !json_is_boolean(v))
            return fail(e, "echo", "'echo' must be a boolean", NULL);
        r->echo = json_is_true(v);
        v = json_object_get(o, "suffix");
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return fail(e, "suffix",
                        "'suffix' is not supported by this server (no fill-in-the-middle)", NULL);
    }
    if ((rc = get_int(o, "n", 1, RT_OAI_MAX_PROMPTS, &x, &has, e))) return rc;
    r->n = has ? (int)x : 1;
    return parse_logit_bias(json_object_get(o, "logit_bias"), r, e);
}

void rt_oai_req_free(rt_oai_req *r)
{
    if (!r) return;
    free(r->model);
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    free(r->logit_bias);
    for (int i = 0; i < r->n_msgs; i++) {
        free(r->msgs[i].role);
        free(r->msgs[i].content);
    }
    free(r->msgs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->cache_salt);
    free(r->grammar);
    free(r->tool_names);
    free(r->chunks);
    memset(r, 0, sizeof *r);
}

static int parse_obj(json_t *o, bool chat, rt_oai_req *r, rt_oai_err *e)
{
    json_t *v;
    v = json_object_get(o, "model");
    if (v && !json_is_null(v)) {
        if (!json_is_string(v)) return fail(e, "model", "'model' must be a string", NULL);
        if (!(r->model = dup_str(v))) return KM_ENOMEM;
    }
    if (chat) {
        v = json_object_get(o, "messages");
        if (!json_is_array(v) || json_array_size(v) == 0)
            return fail(e, "messages", "'messages' must be a non-empty array", NULL);
        if (json_array_size(v) > 1024)
            return fail(e, "messages", "too many messages (limit 1024)", NULL);
        r->msgs = calloc(json_array_size(v), sizeof *r->msgs);
        if (!r->msgs) return KM_ENOMEM;
        size_t i;
        json_t *m;
        json_array_foreach(v, i, m)
        {
            json_t *role = json_object_get(m, "role");
            if (!json_is_object(m) || !json_is_string(role))
                return fail(e, "messages", "every message needs a string 'role'", NULL);
            const char *rs = json_string_value(role);
            if (!strcmp(rs, "developer")) rs = "system";
            if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") &&
                strcmp(rs, "tool"))
                return fail(e, "messages", "unsupported message role '%s'", rs);
            r->msgs[i].role = strdup(rs);
            r->n_msgs = (int)i + 1;
            /* OpenAI: an assistant turn with tool_calls may leave content out */
            json_t *c = json_object_get(m, "content");
            bool calls_only =
                !c && !strcmp(rs, "assistant") && json_array_size(json_object_get(m, "tool_calls"));
            r->msgs[i].content = calls_only ? strdup("") : content_text(c, e);
            json_t *ck = json_object_get(m, "kvmesh_chunk");
            if (ck && !json_is_boolean(ck) && !json_is_null(ck))
                return fail(e, "messages", "'kvmesh_chunk' must be true or false", NULL);
            r->msgs[i].chunk = json_is_true(ck);
            if (!r->msgs[i].content) return e->status ? KM_EFORMAT : KM_ENOMEM;
            if (!r->msgs[i].role) return KM_ENOMEM;
        }
    } else {
        int rc = parse_prompts(json_object_get(o, "prompt"), r, e);
        if (rc) return rc;
    }
    long long x = 0;
    bool has = false;
    int rc;
    /* structured outputs (openai_tools.c) */
    if ((rc = rt_oai_response_format(o, r, e))) return rc;
    if ((rc = rt_oai_tools(o, r, e))) return rc;
    if ((rc = rt_oai_chunks(o, r, e))) return rc;
    /* OpenAI refuses 0 (integer_below_min_value); absent is the router's default */
    static const char *const max_keys[] = {"max_tokens", "max_completion_tokens"};
    for (int i = 0; i < 2; i++) {
        if ((rc = get_int(o, max_keys[i], 1, 1 << 20, &x, &has, e))) {
            if (json_is_integer(json_object_get(o, max_keys[i])) &&
                json_integer_value(json_object_get(o, max_keys[i])) < 1)
                e->code = "integer_below_min_value";
            return rc;
        }
        if (has) r->max_tokens = (uint32_t)x;
    }
    if ((rc = get_float(o, "temperature", 0, 100, &r->temperature, e))) return rc;
    if ((rc = get_float(o, "top_p", 0, 1, &r->top_p, e))) return rc;
    if ((rc = get_float(o, "min_p", 0, 1, &r->min_p, e))) return rc;
    if ((rc = get_float(o, "presence_penalty", -2, 2, &r->presence_penalty, e))) return rc;
    if ((rc = get_float(o, "frequency_penalty", -2, 2, &r->frequency_penalty, e))) return rc;
    if ((rc = get_float(o, "repetition_penalty", 0.01, 100, &r->repeat_penalty, e))) return rc;
    if ((rc = get_int(o, "top_k", 0, 1 << 20, &x, &has, e))) return rc;
    if (has) r->top_k = (int32_t)x;
    if ((rc = get_int(o, "priority", -100, 100, &x, &has, e))) return rc;
    if (has) r->priority = (int32_t)x;
    if ((rc = get_int(o, "max_draft_tokens", 0, KM_PROTO_MAX_DRAFT, &x, &has, e))) return rc;
    if (has) r->max_draft_tokens = (uint32_t)x;
    v = json_object_get(o, "speculate");
    if (v && !json_is_null(v)) {
        const char *sv = json_is_string(v) ? json_string_value(v) : "";
        if (!strcmp(sv, "auto"))
            r->speculate = KM_SPECULATE_AUTO;
        else if (!strcmp(sv, "off"))
            r->speculate = KM_SPECULATE_OFF;
        else if (!strcmp(sv, "self"))
            r->speculate = KM_SPECULATE_SELF;
        else
            return fail(e, "speculate", "'speculate' must be \"auto\", \"off\" or \"self\"", NULL);
    }
    v = json_object_get(o, "seed");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v)) return fail(e, "seed", "'seed' must be an integer", NULL);
        r->has_seed = true;
        r->seed = (uint64_t)json_integer_value(v);
    }
    if ((rc = parse_logprobs(o, chat, r, e))) return rc;
    v = json_object_get(o, "stream");
    if (v && !json_is_null(v)) {
        if (!json_is_boolean(v)) return fail(e, "stream", "'stream' must be a boolean", NULL);
        r->stream = json_is_true(v);
    }
    v = json_object_get(o, "stream_options");
    if (json_is_object(v)) r->include_usage = json_is_true(json_object_get(v, "include_usage"));
    v = json_object_get(o, "stop");
    if (json_is_string(v)) {
        if (json_string_length(v) == 0 || json_string_length(v) > KM_PROTO_MAX_NAME)
            return fail(e, "stop", "stop strings must be 1-256 bytes", NULL);
        if (!(r->stop[r->n_stop++] = dup_str(v))) return KM_ENOMEM;
    } else if (json_is_array(v)) {
        if (json_array_size(v) > KM_PROTO_MAX_STOP)
            return fail(e, "stop", "at most 16 stop strings", NULL);
        size_t i;
        json_t *s;
        json_array_foreach(v, i, s)
        {
            if (!json_is_string(s) || json_string_length(s) == 0 ||
                json_string_length(s) > KM_PROTO_MAX_NAME ||
                memchr(json_string_value(s), 0, json_string_length(s)))
                return fail(e, "stop", "stop strings must be strings of 1-256 bytes", NULL);
            if (!(r->stop[r->n_stop++] = dup_str(s))) return KM_ENOMEM;
        }
    } else if (v && !json_is_null(v)) {
        return fail(e, "stop", "'stop' must be a string or an array of strings", NULL);
    }
    v = json_object_get(o, "cache_salt");
    if (v && !json_is_null(v)) {
        if (!json_is_string(v) || json_string_length(v) > KM_PROTO_MAX_NAME ||
            memchr(json_string_value(v), 0, json_string_length(v)))
            return fail(e, "cache_salt", "'cache_salt' must be a string of at most 256 bytes",
                        NULL);
        if (!(r->cache_salt = dup_str(v))) return KM_ENOMEM;
    }
    /* Asked-for features this server does not have: say so rather than silently ignore. */
    static const char *const unsupported[] = {"best_of", "functions"};
    for (size_t i = 0; i < sizeof unsupported / sizeof *unsupported; i++) {
        v = json_object_get(o, unsupported[i]);
        if (!v || json_is_null(v) || json_is_false(v)) continue;
        if (json_is_array(v) && json_array_size(v) == 0) continue;
        if (json_is_object(v) && json_object_size(v) == 0) continue;
        if (json_is_integer(v) && json_integer_value(v) <= 1) continue; /* best_of 1 */
        return fail(e, unsupported[i], "'%s' is not supported by this server", unsupported[i]);
    }
    return 0;
}

/* rc, with e made a 500 when rc says memory ran out before any 400 was filled in. */
static int no_memory(int rc, rt_oai_err *e)
{
    if (rc == KM_ENOMEM && !e->status) {
        e->status = 500;
        e->type = "server_error";
        snprintf(e->message, sizeof e->message, "out of memory");
    }
    return rc;
}

/* The body as a JSON object, or NULL with e filled (400). */
static json_t *load_object(const char *body, size_t len, rt_oai_err *e)
{
    json_error_t je;
    json_t *o = json_loadb(body ? body : "", body ? len : 0, JSON_REJECT_DUPLICATES, &je);
    if (!o) {
        char m[300];
        snprintf(m, sizeof m, "request body is not valid JSON: %s (line %d, column %d)", je.text,
                 je.line, je.column);
        fail(e, NULL, "%s", m);
        return NULL;
    }
    if (!json_is_object(o)) {
        json_decref(o);
        fail(e, NULL, "request body must be a JSON object", NULL);
        return NULL;
    }
    return o;
}

int rt_oai_parse(const char *body, size_t len, bool chat, rt_oai_req *out, rt_oai_err *e)
{
    memset(out, 0, sizeof *out);
    memset(e, 0, sizeof *e);
    out->chat = chat;
    out->temperature = 1.0f;
    out->top_p = 1.0f;
    out->repeat_penalty = 1.0f;
    json_t *o = load_object(body, len, e);
    if (!o) return KM_EFORMAT;
    int rc = no_memory(parse_obj(o, chat, out, e), e);
    json_decref(o);
    if (rc) rt_oai_req_free(out);
    return rc;
}

/* ---------------------------------------------------------------- /tokenize, /detokenize */

static int dump(km_buf *out, json_t *o, const char *prefix, const char *suffix);

static int get_bool(json_t *o, const char *key, bool *out, rt_oai_err *e)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return fail(e, key, "'%s' must be a boolean", key);
    *out = json_is_true(v);
    return 0;
}

int rt_oai_parse_tokenize(const char *body, size_t len, rt_oai_tokreq *out, rt_oai_err *e)
{
    memset(out, 0, sizeof *out);
    memset(e, 0, sizeof *e);
    json_t *o = load_object(body, len, e);
    if (!o) return KM_EFORMAT;
    bool chat = json_object_get(o, "messages") != NULL;
    out->q.chat = chat;
    out->add_special = !chat;
    out->add_generation_prompt = true;
    int rc = parse_obj(o, chat, &out->q, e);
    if (!rc && !chat && out->q.n_prompts != 1)
        rc = fail(e, "prompt", "'prompt' must be one string here", NULL);
    if (!rc && !chat && !out->q.prompts[0].text)
        rc = fail(e, "prompt", "'prompt' must be a string here (token ids need no tokenizing)",
                  NULL);
    if (!rc) rc = get_bool(o, "add_special_tokens", &out->add_special, e);
    if (!rc) rc = get_bool(o, "add_generation_prompt", &out->add_generation_prompt, e);
    if (!rc) rc = get_bool(o, "return_token_strs", &out->return_token_strs, e);
    json_decref(o);
    no_memory(rc, e);
    if (rc) rt_oai_req_free(&out->q);
    return rc;
}

int rt_oai_tokenize_response(km_buf *out, const int32_t *ids, int n, uint32_t max_model_len,
                             char *const *strs)
{
    json_t *t = json_array(), *s = strs ? json_array() : NULL;
    for (int i = 0; t && i < n; i++) {
        json_array_append_new(t, json_integer(ids[i]));
        if (s) json_array_append_new(s, jstr(strs[i], strlen(strs[i])));
    }
    json_t *o = json_pack("{s:i,s:I,s:o}", "count", n, "max_model_len", (json_int_t)max_model_len,
                          "tokens", t);
    if (o && s) json_object_set_new(o, "token_strs", s);
    if (!o) json_decref(s);
    return dump(out, o, "", "\n");
}

int rt_oai_parse_detokenize(const char *body, size_t len, int n_vocab, int32_t **ids, int *n,
                            rt_oai_err *e)
{
    memset(e, 0, sizeof *e);
    *ids = NULL;
    *n = 0;
    json_t *o = load_object(body, len, e);
    if (!o) return KM_EFORMAT;
    json_t *v = json_object_get(o, "tokens");
    int rc = 0;
    if (!json_is_array(v)) rc = fail(e, "tokens", "'tokens' must be an array of token ids", NULL);
    size_t cnt = rc ? 0 : json_array_size(v);
    if (!rc && !(*ids = malloc(sizeof **ids * (cnt ? cnt : 1)))) rc = KM_ENOMEM;
    for (size_t i = 0; !rc && i < cnt; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= n_vocab) {
            char m[120];
            snprintf(m, sizeof m, "'tokens[%zu]' is not a token id in [0, %d)", i, n_vocab);
            rc = fail(e, "tokens", "%s", m);
        } else {
            (*ids)[i] = (int32_t)json_integer_value(x);
        }
    }
    json_decref(o);
    if (rc) {
        free(*ids);
        *ids = NULL;
        return no_memory(rc, e);
    }
    *n = (int)cnt;
    return 0;
}

int rt_oai_detokenize_response(km_buf *out, const char *text, size_t len)
{
    return dump(out, json_pack("{s:o}", "prompt", jstr(text, len)), "", "\n");
}

/* ---------------------------------------------------------------- responses */

const char *rt_oai_finish(km_finish f)
{
    return f == KM_FINISH_LENGTH ? "length" : "stop";
}

static int dump(km_buf *out, json_t *o, const char *prefix, const char *suffix)
{
    if (!o) return KM_ENOMEM;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return KM_ENOMEM;
    int rc = km_buf_printf(out, "%s%s%s", prefix, s, suffix);
    free(s);
    return rc;
}

static json_t *usage_obj(const rt_oai_usage *u)
{
    json_t *o = json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)u->prompt_tokens,
                          "completion_tokens", (json_int_t)u->completion_tokens, "total_tokens",
                          (json_int_t)u->prompt_tokens + u->completion_tokens,
                          "prompt_tokens_details", "cached_tokens", (json_int_t)u->cached_tokens);
    /* Drafts verified by speculative decoding, in the fields OpenAI gives predicted outputs:
     * accepted ones are part of the completion, rejected ones cost compute only. */
    if (o && u->draft_tokens)
        json_object_set_new(o, "completion_tokens_details",
                            json_pack("{s:I,s:I}", "accepted_prediction_tokens",
                                      (json_int_t)u->accepted_draft_tokens,
                                      "rejected_prediction_tokens",
                                      (json_int_t)(u->draft_tokens - u->accepted_draft_tokens)));
    /* chunk reuse is not a prefix hit (its KV is repaired, not exact): a field of its own */
    json_t *pd = o ? json_object_get(o, "prompt_tokens_details") : NULL;
    if (pd && u->chunk_tokens)
        json_object_set_new(pd, "chunk_tokens", json_integer((json_int_t)u->chunk_tokens));
    return o;
}

static json_t *base_obj(const rt_oai_meta *m, const char *object)
{
    json_t *o = json_pack("{s:s,s:s,s:I,s:s}", "id", m->id ? m->id : "", "object", object,
                          "created", (json_int_t)m->created, "model", m->model ? m->model : "");
    if (o && m->worker) json_object_set_new(o, "kvmesh", json_pack("{s:s}", "worker", m->worker));
    return o;
}

/* A logprob as JSON: OpenAI's -9999 stands for a probability of zero. */
static json_t *jlp(float x)
{
    return json_real(isfinite(x) ? x : -9999.0);
}

/* Chat: {"token", "logprob", "bytes"}; the token's bytes in p (n of them). */
static json_t *chat_lp_entry(const char *p, int n, float lp)
{
    json_t *bytes = json_array();
    for (int i = 0; bytes && i < n; i++) json_array_append_new(bytes, json_integer((uint8_t)p[i]));
    return json_pack("{s:o,s:o,s:o}", "token", jstr(p, (size_t)n), "logprob", jlp(lp), "bytes",
                     bytes);
}

static int token_piece(const rt_oai_meta *m, int32_t id, char *buf, int cap)
{
    int n = m->piece ? m->piece(m->piece_ctx, id, buf, cap) : 0;
    return n < 0 || n > cap ? 0 : n;
}

/* A choice's "logprobs" object for lp[0..n_lp), or null when lp is NULL. */
static json_t *logprobs_obj(const rt_oai_meta *m, const rt_oai_lp *lp, int n_lp, size_t offset)
{
    if (!lp) return json_null();
    char p[KM_PROTO_MAX_PIECE];
    if (m->chat) {
        json_t *content = json_array();
        for (int i = 0; content && i < n_lp; i++) {
            const rt_oai_lp *t = &lp[i];
            json_t *e = chat_lp_entry(p, token_piece(m, t->token, p, sizeof p), t->logprob);
            json_t *top = json_array();
            for (uint32_t k = 0; top && k < t->n_top; k++)
                json_array_append_new(top,
                                      chat_lp_entry(p, token_piece(m, t->top[k].token, p, sizeof p),
                                                    t->top[k].value));
            if (e) json_object_set_new(e, "top_logprobs", top ? top : json_array());
            json_array_append_new(content, e);
        }
        return json_pack("{s:o,s:n}", "content", content, "refusal");
    }
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    size_t off = offset;
    for (int i = 0; i < n_lp; i++) {
        const rt_oai_lp *t = &lp[i];
        int n = token_piece(m, t->token, p, sizeof p);
        json_array_append_new(toks, jstr(p, (size_t)n));
        json_array_append_new(offs, json_integer((json_int_t)off));
        off += (size_t)n;
        if (isnan(t->logprob)) { /* echo: the prompt's first token has none */
            json_array_append_new(lps, json_null());
            json_array_append_new(tops, json_null());
            continue;
        }
        json_array_append_new(lps, jlp(t->logprob));
        json_t *d = json_object();
        for (uint32_t k = 0; d && k < t->n_top; k++) {
            int pn = token_piece(m, t->top[k].token, p, sizeof p);
            json_t *key = jstr(p, (size_t)pn);
            if (key) json_object_set_new(d, json_string_value(key), jlp(t->top[k].value));
            json_decref(key);
        }
        json_array_append_new(tops, d);
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs",
                     tops, "text_offset", offs);
}

int rt_oai_sse_chunk(km_buf *out, const rt_oai_meta *m, const char *text, size_t len,
                     const char *finish)
{
    json_t *o = base_obj(m, m->chat ? "chat.completion.chunk" : "text_completion");
    if (!o) return KM_ENOMEM;
    json_t *choice =
        json_pack("{s:i,s:o}", "index", m->index, "logprobs",
                  finish ? json_null() : logprobs_obj(m, m->lp, m->n_lp, m->text_offset));
    json_t *t = finish ? json_string("") : jstr(text, len);
    if (!choice || !t) {
        json_decref(choice);
        json_decref(t);
        json_decref(o);
        return KM_ENOMEM;
    }
    if (m->chat) {
        json_t *delta = json_object();
        if (!text && !finish) { /* the first chunk announces the role */
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", t);
        } else if (finish) {
            json_decref(t);
        } else {
            json_object_set_new(delta, "content", t);
        }
        json_object_set_new(choice, "delta", delta);
    } else {
        json_object_set_new(choice, "text", t);
    }
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    json_object_set_new(o, "choices", json_pack("[o]", choice));
    return dump(out, o, "data: ", "\n\n");
}

int rt_oai_sse_usage(km_buf *out, const rt_oai_meta *m, const rt_oai_usage *u)
{
    json_t *o = base_obj(m, m->chat ? "chat.completion.chunk" : "text_completion");
    if (!o) return KM_ENOMEM;
    json_object_set_new(o, "choices", json_array());
    json_object_set_new(o, "usage", usage_obj(u));
    return dump(out, o, "data: ", "\n\n");
}

int rt_oai_sse_done(km_buf *out)
{
    return km_buf_printf(out, "data: [DONE]\n\n");
}

static json_t *error_obj(const rt_oai_err *e)
{
    json_t *msg = jstr(e->message, strlen(e->message));
    return json_pack("{s:{s:o,s:s,s:s?,s:s?}}", "error", "message", msg, "type",
                     e->type ? e->type : "server_error", "param", e->param, "code", e->code);
}

int rt_oai_sse_error(km_buf *out, const rt_oai_err *e)
{
    return dump(out, error_obj(e), "data: ", "\n\n");
}

int rt_oai_error_json(km_buf *out, const rt_oai_err *e)
{
    return dump(out, error_obj(e), "", "\n");
}

const char *rt_oai_http_error(int status, const char *message, km_buf *out)
{
    rt_oai_err e = {.status = status,
                    .type = status >= 500 ? "server_error" : "invalid_request_error"};
    snprintf(e.message, sizeof e.message, "%s", message);
    rt_oai_error_json(out, &e);
    return "application/json";
}

int rt_oai_response_choices(km_buf *out, const rt_oai_meta *m, const rt_oai_choice *c, int n,
                            const rt_oai_usage *u)
{
    json_t *o = base_obj(m, m->chat ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    for (int i = 0; o && choices && i < n; i++) {
        json_t *t = jstr(c[i].text, c[i].len);
        json_t *lp = logprobs_obj(m, c[i].lp, c[i].n_lp, c[i].text_offset);
        json_t *choice;
        if (m->chat)
            choice =
                json_pack("{s:i,s:{s:s,s:o},s:o,s:s}", "index", i, "message", "role", "assistant",
                          "content", t, "logprobs", lp, "finish_reason", c[i].finish);
        else
            choice = json_pack("{s:i,s:o,s:o,s:s}", "index", i, "text", t, "logprobs", lp,
                               "finish_reason", c[i].finish);
        if (m->chat && c[i].tool_calls && choice) { /* a call: no text (openai_tools.c) */
            json_t *msg = json_object_get(choice, "message");
            json_object_set_new(msg, "content", json_null());
            json_object_set(msg, "tool_calls", c[i].tool_calls);
        }
        if (json_array_append_new(choices, choice)) {
            json_decref(choices);
            choices = NULL;
        }
    }
    if (!o || !choices) {
        json_decref(o);
        json_decref(choices);
        return KM_ENOMEM;
    }
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", usage_obj(u));
    return dump(out, o, "", "\n");
}

int rt_oai_response(km_buf *out, const rt_oai_meta *m, const char *text, size_t len,
                    const char *finish, const rt_oai_usage *u)
{
    rt_oai_choice c = {.text = text,
                       .len = len,
                       .finish = finish,
                       .lp = m->lp,
                       .n_lp = m->n_lp,
                       .text_offset = m->text_offset};
    return rt_oai_response_choices(out, m, &c, 1, u);
}

static json_t *model_obj(const char *model, int64_t created)
{
    return json_pack("{s:o,s:s,s:I,s:s}", "id", jstr(model, strlen(model)), "object", "model",
                     "created", (json_int_t)created, "owned_by", "kvmesh");
}

int rt_oai_models(km_buf *out, const char *model, int64_t created)
{
    json_t *o = json_pack("{s:s,s:[o]}", "object", "list", "data", model_obj(model, created));
    return dump(out, o, "", "\n");
}

int rt_oai_model(km_buf *out, const char *model, int64_t created)
{
    return dump(out, model_obj(model, created), "", "\n");
}

void rt_oai_err_from_code(int code, const char *message, rt_oai_err *e)
{
    memset(e, 0, sizeof *e);
    snprintf(e->message, sizeof e->message, "%s", message ? message : "");
    e->param = NULL;
    switch (code) {
    case KM_CODE_BAD_REQUEST:
        e->status = 400;
        e->type = "invalid_request_error";
        break;
    case KM_CODE_NOT_FOUND:
        e->status = 404;
        e->type = "invalid_request_error";
        e->code = "model_not_found";
        break;
    case KM_CODE_TOO_LARGE:
        e->status = 400;
        e->type = "invalid_request_error";
        e->code = "context_length_exceeded";
        break;
    case KM_CODE_RATE_LIMIT: /* a key past its own limit (router/fair.c): OpenAI's shape */
        e->status = 429;
        e->type = "rate_limit_exceeded";
        e->code = "rate_limit_exceeded";
        break;
    case KM_CODE_OVERLOADED:
        e->status = 503;
        e->type = "server_error";
        e->code = "overloaded";
        break;
    case KM_CODE_UNAVAILABLE:
        e->status = 503;
        e->type = "server_error";
        e->code = "unavailable";
        break;
    case KM_CODE_DEADLINE:
        e->status = 504;
        e->type = "server_error";
        e->code = "deadline_exceeded";
        break;
    default:
        e->status = code >= 400 && code < 500 ? 400 : 500;
        e->type = code >= 400 && code < 500 ? "invalid_request_error" : "server_error";
        break;
    }
}
