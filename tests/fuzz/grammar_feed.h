/*
 * grammar_feed.h — what fuzz_grammar and fuzz_gbnf check once a grammar text is read: a refusal
 * carries a message, a refused byte leaves the matcher's state as it was (so the same byte is
 * refused again), and a matcher with nothing left to accept is complete.
 */
#ifndef KM_FUZZ_GRAMMAR_FEED_H
#define KM_FUZZ_GRAMMAR_FEED_H

#include <stdlib.h>

#include "engine/engine.h"

/* Compiles src[0..n) and feeds out[0..out_len) to a matcher of it, one byte at a time; aborts
 * when a promise above is broken. */
static inline void fz_grammar_feed(const char *src, size_t n, const uint8_t *out, size_t out_len)
{
    en_grammar *g = NULL;
    km_errbuf err = {{0}};
    if (en_grammar_compile(src, n, &g, &err)) {
        if (g || !err.msg[0]) abort();
        return;
    }
    en_grammar_matcher *m;
    if (en_grammar_matcher_create(g, NULL, &m) == 0) {
        for (size_t i = 0; i < out_len; i++) {
            if (en_grammar_accept_bytes(m, (const char *)out + i, 1) == 0) continue;
            if (en_grammar_accept_bytes(m, (const char *)out + i, 1) == 0) abort();
        }
        if (en_grammar_done(m) && !en_grammar_complete(m)) abort();
        en_grammar_matcher_destroy(m);
    }
    en_grammar_free(g);
}

#endif /* KM_FUZZ_GRAMMAR_FEED_H */
