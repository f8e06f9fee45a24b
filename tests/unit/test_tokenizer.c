/*
 * test_tokenizer.c — the tokenizer held to llama.cpp, its reference.
 *
 * Fixtures (tests/fixtures/tokenizer, see NOTICE and the scripts there):
 *  - smollm2.tsv: 78 strings (English, code, Cyrillic, CJK, Arabic, Hindi, emoji with ZWJ
 *    sequences, whitespace runs, numbers, special tokens parsed and not, invalid UTF-8) with the
 *    ids llama.cpp's llama-tokenize gives for SmolLM2 (gen_smollm2.sh). Needs models/ (make
 *    deps); without the model those tests skip and say so.
 *  - ggml-vocab-{llama-bpe,qwen2,llama-spm,gpt-2}.gguf with llama.cpp's .inp/.out vectors, and
 *    ggml-vocab-gpt-2-default.out: the GPT-2 vocabulary with tokenizer.ggml.pre = "default",
 *    spliced here in memory the same way copy_vocabs.sh did for llama-tokenize.
 *  - chat.tsv: conversations rendered by the models' Jinja templates (gen_chat.sh).
 */
#define _GNU_SOURCE /* memmem */
#include "common/km.h"
#include "model/model.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FIX     "tests/fixtures/tokenizer/"
#define SMOLLM2 "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* ---------------------------------------------------------------- helpers */

typedef struct loaded {
    md_gguf *g;
    md_tokenizer *t;
    void *mem; /* file bytes when opened from memory */
} loaded;

static loaded load_path(const char *path)
{
    loaded l = {0};
    km_errbuf e = {{0}};
    cr_assert_eq(md_gguf_open(path, &l.g, &e), 0, "%s: %s", path, e.msg);
    cr_assert_eq(md_tok_create(l.g, &l.t, &e), 0, "%s: %s", path, e.msg);
    return l;
}

static loaded load_smollm2(void)
{
    if (access(SMOLLM2, R_OK) != 0) cr_skip_test("%s absent (make deps)", SMOLLM2);
    return load_path(SMOLLM2);
}

static void unload(loaded *l)
{
    md_tok_destroy(l->t);
    md_gguf_close(l->g);
    free(l->mem);
}

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert_geq(n, 0);
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* Undoes the fixtures' escaping (\\ and \xHH) of s[0..n) into out; returns the length. */
static size_t unescape(const char *s, size_t n, char *out)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\\' && i + 1 < n && s[i + 1] == '\\') {
            out[m++] = '\\';
            i++;
        } else if (s[i] == '\\' && i + 3 < n && s[i + 1] == 'x') {
            char hex[3] = {s[i + 2], s[i + 3], 0};
            out[m++] = (char)strtol(hex, NULL, 16);
            i += 3;
        } else {
            out[m++] = s[i];
        }
    }
    return m;
}

/* Splits a line at tabs in place; returns the field count. */
static int split_tabs(char *line, char **fields, int max)
{
    int n = 0;
    fields[n++] = line;
    for (char *p = line; *p && n < max; p++) {
        if (*p == '\t') {
            *p = 0;
            fields[n++] = p + 1;
        }
    }
    return n;
}

static int parse_ids(const char *s, int32_t *ids, int max)
{
    int n = 0;
    char *end;
    for (;;) {
        long v = strtol(s, &end, 10);
        if (end == s) break;
        cr_assert_lt(n, max);
        ids[n++] = (int32_t)v;
        s = end;
    }
    return n;
}

static int encode(const md_tokenizer *t, const char *s, size_t n, int add_special, int special,
                  int32_t *ids, int max)
{
    int k = md_tok_encode(t, s, n, add_special, special, ids, max);
    cr_assert_geq(k, 0, "encode failed: %d", k);
    cr_assert_leq(k, max, "more than %d tokens", max);
    return k;
}

/* Concatenated pieces; returns the length. */
static size_t decode(const md_tokenizer *t, const int32_t *ids, int n, int special, char *out,
                     size_t cap)
{
    size_t m = 0;
    for (int i = 0; i < n; i++) {
        int k = md_tok_piece(t, ids[i], special, out + m, (int)(cap - m));
        cr_assert_geq(k, 0);
        cr_assert_leq((size_t)k, cap - m);
        m += (size_t)k;
    }
    return m;
}

static int utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t k;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            k = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            k = 3;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            k = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
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

#define MAX_IDS  4096
#define MAX_TEXT 65536

/* One row of smollm2.tsv. */
typedef struct row {
    int special;
    char text[4096];
    size_t len;
    int32_t ids[2048];
    int n_ids;
} row;

static row *read_smollm2_rows(int *n_rows)
{
    size_t len;
    char *all = slurp(FIX "smollm2.tsv", &len);
    row *rows = calloc(256, sizeof *rows);
    cr_assert_not_null(rows);
    int n = 0;
    for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#') continue;
        char *f[3];
        cr_assert_eq(split_tabs(line, f, 3), 3, "bad row: %s", line);
        cr_assert_lt(n, 256);
        row *r = &rows[n++];
        r->special = f[0][0] == 'S';
        r->len = unescape(f[1], strlen(f[1]), r->text);
        r->n_ids = parse_ids(f[2], r->ids, 2048);
    }
    free(all);
    *n_rows = n;
    return rows;
}

/* ---------------------------------------------------------------- SmolLM2 against llama.cpp */

Test(smollm2, fixture_ids_equal_llama_cpp)
{
    loaded l = load_smollm2();
    int n_rows;
    row *rows = read_smollm2_rows(&n_rows);
    cr_assert_geq(n_rows, 50, "the fixture has %d strings", n_rows);
    static int32_t ids[MAX_IDS];
    int bad = 0;
    for (int i = 0; i < n_rows; i++) {
        const row *r = &rows[i];
        int n = encode(l.t, r->text, r->len, 1, r->special, ids, MAX_IDS);
        int same = n == r->n_ids && memcmp(ids, r->ids, (size_t)n * sizeof *ids) == 0;
        if (!same) {
            bad++;
            cr_log_error("row %d (%s, %zu bytes): %d ids, llama.cpp %d; first %.60s", i + 1,
                         r->special ? "special" : "plain", r->len, n, r->n_ids, r->text);
        }
    }
    cr_expect_eq(bad, 0, "%d of %d fixture strings differ from llama.cpp", bad, n_rows);
    free(rows);
    unload(&l);
}

Test(smollm2, decode_of_encode_gives_the_input_back)
{
    loaded l = load_smollm2();
    int n_rows, checked = 0;
    row *rows = read_smollm2_rows(&n_rows);
    static int32_t ids[MAX_IDS];
    static char out[MAX_TEXT];
    for (int i = 0; i < n_rows; i++) {
        const row *r = &rows[i];
        if (!utf8_valid((const unsigned char *)r->text, r->len)) continue; /* U+FFFD'd inputs */
        int n = encode(l.t, r->text, r->len, 1, r->special, ids, MAX_IDS);
        size_t m = decode(l.t, ids, n, 1, out, sizeof out);
        cr_expect(m == r->len && memcmp(out, r->text, m) == 0, "row %d does not round-trip: %.60s",
                  i + 1, r->text);
        checked++;
    }
    cr_expect_geq(checked, 70);
    free(rows);
    unload(&l);
}

Test(smollm2, invalid_utf8_decodes_to_replacement_characters_like_llama_cpp)
{
    loaded l = load_smollm2();
    static int32_t ids[MAX_IDS];
    char out[256];
    /* Each bad byte is one U+FFFD; an overlong '/' decodes as '/' (llama.cpp's lenient decoder). */
    const char in[] = "a\xff"
                      "b\xc0\xaf"
                      "c\xe4\xb8";
    int n = encode(l.t, in, sizeof in - 1, 0, 0, ids, MAX_IDS);
    size_t m = decode(l.t, ids, n, 0, out, sizeof out);
    const char want[] = "a\xef\xbf\xbd"
                        "b/c\xef\xbf\xbd\xef\xbf\xbd";
    cr_expect(m == sizeof want - 1 && memcmp(out, want, m) == 0, "got %.*s", (int)m, out);
    /* Beyond U+10FFFF llama.cpp throws; here those bytes are invalid like any other. */
    const char big[] = "\xf4\x90\x80\x80";
    n = encode(l.t, big, 4, 0, 0, ids, MAX_IDS);
    m = decode(l.t, ids, n, 0, out, sizeof out);
    cr_expect_eq(m, 12, "four U+FFFD expected, got %zu bytes", m);
    unload(&l);
}

Test(smollm2, special_ids_and_end_of_generation_set)
{
    loaded l = load_smollm2();
    cr_expect_eq(md_tok_n_vocab(l.t), 49152);
    cr_expect_eq(md_tok_bos(l.t), 1);
    cr_expect_eq(md_tok_eos(l.t), 2);
    /* llama.cpp picks <|endoftext|> or <|im_end|> by hash order; the chat's end of turn is the
     * second, and both end generation. */
    cr_expect_eq(md_tok_eot(l.t), 2);
    cr_expect_eq(md_tok_adds_bos(l.t), 0);
    /* llama.cpp's EOG set for this model: <|endoftext|>, <|im_end|>, <reponame> (FIM repo). */
    for (int32_t id = -1; id < 100; id++)
        cr_expect_eq(md_tok_is_eog(l.t, id), id == 0 || id == 2 || id == 4, "id %d", id);
    cr_expect_not(md_tok_is_eog(l.t, 49152));
    cr_expect_eq(md_tok_find(l.t, "<|im_start|>"), 1);
    cr_expect_eq(md_tok_find(l.t, "<|im_end|>"), 2);
    cr_expect_eq(md_tok_find(l.t, "Hello"), 19556);
    cr_expect_eq(md_tok_find(l.t, "\xc4\xa0Hello"), 38699); /* "ĠHello": GPT-2's space */
    cr_expect_eq(md_tok_find(l.t, "no such token here"), -1);
    cr_expect_eq(md_tok_find(l.t, NULL), -1);
    unload(&l);
}

Test(smollm2, special_texts_are_tokens_only_when_parsed)
{
    loaded l = load_smollm2();
    int32_t ids[64];
    const char s[] = "<|im_start|>user\nHi<|im_end|>";
    int n = encode(l.t, s, sizeof s - 1, 1, 1, ids, 64);
    cr_assert_geq(n, 3);
    cr_expect_eq(ids[0], 1);
    cr_expect_eq(ids[n - 1], 2);
    n = encode(l.t, s, sizeof s - 1, 1, 0, ids, 64);
    for (int i = 0; i < n; i++) cr_expect(ids[i] != 1 && ids[i] != 2, "control id %d", ids[i]);
    unload(&l);
}

Test(smollm2, encode_returns_the_full_count_when_the_buffer_is_short)
{
    loaded l = load_smollm2();
    const char s[] = "The quick brown fox jumps over the lazy dog.";
    int32_t all[64], few[3] = {-7, -7, -7};
    int n = encode(l.t, s, sizeof s - 1, 1, 0, all, 64);
    cr_assert_gt(n, 3);
    cr_expect_eq(md_tok_encode(l.t, s, sizeof s - 1, 1, 0, few, 2), n);
    cr_expect_eq(few[0], all[0]);
    cr_expect_eq(few[1], all[1]);
    cr_expect_eq(few[2], -7, "wrote past max_out");
    cr_expect_eq(md_tok_encode(l.t, s, sizeof s - 1, 1, 0, NULL, 0), n);
    cr_expect_eq(md_tok_encode(l.t, NULL, 0, 1, 1, NULL, 0), 0);
    cr_expect_eq(md_tok_encode(l.t, "", 0, 1, 1, few, 3), 0);
    unload(&l);
}

Test(smollm2, pieces_hide_control_tokens_unless_special)
{
    loaded l = load_smollm2();
    char buf[64];
    cr_expect_eq(md_tok_piece(l.t, 1, 0, buf, sizeof buf), 0);
    cr_expect_eq(md_tok_piece(l.t, 1, 1, buf, sizeof buf), 12);
    cr_expect(memcmp(buf, "<|im_start|>", 12) == 0);
    cr_expect_eq(md_tok_piece(l.t, 38699, 0, buf, sizeof buf), 6);
    cr_expect(memcmp(buf, " Hello", 6) == 0);
    /* Too small: the size comes back, nothing is promised about buf. */
    cr_expect_eq(md_tok_piece(l.t, 38699, 0, buf, 3), 6);
    cr_expect_eq(md_tok_piece(l.t, 38699, 0, NULL, 0), 6);
    cr_expect_lt(md_tok_piece(l.t, -1, 1, buf, sizeof buf), 0);
    cr_expect_lt(md_tok_piece(l.t, 49152, 1, buf, sizeof buf), 0);
    unload(&l);
}

/* ---------------------------------------------------------------- streaming detokenizer */

/* Streams ids through md_detok; checks every chunk is whole UTF-8; returns the text. */
static size_t stream(const md_tokenizer *t, const int32_t *ids, int n, char *out, size_t cap,
                     int *n_empty)
{
    md_detok d;
    md_detok_init(&d);
    size_t m = 0;
    char chunk[512];
    *n_empty = 0;
    for (int i = 0; i <= n; i++) {
        int k = i < n ? md_detok_push(t, &d, ids[i], chunk, sizeof chunk)
                      : md_detok_flush(&d, chunk, sizeof chunk);
        cr_assert_geq(k, 0, "detok failed: %d", k);
        cr_assert(utf8_valid((const unsigned char *)chunk, (size_t)k), "chunk %d broken", i);
        if (k == 0 && i < n) (*n_empty)++;
        cr_assert_leq(m + (size_t)k, cap);
        memcpy(out + m, chunk, (size_t)k);
        m += (size_t)k;
    }
    return m;
}

Test(detok, emoji_and_cjk_token_by_token_stay_whole_utf8)
{
    loaded l = load_smollm2();
    static const char *texts[] = {
        "\xf0\x9f\xab\xa0", /* one emoji, several tokens */
        "\xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 family",
        "\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c\xef\xbc\x81",
        ("\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 "
         "\xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87"),
        "\xf0\x9f\x8f\xb3\xef\xb8\x8f\xe2\x80\x8d\xf0\x9f\x8c\x88 \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbf",
    };
    int32_t ids[256];
    char full[1024], streamed[1024];
    int saw_hold_back = 0;
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        size_t len = strlen(texts[i]);
        int n = encode(l.t, texts[i], len, 0, 0, ids, 256);
        size_t m = decode(l.t, ids, n, 0, full, sizeof full);
        cr_assert(m == len && memcmp(full, texts[i], m) == 0);
        int n_empty;
        size_t s = stream(l.t, ids, n, streamed, sizeof streamed, &n_empty);
        cr_expect(s == m && memcmp(streamed, full, m) == 0, "text %zu streams differently", i);
        saw_hold_back |= n_empty > 0;
    }
    cr_expect(saw_hold_back, "no token ever ended inside a character: the test proves nothing");
    unload(&l);
}

Test(detok, every_fixture_string_streams_to_its_decode)
{
    loaded l = load_smollm2();
    int n_rows;
    row *rows = read_smollm2_rows(&n_rows);
    static int32_t ids[MAX_IDS];
    static char full[MAX_TEXT], streamed[3 * MAX_TEXT];
    for (int i = 0; i < n_rows; i++) {
        int n = encode(l.t, rows[i].text, rows[i].len, 1, rows[i].special, ids, MAX_IDS);
        size_t m = decode(l.t, ids, n, 0, full, sizeof full);
        int n_empty;
        size_t s = stream(l.t, ids, n, streamed, sizeof streamed, &n_empty);
        if (utf8_valid((const unsigned char *)full, m))
            cr_expect(s == m && memcmp(streamed, full, m) == 0, "row %d", i + 1);
    }
    free(rows);
    unload(&l);
}

Test(detok, invalid_bytes_become_replacement_characters)
{
    loaded l = load_smollm2();
    /* Byte-level tokens of single raw bytes: "\xc2\xbf" (¿) is byte 0xBF, a lone continuation
     * byte; "\xc3\xa4" (ä) is 0xE4, the lead of a 3-byte sequence. */
    int32_t lone = md_tok_find(l.t, "\xc2\xbf"), e4 = md_tok_find(l.t, "\xc3\xa4"),
            a = md_tok_find(l.t, "a");
    cr_assert(lone >= 0 && e4 >= 0 && a >= 0);
    md_detok d;
    md_detok_init(&d);
    char out[64];
    cr_expect_eq(md_detok_push(l.t, &d, lone, out, sizeof out), 3);
    cr_expect(memcmp(out, "\xef\xbf\xbd", 3) == 0);
    cr_expect_eq(md_detok_push(l.t, &d, e4, out, sizeof out), 0); /* could still be valid */
    cr_expect_eq(md_detok_push(l.t, &d, a, out, sizeof out), 4);  /* it was not */
    cr_expect(memcmp(out,
                     "\xef\xbf\xbd"
                     "a",
                     4) == 0);
    cr_expect_eq(md_detok_push(l.t, &d, e4, out, sizeof out), 0);
    cr_expect_eq(md_detok_flush(&d, out, sizeof out), 3); /* cut off at the end */
    cr_expect(memcmp(out, "\xef\xbf\xbd", 3) == 0);
    cr_expect_eq(md_detok_flush(&d, out, sizeof out), 0);
    /* No room: an error, and the state is kept. */
    cr_expect_eq(md_detok_push(l.t, &d, e4, out, sizeof out), 0);
    cr_expect_eq(md_detok_push(l.t, &d, a, out, 2), KM_ENOSPC);
    cr_expect_eq(md_detok_push(l.t, &d, a, out, sizeof out), 4);
    cr_expect_lt(md_detok_push(l.t, &d, -3, out, sizeof out), 0);
    unload(&l);
}

/* ---------------------------------------------------------------- llama.cpp's vocab vectors */

/* The .inp holds the strings, each followed by "\n__ggml_vocab_test__\n"; the .out line i the
 * ids of string i (add_special and parse_special off, as llama.cpp's test-tokenizer-0). */
static void check_vectors(const md_tokenizer *t, const char *inp_path, const char *out_path)
{
    size_t ni, no;
    char *inp = slurp(inp_path, &ni), *outs = slurp(out_path, &no);
    static const char sep[] = "\n__ggml_vocab_test__\n";
    static int32_t ids[MAX_IDS], want[MAX_IDS];
    char *p = inp, *q = outs;
    int cases = 0, bad = 0;
    while (p < inp + ni) {
        char *end = strstr(p, sep);
        cr_assert_not_null(end);
        char *eol = strchr(q, '\n');
        cr_assert_not_null(eol, "%s has fewer lines than cases", out_path);
        *eol = 0;
        int n = encode(t, p, (size_t)(end - p), 0, 0, ids, MAX_IDS);
        int nw = parse_ids(q, want, MAX_IDS);
        if (n != nw || memcmp(ids, want, (size_t)n * sizeof *ids) != 0) {
            bad++;
            cr_log_error("%s case %d differs: %.*s", inp_path, cases, (int)(end - p), p);
        }
        cases++;
        p = end + sizeof sep - 1;
        q = eol + 1;
    }
    cr_expect_eq(cases, 46);
    cr_expect_eq(bad, 0, "%d of %d cases of %s differ", bad, cases, inp_path);
    free(inp);
    free(outs);
}

#define VOCAB_TEST(name, file)                                                                     \
    Test(vocab, name)                                                                              \
    {                                                                                              \
        loaded l = load_path(FIX file);                                                            \
        check_vectors(l.t, FIX file ".inp", FIX file ".out");                                      \
        unload(&l);                                                                                \
    }

VOCAB_TEST(llama_bpe_matches_llama_cpp_vectors, "ggml-vocab-llama-bpe.gguf")
VOCAB_TEST(qwen2_matches_llama_cpp_vectors, "ggml-vocab-qwen2.gguf")
VOCAB_TEST(llama_spm_matches_llama_cpp_vectors, "ggml-vocab-llama-spm.gguf")
VOCAB_TEST(gpt2_matches_llama_cpp_vectors, "ggml-vocab-gpt-2.gguf")

/* The GPT-2 vocabulary with its tokenizer.ggml.pre string replaced (the file has no tensors, so
 * the rest of it may move). */
static loaded load_gpt2_with_pre(const char *pre, km_errbuf *e, int *rc)
{
    size_t n;
    char *src = slurp(FIX "ggml-vocab-gpt-2.gguf", &n);
    static const char key[] = "tokenizer.ggml.pre";
    char old[64];
    size_t k = 0;
    uint64_t klen = sizeof key - 1, vlen = 5;
    uint32_t type = 8;
    memcpy(old + k, &klen, 8), k += 8;
    memcpy(old + k, key, klen), k += klen;
    memcpy(old + k, &type, 4), k += 4;
    memcpy(old + k, &vlen, 8), k += 8;
    memcpy(old + k, "gpt-2", 5), k += 5;
    char *at = memmem(src, n, old, k);
    cr_assert_not_null(at);
    size_t plen = strlen(pre), head = (size_t)(at - src) + 8 + klen; /* where the type starts */
    loaded l = {0};
    l.mem = malloc(n + plen);
    cr_assert_not_null(l.mem);
    char *dst = l.mem;
    memcpy(dst, src, head);
    uint64_t nl = plen;
    memcpy(dst + head, &type, 4);
    memcpy(dst + head + 4, &nl, 8);
    memcpy(dst + head + 12, pre, plen);
    memcpy(dst + head + 12 + plen, at + k, n - (size_t)(at + k - src));
    size_t total = head + 12 + plen + (n - (size_t)(at + k - src));
    free(src);
    cr_assert_eq(md_gguf_open_memory(l.mem, total, &l.g, e), 0, "%s", e->msg);
    *rc = md_tok_create(l.g, &l.t, e);
    return l;
}

Test(vocab, default_pre_tokenizer_matches_llama_cpp)
{
    km_errbuf e = {{0}};
    int rc;
    loaded l = load_gpt2_with_pre("default", &e, &rc);
    cr_assert_eq(rc, 0, "%s", e.msg);
    check_vectors(l.t, FIX "ggml-vocab-gpt-2.gguf.inp", FIX "ggml-vocab-gpt-2-default.out");
    unload(&l);
}

Test(vocab, unknown_pre_tokenizer_is_refused_with_its_name)
{
    km_errbuf e = {{0}};
    int rc;
    loaded l = load_gpt2_with_pre("kimi-k2", &e, &rc);
    cr_expect_eq(rc, KM_EUNSUPPORTED);
    cr_expect_null(l.t);
    cr_expect_not_null(strstr(e.msg, "kimi-k2"), "message: %s", e.msg);
    unload(&l);
}

Test(vocab, llama3_adds_bos_and_ends_turns_with_eot_id)
{
    loaded l = load_path(FIX "ggml-vocab-llama-bpe.gguf");
    int32_t ids[16];
    cr_expect_eq(md_tok_adds_bos(l.t), 1);
    cr_expect_eq(md_tok_bos(l.t), 128000);
    cr_expect_eq(md_tok_eos(l.t), 128001);
    cr_expect_eq(md_tok_eot(l.t), 128009);
    cr_expect(md_tok_is_eog(l.t, 128001) && md_tok_is_eog(l.t, 128009));
    cr_expect_not(md_tok_is_eog(l.t, 128000));
    /* llama-tokenize -p "Hello world": [128000, 9906, 1917] */
    int n = encode(l.t, "Hello world", 11, 1, 1, ids, 16);
    cr_expect(n == 3 && ids[0] == 128000 && ids[1] == 9906 && ids[2] == 1917);
    /* llama-tokenize -p "<|begin_of_text|>Hi<|eot_id|>": BOS twice, as llama.cpp does. */
    const char s[] = "<|begin_of_text|>Hi<|eot_id|>";
    n = encode(l.t, s, sizeof s - 1, 1, 1, ids, 16);
    cr_expect(n == 4 && ids[0] == 128000 && ids[1] == 128000 && ids[2] == 13347 &&
              ids[3] == 128009);
    unload(&l);
}

Test(vocab, qwen2_control_looking_texts_become_end_of_generation)
{
    loaded l = load_path(FIX "ggml-vocab-qwen2.gguf");
    int32_t ids[16];
    cr_expect_eq(md_tok_eot(l.t), 151645);
    cr_expect(md_tok_is_eog(l.t, 151643) && md_tok_is_eog(l.t, 151645));
    /* "</s>" is a normal token in this file; llama.cpp makes it control and EOG. */
    cr_expect(md_tok_is_eog(l.t, 128247));
    /* llama-tokenize -p "a</s>b<|im_end|>": [64, 128247, 65, 151645] */
    const char s[] = "a</s>b<|im_end|>";
    int n = encode(l.t, s, sizeof s - 1, 1, 1, ids, 16);
    cr_expect(n == 4 && ids[0] == 64 && ids[1] == 128247 && ids[2] == 65 && ids[3] == 151645);
    unload(&l);
}

Test(vocab, spm_adds_bos_and_a_space_after_special_tokens)
{
    loaded l = load_path(FIX "ggml-vocab-llama-spm.gguf");
    int32_t ids[32];
    cr_expect_eq(md_tok_adds_bos(l.t), 1);
    cr_expect_eq(md_tok_eot(l.t), -1);
    cr_expect(md_tok_is_eog(l.t, 2));
    /* Expected ids from llama-tokenize on the same vocabulary. */
    int n = encode(l.t, "Hello world", 11, 1, 1, ids, 32);
    cr_expect(n == 3 && ids[0] == 1 && ids[1] == 15043 && ids[2] == 3186);
    const char s[] = "Hello<s>world</s> x";
    static const int32_t parsed[] = {1, 15043, 1, 3186, 2, 29871, 921};
    n = encode(l.t, s, sizeof s - 1, 1, 1, ids, 32);
    cr_expect(n == 7 && memcmp(ids, parsed, sizeof parsed) == 0);
    static const int32_t plain[] = {1, 15043, 29966, 29879, 29958, 11526, 829, 29879, 29958, 921};
    n = encode(l.t, s, sizeof s - 1, 1, 0, ids, 32);
    cr_expect(n == 10 && memcmp(ids, plain, sizeof plain) == 0);
    /* Byte fallback: an emoji the vocabulary lacks. */
    static const int32_t bytes[] = {1, 29871, 243, 162, 174, 163, 29871, 30793};
    n = encode(l.t, "\xf0\x9f\xab\xa0 \xe4\xb8\x96", 8, 1, 1, ids, 32);
    cr_expect(n == 8 && memcmp(ids, bytes, sizeof bytes) == 0);
    char out[64];
    size_t m = decode(l.t, ids, n, 0, out, sizeof out);
    cr_expect(m == 9 && memcmp(out, " \xf0\x9f\xab\xa0 \xe4\xb8\x96", 9) == 0);
    unload(&l);
}

/* ---------------------------------------------------------------- robustness */

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

Test(robust, random_bytes_encode_and_valid_text_round_trips)
{
    loaded l = load_smollm2();
    static int32_t ids[MAX_IDS];
    static char text[1024], out[MAX_TEXT];
    uint64_t seed = 0x9E3779B97F4A7C15ULL;
    static const char *alphabet[] = {"a",
                                     "Z",
                                     "7",
                                     " ",
                                     "  ",
                                     "\t",
                                     "\n",
                                     "\r\n",
                                     "'s",
                                     "'",
                                     "!",
                                     "<|im_start|>",
                                     "<|im",
                                     "\xc3\xa9",
                                     "\xe4\xb8\x96",
                                     "\xf0\x9f\x98\x80",
                                     "\xe2\x80\x8d",
                                     "\xd9\xa3",
                                     "\xc2\xa0"};
    for (int iter = 0; iter < 2000; iter++) {
        size_t n = rng_next(&seed) % 200;
        int valid = iter % 2;
        size_t m = 0;
        if (valid) {
            while (m < n) {
                const char *piece =
                    alphabet[rng_next(&seed) % (sizeof alphabet / sizeof *alphabet)];
                size_t k = strlen(piece);
                memcpy(text + m, piece, k);
                m += k;
            }
        } else {
            for (; m < n; m++) text[m] = (char)rng_next(&seed);
        }
        int special = (int)(rng_next(&seed) & 1);
        int k = encode(l.t, text, m, 1, special, ids, MAX_IDS);
        if (valid) {
            size_t back = decode(l.t, ids, k, 1, out, sizeof out);
            cr_assert(back == m && memcmp(out, text, m) == 0, "iteration %d", iter);
        }
    }
    unload(&l);
}

typedef struct encode_job {
    const md_tokenizer *t;
    const row *rows;
    int n_rows, mismatches;
} encode_job;

static void *encode_all_rows(void *arg)
{
    encode_job *j = arg;
    static _Thread_local int32_t ids[MAX_IDS];
    for (int rep = 0; rep < 5; rep++) {
        for (int i = 0; i < j->n_rows; i++) {
            const row *r = &j->rows[i];
            int n = md_tok_encode(j->t, r->text, r->len, 1, r->special, ids, MAX_IDS);
            if (n != r->n_ids || memcmp(ids, r->ids, (size_t)n * sizeof *ids) != 0) j->mismatches++;
        }
    }
    return NULL;
}

Test(robust, one_tokenizer_encodes_from_several_threads_at_once)
{
    loaded l = load_smollm2();
    int n_rows;
    row *rows = read_smollm2_rows(&n_rows);
    encode_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (encode_job){l.t, rows, n_rows, 0};
        cr_assert_eq(pthread_create(&th[i], NULL, encode_all_rows, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(jobs[i].mismatches, 0, "thread %d", i);
    }
    free(rows);
    unload(&l);
}

Test(robust, bad_arguments_are_errors)
{
    loaded l = load_smollm2();
    int32_t ids[4];
    md_tokenizer *t = (md_tokenizer *)1;
    km_errbuf e = {{0}};
    cr_expect_lt(md_tok_create(NULL, &t, &e), 0);
    cr_expect_lt(md_tok_encode(NULL, "a", 1, 0, 0, ids, 4), 0);
    cr_expect_lt(md_tok_encode(l.t, NULL, 3, 0, 0, ids, 4), 0);
    cr_expect_lt(md_tok_encode(l.t, "a", 1, 0, 0, ids, -1), 0);
    cr_expect_lt(md_tok_encode(l.t, "a", 1, 0, 0, NULL, 4), 0);
    md_detok d;
    md_detok_init(&d);
    cr_expect_lt(md_detok_push(l.t, &d, 1 << 20, NULL, 0), 0);
    md_tok_destroy(NULL);
    unload(&l);
}

Test(robust, a_gguf_without_a_tokenizer_is_an_error)
{
    /* The smallest valid GGUF: header only. */
    static const unsigned char empty[] = {'G', 'G', 'U', 'F', 3, 0, 0, 0, 0, 0, 0, 0,
                                          0,   0,   0,   0,   0, 0, 0, 0, 0, 0, 0, 0};
    md_gguf *g;
    km_errbuf e = {{0}};
    cr_assert_eq(md_gguf_open_memory(empty, sizeof empty, &g, &e), 0, "%s", e.msg);
    md_tokenizer *t = NULL;
    cr_expect_eq(md_tok_create(g, &t, &e), KM_EFORMAT);
    cr_expect_null(t);
    cr_expect_not_null(strstr(e.msg, "tokenizer.ggml.model"), "message: %s", e.msg);
    md_gguf_close(g);
}

/* ---------------------------------------------------------------- chat templates */

Test(chat, renders_exactly_like_the_jinja_templates)
{
    size_t len;
    char *all = slurp(FIX "chat.tsv", &len);
    static char bufs[40][4096];
    static char want[8192], got[8192], sys[512];
    int cases = 0;
    for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#') continue;
        char *f[24];
        int nf = split_tabs(line, f, 24);
        cr_assert_geq(nf, 4);
        cr_assert_eq(nf % 2, 0);
        md_chat_kind kind = md_chat_parse(f[0]);
        cr_assert_neq(kind, MD_CHAT_NONE);
        int add = atoi(f[1]);
        const char *def = NULL;
        if (strcmp(f[2], "-") != 0) {
            sys[unescape(f[2], strlen(f[2]), sys)] = 0;
            def = sys;
        }
        size_t wn = unescape(f[3], strlen(f[3]), want);
        md_chat_msg msgs[10];
        int n = 0;
        for (int i = 4; i + 1 < nf; i += 2, n++) {
            bufs[2 * n][unescape(f[i], strlen(f[i]), bufs[2 * n])] = 0;
            bufs[2 * n + 1][unescape(f[i + 1], strlen(f[i + 1]), bufs[2 * n + 1])] = 0;
            msgs[n] = (md_chat_msg){bufs[2 * n], bufs[2 * n + 1]};
        }
        int k = md_chat_apply(kind, msgs, n, add, def, got, sizeof got);
        cr_expect(k == (int)wn && memcmp(got, want, wn) == 0 && got[wn] == 0,
                  "case %d (%s, %d messages, add_assistant %d):\n got: %s\nwant: %.*s", cases + 1,
                  f[0], n, add, got, (int)wn, want);
        cases++;
    }
    cr_expect_eq(cases, 56);
    free(all);
}

Test(chat, llama3_writes_bos_and_trims_contents)
{
    md_chat_msg msgs[] = {{"user", "  Hello\n"}};
    char out[256];
    const char want[] =
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n";
    cr_expect_eq(md_chat_apply(MD_CHAT_LLAMA3, msgs, 1, 1, NULL, out, sizeof out),
                 (int)sizeof want - 1);
    cr_expect_str_eq(out, want);
}

Test(chat, short_buffer_gets_the_needed_length_and_a_terminated_prefix)
{
    md_chat_msg msgs[] = {{"user", "Hello"}};
    char out[8];
    int need = md_chat_apply(MD_CHAT_CHATML, msgs, 1, 0, NULL, out, sizeof out);
    cr_expect_eq(need, (int)strlen("<|im_start|>user\nHello<|im_end|>\n"));
    cr_expect_str_eq(out, "<|im_st");
    cr_expect_eq(md_chat_apply(MD_CHAT_CHATML, msgs, 1, 0, NULL, NULL, 0), need);
    cr_expect_eq(md_chat_apply(MD_CHAT_NONE, msgs, 1, 0, NULL, out, sizeof out), KM_EUNSUPPORTED);
    md_chat_msg bad[] = {{NULL, "x"}};
    cr_expect_eq(md_chat_apply(MD_CHAT_CHATML, bad, 1, 0, NULL, out, sizeof out), KM_EINVAL);
}

Test(chat, detect_and_parse_name_the_families)
{
    cr_expect_eq(md_chat_parse("chatml"), MD_CHAT_CHATML);
    cr_expect_eq(md_chat_parse("llama3"), MD_CHAT_LLAMA3);
    cr_expect_eq(md_chat_parse("llama2"), MD_CHAT_NONE);
    cr_expect_eq(md_chat_parse(NULL), MD_CHAT_NONE);
    cr_expect_eq(md_chat_detect(NULL), MD_CHAT_NONE);
    md_gguf *g;
    km_errbuf e = {{0}};
    cr_assert_eq(md_gguf_open(FIX "ggml-vocab-qwen2.gguf", &g, &e), 0, "%s", e.msg);
    cr_expect_eq(md_chat_detect(g), MD_CHAT_CHATML);
    md_gguf_close(g);
    cr_assert_eq(md_gguf_open(FIX "ggml-vocab-gpt-2.gguf", &g, &e), 0, "%s", e.msg);
    cr_expect_eq(md_chat_detect(g), MD_CHAT_NONE); /* no template */
    md_gguf_close(g);
    if (access(SMOLLM2, R_OK) == 0) {
        cr_assert_eq(md_gguf_open(SMOLLM2, &g, &e), 0, "%s", e.msg);
        cr_expect_eq(md_chat_detect(g), MD_CHAT_CHATML);
        md_gguf_close(g);
    }
}
