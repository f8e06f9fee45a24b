/*
 * grammar_cfg_run.c — the matcher of the grammar extensions (grammar_cfg.c compiles them): a
 * state is a set of stacks of positions in the rules, stepped over output bytes read as UTF-8.
 * docs/structured.md, "GBNF grammars and regexes", says why it is built this way.
 */
#include <stddef.h>
#include <string.h>

#include "engine/grammar_internal.h"

static int set_has(const en_cfg *g, uint32_t s, uint32_t cp)
{
    const en_cset *x = &g->sets[s];
    for (uint32_t i = 0; i < x->n; i++)
        if (cp >= g->rng[x->off + i][0] && cp <= g->rng[x->off + i][1]) return !x->neg;
    return x->neg;
}

/* Whether set s holds some code point in [lo, hi]. */
static int set_meets(const en_cfg *g, uint32_t s, uint32_t lo, uint32_t hi)
{
    const en_cset *x = &g->sets[s];
    for (uint32_t i = 0; i < x->n; i++) {
        const uint32_t *r = g->rng[x->off + i];
        if (x->neg && r[0] <= lo && r[1] >= hi) return 0;
        if (!x->neg && r[0] <= hi && r[1] >= lo) return 1;
    }
    return x->neg;
}

static int cont(const en_cfg *g, uint32_t p)
{
    return g->el[p].t != EN_CE_ALT && g->el[p].t != EN_CE_END;
}

/* stk[0, len) into o's set, unless already there. */
static int cs_add(en_cstate *o, const uint32_t *stk, int len)
{
    for (uint32_t i = 0, k = 0; k < o->n_st; k++) {
        if (o->w[i] == (uint32_t)len && !memcmp(o->w + i + 1, stk, sizeof *stk * (size_t)len))
            return 0;
        i += 1 + o->w[i];
    }
    if (o->n_st >= EN_CFG_STACKS || o->used + 1 + (uint32_t)len > EN_CFG_WORDS) return -1;
    o->w[o->used] = (uint32_t)len;
    memcpy(o->w + o->used + 1, stk, sizeof *stk * (size_t)len);
    o->used += 1 + (uint32_t)len;
    o->n_st++;
    return 0;
}

/* stk into o with every rule reference on top replaced by its alternatives, until the tops are
 * character sets (an empty stack: the output may end). */
static int cs_expand(const en_cfg *g, en_cstate *o, const uint32_t *stk, int len, int guard)
{
    if (len == 0 || g->el[stk[len - 1]].t == EN_CE_SET) return cs_add(o, stk, len);
    if (guard > EN_CFG_DEPTH) return -1;
    uint32_t top = stk[len - 1], buf[EN_CFG_DEPTH + 2];
    int base = len - 1;
    memcpy(buf, stk, sizeof *buf * (size_t)base);
    if (cont(g, top + 1)) buf[base++] = top + 1;
    for (uint32_t a = g->rule_off[g->el[top].a];; a++) {
        int n = base;
        if (cont(g, a)) {
            if (n >= EN_CFG_DEPTH) return -1;
            buf[n++] = a;
        }
        if (cs_expand(g, o, buf, n, guard + 1)) return -1;
        while (cont(g, a)) a++;
        if (g->el[a].t == EN_CE_END) break;
    }
    return 0;
}

int en_cfg_start(const en_cfg *g, en_cstate *s)
{
    memset(s, 0, offsetof(en_cstate, w));
    static const uint32_t start[1] = {0}; /* el[0]: the reference to root */
    return cs_expand(g, s, start, 1, 0);
}

size_t en_cstate_size(const en_cstate *s)
{
    return offsetof(en_cstate, w) + sizeof *s->w * s->used;
}

/* The least code point a character of len bytes may hold (no overlong forms). */
static uint32_t utf8_min(int len)
{
    return len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
}

/* Some stack's top may hold a code point in [lo, hi]. */
static int cs_viable(const en_cfg *g, const en_cstate *s, uint32_t lo, uint32_t hi)
{
    if (lo < utf8_min(s->len)) lo = utf8_min(s->len);
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    if (lo > hi) return 0;
    for (uint32_t i = 0, k = 0; k < s->n_st; k++, i += 1 + s->w[i])
        if (s->w[i] && set_meets(g, g->el[s->w[i + s->w[i]]].a, lo, hi)) return 1;
    return 0;
}

int en_cfg_step(const en_cfg *g, const en_cstate *in, en_cstate *o, int c)
{
    if (c < 0) return en_cfg_complete(in) ? 0 : -1;
    uint32_t cp;
    if (in->need) {
        if ((c & 0xC0) != 0x80) return -1;
        cp = in->cp << 6 | (uint32_t)(c & 0x3F);
        if (in->need == 1 && (cp < utf8_min(in->len) || (cp >= 0xD800 && cp < 0xE000)))
            return -1; /* overlong, or a surrogate */
        if (in->need > 1) {
            memcpy(o, in, en_cstate_size(in));
            o->cp = cp, o->need--;
            uint32_t k = 6u * o->need;
            return cs_viable(g, o, cp << k, cp << k | ((1u << k) - 1)) ? 0 : -1;
        }
    } else if (c < 0x80) {
        cp = (uint32_t)c;
    } else {
        int need = c >= 0xF0 && c <= 0xF4 ? 3 : c >= 0xE0 ? 2 : c >= 0xC2 && c < 0xE0 ? 1 : 0;
        if (!need || c > 0xF4) return -1;
        memcpy(o, in, en_cstate_size(in));
        o->cp = (uint32_t)c & (0x3Fu >> need), o->need = (uint8_t)need;
        o->len = (uint8_t)(need + 1);
        uint32_t k = 6u * (uint32_t)need;
        return cs_viable(g, o, o->cp << k, o->cp << k | ((1u << k) - 1)) ? 0 : -1;
    }
    memset(o, 0, offsetof(en_cstate, w));
    uint32_t buf[EN_CFG_DEPTH + 2];
    for (uint32_t i = 0, k = 0; k < in->n_st; k++, i += 1 + in->w[i]) {
        int len = (int)in->w[i];
        if (!len) continue;
        uint32_t top = in->w[i + (uint32_t)len];
        if (!set_has(g, g->el[top].a, cp)) continue;
        memcpy(buf, in->w + i + 1, sizeof *buf * (size_t)(len - 1));
        int n = len - 1;
        if (cont(g, top + 1)) buf[n++] = top + 1;
        if (cs_expand(g, o, buf, n, 0)) return -1;
    }
    return o->n_st ? 0 : -1;
}

int en_cfg_complete(const en_cstate *s)
{
    if (s->need) return 0;
    for (uint32_t i = 0, k = 0; k < s->n_st; k++, i += 1 + s->w[i])
        if (!s->w[i]) return 1;
    return 0;
}

int en_cfg_done(const en_cstate *s)
{
    return s->n_st == 1 && en_cfg_complete(s);
}
