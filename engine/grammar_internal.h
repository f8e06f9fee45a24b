/*
 * grammar_internal.h — what the grammar's two files share: grammar_schema.c (a JSON Schema read
 * and compiled into nodes) and grammar.c (the nodes run as a pushdown automaton over bytes, the
 * vocabulary's byte trie, the per-step mask). Private to engine/; engine.h is the contract and
 * docs/structured.md the story.
 */
#ifndef EN_GRAMMAR_INTERNAL_H
#define EN_GRAMMAR_INTERNAL_H

#include "engine/engine.h"

/* Schema nodes. A value of a node starts with a byte of its first set (en_gn_first). */
typedef enum en_gn_kind {
    EN_GN_ANY,     /* any JSON value */
    EN_GN_OBJECT,  /* listed properties in order; or any keys (any_keys) */
    EN_GN_ARRAY,   /* items of one node */
    EN_GN_STRING,  /* with a length in characters between min_len and max_len */
    EN_GN_NUMBER,  /* no exponent; bounds when has_min / has_max */
    EN_GN_INTEGER, /* the same without a fraction */
    EN_GN_ENUM,    /* one of lits (JSON texts): enum, const, boolean, null */
    EN_GN_ALT,     /* one of alts, told apart by their first byte (anyOf, a list of types) */
    EN_GN_SWITCH,  /* one of alts, objects told apart by the constant value of their shared first
                    * property (a discriminated union): props[0] is that property, an enum of
                    * the constants in the order of alts */
} en_gn_kind;

#define EN_GN_MAX_PROPS  64 /* properties of one object, literals of one enum (a 64-bit set) */
#define EN_GRAMMAR_DEPTH 24 /* frames of the automaton: nesting of values, plus one */
/* Values of no listed shape (json_object, an object without properties, an untyped value) end:
 * at most this many members an object, items an array, so a model that repeats itself still
 * closes its value (docs/structured.md, "Limits"). */
#define EN_GN_ANY_MEMBERS 16
#define EN_GN_ANY_ITEMS   32

/* A string's pattern (grammar_regex.c): a position automaton of at most 63 positions; a set of
 * positions is a 64-bit word whose bit 63 is the start. */
typedef struct en_re {
    int n_pos, nullable;
    uint64_t first, last;
    uint64_t follow[63];
    uint64_t cls[63][2]; /* the ASCII bytes each position matches */
} en_re;

int en_re_compile(const char *pat, size_t len, en_re **out, km_errbuf *err);
/* The positions after byte c from set (0: no match can go on). */
uint64_t en_re_step(const en_re *re, uint64_t set, int c);
int en_re_accepts(const en_re *re, uint64_t set);
#define EN_RE_START (1ull << 63)

typedef struct en_gn {
    en_gn_kind kind;
    /* object: keys as JSON text ("\"name\""), their value nodes, which are required */
    int n_props;
    char **keys;
    int *props;
    uint64_t required;
    int any_keys, addl; /* any keys allowed (values of node addl) when the object lists none */
    /* array */
    int items, min_items, max_items; /* max_items -1: none */
    /* string */
    int min_len, max_len; /* max_len -1: none */
    en_re *re;            /* pattern; NULL: none */
    /* number, integer */
    int has_min, has_max, excl_min, excl_max;
    double min, max;
    /* enum */
    int n_lits;
    char **lits;
    /* alt */
    int n_alts;
    int *alts;
} en_gn;

/* A GBNF grammar or a regex (grammar_cfg.c): rules run by a set of stacks (grammar_cfg_run.c).
 * Each rule's alternatives are elements, EN_CE_ALT between them, EN_CE_END after the last. */
enum { EN_CE_END, EN_CE_ALT, EN_CE_REF, EN_CE_SET };

typedef struct en_cel {
    uint32_t t : 2, a : 30; /* EN_CE_REF: the rule; EN_CE_SET: the set */
} en_cel;

typedef struct en_cset {
    uint32_t off, n; /* ranges rng[off, off + n) */
    int neg;
} en_cset;

typedef struct en_cfg {
    en_cel *el; /* el[0] = REF root, el[1] = END: the start */
    int n_el;
    uint32_t *rule_off; /* each rule's alternatives: elements, EN_CE_ALT, ..., EN_CE_END */
    int n_rules;
    uint32_t (*rng)[2];
    en_cset *sets;
} en_cfg;
#define EN_CFG_STACKS 64   /* stacks of one state at most */
#define EN_CFG_DEPTH  60   /* positions of one stack at most */
#define EN_CFG_WORDS  1024 /* the stacks' words, with their lengths */
/* A state: the stacks one after another, each its length then its positions (the top last); cp
 * need and len: a UTF-8 character begun. Compared and hashed as bytes up to en_cstate_size. */
typedef struct en_cstate {
    uint32_t cp;
    uint8_t need, len; /* bytes still to come, of a character of len bytes */
    uint16_t n_st;
    uint32_t used;
    uint32_t w[EN_CFG_WORDS];
} en_cstate;

/* src: GBNF (regex 0) or a regex (1). KM_EINVAL with the reason in err. */
int en_cfg_compile(const char *src, size_t len, int regex, en_cfg **out, km_errbuf *err);
void en_cfg_free(en_cfg *c);
int en_cfg_start(const en_cfg *g, en_cstate *s);
/* in after byte c (-1: the end) into o; -1 when c is not valid there. */
int en_cfg_step(const en_cfg *g, const en_cstate *in, en_cstate *o, int c);
int en_cfg_complete(const en_cstate *s);
int en_cfg_done(const en_cstate *s);
size_t en_cstate_size(const en_cstate *s);

struct en_grammar {
    en_gn *nodes;
    int n_nodes, cap_nodes, root;
    int any_val, any_obj, any_arr, any_str, any_num, any_lit; /* any value, and its parts */
    int refs;
    struct en_gmask_cache *cache; /* masks by automaton state, for one vocabulary */
    en_cfg *cfg;                  /* a GBNF grammar or a regex: the nodes are unused */
};

/* grammar_schema.c */
/* The first bytes a value of node n may start with, as a 256-bit set. */
void en_gn_first(const en_grammar *g, int n, uint64_t set[4]);

#endif
