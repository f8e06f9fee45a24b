/*
 * fuzz_sparse_shares.c — libFuzzer target for the sparse budget-shares file reader
 * (engine/sparse_shares.c): the file comes from an operator's disk, so whatever the bytes,
 * en_sparse_shares_parse returns KM_EINVAL with a message, or a table for its 4 x 2 model shape
 * whose every share is finite, in range and not all zero, and never reads outside the buffer.
 * Seeds: tests/fuzz/corpus/fuzz_sparse_shares/ (a good table, comments, bad shares).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    float s[8];
    km_errbuf err = {{0}};
    const int rc = en_sparse_shares_parse(buf, size, 4, 2, s, &err);
    if (rc == 0) {
        double sum = 0;
        for (int i = 0; i < 8; i++) {
            if (!isfinite(s[i]) || s[i] < 0 || s[i] > 1e6f) abort();
            sum += s[i];
        }
        if (!(sum > 0)) abort();
    } else if (rc != KM_EINVAL || !err.msg[0]) {
        abort();
    }
    free(buf);
    return 0;
}
