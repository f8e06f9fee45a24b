/*
 * test_common.c — errors, the logger's two line formats, the clock and the tensor-type table.
 *
 * Log lines are captured by pointing fd 2 at a temporary file around the call; each test runs in
 * its own process (Criterion forks), so the logger's global level and format do not leak between
 * tests. JSON lines are checked with a small strict validator below, not just by substring.
 */
#include "common/km.h"
#include "model/model.h"

#include <criterion/criterion.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- errors */

Test(err, every_code_has_its_own_message)
{
    for (int a = KM_ECORRUPT; a <= KM_OK; a++) {
        const char *m = km_strerror(a);
        cr_assert_not_null(m);
        cr_expect_gt(strlen(m), 1);
        cr_expect_str_neq(m, "unknown error", "code %d", a);
        for (int b = a + 1; b <= KM_OK; b++) cr_expect_str_neq(m, km_strerror(b));
    }
    cr_expect_str_eq(km_strerror(KM_ENOMEM), "out of memory");
    cr_expect_str_eq(km_strerror(-1000), "unknown error");
    cr_expect_str_eq(km_strerror(7), "unknown error");
}

Test(err, errf_formats_into_the_buffer_and_returns_the_code)
{
    km_errbuf e;
    cr_expect_eq(km_errf(&e, KM_EFORMAT, "tensor %d '%s' bad", 12, "x"), KM_EFORMAT);
    cr_expect_str_eq(e.msg, "tensor 12 'x' bad");
    cr_expect_eq(km_errf(NULL, KM_EIO, "ignored %d", 1), KM_EIO);
}

Test(err, errf_truncates_long_messages_safely)
{
    km_errbuf e;
    char big[2000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    cr_expect_eq(km_errf(&e, KM_ERANGE, "%s", big), KM_ERANGE);
    cr_expect_eq(strlen(e.msg), sizeof e.msg - 1);
}

/* ---------------------------------------------------------------- clock */

Test(time, now_ns_is_monotonic_and_advances)
{
    uint64_t a = km_now_ns();
    struct timespec d = {0, 2000000};
    nanosleep(&d, NULL);
    uint64_t b = km_now_ns();
    cr_expect_geq(b - a, 2000000u);
    cr_expect_lt(b - a, 5000000000u);
    for (int i = 0; i < 1000; i++) {
        uint64_t c = km_now_ns();
        cr_assert_geq(c, b);
        b = c;
    }
}

/* ---------------------------------------------------------------- type table */

Test(types, table_matches_ggml)
{
    static const struct {
        uint32_t id;
        const char *name;
        int elems, bytes;
    } want[] = {
        {MD_TYPE_F32, "F32", 1, 4},       {MD_TYPE_F16, "F16", 1, 2},
        {MD_TYPE_BF16, "BF16", 1, 2},     {MD_TYPE_Q4_0, "Q4_0", 32, 18},
        {MD_TYPE_Q4_1, "Q4_1", 32, 20},   {MD_TYPE_Q5_0, "Q5_0", 32, 22},
        {MD_TYPE_Q5_1, "Q5_1", 32, 24},   {MD_TYPE_Q8_0, "Q8_0", 32, 34},
        {MD_TYPE_Q8_1, "Q8_1", 32, 36},   {MD_TYPE_Q2_K, "Q2_K", 256, 84},
        {MD_TYPE_Q3_K, "Q3_K", 256, 110}, {MD_TYPE_Q4_K, "Q4_K", 256, 144},
        {MD_TYPE_Q5_K, "Q5_K", 256, 176}, {MD_TYPE_Q6_K, "Q6_K", 256, 210},
        {MD_TYPE_Q8_K, "Q8_K", 256, 292},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        cr_expect_eq(md_type_block_elems(want[i].id), want[i].elems, "%s", want[i].name);
        cr_expect_eq(md_type_block_bytes(want[i].id), want[i].bytes, "%s", want[i].name);
        cr_expect_str_eq(md_type_name(want[i].id), want[i].name);
    }
    /* ggml's raw numeric ids, as written in GGUF files. */
    cr_expect_str_eq(md_type_name(3), "Q4_1");
    cr_expect_str_eq(md_type_name(8), "Q8_0");
    cr_expect_str_eq(md_type_name(30), "BF16");
}

Test(types, unknown_ids_read_as_unknown)
{
    const uint32_t ids[] = {4, 5, 16, 20, 29, 31, 39, 40, 41, 1000, UINT32_MAX};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        cr_expect_eq(md_type_block_elems(ids[i]), 0, "id %u", ids[i]);
        cr_expect_eq(md_type_block_bytes(ids[i]), 0, "id %u", ids[i]);
        cr_expect_str_eq(md_type_name(ids[i]), "unknown");
        cr_expect_eq(md_type_row_bytes(ids[i], 256), 0);
    }
}

Test(types, row_bytes_counts_whole_blocks_only)
{
    cr_expect_eq(md_type_row_bytes(MD_TYPE_F32, 3), 12);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_F16, 576), 1152);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_Q4_1, 576), 576 / 32 * 20);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_Q8_0, 576), 576 / 32 * 34);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_Q6_K, 1536), 6 * 210);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_Q4_0, 33), 0);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_Q4_K, 576), 0, "576 is not a multiple of 256");
    cr_expect_eq(md_type_row_bytes(MD_TYPE_F32, 0), 0);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_F32, -4), 0);
    /* Byte counts past 2^64 cannot be represented and read as 0. */
    cr_expect_eq(md_type_row_bytes(MD_TYPE_F32, (INT64_C(1) << 62) - 1), UINT64_MAX - 3);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_F32, INT64_C(1) << 62), 0);
    cr_expect_eq(md_type_row_bytes(MD_TYPE_F32, INT64_MAX), 0);
}

/* ---------------------------------------------------------------- logging */

/* Runs fn with stderr redirected to a temporary file and returns what was written (malloc'd). */
static char *capture_stderr(void (*fn)(void))
{
    FILE *tmp = tmpfile();
    cr_assert_not_null(tmp);
    fflush(stderr);
    int saved = dup(2);
    cr_assert_geq(saved, 0);
    dup2(fileno(tmp), 2);
    fn();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    /* fd 2 and tmp share one file offset, but tmp's stdio position is stale: seek to learn it. */
    fseek(tmp, 0, SEEK_END);
    long n = ftell(tmp);
    char *out = calloc(1, (size_t)n + 1);
    cr_assert_not_null(out);
    rewind(tmp);
    size_t got = fread(out, 1, (size_t)n, tmp);
    out[got] = '\0';
    fclose(tmp);
    return out;
}

static int matches(const char *re, const char *s)
{
    regex_t r;
    cr_assert_eq(regcomp(&r, re, REG_EXTENDED | REG_NOSUB), 0, "bad regex %s", re);
    int ok = regexec(&r, s, 0, NULL, 0) == 0;
    regfree(&r);
    return ok;
}

#define TS_RE "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z"

Test(log, parse_level_accepts_the_four_names_only)
{
    km_log_level l;
    cr_expect_eq(km_log_parse_level("debug", &l), 0);
    cr_expect_eq(l, KM_LOG_DEBUG);
    cr_expect_eq(km_log_parse_level("info", &l), 0);
    cr_expect_eq(l, KM_LOG_INFO);
    cr_expect_eq(km_log_parse_level("warn", &l), 0);
    cr_expect_eq(l, KM_LOG_WARN);
    cr_expect_eq(km_log_parse_level("error", &l), 0);
    cr_expect_eq(l, KM_LOG_ERROR);
    cr_expect_eq(km_log_parse_level("verbose", &l), KM_EINVAL);
    cr_expect_eq(km_log_parse_level("", &l), KM_EINVAL);
    cr_expect_eq(km_log_parse_level(NULL, &l), KM_EINVAL);
}

Test(log, set_format_accepts_text_and_json_only)
{
    cr_expect_eq(km_log_set_format("json"), 0);
    cr_expect_eq(km_log_set_format("text"), 0);
    cr_expect_eq(km_log_set_format("xml"), KM_EINVAL);
    cr_expect_eq(km_log_set_format(NULL), KM_EINVAL);
}

static void log_plain(void)
{
    KM_INFO("model.load", "path=%s bytes=%zu", "/m/x.gguf", (size_t)123);
}

Test(log, text_line_has_ts_level_event_then_pairs)
{
    char *out = capture_stderr(log_plain);
    cr_expect(matches("^ts=" TS_RE " level=info event=model.load path=/m/x.gguf bytes=123\n$", out),
              "got: %s", out);
    free(out);
}

static void log_levels(void)
{
    KM_DEBUG("hidden", "a=1");
    KM_INFO("shown", "a=2");
    km_log_set_level(KM_LOG_WARN);
    KM_INFO("hidden", "a=3");
    KM_WARN("shown", "a=4");
    KM_ERROR("shown", "a=5");
    km_log_set_level(KM_LOG_DEBUG);
    KM_DEBUG("shown", "a=6");
}

Test(log, level_filters_lines)
{
    char *out = capture_stderr(log_levels);
    cr_expect_null(strstr(out, "hidden"), "got: %s", out);
    cr_expect_not_null(strstr(out, "level=info event=shown a=2\n"), "got: %s", out);
    cr_expect_not_null(strstr(out, "level=warn event=shown a=4\n"), "got: %s", out);
    cr_expect_not_null(strstr(out, "level=error event=shown a=5\n"), "got: %s", out);
    cr_expect_not_null(strstr(out, "level=debug event=shown a=6\n"), "got: %s", out);
    int lines = 0;
    for (const char *p = out; *p; p++) lines += *p == '\n';
    cr_expect_eq(lines, 4);
    free(out);
}

static void log_text_quoting(void)
{
    KM_WARN("gguf.reject", "path=%s err=%s n=%d", "/tmp/my model.gguf",
            "gguf: tensor 1 'a\"b': bad\nline", 3);
    KM_INFO("ev", "empty= quoted=\"%s\" tail=x", "a b");
    KM_INFO("ev", "just some prose");
    KM_INFO("ev two", "k=%s", "caf\xc3\xa9");
}

Test(log, text_values_with_spaces_quotes_or_newlines_are_quoted)
{
    char *out = capture_stderr(log_text_quoting);
    cr_expect_not_null(strstr(out, " event=gguf.reject path=\"/tmp/my model.gguf\" "
                                   "err=\"gguf: tensor 1 'a\\\"b': bad\\nline\" n=3\n"),
                       "got: %s", out);
    cr_expect_not_null(strstr(out, " event=ev empty=\"\" quoted=\"a b\" tail=x\n"), "got: %s", out);
    cr_expect_not_null(strstr(out, " event=ev msg=\"just some prose\"\n"), "got: %s", out);
    cr_expect_not_null(strstr(out, " event=\"ev two\" k=caf\xc3\xa9\n"), "got: %s", out);
    int lines = 0;
    for (const char *p = out; *p; p++) lines += *p == '\n';
    cr_expect_eq(lines, 4, "one line per event: %s", out);
    free(out);
}

/* A strict validator for the JSON the logger writes: one object per line whose values are strings
 * or numbers. Returns the number of members, or -1 when the line is not valid JSON. */
static const char *json_string(const char *p)
{
    if (*p++ != '"') return NULL;
    while (*p != '"') {
        unsigned char c = (unsigned char)*p;
        if (c < 0x20) return NULL;
        if (c == '\\') {
            p++;
            if (*p == 'u') {
                for (int i = 1; i <= 4; i++)
                    if (!strchr("0123456789abcdefABCDEF", p[i]) || !p[i]) return NULL;
                p += 5;
                continue;
            }
            if (!*p || !strchr("\"\\/bfnrt", *p)) return NULL;
        }
        p++;
    }
    return p + 1;
}

static const char *json_number(const char *p)
{
    char *end;
    strtod(p, &end);
    return end == p ? NULL : end;
}

static int json_line_members(const char *line)
{
    const char *p = line;
    int n = 0;
    if (*p++ != '{') return -1;
    for (;;) {
        if (!(p = json_string(p)) || *p++ != ':') return -1;
        p = *p == '"' ? json_string(p) : json_number(p);
        if (!p) return -1;
        n++;
        if (*p == ',') {
            p++;
            continue;
        }
        break;
    }
    if (*p++ != '}' || *p++ != '\n' || *p) return -1;
    return n;
}

static void log_json(void)
{
    cr_assert_eq(km_log_set_format("json"), 0);
    KM_WARN("model.load", "path=%s bytes=%zu ratio=%.2f neg=%d code=%s", "/a b/\"q\".gguf",
            (size_t)42, 0.5, -7, "007");
}

Test(log, json_line_is_one_valid_object_with_typed_values)
{
    char *out = capture_stderr(log_json);
    cr_expect_eq(json_line_members(out), 8, "invalid JSON: %s", out);
    cr_expect(matches("^\\{\"ts\":\"" TS_RE "\",\"level\":\"warn\",\"event\":\"model.load\",", out),
              "got: %s", out);
    cr_expect_not_null(strstr(out, ",\"path\":\"/a b/\\\"q\\\".gguf\",\"bytes\":42,\"ratio\":0.50,"
                                   "\"neg\":-7,\"code\":\"007\"}\n"),
                       "got: %s", out);
    free(out);
}

static void log_json_escapes(void)
{
    cr_assert_eq(km_log_set_format("json"), 0);
    KM_ERROR("ev\"x", "ctl=%s bad=%s ok=%s bs=%s", "a\x01\tb\n", "\xff\xc3(", "\xe2\x82\xac",
             "c:\\dir");
    KM_INFO("ev", "prose only");
}

Test(log, json_escapes_control_bytes_and_invalid_utf8)
{
    char *out = capture_stderr(log_json_escapes);
    char *nl = strchr(out, '\n');
    cr_assert_not_null(nl);
    char *second = strdup(nl + 1);
    nl[1] = '\0';
    cr_expect_eq(json_line_members(out), 7, "invalid JSON: %s", out);
    cr_expect_not_null(strstr(out, "\"event\":\"ev\\\"x\""), "got: %s", out);
    cr_expect_not_null(strstr(out, "\"ctl\":\"a\\u0001\\tb\\n\""), "got: %s", out);
    cr_expect_not_null(strstr(out, "\"bad\":\"\\ufffd\\ufffd(\""), "got: %s", out);
    cr_expect_not_null(strstr(out, "\"ok\":\"\xe2\x82\xac\""), "got: %s", out);
    cr_expect_not_null(strstr(out, "\"bs\":\"c:\\\\dir\""), "got: %s", out);
    cr_expect_eq(json_line_members(second), 4, "invalid JSON: %s", second);
    cr_expect_not_null(strstr(second, "\"msg\":\"prose only\"}"), "got: %s", second);
    free(second);
    free(out);
}

static void log_long(void)
{
    char *v = malloc(10001);
    memset(v, 'v', 10000);
    v[10000] = '\0';
    km_log_set_format("json");
    KM_INFO("big", "v=%s end=1", v);
    free(v);
}

Test(log, long_lines_are_written_whole)
{
    char *out = capture_stderr(log_long);
    cr_expect_eq(json_line_members(out), 5, "invalid JSON (len %zu)", strlen(out));
    cr_expect_gt(strlen(out), 10000);
    cr_expect_not_null(strstr(out, "vvvv\",\"end\":1}\n"));
    free(out);
}
