/*
 * grammar.c — constrained decoding (engine.h, docs/structured.md): a compiled schema
 * (grammar_schema.c) run as a pushdown automaton over output bytes, and the mask of the tokens
 * that keep the output valid, built per step over the vocabulary's byte trie.
 *
 * Why this way:
 *  - The automaton is deterministic: a JSON value under a schema decides its next frame from one
 *    byte (anyOf alternatives must differ in their first byte, compile-time checked), so a state
 *    is a small stack of frames, copied by value. Numbers and enum literals end lazily: the byte
 *    after them pops the frame and is fed to the parent, so "1" then "2" stays one number.
 *  - The mask walks the trie of all tokens' bytes once, advancing a copy of the state by one byte
 *    per edge and pruning a subtree at the first byte the automaton refuses. Inside an unbounded
 *    string every byte but '"', '\\' and controls keeps the state as it is, so a subtree whose
 *    bytes are all such (marked when the trie is built) is accepted whole without walking it.
 *  - Masks are cached per compiled grammar by the full automaton state: requests with the same
 *    schema (the worker shares the compiled grammar) reach the same few states again and again,
 *    and a hit costs a hash and a copy.
 *  - End-of-generation tokens are allowed exactly when the value is complete.
 * A grammar, its matchers and its cache are used from one thread (the scheduler's).
 */
#include <assert.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

/* ---------------------------------------------------------------- the automaton */

typedef enum { F_ROOT, F_OBJ, F_ARR, F_STR, F_NUM, F_LIT } fr_kind;

/* F_OBJ: after '{', after a key (expects ':'), after ':' (value or one space), after ': ', after
 * a value (',' or '}'), after ',' (key or one space), after ', '; O_KEY while a key is read. */
enum { O_OPEN, O_KEY, O_KEYED, O_COLON, O_COLON_SP, O_VAL, O_COMMA, O_COMMA_SP };
enum { A_OPEN, A_VAL, A_COMMA, A_COMMA_SP };             /* F_ARR */
enum { S_BODY, S_ESC, S_U1, S_U2, S_U3, S_U4 };          /* F_STR */
enum { N_START, N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC }; /* F_NUM */
enum { R_START, R_DONE };                                /* F_ROOT */

#define NUM_INT_DIGITS  15 /* digits of a number's integer part at most */
#define NUM_FRAC_DIGITS 8  /* digits of its fraction at most */

typedef struct gfr {
    uint16_t node;
    uint8_t kind, sub;
    uint16_t pos;    /* F_LIT: bytes matched; F_OBJ: the property being read */
    uint8_t neg, nd; /* F_NUM: sign, digits of the part being read */
    uint32_t n;      /* F_STR: characters; F_ARR: items; F_OBJ: next property allowed (with
                      * any keys: members begun) */
    uint32_t keys;   /* F_LIT: 1 when matching an object's keys (node is the object) */
    uint64_t cand;   /* F_LIT: candidates still possible */
    int64_t iv, fv;  /* F_NUM: integer part, fraction digits as an integer */
} gfr;

typedef struct gstate {
    int depth;
    gfr f[EN_GRAMMAR_DEPTH];
} gstate;

static size_t gstate_size(const gstate *s)
{
    return offsetof(gstate, f) + sizeof(gfr) * (size_t)s->depth;
}

static int g_push(gstate *s, int node, fr_kind kind)
{
    if (s->depth >= EN_GRAMMAR_DEPTH) return -1;
    gfr *f = &s->f[s->depth++];
    memset(f, 0, sizeof *f);
    f->node = (uint16_t)node;
    f->kind = (uint8_t)kind;
    return 0;
}

static int lit_n(const en_grammar *g, const gfr *f)
{
    const en_gn *x = &g->nodes[f->node];
    return f->keys ? x->n_props : x->n_lits;
}

static const char *lit_at(const en_grammar *g, const gfr *f, int i)
{
    const en_gn *x = &g->nodes[f->node];
    return f->keys ? x->keys[i] : x->lits[i];
}

/* The value on top ended (result: the literal matched, for keys): its parent moves on. */
static void g_complete(const en_grammar *g, gstate *s, int result)
{
    s->depth--;
    gfr *p = &s->f[s->depth - 1];
    if (p->kind == F_ROOT) {
        p->sub = R_DONE;
    } else if (p->kind == F_ARR) {
        /* counted only as far as a bound needs it, so that states repeat (the mask cache) */
        const en_gn *x = &g->nodes[p->node];
        if (x->max_items >= 0 || p->n < (uint32_t)x->min_items) p->n++;
        p->sub = A_VAL;
    } else if (p->sub != O_KEY && g->nodes[p->node].kind == EN_GN_SWITCH) {
        /* the constant is read: the frame is the chosen object's, past its first property */
        p->node = (uint16_t)g->nodes[p->node].alts[result];
        p->sub = O_VAL;
    } else if (p->sub == O_KEY) {
        p->sub = O_KEYED;
        if (!g->nodes[p->node].any_keys) p->pos = (uint16_t)result, p->n = (uint32_t)result + 1;
    } else {
        p->sub = O_VAL;
    }
}

/* A value of node n begins with byte c: its frame pushed (c not yet consumed). */
static int g_begin(const en_grammar *g, gstate *s, int n, int c)
{
    const en_gn *x = &g->nodes[n];
    int digit = c == '-' || (c >= '0' && c <= '9');
    switch (x->kind) {
    case EN_GN_ANY:
        if (c == '{' || c == '[') { /* any value nests only as deep as the frames go */
            if (s->depth + 2 > EN_GRAMMAR_DEPTH) return -1;
            return c == '{' ? g_push(s, g->any_obj, F_OBJ) : g_push(s, g->any_arr, F_ARR);
        }
        if (c == '"') return g_push(s, g->any_str, F_STR);
        if (digit) return g_push(s, g->any_num, F_NUM);
        return g_begin(g, s, g->any_lit, c);
    case EN_GN_OBJECT:
    case EN_GN_SWITCH:
        return c == '{' ? g_push(s, n, F_OBJ) : -1;
    case EN_GN_ARRAY:
        return c == '[' ? g_push(s, n, F_ARR) : -1;
    case EN_GN_STRING:
        if (c != '"' || g_push(s, n, F_STR)) return -1;
        s->f[s->depth - 1].cand = x->re ? EN_RE_START : 0; /* the pattern's positions */
        return 0;
    case EN_GN_NUMBER:
    case EN_GN_INTEGER:
        return digit ? g_push(s, n, F_NUM) : -1;
    case EN_GN_ENUM:
        if (g_push(s, n, F_LIT)) return -1;
        s->f[s->depth - 1].cand = x->n_lits >= 64 ? ~0ull : (1ull << x->n_lits) - 1;
        return 0;
    case EN_GN_ALT:
        for (int i = 0; i < x->n_alts; i++) {
            uint64_t f[4];
            en_gn_first(g, x->alts[i], f);
            if (f[c >> 6] >> (c & 63) & 1) return g_begin(g, s, x->alts[i], c);
        }
        return -1;
    }
    return -1;
}

/* Whether some number that starts with the magnitudes [lo, hi] (hi < 0: only lo itself) lies
 * within the node's bounds, the sign applied. */
static int num_fits(const en_gn *x, int neg, double lo, double hi)
{
    if (hi < 0) hi = lo;
    double a = neg ? -hi : lo, b = neg ? -lo : hi;
    if (x->has_min && (x->excl_min ? b <= x->min : b < x->min)) return 0;
    if (x->has_max && (x->excl_max ? a >= x->max : a > x->max)) return 0;
    return 1;
}

static double pow10i(int k)
{
    double p = 1;
    while (k-- > 0) p *= 10;
    return p;
}

/* Whether the number read so far can still end within the bounds: as it is (when complete), or
 * with more digits, or with a fraction. */
static int num_viable(const en_gn *x, const gfr *f)
{
    if (!x->has_min && !x->has_max) return 1;
    int integer = x->kind == EN_GN_INTEGER;
    double v = (double)f->iv;
    switch (f->sub) {
    case N_MINUS:
        return num_fits(x, 1, 0, pow10i(NUM_INT_DIGITS));
    case N_ZERO:
        return num_fits(x, f->neg, 0, -1) || (!integer && num_fits(x, f->neg, 0, 1));
    case N_INT:
        if (num_fits(x, f->neg, v, -1) || (!integer && num_fits(x, f->neg, v, v + 1))) return 1;
        for (int k = 1; f->nd + k <= NUM_INT_DIGITS; k++)
            if (num_fits(x, f->neg, v * pow10i(k), (v + 1) * pow10i(k))) return 1;
        return 0;
    case N_DOT:
        return num_fits(x, f->neg, v, v + 1);
    default: { /* N_FRAC */
        double p = pow10i(f->nd), lo = v + (double)f->fv / p;
        return num_fits(x, f->neg, lo, -1) ||
               (f->nd < NUM_FRAC_DIGITS && num_fits(x, f->neg, lo, lo + 1 / p));
    }
    }
}

static int num_complete(const en_gn *x, const gfr *f)
{
    if (f->sub != N_ZERO && f->sub != N_INT && f->sub != N_FRAC) return 0;
    double v = (double)f->iv + (f->sub == N_FRAC ? (double)f->fv / pow10i(f->nd) : 0);
    return num_fits(x, f->neg, v, -1);
}

static int g_feed(const en_grammar *g, gstate *s, int c);

/* A value of node n begins with byte c: an object's, array's or string's opening byte is taken by
 * pushing its frame; a number's or literal's first byte is fed to the frame pushed for it. */
static int g_value(const en_grammar *g, gstate *s, int n, int c)
{
    if (c < 0 || g_begin(g, s, n, c)) return -1;
    int k = s->f[s->depth - 1].kind;
    return k == F_OBJ || k == F_ARR || k == F_STR ? 0 : g_feed(g, s, c);
}

/* F_NUM takes c, or ends (when complete) and hands c to its parent. */
static int g_num(const en_grammar *g, gstate *s, gfr *f, int c)
{
    const en_gn *x = &g->nodes[f->node];
    int d = c >= '0' && c <= '9';
    gfr was = *f;
    /* without bounds the value itself is not kept, so that states repeat (the mask cache) */
    int keep = x->has_min || x->has_max;
    if (f->sub == N_START && c == '-') {
        f->sub = N_MINUS, f->neg = 1;
    } else if ((f->sub == N_START || f->sub == N_MINUS) && d) {
        f->sub = c == '0' ? N_ZERO : N_INT, f->iv = keep ? c - '0' : 0, f->nd = 1;
    } else if (f->sub == N_INT && d && f->nd < NUM_INT_DIGITS) {
        f->iv = keep ? f->iv * 10 + (c - '0') : 0, f->nd++;
    } else if ((f->sub == N_ZERO || f->sub == N_INT) && c == '.' && x->kind == EN_GN_NUMBER) {
        f->sub = N_DOT, f->nd = 0;
    } else if ((f->sub == N_DOT || f->sub == N_FRAC) && d && f->nd < NUM_FRAC_DIGITS) {
        f->sub = N_FRAC, f->fv = keep ? f->fv * 10 + (c - '0') : 0, f->nd++;
    } else {
        if (!num_complete(x, f)) return -1;
        g_complete(g, s, 0);
        return g_feed(g, s, c);
    }
    if (num_viable(x, f)) return 0;
    *f = was;
    return -1;
}

/* F_LIT takes c, or ends (when a candidate is complete) and hands c to its parent. */
static int g_lit(const en_grammar *g, gstate *s, gfr *f, int c)
{
    uint64_t next = 0;
    int done = -1, n = lit_n(g, f);
    for (int i = 0; i < n; i++) {
        if (!(f->cand >> i & 1)) continue;
        const char *l = lit_at(g, f, i);
        size_t len = strlen(l);
        if (len == f->pos) done = i;
        if (c >= 0 && len > f->pos && (unsigned char)l[f->pos] == c) next |= 1ull << i;
    }
    if (next) {
        f->cand = next;
        f->pos++;
        /* every candidate left is complete: the value ends now */
        int longer = 0, only = -1;
        for (int i = 0; i < n; i++)
            if (next >> i & 1) {
                if (strlen(lit_at(g, f, i)) > f->pos) longer = 1;
                only = i;
            }
        if (!longer) g_complete(g, s, only);
        return 0;
    }
    if (done < 0) return -1;
    g_complete(g, s, done);
    return g_feed(g, s, c);
}

static int g_str(const en_grammar *g, gstate *s, gfr *f, int c)
{
    const en_gn *x = &g->nodes[f->node];
    int hex = (c >= '0' && c <= '9') || ((c | 32) >= 'a' && (c | 32) <= 'f');
    switch (f->sub) {
    case S_BODY:
        if (c == '"') {
            if (f->n < (uint32_t)x->min_len || (x->re && !en_re_accepts(x->re, f->cand))) return -1;
            g_complete(g, s, 0);
            return 0;
        }
        if (c < 0x20) return -1;
        if (x->re) { /* printable ASCII, no escapes, along the pattern */
            uint64_t next = c == '\\' ? 0 : en_re_step(x->re, f->cand, c);
            if (!next) return -1;
            f->cand = next;
        }
        if ((c & 0xC0) == 0x80) return 0; /* continues a character already counted */
        if (x->max_len >= 0 && f->n >= (uint32_t)x->max_len) return -1;
        if (x->max_len >= 0 || f->n < (uint32_t)x->min_len) f->n++; /* as far as bounds need */
        if (c == '\\') f->sub = S_ESC;
        return 0;
    case S_ESC:
        if (c == 'u') return f->sub = S_U1, 0;
        if (!strchr("\"\\/bfnrt", c) || !c) return -1;
        return f->sub = S_BODY, 0;
    default:
        if (!hex) return -1;
        f->sub = f->sub == S_U4 ? S_BODY : f->sub + 1;
        return 0;
    }
}

static int g_obj(const en_grammar *g, gstate *s, gfr *f, int c)
{
    const en_gn *x = &g->nodes[f->node];
    uint64_t all = x->n_props >= 64 ? ~0ull : (1ull << x->n_props) - 1;
    uint64_t left = all & ~((f->n >= 64 ? ~0ull : (1ull << f->n) - 1)); /* not yet passed */
    int can_close = x->any_keys || !(x->required & left);
    switch (f->sub) {
    case O_OPEN:
    case O_COMMA:
    case O_COMMA_SP:
        if (c == '}' && f->sub == O_OPEN && can_close) return g_complete(g, s, 0), 0;
        if (c == ' ' && f->sub == O_COMMA) return f->sub = O_COMMA_SP, 0;
        if (c != '"') return -1;
        if (x->any_keys) {
            f->sub = O_KEY;
            f->n++; /* members begun */
            return g_push(s, g->any_str, F_STR);
        } else {
            /* the keys still allowed: properties after the last one, none skipped required */
            uint64_t cand = 0;
            for (int j = (int)f->n; j < x->n_props; j++) {
                cand |= 1ull << j;
                if (x->required >> j & 1) break;
            }
            if (!cand) return -1;
            f->sub = O_KEY;
            if (g_push(s, f->node, F_LIT)) return -1;
            gfr *k = &s->f[s->depth - 1];
            k->keys = 1, k->cand = cand;
            return g_lit(g, s, k, c);
        }
    case O_KEYED:
        return c == ':' ? (f->sub = O_COLON, 0) : -1;
    case O_COLON:
    case O_COLON_SP:
        if (c == ' ' && f->sub == O_COLON) return f->sub = O_COLON_SP, 0;
        return g_value(g, s, x->any_keys ? x->addl : x->props[f->pos], c);
    case O_VAL:
        if (c == '}' && can_close) return g_complete(g, s, 0), 0;
        if (c == ',' && (x->any_keys ? f->n < EN_GN_ANY_MEMBERS : left != 0))
            return f->sub = O_COMMA, 0;
        return -1;
    }
    return -1;
}

static int g_arr(const en_grammar *g, gstate *s, gfr *f, int c)
{
    const en_gn *x = &g->nodes[f->node];
    int min = x->min_items, max = x->max_items;
    if (c == ']' && (f->sub == A_OPEN || f->sub == A_VAL) && f->n >= (uint32_t)min)
        return g_complete(g, s, 0), 0;
    if (f->sub == A_VAL)
        return c == ',' && (max < 0 || f->n < (uint32_t)max) ? (f->sub = A_COMMA, 0) : -1;
    if (c == ' ' && f->sub == A_COMMA) return f->sub = A_COMMA_SP, 0;
    if (f->sub == A_OPEN && max == 0) return -1;
    return g_value(g, s, x->items, c);
}

/* Feeds one byte (c) or the end of the output (c = -1: lazily ending values close). */
static int g_feed(const en_grammar *g, gstate *s, int c)
{
    gfr *f = &s->f[s->depth - 1];
    switch (f->kind) {
    case F_ROOT:
        if (f->sub == R_DONE) return c < 0 ? 0 : -1;
        return g_value(g, s, g->root, c);
    case F_NUM:
        return g_num(g, s, f, c);
    case F_LIT:
        return g_lit(g, s, f, c);
    case F_STR:
        return c < 0 ? -1 : g_str(g, s, f, c);
    case F_OBJ:
        return c < 0 ? -1 : g_obj(g, s, f, c);
    case F_ARR:
        return c < 0 ? -1 : g_arr(g, s, f, c);
    }
    return -1;
}

/* ---------------------------------------------------------------- the vocabulary's byte trie */

typedef struct tnode {
    int32_t lo, hi;     /* its tokens: sorted[lo, hi) */
    int32_t kid, n_kid; /* children nodes[kid, kid + n_kid), by byte */
    int32_t n_end;      /* sorted[lo, lo + n_end) end here */
    uint8_t byte;       /* the edge into it */
    uint8_t plain;      /* every byte below it may sit inside a string as it is */
    uint8_t below;      /* the most bytes a token goes on below it (at most 255) */
} tnode;

struct en_grammar_vocab {
    int n_vocab, n_nodes, max_len;
    tnode *nodes;    /* nodes[0]: the root */
    int32_t *sorted; /* token ids by their bytes */
    uint8_t *bytes;  /* every token's bytes */
    uint32_t *off, *len;
    int32_t *eog;
    int n_eog;
};

typedef struct tok_ref {
    const uint8_t *p;
    uint32_t len;
    int32_t id;
} tok_ref;

static int tok_ref_cmp(const void *a, const void *b)
{
    const tok_ref *x = a, *y = b;
    uint32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    if (c) return c;
    return x->len != y->len ? (x->len < y->len ? -1 : 1) : x->id - y->id;
}

static int plain_byte(uint8_t c)
{
    return c >= 0x20 && c != '"' && c != '\\';
}

static void trie_build(en_grammar_vocab *v, const tok_ref *t, int node, int lo, int hi, int depth)
{
    int k = lo;
    while (k < hi && t[k].len == (uint32_t)depth) k++;
    int ng = 0;
    for (int i = k; i < hi; ng++) {
        uint8_t b = t[i].p[depth];
        while (i < hi && t[i].p[depth] == b) i++;
    }
    int first = v->n_nodes;
    v->n_nodes += ng;
    v->nodes[node] = (tnode){.lo = lo,
                             .hi = hi,
                             .kid = first,
                             .n_kid = ng,
                             .n_end = k - lo,
                             .byte = v->nodes[node].byte,
                             .plain = 1};
    for (int i = k, gi = 0; i < hi; gi++) {
        uint8_t b = t[i].p[depth];
        int j = i;
        while (j < hi && t[j].p[depth] == b) j++;
        v->nodes[first + gi].byte = b;
        trie_build(v, t, first + gi, i, j, depth + 1);
        if (!plain_byte(b) || !v->nodes[first + gi].plain) v->nodes[node].plain = 0;
        int below = 1 + v->nodes[first + gi].below;
        if (below > v->nodes[node].below)
            v->nodes[node].below = (uint8_t)(below > 255 ? 255 : below);
        i = j;
    }
}

void en_grammar_vocab_destroy(en_grammar_vocab *v)
{
    if (!v) return;
    free(v->nodes);
    free(v->sorted);
    free(v->bytes);
    free(v->off);
    free(v->len);
    free(v->eog);
    free(v);
}

int en_grammar_vocab_create(const md_tokenizer *tok, en_grammar_vocab **out)
{
    *out = NULL;
    int n = md_tok_n_vocab(tok);
    en_grammar_vocab *v = calloc(1, sizeof *v);
    tok_ref *t = calloc((size_t)n + 1, sizeof *t);
    if (!v || !t || n < 1) {
        free(t);
        free(v);
        return n < 1 ? KM_EINVAL : KM_ENOMEM;
    }
    v->n_vocab = n;
    v->off = calloc((size_t)n, sizeof *v->off);
    v->len = calloc((size_t)n, sizeof *v->len);
    v->sorted = calloc((size_t)n, sizeof *v->sorted);
    v->eog = calloc((size_t)n, sizeof *v->eog);
    size_t total = 0, cap = (size_t)n * 8;
    v->bytes = malloc(cap);
    int rc = v->off && v->len && v->sorted && v->eog && v->bytes ? 0 : KM_ENOMEM;
    for (int id = 0; !rc && id < n; id++) {
        if (md_tok_is_eog(tok, id)) v->eog[v->n_eog++] = id;
        int len = md_tok_piece(tok, id, 0, NULL, 0);
        if (len < 0) len = 0;
        if (total + (size_t)len > cap) {
            uint8_t *b = realloc(v->bytes, (cap = (total + (size_t)len) * 2));
            if (!b) {
                rc = KM_ENOMEM;
                break;
            }
            v->bytes = b;
        }
        if (len) md_tok_piece(tok, id, 0, (char *)v->bytes + total, len);
        v->off[id] = (uint32_t)total;
        v->len[id] = (uint32_t)len;
        total += (size_t)len;
        if (len > v->max_len) v->max_len = len;
    }
    /* tokens with no bytes (special ones) are never in the trie: only end-of-generation ones
     * are ever allowed, and those separately */
    int m = 0;
    for (int id = 0; !rc && id < n; id++)
        if (v->len[id]) t[m++] = (tok_ref){v->bytes + v->off[id], v->len[id], id};
    if (!rc) {
        qsort(t, (size_t)m, sizeof *t, tok_ref_cmp);
        for (int i = 0; i < m; i++) v->sorted[i] = t[i].id;
        if (!(v->nodes = calloc(total + 1, sizeof *v->nodes))) rc = KM_ENOMEM;
    }
    if (!rc) {
        v->n_nodes = 1;
        trie_build(v, t, 0, 0, m, 0);
    }
    free(t);
    if (rc) {
        en_grammar_vocab_destroy(v);
        return rc;
    }
    *out = v;
    return 0;
}

/* ---------------------------------------------------------------- masks cached by state */

#define CACHE_SLOTS 512 /* open addressing; cleared when half full */

typedef struct gcache_slot {
    uint64_t h;
    void *st; /* the state's bytes (a gstate or an en_cstate); NULL: empty */
    size_t n;
    uint32_t *bits;
} gcache_slot;

typedef struct en_gmask_cache {
    const en_grammar_vocab *v;
    int words, used;
    gcache_slot slot[CACHE_SLOTS];
} en_gmask_cache;

static uint64_t gstate_hash(const void *s, size_t n)
{
    const uint8_t *p = (const uint8_t *)s;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h ? h : 1;
}

static void gcache_clear(en_gmask_cache *c)
{
    for (int i = 0; i < CACHE_SLOTS; i++) {
        free(c->slot[i].st);
        free(c->slot[i].bits);
        c->slot[i] = (gcache_slot){0};
    }
    c->used = 0;
}

static gcache_slot *gcache_find(en_gmask_cache *c, const void *s, size_t n, uint64_t h)
{
    for (int i = 0; i < CACHE_SLOTS; i++) {
        gcache_slot *e = &c->slot[(h + (uint64_t)i) % CACHE_SLOTS];
        if (!e->st || (e->h == h && e->n == n && !memcmp(e->st, s, n))) return e;
    }
    return NULL;
}

en_grammar *en_grammar_ref(en_grammar *g)
{
    g->refs++;
    return g;
}

void en_grammar_free(en_grammar *g)
{
    if (!g || --g->refs > 0) return;
    for (int i = 0; i < g->n_nodes; i++) {
        en_gn *x = &g->nodes[i];
        for (int j = 0; x->keys && j < x->n_props; j++) free(x->keys[j]);
        for (int j = 0; x->lits && j < x->n_lits; j++) free(x->lits[j]);
        free(x->keys);
        free(x->props);
        free(x->lits);
        free(x->alts);
        free(x->re);
    }
    free(g->nodes);
    en_cfg_free(g->cfg);
    if (g->cache) gcache_clear(g->cache);
    free(g->cache);
    free(g);
}

/* ---------------------------------------------------------------- matchers */

struct en_grammar_matcher {
    en_grammar *g;
    const en_grammar_vocab *v;
    gstate st;
    gstate *scratch; /* [max_len + 1]: the states along the trie walk */
    en_cstate *cs;   /* a GBNF grammar or a regex: its state [0], and two to step through */
    en_cstate *cscr; /* [max_len + 1], made at the first mask */
};

int en_grammar_matcher_create(en_grammar *g, const en_grammar_vocab *v, en_grammar_matcher **out)
{
    *out = NULL;
    if (v && g->cache && g->cache->v != v) return KM_EINVAL; /* one vocabulary per grammar */
    en_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m) return KM_ENOMEM;
    if (g->cfg && (!(m->cs = malloc(sizeof *m->cs * 3)) || en_cfg_start(g->cfg, m->cs))) {
        int rc = m->cs ? KM_EINVAL : KM_ENOMEM; /* a start past the bounds of a state */
        free(m->cs);
        free(m);
        return rc;
    }
    if (!v) { /* bytes only */
        m->g = en_grammar_ref(g);
        g_push(&m->st, 0, F_ROOT);
        *out = m;
        return 0;
    }
    if (!g->cache && (g->cache = calloc(1, sizeof *g->cache))) {
        g->cache->v = v;
        g->cache->words = (v->n_vocab + 31) / 32;
    }
    m->scratch = g->cfg ? NULL : malloc(sizeof *m->scratch * (size_t)(v->max_len + 1));
    if ((!g->cfg && !m->scratch) || !g->cache) {
        free(m->scratch);
        free(m->cs);
        free(m);
        return KM_ENOMEM;
    }
    m->g = en_grammar_ref(g);
    m->v = v;
    g_push(&m->st, 0, F_ROOT);
    *out = m;
    return 0;
}

void en_grammar_matcher_destroy(en_grammar_matcher *m)
{
    if (!m) return;
    en_grammar_free(m->g);
    free(m->scratch);
    free(m->cs);
    free(m->cscr);
    free(m);
}

int en_grammar_accept_bytes(en_grammar_matcher *m, const char *bytes, size_t n)
{
    if (m->g->cfg) { /* stepped through cs[1] and cs[2], so a refusal leaves cs[0] as it was */
        const en_cstate *cur = &m->cs[0];
        for (size_t i = 0; i < n; i++) {
            en_cstate *nx = &m->cs[1 + (i & 1)];
            if (en_cfg_step(m->g->cfg, cur, nx, (unsigned char)bytes[i])) return KM_EINVAL;
            cur = nx;
        }
        if (n) memcpy(&m->cs[0], cur, en_cstate_size(cur));
        return 0;
    }
    gstate s;
    memcpy(&s, &m->st, gstate_size(&m->st));
    for (size_t i = 0; i < n; i++)
        if (g_feed(m->g, &s, (unsigned char)bytes[i])) return KM_EINVAL;
    memcpy(&m->st, &s, gstate_size(&s));
    return 0;
}

int en_grammar_complete(const en_grammar_matcher *m)
{
    if (m->g->cfg) return en_cfg_complete(m->cs);
    gstate s;
    memcpy(&s, &m->st, gstate_size(&m->st));
    return g_feed(m->g, &s, -1) == 0;
}

int en_grammar_done(const en_grammar_matcher *m)
{
    if (m->g->cfg) return en_cfg_done(m->cs);
    return m->st.depth == 1 && m->st.f[0].sub == R_DONE;
}

static int is_eog(const en_grammar_vocab *v, int32_t id)
{
    for (int i = 0; i < v->n_eog; i++)
        if (v->eog[i] == id) return 1;
    return 0;
}

int en_grammar_accept_token(en_grammar_matcher *m, int32_t id)
{
    const en_grammar_vocab *v = m->v;
    if (!v || id < 0 || id >= v->n_vocab) return KM_EINVAL;
    if (is_eog(v, id)) return en_grammar_complete(m) ? 0 : KM_EINVAL;
    if (!v->len[id]) return KM_EINVAL;
    return en_grammar_accept_bytes(m, (const char *)v->bytes + v->off[id], v->len[id]);
}

#define SET(bits, id) ((bits)[(id) >> 5] |= 1u << ((id)&31))

static void walk(en_grammar_matcher *m, uint32_t *bits, int node, int depth)
{
    const en_grammar_vocab *v = m->v;
    const tnode *N = &v->nodes[node];
    if (depth > 0)
        for (int k = N->lo; k < N->lo + N->n_end; k++) SET(bits, v->sorted[k]);
    const gstate *cur = &m->scratch[depth];
    const gfr *top = &cur->f[cur->depth - 1];
    /* inside a string, plain bytes change nothing but the count of characters: a plain subtree
     * whose longest token fits in what the string may still take is valid whole */
    const en_gn *sx = &m->g->nodes[top->node];
    if (N->plain && top->kind == F_STR && top->sub == S_BODY && !sx->re &&
        (sx->max_len < 0 || (uint32_t)sx->max_len - top->n >= N->below)) {
        for (int k = N->lo + N->n_end; k < N->hi; k++) SET(bits, v->sorted[k]);
        return;
    }
    for (int i = 0; i < N->n_kid; i++) {
        const tnode *K = &v->nodes[N->kid + i];
        gstate *nx = &m->scratch[depth + 1];
        memcpy(nx, cur, gstate_size(cur));
        if (!g_feed(m->g, nx, K->byte)) walk(m, bits, N->kid + i, depth + 1);
    }
}

/* The trie walk for a GBNF grammar or a regex: the same, over en_cfg_step's states. */
static void cfg_walk(en_grammar_matcher *m, uint32_t *bits, int node, int depth)
{
    const en_grammar_vocab *v = m->v;
    const tnode *N = &v->nodes[node];
    if (depth > 0)
        for (int k = N->lo; k < N->lo + N->n_end; k++) SET(bits, v->sorted[k]);
    for (int i = 0; i < N->n_kid; i++) {
        const tnode *K = &v->nodes[N->kid + i];
        if (!en_cfg_step(m->g->cfg, &m->cscr[depth], &m->cscr[depth + 1], K->byte))
            cfg_walk(m, bits, N->kid + i, depth + 1);
    }
}

void en_grammar_mask(en_grammar_matcher *m, uint32_t *bits)
{
    assert(m->v); /* a matcher made with a vocabulary */
    en_gmask_cache *c = m->g->cache;
    size_t bytes = sizeof *bits * (size_t)c->words;
    const void *key = m->g->cfg ? (const void *)m->cs : (const void *)&m->st;
    size_t n = m->g->cfg ? en_cstate_size(m->cs) : gstate_size(&m->st);
    uint64_t h = gstate_hash(key, n);
    gcache_slot *e = gcache_find(c, key, n, h);
    if (e && e->st) {
        memcpy(bits, e->bits, bytes);
        return;
    }
    memset(bits, 0, bytes);
    if (!m->g->cfg) {
        memcpy(&m->scratch[0], &m->st, gstate_size(&m->st));
        walk(m, bits, 0, 0);
    } else if (m->cscr || (m->cscr = malloc(sizeof *m->cscr * (size_t)(m->v->max_len + 1)))) {
        memcpy(&m->cscr[0], m->cs, n);
        cfg_walk(m, bits, 0, 0);
    }
    int any = 0;
    for (int i = 0; i < c->words && !any; i++) any = bits[i] != 0;
    /* the end is allowed when the value is complete (and, defensively, when nothing else is) */
    if (!any || en_grammar_complete(m))
        for (int i = 0; i < m->v->n_eog; i++) SET(bits, m->v->eog[i]);
    if (c->used >= CACHE_SLOTS / 2) {
        gcache_clear(c);
        e = gcache_find(c, key, n, h);
    }
    if (!e || !(e->st = malloc(n))) return;
    if (!(e->bits = malloc(bytes))) {
        free(e->st);
        e->st = NULL;
        return;
    }
    memcpy(e->st, key, n);
    memcpy(e->bits, bits, bytes);
    e->h = h;
    e->n = n;
    c->used++;
}
