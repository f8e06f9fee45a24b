/*
 * tok_text.c — the tokenizer's text paths over the tables tokenizer.c built: encoding (special
 * token texts cut out of the input first, longest first, as llama.cpp does; the raw fragments
 * between them go to the model's BPE, tok_bpe.c or tok_spm.c), token pieces, and the streaming
 * detokenizer, which holds back the bytes of an unfinished UTF-8 sequence until the next token
 * completes it (or md_detok_flush turns it into U+FFFD), so a stream never prints half a
 * character.
 */
#define _GNU_SOURCE /* memmem */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "model/tok_internal.h"

/* ---------------------------------------------------------------- encode */

/* A piece of the input: raw text, or a special token cut out of it. */
typedef struct tok_frag {
    int32_t id; /* -1: raw text */
    size_t off, len;
} tok_frag;

typedef struct tok_frags {
    tok_frag *v;
    size_t n, cap;
} tok_frags;

static int tok_frag_push(tok_frags *f, int32_t id, size_t off, size_t len)
{
    int rc = tok_grow((void **)&f->v, &f->cap, f->n + 1, sizeof *f->v);
    if (rc) return rc;
    f->v[f->n++] = (tok_frag){id, off, len};
    return 0;
}

/* llama.cpp's tokenizer_st_partition: special tokens longest first, each cut out of every raw
 * fragment at all its non-overlapping occurrences, left to right. Without parse_special only
 * user-defined tokens are cut (control and unknown texts stay text). */
static int tok_partition(const md_tokenizer *t, const char *text, size_t len, int parse_special,
                         tok_frags *cur, tok_frags *next)
{
    int rc;
    cur->n = 0;
    if (len == 0) return 0;
    if ((rc = tok_frag_push(cur, -1, 0, len))) return rc;
    for (int32_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        if (!parse_special && (t->attr[id] & (TOK_ATTR_CONTROL | TOK_ATTR_UNKNOWN))) continue;
        const char *st = tok_str_ptr(&t->str, id);
        size_t sn = t->str.len[id];
        next->n = 0;
        int found = 0;
        for (size_t i = 0; i < cur->n; i++) {
            tok_frag f = cur->v[i];
            if (f.id >= 0 || f.len < sn) {
                if ((rc = tok_frag_push(next, f.id, f.off, f.len))) return rc;
                continue;
            }
            size_t at = f.off, end = f.off + f.len;
            const char *hit;
            while (end - at >= sn && (hit = memmem(text + at, end - at, st, sn))) {
                size_t pos = (size_t)(hit - text);
                if (pos > at && (rc = tok_frag_push(next, -1, at, pos - at))) return rc;
                if ((rc = tok_frag_push(next, id, pos, sn))) return rc;
                at = pos + sn;
                found = 1;
            }
            if (at < end && (rc = tok_frag_push(next, -1, at, end - at))) return rc;
        }
        if (found) {
            tok_frags tmp = *cur;
            *cur = *next;
            *next = tmp;
        }
    }
    return 0;
}

static int tok_encode_all(const md_tokenizer *t, const char *text, size_t len, int add_special,
                          int parse_special, tok_ids *ids)
{
    tok_frags cur = {0}, next = {0};
    int rc = tok_partition(t, text, len, parse_special, &cur, &next);
    if (!rc && add_special && t->add_bos && t->bos >= 0) rc = tok_push_id(ids, t->bos);
    int prev_special = 1; /* SPM: a space is prepended to text at the start or after a token */
    for (size_t i = 0; !rc && i < cur.n; i++) {
        const tok_frag *f = &cur.v[i];
        if (f->id >= 0) {
            rc = tok_push_id(ids, f->id);
            prev_special = 1;
        } else if (t->model == TOK_MODEL_BPE) {
            rc = tok_bpe_encode(t, ids, text + f->off, f->len);
        } else {
            rc = tok_spm_encode(t, ids, text + f->off, f->len, t->add_space_prefix && prev_special);
            prev_special = 0;
        }
    }
    if (!rc && add_special && t->add_eos && t->eos >= 0) rc = tok_push_id(ids, t->eos);
    free(cur.v);
    free(next.v);
    return rc;
}

int md_tok_encode(const md_tokenizer *t, const char *text, size_t len, int add_special,
                  int parse_special, int32_t *out, int max_out)
{
    if (!t || (!text && len) || max_out < 0 || (max_out > 0 && !out)) return KM_EINVAL;
    tok_ids ids = {0};
    int rc = tok_encode_all(t, text, len, add_special, parse_special, &ids);
    if (!rc && ids.n > INT_MAX) rc = KM_ERANGE;
    if (rc) {
        free(ids.v);
        return rc;
    }
    size_t n = ids.n < (size_t)max_out ? ids.n : (size_t)max_out;
    if (n) memcpy(out, ids.v, n * sizeof *out);
    free(ids.v);
    return (int)ids.n;
}

/* ---------------------------------------------------------------- pieces and streaming */

/* The piece of a valid id; NULL length 0 for control/unknown tokens unless special. */
static const char *tok_piece_of(const md_tokenizer *t, int32_t id, int special, size_t *n)
{
    if (!special && (t->attr[id] & (TOK_ATTR_UNKNOWN | TOK_ATTR_CONTROL))) {
        *n = 0;
        return "";
    }
    *n = t->piece_len[id];
    return t->piece_pool + t->piece_off[id];
}

int md_tok_piece(const md_tokenizer *t, int32_t id, int special, char *buf, int cap)
{
    if (!t || id < 0 || id >= t->n_vocab || cap < 0 || (cap > 0 && !buf)) return KM_EINVAL;
    size_t n;
    const char *p = tok_piece_of(t, id, special, &n);
    if (n > 0 && n <= (size_t)cap) memcpy(buf, p, n);
    return (int)n;
}

void md_detok_init(md_detok *d)
{
    memset(d, 0, sizeof *d);
}

/* Appends bytes to out, or reports that cap is too small. */
typedef struct tok_sink {
    char *out;
    size_t n, cap;
    int full;
} tok_sink;

static void tok_sink_put(tok_sink *s, const void *p, size_t n)
{
    if (s->n + n > s->cap) {
        s->full = 1;
        return;
    }
    if (n) memcpy(s->out + s->n, p, n);
    s->n += n;
}

/* Emits complete sequences of s[0..n) (bad ones as U+FFFD) and returns the length of a trailing
 * unfinished sequence that must wait for more bytes (0 when at_end: it is bad then). */
static size_t tok_emit_utf8(tok_sink *k, const unsigned char *s, size_t n, int at_end)
{
    for (size_t i = 0; i < n;) {
        size_t len;
        int r = tok_utf8_check(s + i, n - i, &len);
        if (r == TOK_UTF8_PARTIAL && !at_end) return n - i;
        if (r == TOK_UTF8_OK)
            tok_sink_put(k, s + i, len);
        else
            tok_sink_put(k, "\xef\xbf\xbd", 3);
        i += len;
    }
    return 0;
}

int md_detok_push(const md_tokenizer *t, md_detok *d, int32_t id, char *out, int cap)
{
    if (!t || !d || id < 0 || id >= t->n_vocab || cap < 0 || (cap > 0 && !out)) return KM_EINVAL;
    if (d->n_pending < 0 || d->n_pending > 3) return KM_EINVAL;
    size_t n;
    const unsigned char *p = (const unsigned char *)tok_piece_of(t, id, 0, &n);
    tok_sink k = {out, 0, (size_t)cap, 0};

    /* The held-back bytes first, joined with enough of the piece to finish their sequence; then
     * the rest of the piece in place. */
    unsigned char head[8];
    size_t np = (size_t)d->n_pending, nh = n < 4 ? n : 4, i = 0;
    memcpy(head, d->pending, np);
    memcpy(head + np, p, nh);
    size_t keep = 0, from = 0;
    const unsigned char *keep_src = NULL;
    while (i < np) {
        size_t len;
        int r = tok_utf8_check(head + i, np + nh - i, &len);
        if (r == TOK_UTF8_PARTIAL) { /* the whole piece was too short to finish it */
            keep = np + nh - i;
            keep_src = head + i;
            from = n;
            break;
        }
        if (r == TOK_UTF8_OK)
            tok_sink_put(&k, head + i, len);
        else
            tok_sink_put(&k, "\xef\xbf\xbd", 3);
        i += len;
    }
    if (!keep_src) {
        from = i - np;
        keep = tok_emit_utf8(&k, p + from, n - from, 0);
        keep_src = p + n - keep;
    }
    if (k.full) return KM_ENOSPC;
    memmove(d->pending, keep_src, keep);
    d->n_pending = (int)keep;
    return (int)k.n;
}

int md_detok_flush(md_detok *d, char *out, int cap)
{
    if (!d || cap < 0 || (cap > 0 && !out) || d->n_pending < 0 || d->n_pending > 3)
        return KM_EINVAL;
    tok_sink k = {out, 0, (size_t)cap, 0};
    tok_emit_utf8(&k, (const unsigned char *)d->pending, (size_t)d->n_pending, 1);
    if (k.full) return KM_ENOSPC;
    d->n_pending = 0;
    return (int)k.n;
}
