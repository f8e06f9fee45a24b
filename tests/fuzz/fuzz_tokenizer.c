/*
 * fuzz_tokenizer.c — libFuzzer target for the tokenizer with the default model's vocabulary.
 *
 * Any byte string must encode without a crash, an out-of-bounds access or a hang (invalid UTF-8
 * included, with and without special-token parsing); the ids must be in the vocabulary; the
 * streaming detokenizer must emit only whole UTF-8; and text that is valid UTF-8 made of bytes
 * the vocabulary can spell must decode back to itself. The first input byte picks the flags, the
 * rest is the text. Needs models/SmolLM2-135M-Instruct.Q4_1.gguf (make deps), found from the
 * repository root, from the binary's place in build/fuzz/, or by $KVMESH_MODEL, so the target runs
 * from any directory; without a vocabulary it exits 1 at start (it used to accept every input
 * untested and exit 0). Seeds: tests/fuzz/corpus.
 *
 * KM_FUZZ_TOKENIZER_GGUF=path fuzzes another vocabulary (e.g. the SPM and Llama 3 ones in
 * tests/fixtures/tokenizer); the round-trip check is then off, since BOS and SPM's space prefix
 * are not in the input.
 */
#include "common/km.h"
#include "model/model.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static md_gguf *g_gguf;
static md_tokenizer *g_tok;
static int g_tried, g_roundtrip;
/* Bytes the vocabulary can spell: those whose GPT-2 byte-level character is a token (SmolLM2
 * lacks a few, e.g. 0x04 and 0xF2; llama.cpp drops such bytes). */
static unsigned char g_spellable[256];

static int fuzz_load(void)
{
    if (g_tried) return g_tok != NULL;
    g_tried = 1;
    km_errbuf e = {{0}};
    const char *path = getenv("KM_FUZZ_TOKENIZER_GGUF");
    g_roundtrip = path == NULL;
    char beside[PATH_MAX + 64] = MODEL; /* build/fuzz/fuzz_tokenizer -> ../../models/... */
    ssize_t l = readlink("/proc/self/exe", beside, PATH_MAX);
    if (l > 0) {
        beside[l] = 0;
        for (int up = 0; up < 3; up++) {
            char *slash = strrchr(beside, '/');
            if (slash) *slash = 0;
        }
        strcat(beside, "/" MODEL);
    }
    const char *tries[] = {path, path ? NULL : MODEL, path ? NULL : beside,
                           path ? NULL : getenv("KVMESH_MODEL")};
    for (size_t i = 0; i < sizeof tries / sizeof *tries && !g_tok; i++) {
        if (!tries[i]) continue;
        if (g_gguf) md_gguf_close(g_gguf);
        g_gguf = NULL;
        if (md_gguf_open(tries[i], &g_gguf, &e) == 0) md_tok_create(g_gguf, &g_tok, &e);
    }
    if (!g_tok) return 0;
    /* GPT-2's bytes_to_unicode: printable Latin-1 stays, the rest counts up from U+0100. */
    unsigned next = 256;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        unsigned cpt = printable ? (unsigned)b : next++;
        char u[3] = {(char)cpt, 0, 0};
        if (cpt >= 0x80) u[0] = (char)(0xC0 | cpt >> 6), u[1] = (char)(0x80 | (cpt & 0x3F));
        g_spellable[b] = md_tok_find(g_tok, u) >= 0;
    }
    return 1;
}

/* Strictly well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF). */
static int fuzz_utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t k;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            k = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            k = 3;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            k = 4;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return 0;
        }
        if (i + k > n || s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (size_t j = 2; j < k; j++)
            if ((s[i + j] & 0xC0) != 0x80) return 0;
        i += k;
    }
    return 1;
}

/* A fuzzer that cannot load its vocabulary tests nothing: say so and fail. */
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    if (fuzz_load()) return 0;
    fprintf(stderr,
            "fuzz_tokenizer: no vocabulary: %s (make deps, or KM_FUZZ_TOKENIZER_GGUF=path)\n",
            getenv("KM_FUZZ_TOKENIZER_GGUF") ? getenv("KM_FUZZ_TOKENIZER_GGUF") : MODEL);
    exit(1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0 || !fuzz_load()) return 0;
    int add_special = data[0] & 1, parse_special = (data[0] >> 1) & 1;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;

    /* A first guess at the count; when short, the call says how many and is repeated. */
    int cap = (int)len + 8;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) abort();
    int n = md_tok_encode(g_tok, text, len, add_special, parse_special, ids, cap);
    if (n < 0) abort();
    if (n > cap) {
        free(ids);
        ids = malloc((size_t)n * sizeof *ids);
        if (!ids || md_tok_encode(g_tok, text, len, add_special, parse_special, ids, n) != n)
            abort();
    }
    /* Pieces: at most 3 bytes (U+FFFD) per input byte, or a special token's own text. */
    size_t back_cap = 3 * len + 64 * ((size_t)n + 1);
    char *back = malloc(back_cap), chunk[4096];
    if (!back) abort();

    size_t m = 0;
    md_detok d;
    md_detok_init(&d);
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= md_tok_n_vocab(g_tok)) abort();
        int k = md_tok_piece(g_tok, ids[i], 1, back + m, (int)(back_cap - m));
        if (k < 0 || (size_t)k > back_cap - m) abort();
        m += (size_t)k;
        k = md_detok_push(g_tok, &d, ids[i], chunk, sizeof chunk);
        if (k < 0 || !fuzz_utf8_valid((unsigned char *)chunk, (size_t)k)) abort();
    }
    int k = md_detok_flush(&d, chunk, sizeof chunk);
    if (k < 0 || !fuzz_utf8_valid((unsigned char *)chunk, (size_t)k)) abort();

    int spellable = g_roundtrip && fuzz_utf8_valid((const unsigned char *)text, len);
    for (size_t i = 0; spellable && i < len; i++)
        if (!g_spellable[(unsigned char)text[i]]) spellable = 0;
    if (spellable && (m != len || memcmp(back, text, len) != 0)) abort();

    free(ids);
    free(back);
    return 0;
}
