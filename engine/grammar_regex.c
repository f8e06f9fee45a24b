/*
 * grammar_regex.c — the `pattern` of a string schema (grammar_schema.c) as a position automaton
 * (Glushkov's: one state per character class of the pattern, no empty moves), which the string
 * frame of the grammar's automaton (grammar.c) runs over the string's bytes, its set of states a
 * 64-bit word of the frame.
 *
 * Why this form: a set of at most 63 positions fits the frame's word, so a pattern adds nothing
 * to the state but that word, and a step is a few bit operations per position. A pattern is
 * matched as JSON Schema says (ECMA-262, unanchored: found anywhere unless ^ and $ anchor it) over
 * strings of printable ASCII only (the string's bytes are then its characters; no escapes), a
 * documented limit. Supported: literals, '.', classes ([a-z], [^...], \d \w \s and their
 * negations), groups ((...), (?:...)), '|', '*', '+', '?', {m}, {m,}, {m,n} (m, n <= 16).
 */
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

#define RE_MAX_POS 63 /* bit 63 of a set is the start */
#define RE_START   (1ull << 63)

typedef enum { RE_SYM, RE_CAT, RE_ALT, RE_STAR, RE_OPT, RE_EMPTY } re_kind;

typedef struct re_ast {
    re_kind kind;
    uint64_t cls[2]; /* RE_SYM: bytes 0x00..0x7f it matches */
    struct re_ast *a, *b;
} re_ast;

typedef struct re_parse {
    const char *p, *end;
    km_errbuf *err;
    int fail, depth, nodes;
} re_parse;

static int re_bad(re_parse *r, const char *what);
static void re_free(re_ast *n);

static re_ast *re_node(re_parse *r, re_kind k, re_ast *a, re_ast *b)
{
    /* repetitions copy their operand: nested ones would grow without this bound */
    re_ast *n = ++r->nodes > 4096 ? NULL : calloc(1, sizeof *n);
    if (!n) { /* the children go with it */
        if (r->nodes > 4096) re_bad(r, "too large once its repetitions are written out");
        if (!r->fail) r->fail = km_errf(r->err, KM_ENOMEM, "schema: out of memory");
        re_free(a);
        re_free(b);
        return NULL;
    }
    n->kind = k, n->a = a, n->b = b;
    return n;
}

static void re_free(re_ast *n)
{
    if (!n) return;
    re_free(n->a);
    re_free(n->b);
    free(n);
}

static re_ast *re_clone(re_parse *r, const re_ast *n)
{
    if (!n) return NULL;
    re_ast *c = re_node(r, n->kind, re_clone(r, n->a), re_clone(r, n->b));
    if (c) memcpy(c->cls, n->cls, sizeof c->cls);
    return c;
}

static int re_bad(re_parse *r, const char *what)
{
    if (!r->fail) r->fail = km_errf(r->err, KM_EUNSUPPORTED, "schema: 'pattern': %s", what);
    return r->fail;
}

static void cls_add(uint64_t *c, int lo, int hi)
{
    for (int x = lo; x <= hi && x < 128; x++) c[x >> 6] |= 1ull << (x & 63);
}

/* \d \w \s (and capitals: their complements) into c; 0 when e is not one of them. */
static int cls_escape(uint64_t *c, char e)
{
    uint64_t t[2] = {0};
    char l = (char)(e | 32);
    if (l == 'd') cls_add(t, '0', '9');
    if (l == 'w')
        cls_add(t, '0', '9'), cls_add(t, 'a', 'z'), cls_add(t, 'A', 'Z'), cls_add(t, '_', '_');
    if (l == 's') cls_add(t, ' ', ' '), cls_add(t, '\t', '\r');
    if (l != 'd' && l != 'w' && l != 's') return 0;
    for (int w = 0; w < 2; w++) c[w] |= e == l ? t[w] : ~t[w];
    return 1;
}

static re_ast *re_alt(re_parse *r);

static re_ast *re_class(re_parse *r)
{
    re_ast *n = re_node(r, RE_SYM, NULL, NULL);
    if (!n) return NULL;
    int neg = r->p < r->end && *r->p == '^';
    r->p += neg;
    for (int first = 1; r->p < r->end && (*r->p != ']' || first); first = 0) {
        char c = *r->p++;
        if (c == '\\' && r->p < r->end) {
            c = *r->p++;
            if (cls_escape(n->cls, c)) continue;
        }
        if (r->p + 1 < r->end && *r->p == '-' && r->p[1] != ']') {
            char hi = r->p[1] == '\\' && r->p + 2 < r->end ? r->p[2] : r->p[1];
            r->p += r->p[1] == '\\' ? 3 : 2;
            cls_add(n->cls, (unsigned char)c, (unsigned char)hi);
        } else {
            cls_add(n->cls, (unsigned char)c, (unsigned char)c);
        }
    }
    if (r->p >= r->end) return re_bad(r, "unterminated class"), n;
    r->p++;
    if (neg) n->cls[0] = ~n->cls[0], n->cls[1] = ~n->cls[1];
    return n;
}

static re_ast *re_atom(re_parse *r)
{
    char c = *r->p++;
    if (c == '(') {
        if (r->end - r->p >= 2 && r->p[0] == '?' && r->p[1] == ':')
            r->p += 2;
        else if (r->p < r->end && *r->p == '?')
            return re_bad(r, "lookarounds are not supported"), NULL;
        re_ast *n = re_alt(r);
        if (r->p >= r->end || *r->p != ')') return re_bad(r, "unbalanced '('"), n;
        r->p++;
        return n;
    }
    if (c == '[') return re_class(r);
    re_ast *n = re_node(r, RE_SYM, NULL, NULL);
    if (!n) return NULL;
    if (c == '.') {
        cls_add(n->cls, 0, 127);
        n->cls[0] &= ~(1ull << '\n');
    } else if (c == '\\') {
        if (r->p >= r->end) return re_bad(r, "a trailing '\\'"), n;
        c = *r->p++;
        if (strchr("bBkpPuxc123456789", c)) return re_bad(r, "this escape is not supported"), n;
        if (!cls_escape(n->cls, c)) {
            const char *from = "ntrfv0", *to = "\n\t\r\f\v", *at = strchr(from, c);
            cls_add(n->cls, at ? (unsigned char)to[at - from] : (unsigned char)c,
                    at ? (unsigned char)to[at - from] : (unsigned char)c);
        }
    } else if (c == '^' || c == '$') {
        return re_bad(r, "'^' and '$' only at the ends"), n;
    } else if (strchr("*+?{|)", c)) {
        return re_bad(r, "a quantifier or ')' with nothing before it"), n;
    } else {
        cls_add(n->cls, (unsigned char)c, (unsigned char)c);
    }
    return n;
}

static int re_int(re_parse *r)
{
    int v = -1;
    while (r->p < r->end && *r->p >= '0' && *r->p <= '9' && v < 1000)
        v = (v < 0 ? 0 : v * 10) + (*r->p++ - '0');
    return v;
}

/* a{m,n}: m copies, then n - m optional ones (n < 0: a star). */
static re_ast *re_repeat(re_parse *r, re_ast *a, int m, int n)
{
    if (m > 16 || n > 16 || (n >= 0 && n < m)) return re_bad(r, "a repetition over 16"), a;
    re_ast *out = m ? NULL : re_node(r, RE_EMPTY, NULL, NULL);
    for (int i = 0; i < m; i++)
        out = out ? re_node(r, RE_CAT, out, re_clone(r, a)) : re_clone(r, a);
    if (n < 0) out = re_node(r, RE_CAT, out, re_node(r, RE_STAR, re_clone(r, a), NULL));
    for (int i = m; i < n; i++)
        out = re_node(r, RE_CAT, out, re_node(r, RE_OPT, re_clone(r, a), NULL));
    re_free(a);
    return out;
}

static re_ast *re_cat(re_parse *r)
{
    re_ast *out = NULL;
    while (r->p < r->end && *r->p != '|' && *r->p != ')' && !r->fail) {
        if (*r->p == '$' && r->p + 1 == r->end) break;
        re_ast *a = re_atom(r);
        for (int more = 1; more && r->p < r->end && !r->fail;) {
            char q = *r->p;
            if (q == '*')
                r->p++, a = re_node(r, RE_STAR, a, NULL);
            else if (q == '+')
                r->p++, a = re_repeat(r, a, 1, -1);
            else if (q == '?')
                r->p++, a = re_node(r, RE_OPT, a, NULL);
            else if (q == '{') {
                r->p++;
                int m = re_int(r), n = m;
                if (r->p < r->end && *r->p == ',') r->p++, n = re_int(r);
                if (m < 0 || r->p >= r->end || *r->p++ != '}') {
                    re_free(a);
                    re_bad(r, "a bad {m,n}");
                    return out;
                }
                a = re_repeat(r, a, m, n);
            } else
                more = 0;
            if (r->p < r->end && (*r->p == '?' || *r->p == '+') && strchr("*+?}", r->p[-1])) {
                re_free(a);
                re_bad(r, "lazy and possessive quantifiers are not supported");
                return out;
            }
        }
        out = out ? re_node(r, RE_CAT, out, a) : a;
    }
    return out ? out : re_node(r, RE_EMPTY, NULL, NULL);
}

static re_ast *re_alt(re_parse *r)
{
    if (++r->depth > 32) return re_bad(r, "nested too deep"), NULL;
    re_ast *a = re_cat(r);
    while (r->p < r->end && *r->p == '|' && !r->fail) {
        r->p++;
        a = re_node(r, RE_ALT, a, re_cat(r));
    }
    r->depth--;
    return a;
}

/* Glushkov: positions numbered in order; nullable, first and last of each subexpression, and the
 * follow set of each position. */
typedef struct re_sets {
    int nullable;
    uint64_t first, last;
} re_sets;

static re_sets re_glushkov(re_parse *r, re_ast *n, en_re *re)
{
    re_sets s = {1, 0, 0}, a, b;
    if (!n || r->fail) return s;
    switch (n->kind) {
    case RE_EMPTY:
        return s;
    case RE_SYM:
        if (re->n_pos >= RE_MAX_POS) return re_bad(r, "more than 63 characters and classes"), s;
        memcpy(re->cls[re->n_pos], n->cls, sizeof n->cls);
        re->cls[re->n_pos][0] &= ~0xffffffffull; /* printable ASCII only: no controls ... */
        re->cls[re->n_pos][1] &= ~(1ull << 63);  /* ... nor DEL */
        re->cls[re->n_pos][0] &= ~(1ull << '"');
        re->cls[re->n_pos][1] &= ~(1ull << ('\\' - 64));
        return (re_sets){0, 1ull << re->n_pos, 1ull << re->n_pos++};
    case RE_CAT:
        a = re_glushkov(r, n->a, re), b = re_glushkov(r, n->b, re);
        for (int p = 0; p < RE_MAX_POS; p++)
            if (a.last >> p & 1) re->follow[p] |= b.first;
        return (re_sets){a.nullable && b.nullable, a.first | (a.nullable ? b.first : 0),
                         b.last | (b.nullable ? a.last : 0)};
    case RE_ALT:
        a = re_glushkov(r, n->a, re), b = re_glushkov(r, n->b, re);
        return (re_sets){a.nullable || b.nullable, a.first | b.first, a.last | b.last};
    case RE_STAR:
    case RE_OPT:
        a = re_glushkov(r, n->a, re);
        if (n->kind == RE_STAR)
            for (int p = 0; p < RE_MAX_POS; p++)
                if (a.last >> p & 1) re->follow[p] |= a.first;
        return (re_sets){1, a.first, a.last};
    }
    return s;
}

int en_re_compile(const char *pat, size_t len, en_re **out, km_errbuf *err)
{
    *out = NULL;
    re_parse r = {pat, pat + len, err, 0, 0, 0};
    int head = len && pat[0] == '^', tail = len > 1 && pat[len - 1] == '$' && pat[len - 2] != '\\';
    r.p += head;
    re_ast *ast = re_alt(&r);
    if (!r.fail && r.p < r.end && !(tail && r.p + 1 == r.end)) re_bad(&r, "unbalanced ')'");
    /* unanchored ends match anything: .* before and after */
    re_ast *any = r.fail ? NULL : re_node(&r, RE_SYM, NULL, NULL);
    if (any) cls_add(any->cls, 0, 127);
    if (!r.fail && !head)
        ast = re_node(&r, RE_CAT, re_node(&r, RE_STAR, re_clone(&r, any), NULL), ast);
    if (!r.fail && !tail)
        ast = re_node(&r, RE_CAT, ast, re_node(&r, RE_STAR, re_clone(&r, any), NULL));
    re_free(any);
    en_re *re = r.fail ? NULL : calloc(1, sizeof *re);
    if (!r.fail && !re) r.fail = km_errf(err, KM_ENOMEM, "schema: out of memory");
    if (!r.fail) {
        re_sets s = re_glushkov(&r, ast, re);
        re->first = s.first, re->last = s.last, re->nullable = s.nullable;
    }
    re_free(ast);
    if (r.fail) {
        free(re);
        return r.fail;
    }
    *out = re;
    return 0;
}

uint64_t en_re_step(const en_re *re, uint64_t set, int c)
{
    if (c < 0x20 || c > 0x7e) return 0;
    uint64_t next = set & RE_START ? re->first : 0;
    for (uint64_t s = set & ~RE_START; s; s &= s - 1) next |= re->follow[__builtin_ctzll(s)];
    uint64_t out = 0;
    for (uint64_t s = next; s; s &= s - 1) {
        int p = __builtin_ctzll(s);
        if (re->cls[p][c >> 6] >> (c & 63) & 1) out |= 1ull << p;
    }
    return out;
}

int en_re_accepts(const en_re *re, uint64_t set)
{
    return ((set & RE_START) && re->nullable) || (set & re->last);
}
