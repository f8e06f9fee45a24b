/*
 * fuzz_peeraddr.c — libFuzzer target for the node address a peer connects with (peer/addr.c):
 * it comes from other processes (heartbeats, the controller's view), so whatever the bytes,
 * pr_addr_parse returns an error or an address whose host is a NUL-terminated string and whose
 * remote keys lie inside the buffer, and never reads outside it. A parsed address re-encodes to
 * the same bytes. Seeds: tests/fuzz/corpus/fuzz_peeraddr/ (addresses with 0 to 2 regions).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "peer/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    pr_addr a;
    if (pr_addr_parse(buf, size, &a) == 0) {
        if (strnlen(a.host, sizeof a.host) >= sizeof a.host) abort();
        for (int i = 0; i < a.n_regions; i++)
            if (a.region[i].rkey < buf || a.region[i].rkey + a.region[i].rkey_len > buf + size)
                abort();
        size_t n = pr_addr_size(&a);
        uint8_t *out = malloc(n ? n : 1);
        if (!out || n != size || pr_addr_encode(&a, out, n) != n || memcmp(out, buf, n)) abort();
        free(out);
    }
    free(buf);
    return 0;
}
