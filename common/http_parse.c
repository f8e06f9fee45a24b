/*
 * http_parse.c — HTTP/1 messages out of buffers (common/http.h, "parsing"): a request from the
 * front of a connection's buffer for the server, a whole response for libkvmesh's client.
 *
 * Why it is built this way: the parsing is picohttpparser's (phr_parse_request,
 * phr_parse_response, phr_decode_chunked), the maintained parser of h2o, taken from Debian's
 * libh2o, which exports it but ships no header for it, hence the declarations below
 * (docs/dependencies.md). What is left here is HTTP's framing rules on top of the parsed head:
 * Content-Length or chunked, keep-alive, 100-continue and the limits, each refusal with the status
 * the server answers. No I/O and no state between calls, so a fuzz driver can feed it anything.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/types.h>

#include "common/http.h"

/* picohttpparser's API as exported by libh2o (deps/picohttpparser/picohttpparser.h in h2o). */
struct phr_header {
    const char *name;
    size_t name_len;
    const char *value;
    size_t value_len;
};
int phr_parse_request(const char *buf, size_t len, const char **method, size_t *method_len,
                      const char **path, size_t *path_len, int *minor_version,
                      struct phr_header *headers, size_t *num_headers, size_t last_len);
int phr_parse_response(const char *buf, size_t len, int *minor_version, int *status,
                       const char **msg, size_t *msg_len, struct phr_header *headers,
                       size_t *num_headers, size_t last_len);
struct phr_chunked_decoder {
    size_t bytes_left_in_chunk;
    char consume_trailer;
    char _hex_count;
    char _state;
};
ssize_t phr_decode_chunked(struct phr_chunked_decoder *decoder, char *buf, size_t *bufsz);

const char *km_http_reason(int status)
{
    static const struct {
        int status;
        const char *reason;
    } reasons[] = {
        {100, "Continue"},
        {200, "OK"},
        {400, "Bad Request"},
        {401, "Unauthorized"},
        {404, "Not Found"},
        {405, "Method Not Allowed"},
        {408, "Request Timeout"},
        {411, "Length Required"},
        {413, "Payload Too Large"},
        {415, "Unsupported Media Type"},
        {429, "Too Many Requests"},
        {431, "Request Header Fields Too Large"},
        {499, "Client Closed Request"},
        {500, "Internal Server Error"},
        {501, "Not Implemented"},
        {503, "Service Unavailable"},
        {504, "Gateway Timeout"},
    };
    for (size_t i = 0; i < sizeof reasons / sizeof *reasons; i++)
        if (reasons[i].status == status) return reasons[i].reason;
    return "Unknown";
}

/* ---------------------------------------------------------------- headers */

static bool field_is(const struct phr_header *h, const char *name)
{
    return h->name && h->name_len == strlen(name) && !strncasecmp(h->name, name, h->name_len);
}

/* Whether the header's value contains token (case-insensitive), as a substring. */
static bool field_has(const struct phr_header *h, const char *token)
{
    size_t n = strlen(token);
    for (size_t i = 0; i + n <= h->value_len; i++)
        if (!strncasecmp(h->value + i, token, n)) return true;
    return false;
}

/* Transfer-Encoding (RFC 9112 §6.1), over all its header lines: a comma-separated list of
 * codings, the last applied last. A body is chunked only when chunked is the final coding; kvmesh
 * decodes no other coding. Elements are compared whole (no substring: "notchunked" is not
 * chunked), empty ones skipped as RFC 9110 §5.6.1 asks. */
typedef struct te_list {
    int codings, chunked; /* how many, how many of them chunked */
    bool last_chunked, unknown;
} te_list;

static void te_scan(const struct phr_header *h, te_list *te)
{
    const char *p = h->value, *end = h->value + h->value_len;
    while (p < end) {
        const char *comma = memchr(p, ',', (size_t)(end - p)), *e = comma ? comma : end;
        const char *a = p, *b = e;
        while (a < b && (*a == ' ' || *a == '\t')) a++;
        while (b > a && (b[-1] == ' ' || b[-1] == '\t')) b--;
        if (b > a) {
            bool is_chunked = b - a == 7 && !strncasecmp(a, "chunked", 7);
            te->codings++;
            te->chunked += is_chunked;
            te->unknown |= !is_chunked;
            te->last_chunked = is_chunked;
        }
        p = comma ? comma + 1 : end;
    }
}

/* A Content-Length value: digits only, at most 19 of them. */
static int parse_length(const struct phr_header *h, size_t *out)
{
    if (h->value_len == 0 || h->value_len > 19) return -1;
    size_t v = 0;
    for (size_t i = 0; i < h->value_len; i++) {
        if (h->value[i] < '0' || h->value[i] > '9') return -1;
        v = v * 10 + (size_t)(h->value[i] - '0');
    }
    *out = v;
    return 0;
}

/* ---------------------------------------------------------------- requests */

static int refuse(km_http_request *out, int status, const char *message)
{
    km_buf_free(&out->body);
    out->status = status;
    out->message = message;
    return KM_EPROTO;
}

/* ---------------------------------------------------------------- chunked bodies */

_Static_assert(sizeof(struct phr_chunked_decoder) <= sizeof(((km_http_chunked *)0)->dec),
               "km_http_chunked.dec holds picohttpparser's decoder");

void km_http_chunked_init(km_http_chunked *d, const km_http_limits *lim)
{
    memset(d, 0, sizeof *d);
    struct phr_chunked_decoder *pd = (struct phr_chunked_decoder *)d->dec.bytes;
    pd->consume_trailer = 1;
    d->max_body = lim->max_body;
    /* the framing of many small chunks is not free either */
    d->max_raw = lim->max_head + lim->max_body + 64;
}

void km_http_chunked_free(km_http_chunked *d)
{
    km_buf_free(&d->body);
}

static int chunked_refuse(km_http_chunked *d, int status, const char *message)
{
    km_buf_free(&d->body);
    d->status = status;
    d->message = message;
    return KM_EPROTO;
}

int km_http_chunked_feed(km_http_chunked *d, const char *buf, size_t len, size_t *taken)
{
    *taken = 0;
    if (d->status) return KM_EPROTO;
    if (len == 0) return 0;
    /* the new bytes are decoded in place behind what is already decoded */
    if (km_buf_reserve(&d->body, len)) return chunked_refuse(d, 500, "out of memory");
    char *at = (char *)d->body.data + d->body.len;
    memcpy(at, buf, len);
    struct phr_chunked_decoder *pd = (struct phr_chunked_decoder *)d->dec.bytes;
    size_t sz = len;
    ssize_t left = phr_decode_chunked(pd, at, &sz);
    if (left == -1) return chunked_refuse(d, 400, "malformed chunked body");
    size_t used = left >= 0 ? len - (size_t)left : len;
    d->body.len += sz;
    d->raw += used;
    /* over the limit already, or announced to be (the chunk being read is longer; its size
     * counts once all its digits are in, so the status does not depend on the split) */
    if (d->body.len > d->max_body ||
        (left == -2 && pd->_hex_count == 0 && pd->bytes_left_in_chunk > d->max_body - d->body.len))
        return chunked_refuse(d, 413, "request body too large");
    if (d->raw > d->max_raw) return chunked_refuse(d, 413, "request too large");
    *taken = used;
    return left >= 0;
}

/* Decodes the chunked body that starts at buf[head]: the bytes taken (> 0), 0 incomplete, or a
 * refusal. */
static int chunked_body(const char *buf, size_t len, const km_http_limits *lim,
                        km_http_request *out)
{
    km_http_chunked d;
    km_http_chunked_init(&d, lim);
    size_t head = out->head_len, taken;
    int rc = km_http_chunked_feed(&d, buf + head, len - head, &taken);
    if (rc < 0) return refuse(out, d.status, d.message);
    if (rc == 0) {
        km_http_chunked_free(&d);
        return 0;
    }
    km_buf_free(&out->body);
    out->body = d.body;
    return (int)(head + taken);
}

/* Whether a head picohttpparser refused failed only for having more than KM_HTTP_MAX_HEADERS
 * fields (431, not 400): parsed again with room for one field per line. Only on that error path. */
static bool too_many_headers(const char *buf, size_t len, const km_http_limits *lim)
{
    size_t scan = len < lim->max_head ? len : lim->max_head, lines = 0;
    for (size_t i = 0; i < scan; i++) lines += buf[i] == '\n';
    if (lines <= KM_HTTP_MAX_HEADERS) return false;
    struct phr_header *hs = malloc(lines * sizeof *hs);
    if (!hs) return false;
    const char *m, *p;
    size_t ml, pl, nh = lines;
    int minor;
    int rc = phr_parse_request(buf, scan, &m, &ml, &p, &pl, &minor, hs, &nh, 0);
    free(hs);
    return rc != -1;
}

/* What is taken must fit the int the parsers return. */
static km_http_limits clamp_limits(const km_http_limits *limits)
{
    km_http_limits l = *limits;
    if (l.max_head > (1u << 20)) l.max_head = 1u << 20;
    if (l.max_body > (1u << 30)) l.max_body = 1u << 30;
    return l;
}

static int parse_head(const char *buf, size_t len, const km_http_limits *lim, km_http_request *out)
{
    memset(out, 0, sizeof *out);
    struct phr_header hs[KM_HTTP_MAX_HEADERS];
    size_t nh = KM_HTTP_MAX_HEADERS;
    int hl = phr_parse_request(buf, len, &out->method, &out->method_len, &out->path, &out->path_len,
                               &out->minor_version, hs, &nh, 0);
    if (hl == -1)
        return too_many_headers(buf, len, lim) ? refuse(out, 431, "too many header fields")
                                               : refuse(out, 400, "malformed HTTP request");
    if (hl == -2 || (size_t)hl > lim->max_head) {
        if (hl == -2 && len < lim->max_head) return 0;
        return refuse(out, 431, "request head too large");
    }
    const char *q = memchr(out->path, '?', out->path_len);
    if (q) out->path_len = (size_t)(q - out->path);
    bool has_len = false;
    te_list te = {0};
    size_t clen = 0;
    out->keep_alive = out->minor_version >= 1;
    for (size_t i = 0; i < nh; i++) {
        out->headers[i] = (km_http_field){hs[i].name, hs[i].name_len, hs[i].value, hs[i].value_len};
        if (field_is(&hs[i], "content-length")) {
            size_t v;
            if (parse_length(&hs[i], &v) || (has_len && v != clen))
                return refuse(out, 400, "bad Content-Length");
            clen = v;
            has_len = true;
        } else if (field_is(&hs[i], "transfer-encoding")) {
            if (lim->max_body == 0) return refuse(out, 501, "request bodies are not supported");
            te_scan(&hs[i], &te);
            te.codings += !te.codings; /* a header line, even an empty one, announces a coding */
        } else if (field_is(&hs[i], "connection")) {
            if (field_has(&hs[i], "close")) out->keep_alive = false;
            if (field_has(&hs[i], "keep-alive")) out->keep_alive = true;
        } else if (field_is(&hs[i], "expect")) {
            out->expect_continue = field_has(&hs[i], "100-continue");
        }
    }
    out->n_headers = nh;
    out->head_len = (size_t)hl;
    bool chunked = te.codings > 0;
    if (chunked) {
        /* RFC 9112 §6.1: unknown codings 501; chunked other than once and last 400; and a
         * Transfer-Encoding in HTTP/1.0 means faulty framing */
        if (te.unknown) return refuse(out, 501, "unsupported Transfer-Encoding (only chunked)");
        if (te.chunked != 1 || !te.last_chunked)
            return refuse(out, 400, "chunked must be the final transfer coding, once");
        if (out->minor_version == 0) return refuse(out, 400, "Transfer-Encoding in HTTP/1.0");
    }
    if (chunked && has_len) return refuse(out, 400, "both Content-Length and chunked");
    if (clen > lim->max_body)
        return refuse(out, 413,
                      lim->max_body ? "request body too large"
                                    : "request bodies are not supported");
    out->chunked = chunked;
    out->content_length = clen;
    return hl;
}

int km_http_parse_head(const char *buf, size_t len, const km_http_limits *limits,
                       km_http_request *out)
{
    km_http_limits l = clamp_limits(limits);
    return parse_head(buf, len, &l, out);
}

int km_http_parse_request(const char *buf, size_t len, const km_http_limits *limits,
                          km_http_request *out)
{
    km_http_limits l = clamp_limits(limits);
    int hl = parse_head(buf, len, &l, out);
    if (hl <= 0) return hl;
    if (out->chunked) return chunked_body(buf, len, &l, out);
    size_t clen = out->content_length;
    if (len - (size_t)hl < clen) return 0;
    if (clen && km_buf_append(&out->body, buf + hl, clen)) return refuse(out, 500, "out of memory");
    return hl + (int)clen;
}

const char *km_http_request_header(const km_http_request *r, const char *name, size_t *len)
{
    size_t n = strlen(name);
    for (size_t i = 0; i < r->n_headers; i++) {
        const km_http_field *f = &r->headers[i];
        if (f->name && f->name_len == n && !strncasecmp(f->name, name, n)) {
            if (len) *len = f->value_len;
            return f->value;
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- responses */

int km_http_parse_response(const char *buf, size_t len, int *status, km_buf *body, km_errbuf *err)
{
    km_buf_reset(body);
    struct phr_header hs[KM_HTTP_MAX_HEADERS];
    size_t nh = KM_HTTP_MAX_HEADERS, msg_len;
    const char *msg;
    int minor;
    int hl = phr_parse_response(buf, len, &minor, status, &msg, &msg_len, hs, &nh, 0);
    if (hl == -1) return km_errf(err, KM_EPROTO, "not an HTTP response");
    if (hl == -2) return km_errf(err, KM_EPROTO, "the response ended inside its head");
    if (*status < 100) return km_errf(err, KM_EPROTO, "no HTTP status has %03d", *status);
    bool has_len = false;
    te_list te = {0};
    size_t clen = 0;
    for (size_t i = 0; i < nh; i++) {
        if (field_is(&hs[i], "transfer-encoding")) {
            te_scan(&hs[i], &te);
        } else if (field_is(&hs[i], "content-length")) {
            if (parse_length(&hs[i], &clen)) return km_errf(err, KM_EPROTO, "bad Content-Length");
            has_len = true;
        }
    }
    size_t rest = len - (size_t)hl;
    /* RFC 9112 §6.3: chunked only as the final coding; any other coding is read to the end */
    bool chunked = te.last_chunked;
    if (te.codings) has_len = false;
    if (chunked) {
        if (km_buf_append(body, buf + hl, rest)) return km_errf(err, KM_ENOMEM, "out of memory");
        struct phr_chunked_decoder dec;
        memset(&dec, 0, sizeof dec);
        dec.consume_trailer = 1;
        size_t sz = body->len;
        ssize_t left = phr_decode_chunked(&dec, (char *)body->data, &sz);
        body->len = left == -1 ? 0 : sz;
        if (left == -1) return km_errf(err, KM_EPROTO, "malformed chunked body");
        if (left == -2)
            return km_errf(err, KM_EPROTO, "the chunked body ended after %zu bytes, inside a chunk",
                           sz);
        return 0;
    }
    if (has_len && rest < clen)
        return km_errf(err, KM_EPROTO, "the body ended after %zu of its %zu bytes", rest, clen);
    size_t n = has_len ? clen : rest;
    if (n && km_buf_append(body, buf + hl, n)) return km_errf(err, KM_ENOMEM, "out of memory");
    return 0;
}
