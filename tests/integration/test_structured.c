/*
 * test_structured.c — structured outputs through kvmesh-router in front of a real kvmesh-worker
 * on 127.0.0.1 (docs/structured.md): response_format json_schema and json_object on chat and
 * completions, streamed and not, greedy and sampled. Every output must parse (jansson) and
 * validate against its schema (a validator for the subset written here, independent of the
 * engine's; and Python's jsonschema too when it is installed), and end by itself
 * (finish_reason "stop"). Schemas cover nested objects, arrays of objects, enums, numbers and
 * integers with bounds, a pattern, optional and required fields. A schema the engine cannot
 * enforce, or a malformed response_format, is a 400 that says why. Forced tool calls (tool_choice
 * required or named) come back as tool_calls whose arguments parse and validate. A constrained
 * stream whose worker is SIGKILLed mid-value migrates and ends with the undisturbed output (two
 * workers).
 *
 * Requests go out with curl, all at once, so the worker batches them. Run from the repository
 * root after `make build`; without the default model or curl every test skips and says so.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <regex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "tests/integration/harness.h"

typedef it_proc proc;

static const char *const g_schemas[] = {
    /* a person: strings with bounds, an integer with bounds, an optional field */
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":32},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},\"email\":{\"type\":\"string\","
    "\"maxLength\":40}},\"required\":[\"name\",\"age\"],\"additionalProperties\":false}",
    /* the weather: an enum, a number with bounds, a date by a pattern */
    "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":24},"
    "\"condition\":{\"enum\":[\"sunny\",\"cloudy\",\"rain\",\"snow\"]},\"temp_c\":{\"type\":"
    "\"number\",\"minimum\":-60,\"maximum\":60},\"date\":{\"type\":\"string\",\"pattern\":"
    "\"^\\\\d{4}-\\\\d{2}-\\\\d{2}$\"}},\"required\":[\"city\",\"condition\",\"temp_c\","
    "\"date\"],\"additionalProperties\":false}",
    /* an order: nested objects, an array of objects with bounds */
    "{\"type\":\"object\",\"properties\":{\"customer\":{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"maxLength\":24},\"vip\":{\"type\":\"boolean\"}},\"required\":"
    "[\"name\",\"vip\"]},\"items\":{\"type\":\"array\",\"items\":{\"type\":\"object\","
    "\"properties\":"
    "{\"sku\":{\"type\":\"string\",\"maxLength\":12},\"qty\":{\"type\":\"integer\",\"minimum\":1,"
    "\"maximum\":20},\"price\":{\"type\":\"number\",\"minimum\":0,\"maximum\":1000}},\"required\":"
    "[\"sku\",\"qty\",\"price\"]},\"minItems\":1,\"maxItems\":4}},\"required\":[\"customer\","
    "\"items\"]}",
    /* a configuration: an array of enums, nested integers and numbers with bounds, null or a
     * string */
    "{\"type\":\"object\",\"properties\":{\"mode\":{\"enum\":[\"fast\",\"safe\",\"debug\"]},"
    "\"flags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",\"c\"]},\"maxItems\":3},"
    "\"limits\":{\"type\":\"object\",\"properties\":{\"cpu\":{\"type\":\"integer\",\"minimum\":1,"
    "\"maximum\":64},\"mem_gb\":{\"type\":\"number\",\"exclusiveMinimum\":0,\"maximum\":512}},"
    "\"required\":[\"cpu\",\"mem_gb\"]},\"note\":{\"type\":[\"string\",\"null\"],\"maxLength\":30}}"
    ","
    "\"required\":[\"mode\",\"flags\",\"limits\",\"note\"]}",
};
#define N_SCHEMAS 4

static const char *const g_asks[] = {
    "Tell me about a person called Ana who is 34.",
    "What is the weather like in Oslo today?",
    "Write an order for two books and a pen for Bob.",
    "Give a server configuration.",
};

/* ---------------------------------------------------------------- a validator for the subset */

static bool valid(json_t *v, json_t *s);

static bool valid_number(json_t *v, json_t *s)
{
    double x = json_number_value(v);
    json_t *k;
    if ((k = json_object_get(s, "minimum")) && x < json_number_value(k)) return false;
    if ((k = json_object_get(s, "maximum")) && x > json_number_value(k)) return false;
    if ((k = json_object_get(s, "exclusiveMinimum")) && x <= json_number_value(k)) return false;
    if ((k = json_object_get(s, "exclusiveMaximum")) && x >= json_number_value(k)) return false;
    return true;
}

static bool valid_type(json_t *v, json_t *s, const char *t)
{
    if (!strcmp(t, "null")) return json_is_null(v);
    if (!strcmp(t, "boolean")) return json_is_boolean(v);
    if (!strcmp(t, "integer")) return json_is_integer(v) && valid_number(v, s);
    if (!strcmp(t, "number")) return json_is_number(v) && valid_number(v, s);
    if (!strcmp(t, "string")) {
        json_t *k = json_object_get(s, "maxLength");
        /* characters: bytes that do not continue a UTF-8 sequence */
        size_t n = 0, len = json_string_length(v);
        const unsigned char *p = (const unsigned char *)json_string_value(v);
        for (size_t i = 0; json_is_string(v) && i < len; i++) n += (p[i] & 0xC0) != 0x80;
        return json_is_string(v) && (!k || n <= (size_t)json_integer_value(k));
    }
    if (!strcmp(t, "array")) {
        if (!json_is_array(v)) return false;
        json_t *k, *it = json_object_get(s, "items");
        if ((k = json_object_get(s, "minItems")) &&
            json_array_size(v) < (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "maxItems")) &&
            json_array_size(v) > (size_t)json_integer_value(k))
            return false;
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) if (it && !valid(e, it)) return false;
        return true;
    }
    if (!strcmp(t, "object")) {
        if (!json_is_object(v)) return false;
        json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
        size_t i;
        json_t *e;
        json_array_foreach(req, i, e) if (!json_object_get(v, json_string_value(e))) return false;
        const char *key;
        json_object_foreach(v, key, e)
        {
            json_t *ps = json_object_get(props, key);
            if (ps && !valid(e, ps)) return false;
            if (!ps && json_is_false(json_object_get(s, "additionalProperties"))) return false;
        }
        return true;
    }
    return false;
}

static bool valid(json_t *v, json_t *s)
{
    json_t *en = json_object_get(s, "enum"), *t = json_object_get(s, "type");
    if (en) {
        size_t i;
        json_t *e;
        json_array_foreach(en, i, e) if (json_equal(e, v)) return true;
        return false;
    }
    if (json_is_string(t)) return valid_type(v, s, json_string_value(t));
    size_t i;
    json_t *e;
    json_array_foreach(t, i, e) if (valid_type(v, s, json_string_value(e))) return true;
    return !t;
}

/* ---------------------------------------------------------------- the cluster and requests */

static bool cluster(proc *w, proc *r)
{
    return it_have_curl() && it_router_http_start(r, w, 1, 2, "st", NULL);
}

typedef struct call {
    char body[8192];
    char out[256];
    bool chat, stream;
    int schema; /* -1: json_object */
} call;

/* Sends every call at once (curl in the background), waits for all. */
static void send_all(const proc *r, call *c, int n, const char *dir)
{
    char *script = malloc(1 << 20);
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        char path[256];
        snprintf(path, sizeof path, "%s/body%d.json", dir, i);
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f);
        fputs(c[i].body, f);
        fclose(f);
        snprintf(c[i].out, sizeof c[i].out, "%s/out%d", dir, i);
        len += (size_t)snprintf(script + len, (1 << 20) - len,
                                "curl -sN --max-time 600 -H 'Content-Type: application/json' "
                                "http://127.0.0.1:%d/v1/%s -d @%s > %s &\n",
                                r->http_port, c[i].chat ? "chat/completions" : "completions", path,
                                c[i].out);
    }
    snprintf(script + len, (1 << 20) - len, "wait\n");
    cr_assert_eq(system(script), 0);
    free(script);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    km_buf b = {0};
    char tmp[4096];
    size_t n;
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) km_buf_append(&b, tmp, n);
    fclose(f);
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

/* The generated text of a response (concatenated deltas when streamed) and its finish reason. */
static char *content_of(const call *c, char *finish, size_t cap)
{
    char *raw = slurp(c->out);
    km_buf text = {0};
    finish[0] = 0;
    const char *key = c->chat ? (c->stream ? "delta" : "message") : NULL;
    for (char *line = raw; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        const char *js = c->stream ? (strncmp(line, "data: {", 7) ? NULL : line + 6) : line;
        json_t *o = js ? json_loads(js, 0, NULL) : NULL;
        cr_assert(!js || o, "response not JSON: %s", line);
        json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        json_t *t = key ? json_object_get(json_object_get(ch, key), "content")
                        : json_object_get(ch, "text");
        if (json_is_string(t)) km_buf_append(&text, json_string_value(t), json_string_length(t));
        json_t *fr = json_object_get(ch, "finish_reason");
        if (json_is_string(fr)) snprintf(finish, cap, "%s", json_string_value(fr));
        cr_assert(!json_object_get(o, "error"), "error: %s", line);
        json_decref(o);
        line = nl ? nl + 1 : NULL;
        if (!c->stream) break;
    }
    free(raw);
    km_buf_append(&text, "", 1);
    return (char *)text.data;
}

static void make_call(call *c, int schema, bool chat, bool stream, float temperature, int seed)
{
    char rf[4096];
    if (schema < 0)
        snprintf(rf, sizeof rf, "{\"type\":\"json_object\"}");
    else
        snprintf(rf, sizeof rf,
                 "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"s%d\",\"strict\":true,"
                 "\"schema\":%s}}",
                 schema, g_schemas[schema]);
    const char *ask = g_asks[(schema < 0 ? 0 : schema) % N_SCHEMAS];
    char prompt[512];
    if (chat)
        snprintf(prompt, sizeof prompt,
                 "\"messages\":[{\"role\":\"user\",\"content\":\"%s Answer in JSON.\"}]", ask);
    else
        snprintf(prompt, sizeof prompt, "\"prompt\":\"%s Answer in JSON.\\nJSON:\"", ask);
    snprintf(c->body, sizeof c->body,
             "{%s,\"max_tokens\":400,\"temperature\":%g,\"seed\":%d,\"stream\":%s,"
             "\"response_format\":%s}",
             prompt, temperature, seed, stream ? "true" : "false", rf);
    c->chat = chat;
    c->stream = stream;
    c->schema = schema;
}

static bool have_jsonschema(void)
{
    return !system("python3 -c 'import jsonschema' >/dev/null 2>&1");
}

Test(structured, every_output_parses_and_validates_against_its_schema, .timeout = 900)
{
    proc w, r;
    if (!cluster(&w, &r)) return;
    enum { N = 20 };
    static call c[N];
    int n = 0;
    for (int s = 0; s < N_SCHEMAS; s++) {
        make_call(&c[n++], s, true, false, 0, 1);
        make_call(&c[n++], s, true, true, 0, 2);
        make_call(&c[n++], s, false, false, 0, 3);
        make_call(&c[n++], s, true, false, 0.8f, 40 + s);
    }
    make_call(&c[n++], -1, true, false, 0, 5);
    make_call(&c[n++], -1, true, true, 0.8f, 6);
    make_call(&c[n++], -1, false, false, 0, 7);
    make_call(&c[n++], 3, false, true, 0.8f, 8);
    cr_assert_eq(n, N);
    send_all(&r, c, n, r.dir);
    bool py = have_jsonschema();
    int ok = 0;
    for (int i = 0; i < n; i++) {
        char finish[32];
        char *text = content_of(&c[i], finish, sizeof finish);
        json_error_t je;
        json_t *v = json_loads(text, 0, &je);
        cr_expect_not_null(v, "call %d (schema %d): not JSON (%s): %s", i, c[i].schema, je.text,
                           text);
        json_t *s = c[i].schema < 0 ? json_pack("{s:s}", "type", "object")
                                    : json_loads(g_schemas[c[i].schema], 0, NULL);
        bool good = v && valid(v, s);
        cr_expect(good, "call %d (schema %d): does not validate: %s", i, c[i].schema, text);
        cr_expect_str_eq(finish, "stop", "call %d: finish %s: %s", i, finish, text);
        if (py && v) { /* a second, independent validator */
            char path[256], cmd[1024];
            snprintf(path, sizeof path, "%s/check%d.json", r.dir, i);
            json_t *pair = json_pack("{s:O,s:O}", "schema", s, "value", v);
            json_dump_file(pair, path, 0);
            json_decref(pair);
            snprintf(cmd, sizeof cmd,
                     "python3 -c 'import json,sys,jsonschema; d=json.load(open(sys.argv[1])); "
                     "jsonschema.validate(d[\"value\"], d[\"schema\"])' %s",
                     path);
            cr_expect_eq(system(cmd), 0, "call %d: jsonschema refuses %s", i, text);
        }
        ok += good && !strcmp(finish, "stop");
        json_decref(v);
        json_decref(s);
        free(text);
    }
    cr_expect_eq(ok, n, "%d of %d outputs valid and complete", ok, n);
    it_stop(&r);
    it_stop(&w);
}

Test(structured, schemas_the_engine_cannot_enforce_are_a_400_that_says_why, .timeout = 300)
{
    proc w, r;
    if (!cluster(&w, &r)) return;
    static const struct {
        const char *rf, *needle;
    } cases[] = {
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"schema\":{\"type\":"
         "\"string\",\"pattern\":\"(?=a)\"}}}",
         "lookarounds are not supported"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"schema\":{\"type\":"
         "\"object\",\"required\":[\"x\"]}}}",
         "'x'"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{}}}", "json_schema.name"},
        {"{\"type\":\"yaml\"}", "not supported"},
        {"{\"type\":\"text\"},\"tools\":["
         "{\"type\":\"function\",\"function\":{\"name\":\"f\"}}"
         "],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}",
         "one of the 'tools'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        for (int stream = 0; stream < 2; stream++) {
            call c = {0};
            snprintf(c.body, sizeof c.body,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":%s,"
                     "\"response_format\":%s}",
                     stream ? "true" : "false", cases[i].rf);
            c.chat = true;
            char path[256], cmd[1024];
            snprintf(path, sizeof path, "%s/bad.json", r.dir);
            FILE *f = fopen(path, "w");
            fputs(c.body, f);
            fclose(f);
            snprintf(c.out, sizeof c.out, "%s/bad.out", r.dir);
            snprintf(cmd, sizeof cmd,
                     "curl -s -o %s -w '%%{http_code}' http://127.0.0.1:%d/v1/chat/completions "
                     "-d @%s > %s.code",
                     c.out, r.http_port, path, c.out);
            cr_assert_eq(system(cmd), 0);
            char codepath[300];
            snprintf(codepath, sizeof codepath, "%s.code", c.out);
            char *code = slurp(codepath), *body = slurp(c.out);
            cr_expect_str_eq(code, "400", "case %zu: %s", i, body);
            cr_expect(strstr(body, cases[i].needle) && strstr(body, "invalid_request_error"),
                      "case %zu: '%s' lacks '%s'", i, body, cases[i].needle);
            free(code);
            free(body);
        }
    }
    it_stop(&r);
    it_stop(&w);
}

#define WEATHER                                                                                    \
    "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"The weather " \
    "in a city\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":"          \
    "\"string\",\"maxLength\":20},\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\","      \
    "\"unit\"]}}}"
#define TIME                                                                                       \
    "{\"type\":\"function\",\"function\":{\"name\":\"get_time\",\"parameters\":{\"type\":"         \
    "\"object\",\"properties\":{\"zone\":{\"type\":\"string\",\"maxLength\":20}},\"required\":"    \
    "[\"zone\"]}}}"

/* The first choice of a response (its last chunks folded when streamed): message or delta. */
static json_t *tool_reply(const proc *r, const char *body, bool stream, char *finish, size_t cap)
{
    call c = {0};
    snprintf(c.body, sizeof c.body, "%s", body);
    c.chat = true;
    c.stream = stream;
    send_all(r, &c, 1, r->dir);
    char *raw = slurp(c.out);
    json_t *calls = NULL;
    finish[0] = 0;
    for (char *line = raw; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        const char *js = stream ? (strncmp(line, "data: {", 7) ? NULL : line + 6) : line;
        json_t *o = js ? json_loads(js, 0, NULL) : NULL;
        cr_assert(!js || o, "not JSON: %s", line);
        json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        json_t *tc =
            json_object_get(json_object_get(ch, stream ? "delta" : "message"), "tool_calls");
        if (tc && !calls) calls = json_incref(tc);
        if (!stream && tc) /* a call has no text */
            cr_expect(json_is_null(json_object_get(json_object_get(ch, "message"), "content")));
        json_t *fr = json_object_get(ch, "finish_reason");
        if (json_is_string(fr)) snprintf(finish, cap, "%s", json_string_value(fr));
        json_decref(o);
        line = nl ? nl + 1 : NULL;
        if (!stream) break;
    }
    free(raw);
    return calls;
}

Test(structured, tool_choice_required_or_named_gives_a_call_that_parses, .timeout = 600)
{
    proc w, r;
    if (!cluster(&w, &r)) return;
    json_t *weather = json_loads(WEATHER, 0, NULL);
    json_t *params = json_object_get(json_object_get(weather, "function"), "parameters");
    for (int i = 0; i < 4; i++) {
        char body[4096], finish[32];
        bool stream = i & 1, named = i < 2;
        snprintf(body, sizeof body,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the weather in "
                 "Lisbon?\"}],\"max_tokens\":200,\"temperature\":0,\"stream\":%s,\"tools\":"
                 "[" WEATHER "," TIME "],\"tool_choice\":%s}",
                 stream ? "true" : "false",
                 named ? "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}"
                       : "\"required\"");
        json_t *calls = tool_reply(&r, body, stream, finish, sizeof finish);
        cr_assert_not_null(calls, "case %d: no tool_calls", i);
        json_t *f = json_object_get(json_array_get(calls, 0), "function");
        const char *name = json_string_value(json_object_get(f, "name"));
        cr_assert_str_eq(finish, "tool_calls", "case %d", i);
        cr_assert(!strncmp(json_string_value(json_object_get(json_array_get(calls, 0), "id")),
                           "call_", 5));
        json_t *args = json_loads(json_string_value(json_object_get(f, "arguments")), 0, NULL);
        cr_assert_not_null(args, "case %d: arguments not JSON", i);
        if (named) {
            cr_assert_str_eq(name, "get_weather");
            cr_expect(valid(args, params), "case %d: %s", i,
                      json_string_value(json_object_get(f, "arguments")));
        } else { /* the name read picks the arguments' schema */
            cr_assert(!strcmp(name, "get_weather") || !strcmp(name, "get_time"), "%s", name);
            json_t *tm = json_loads(TIME, 0, NULL);
            json_t *tp = json_object_get(json_object_get(tm, "function"), "parameters");
            cr_expect(valid(args, strcmp(name, "get_time") ? params : tp), "case %d: %s", i,
                      json_string_value(json_object_get(f, "arguments")));
            json_decref(tm);
        }
        json_decref(args);
        json_decref(calls);
    }
    json_decref(weather);
    /* a conversation with a call and its result renders and is answered */
    char body[4096], finish[32];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Lisbon?\"},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\","
             "\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":"
             "\"{\\\"city\\\":\\\"Lisbon\\\",\\\"unit\\\":\\\"c\\\"}\"}}]},{\"role\":\"tool\","
             "\"tool_call_id\":\"call_1\",\"content\":\"21 C, sunny\"}],\"max_tokens\":12,"
             "\"temperature\":0,\"tools\":[" WEATHER "],\"tool_choice\":\"none\"}");
    json_t *none = tool_reply(&r, body, false, finish, sizeof finish);
    cr_expect_null(none);
    cr_expect(!strcmp(finish, "length") || !strcmp(finish, "stop"), "%s", finish);
    it_stop(&r);
    it_stop(&w);
}

/* ---------------------------------------------------------------- grammar extensions */

/* POSTs body to /v1/<path>; the HTTP status, and the response's body in *out (to free). */
static int post(const proc *r, const char *path, const char *body, char **out)
{
    char file[256], cmd[1024], codepath[300];
    snprintf(file, sizeof file, "%s/post.json", r->dir);
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fputs(body, f);
    fclose(f);
    snprintf(codepath, sizeof codepath, "%s/post.code", r->dir);
    snprintf(cmd, sizeof cmd,
             "curl -s -o %s/post.out -w '%%{http_code}' -H 'Content-Type: application/json' "
             "http://127.0.0.1:%d/v1/%s -d @%s > %s",
             r->dir, r->http_port, path, file, codepath);
    cr_assert_eq(system(cmd), 0);
    char *code = slurp(codepath), outpath[300];
    snprintf(outpath, sizeof outpath, "%s/post.out", r->dir);
    *out = slurp(outpath);
    int st = atoi(code);
    free(code);
    return st;
}

/* Whether text matches the POSIX extended regex re, whole. */
static bool matches(const char *re, const char *text)
{
    regex_t x;
    cr_assert_eq(regcomp(&x, re, REG_EXTENDED | REG_NOSUB), 0, "%s", re);
    bool ok = regexec(&x, text, 0, NULL, 0) == 0;
    regfree(&x);
    return ok;
}

Test(structured, grammar_and_regex_extensions_hold_the_output_or_are_a_400, .timeout = 900)
{
    proc w, r;
    if (!cluster(&w, &r)) return;
    static const struct {
        bool chat, stream;
        const char *fields, *check; /* check: a POSIX regex the whole output matches */
    } cases[] = {
        {false, false, "\"prompt\":\"Call me at\",\"guided_regex\":\"\\\\d{3}-\\\\d{4}\"",
         "^[0-9]{3}-[0-9]{4}$"},
        {true, true,
         "\"messages\":[{\"role\":\"user\",\"content\":\"Is the sky blue?\"}],"
         "\"guided_grammar\":\"root ::= \\\"The answer is \\\" (\\\"yes\\\" | \\\"no\\\") "
         "\\\".\\\"\\n\"",
         "^The answer is (yes|no)\\.$"},
        {true, false,
         "\"messages\":[{\"role\":\"user\",\"content\":\"Name a color.\"}],"
         "\"guided_choice\":[\"red\",\"green\",\"blue\\\"ish\"]",
         "^(red|green|blue\"ish)$"},
        {false, true,
         "\"prompt\":\"Three fruits:\",\"grammar\":\"# llama-server's field\\nroot ::= \\\"[\\\" "
         "word (\\\",\\\" word){0,3} \\\"]\\\"\\nword ::= [a-z]{1,8}\\n\"",
         "^\\[[a-z]{1,8}(,[a-z]{1,8}){0,3}\\]$"},
        {true, false,
         "\"messages\":[{\"role\":\"user\",\"content\":\"Do cats purr?\"}],"
         "\"structured_outputs\":{\"regex\":\"(yes|no), because [a-z ]{1,30}\\\\.\"}",
         "^(yes|no), because [a-z ]{1,30}\\.$"},
        {false, false,
         "\"prompt\":\"A famous person:\",\"temperature\":0.9,\"seed\":7,"
         "\"regex\":\"[A-Z][a-z]{2,10} [A-Z][a-zé]{2,10}\"",
         "^[A-Z][a-z]{2,10} [A-Z][a-z\xc3\xa9]{2,10}$"},
    };
    enum { N = sizeof cases / sizeof *cases };
    static call c[N];
    for (int i = 0; i < N; i++) {
        snprintf(c[i].body, sizeof c[i].body, "{%s,\"max_tokens\":100,\"stream\":%s%s}",
                 cases[i].fields, cases[i].stream ? "true" : "false",
                 strstr(cases[i].fields, "temperature") ? "" : ",\"temperature\":0");
        c[i].chat = cases[i].chat;
        c[i].stream = cases[i].stream;
    }
    send_all(&r, c, N, r.dir);
    for (int i = 0; i < N; i++) {
        char finish[32];
        char *text = content_of(&c[i], finish, sizeof finish);
        cr_expect(matches(cases[i].check, text), "case %d: '%s' does not match %s", i, text,
                  cases[i].check);
        cr_expect_str_eq(finish, "stop", "case %d: %s", i, text);
        free(text);
    }
    static const struct {
        const char *fields, *needle;
    } bad[] = {
        {"\"guided_grammar\":\"root ::= a\\na ::= a \\\"x\\\" | \\\"y\\\"\"",
         "left recursion through rule 'a'"},
        {"\"guided_grammar\":\"root ::= thing\"", "rule 'thing' is used but not defined"},
        {"\"ebnf\":\"root ::= [z-a]\"", "line 1: a character range out of order"},
        {"\"guided_regex\":\"(?=a)b\"", "lookaround"},
        {"\"guided_regex\":5", "'guided_regex' must be a non-empty string"},
        {"\"guided_choice\":[]", "'guided_choice' must be a list of 1 to 256 strings"},
        {"\"guided_regex\":\"a\",\"response_format\":{\"type\":\"json_object\"}",
         "together are not supported"},
        {"\"guided_regex\":\"a\",\"regex\":\"b\"", "one grammar at a time"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        for (int stream = 0; stream < 2; stream++) {
            char body[1024], *out;
            snprintf(body, sizeof body,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":%s,%s}",
                     stream ? "true" : "false", bad[i].fields);
            int st = post(&r, "chat/completions", body, &out);
            cr_expect_eq(st, 400, "bad %zu: %d %s", i, st, out);
            cr_expect(strstr(out, bad[i].needle) && strstr(out, "invalid_request_error"),
                      "bad %zu: '%s' lacks '%s'", i, out, bad[i].needle);
            free(out);
        }
    it_stop(&r);
    it_stop(&w);
}

/* Every choice of an n > 1 response that must call a tool is a call of its own. */
Test(structured, tool_calls_with_n_give_each_choice_its_own_call, .timeout = 600)
{
    proc w, r;
    if (!cluster(&w, &r)) return;
    for (int stream = 0; stream < 2; stream++) {
        char body[4096], *out;
        snprintf(body, sizeof body,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the weather in "
                 "Lisbon?\"}],\"max_tokens\":200,\"temperature\":0.8,\"seed\":3,\"n\":3,"
                 "\"stream\":%s,\"tools\":[" WEATHER "," TIME "],\"tool_choice\":\"required\"}",
                 stream ? "true" : "false");
        cr_assert_eq(post(&r, "chat/completions", body, &out), 200, "%s", out);
        json_t *calls[3] = {0};
        const char *finish[3] = {0};
        char fin[3][32] = {{0}};
        for (char *line = out; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            const char *js = stream ? (strncmp(line, "data: {", 7) ? NULL : line + 6) : line;
            json_t *o = js ? json_loads(js, 0, NULL) : NULL;
            cr_assert(!js || o, "not JSON: %s", line);
            size_t k;
            json_t *ch;
            json_array_foreach(json_object_get(o, "choices"), k, ch)
            {
                json_int_t i = json_integer_value(json_object_get(ch, "index"));
                cr_assert(i >= 0 && i < 3, "%s", line);
                json_t *tc = json_object_get(json_object_get(ch, stream ? "delta" : "message"),
                                             "tool_calls");
                if (tc) {
                    cr_assert_null(calls[i], "choice %d: two calls", (int)i);
                    calls[i] = json_incref(tc);
                }
                json_t *fr = json_object_get(ch, "finish_reason");
                if (json_is_string(fr))
                    snprintf(fin[i], sizeof fin[i], "%s", json_string_value(fr)),
                        finish[i] = fin[i];
            }
            json_decref(o);
            line = nl ? nl + 1 : NULL;
            if (!stream) break;
        }
        const char *ids[3] = {0};
        for (int i = 0; i < 3; i++) {
            cr_assert_not_null(calls[i], "stream %d choice %d: no tool_calls: %s", stream, i, out);
            cr_expect_str_eq(finish[i] ? finish[i] : "", "tool_calls", "choice %d", i);
            json_t *f = json_object_get(json_array_get(calls[i], 0), "function");
            const char *name = json_string_value(json_object_get(f, "name"));
            cr_expect(name && (!strcmp(name, "get_weather") || !strcmp(name, "get_time")));
            json_t *args = json_loads(json_string_value(json_object_get(f, "arguments")), 0, NULL);
            cr_expect(json_is_object(args), "choice %d: arguments not an object", i);
            json_decref(args);
            ids[i] = json_string_value(json_object_get(json_array_get(calls[i], 0), "id"));
            for (int k = 0; k < i; k++) cr_expect(ids[k] && ids[i] && strcmp(ids[k], ids[i]));
        }
        for (int i = 0; i < 3; i++) json_decref(calls[i]);
        free(out);
    }
    it_stop(&r);
    it_stop(&w);
}

/* ---------------------------------------------------------------- migration */

typedef struct killer {
    proc *w;
    const proc *r;
    int at, killed;
} killer;

/* At the at-th token, SIGKILLs the worker the router says has a request in flight. */
static int kill_at(void *user, uint32_t index, int32_t token, const char *text, size_t len)
{
    killer *k = user;
    if ((int)index != k->at) return 0;
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/status", k->r->http_port);
    km_buf b = {0};
    int st = 0;
    km_errbuf err = {{0}};
    cr_assert_eq(kvm_http_get(url, 5000, &b, &st, &err), 0, "%s", err.msg);
    json_t *o = json_loadb((const char *)b.data, b.len, 0, NULL), *wj;
    km_buf_free(&b);
    size_t i;
    json_array_foreach(json_object_get(o, "workers"), i, wj)
    {
        if (json_integer_value(json_object_get(wj, "inflight")) > 0) k->killed = (int)i;
    }
    json_decref(o);
    cr_assert_geq(k->killed, 0, "no worker has the request in flight");
    kill(k->w[k->killed].pid, SIGKILL);
    it_wait_exit(&k->w[k->killed], 5000);
    return 0;
}

/* parallel_tool_calls true with a forced call: the reply is 1 to 8 calls, each of a listed
 * function with object arguments, ids distinct, streamed with their index. */
Test(structured, parallel_tool_calls_give_an_array_of_calls, .timeout = 600)
{
    proc w, r;
    if (!cluster(&w, &r)) return;
    for (int stream = 0; stream < 2; stream++) {
        char body[4096], *out;
        snprintf(body, sizeof body,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"What are the weather and the "
                 "time in Lisbon and in Paris?\"}],\"max_tokens\":300,\"temperature\":0,"
                 "\"stream\":%s,\"tools\":[" WEATHER "," TIME "],\"tool_choice\":\"required\","
                 "\"parallel_tool_calls\":true}",
                 stream ? "true" : "false");
        cr_assert_eq(post(&r, "chat/completions", body, &out), 200, "%s", out);
        json_t *calls = NULL;
        for (char *line = out; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            const char *js = stream ? (strncmp(line, "data: {", 7) ? NULL : line + 6) : line;
            json_t *o = js ? json_loads(js, 0, NULL) : NULL;
            json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
            json_t *tc =
                json_object_get(json_object_get(ch, stream ? "delta" : "message"), "tool_calls");
            if (tc) {
                cr_assert_null(calls, "two tool_calls parts: %s", out);
                calls = json_incref(tc);
            }
            json_decref(o);
            line = nl ? nl + 1 : NULL;
            if (!stream) break;
        }
        cr_assert_not_null(calls, "stream %d: no tool_calls", stream);
        size_t n = json_array_size(calls);
        cr_assert(n >= 1 && n <= 8, "%zu calls", n);
        for (size_t k = 0; k < n; k++) {
            json_t *c = json_array_get(calls, k), *f = json_object_get(c, "function");
            const char *name = json_string_value(json_object_get(f, "name"));
            cr_expect(name && (!strcmp(name, "get_weather") || !strcmp(name, "get_time")));
            json_t *args = json_loads(json_string_value(json_object_get(f, "arguments")), 0, NULL);
            cr_expect(json_is_object(args), "call %zu: arguments not an object", k);
            json_decref(args);
            if (stream)
                cr_expect_eq(json_integer_value(json_object_get(c, "index")), (json_int_t)k);
            for (size_t j = 0; j < k; j++)
                cr_expect(strcmp(json_string_value(json_object_get(json_array_get(calls, j), "id")),
                                 json_string_value(json_object_get(c, "id"))),
                          "calls %zu and %zu share an id", j, k);
        }
        fprintf(stderr, "parallel_tool_calls (stream %d): %zu calls\n", stream, n);
        json_decref(calls);
        free(out);
    }
    it_stop(&r);
    it_stop(&w);
}

Test(structured, a_constrained_stream_whose_worker_is_killed_continues_its_grammar, .timeout = 600)
{
    proc w[2], r;
    if (!it_router_http_start(&r, w, 2, 1, "st", NULL)) return;
    kvm_client *c = NULL;
    km_errbuf err = {{0}};
    kvm_opts o = {.timeout_ms = 120000};
    cr_assert_eq(kvm_open(r.front, &o, &c, &err), 0, "%s", err.msg);
    km_msg_request q;
    kvm_request_init(&q);
    q.prompt = "<|im_start|>user\nWrite an order for two books and a pen for Bob as JSON."
               "<|im_end|>\n<|im_start|>assistant\n";
    q.temperature = 0;
    q.max_tokens = 300;
    q.stream = true;
    q.speculate = KM_SPECULATE_OFF; /* one token a step: the kill lands mid-value */
    q.grammar = g_schemas[2];
    kvm_result ref, got;
    for (uint64_t dl = it_deadline(30000);;) { /* both workers up at the router */
        int rc = kvm_generate(c, &q, NULL, NULL, &ref, &err);
        if (!rc) break;
        kvm_result_free(&ref);
        cr_assert(it_poll(dl), "no answer: %s", err.msg);
    }
    cr_assert_eq(ref.finish, KM_FINISH_STOP);
    cr_assert_gt(ref.completion_tokens, 20);
    killer k = {w, &r, 10, -1};
    cr_assert_eq(kvm_generate(c, &q, kill_at, &k, &got, &err), 0, "%s", err.msg);
    cr_assert_eq(got.error_code, 0, "%s", got.error);
    cr_assert_eq(got.migrations, 1u);
    cr_assert(got.text.len == ref.text.len && !memcmp(got.text.data, ref.text.data, got.text.len),
              "migrated output differs:\n%.*s\n---\n%.*s", (int)got.text.len,
              (const char *)got.text.data, (int)ref.text.len, (const char *)ref.text.data);
    json_t *v = json_loadb((const char *)got.text.data, got.text.len, 0, NULL),
           *s = json_loads(g_schemas[2], 0, NULL);
    cr_assert(v && valid(v, s), "%.*s", (int)got.text.len, (const char *)got.text.data);
    json_decref(v);
    json_decref(s);
    kvm_result_free(&ref);
    kvm_result_free(&got);
    kvm_close(c);
    it_stop(&r);
    for (int i = 0; i < 2; i++) it_stop(&w[i]);
}
