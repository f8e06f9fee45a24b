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

#include "tests/fuzz/grammar_feed.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t n = nul ? (size_t)(nul - data) : size;
    fz_grammar_feed((const char *)data, n, nul ? nul + 1 : data, nul ? size - n - 1 : 0);
    return 0;
}
