/*
 * fuzz_http_request.c — libFuzzer target for the HTTP request parser every kvmesh server uses
 * (km_http_parse_request, common/http_parse.c, on picohttpparser).
 *
 * Feeds arbitrary bytes as a connection's buffer under the router's limits, tight ones and the
 * admin port's (no bodies). Beyond what ASan/UBSan catch, it checks the promises the server
 * relies on: a complete request takes no more than the buffer and is self-delimiting (parsing
 * exactly the bytes it took gives the same request), its body is within the limit, its path
 * within the buffer; a refusal names one of the statuses the server answers and frees the body;
 * "incomplete" owns nothing. The server's own path agrees: km_http_parse_head takes the same
 * head, and a chunked body fed to the incremental decoder in two pieces (cut where the input's
 * first byte says) decodes to the same bytes and ends at the same place.
 */
#include <stdlib.h>
#include <string.h>

#include "common/http.h"

static void check(const uint8_t *data, size_t size, const km_http_limits *lim)
{
    const char *buf = (const char *)data;
    km_http_request r;
    int n = km_http_parse_request(buf, size, lim, &r);
    if (n < 0) {
        if (r.status != 400 && r.status != 413 && r.status != 431 && r.status != 501 &&
            r.status != 500)
            abort();
        if (!r.message || r.body.data) abort();
        return;
    }
    if (n == 0) {
        if (r.body.data || r.head_len > size) abort();
        return;
    }
    if ((size_t)n > size || r.head_len > (size_t)n || r.body.len > lim->max_body) abort();
    if (r.path < buf || r.path + r.path_len > buf + size) abort();
    if (memchr(r.path, '?', r.path_len)) abort(); /* the query string is cut off */
    km_http_request head;
    if (km_http_parse_head(buf, size, lim, &head) != (int)r.head_len) abort();
    if (head.chunked) {
        size_t body = (size_t)n - r.head_len, cut = size ? data[0] % (body + 1) : 0, t1, t2 = 0;
        km_http_chunked d;
        km_http_chunked_init(&d, lim);
        int rc = km_http_chunked_feed(&d, buf + r.head_len, cut, &t1);
        if (rc == 0)
            rc = km_http_chunked_feed(&d, buf + r.head_len + cut, size - r.head_len - cut, &t2);
        if (rc != 1 || t1 + t2 != body || d.body.len != r.body.len ||
            (r.body.len && memcmp(d.body.data, r.body.data, r.body.len)))
            abort();
        km_http_chunked_free(&d);
    }
    km_http_request again;
    if (km_http_parse_request(buf, (size_t)n, lim, &again) != n) abort();
    if (again.body.len != r.body.len ||
        (r.body.len && memcmp(again.body.data, r.body.data, r.body.len)))
        abort();
    km_buf_free(&again.body);
    km_buf_free(&r.body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const km_http_limits router = {.max_head = 16384, .max_body = 4u << 20};
    const km_http_limits tight = {.max_head = 64, .max_body = 16};
    const km_http_limits admin = {.max_head = 8192, .max_body = 0};
    check(data, size, &router);
    check(data, size, &tight);
    check(data, size, &admin);
    return 0;
}
