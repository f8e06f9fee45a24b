/*
 * fuzz_gbnf.c — libFuzzer target for the grammar extensions' readers and compilers
 * (engine/grammar_cfg.c: GBNF grammars and regexes from any API client) and their matcher.
 *
 * The first byte picks the reader (even: GBNF, odd: regex), so the fuzzer need not find the
 * "%gbnf\n" header itself; the input up to its first NUL byte after that is the grammar, what
 * follows is fed as output bytes, one at a time. ASan/UBSan catch memory errors and leaks; the
 * checks hold the promises the engine relies on: a refusal carries a message, a refused byte
 * leaves the matcher's state as it was (so the same byte is refused again), and a matcher with
 * nothing left to accept is complete.
 */
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/grammar_feed.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const char *head = data[0] & 1 ? "%regex\n" : "%gbnf\n";
    data++, size--;
    const uint8_t *nul = memchr(data, 0, size);
    size_t n = nul ? (size_t)(nul - data) : size, h = strlen(head);
    char *src = malloc(h + n + 1);
    if (!src) return 0;
    memcpy(src, head, h);
    memcpy(src + h, data, n);
    fz_grammar_feed(src, h + n, nul ? nul + 1 : data, nul ? size - n - 1 : 0);
    free(src);
    return 0;
}
