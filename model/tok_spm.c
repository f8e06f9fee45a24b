/*
 * tok_spm.c — SentencePiece-style BPE, tokenizer.ggml.model "llama" (Llama 2, Mistral, ...).
 *
 * As llama.cpp's llm_tokenizer_spm: spaces become U+2581 ("▁"), the text is cut into UTF-8
 * characters, and adjacent symbols whose concatenation is a token are merged highest score
 * first (ties: leftmost) until no pair is a token. What is left and is no token falls back to
 * byte tokens (<0xXX>). There are no merge rules: the scores in the vocabulary are the order.
 */
#include <stdlib.h>
#include <string.h>

#include "model/tok_internal.h"

typedef struct spm_sym {
    int32_t prev, next;
    uint32_t start, n; /* bytes of the escaped text; n == 0 once merged leftwards */
} spm_sym;

typedef struct spm_pair {
    float score;
    int32_t left, right;
    uint32_t size; /* left.n + right.n when queued: a changed sum means the pair is stale */
} spm_pair;

typedef struct spm_work {
    char *text;
    spm_sym *sym;
    spm_pair *heap;
    size_t cap_text, cap_sym, cap_heap, n_heap;
} spm_work;

/* Higher score first, then the leftmost pair. */
static inline int spm_pair_before(const spm_pair *a, const spm_pair *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static int spm_heap_push(spm_work *w, spm_pair p)
{
    int rc = tok_grow((void **)&w->heap, &w->cap_heap, w->n_heap + 1, sizeof *w->heap);
    if (rc) return rc;
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!spm_pair_before(&p, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = p;
    return 0;
}

static spm_pair spm_heap_pop(spm_work *w)
{
    spm_pair top = w->heap[0];
    spm_pair last = w->heap[--w->n_heap];
    size_t i = 0, n = w->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const spm_pair *best = &last;
        if (l < n && spm_pair_before(&w->heap[l], best)) m = l, best = &w->heap[l];
        if (r < n && spm_pair_before(&w->heap[r], best)) m = r;
        if (m == i) break;
        w->heap[i] = w->heap[m];
        i = m;
    }
    if (n) w->heap[i] = last;
    return top;
}

static int spm_try_pair(const md_tokenizer *t, spm_work *w, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return 0;
    const spm_sym *l = &w->sym[left], *r = &w->sym[right];
    int32_t id = tok_str_find(&t->str, w->text + l->start, l->n + r->n);
    if (id < 0 || id >= t->n_vocab) return 0;
    spm_pair p = {t->score[id], left, right, l->n + r->n};
    return spm_heap_push(w, p);
}

static int spm_fragment(const md_tokenizer *t, spm_work *w, tok_ids *out, const char *raw,
                        size_t len, int space_prefix)
{
    int rc;
    /* Escape: every space (and the prefix) becomes the 3-byte U+2581. */
    if ((rc = tok_grow((void **)&w->text, &w->cap_text, 3 * (len + 1), 1))) return rc;
    size_t m = 0;
    for (size_t i = 0; i < len + (space_prefix != 0); i++) {
        char c = space_prefix ? (i == 0 ? ' ' : raw[i - 1]) : raw[i];
        if (c == ' ') {
            memcpy(w->text + m, "\xe2\x96\x81", 3);
            m += 3;
        } else {
            w->text[m++] = c;
        }
    }

    /* Symbols: UTF-8 characters by their lead byte, cut short at the end of the text. */
    if ((rc = tok_grow((void **)&w->sym, &w->cap_sym, m, sizeof *w->sym))) return rc;
    int32_t n = 0;
    for (size_t off = 0; off < m;) {
        size_t k = (size_t)tok_utf8_lead_len((unsigned char)w->text[off]);
        if (k > m - off) k = m - off;
        w->sym[n] = (spm_sym){n - 1, off + k == m ? -1 : n + 1, (uint32_t)off, (uint32_t)k};
        off += k;
        n++;
    }

    w->n_heap = 0;
    for (int32_t i = 1; i < n; i++)
        if ((rc = spm_try_pair(t, w, i - 1, i))) return rc;
    while (w->n_heap > 0) {
        spm_pair p = spm_heap_pop(w);
        spm_sym *l = &w->sym[p.left], *r = &w->sym[p.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != p.size) continue; /* stale */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) w->sym[r->next].prev = p.left;
        if ((rc = spm_try_pair(t, w, l->prev, p.left))) return rc;
        if ((rc = spm_try_pair(t, w, p.left, w->sym[p.left].next))) return rc;
    }

    for (int32_t i = 0; i >= 0 && i < n; i = w->sym[i].next) {
        const spm_sym *s = &w->sym[i];
        int32_t id = tok_str_find(&t->str, w->text + s->start, s->n);
        if (id >= 0 && id < t->n_vocab) {
            if ((rc = tok_push_id(out, id))) return rc;
            continue;
        }
        /* Byte fallback. A vocabulary without byte tokens makes llama.cpp throw; here the
         * unknown token stands in (or nothing, without one). */
        for (uint32_t j = s->start; j < s->start + s->n; j++) {
            int32_t b = t->byte_tok[(unsigned char)w->text[j]];
            if (b < 0) b = t->unk;
            if (b >= 0 && (rc = tok_push_id(out, b))) return rc;
        }
    }
    return 0;
}

int tok_spm_encode(const md_tokenizer *t, tok_ids *out, const char *text, size_t len,
                   int space_prefix)
{
    if (len == 0 && !space_prefix) return 0;
    if (len > INT32_MAX / 4) return KM_ERANGE;
    spm_work w = {0};
    int rc = spm_fragment(t, &w, out, text, len, space_prefix);
    free(w.text);
    free(w.sym);
    free(w.heap);
    return rc;
}
