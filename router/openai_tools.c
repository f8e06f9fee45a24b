/*
 * openai_tools.c — the structured-output fields of an OpenAI request (openai.h, docs/openai.md,
 * docs/structured.md): response_format json_object and json_schema become the JSON Schema text
 * the worker compiles into a grammar (engine.h, en_grammar_compile) and holds the output to.
 *
 * The router checks the field's shape (OpenAI's: a name of at most 64 letters, digits, '_' or
 * '-', strict a boolean, schema an object) and hands the schema on as compact JSON in its own key
 * order (properties are generated in that order). Whether the schema's keywords are supported is
 * the worker's compiler's to say: it answers bad_request with the keyword named, which reaches the
 * client as a 400 before any token, so the rules live in one place.
 *
 * tools and tool_choice: the model's chat template has no tool syntax (SmolLM2's), so the
 * functions are told in a system turn and a call is a JSON object {"name", "arguments"}; a forced
 * call (required, or a named function) is the same grammar machinery with a schema made here,
 * and a reply that is a call is turned into OpenAI's tool_calls by the front (front.c) with the
 * helpers at the end of this file, which edit the objects openai.c builds rather than build them
 * twice.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/openai.h"

static int tools_fail(rt_oai_err *e, const char *param, const char *fmt, const char *arg)
{
    e->status = 400;
    e->type = "invalid_request_error";
    e->param = param;
    e->code = NULL;
    if (arg)
        snprintf(e->message, sizeof e->message, fmt, arg);
    else
        snprintf(e->message, sizeof e->message, "%s", fmt);
    return KM_EINVAL;
}

static int response_format(json_t *body, rt_oai_req *r, rt_oai_err *e);

static int name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n < 1 || n > 64) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- grammar extensions */

/* The fields that hold the output to a grammar of the request's own, by the name each server
 * gives them: vLLM's guided_* (and its newer structured_outputs object), SGLang's regex and
 * ebnf, llama-server's grammar. 'r': a regex, 'g': a GBNF grammar, 'c': a list of choices. */
static const struct {
    const char *name;
    char kind;
} guided_fields[] = {
    {"guided_regex", 'r'}, {"regex", 'r'}, {"guided_grammar", 'g'},
    {"grammar", 'g'},      {"ebnf", 'g'},  {"guided_choice", 'c'},
};

/* A GBNF literal of s: "..." with '"', '\' and control bytes escaped. */
static void gbnf_literal(km_buf *b, const char *s)
{
    km_buf_append(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x20 || c == 0x7F || c == '"' || c == '\\')
            km_buf_printf(b, "\\x%02X", c);
        else
            km_buf_append(b, s, 1);
    }
    km_buf_append(b, "\"", 1);
}

/* The grammar text (engine.h, en_grammar_compile: "%regex\n" or "%gbnf\n" and the text) of one
 * extension field v of kind k; NULL with e filled. */
static char *guided_text(json_t *v, char k, const char *param, rt_oai_err *e)
{
    km_buf b = {0};
    if (k == 'c') {
        if (!json_is_array(v) || json_array_size(v) < 1 || json_array_size(v) > 256) {
            tools_fail(e, param, "'%s' must be a list of 1 to 256 strings", param);
            return NULL;
        }
        km_buf_printf(&b, "%%gbnf\nroot ::= ");
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x)
        {
            if (!json_is_string(x) || !json_string_length(x)) {
                km_buf_free(&b);
                tools_fail(e, param, "'%s' must hold non-empty strings", param);
                return NULL;
            }
            if (i) km_buf_append(&b, " | ", 3);
            gbnf_literal(&b, json_string_value(x));
        }
        km_buf_append(&b, "\n", 1);
    } else {
        if (!json_is_string(v) || !json_string_length(v)) {
            tools_fail(e, param, "'%s' must be a non-empty string", param);
            return NULL;
        }
        km_buf_printf(&b, "%%%s\n", k == 'r' ? "regex" : "gbnf");
        km_buf_append(&b, json_string_value(v), json_string_length(v));
    }
    km_buf_append(&b, "", 1);
    if (b.len - 1 > KM_PROTO_MAX_GRAMMAR) {
        km_buf_free(&b);
        char m[32];
        snprintf(m, sizeof m, "%u", KM_PROTO_MAX_GRAMMAR);
        tools_fail(e, param, "the grammar is longer than %s bytes", m);
        return NULL;
    }
    return (char *)b.data;
}

/* The extension fields into r->grammar (after response_format); at most one of them. */
static int guided(json_t *body, rt_oai_req *r, rt_oai_err *e)
{
    json_t *so = json_object_get(body, "structured_outputs"), *found = NULL;
    const char *param = NULL;
    char kind = 0;
    static const char *const so_names[][2] = {{"regex", "structured_outputs.regex"},
                                              {"grammar", "structured_outputs.grammar"},
                                              {"choice", "structured_outputs.choice"}};
    if (so && !json_is_null(so) && !json_is_object(so))
        return tools_fail(e, "structured_outputs", "'structured_outputs' must be an object", NULL);
    for (size_t i = 0; i < sizeof guided_fields / sizeof *guided_fields + 3; i++) {
        size_t k = i - sizeof guided_fields / sizeof *guided_fields;
        int in_so = i >= sizeof guided_fields / sizeof *guided_fields;
        json_t *v = in_so ? json_object_get(so, so_names[k][0])
                          : json_object_get(body, guided_fields[i].name);
        if (!v || json_is_null(v)) continue;
        const char *name = in_so ? so_names[k][1] : guided_fields[i].name;
        if (found)
            return tools_fail(e, name,
                              "one grammar at a time: '%s' comes with another of guided_regex, "
                              "guided_grammar, guided_choice, regex, ebnf, grammar, "
                              "structured_outputs",
                              name);
        found = v;
        param = name;
        kind = in_so ? so_names[k][0][0] : guided_fields[i].kind;
    }
    if (!found) return 0;
    if (r->grammar) {
        free(r->grammar);
        r->grammar = NULL;
        return tools_fail(e, param, "'%s' and a JSON 'response_format' together are not supported",
                          param);
    }
    return (r->grammar = guided_text(found, kind, param, e)) ? 0 : KM_EINVAL;
}

int rt_oai_response_format(struct json_t *body, rt_oai_req *r, rt_oai_err *e)
{
    int rc = response_format(body, r, e);
    return rc ? rc : guided(body, r, e);
}

static int response_format(json_t *body, rt_oai_req *r, rt_oai_err *e)
{
    json_t *v = json_object_get(body, "response_format");
    if (!v || json_is_null(v)) return 0;
    json_t *type = json_object_get(v, "type");
    if (!json_is_object(v) || !json_is_string(type))
        return tools_fail(e, "response_format", "'response_format' must be an object with a 'type'",
                          NULL);
    const char *t = json_string_value(type);
    if (!strcmp(t, "text")) return 0;
    if (!strcmp(t, "json_object")) {
        r->grammar = strdup("{\"type\":\"object\"}");
        return r->grammar ? 0 : KM_ENOMEM;
    }
    if (strcmp(t, "json_schema"))
        return tools_fail(e, "response_format",
                          "response_format type '%s' is not supported (text, json_object, "
                          "json_schema)",
                          t);
    json_t *js = json_object_get(v, "json_schema");
    if (!json_is_object(js))
        return tools_fail(e, "response_format.json_schema",
                          "response_format json_schema needs a 'json_schema' object", NULL);
    json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict"),
           *schema = json_object_get(js, "schema");
    if (!json_is_string(name) || !name_ok(json_string_value(name)))
        return tools_fail(e, "response_format.json_schema.name",
                          "'json_schema.name' must be 1 to 64 letters, digits, '_' or '-'", NULL);
    if (strict && !json_is_null(strict) && !json_is_boolean(strict))
        return tools_fail(e, "response_format.json_schema.strict",
                          "'json_schema.strict' must be a boolean", NULL);
    if (schema && !json_is_null(schema) && !json_is_object(schema))
        return tools_fail(e, "response_format.json_schema.schema",
                          "'json_schema.schema' must be a JSON Schema object", NULL);
    /* no schema: any JSON object, as json_object */
    r->grammar = schema && !json_is_null(schema) ? json_dumps(schema, JSON_COMPACT)
                                                 : strdup("{\"type\":\"object\"}");
    if (!r->grammar) return KM_ENOMEM;
    if (strlen(r->grammar) > KM_PROTO_MAX_GRAMMAR) {
        free(r->grammar);
        r->grammar = NULL;
        char m[32];
        snprintf(m, sizeof m, "%u", KM_PROTO_MAX_GRAMMAR);
        return tools_fail(e, "response_format.json_schema.schema",
                          "'json_schema.schema' is longer than %s bytes as compact JSON", m);
    }
    return 0;
}

/* ---------------------------------------------------------------- tools */

/* What the model is told of the functions (the fallback for templates with no tool syntax,
 * SmolLM2's among them): one system turn listing them and the form of a call. */
static char *tools_prompt(json_t *tools, bool several)
{
    km_buf b = {0};
    km_buf_printf(&b,
                  "You can call functions. To call one, answer with only a JSON object "
                  "{\"name\": <function name>, \"arguments\": <its arguments>}.%s "
                  "Functions:",
                  several ? " To call several at once, answer with only a JSON array of such "
                            "objects."
                          : "");
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        json_t *f = json_object_get(t, "function"), *d = json_object_get(f, "description");
        char *params = json_dumps(json_object_get(f, "parameters"), JSON_COMPACT);
        km_buf_printf(&b, "\n- %s%s%s; arguments: %s",
                      json_string_value(json_object_get(f, "name")), json_is_string(d) ? ": " : "",
                      json_is_string(d) ? json_string_value(d) : "", params ? params : "{}");
        free(params);
    }
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

/* The object of a call of one function: {"name": its name, "arguments": its parameters}. */
static json_t *call_object(json_t *f)
{
    json_t *p = json_object_get(f, "parameters");
    json_t *args = p ? json_deep_copy(p) : json_pack("{s:s}", "type", "object");
    return json_pack("{s:s,s:{s:{s:[O]},s:o},s:[s,s]}", "type", "object", "properties", "name",
                     "enum", json_object_get(f, "name"), "arguments", args, "required", "name",
                     "arguments");
}

/* The schema of a call: of the one function named (only) or there is, else one of the calls of
 * each (a discriminated union the grammar engine ties together: the name read picks the
 * arguments' schema); with several, an array of 1 to RT_OAI_MAX_CALLS such calls. */
static char *call_schema(json_t *tools, const char *only, bool several)
{
    json_t *calls = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        json_t *f = json_object_get(t, "function");
        if (only && strcmp(json_string_value(json_object_get(f, "name")), only)) continue;
        json_array_append_new(calls, call_object(f));
    }
    json_t *s = json_array_size(calls) == 1 ? json_incref(json_array_get(calls, 0))
                                            : json_pack("{s:O}", "oneOf", calls);
    json_decref(calls);
    if (s && several)
        s = json_pack("{s:s,s:o,s:i,s:i}", "type", "array", "items", s, "minItems", 1, "maxItems",
                      RT_OAI_MAX_CALLS);
    char *out = s ? json_dumps(s, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(s);
    return out;
}

static int tools_check(json_t *tools, rt_oai_err *e)
{
    if (!json_is_array(tools) || json_array_size(tools) > 64)
        return tools_fail(e, "tools", "'tools' must be an array of at most 64 functions", NULL);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        json_t *f = json_object_get(t, "function"), *n = json_object_get(f, "name"),
               *p = json_object_get(f, "parameters");
        if (!json_is_object(t) || !json_is_object(f) ||
            strcmp(json_string_value(json_object_get(t, "type")) ?: "", "function"))
            return tools_fail(e, "tools",
                              "each tool must be {\"type\": \"function\", "
                              "\"function\": {...}}",
                              NULL);
        if (!json_is_string(n) || !name_ok(json_string_value(n)))
            return tools_fail(e, "tools",
                              "a function's 'name' must be 1 to 64 letters, digits, "
                              "'_' or '-'",
                              NULL);
        if (p && !json_is_object(p))
            return tools_fail(e, "tools", "a function's 'parameters' must be a JSON Schema object",
                              NULL);
    }
    return 0;
}

/* The messages of a conversation with calls: an assistant turn's tool_calls become its text
 * (the call's JSON), a tool turn a user turn that gives the result. */
static int tools_messages(json_t *body, rt_oai_req *r)
{
    json_t *msgs = json_object_get(body, "messages"), *m;
    size_t i;
    json_array_foreach(msgs, i, m)
    {
        if ((int)i >= r->n_msgs) break;
        json_t *calls = json_object_get(m, "tool_calls");
        char *text = NULL;
        if (!strcmp(r->msgs[i].role, "assistant") && json_array_size(calls)) {
            /* one call as its object, several as an array of them (the reply's own shapes) */
            json_t *all = json_array(), *call;
            size_t k;
            json_array_foreach(calls, k, call)
            {
                json_t *f = json_object_get(call, "function");
                json_t *args =
                    json_loads(json_string_value(json_object_get(f, "arguments")) ?: "{}", 0, NULL);
                json_array_append_new(all,
                                      json_pack("{s:O,s:o}", "name", json_object_get(f, "name"),
                                                "arguments", args ? args : json_object()));
            }
            json_t *c = json_array_size(all) == 1 ? json_array_get(all, 0) : all;
            text = c ? json_dumps(c, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
            json_decref(all);
        } else if (!strcmp(r->msgs[i].role, "tool")) {
            km_buf b = {0};
            km_buf_printf(&b, "Result of the function call: %s", r->msgs[i].content);
            km_buf_append(&b, "", 1);
            text = (char *)b.data;
            free(r->msgs[i].role);
            r->msgs[i].role = strdup("user");
            if (!r->msgs[i].role) {
                free(text);
                return KM_ENOMEM;
            }
        } else {
            continue;
        }
        if (!text) return KM_ENOMEM;
        free(r->msgs[i].content);
        r->msgs[i].content = text;
    }
    return 0;
}

/* The system turn listing the functions, first. */
static int tools_system(rt_oai_req *r, json_t *tools, bool several)
{
    char *sys = tools_prompt(tools, several);
    rt_oai_msg *m = realloc(r->msgs, sizeof *m * (size_t)(r->n_msgs + 1));
    if (!sys || !m) {
        free(sys);
        if (m) r->msgs = m;
        return KM_ENOMEM;
    }
    r->msgs = m;
    memmove(m + 1, m, sizeof *m * (size_t)r->n_msgs);
    r->n_msgs++;
    m[0].content = sys;
    if (!(m[0].role = strdup("system"))) return KM_ENOMEM;
    return 0;
}

int rt_oai_tools(struct json_t *body, rt_oai_req *r, rt_oai_err *e)
{
    json_t *tools = json_object_get(body, "tools"), *choice = json_object_get(body, "tool_choice");
    json_t *par = json_object_get(body, "parallel_tool_calls");
    if (par && !json_is_null(par) && !json_is_boolean(par))
        return tools_fail(e, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean",
                          NULL);
    /* OpenAI's default is true: a reply that is an array of calls is read as several unless
     * parallel_tool_calls is false; the model is told of arrays, and a forced reply is held to
     * one, only when it is true (docs/openai.md) */
    bool several_ok = !json_is_false(par), several_asked = json_is_true(par);
    int rc = r->chat ? tools_messages(body, r) : 0;
    if (rc) return rc;
    if (!tools || json_is_null(tools) || (json_is_array(tools) && !json_array_size(tools))) {
        if (choice && !json_is_null(choice) && !json_is_string(choice))
            return tools_fail(e, "tool_choice",
                              "'tool_choice' names a function but there are "
                              "no 'tools'",
                              NULL);
        return 0;
    }
    if (!r->chat) return tools_fail(e, "tools", "'tools' is for /v1/chat/completions", NULL);
    if ((rc = tools_check(tools, e))) return rc;
    const char *mode = json_is_string(choice) ? json_string_value(choice) : "auto", *only = NULL;
    if (json_is_object(choice)) {
        only = json_string_value(json_object_get(json_object_get(choice, "function"), "name"));
        mode = "required";
        int found = 0;
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) found |=
            only &&
            !strcmp(json_string_value(json_object_get(json_object_get(t, "function"), "name")),
                    only);
        if (!found)
            return tools_fail(e, "tool_choice", "'tool_choice' must name one of the 'tools'", NULL);
    } else if (choice && !json_is_null(choice) && strcmp(mode, "none") && strcmp(mode, "auto") &&
               strcmp(mode, "required")) {
        return tools_fail(e, "tool_choice",
                          "'tool_choice' must be none, auto, required or "
                          "{\"type\": \"function\", \"function\": {\"name\"}}",
                          NULL);
    }
    if (!strcmp(mode, "none")) return 0;
    km_buf names = {0};
    r->tool_several = several_ok;
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (!only || !strcmp(n, only)) km_buf_printf(&names, "%s\n", n);
    }
    km_buf_append(&names, "", 1);
    r->tool_names = (char *)names.data;
    if (!r->tool_names) return KM_ENOMEM;
    if (!strcmp(mode, "required")) {
        if (r->grammar)
            return tools_fail(e, "tool_choice",
                              "a forced tool call and 'response_format' (or a grammar "
                              "extension) together are not supported",
                              NULL);
        if (!(r->grammar = call_schema(tools, only, several_asked))) return KM_ENOMEM;
    }
    return tools_system(r, tools, several_asked);
}

/* ---------------------------------------------------------------- tool calls out */

/* The call object {"name": one of names, "arguments": {...}} as OpenAI's call k; NULL if not. */
static json_t *one_call(json_t *v, const char *names, const char *id, size_t k)
{
    json_t *n = json_object_get(v, "name"), *args = json_object_get(v, "arguments");
    const char *ns = json_string_value(n);
    size_t nl = ns ? strlen(ns) : 0;
    const char *at = ns ? strstr(names, ns) : NULL;
    while (at && !((at == names || at[-1] == '\n') && at[nl] == '\n')) at = strstr(at + 1, ns);
    if (!at || !nl || !json_is_object(args) || !name_ok(ns)) return NULL;
    char *a = json_dumps(args, JSON_COMPACT | JSON_PRESERVE_ORDER), cid[96];
    snprintf(cid, sizeof cid, "call_%s_%zu", id, k);
    json_t *c = a ? json_pack("{s:s,s:s,s:{s:O,s:s}}", "id", cid, "type", "function", "function",
                              "name", n, "arguments", a)
                  : NULL;
    free(a);
    return c;
}

json_t *rt_oai_tool_calls(const char *text, size_t len, const char *names, bool several,
                          const char *id)
{
    json_t *v = json_loadb(text, len, 0, NULL), *calls = json_array(), *c;
    if (json_is_object(v)) {
        json_array_append_new(calls, one_call(v, names, id, 0));
    } else if (several && json_is_array(v) && json_array_size(v) >= 1 &&
               json_array_size(v) <= RT_OAI_MAX_CALLS) {
        size_t k;
        json_array_foreach(v, k, c) json_array_append_new(calls, one_call(c, names, id, k));
    }
    /* every element a call of one of names, or the reply is text */
    if (!json_array_size(calls) ||
        json_array_size(calls) != (json_is_object(v) ? 1 : json_array_size(v)))
        json_decref(calls), calls = NULL;
    json_decref(v);
    return calls;
}

int rt_oai_tool_patch(const km_buf *src, int sse, json_t *calls, km_buf *out)
{
    if (src->len < (sse ? 8u : 1u)) return KM_EINVAL;
    const char *js = (const char *)src->data + (sse ? 6 : 0);
    json_t *o = json_loadb(js, src->len - (sse ? 8 : 0), 0, NULL);
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    if (!ch) {
        json_decref(o);
        return KM_EINVAL;
    }
    if (sse) {
        json_t *c = json_deep_copy(calls), *one;
        size_t k;
        json_array_foreach(c, k, one)
            json_object_set_new(one, "index", json_integer((json_int_t)k));
        json_object_set_new(ch, "delta", json_pack("{s:o}", "tool_calls", c));
    } else {
        json_t *msg = json_object_get(ch, "message");
        json_object_set_new(msg, "content", json_null());
        json_object_set(msg, "tool_calls", calls);
    }
    char *s = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!s) return KM_ENOMEM;
    int rc = sse ? km_buf_printf(out, "data: %s\n\n", s) : km_buf_printf(out, "%s", s);
    free(s);
    return rc;
}
