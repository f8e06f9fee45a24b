/*
 * tok_bpe.c — byte-level BPE, tokenizer.ggml.model "gpt2" (SmolLM2, Llama 3, Qwen2, GPT-2).
 *
 * A fragment of text (special tokens are already cut out by tokenizer.c) goes through three
 * steps, each the same as llama.cpp's so that the ids are the same:
 *  1. decode to code points, leniently (invalid bytes become U+FFFD) and re-encode: this is the
 *     text the rest sees;
 *  2. pre-tokenize into words. The Hugging Face regexes are hand-written matchers over code
 *     points and their Unicode categories — no regex engine — and reproduce llama.cpp's own
 *     matchers (unicode.cpp: unicode_regex_split_custom_gpt2/_llama3/_qwen2) including their
 *     small departures from the regexes, plus the std::regex stages of "smollm" and "default";
 *  3. BPE each word: bytes become GPT-2's printable characters, then adjacent symbols are merged
 *     lowest rank first (ties: leftmost) through a binary heap over a linked list of symbols,
 *     with merges looked up by (left id, right id) in a hash table built at create.
 */
#include <stdlib.h>
#include <string.h>

#include "model/tok_internal.h"

#define TOK_OOR 0xFFFFFFFFu /* "no code point": outside the range being split */

/* ---------------------------------------------------------------- pre-tokenizer names */

static const struct {
    const char *name;
    tok_pre pre;
    int ignore_merges, add_bos;
} tok_pre_names[] = {
    /* The names llama.cpp maps to one of these five regex sets with nothing else attached
     * (src/llama-vocab.cpp, llama_vocab::impl::load). "gpt2" is accepted as an alias. */
    {"default", TOK_PRE_DEFAULT, 0, 0},
    {"gpt-2", TOK_PRE_GPT2, 0, 0},
    {"gpt2", TOK_PRE_GPT2, 0, 0},
    {"phi-2", TOK_PRE_GPT2, 0, 0},
    {"gigachat", TOK_PRE_GPT2, 0, 0},
    {"a.x-4.0", TOK_PRE_GPT2, 0, 0},
    {"mellum", TOK_PRE_GPT2, 0, 0},
    {"exaone4", TOK_PRE_GPT2, 0, 0},
    {"mpt", TOK_PRE_GPT2, 0, 0},
    {"olmo", TOK_PRE_GPT2, 0, 0},
    {"jais", TOK_PRE_GPT2, 0, 0},
    {"trillion", TOK_PRE_GPT2, 0, 0},
    {"granite-docling", TOK_PRE_GPT2, 0, 0},
    {"roberta-bpe", TOK_PRE_GPT2, 0, 0},
    {"smollm", TOK_PRE_SMOLLM, 0, 0},
    {"starcoder", TOK_PRE_SMOLLM, 0, 0},
    {"refact", TOK_PRE_SMOLLM, 0, 0},
    {"command-r", TOK_PRE_SMOLLM, 0, 0},
    {"codeshell", TOK_PRE_SMOLLM, 0, 0},
    {"exaone", TOK_PRE_SMOLLM, 0, 0},
    {"minerva-7b", TOK_PRE_SMOLLM, 0, 0},
    {"mellum2", TOK_PRE_SMOLLM, 0, 0},
    {"llama3", TOK_PRE_LLAMA3, 1, 1},
    {"llama-v3", TOK_PRE_LLAMA3, 1, 1},
    {"llama-bpe", TOK_PRE_LLAMA3, 1, 1},
    {"falcon3", TOK_PRE_LLAMA3, 1, 1},
    {"falcon-h1", TOK_PRE_LLAMA3, 1, 1},
    {"pixtral", TOK_PRE_LLAMA3, 1, 1},
    {"midm-2.0", TOK_PRE_LLAMA3, 1, 1},
    {"lfm2", TOK_PRE_LLAMA3, 1, 1},
    {"jina-v5-nano", TOK_PRE_LLAMA3, 1, 1},
    {"dbrx", TOK_PRE_LLAMA3, 0, 0},
    {"smaug-bpe", TOK_PRE_LLAMA3, 0, 0},
    {"qwen2", TOK_PRE_QWEN2, 0, 0},
    {"deepseek-r1-qwen", TOK_PRE_QWEN2, 0, 0},
    {"kormo", TOK_PRE_QWEN2, 0, 0},
    {"f2llmv2", TOK_PRE_QWEN2, 0, 0},
    {"megrez", TOK_PRE_QWEN2, 0, 0},
    {"stablelm2", TOK_PRE_QWEN2, 0, 0},
    {"hunyuan", TOK_PRE_QWEN2, 0, 0},
    {"grok-2", TOK_PRE_QWEN2, 0, 0},
    {"solar-open", TOK_PRE_QWEN2, 0, 0},
};

int tok_bpe_pre_from_name(const char *name, size_t len, int *ignore_merges, int *add_bos)
{
    for (size_t i = 0; i < sizeof tok_pre_names / sizeof tok_pre_names[0]; i++) {
        if (strlen(tok_pre_names[i].name) == len && memcmp(tok_pre_names[i].name, name, len) == 0) {
            *ignore_merges = tok_pre_names[i].ignore_merges;
            *add_bos = tok_pre_names[i].add_bos;
            return (int)tok_pre_names[i].pre;
        }
    }
    return -1;
}

/* ---------------------------------------------------------------- merges */

static uint32_t tok_mix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return (uint32_t)k;
}

static inline uint64_t tok_pair_key(int32_t left, int32_t right)
{
    return (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
}

/* Rank of merging left and right (their result in *result), or -1. */
static int32_t tok_merge_find(const tok_merges *m, int32_t left, int32_t right, int32_t *result)
{
    if (left < 0 || right < 0 || !m->slots) return -1;
    uint64_t key = tok_pair_key(left, right);
    for (uint32_t h = tok_mix64(key) & m->mask;; h = (h + 1) & m->mask) {
        const tok_merge *e = &m->slots[h];
        if (e->key == key) {
            *result = e->result;
            return e->rank;
        }
        if (e->key == UINT64_MAX) return -1;
    }
}

int tok_bpe_load_merges(md_tokenizer *t, const md_gguf *g, km_errbuf *err)
{
    static const char *key = "tokenizer.ggml.merges";
    md_gguf_type elem;
    uint64_t n;
    int rc = md_gguf_get_arr(g, key, &elem, &n);
    if (rc == KM_ENOTFOUND) return km_errf(err, KM_EFORMAT, "tokenizer: %s missing", key);
    if (rc || elem != MD_GGUF_STRING)
        return km_errf(err, KM_EFORMAT, "tokenizer: %s is not an array of strings", key);
    if (n > INT32_MAX / 4)
        return km_errf(err, KM_ERANGE, "tokenizer: %llu merges", (unsigned long long)n);

    tok_merges *m = &t->merges;
    uint32_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots) return km_errf(err, KM_ENOMEM, "tokenizer: merges");
    for (uint32_t i = 0; i < cap; i++) m->slots[i].key = UINT64_MAX;
    m->mask = cap - 1;

    char *joined = NULL;
    size_t joined_cap = 0;
    for (uint64_t i = 0; i < n; i++) {
        km_str s;
        if ((rc = md_gguf_arr_str(g, key, i, &s))) break;
        /* "first second", split at the first space after position 0 (a merge may start with a
         * space in non-byte-level vocabularies). No space: llama.cpp stores an empty pair,
         * which can never match; skip it. */
        const char *sp = s.len > 1 ? memchr(s.ptr + 1, ' ', s.len - 1) : NULL;
        if (!sp) continue;
        size_t n1 = (size_t)(sp - s.ptr), n2 = s.len - n1 - 1;
        if (n2 == 0) continue;
        int32_t left = tok_str_intern(&t->str, s.ptr, n1);
        int32_t right = tok_str_intern(&t->str, sp + 1, n2);
        if ((rc = tok_grow((void **)&joined, &joined_cap, n1 + n2, 1))) break;
        memcpy(joined, s.ptr, n1);
        memcpy(joined + n1, sp + 1, n2);
        int32_t res = tok_str_intern(&t->str, joined, n1 + n2);
        if (left < 0 || right < 0 || res < 0) {
            rc = KM_ENOMEM;
            break;
        }
        uint64_t k = tok_pair_key(left, right);
        uint32_t h = tok_mix64(k) & m->mask;
        while (m->slots[h].key != UINT64_MAX && m->slots[h].key != k) h = (h + 1) & m->mask;
        if (m->slots[h].key == k) continue; /* the first rank of a repeated pair wins */
        m->slots[h] = (tok_merge){k, (int32_t)i, res};
        m->n++;
    }
    free(joined);
    if (rc) return km_errf(err, rc, "tokenizer: reading merges: %s", km_strerror(rc));
    return 0;
}

/* ---------------------------------------------------------------- pre-tokenizers */

/* One range [ini, end) of code points being cut into pieces; piece lengths go to out. */
typedef struct bpe_split {
    const uint32_t *cpt;
    const uint16_t *fl;
    size_t ini, end, prev;
    uint32_t *out;
    size_t n_out;
} bpe_split;

static inline uint32_t bpe_at(const bpe_split *c, size_t pos)
{
    return pos < c->end ? c->cpt[pos] : TOK_OOR;
}

static inline uint16_t bpe_flags_at(const bpe_split *c, size_t pos)
{
    return pos < c->end ? c->fl[pos] : 0;
}

/* Ends a piece at `end` (nothing when empty); returns its length. */
static size_t bpe_cut(bpe_split *c, size_t end)
{
    size_t len = end - c->prev;
    if (len) c->out[c->n_out++] = (uint32_t)len;
    c->prev = end;
    return len;
}

#define BPE_WS  TOK_UCD_WHITESPACE
#define BPE_L   TOK_UCD_LETTER
#define BPE_N   TOK_UCD_NUMBER
#define BPE_WLN (BPE_WS | BPE_L | BPE_N)

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S) */
static void bpe_split_gpt2(bpe_split *c)
{
    for (size_t pos = c->ini; pos < c->end;) {
        uint32_t cpt = bpe_at(c, pos);
        uint16_t f = bpe_flags_at(c, pos);

        if (cpt == '\'' && pos + 1 < c->end) {
            uint32_t nx = bpe_at(c, pos + 1);
            if (nx == 's' || nx == 't' || nx == 'm' || nx == 'd') {
                pos += bpe_cut(c, pos + 2);
                continue;
            }
            if (pos + 2 < c->end) {
                uint32_t nn = bpe_at(c, pos + 2);
                if ((nx == 'r' && nn == 'e') || (nx == 'v' && nn == 'e') ||
                    (nx == 'l' && nn == 'l')) {
                    pos += bpe_cut(c, pos + 3);
                    continue;
                }
            }
        }

        uint16_t f2 = cpt == ' ' ? bpe_flags_at(c, pos + 1) : f;
        if (f2 & BPE_L) { /* ' ?\p{L}+' */
            pos += cpt == ' ';
            while (f2 & BPE_L) f2 = bpe_flags_at(c, ++pos);
            bpe_cut(c, pos);
            continue;
        }
        if (f2 & BPE_N) { /* ' ?\p{N}+' */
            pos += cpt == ' ';
            while (f2 & BPE_N) f2 = bpe_flags_at(c, ++pos);
            bpe_cut(c, pos);
            continue;
        }
        if (!(f2 & BPE_WLN) && f2) { /* ' ?[^\s\p{L}\p{N}]+' */
            pos += cpt == ' ';
            while (!(f2 & BPE_WLN) && f2) f2 = bpe_flags_at(c, ++pos);
            bpe_cut(c, pos);
            continue;
        }

        size_t nws = 0;
        while (bpe_flags_at(c, pos + nws) & BPE_WS) nws++;
        if (nws > 1 && bpe_at(c, pos + nws) != TOK_OOR) { /* '\s+(?!\S)' */
            pos += nws - 1;
            bpe_cut(c, pos);
            continue;
        }
        if (nws > 0) { /* '\s+' */
            pos += nws;
            bpe_cut(c, pos);
            continue;
        }
        bpe_cut(c, ++pos); /* nothing matched: one code point alone */
    }
}

static inline uint32_t bpe_ascii_lower(uint32_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* llama3 (max_digits 3):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 *   \s*[\r\n]+|\s+(?!\S)|\s+
 * qwen2 is the same with \p{N} (max_digits 1). */
static void bpe_split_llama3(bpe_split *c, size_t max_digits)
{
    for (size_t pos = c->ini; pos < c->end;) {
        uint32_t cpt = bpe_at(c, pos);
        uint16_t f = bpe_flags_at(c, pos);

        if (cpt == '\'' && pos + 1 < c->end) {
            uint32_t nx = bpe_ascii_lower(bpe_at(c, pos + 1));
            if (nx == 's' || nx == 't' || nx == 'm' || nx == 'd') {
                pos += bpe_cut(c, pos + 2);
                continue;
            }
            if (pos + 2 < c->end) {
                uint32_t nn = bpe_ascii_lower(bpe_at(c, pos + 2));
                if ((nx == 'r' && nn == 'e') || (nx == 'v' && nn == 'e') ||
                    (nx == 'l' && nn == 'l')) {
                    pos += bpe_cut(c, pos + 3);
                    continue;
                }
            }
        }

        if (!(cpt == '\r' || cpt == '\n' || (f & BPE_N))) { /* '[^\r\n\p{L}\p{N}]?\p{L}+' */
            if ((f & BPE_L) || (bpe_flags_at(c, pos + 1) & BPE_L)) {
                pos++;
                while (bpe_flags_at(c, pos) & BPE_L) pos++;
                bpe_cut(c, pos);
                continue;
            }
        }

        if (f & BPE_N) { /* '\p{N}{1,max_digits}', repeatedly */
            size_t ini = pos;
            while (bpe_flags_at(c, pos) & BPE_N) {
                if (++pos - ini >= max_digits) {
                    bpe_cut(c, pos);
                    ini = pos;
                }
            }
            bpe_cut(c, pos);
            continue;
        }

        /* ' ?[^\s\p{L}\p{N}]+[\r\n]*'. llama.cpp tests the flags of cpt itself (not of the code
         * point after the space) for "is anything": kept, it decides a lone trailing space. */
        uint16_t f2 = cpt == ' ' ? bpe_flags_at(c, pos + 1) : f;
        if (!(f2 & BPE_WLN) && f) {
            pos += cpt == ' ';
            while (!(f2 & BPE_WLN) && f2) f2 = bpe_flags_at(c, ++pos);
            uint32_t c2 = bpe_at(c, pos);
            while (c2 == '\r' || c2 == '\n') c2 = bpe_at(c, ++pos);
            bpe_cut(c, pos);
            continue;
        }

        size_t nws = 0, last_rn = 0;
        while (bpe_flags_at(c, pos + nws) & BPE_WS) {
            uint32_t c2 = bpe_at(c, pos + nws);
            if (c2 == '\r' || c2 == '\n') last_rn = pos + nws + 1;
            nws++;
        }
        if (last_rn > 0) { /* '\s*[\r\n]+' */
            pos = last_rn;
            bpe_cut(c, pos);
            continue;
        }
        if (nws > 1 && bpe_at(c, pos + nws) != TOK_OOR) { /* '\s+(?!\S)' */
            pos += nws - 1;
            bpe_cut(c, pos);
            continue;
        }
        if (nws > 0) { /* '\s+' */
            pos += nws;
            bpe_cut(c, pos);
            continue;
        }
        bpe_cut(c, ++pos);
    }
}

/* llama.cpp runs the other regexes with std::regex over a "collapsed" text (one byte per code
 * point: ASCII as is, other code points by category), so \p{N} there is exactly the NUMBER
 * flag and \p{P} the PUNCT flag. */
static inline int bpe_is_number(const bpe_split *c, size_t pos)
{
    return (c->fl[pos] & BPE_N) != 0;
}

/* [\p{P}\$\+<=>\^~\|] */
static inline int bpe_is_default_punct(const bpe_split *c, size_t pos)
{
    uint32_t cpt = c->cpt[pos];
    return (c->fl[pos] & TOK_UCD_PUNCT) || cpt == '$' || cpt == '+' || cpt == '<' || cpt == '=' ||
           cpt == '>' || cpt == '^' || cpt == '~' || cpt == '|';
}

/* \p{N}: every number code point alone, the text between as pieces. */
static void bpe_split_each_number(bpe_split *c)
{
    for (size_t pos = c->ini; pos < c->end; pos++) {
        if (bpe_is_number(c, pos)) {
            bpe_cut(c, pos);
            bpe_cut(c, pos + 1);
        }
    }
    bpe_cut(c, c->end);
}

/* X+ for a class X: maximal runs, the text between as pieces. */
static void bpe_split_runs(bpe_split *c, int (*in_class)(const bpe_split *, size_t))
{
    for (size_t pos = c->ini; pos < c->end;) {
        if (!in_class(c, pos)) {
            pos++;
            continue;
        }
        bpe_cut(c, pos);
        while (pos < c->end && in_class(c, pos)) pos++;
        bpe_cut(c, pos);
    }
    bpe_cut(c, c->end);
}

static inline int bpe_is_ascii_digit(const bpe_split *c, size_t pos)
{
    return c->cpt[pos] >= '0' && c->cpt[pos] <= '9';
}

/* [0-9][0-9][0-9]: leftmost non-overlapping triples. */
static void bpe_split_digit_triples(bpe_split *c)
{
    for (size_t pos = c->ini; pos + 3 <= c->end;) {
        if (bpe_is_ascii_digit(c, pos) && bpe_is_ascii_digit(c, pos + 1) &&
            bpe_is_ascii_digit(c, pos + 2)) {
            bpe_cut(c, pos);
            bpe_cut(c, pos + 3);
            pos += 3;
        } else {
            pos++;
        }
    }
    bpe_cut(c, c->end);
}

enum {
    BPE_ST_GPT2,
    BPE_ST_LLAMA3,
    BPE_ST_QWEN2,
    BPE_ST_EACH_NUMBER,
    BPE_ST_NUMBER_RUNS,
    BPE_ST_PUNCT_RUNS,
    BPE_ST_TRIPLES
};

/* Applies one stage to every piece of the previous one (in -> out, lengths in code points). */
static size_t bpe_split_stage(int stage, const uint32_t *cpt, const uint16_t *fl,
                              const uint32_t *in, size_t n_in, uint32_t *out)
{
    bpe_split c = {.cpt = cpt, .fl = fl, .out = out};
    size_t start = 0;
    for (size_t i = 0; i < n_in; i++) {
        c.ini = c.prev = start;
        c.end = start + in[i];
        switch (stage) {
        case BPE_ST_GPT2:
            bpe_split_gpt2(&c);
            break;
        case BPE_ST_LLAMA3:
            bpe_split_llama3(&c, 3);
            break;
        case BPE_ST_QWEN2:
            bpe_split_llama3(&c, 1);
            break;
        case BPE_ST_EACH_NUMBER:
            bpe_split_each_number(&c);
            break;
        case BPE_ST_NUMBER_RUNS:
            bpe_split_runs(&c, bpe_is_number);
            break;
        case BPE_ST_PUNCT_RUNS:
            bpe_split_runs(&c, bpe_is_default_punct);
            break;
        default:
            bpe_split_digit_triples(&c);
            break;
        }
        start = c.end;
    }
    return c.n_out;
}

/* ---------------------------------------------------------------- BPE of one word */

typedef struct bpe_sym {
    int32_t prev, next;
    uint32_t start, n; /* bytes of the word; n == 0 once merged into its left neighbour */
    int32_t sid;       /* the text's string id, -1 when it is no known string */
} bpe_sym;

typedef struct bpe_pair {
    int32_t rank, left, right, result;
    uint32_t size; /* left.n + right.n when queued: a changed sum means the pair is stale */
} bpe_pair;

/* Working memory of one tok_bpe_encode call, grown as needed. */
typedef struct bpe_work {
    uint32_t *cpt;
    uint16_t *fl;
    uint32_t *cpt_off; /* byte offset of each code point in text, plus the end */
    char *text;        /* the fragment after lenient decoding, re-encoded */
    uint32_t *span[2];
    bpe_sym *sym;
    bpe_pair *heap;
    char *enc; /* a word in GPT-2 characters (ignore_merges lookup) */
    size_t cap_cpt, cap_fl, cap_off, cap_text, cap_span[2], cap_sym, cap_heap, cap_enc;
    size_t n_heap;
} bpe_work;

static inline int bpe_pair_less(const bpe_pair *a, const bpe_pair *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static int bpe_heap_push(bpe_work *w, bpe_pair p)
{
    int rc = tok_grow((void **)&w->heap, &w->cap_heap, w->n_heap + 1, sizeof *w->heap);
    if (rc) return rc;
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bpe_pair_less(&p, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = p;
    return 0;
}

static bpe_pair bpe_heap_pop(bpe_work *w)
{
    bpe_pair top = w->heap[0];
    bpe_pair last = w->heap[--w->n_heap];
    size_t i = 0, n = w->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const bpe_pair *best = &last;
        if (l < n && bpe_pair_less(&w->heap[l], best)) m = l, best = &w->heap[l];
        if (r < n && bpe_pair_less(&w->heap[r], best)) m = r;
        if (m == i) break;
        w->heap[i] = w->heap[m];
        i = m;
    }
    if (n) w->heap[i] = last;
    return top;
}

static int bpe_try_pair(const md_tokenizer *t, bpe_work *w, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return 0;
    int32_t result;
    int32_t rank = tok_merge_find(&t->merges, w->sym[left].sid, w->sym[right].sid, &result);
    if (rank < 0) return 0;
    bpe_pair p = {rank, left, right, result, w->sym[left].n + w->sym[right].n};
    return bpe_heap_push(w, p);
}

static int bpe_word(const md_tokenizer *t, bpe_work *w, tok_ids *out, const unsigned char *word,
                    size_t n)
{
    int rc;
    if (t->ignore_merges) {
        /* Pre-tokenizers that say so take a word that is a whole token as is. */
        if ((rc = tok_grow((void **)&w->enc, &w->cap_enc, 2 * n, 1))) return rc;
        size_t m = 0;
        for (size_t i = 0; i < n; i++) m += tok_utf8_encode(t->byte_cpt[word[i]], w->enc + m);
        int32_t sid = tok_str_find(&t->str, w->enc, m);
        if (sid >= 0 && sid < t->n_vocab) return tok_push_id(out, sid);
    }

    if ((rc = tok_grow((void **)&w->sym, &w->cap_sym, n, sizeof *w->sym))) return rc;
    for (size_t i = 0; i < n; i++) {
        w->sym[i] = (bpe_sym){.prev = (int32_t)i - 1,
                              .next = i + 1 < n ? (int32_t)i + 1 : -1,
                              .start = (uint32_t)i,
                              .n = 1,
                              .sid = t->byte_sid[word[i]]};
    }
    w->n_heap = 0;
    for (size_t i = 1; i < n; i++)
        if ((rc = bpe_try_pair(t, w, (int32_t)i - 1, (int32_t)i))) return rc;

    while (w->n_heap > 0) {
        bpe_pair p = bpe_heap_pop(w);
        bpe_sym *l = &w->sym[p.left], *r = &w->sym[p.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != p.size) continue; /* stale */
        l->n += r->n;
        r->n = 0;
        l->sid = p.result;
        l->next = r->next;
        if (r->next >= 0) w->sym[r->next].prev = p.left;
        if ((rc = bpe_try_pair(t, w, l->prev, p.left))) return rc;
        if ((rc = bpe_try_pair(t, w, p.left, w->sym[p.left].next))) return rc;
    }

    for (int32_t i = 0; i >= 0 && (size_t)i < n; i = w->sym[i].next) {
        const bpe_sym *s = &w->sym[i];
        if (s->sid >= 0 && s->sid < t->n_vocab) {
            if ((rc = tok_push_id(out, s->sid))) return rc;
            continue;
        }
        /* Not a token: llama.cpp looks each byte of the GPT-2-encoded text up as a
         * one-character token and drops those that are none. */
        for (uint32_t j = s->start; j < s->start + s->n; j++) {
            char u[4];
            int k = tok_utf8_encode(t->byte_cpt[word[j]], u);
            for (int b = 0; b < k; b++) {
                int32_t id = t->byte_tok[(unsigned char)u[b]];
                if (id >= 0 && (rc = tok_push_id(out, id))) return rc;
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- one fragment */

static int bpe_fragment(const md_tokenizer *t, bpe_work *w, tok_ids *out, const char *raw,
                        size_t len)
{
    int rc;
    /* 1. Code points (at most len of them) and the re-encoded text (at most 3 bytes per input
     * byte: U+FFFD for a bad one). */
    if ((rc = tok_grow((void **)&w->cpt, &w->cap_cpt, len, sizeof *w->cpt)) ||
        (rc = tok_grow((void **)&w->fl, &w->cap_fl, len, sizeof *w->fl)) ||
        (rc = tok_grow((void **)&w->cpt_off, &w->cap_off, len + 1, sizeof *w->cpt_off)) ||
        (rc = tok_grow((void **)&w->text, &w->cap_text, 3 * len, 1)) ||
        (rc = tok_grow((void **)&w->span[0], &w->cap_span[0], len, sizeof *w->span[0])) ||
        (rc = tok_grow((void **)&w->span[1], &w->cap_span[1], len, sizeof *w->span[1])))
        return rc;
    const unsigned char *s = (const unsigned char *)raw;
    size_t n = 0, m = 0;
    for (size_t i = 0; i < len;) {
        size_t used;
        uint32_t cpt = tok_utf8_decode(s + i, len - i, &used);
        i += used;
        w->cpt[n] = cpt;
        w->fl[n] = tok_ucd_flags(cpt);
        w->cpt_off[n++] = (uint32_t)m;
        m += tok_utf8_encode(cpt, w->text + m);
    }
    w->cpt_off[n] = (uint32_t)m;

    /* 2. Words. */
    static const int stages[][5] = {
        [TOK_PRE_DEFAULT] = {BPE_ST_PUNCT_RUNS, BPE_ST_GPT2, BPE_ST_NUMBER_RUNS, BPE_ST_TRIPLES,
                             -1},
        [TOK_PRE_GPT2] = {BPE_ST_GPT2, -1},
        [TOK_PRE_SMOLLM] = {BPE_ST_EACH_NUMBER, BPE_ST_GPT2, -1},
        [TOK_PRE_LLAMA3] = {BPE_ST_LLAMA3, -1},
        [TOK_PRE_QWEN2] = {BPE_ST_QWEN2, -1},
    };
    uint32_t *in = w->span[0], *next = w->span[1];
    size_t n_spans = 1;
    in[0] = (uint32_t)n;
    for (const int *st = stages[t->pre]; *st >= 0; st++) {
        n_spans = bpe_split_stage(*st, w->cpt, w->fl, in, n_spans, next);
        uint32_t *tmp = in;
        in = next;
        next = tmp;
    }

    /* 3. BPE per word. */
    size_t at = 0;
    for (size_t i = 0; i < n_spans; i++) {
        size_t b0 = w->cpt_off[at], b1 = w->cpt_off[at + in[i]];
        at += in[i];
        if ((rc = bpe_word(t, w, out, (const unsigned char *)w->text + b0, b1 - b0))) return rc;
    }
    return 0;
}

int tok_bpe_encode(const md_tokenizer *t, tok_ids *out, const char *text, size_t len)
{
    if (len == 0) return 0;
    if (len > INT32_MAX / 4) return KM_ERANGE; /* symbol indices are int32 */
    bpe_work w = {0};
    int rc = bpe_fragment(t, &w, out, text, len);
    free(w.cpt);
    free(w.fl);
    free(w.cpt_off);
    free(w.text);
    free(w.span[0]);
    free(w.span[1]);
    free(w.sym);
    free(w.heap);
    free(w.enc);
    return rc;
}
