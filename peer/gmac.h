/*
 * gmac.h — GHASH with 512-bit carry-less multiplication (gmac.c), for seal.c's GMAC: the
 * authenticator of AES-GCM over data it does not encrypt. pr_gmac_fast() says whether this CPU
 * has it; the tag is E_K(J0) xor the value pr_gmac_end writes (seal.c adds that part).
 */
#ifndef PEER_GMAC_H
#define PEER_GMAC_H

#include <stddef.h>
#include <stdint.h>

#define PR_GMAC_POWERS 32 /* blocks hashed per round */

/* The hash key H = E_K(0^128) as its powers H^32 .. H^1 (pow[0] is H^32), in gmac.c's form. */
typedef struct pr_gmac_key {
    uint8_t pow[PR_GMAC_POWERS][16];
} pr_gmac_key;

/* One message: the running hash, a block begun and the bytes so far. */
typedef struct pr_gmac {
    uint8_t acc[16], buf[16];
    unsigned nbuf;
    uint64_t len;
} pr_gmac;

int pr_gmac_fast(
    void); /* 1 when this CPU has AVX-512 and VPCLMULQDQ (nothing else may be called) */
void pr_gmac_key_init(pr_gmac_key *k, const uint8_t h_block[16]);
void pr_gmac_begin(pr_gmac *g);
/* The next len bytes of the authenticated data (any length; pieces join as one message). */
void pr_gmac_update(pr_gmac *g, const pr_gmac_key *k, const uint8_t *in, size_t len);
/* GHASH of the data and its lengths block, in GCM's byte order. */
void pr_gmac_end(pr_gmac *g, const pr_gmac_key *k, uint8_t s[16]);

#endif
