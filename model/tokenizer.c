/*
 * tokenizer.c — the tokenizer of km.h: the vocabulary read from a GGUF's tokenizer.* keys, the
 * special-token rules, every token's piece, and the queries over them. Text to ids and back
 * (special texts cut out first, then byte-level BPE in tok_bpe.c or SentencePiece BPE in
 * tok_spm.c; pieces and the streaming detokenizer) is tok_text.c.
 *
 * The reference is llama.cpp (src/llama-vocab.cpp): the same bytes must give the same ids, so
 * its load-time rules are repeated here — default special ids per model type, the end-of-turn
 * and end-of-generation tokens recognised by their text, control-type overrides, special tokens
 * cut out longest first. Where llama.cpp leaves an order to an unordered_map (which text becomes
 * the EOT token when several qualify), the first in its list of names wins here.
 *
 * Everything the encoder needs is built at create and read-only afterwards: token text -> id
 * and merge pair -> rank hash tables, and every token's decoded piece.
 */
#define _GNU_SOURCE /* qsort_r */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tok_internal.h"

/* ---------------------------------------------------------------- small shared helpers */

int tok_grow(void **p, size_t *cap, size_t n, size_t elem)
{
    if (n <= *cap && *p) return 0;
    size_t c = *cap ? *cap : 16;
    while (c < n) {
        if (c > SIZE_MAX / 2 / elem) return KM_ENOMEM;
        c *= 2;
    }
    void *q = realloc(*p, c * elem);
    if (!q) return KM_ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

int tok_push_id(tok_ids *out, int32_t id)
{
    if (out->n == out->cap) {
        int rc = tok_grow((void **)&out->v, &out->cap, out->n + 1, sizeof *out->v);
        if (rc) return rc;
    }
    out->v[out->n++] = id;
    return 0;
}

/* ---------------------------------------------------------------- interned strings */

static uint32_t tok_hash(const char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 0x100000001b3ULL;
    return (uint32_t)(h ^ h >> 32);
}

int32_t tok_str_find(const tok_strings *s, const char *p, size_t n)
{
    if (!s->slots) return -1;
    uint32_t hash = tok_hash(p, n);
    for (uint32_t h = hash & s->mask;; h = (h + 1) & s->mask) {
        const struct tok_slot *e = &s->slots[h];
        if (e->sid < 0) return -1;
        if (e->hash == hash && e->len == n && memcmp(s->pool + e->off, p, n) == 0) return e->sid;
    }
}

/* The slot holding this text, or the empty slot where it belongs. */
static uint32_t tok_str_slot(const tok_strings *s, const char *p, size_t n, uint32_t hash)
{
    for (uint32_t h = hash & s->mask;; h = (h + 1) & s->mask) {
        const struct tok_slot *e = &s->slots[h];
        if (e->sid < 0 || (e->hash == hash && e->len == n && memcmp(s->pool + e->off, p, n) == 0))
            return h;
    }
}

static int tok_str_rehash(tok_strings *s, uint32_t cap)
{
    struct tok_slot *old = s->slots;
    uint32_t old_cap = old ? s->mask + 1 : 0;
    s->slots = malloc((size_t)cap * sizeof *s->slots);
    if (!s->slots) {
        s->slots = old;
        return KM_ENOMEM;
    }
    for (uint32_t i = 0; i < cap; i++) s->slots[i].sid = -1;
    s->mask = cap - 1;
    for (uint32_t i = 0; i < old_cap; i++) {
        if (old[i].sid < 0) continue;
        uint32_t h = old[i].hash & s->mask;
        while (s->slots[h].sid >= 0) h = (h + 1) & s->mask; /* texts are distinct */
        s->slots[h] = old[i];
    }
    free(old);
    return 0;
}

/* Appends a text to the pool as a new sid (not hashed). */
static int32_t tok_str_append(tok_strings *s, const char *p, size_t n)
{
    if (s->pool_len + n > UINT32_MAX || s->n == INT32_MAX) return KM_ERANGE;
    if (tok_grow((void **)&s->pool, &s->pool_cap, s->pool_len + n + 1, 1)) return KM_ENOMEM;
    size_t cap = (size_t)s->cap;
    if (tok_grow((void **)&s->off, &cap, (size_t)s->n + 1, sizeof *s->off)) return KM_ENOMEM;
    cap = (size_t)s->cap;
    if (tok_grow((void **)&s->len, &cap, (size_t)s->n + 1, sizeof *s->len)) return KM_ENOMEM;
    s->cap = (int32_t)(cap > INT32_MAX ? INT32_MAX : cap);
    memcpy(s->pool + s->pool_len, p, n);
    s->pool[s->pool_len + n] = 0;
    s->off[s->n] = (uint32_t)s->pool_len;
    s->len[s->n] = (uint32_t)n;
    s->pool_len += n + 1;
    return s->n++;
}

/* Makes sid findable by its text; an existing entry with the same text is replaced (the last id
 * of a repeated token text wins, as in llama.cpp's token_to_id). */
static int tok_str_index(tok_strings *s, int32_t sid)
{
    if ((uint32_t)(s->n_slots_used + 1) * 2 > s->mask + 1) {
        int rc = tok_str_rehash(s, (s->mask + 1) * 2);
        if (rc) return rc;
    }
    const char *p = s->pool + s->off[sid];
    uint32_t hash = tok_hash(p, s->len[sid]);
    uint32_t h = tok_str_slot(s, p, s->len[sid], hash);
    if (s->slots[h].sid < 0) s->n_slots_used++;
    s->slots[h] = (struct tok_slot){sid, hash, s->off[sid], s->len[sid]};
    return 0;
}

int32_t tok_str_intern(tok_strings *s, const char *p, size_t n)
{
    int32_t sid = tok_str_find(s, p, n);
    if (sid >= 0) return sid;
    sid = tok_str_append(s, p, n);
    if (sid < 0) return sid;
    int rc = tok_str_index(s, sid);
    return rc ? rc : sid;
}

/* ---------------------------------------------------------------- create */

static int32_t tok_find_token(const md_tokenizer *t, const char *text)
{
    int32_t sid = tok_str_find(&t->str, text, strlen(text));
    return sid < t->n_vocab ? sid : -1;
}

/* The first of these texts that is a token (llama.cpp tries them in hash order). Its type
 * becomes control, as llama.cpp forces. */
static int32_t tok_find_named(md_tokenizer *t, const char *const *names)
{
    for (; *names; names++) {
        int32_t id = tok_find_token(t, *names);
        if (id >= 0) {
            t->attr[id] |= TOK_ATTR_CONTROL;
            return id;
        }
    }
    return -1;
}

/* Reads an optional id key; ids outside the vocabulary are ignored (llama.cpp warns and keeps
 * the default). */
static void tok_read_id(const md_gguf *g, const char *key, int32_t n_vocab, int32_t *id)
{
    uint32_t v;
    if (md_gguf_get_u32(g, key, &v) == 0 && v < (uint32_t)n_vocab) *id = (int32_t)v;
}

static void tok_read_flag(const md_gguf *g, const char *key, int *flag)
{
    int v;
    if (md_gguf_get_bool(g, key, &v) == 0) *flag = v;
}

/* Reads element i of a little-endian int32 or float32 array that may sit unaligned. */
static int32_t tok_le_i32(const void *base, uint64_t i)
{
    const unsigned char *p = (const unsigned char *)base + 4 * i;
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

static float tok_le_f32(const void *base, uint64_t i)
{
    int32_t bits = tok_le_i32(base, i);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static int tok_read_vocab(md_tokenizer *t, const md_gguf *g, km_errbuf *err)
{
    static const char *k_tokens = "tokenizer.ggml.tokens", *k_scores = "tokenizer.ggml.scores",
                      *k_types = "tokenizer.ggml.token_type";
    md_gguf_type elem;
    uint64_t n;
    int rc = md_gguf_get_arr(g, k_tokens, &elem, &n);
    if (rc || elem != MD_GGUF_STRING)
        return km_errf(err, KM_EFORMAT, "tokenizer: %s %s", k_tokens,
                       rc == KM_ENOTFOUND ? "missing" : "is not an array of strings");
    if (n == 0 || n > INT32_MAX / 2)
        return km_errf(err, KM_EFORMAT, "tokenizer: %llu tokens", (unsigned long long)n);
    t->n_vocab = (int32_t)n;

    const void *scores = NULL, *types = NULL;
    int scores_int = 0;
    uint64_t m;
    if (md_gguf_get_arr(g, k_scores, &elem, &m) == 0) {
        if ((elem != MD_GGUF_FLOAT32 && elem != MD_GGUF_INT32) || m < n)
            return km_errf(err, KM_EFORMAT, "tokenizer: bad %s", k_scores);
        scores = md_gguf_arr_data(g, k_scores);
        scores_int = elem == MD_GGUF_INT32;
    }
    if (md_gguf_get_arr(g, k_types, &elem, &m) == 0) {
        if (elem != MD_GGUF_INT32 || m < n)
            return km_errf(err, KM_EFORMAT, "tokenizer: bad %s", k_types);
        types = md_gguf_arr_data(g, k_types);
    }

    t->score = malloc(n * sizeof *t->score);
    t->attr = malloc(n * sizeof *t->attr);
    if (!t->score || !t->attr) return km_errf(err, KM_ENOMEM, "tokenizer: vocab");
    for (uint64_t i = 0; i < n; i++) {
        km_str s;
        if ((rc = md_gguf_arr_str(g, k_tokens, i, &s)))
            return km_errf(err, rc, "tokenizer: token %llu", (unsigned long long)i);
        char empty[32];
        if (s.len == 0) { /* as llama.cpp: an empty text would make lookups ambiguous */
            s.len = (uint64_t)snprintf(empty, sizeof empty, "[EMPTY_%llu]", (unsigned long long)i);
            s.ptr = empty;
        }
        if (s.len > UINT32_MAX / 2 || tok_str_append(&t->str, s.ptr, s.len) < 0)
            return km_errf(err, KM_ENOMEM, "tokenizer: token %llu", (unsigned long long)i);
        t->score[i] =
            scores ? (scores_int ? (float)tok_le_i32(scores, i) : tok_le_f32(scores, i)) : 0.0f;
        /* tokenizer.ggml.token_type: 0 undefined, 1 normal, 2 unknown, 3 control,
         * 4 user-defined, 5 unused, 6 byte; anything else is undefined. Without the array every
         * token is normal. */
        static const uint16_t attr_of_type[7] = {0,
                                                 TOK_ATTR_NORMAL,
                                                 TOK_ATTR_UNKNOWN,
                                                 TOK_ATTR_CONTROL,
                                                 TOK_ATTR_USER_DEFINED,
                                                 TOK_ATTR_UNUSED,
                                                 TOK_ATTR_BYTE};
        int32_t type = types ? tok_le_i32(types, i) : 1;
        uint16_t a = type >= 0 && type < 7 ? attr_of_type[type] : 0;
        t->attr[i] = a;
    }
    uint32_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    if (tok_str_rehash(&t->str, cap)) return km_errf(err, KM_ENOMEM, "tokenizer: vocab");
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (tok_str_index(&t->str, i)) return km_errf(err, KM_ENOMEM, "tokenizer: vocab");
    return 0;
}

/* The end-of-generation and special-id rules of llama_vocab::impl::load. */
static void tok_find_special_ids(md_tokenizer *t, const md_gguf *g)
{
    /* The texts llama.cpp recognises, in its order (UTF-8 literals: DeepSeek's use U+FF5C and
     * U+2581). */
    static const char *const eot_names[] = {
        "<|eot_id|>",         "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>",    "<EOT>",      "_<EOT>",  "[EOT]",         "<｜end▁of▁sentence｜>",
        "<end_of_utterance>", NULL};
    static const char *const eom_names[] = {"<|eom_id|>", NULL};
    static const char *const fim_pre_names[] = {"<|fim_prefix|>",  "<fim-prefix>", "<fim_prefix>",
                                                "<｜fim▁begin｜>", "<PRE>",        "▁<PRE>",
                                                "<|code_prefix|>", "<|prefix|>",   NULL};
    static const char *const fim_suf_names[] = {"<|fim_suffix|>",  "<fim-suffix>", "<fim_suffix>",
                                                "<｜fim▁hole｜>",  "<SUF>",        "▁<SUF>",
                                                "<|code_suffix|>", "<|suffix|>",   NULL};
    static const char *const fim_mid_names[] = {"<|fim_middle|>",  "<fim-middle>", "<fim_middle>",
                                                "<｜fim▁end｜>",   "<MID>",        "▁<MID>",
                                                "<|code_middle|>", "<|middle|>",   NULL};
    static const char *const fim_pad_names[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>",
                                                "<PAD>",       "[PAD]",     NULL};
    static const char *const fim_rep_names[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                                "<REPO>",       "<reponame>",    NULL};
    static const char *const fim_sep_names[] = {"<|file_sep|>", NULL};
    static const char *const eog_names[] = {"<|eot_id|>",
                                            "<|im_end|>",
                                            "<|end|>",
                                            "<|return|>",
                                            "<|call|>",
                                            "<|flush|>",
                                            "<|calls|>",
                                            "<end_of_turn>",
                                            "<|endoftext|>",
                                            "</s>",
                                            "<|eom_id|>",
                                            "<EOT>",
                                            "_<EOT>",
                                            "[EOT]",
                                            "[EOS]",
                                            "<|end_of_text|>",
                                            "<end_of_utterance>",
                                            "<eos>",
                                            "<turn|>",
                                            "<|tool_response>",
                                            "<｜end▁of▁sentence｜>",
                                            "[e~[",
                                            NULL};

    int32_t n = t->n_vocab;
    int32_t fim_pre = -1, fim_suf = -1, fim_mid = -1, fim_pad = -1, fim_rep = -1, fim_sep = -1;
    int32_t *const slots[] = {&t->bos,  &t->eos,  &t->eot,  &t->eom,  &t->unk, &fim_pre,
                              &fim_suf, &fim_mid, &fim_pad, &fim_rep, &fim_sep};
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++)
        if (*slots[i] >= n) *slots[i] = -1; /* a default beyond the vocabulary */
    tok_read_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos);
    tok_read_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos);
    tok_read_id(g, "tokenizer.ggml.eot_token_id", n, &t->eot);
    tok_read_id(g, "tokenizer.ggml.eom_token_id", n, &t->eom);
    tok_read_id(g, "tokenizer.ggml.unknown_token_id", n, &t->unk);
    tok_read_id(g, "tokenizer.ggml.fim_pre_token_id", n, &fim_pre);
    tok_read_id(g, "tokenizer.ggml.fim_suf_token_id", n, &fim_suf);
    tok_read_id(g, "tokenizer.ggml.fim_mid_token_id", n, &fim_mid);
    tok_read_id(g, "tokenizer.ggml.fim_pad_token_id", n, &fim_pad);
    tok_read_id(g, "tokenizer.ggml.fim_rep_token_id", n, &fim_rep);
    tok_read_id(g, "tokenizer.ggml.fim_sep_token_id", n, &fim_sep);
    tok_read_id(g, "tokenizer.ggml.prefix_token_id", n, &fim_pre); /* deprecated names */
    tok_read_id(g, "tokenizer.ggml.suffix_token_id", n, &fim_suf);
    tok_read_id(g, "tokenizer.ggml.middle_token_id", n, &fim_mid);
    tok_read_flag(g, "tokenizer.ggml.add_bos_token", &t->add_bos);
    tok_read_flag(g, "tokenizer.ggml.add_eos_token", &t->add_eos);

    if (t->eot < 0) t->eot = tok_find_named(t, eot_names);
    if (t->eom < 0) t->eom = tok_find_named(t, eom_names);
    if (fim_pre < 0) fim_pre = tok_find_named(t, fim_pre_names);
    if (fim_suf < 0) fim_suf = tok_find_named(t, fim_suf_names);
    if (fim_mid < 0) fim_mid = tok_find_named(t, fim_mid_names);
    if (fim_pad < 0) fim_pad = tok_find_named(t, fim_pad_names);
    if (fim_rep < 0) fim_rep = tok_find_named(t, fim_rep_names);
    if (fim_sep < 0) fim_sep = tok_find_named(t, fim_sep_names);

    /* End of generation: the FIM pad/repo/file-separator tokens, every token named like an end
     * (forced to control type), and eos, eot, eom. */
    int32_t eog[] = {fim_pad, fim_rep, fim_sep, t->eos, t->eot, t->eom};
    for (size_t i = 0; i < sizeof eog / sizeof eog[0]; i++)
        if (eog[i] >= 0) t->attr[eog[i]] |= TOK_ATTR_EOG;
    for (const char *const *name = eog_names; *name; name++) {
        int32_t id = tok_find_token(t, *name);
        if (id >= 0) t->attr[id] |= TOK_ATTR_EOG | TOK_ATTR_CONTROL;
    }
}

static int tok_cmp_special(const void *a, const void *b, void *arg)
{
    const md_tokenizer *t = arg;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = t->str.len[x], ly = t->str.len[y];
    if (lx != ly) return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

/* llama_decode_text: GPT-2 characters back to bytes; a character outside that alphabet becomes
 * "[UNK_BYTE_0x<its utf-8 in hex><the whole token text>]", as llama.cpp writes it. Writes at most
 * cap bytes to out and returns the full length. */
static size_t tok_decode_byte_level(const int16_t *cpt_byte, const char *text, size_t n, char *out,
                                    size_t cap)
{
    size_t m = 0;
#define TOK_PUT(c)                                                                                 \
    do {                                                                                           \
        if (m < cap) out[m] = (char)(c);                                                           \
        m++;                                                                                       \
    } while (0)
    for (size_t i = 0; i < n;) {
        const unsigned char *p = (const unsigned char *)text + i;
        uint32_t cpt;
        size_t used;
        if (p[0] < 0x80) { /* the common cases inline: ASCII and two-byte characters */
            cpt = p[0], used = 1;
        } else if ((p[0] & 0xE0) == 0xC0 && i + 1 < n && (p[1] & 0xC0) == 0x80) {
            cpt = (uint32_t)(p[0] & 0x1F) << 6 | (p[1] & 0x3F), used = 2;
        } else {
            cpt = tok_utf8_decode(p, n - i, &used);
        }
        i += used;
        if (cpt < 0x144 && cpt_byte[cpt] >= 0) {
            TOK_PUT(cpt_byte[cpt]);
            continue;
        }
        static const char hex[] = "0123456789abcdef";
        char u[4];
        int k = tok_utf8_encode(cpt, u);
        for (const char *q = "[UNK_BYTE_0x"; *q; q++) TOK_PUT(*q);
        for (int j = 0; j < k; j++) {
            TOK_PUT(hex[(unsigned char)u[j] >> 4]);
            TOK_PUT(hex[u[j] & 15]);
        }
        for (size_t j = 0; j < n; j++) TOK_PUT(text[j]);
        TOK_PUT(']');
    }
#undef TOK_PUT
    return m;
}

/* The byte of a <0xXX> token (strtol of the two characters after "<0x", as llama.cpp). */
static char tok_byte_of_token(const char *text, size_t n)
{
    int v = 0;
    for (size_t i = 3; i < 5 && i < n; i++) {
        char c = text[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) break;
        v = v * 16 + d;
    }
    return (char)v;
}

/* The piece of one token (llama_token_to_piece with special = true): writes at most cap bytes
 * to dst and returns the full length. Only llama.cpp's [UNK_BYTE_...] spelling of characters
 * outside GPT-2's alphabet makes a piece longer than the token's text. */
static size_t tok_piece_text(const md_tokenizer *t, const int16_t *cpt_byte, int32_t id, char *dst,
                             size_t cap)
{
    const char *text = tok_str_ptr(&t->str, id);
    size_t n = t->str.len[id], k = 0;
    uint16_t a = t->attr[id];
    if (a & (TOK_ATTR_UNKNOWN | TOK_ATTR_CONTROL | TOK_ATTR_USER_DEFINED)) {
        memcpy(dst, text, n < cap ? n : cap);
        return n;
    }
    if (a & TOK_ATTR_NORMAL) {
        if (t->model == TOK_MODEL_BPE) return tok_decode_byte_level(cpt_byte, text, n, dst, cap);
        for (size_t i = 0; i < n; i++, k++) { /* SPM: U+2581 back to a space */
            int space = i + 2 < n && memcmp(text + i, "\xe2\x96\x81", 3) == 0;
            dst[k] = space ? ' ' : text[i]; /* k <= i < n <= cap */
            i += space ? 2 : 0;
        }
        return k;
    }
    if (a & TOK_ATTR_BYTE) {
        if (cap) dst[0] = tok_byte_of_token(text, n);
        return 1;
    }
    return 0; /* unused and undefined tokens have no text */
}

/* Every token's piece, computed once. */
static int tok_build_pieces(md_tokenizer *t, km_errbuf *err)
{
    int16_t cpt_byte[0x144];
    memset(cpt_byte, 0xFF, sizeof cpt_byte);
    for (int b = 0; b < 256; b++) cpt_byte[t->byte_cpt[b]] = (int16_t)b;

    t->piece_off = malloc((size_t)t->n_vocab * sizeof *t->piece_off);
    t->piece_len = malloc((size_t)t->n_vocab * sizeof *t->piece_len);
    if (!t->piece_off || !t->piece_len) return km_errf(err, KM_ENOMEM, "tokenizer: pieces");
    size_t cap = 0, m = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t room = t->str.len[id] + 1; /* + 1: a byte token's piece from an empty text */
        if (tok_grow((void **)&t->piece_pool, &cap, m + room, 1))
            return km_errf(err, KM_ENOMEM, "tokenizer: pieces");
        size_t k = tok_piece_text(t, cpt_byte, id, t->piece_pool + m, room);
        if (k > room) {
            /* A hostile vocabulary's UNK_BYTE expansions could grow without bound. */
            if (k > (1u << 20) || m + k > (1u << 28))
                return km_errf(err, KM_ERANGE, "tokenizer: token %d decodes to a huge piece", id);
            if (tok_grow((void **)&t->piece_pool, &cap, m + k, 1))
                return km_errf(err, KM_ENOMEM, "tokenizer: pieces");
            tok_piece_text(t, cpt_byte, id, t->piece_pool + m, k);
        }
        t->piece_off[id] = (uint32_t)m;
        t->piece_len[id] = (uint32_t)k;
        m += k;
    }
    return 0;
}

static int tok_build_specials(md_tokenizer *t, km_errbuf *err)
{
    t->special = malloc((size_t)t->n_vocab * sizeof *t->special);
    if (!t->special) return km_errf(err, KM_ENOMEM, "tokenizer: specials");
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (t->attr[id] & (TOK_ATTR_CONTROL | TOK_ATTR_USER_DEFINED | TOK_ATTR_UNKNOWN))
            t->special[t->n_special++] = id;
    qsort_r(t->special, (size_t)t->n_special, sizeof *t->special, tok_cmp_special, t);
    return 0;
}

static int tok_create(const md_gguf *g, md_tokenizer *t, km_errbuf *err)
{
    km_str model, pre = {NULL, 0};
    int rc = md_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (rc)
        return km_errf(err, KM_EFORMAT, "tokenizer: tokenizer.ggml.model %s",
                       rc == KM_ENOTFOUND ? "missing" : "is not a string");
    int has_pre = md_gguf_get_str(g, "tokenizer.ggml.pre", &pre) == 0;

    if (model.len == 4 && memcmp(model.ptr, "gpt2", 4) == 0) {
        t->model = TOK_MODEL_BPE;
        t->bos = 11, t->eos = 11, t->unk = -1; /* llama.cpp's defaults for "gpt2" */
        t->pre = TOK_PRE_DEFAULT;
        if (has_pre) {
            int p = tok_bpe_pre_from_name(pre.ptr, pre.len, &t->ignore_merges, &t->add_bos);
            if (p < 0)
                return km_errf(err, KM_EUNSUPPORTED, "tokenizer: pre-tokenizer '%.*s' unsupported",
                               (int)(pre.len > 64 ? 64 : pre.len), pre.ptr);
            t->pre = (tok_pre)p;
        }
    } else if (model.len == 5 && memcmp(model.ptr, "llama", 5) == 0) {
        t->model = TOK_MODEL_SPM;
        t->bos = 1, t->eos = 2, t->unk = 0;
        t->add_bos = 1;
        t->add_space_prefix = 1;
    } else {
        return km_errf(err, KM_EUNSUPPORTED, "tokenizer: model '%.*s' unsupported",
                       (int)(model.len > 64 ? 64 : model.len), model.ptr);
    }
    tok_read_flag(g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix);

    if ((rc = tok_read_vocab(t, g, err))) return rc;
    if (t->model == TOK_MODEL_BPE && (rc = tok_bpe_load_merges(t, g, err))) return rc;

    tok_byte_map(t->byte_cpt);
    for (int b = 0; b < 256; b++) {
        char u[4], c = (char)b;
        if (t->model == TOK_MODEL_BPE) {
            int32_t sid = tok_str_find(&t->str, u, (size_t)tok_utf8_encode(t->byte_cpt[b], u));
            t->byte_sid[b] = sid;
            sid = tok_str_find(&t->str, &c, 1);
            t->byte_tok[b] = sid < t->n_vocab ? sid : -1;
        } else { /* llama.cpp's byte_to_token: <0xXX>, else the byte itself */
            char hex[8];
            snprintf(hex, sizeof hex, "<0x%02X>", b);
            int32_t id = tok_find_token(t, hex);
            t->byte_tok[b] = id >= 0 ? id : tok_find_token(t, (char[2]){c, 0});
            t->byte_sid[b] = -1;
        }
    }

    t->eot = t->eom = -1;
    tok_find_special_ids(t, g);
    if ((rc = tok_build_specials(t, err))) return rc;
    return tok_build_pieces(t, err);
}

int md_tok_create(const md_gguf *g, md_tokenizer **out, km_errbuf *err)
{
    if (!g || !out) return km_errf(err, KM_EINVAL, "tokenizer: no GGUF");
    *out = NULL;
    md_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return km_errf(err, KM_ENOMEM, "tokenizer: create");
    int rc = tok_create(g, t, err);
    if (rc) {
        md_tok_destroy(t);
        return rc;
    }
    *out = t;
    return 0;
}

void md_tok_destroy(md_tokenizer *t)
{
    if (!t) return;
    free(t->str.pool);
    free(t->str.off);
    free(t->str.len);
    free(t->str.slots);
    free(t->score);
    free(t->attr);
    free(t->merges.slots);
    free(t->piece_pool);
    free(t->piece_off);
    free(t->piece_len);
    free(t->special);
    free(t);
}

/* ---------------------------------------------------------------- queries */

int md_tok_n_vocab(const md_tokenizer *t)
{
    return t->n_vocab;
}

int32_t md_tok_bos(const md_tokenizer *t)
{
    return t->bos;
}

int32_t md_tok_eos(const md_tokenizer *t)
{
    return t->eos;
}

int32_t md_tok_eot(const md_tokenizer *t)
{
    return t->eot;
}

int md_tok_adds_bos(const md_tokenizer *t)
{
    return t->add_bos && t->bos >= 0;
}

int md_tok_is_eog(const md_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && (t->attr[id] & TOK_ATTR_EOG);
}

int32_t md_tok_find(const md_tokenizer *t, const char *text)
{
    return text ? tok_find_token(t, text) : -1;
}
