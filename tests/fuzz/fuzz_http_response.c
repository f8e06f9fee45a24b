/*
 * fuzz_http_response.c — libFuzzer target for the HTTP response parser of libkvmesh's
 * kvm_http_get (km_http_parse_response, common/http_parse.c, on picohttpparser).
 *
 * Feeds arbitrary bytes as everything a server sent before closing. A hand-written parser used to
 * read past its buffer on a chunk longer than what arrived (the corpus keeps that input); here
 * ASan/UBSan watch every read, and the checks hold the promises: success means a status in
 * [100, 999] and a body no longer than the input; failure says why.
 */
#include <stdlib.h>

#include "common/http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    km_buf body = {0};
    km_errbuf err = {{0}};
    int status = 0;
    int rc = km_http_parse_response((const char *)data, size, &status, &body, &err);
    if (rc == 0 && (status < 100 || status > 999 || body.len > size)) abort();
    if (rc != 0 && !err.msg[0]) abort();
    km_buf_free(&body);
    return 0;
}
