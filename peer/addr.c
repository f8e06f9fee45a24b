/*
 * addr.c — the node address (pr_node_address): what a peer needs to connect to this node and to
 * read its registered memory. It reaches other processes through heartbeats and the
 * controller's view, so it is parsed like any input from the network: every length checked
 * against what remains, nothing read outside the buffer (tests/fuzz/fuzz_peeraddr.c).
 *
 * Little-endian:
 *   0  "KVMPEER1"   8 u32 version (1)   12 u32 port   16 u32 host length (< 64)   20 host
 *   then u32 n_regions (<= 4), and per region: u64 base, u64 bytes, u32 rkey length (<= 4096),
 *   the packed remote key (opaque to everyone but the back end that packed it).
 */
#include <string.h>

#include "peer/internal.h"

#define PR_ADDR_MAGIC   "KVMPEER1"
#define PR_ADDR_VERSION 1
#define PR_RKEY_MAX     4096

static void pr_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void pr_put64(uint8_t *p, uint64_t v)
{
    pr_put32(p, (uint32_t)v);
    pr_put32(p + 4, (uint32_t)(v >> 32));
}

static uint32_t pr_get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t pr_get64(const uint8_t *p)
{
    return pr_get32(p) | (uint64_t)pr_get32(p + 4) << 32;
}

size_t pr_addr_size(const pr_addr *a)
{
    size_t hl = strnlen(a->host, PR_ADDR_HOST);
    if (hl >= PR_ADDR_HOST || a->port < 0 || a->port > 65535 || a->n_regions < 0 ||
        a->n_regions > PR_MAX_REGIONS)
        return 0;
    size_t n = 20 + hl + 4;
    for (int i = 0; i < a->n_regions; i++) {
        if (a->region[i].rkey_len > PR_RKEY_MAX) return 0;
        n += 20 + a->region[i].rkey_len;
    }
    return n;
}

size_t pr_addr_encode(const pr_addr *a, uint8_t *buf, size_t cap)
{
    size_t n = pr_addr_size(a);
    if (!n || cap < n) return 0;
    size_t hl = strlen(a->host);
    memcpy(buf, PR_ADDR_MAGIC, 8);
    pr_put32(buf + 8, PR_ADDR_VERSION);
    pr_put32(buf + 12, (uint32_t)a->port);
    pr_put32(buf + 16, (uint32_t)hl);
    memcpy(buf + 20, a->host, hl);
    uint8_t *p = buf + 20 + hl;
    pr_put32(p, (uint32_t)a->n_regions);
    p += 4;
    for (int i = 0; i < a->n_regions; i++) {
        pr_put64(p, a->region[i].base);
        pr_put64(p + 8, a->region[i].bytes);
        pr_put32(p + 16, (uint32_t)a->region[i].rkey_len);
        if (a->region[i].rkey_len) memcpy(p + 20, a->region[i].rkey, a->region[i].rkey_len);
        p += 20 + a->region[i].rkey_len;
    }
    return n;
}

int pr_addr_parse(const uint8_t *buf, size_t len, pr_addr *out)
{
    memset(out, 0, sizeof *out);
    if (!buf || len < 24 || memcmp(buf, PR_ADDR_MAGIC, 8) || pr_get32(buf + 8) != PR_ADDR_VERSION)
        return KM_EFORMAT;
    uint32_t port = pr_get32(buf + 12), hl = pr_get32(buf + 16);
    if (port > 65535 || hl == 0 || hl >= PR_ADDR_HOST || len - 20 < (size_t)hl + 4)
        return KM_EFORMAT;
    memcpy(out->host, buf + 20, hl);
    if (memchr(out->host, 0, hl)) return KM_EFORMAT;
    out->port = (int)port;
    const uint8_t *p = buf + 20 + hl, *end = buf + len;
    uint32_t nr = pr_get32(p);
    p += 4;
    if (nr > PR_MAX_REGIONS) return KM_EFORMAT;
    for (uint32_t i = 0; i < nr; i++) {
        if ((size_t)(end - p) < 20) return KM_EFORMAT;
        uint64_t base = pr_get64(p), bytes = pr_get64(p + 8);
        uint32_t rl = pr_get32(p + 16);
        p += 20;
        if (rl > PR_RKEY_MAX || (size_t)(end - p) < rl || bytes == 0 || base + bytes < base)
            return KM_EFORMAT;
        out->region[i].base = base;
        out->region[i].bytes = bytes;
        out->region[i].rkey = p;
        out->region[i].rkey_len = rl;
        p += rl;
    }
    if (p != end) return KM_EFORMAT;
    out->n_regions = (int)nr;
    return 0;
}
