/*
 * log.c — the process-wide logger (one line per event on stderr) and the monotonic clock.
 *
 * Every line is `ts=... level=... event=EVENT key=value ...` (logfmt), or with
 * `--log-format json` one JSON object per line with the same fields, for collectors. Callers
 * format their fields with printf into one "k=v k=v" string; the logger then splits it back into
 * pairs: a new pair starts at a space followed by `identifier=`. That keeps call sites as short as
 * a printf while letting both formats quote and escape values (a value with spaces, quotes or a
 * newline from a file or a peer can never break the one-line-per-event rule or the JSON).
 *
 * The line is assembled in memory and handed to stderr with one fwrite, so lines from different
 * threads do not interleave. The level and format are the only global state (set at start-up,
 * read with relaxed atomics).
 */
#include "common/km.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { LOG_FMT_TEXT = 0, LOG_FMT_JSON = 1 };

static int log_level = KM_LOG_INFO;
static int log_format = LOG_FMT_TEXT;

static const char *const log_level_names[] = {"debug", "info", "warn", "error"};

void km_log_set_level(km_log_level level)
{
    if ((int)level < KM_LOG_DEBUG) level = KM_LOG_DEBUG;
    if ((int)level > KM_LOG_ERROR) level = KM_LOG_ERROR;
    __atomic_store_n(&log_level, (int)level, __ATOMIC_RELAXED);
}

int km_log_set_format(const char *format)
{
    if (!format) return KM_EINVAL;
    if (strcmp(format, "text") == 0)
        __atomic_store_n(&log_format, LOG_FMT_TEXT, __ATOMIC_RELAXED);
    else if (strcmp(format, "json") == 0)
        __atomic_store_n(&log_format, LOG_FMT_JSON, __ATOMIC_RELAXED);
    else
        return KM_EINVAL;
    return 0;
}

int km_log_parse_level(const char *s, km_log_level *out)
{
    if (!s || !out) return KM_EINVAL;
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, log_level_names[i]) == 0) {
            *out = (km_log_level)i;
            return 0;
        }
    }
    return KM_EINVAL;
}

uint64_t km_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t km_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void km_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* ---------------------------------------------------------------- line buffer */

/* A growable byte buffer that starts on the stack; on allocation failure it keeps what fits and
 * the line is emitted truncated rather than lost. */
typedef struct log_buf {
    char *p;
    size_t len, cap;
    int heap;
    char stack[1024];
} log_buf;

static void log_buf_init(log_buf *b)
{
    b->p = b->stack;
    b->len = 0;
    b->cap = sizeof b->stack;
    b->heap = 0;
}

static void log_buf_free(log_buf *b)
{
    if (b->heap) free(b->p);
}

/* Makes room for n more bytes; returns how many of them fit. */
static size_t log_buf_reserve(log_buf *b, size_t n)
{
    if (b->cap - b->len >= n) return n;
    size_t want = b->cap * 2;
    while (want - b->len < n) want *= 2;
    char *q = b->heap ? realloc(b->p, want) : malloc(want);
    if (q) {
        if (!b->heap) memcpy(q, b->p, b->len);
        b->p = q;
        b->cap = want;
        b->heap = 1;
        return n;
    }
    return b->cap - b->len;
}

static void log_buf_put(log_buf *b, const char *s, size_t n)
{
    n = log_buf_reserve(b, n);
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void log_buf_puts(log_buf *b, const char *s)
{
    log_buf_put(b, s, strlen(s));
}

static void log_buf_putc(log_buf *b, char c)
{
    log_buf_put(b, &c, 1);
}

/* ---------------------------------------------------------------- escaping */

/* Length of the valid UTF-8 sequence at s (at most n bytes), or 0 when it is not valid
 * (overlong forms, surrogates and code points past U+10FFFF are invalid). */
static size_t log_utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len;
    uint32_t cp, min;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2, cp = c & 0x1f, min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3, cp = c & 0x0f, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4, cp = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return len;
}

/* Writes s as the inside of a JSON string (or of a logfmt quoted value, which uses the same
 * escapes): quotes, backslashes and control characters escaped, invalid UTF-8 replaced with
 * U+FFFD so the output is always valid UTF-8. */
static void log_put_escaped(log_buf *b, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned c = u[i];
        size_t run = 0;
        if (c >= 0x20 && c != '"' && c != '\\' && c != 0x7f) run = log_utf8_len(u + i, n - i);
        if (run) {
            log_buf_put(b, s + i, run);
            i += run;
            continue;
        }
        char esc[8];
        switch (c) {
        case '"':
            log_buf_puts(b, "\\\"");
            break;
        case '\\':
            log_buf_puts(b, "\\\\");
            break;
        case '\n':
            log_buf_puts(b, "\\n");
            break;
        case '\r':
            log_buf_puts(b, "\\r");
            break;
        case '\t':
            log_buf_puts(b, "\\t");
            break;
        case '\b':
            log_buf_puts(b, "\\b");
            break;
        case '\f':
            log_buf_puts(b, "\\f");
            break;
        default:
            if (c < 0x20 || c == 0x7f) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                log_buf_puts(b, esc);
            } else {
                log_buf_puts(b, "\\ufffd");
            }
        }
        i++;
    }
}

/* A logfmt value needs quotes when it is empty or holds a space, '=', a quote, a backslash, a
 * control character or bytes that are not valid UTF-8. */
static int log_text_needs_quotes(const char *s, size_t n)
{
    if (n == 0) return 1;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = u[i];
        if (c <= 0x20 || c == '=' || c == '"' || c == '\\' || c == 0x7f) return 1;
        size_t run = log_utf8_len(u + i, n - i);
        if (!run) return 1;
        i += run;
    }
    return 0;
}

static void log_put_text_value(log_buf *b, const char *s, size_t n)
{
    if (!log_text_needs_quotes(s, n)) {
        log_buf_put(b, s, n);
        return;
    }
    log_buf_putc(b, '"');
    log_put_escaped(b, s, n);
    log_buf_putc(b, '"');
}

/* True when s is exactly a JSON number (RFC 8259 grammar), so it can be written unquoted. */
static int log_is_json_number(const char *s, size_t n)
{
    size_t i = 0;
    if (i < n && s[i] == '-') i++;
    if (i >= n) return 0;
    if (s[i] == '0') {
        i++;
    } else if (s[i] >= '1' && s[i] <= '9') {
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    } else {
        return 0;
    }
    if (i < n && s[i] == '.') {
        i++;
        if (i >= n || s[i] < '0' || s[i] > '9') return 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= n || s[i] < '0' || s[i] > '9') return 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    return i == n;
}

static void log_put_json_value(log_buf *b, const char *s, size_t n)
{
    if (log_is_json_number(s, n)) {
        log_buf_put(b, s, n);
        return;
    }
    log_buf_putc(b, '"');
    log_put_escaped(b, s, n);
    log_buf_putc(b, '"');
}

/* ---------------------------------------------------------------- splitting k=v pairs */

static int log_is_key_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
}

/* Length of the key when s starts with `identifier=`, else 0. */
static size_t log_key_at(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n && log_is_key_char(s[i])) i++;
    return (i > 0 && i < n && s[i] == '=') ? i : 0;
}

/* Calls emit(key, value) for each pair of msg. Text before the first pair (a caller that wrote
 * prose instead of pairs) becomes the value of "msg". Values run up to the next " key=". */
static void log_split(const char *msg, size_t n, log_buf *b, int format)
{
    size_t i = 0;
    while (i < n) {
        while (i < n && msg[i] == ' ') i++;
        if (i >= n) break;
        const char *key = "msg";
        size_t klen = 3;
        size_t k = log_key_at(msg + i, n - i);
        if (k) {
            key = msg + i;
            klen = k;
            i += k + 1;
        }
        size_t v = i;
        while (i < n && !(msg[i] == ' ' && i + 1 < n && log_key_at(msg + i + 1, n - i - 1))) i++;
        size_t vend = i;
        while (vend > v && msg[vend - 1] == ' ') vend--;
        /* A caller that quoted a value itself (path="%s") gets its quotes replaced by ours. */
        if (vend - v >= 2 && msg[v] == '"' && msg[vend - 1] == '"') v++, vend--;
        if (format == LOG_FMT_JSON) {
            log_buf_puts(b, ",\"");
            log_put_escaped(b, key, klen);
            log_buf_puts(b, "\":");
            log_put_json_value(b, msg + v, vend - v);
        } else {
            log_buf_putc(b, ' ');
            log_buf_put(b, key, klen);
            log_buf_putc(b, '=');
            log_put_text_value(b, msg + v, vend - v);
        }
    }
}

/* ---------------------------------------------------------------- km_log */

void km_log(km_log_level level, const char *event, const char *fmt, ...)
{
    if ((int)level < __atomic_load_n(&log_level, __ATOMIC_RELAXED)) return;
    int format = __atomic_load_n(&log_format, __ATOMIC_RELAXED);
    if ((int)level < KM_LOG_DEBUG || (int)level > KM_LOG_ERROR) level = KM_LOG_ERROR;
    if (!event) event = "";

    /* The caller's pairs, formatted once. */
    char small[512];
    char *msg = small;
    va_list ap;
    va_start(ap, fmt);
    int n = fmt ? vsnprintf(small, sizeof small, fmt, ap) : 0;
    va_end(ap);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof small) {
        char *big = malloc((size_t)n + 1);
        if (big) {
            va_start(ap, fmt);
            vsnprintf(big, (size_t)n + 1, fmt, ap);
            va_end(ap);
            msg = big;
        } else {
            n = sizeof small - 1;
        }
    }

    char ts[40];
    struct timespec now;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    size_t tl = strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(ts + tl, sizeof ts - tl, ".%03ldZ", now.tv_nsec / 1000000);

    log_buf b;
    log_buf_init(&b);
    const char *lvl = log_level_names[level];
    if (format == LOG_FMT_JSON) {
        log_buf_puts(&b, "{\"ts\":\"");
        log_buf_puts(&b, ts);
        log_buf_puts(&b, "\",\"level\":\"");
        log_buf_puts(&b, lvl);
        log_buf_puts(&b, "\",\"event\":\"");
        log_put_escaped(&b, event, strlen(event));
        log_buf_putc(&b, '"');
        log_split(msg, (size_t)n, &b, format);
        log_buf_puts(&b, "}\n");
    } else {
        log_buf_puts(&b, "ts=");
        log_buf_puts(&b, ts);
        log_buf_puts(&b, " level=");
        log_buf_puts(&b, lvl);
        log_buf_puts(&b, " event=");
        log_put_text_value(&b, event, strlen(event));
        log_split(msg, (size_t)n, &b, format);
        log_buf_putc(&b, '\n');
    }
    /* A line cut short by a failed allocation still ends the line. */
    if (b.len && b.p[b.len - 1] != '\n') b.p[b.len - 1] = '\n';

    fwrite(b.p, 1, b.len, stderr);
    fflush(stderr);
    log_buf_free(&b);
    if (msg != small) free(msg);
}
