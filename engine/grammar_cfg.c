/*
 * grammar_cfg.c — the two request-level grammar extensions (engine.h, docs/structured.md): a
 * GBNF grammar (llama.cpp's notation, which vLLM's and SGLang's EBNF share) and a regular
 * expression, both compiled here into one form, a context-free grammar of rules, and run over
 * output bytes by a matcher (grammar_cfg_run.c) that grammar.c drives like the JSON Schema
 * automaton (mask, cache, end).
 *
 * Why this way:
 *  - A regex is a grammar without recursion, so one matcher serves both and a regex has no limit
 *    on its positions and matches any Unicode character (the JSON Schema `pattern` automaton in
 *    grammar_regex.c stays: it runs inside a JSON string's frame, ASCII only).
 *  - GBNF is not deterministic (alternatives may share a prefix), so a state is a set of stacks,
 *    as in llama.cpp's sampler: each stack holds the positions still to be matched, the top
 *    always a character set. A code point moves every stack whose top matches it; a rule
 *    reference on top is replaced by each of its alternatives. The set is kept in one flat,
 *    bounded buffer, copied by value like the schema automaton's frames, so the mask's trie walk
 *    and its cache by state work unchanged.
 *  - Left recursion would expand forever: it is refused when the grammar is compiled, with the
 *    rule named. Groups and quantifiers become generated rules (x* is R ::= x R | empty).
 *  - Bytes are read as UTF-8: a character's first bytes are taken when some stack's set can
 *    still hold a code point that starts with them.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

#define CFG_MAX_ELEMS  65536 /* elements of a compiled grammar */
#define CFG_MAX_REPEAT 256   /* m and n of {m,n} */
#define CFG_MAX_NEST   64    /* nesting of groups while parsing */

/* ---------------------------------------------------------------- building */

typedef struct cvec {
    en_cel *e;
    int n, cap;
} cvec;

typedef struct crule {
    char *name;
    cvec el;
    int defined;
} crule;

typedef struct cb {
    crule *rules;
    int n_rules, cap_rules;
    uint32_t (*rng)[2];
    int n_rng, cap_rng;
    en_cset *sets;
    int n_sets, cap_sets;
    long total;
    const char *src, *p, *end;
    int regex, nest;
    km_errbuf *err;
} cb;

static int cb_fail(cb *b, const char *what)
{
    int line = 1;
    for (const char *q = b->src; q < b->p && q < b->end; q++) line += *q == '\n';
    if (b->regex)
        return km_errf(b->err, KM_EINVAL, "regex: %s at offset %d", what, (int)(b->p - b->src));
    return km_errf(b->err, KM_EINVAL, "grammar: line %d: %s", line, what);
}

static int grow(void **p, int *cap, int need, size_t size)
{
    if (need <= *cap) return 0;
    int c = *cap ? *cap * 2 : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * size);
    if (!q) return KM_ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

static int cv_push(cb *b, cvec *v, int t, uint32_t a)
{
    if (++b->total > CFG_MAX_ELEMS) return cb_fail(b, "grammar too large");
    if (grow((void **)&v->e, &v->cap, v->n + 1, sizeof *v->e)) return KM_ENOMEM;
    v->e[v->n++] = (en_cel){.t = (uint32_t)t, .a = a};
    return 0;
}

static int cv_append(cb *b, cvec *v, const en_cel *e, int n)
{
    for (int i = 0; i < n; i++) {
        int rc = cv_push(b, v, (int)e[i].t, e[i].a);
        if (rc) return rc;
    }
    return 0;
}

/* The rule named name[0, len) (created, not yet defined, when new); its index or < 0. */
static int cb_rule(cb *b, const char *name, size_t len)
{
    for (int i = 0; i < b->n_rules; i++)
        if (strlen(b->rules[i].name) == len && !memcmp(b->rules[i].name, name, len)) return i;
    if (b->n_rules >= 4096) return cb_fail(b, "too many rules");
    if (grow((void **)&b->rules, &b->cap_rules, b->n_rules + 1, sizeof *b->rules)) return KM_ENOMEM;
    crule *r = &b->rules[b->n_rules];
    memset(r, 0, sizeof *r);
    if (!(r->name = malloc(len + 1))) return KM_ENOMEM;
    memcpy(r->name, name, len);
    r->name[len] = 0;
    return b->n_rules++;
}

/* A rule of its own for a group or a quantifier, named after the rule it is part of. */
static int cb_gen(cb *b, int parent)
{
    char name[96];
    snprintf(name, sizeof name, "%.60s_%d", b->rules[parent].name, b->n_rules);
    int r = cb_rule(b, name, strlen(name));
    if (r >= 0) b->rules[r].defined = 1;
    return r;
}

/* A new set; its ranges are added with cb_range. */
static int cb_set(cb *b, int neg)
{
    if (grow((void **)&b->sets, &b->cap_sets, b->n_sets + 1, sizeof *b->sets)) return KM_ENOMEM;
    b->sets[b->n_sets] = (en_cset){.off = (uint32_t)b->n_rng, .n = 0, .neg = neg};
    return b->n_sets++;
}

static int cb_range(cb *b, int set, uint32_t lo, uint32_t hi)
{
    if (lo > hi) return cb_fail(b, "a character range out of order");
    if (grow((void **)&b->rng, &b->cap_rng, b->n_rng + 1, sizeof *b->rng)) return KM_ENOMEM;
    b->rng[b->n_rng][0] = lo;
    b->rng[b->n_rng][1] = hi;
    b->n_rng++;
    b->sets[set].n++;
    return 0;
}

/* One character of the source (UTF-8 decoded) into *cp; 0 or < 0. */
static int cb_utf8(cb *b, uint32_t *cp)
{
    const unsigned char *s = (const unsigned char *)b->p;
    size_t left = (size_t)(b->end - b->p);
    if (!left) return cb_fail(b, "unexpected end");
    int n = s[0] < 0x80 ? 1 : s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC0 ? 2 : 0;
    if (!n || (size_t)n > left) return cb_fail(b, "invalid UTF-8");
    uint32_t c = n == 1 ? s[0] : s[0] & (0x3Fu >> (n - 1));
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return cb_fail(b, "invalid UTF-8");
        c = c << 6 | (s[i] & 0x3Fu);
    }
    b->p += n;
    *cp = c;
    return 0;
}

static int hexval(int c)
{
    return c >= '0' && c <= '9'                 ? c - '0'
           : (c | 32) >= 'a' && (c | 32) <= 'f' ? (c | 32) - 'a' + 10
                                                : -1;
}

/* An escape after '\\' (b->p at the letter): the code point, or for a class escape (\d \w \s
 * and their negations, regex and GBNF classes) *cls set to the letter. */
static int cb_escape(cb *b, uint32_t *cp, int *cls)
{
    *cls = 0;
    if (b->p >= b->end) return cb_fail(b, "an escape at the end");
    int c = (unsigned char)*b->p++;
    int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (digits) {
        uint32_t v = 0;
        for (int i = 0; i < digits; i++) {
            int h = b->p < b->end ? hexval((unsigned char)*b->p) : -1;
            if (h < 0) return cb_fail(b, "a bad hex escape");
            v = v << 4 | (uint32_t)h;
            b->p++;
        }
        if (v > 0x10FFFF) return cb_fail(b, "a code point past U+10FFFF");
        *cp = v;
        return 0;
    }
    switch (c) {
    case 'n':
        *cp = '\n';
        return 0;
    case 'r':
        *cp = '\r';
        return 0;
    case 't':
        *cp = '\t';
        return 0;
    case 'f':
        *cp = '\f';
        return 0;
    case 'v':
        *cp = '\v';
        return 0;
    case '0':
        *cp = 0;
        return 0;
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S':
        *cls = c;
        return 0;
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '1' && c <= '9'))
        return cb_fail(b, b->regex ? "an escape not supported (backreferences, \\b, \\p are not)"
                                   : "an unknown escape");
    *cp = (uint32_t)c;
    return 0;
}

/* \d \w \s (and negations) as ranges of set. */
static int cb_class_escape(cb *b, int set, int cls)
{
    int rc = 0;
    switch (cls | 32) {
    case 'd':
        return cb_range(b, set, '0', '9');
    case 'w':
        if (!(rc = cb_range(b, set, '0', '9')) && !(rc = cb_range(b, set, 'A', 'Z')) &&
            !(rc = cb_range(b, set, 'a', 'z')))
            rc = cb_range(b, set, '_', '_');
        return rc;
    default: /* s */
        if (!(rc = cb_range(b, set, '\t', '\r'))) rc = cb_range(b, set, ' ', ' ');
        return rc;
    }
}

/* A class escape on its own (\d outside brackets) as a set; its index or < 0. */
static int cb_class_set(cb *b, int cls)
{
    int s = cb_set(b, cls >= 'A' && cls <= 'Z');
    if (s < 0) return s;
    int rc = cb_class_escape(b, s, cls);
    return rc ? rc : s;
}

static int cb_char_set(cb *b, uint32_t cp)
{
    int s = cb_set(b, 0);
    if (s < 0) return s;
    int rc = cb_range(b, s, cp, cp);
    return rc ? rc : s;
}

/* "[...]" (b->p after '['): a set; its index or < 0. A negated class escape inside brackets
 * (\D, \W, \S) is refused: a set holds ranges of one polarity. */
static int cb_bracket(cb *b)
{
    int neg = b->p < b->end && *b->p == '^';
    b->p += neg;
    int s = cb_set(b, neg), first = 1;
    if (s < 0) return s;
    for (;;) {
        if (b->p >= b->end) return cb_fail(b, "a '[' not closed");
        if (*b->p == ']' && !(first && b->regex)) break;
        first = 0;
        uint32_t lo, hi;
        int cls = 0, rc;
        if (*b->p == '\\') {
            b->p++;
            if ((rc = cb_escape(b, &lo, &cls))) return rc;
        } else if ((rc = cb_utf8(b, &lo))) {
            return rc;
        }
        if (cls) {
            if (cls >= 'A' && cls <= 'Z')
                return cb_fail(b, "a negated class (\\D, \\W, \\S) in []");
            if ((rc = cb_class_escape(b, s, cls))) return rc;
            continue;
        }
        hi = lo;
        if (b->end - b->p >= 2 && b->p[0] == '-' && b->p[1] != ']') {
            b->p++;
            if (*b->p == '\\') {
                b->p++;
                if ((rc = cb_escape(b, &hi, &cls))) return rc;
                if (cls) return cb_fail(b, "a class escape ending a range");
            } else if ((rc = cb_utf8(b, &hi))) {
                return rc;
            }
        }
        if ((rc = cb_range(b, s, lo, hi))) return rc;
    }
    b->p++;
    return s;
}

/* GBNF: spaces and comments; newlines only when inside a group (nested). */
static void cb_space(cb *b, int nested)
{
    while (b->p < b->end) {
        char c = *b->p;
        if (c == '#') {
            while (b->p < b->end && *b->p != '\n') b->p++;
        } else if (c == ' ' || c == '\t' || c == '\r' || (nested && c == '\n')) {
            b->p++;
        } else {
            break;
        }
    }
}

static int is_name(int c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

static int cb_alts(cb *b, int rule, int nested);

/* "{m}", "{m,}", "{m,n}" (b->p after '{'): *m, *n (-1: none). */
static int cb_braces(cb *b, int *m, int *n)
{
    long v[2] = {-1, -1};
    int k = 0;
    for (;;) {
        if (b->p < b->end && *b->p >= '0' && *b->p <= '9') {
            long x = 0;
            while (b->p < b->end && *b->p >= '0' && *b->p <= '9' && x <= CFG_MAX_REPEAT)
                x = x * 10 + (*b->p++ - '0');
            if (x > CFG_MAX_REPEAT) return cb_fail(b, "a repetition count over 256");
            v[k] = x;
        }
        if (b->p < b->end && *b->p == ',' && k == 0) {
            b->p++;
            k = 1;
            continue;
        }
        if (b->p < b->end && *b->p == '}') break;
        return cb_fail(b, "a bad {m,n}");
    }
    b->p++;
    if (v[0] < 0) return cb_fail(b, "a {m,n} without m");
    *m = (int)v[0];
    *n = k == 0 ? (int)v[0] : (int)v[1];
    if (*n >= 0 && *n < *m) return cb_fail(b, "a {m,n} with n < m");
    return 0;
}

/* The last item of seq (seq->e[start, seq->n)) repeated m to n times (n -1: unbounded), as rules
 * of rule `parent`. */
static int cb_repeat(cb *b, int parent, cvec *seq, int start, int m, int n)
{
    int rc;
    en_cel item;
    if (seq->n - start == 1) {
        item = seq->e[start];
    } else { /* a literal of several characters: a rule of its own */
        int w = cb_gen(b, parent);
        if (w < 0) return w;
        if ((rc = cv_append(b, &b->rules[w].el, seq->e + start, seq->n - start)) ||
            (rc = cv_push(b, &b->rules[w].el, EN_CE_END, 0)))
            return rc;
        item = (en_cel){.t = EN_CE_REF, .a = (uint32_t)w};
    }
    seq->n = start;
    for (int i = 0; i < m; i++)
        if ((rc = cv_push(b, seq, (int)item.t, item.a))) return rc;
    if (n == m) return 0;
    /* unbounded: R ::= item R | empty; bounded: R_k ::= item R_(k-1) | empty, k = n - m */
    int prev = -1;
    for (int k = 0; k < (n < 0 ? 1 : n - m); k++) {
        int r = cb_gen(b, parent);
        if (r < 0) return r;
        cvec *e = &b->rules[r].el;
        int tail = n < 0 ? r : prev;
        if ((rc = cv_push(b, e, (int)item.t, item.a)) ||
            (tail >= 0 && (rc = cv_push(b, e, EN_CE_REF, (uint32_t)tail))) ||
            (rc = cv_push(b, e, EN_CE_ALT, 0)) || (rc = cv_push(b, e, EN_CE_END, 0)))
            return rc;
        prev = r;
    }
    return cv_push(b, seq, EN_CE_REF, (uint32_t)prev);
}

/* A quantifier after the item at seq[start..], if one follows. */
static int cb_quant(cb *b, int rule, cvec *seq, int start)
{
    if (b->p >= b->end || start == seq->n) return 0;
    int m = 0, n = 0, rc;
    switch (*b->p) {
    case '*':
        m = 0, n = -1;
        b->p++;
        break;
    case '+':
        m = 1, n = -1;
        b->p++;
        break;
    case '?':
        m = 0, n = 1;
        b->p++;
        break;
    case '{':
        b->p++;
        if ((rc = cb_braces(b, &m, &n))) return rc;
        break;
    default:
        return 0;
    }
    if (b->regex && b->p < b->end && *b->p == '?') b->p++; /* lazy: the same language */
    if (b->regex && b->p < b->end && *b->p == '+') return cb_fail(b, "a possessive quantifier");
    if (b->p < b->end && strchr("*+?", *b->p) && b->regex)
        return cb_fail(b, "a quantifier after a quantifier");
    return cb_repeat(b, rule, seq, start, m, n);
}

/* A group "( ... )" (b->p after '('): a generated rule referenced from seq. */
static int cb_group(cb *b, int rule, cvec *seq)
{
    if (++b->nest > CFG_MAX_NEST) return cb_fail(b, "groups nested too deep");
    int g = cb_gen(b, rule), rc;
    if (g < 0) return g;
    if ((rc = cb_alts(b, g, 1))) return rc;
    if (b->p >= b->end || *b->p != ')') return cb_fail(b, "a '(' not closed");
    b->p++;
    b->nest--;
    return cv_push(b, seq, EN_CE_REF, (uint32_t)g);
}

/* One GBNF item into seq. */
static int cb_gbnf_item(cb *b, int rule, cvec *seq)
{
    char c = *b->p;
    int rc, s;
    if (c == '"') {
        b->p++;
        while (b->p < b->end && *b->p != '"') {
            uint32_t cp;
            int cls = 0;
            if (*b->p == '\\') {
                b->p++;
                if ((rc = cb_escape(b, &cp, &cls))) return rc;
                if (cls) return cb_fail(b, "a class escape in a literal");
            } else if (*b->p == '\n') {
                return cb_fail(b, "a literal not closed on its line");
            } else if ((rc = cb_utf8(b, &cp))) {
                return rc;
            }
            if ((s = cb_char_set(b, cp)) < 0) return s;
            if ((rc = cv_push(b, seq, EN_CE_SET, (uint32_t)s))) return rc;
        }
        if (b->p >= b->end) return cb_fail(b, "a literal not closed");
        b->p++;
        return 0;
    }
    if (c == '[') {
        b->p++;
        if ((s = cb_bracket(b)) < 0) return s;
        return cv_push(b, seq, EN_CE_SET, (uint32_t)s);
    }
    if (c == '.') {
        b->p++;
        if ((s = cb_set(b, 1)) < 0) return s; /* nothing excluded */
        return cv_push(b, seq, EN_CE_SET, (uint32_t)s);
    }
    if (c == '(') {
        b->p++;
        return cb_group(b, rule, seq);
    }
    if (is_name((unsigned char)c)) {
        const char *n0 = b->p;
        while (b->p < b->end && is_name((unsigned char)*b->p)) b->p++;
        int r = cb_rule(b, n0, (size_t)(b->p - n0));
        return r < 0 ? r : cv_push(b, seq, EN_CE_REF, (uint32_t)r);
    }
    return cb_fail(b, "an unexpected character");
}

/* One regex item into seq. */
static int cb_regex_item(cb *b, int rule, cvec *seq)
{
    char c = *b->p;
    int rc, s;
    if (c == '(') {
        b->p++;
        if (b->p < b->end && *b->p == '?') {
            if (b->end - b->p < 2 || b->p[1] != ':')
                return cb_fail(b, "a lookaround or named group (only (?:...) is supported)");
            b->p += 2;
        }
        return cb_group(b, rule, seq);
    }
    if (c == '[') {
        b->p++;
        if ((s = cb_bracket(b)) < 0) return s;
        return cv_push(b, seq, EN_CE_SET, (uint32_t)s);
    }
    if (c == '.') { /* any character but a newline */
        b->p++;
        if ((s = cb_set(b, 1)) < 0 || (rc = cb_range(b, s, '\n', '\n'))) return s < 0 ? s : rc;
        return cv_push(b, seq, EN_CE_SET, (uint32_t)s);
    }
    if (c == '^' || c == '$') return cb_fail(b, "an anchor inside the pattern");
    if (c == '*' || c == '+' || c == '?' || c == '{')
        return cb_fail(b, "a quantifier with nothing before it");
    uint32_t cp;
    int cls = 0;
    if (c == '\\') {
        b->p++;
        if ((rc = cb_escape(b, &cp, &cls))) return rc;
    } else if ((rc = cb_utf8(b, &cp))) {
        return rc;
    }
    s = cls ? cb_class_set(b, cls) : cb_char_set(b, cp);
    return s < 0 ? s : cv_push(b, seq, EN_CE_SET, (uint32_t)s);
}

/* Alternatives into rule: sequences separated by '|', until the end, a ')' or (GBNF, not
 * nested) the end of the line. */
static int cb_alts(cb *b, int rule, int nested)
{
    cvec seq = {0};
    int rc = 0;
    for (;;) {
        if (!b->regex) cb_space(b, nested);
        if (!b->regex && !nested && b->p < b->end && *b->p == '\n') {
            /* a rule goes on over lines that begin with '|' */
            const char *save = b->p;
            cb_space(b, 1);
            if (b->p >= b->end || *b->p != '|') b->p = save;
        }
        int at_end = b->p >= b->end || *b->p == ')' || *b->p == '|' ||
                     (!b->regex && !nested && *b->p == '\n');
        if (at_end) {
            if ((rc = cv_append(b, &b->rules[rule].el, seq.e, seq.n))) break;
            seq.n = 0;
            if (b->p < b->end && *b->p == '|') {
                b->p++;
                if ((rc = cv_push(b, &b->rules[rule].el, EN_CE_ALT, 0))) break;
                if (!b->regex) cb_space(b, 1); /* a newline may follow a '|' */
                continue;
            }
            rc = cv_push(b, &b->rules[rule].el, EN_CE_END, 0);
            break;
        }
        int start = seq.n;
        if ((rc = b->regex ? cb_regex_item(b, rule, &seq) : cb_gbnf_item(b, rule, &seq))) break;
        if (!b->regex) cb_space(b, nested);
        if ((rc = cb_quant(b, rule, &seq, start))) break;
    }
    free(seq.e);
    return rc;
}

static int cb_gbnf(cb *b)
{
    for (;;) {
        cb_space(b, 1);
        if (b->p >= b->end) break;
        const char *n0 = b->p;
        while (b->p < b->end && is_name((unsigned char)*b->p)) b->p++;
        if (b->p == n0) return cb_fail(b, "expected a rule name");
        int r = cb_rule(b, n0, (size_t)(b->p - n0));
        if (r < 0) return r;
        if (b->rules[r].defined) return cb_fail(b, "a rule defined twice");
        b->rules[r].defined = 1;
        cb_space(b, 0);
        if (b->end - b->p < 3 || memcmp(b->p, "::=", 3)) return cb_fail(b, "expected '::='");
        b->p += 3;
        cb_space(b, 1);
        int rc = cb_alts(b, r, 0);
        if (rc) return rc;
        if (b->p < b->end && *b->p == ')') return cb_fail(b, "a ')' without '('");
    }
    if (!b->rules[0].defined) return km_errf(b->err, KM_EINVAL, "grammar: no rule 'root'");
    for (int i = 0; i < b->n_rules; i++)
        if (!b->rules[i].defined) {
            b->p = b->end;
            char m[128];
            snprintf(m, sizeof m, "rule '%.60s' is used but not defined", b->rules[i].name);
            return cb_fail(b, m);
        }
    return 0;
}

static int cb_regex(cb *b)
{
    int r = cb_rule(b, "root", 4);
    if (r < 0) return r;
    b->rules[r].defined = 1;
    if (b->p < b->end && *b->p == '^')
        b->p++; /* the whole output matches: anchors change nothing */
    if (b->end > b->p && b->end[-1] == '$' && (b->end - b->p < 2 || b->end[-2] != '\\')) b->end--;
    int rc = cb_alts(b, r, 0);
    if (!rc && b->p < b->end) rc = cb_fail(b, "a ')' without '('");
    return rc;
}

/* Rules that may match nothing, then a left-recursion check: a rule that can reach itself
 * before reading a character. */
static int cb_check(cb *b)
{
    int n = b->n_rules, changed = 1;
    char *null = calloc((size_t)n, 1), *mark = calloc((size_t)n, 1);
    int *stack = malloc(sizeof *stack * (size_t)n * 2);
    if (!null || !mark || !stack) {
        free(null), free(mark), free(stack);
        return KM_ENOMEM;
    }
    while (changed) {
        changed = 0;
        for (int r = 0; r < n; r++) {
            if (null[r]) continue;
            const cvec *e = &b->rules[r].el;
            int ok = 1, found = 0; /* some alternative all of whose items may match nothing */
            for (int i = 0; i < e->n && !found; i++) {
                if (e->e[i].t == EN_CE_ALT || e->e[i].t == EN_CE_END) {
                    found = ok;
                    ok = 1;
                } else if (e->e[i].t == EN_CE_SET || !null[e->e[i].a]) {
                    ok = 0;
                }
            }
            if (found) null[r] = 1, changed = 1;
        }
    }
    int rc = 0;
    for (int r0 = 0; r0 < n && !rc; r0++) { /* can r0 reach itself along left edges? */
        memset(mark, 0, (size_t)n);
        int sp = 0;
        stack[sp++] = r0;
        while (sp && !rc) {
            int r = stack[--sp];
            const cvec *e = &b->rules[r].el;
            int live = 1;
            for (int i = 0; i < e->n; i++) {
                en_cel x = e->e[i];
                if (x.t == EN_CE_ALT || x.t == EN_CE_END) {
                    live = 1;
                    continue;
                }
                if (!live) continue;
                if (x.t == EN_CE_SET) {
                    live = 0;
                    continue;
                }
                if ((int)x.a == r0) {
                    char m[128];
                    snprintf(m, sizeof m, "left recursion through rule '%.60s'", b->rules[r0].name);
                    b->p = b->end;
                    rc = cb_fail(b, m);
                    break;
                }
                if (!mark[x.a] && sp < n * 2) mark[x.a] = 1, stack[sp++] = (int)x.a;
                live = null[x.a];
            }
        }
    }
    free(null), free(mark), free(stack);
    return rc;
}

void en_cfg_free(en_cfg *c)
{
    if (!c) return;
    free(c->el);
    free(c->rule_off);
    free(c->rng);
    free(c->sets);
    free(c);
}

int en_cfg_compile(const char *src, size_t len, int regex, en_cfg **out, km_errbuf *err)
{
    *out = NULL;
    cb b = {.src = src, .p = src, .end = src + len, .regex = regex, .err = err};
    int rc = 0;
    if (regex) {
        rc = cb_regex(&b);
    } else {
        /* root first, so that it is rule 0 whatever order the rules come in */
        rc = cb_rule(&b, "root", 4) < 0 ? KM_ENOMEM : cb_gbnf(&b);
    }
    if (!rc) rc = cb_check(&b);
    en_cfg *c = rc ? NULL : calloc(1, sizeof *c);
    if (!rc && !c) rc = KM_ENOMEM;
    if (!rc) {
        long total = 2;
        for (int i = 0; i < b.n_rules; i++) total += b.rules[i].el.n;
        c->el = malloc(sizeof *c->el * (size_t)total);
        c->rule_off = malloc(sizeof *c->rule_off * (size_t)b.n_rules);
        if (!c->el || !c->rule_off) rc = KM_ENOMEM;
    }
    if (!rc) {
        c->n_rules = b.n_rules;
        c->el[0] = (en_cel){.t = EN_CE_REF, .a = 0};
        c->el[1] = (en_cel){.t = EN_CE_END};
        c->n_el = 2;
        for (int i = 0; i < b.n_rules; i++) {
            c->rule_off[i] = (uint32_t)c->n_el;
            memcpy(c->el + c->n_el, b.rules[i].el.e, sizeof *c->el * (size_t)b.rules[i].el.n);
            c->n_el += b.rules[i].el.n;
        }
        c->rng = b.rng, c->sets = b.sets;
        b.rng = NULL, b.sets = NULL;
    }
    for (int i = 0; i < b.n_rules; i++) {
        free(b.rules[i].name);
        free(b.rules[i].el.e);
    }
    free(b.rules);
    free(b.rng);
    free(b.sets);
    if (rc) {
        if (rc == KM_ENOMEM) km_errf(err, KM_ENOMEM, "grammar: out of memory");
        en_cfg_free(c);
        return rc;
    }
    *out = c;
    return 0;
}
