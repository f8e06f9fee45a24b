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

int rt_oai_response_format(struct json_t *body, rt_oai_req *r, rt_oai_err *e)
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
