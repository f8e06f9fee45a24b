/*
 * grammar_schema.c — a JSON Schema read and compiled into the grammar's nodes (grammar_internal.h),
 * for en_grammar_compile (engine.h).
 *
 * The schema text is parsed here by a small strict JSON reader of its own rather than jansson:
 * the engine links no JSON library (make check-links), and the reader is what tests/fuzz/
 * fuzz_grammar.c fuzzes. Keywords that would change what is valid and that the automaton cannot
 * enforce (pattern, multipleOf, allOf, not, uniqueItems, ...) are refused with a message naming
 * them, never ignored; annotations (title, description, default, examples, format) are ignored.
 * Local references ("#", "#/$defs/X", "#/definitions/X") are compiled once each, so a recursive
 * schema becomes a cycle of nodes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

/* ---------------------------------------------------------------- JSON reader */

typedef enum { JV_NULL, JV_FALSE, JV_TRUE, JV_NUM, JV_STR, JV_ARR, JV_OBJ } jv_type;

typedef struct jv {
    jv_type type;
    char *s; /* string (decoded, NUL-terminated) or number (its text) */
    size_t len;
    double num;
    int n;
    struct jv *kids; /* array items, object values */
    char **keys;     /* object keys */
    int node;        /* the node compiled from it (schemas reached by $ref); -1: none */
} jv;

typedef struct jrd {
    const char *p, *end;
    km_errbuf *err;
    int depth;
} jrd;

#define JV_MAX_DEPTH 64

static void jv_clear(jv *v)
{
    for (int i = 0; i < v->n; i++) {
        jv_clear(&v->kids[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->kids);
    free(v->keys);
    free(v->s);
}

static void jrd_ws(jrd *r)
{
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r'))
        r->p++;
}

static int jrd_fail(jrd *r, const char *what)
{
    return km_errf(r->err, KM_EFORMAT, "schema: invalid JSON: %s", what);
}

static int jrd_hex(jrd *r, unsigned *out)
{
    if (r->end - r->p < 4) return jrd_fail(r, "short \\u escape");
    unsigned x = 0;
    for (int i = 0; i < 4; i++) {
        char c = *r->p++;
        x <<= 4;
        if (c >= '0' && c <= '9')
            x |= (unsigned)(c - '0');
        else if ((c | 32) >= 'a' && (c | 32) <= 'f')
            x |= (unsigned)((c | 32) - 'a' + 10);
        else
            return jrd_fail(r, "bad \\u escape");
    }
    *out = x;
    return 0;
}

static size_t utf8_put(char *o, unsigned cp)
{
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | ((cp >> 6) & 63));
        o[2] = (char)(0x80 | (cp & 63));
        return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | ((cp >> 12) & 63));
    o[2] = (char)(0x80 | ((cp >> 6) & 63)), o[3] = (char)(0x80 | (cp & 63));
    return 4;
}

/* A string after its opening quote; decoded into *out (its length *len). */
static int jrd_str(jrd *r, char **out, size_t *len)
{
    const char *q = r->p;
    while (q < r->end && *q != '"') q += *q == '\\' ? 2 : 1;
    if (q >= r->end) return jrd_fail(r, "unterminated string");
    char *s = malloc((size_t)(q - r->p) + 1), *o = s;
    if (!s) return km_errf(r->err, KM_ENOMEM, "schema: out of memory");
    while (*r->p != '"') {
        unsigned char c = (unsigned char)*r->p++;
        if (c < 0x20) {
            free(s);
            return jrd_fail(r, "control character in a string");
        }
        if (c != '\\') {
            *o++ = (char)c;
            continue;
        }
        char e = *r->p++;
        const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t", *at = strchr(from, e);
        unsigned cp, lo;
        if (e && at) {
            *o++ = to[at - from];
        } else if (e == 'u' && !jrd_hex(r, &cp)) {
            if (cp >= 0xD800 && cp < 0xDC00 && r->end - r->p >= 6 && r->p[0] == '\\' &&
                r->p[1] == 'u') {
                r->p += 2;
                if (jrd_hex(r, &lo) || lo < 0xDC00 || lo > 0xDFFF) {
                    free(s);
                    return jrd_fail(r, "bad surrogate pair");
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            o += utf8_put(o, cp); /* 6 escape bytes always cover the 4 written */
        } else {
            free(s);
            return jrd_fail(r, "bad escape");
        }
    }
    r->p++;
    *o = 0;
    *out = s;
    *len = (size_t)(o - s);
    return 0;
}

static int jrd_value(jrd *r, jv *v);

static int jrd_push(jrd *r, jv *v, char *key)
{
    if (v->n % 8 == 0) {
        jv *k = realloc(v->kids, sizeof *k * (size_t)(v->n + 8));
        if (k) v->kids = k;
        char **ks = v->type == JV_OBJ ? realloc(v->keys, sizeof *ks * (size_t)(v->n + 8)) : NULL;
        if (ks) v->keys = ks;
        if (!k || (v->type == JV_OBJ && !ks)) {
            free(key);
            return km_errf(r->err, KM_ENOMEM, "schema: out of memory");
        }
    }
    if (v->type == JV_OBJ) v->keys[v->n] = key;
    jv *kid = &v->kids[v->n++];
    memset(kid, 0, sizeof *kid);
    return jrd_value(r, kid);
}

static int jrd_container(jrd *r, jv *v, char close)
{
    if (++r->depth > JV_MAX_DEPTH) return jrd_fail(r, "nested too deep");
    jrd_ws(r);
    if (r->p < r->end && *r->p == close) return r->p++, r->depth--, 0;
    for (;;) {
        char *key = NULL;
        if (close == '}') {
            size_t kl;
            jrd_ws(r);
            if (r->p >= r->end || *r->p++ != '"') return jrd_fail(r, "expected a key");
            int rc = jrd_str(r, &key, &kl);
            if (rc) return rc;
            jrd_ws(r);
            if (r->p >= r->end || *r->p++ != ':') {
                free(key);
                return jrd_fail(r, "expected ':'");
            }
        }
        int rc = jrd_push(r, v, key);
        if (rc) return rc;
        jrd_ws(r);
        if (r->p < r->end && *r->p == ',') {
            r->p++;
            continue;
        }
        if (r->p < r->end && *r->p == close) return r->p++, r->depth--, 0;
        return jrd_fail(r, close == '}' ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int jrd_number(jrd *r, jv *v)
{
    const char *s = r->p;
    if (r->p < r->end && *r->p == '-') r->p++;
    if (r->p >= r->end || *r->p < '0' || *r->p > '9') return jrd_fail(r, "bad number");
    if (*r->p == '0')
        r->p++;
    else
        while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    if (r->p < r->end && *r->p == '.') {
        if (++r->p >= r->end || *r->p < '0' || *r->p > '9') return jrd_fail(r, "bad number");
        while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    }
    if (r->p < r->end && (*r->p | 32) == 'e') {
        r->p++;
        if (r->p < r->end && (*r->p == '+' || *r->p == '-')) r->p++;
        if (r->p >= r->end || *r->p < '0' || *r->p > '9') return jrd_fail(r, "bad number");
        while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    }
    v->type = JV_NUM;
    v->len = (size_t)(r->p - s);
    if (!(v->s = strndup(s, v->len))) return km_errf(r->err, KM_ENOMEM, "schema: out of memory");
    v->num = strtod(v->s, NULL);
    return 0;
}

static int jrd_value(jrd *r, jv *v)
{
    v->node = -1;
    jrd_ws(r);
    if (r->p >= r->end) return jrd_fail(r, "unexpected end");
    static const struct {
        const char *word;
        jv_type type;
    } words[] = {{"null", JV_NULL}, {"false", JV_FALSE}, {"true", JV_TRUE}};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(words[i].word);
        if ((size_t)(r->end - r->p) >= n && !memcmp(r->p, words[i].word, n)) {
            r->p += n;
            v->type = words[i].type;
            return 0;
        }
    }
    char c = *r->p;
    if (c == '"') return r->p++, v->type = JV_STR, jrd_str(r, &v->s, &v->len);
    if (c == '{') return r->p++, v->type = JV_OBJ, jrd_container(r, v, '}');
    if (c == '[') return r->p++, v->type = JV_ARR, jrd_container(r, v, ']');
    return jrd_number(r, v);
}

static const jv *jv_get(const jv *o, const char *key)
{
    if (o->type != JV_OBJ) return NULL;
    for (int i = 0; i < o->n; i++)
        if (!strcmp(o->keys[i], key)) return &o->kids[i];
    return NULL;
}

/* ---------------------------------------------------------------- compiler */

typedef struct gcomp {
    en_grammar *g;
    jv *root;
    km_errbuf *err;
    int depth;
} gcomp;

static int gn_new(gcomp *c, en_gn_kind kind)
{
    en_grammar *g = c->g;
    if (g->n_nodes == g->cap_nodes) {
        int cap = g->cap_nodes ? g->cap_nodes * 2 : 16;
        en_gn *n = realloc(g->nodes, sizeof *n * (size_t)cap);
        if (!n) return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
        g->nodes = n;
        g->cap_nodes = cap;
    }
    en_gn *n = &g->nodes[g->n_nodes];
    memset(n, 0, sizeof *n);
    n->kind = kind;
    n->max_items = n->max_len = -1;
    n->items = n->addl = -1;
    return g->n_nodes++;
}

/* A JSON value as the text the output must carry: strings escaped the way JSON allows. */
static char *lit_text(const jv *v)
{
    if (v->type == JV_NULL) return strdup("null");
    if (v->type == JV_TRUE) return strdup("true");
    if (v->type == JV_FALSE) return strdup("false");
    if (v->type == JV_NUM) return strdup(v->s);
    if (v->type != JV_STR) return NULL;
    char *s = malloc(v->len * 6 + 3), *o = s;
    if (!s) return NULL;
    *o++ = '"';
    for (size_t i = 0; i < v->len; i++) {
        unsigned char ch = (unsigned char)v->s[i];
        if (ch == '"' || ch == '\\')
            *o++ = '\\', *o++ = (char)ch;
        else if (ch < 0x20)
            o += sprintf(o, "\\u%04x", ch);
        else
            *o++ = (char)ch;
    }
    *o++ = '"';
    *o = 0;
    return s;
}

static int gn_enum(gcomp *c, const jv *vals, int n, const char *kw)
{
    if (n < 1 || n > EN_GN_MAX_PROPS)
        return km_errf(c->err, KM_EUNSUPPORTED, "schema: '%s' needs 1 to %d values", kw,
                       EN_GN_MAX_PROPS);
    int id = gn_new(c, EN_GN_ENUM);
    if (id < 0) return id;
    char **lits = calloc((size_t)n, sizeof *lits);
    if (!lits) return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
    c->g->nodes[id].lits = lits;
    c->g->nodes[id].n_lits = n;
    for (int i = 0; i < n; i++) {
        if (vals[i].type == JV_ARR || vals[i].type == JV_OBJ)
            return km_errf(c->err, KM_EUNSUPPORTED,
                           "schema: '%s' values must be strings, numbers, booleans or null", kw);
        if (!(lits[i] = lit_text(&vals[i])))
            return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
    }
    return id;
}

/* boolean: true or false; null: null */
static int gn_words(gcomp *c, int boolean)
{
    jv v[2] = {{.type = boolean ? JV_TRUE : JV_NULL}, {.type = JV_FALSE}};
    return gn_enum(c, v, boolean ? 2 : 1, "type");
}

static int gn_schema(gcomp *c, jv *s);

static int gn_int_kw(gcomp *c, const jv *s, const char *kw, int *out)
{
    const jv *v = jv_get(s, kw);
    if (!v) return 0;
    if (v->type != JV_NUM || v->num < 0 || v->num > 1e9 || v->num != (double)(int)v->num)
        return km_errf(c->err, KM_EINVAL, "schema: '%s' must be a non-negative integer", kw);
    *out = (int)v->num;
    return 0;
}

static int gn_num_kw(gcomp *c, const jv *s, const char *kw, int *has, double *out)
{
    const jv *v = jv_get(s, kw);
    if (!v) return 0;
    if (v->type != JV_NUM)
        return km_errf(c->err, KM_EUNSUPPORTED, "schema: '%s' must be a number", kw);
    *has = 1;
    *out = v->num;
    return 0;
}

static int gn_object(gcomp *c, jv *s)
{
    jv *props = (jv *)jv_get(s, "properties");
    const jv *req = jv_get(s, "required"), *addl = jv_get(s, "additionalProperties");
    if (props && props->type != JV_OBJ)
        return km_errf(c->err, KM_EINVAL, "schema: 'properties' must be an object");
    if (req && req->type != JV_ARR)
        return km_errf(c->err, KM_EINVAL, "schema: 'required' must be an array");
    int np = props ? props->n : 0;
    if (np > EN_GN_MAX_PROPS)
        return km_errf(c->err, KM_EUNSUPPORTED, "schema: more than %d properties in one object",
                       EN_GN_MAX_PROPS);
    int id = gn_new(c, EN_GN_OBJECT);
    if (id < 0) return id;
    en_gn *n = &c->g->nodes[id];
    n->n_props = np;
    n->keys = calloc((size_t)np + 1, sizeof *n->keys);
    n->props = calloc((size_t)np + 1, sizeof *n->props);
    if (!n->keys || !n->props) return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
    for (int i = 0; i < np; i++) {
        jv key = {.type = JV_STR, .s = props->keys[i], .len = strlen(props->keys[i])};
        if (!(c->g->nodes[id].keys[i] = lit_text(&key)))
            return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
        int kid = gn_schema(c, &props->kids[i]);
        if (kid < 0) return kid;
        c->g->nodes[id].props[i] = kid;
    }
    for (int i = 0; req && i < req->n; i++) {
        int at = -1;
        for (int j = 0; j < np && req->kids[i].type == JV_STR; j++)
            if (!strcmp(props->keys[j], req->kids[i].s)) at = j;
        if (at < 0)
            return km_errf(c->err, KM_EUNSUPPORTED,
                           "schema: required property '%.64s' is not among 'properties'",
                           req->kids[i].type == JV_STR ? req->kids[i].s : "?");
        c->g->nodes[id].required |= 1ull << at;
    }
    /* With no properties listed, any keys (additionalProperties: a schema for their values). */
    if (!np && !(addl && addl->type == JV_FALSE)) {
        int v = addl && addl->type == JV_OBJ ? gn_schema(c, (jv *)addl) : c->g->any_val;
        if (v < 0) return v;
        c->g->nodes[id].any_keys = 1;
        c->g->nodes[id].addl = v;
    }
    return id;
}

static int gn_typed(gcomp *c, jv *s, const char *type)
{
    int id, rc = 0;
    if (!strcmp(type, "object")) return gn_object(c, s);
    if (!strcmp(type, "boolean")) return gn_words(c, 1);
    if (!strcmp(type, "null")) return gn_words(c, 0);
    if (!strcmp(type, "array")) {
        jv *items = (jv *)jv_get(s, "items");
        int it = items ? gn_schema(c, items) : c->g->any_val;
        if (it < 0) return it;
        if ((id = gn_new(c, EN_GN_ARRAY)) < 0) return id;
        en_gn *n = &c->g->nodes[id];
        n->items = it;
        rc = gn_int_kw(c, s, "minItems", &n->min_items);
        if (!rc) rc = gn_int_kw(c, s, "maxItems", &n->max_items);
        if (!rc && n->max_items >= 0 && n->max_items < n->min_items)
            rc = km_errf(c->err, KM_EINVAL, "schema: maxItems below minItems");
        return rc ? rc : id;
    }
    if (!strcmp(type, "string")) {
        if ((id = gn_new(c, EN_GN_STRING)) < 0) return id;
        en_gn *n = &c->g->nodes[id];
        rc = gn_int_kw(c, s, "minLength", &n->min_len);
        if (!rc) rc = gn_int_kw(c, s, "maxLength", &n->max_len);
        if (!rc && n->max_len >= 0 && n->max_len < n->min_len)
            rc = km_errf(c->err, KM_EINVAL, "schema: maxLength below minLength");
        const jv *pat = jv_get(s, "pattern");
        if (!rc && pat && pat->type != JV_STR)
            rc = km_errf(c->err, KM_EINVAL, "schema: 'pattern' must be a string");
        if (!rc && pat) rc = en_re_compile(pat->s, pat->len, &c->g->nodes[id].re, c->err);
        return rc ? rc : id;
    }
    if (!strcmp(type, "number") || !strcmp(type, "integer")) {
        if ((id = gn_new(c, type[0] == 'n' ? EN_GN_NUMBER : EN_GN_INTEGER)) < 0) return id;
        en_gn *n = &c->g->nodes[id];
        int hx = 0, hy = 0;
        double x = 0, y = 0;
        rc = gn_num_kw(c, s, "minimum", &n->has_min, &n->min);
        if (!rc) rc = gn_num_kw(c, s, "maximum", &n->has_max, &n->max);
        if (!rc) rc = gn_num_kw(c, s, "exclusiveMinimum", &hx, &x);
        if (!rc) rc = gn_num_kw(c, s, "exclusiveMaximum", &hy, &y);
        if (rc) return rc;
        if (hx && (!n->has_min || x >= n->min)) n->has_min = n->excl_min = 1, n->min = x;
        if (hy && (!n->has_max || y <= n->max)) n->has_max = n->excl_max = 1, n->max = y;
        if (n->has_min && n->has_max && n->min > n->max)
            return km_errf(c->err, KM_EINVAL, "schema: minimum above maximum");
        return id;
    }
    return km_errf(c->err, KM_EUNSUPPORTED, "schema: unknown type '%.32s'", type);
}

/* The alternatives of anyOf/oneOf or a list of types, which must start with different bytes. */
/* Objects whose first property is required, has the same key in all and one constant value,
 * different in each (a discriminated union, as a list of tool calls is): one object frame that
 * becomes the chosen branch's once the constant is read. 0 when alts are not such objects. */
static int gn_switch(gcomp *c, const int *alts, int n)
{
    const en_gn *x = c->g->nodes;
    for (int i = 0; i < n; i++) {
        const en_gn *a = &x[alts[i]], *t = a->n_props ? &x[a->props[0]] : NULL;
        if (a->kind != EN_GN_OBJECT || !t || !(a->required & 1) || t->kind != EN_GN_ENUM ||
            t->n_lits != 1 || strcmp(a->keys[0], x[alts[0]].keys[0]))
            return 0;
        for (int j = 0; j < i; j++)
            if (!strcmp(t->lits[0], x[x[alts[j]].props[0]].lits[0])) return 0;
    }
    jv tags[8];
    for (int i = 0; i < n; i++) tags[i] = (jv){.type = JV_NULL};
    int tag = gn_enum(c, tags, n, "anyOf"), id = tag >= 0 ? gn_new(c, EN_GN_SWITCH) : tag;
    if (id < 0) return id;
    en_gn *tg = &c->g->nodes[tag], *sw = &c->g->nodes[id];
    for (int i = 0; i < n; i++) { /* the constants, as their texts */
        free(tg->lits[i]);
        tg->lits[i] = strdup(c->g->nodes[c->g->nodes[alts[i]].props[0]].lits[0]);
    }
    sw->keys = calloc(1, sizeof *sw->keys);
    sw->props = calloc(1, sizeof *sw->props);
    sw->alts = malloc(sizeof(int) * (size_t)n);
    if (!sw->keys || !sw->props || !sw->alts ||
        !(sw->keys[0] = strdup(c->g->nodes[alts[0]].keys[0])))
        return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
    for (int i = 0; i < n; i++)
        if (!tg->lits[i]) return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
    sw->n_props = 1;
    sw->props[0] = tag;
    sw->required = 1;
    memcpy(sw->alts, alts, sizeof(int) * (size_t)n);
    sw->n_alts = n;
    return id;
}

static int gn_alt(gcomp *c, int *alts, int n)
{
    int sw = gn_switch(c, alts, n);
    if (sw) return sw;
    uint64_t seen[4] = {0};
    for (int i = 0; i < n; i++) {
        uint64_t f[4];
        en_gn_first(c->g, alts[i], f);
        for (int w = 0; w < 4; w++) {
            if (seen[w] & f[w])
                return km_errf(c->err, KM_EUNSUPPORTED,
                               "schema: anyOf/oneOf/type alternatives must differ in their first "
                               "character (e.g. a string and null; two objects do not)");
            seen[w] |= f[w];
        }
    }
    int id = gn_new(c, EN_GN_ALT);
    if (id < 0) return id;
    if (!(c->g->nodes[id].alts = malloc(sizeof(int) * (size_t)n)))
        return km_errf(c->err, KM_ENOMEM, "schema: out of memory");
    memcpy(c->g->nodes[id].alts, alts, sizeof(int) * (size_t)n);
    c->g->nodes[id].n_alts = n;
    return id;
}

static int gn_ref(gcomp *c, const jv *ref)
{
    if (ref->type != JV_STR) return km_errf(c->err, KM_EINVAL, "schema: '$ref' must be a string");
    jv *t = NULL;
    if (!strcmp(ref->s, "#")) {
        t = c->root;
    } else {
        const char *pre[] = {"#/$defs/", "#/definitions/"}, *key[] = {"$defs", "definitions"};
        for (int i = 0; i < 2 && !t; i++) {
            size_t n = strlen(pre[i]);
            const jv *defs = jv_get(c->root, key[i]);
            if (!strncmp(ref->s, pre[i], n) && defs) t = (jv *)jv_get(defs, ref->s + n);
        }
    }
    if (!t)
        return km_errf(c->err, KM_EUNSUPPORTED,
                       "schema: '$ref' '%.64s' is not a local #/$defs/ or #/definitions/ entry",
                       ref->s);
    return gn_schema(c, t);
}

static const char *const gn_refused[] = {"allOf",
                                         "not",
                                         "if",
                                         "then",
                                         "else",
                                         "patternProperties",
                                         "propertyNames",
                                         "multipleOf",
                                         "uniqueItems",
                                         "contains",
                                         "prefixItems",
                                         "minProperties",
                                         "maxProperties",
                                         "dependentRequired",
                                         "dependentSchemas",
                                         "dependencies",
                                         "unevaluatedProperties",
                                         "unevaluatedItems",
                                         "additionalItems",
                                         "$dynamicRef",
                                         "$anchor"};

static int gn_schema_body(gcomp *c, jv *s)
{
    if (s->type == JV_TRUE) return c->g->any_val;
    if (s->type != JV_OBJ)
        return km_errf(c->err, KM_EINVAL, "schema: a schema must be an object or true");
    for (size_t i = 0; i < sizeof gn_refused / sizeof *gn_refused; i++)
        if (jv_get(s, gn_refused[i]))
            return km_errf(c->err, KM_EUNSUPPORTED, "schema: keyword '%s' is not supported",
                           gn_refused[i]);
    const jv *v;
    if ((v = jv_get(s, "$ref"))) return gn_ref(c, v);
    if ((v = jv_get(s, "const"))) return gn_enum(c, v, 1, "const");
    if ((v = jv_get(s, "enum"))) {
        if (v->type != JV_ARR) return km_errf(c->err, KM_EINVAL, "schema: 'enum' must be an array");
        return gn_enum(c, v->kids, v->n, "enum");
    }
    const jv *any = jv_get(s, "anyOf");
    if (!any) any = jv_get(s, "oneOf");
    if (any) {
        if (any->type != JV_ARR || any->n < 1 || any->n > 8)
            return km_errf(c->err, KM_EUNSUPPORTED, "schema: anyOf/oneOf needs 1 to 8 schemas");
        int alts[8];
        for (int i = 0; i < any->n; i++)
            if ((alts[i] = gn_schema(c, &any->kids[i])) < 0) return alts[i];
        return any->n == 1 ? alts[0] : gn_alt(c, alts, any->n);
    }
    const jv *type = jv_get(s, "type");
    if (!type) {
        if (jv_get(s, "properties")) return gn_object(c, s);
        if (jv_get(s, "items")) return gn_typed(c, s, "array");
        return c->g->any_val;
    }
    if (type->type == JV_STR) return gn_typed(c, s, type->s);
    if (type->type != JV_ARR || type->n < 1 || type->n > 7)
        return km_errf(c->err, KM_EINVAL, "schema: 'type' must be a string or a list of them");
    int alts[8];
    for (int i = 0; i < type->n; i++) {
        if (type->kids[i].type != JV_STR)
            return km_errf(c->err, KM_EINVAL, "schema: 'type' must be a string or a list of them");
        if ((alts[i] = gn_typed(c, s, type->kids[i].s)) < 0) return alts[i];
    }
    return type->n == 1 ? alts[0] : gn_alt(c, alts, type->n);
}

static int gn_schema(gcomp *c, jv *s)
{
    if (s->node >= 0) return s->node; /* compiled already, reached again by a $ref */
    /* A schema reached again while it compiles (a recursive $ref) is refused: the node it would
     * become does not exist yet. */
    if (s->node == -2)
        return km_errf(c->err, KM_EUNSUPPORTED, "schema: a recursive '$ref' is not supported");
    if (++c->depth > EN_GRAMMAR_DEPTH - 2)
        return km_errf(c->err, KM_EUNSUPPORTED, "schema: nested deeper than %d",
                       EN_GRAMMAR_DEPTH - 2);
    s->node = -2;
    int id = gn_schema_body(c, s);
    c->depth--;
    s->node = id >= 0 ? id : -1;
    return id;
}

void en_gn_first(const en_grammar *g, int n, uint64_t set[4])
{
    memset(set, 0, sizeof(uint64_t) * 4);
#define ADD(ch) (set[(unsigned char)(ch) >> 6] |= 1ull << ((unsigned char)(ch)&63))
    const en_gn *x = &g->nodes[n];
    switch (x->kind) {
    case EN_GN_ANY:
        for (const char *p = "{[\"-0123456789tfn"; *p; p++) ADD(*p);
        break;
    case EN_GN_OBJECT:
    case EN_GN_SWITCH:
        ADD('{');
        break;
    case EN_GN_ARRAY:
        ADD('[');
        break;
    case EN_GN_STRING:
        ADD('"');
        break;
    case EN_GN_NUMBER:
    case EN_GN_INTEGER:
        for (const char *p = "-0123456789"; *p; p++) ADD(*p);
        break;
    case EN_GN_ENUM:
        for (int i = 0; i < x->n_lits; i++) ADD(x->lits[i][0]);
        break;
    case EN_GN_ALT:
        for (int i = 0; i < x->n_alts; i++) {
            uint64_t f[4];
            en_gn_first(g, x->alts[i], f);
            for (int w = 0; w < 4; w++) set[w] |= f[w];
        }
        break;
    }
#undef ADD
}

void en_grammar_free(en_grammar *g);

int en_grammar_compile(const char *schema, size_t len, en_grammar **out, km_errbuf *err)
{
    *out = NULL;
    if (!schema) return km_errf(err, KM_EINVAL, "schema: missing");
    en_grammar *g = calloc(1, sizeof *g);
    if (!g) return km_errf(err, KM_ENOMEM, "schema: out of memory");
    g->refs = 1;
    /* the extensions: "%gbnf\n" or "%regex\n" and the text (engine.h) */
    int gbnf = len >= 6 && !memcmp(schema, "%gbnf\n", 6),
        regex = len >= 7 && !memcmp(schema, "%regex\n", 7);
    if (gbnf || regex) {
        size_t skip = gbnf ? 6 : 7;
        int rc = en_cfg_compile(schema + skip, len - skip, regex, &g->cfg, err);
        if (rc) {
            free(g);
            return rc;
        }
        *out = g;
        return 0;
    }
    jv root = {0};
    jrd r = {schema, schema + len, err, 0};
    int rc = jrd_value(&r, &root);
    jrd_ws(&r);
    if (!rc && r.p != r.end) rc = jrd_fail(&r, "text after the schema");
    gcomp c = {g, &root, err, 0};
    /* the helper nodes an ANY value uses: a string, a number, true/false/null */
    jv words[3] = {{.type = JV_TRUE}, {.type = JV_FALSE}, {.type = JV_NULL}};
    if (!rc && (g->any_val = gn_new(&c, EN_GN_ANY)) < 0) rc = g->any_val;
    if (!rc && (g->any_obj = gn_new(&c, EN_GN_OBJECT)) >= 0) {
        g->nodes[g->any_obj].any_keys = 1;
        g->nodes[g->any_obj].addl = g->any_val;
    }
    if (!rc && g->any_obj < 0) rc = g->any_obj;
    if (!rc && (g->any_arr = gn_new(&c, EN_GN_ARRAY)) >= 0) {
        g->nodes[g->any_arr].items = g->any_val;
        g->nodes[g->any_arr].max_items = EN_GN_ANY_ITEMS;
    }
    if (!rc && g->any_arr < 0) rc = g->any_arr;
    if (!rc && (g->any_str = gn_new(&c, EN_GN_STRING)) < 0) rc = g->any_str;
    if (!rc && (g->any_num = gn_new(&c, EN_GN_NUMBER)) < 0) rc = g->any_num;
    if (!rc && (g->any_lit = gn_enum(&c, words, 3, "enum")) < 0) rc = g->any_lit;
    if (!rc && (g->root = gn_schema(&c, &root)) < 0) rc = g->root;
    jv_clear(&root);
    if (rc) {
        en_grammar_free(g);
        return rc;
    }
    *out = g;
    return 0;
}
