/*
 * fuzz_grammar.c — libFuzzer target for the grammar engine's schema reader and compiler
 * (en_grammar_compile, engine/grammar_schema.c: JSON Schema text from any API client) and its
 * automaton (engine/grammar.c).
 *
 * The input up to its first NUL byte is compiled as a schema; what follows it is fed as output
 * bytes, one at a time, to a matcher of the compiled grammar. ASan/UBSan catch memory errors and
 * leaks; the checks hold the promises the engine relies on: a refusal carries a message, a
 * refused byte leaves the matcher's state as it was (so the same byte is refused again), and a
 * matcher with nothing left to accept is complete.
 */
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t n = nul ? (size_t)(nul - data) : size;
    en_grammar *g = NULL;
    km_errbuf err = {{0}};
    if (en_grammar_compile((const char *)data, n, &g, &err)) {
        if (g || !err.msg[0]) abort();
        return 0;
    }
    en_grammar_matcher *m;
    if (en_grammar_matcher_create(g, NULL, &m) == 0) {
        for (size_t i = n + 1; nul && i < size; i++) {
            if (en_grammar_accept_bytes(m, (const char *)data + i, 1) == 0) continue;
            if (en_grammar_accept_bytes(m, (const char *)data + i, 1) == 0) abort();
        }
        if (en_grammar_done(m) && !en_grammar_complete(m)) abort();
        en_grammar_matcher_destroy(m);
    }
    en_grammar_free(g);
    return 0;
}
