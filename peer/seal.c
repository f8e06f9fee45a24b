/*
 * seal.c — what binds the page plane to a lease (docs/transfer.md, "Who may read a page"): the
 * lease secret a holder draws for each lease and sends to its puller over the CURVE channel
 * with the offer, the fetch token derived from it that every fetch and every answer carries,
 * and the AES-256-GCM key under which each answer's bytes are authenticated (GMAC: the bytes
 * travel as they are, the tag in the header) or encrypted. Only the two ends of the lease know
 * the secret, so a process that reaches the UCX port without it can neither read a page (its
 * fetches match no lease) nor plant one (its bytes fail their tag), and one that saw a token
 * on the wire still cannot forge a tag.
 *
 * A nonce is never used for two different messages under one key: it holds the page index,
 * the fragment's offset and length and whether it is encrypted, and a lease's page does not
 * change while the lease lasts, so a fetch answered twice sends the same bytes twice.
 * OpenSSL's GCM (AES-NI and carry-less multiplication) authenticates several times faster
 * than libsodium's Poly1305 or BLAKE2b on the CPUs this runs on (docs/transfer.md, "Measured");
 * where the CPU has VPCLMULQDQ, the tag of an unencrypted message is computed by gmac.c's
 * GHASH instead (the same tag, fewer cycles), the AES blocks it needs by OpenSSL.
 */
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <sodium.h>

#include "peer/ucx_internal.h"

void pr_lease_secret(uint8_t key[PR_KEY_BYTES])
{
    randombytes_buf(key, PR_KEY_BYTES);
}

void pr_key_derive(const uint8_t key[PR_KEY_BYTES], uint8_t token[PR_TOKEN_BYTES],
                   uint8_t page_key[PR_KEY_BYTES])
{
    static const char t[] = "kvmesh fetch token", k[] = "kvmesh page key";
    crypto_generichash(token, PR_TOKEN_BYTES, (const uint8_t *)t, sizeof t - 1, key, PR_KEY_BYTES);
    crypto_generichash(page_key, PR_KEY_BYTES, (const uint8_t *)k, sizeof k - 1, key, PR_KEY_BYTES);
}

int pr_token_eq(const uint8_t *a, const uint8_t *b)
{
    return CRYPTO_memcmp(a, b, PR_TOKEN_BYTES) == 0;
}

static void pr_nonce(const pr_data_hdr *h, uint8_t iv[12])
{
    const uint32_t w[3] = {(h->index & 0xffffu) | ((h->flags & 0xffu) << 16), (uint32_t)h->offset,
                           h->len};
    memcpy(iv, w, sizeof w);
}

int pr_seal_init(pr_seal *s)
{
    memset(s, 0, sizeof *s);
    /* KVMESH_PEER_GHASH=openssl: OpenSSL's GHASH only (bench_transfer compares the two) */
    const char *gh = getenv("KVMESH_PEER_GHASH");
    s->fast = pr_gmac_fast() && !(gh && !strcmp(gh, "openssl"));
    s->ctx = EVP_CIPHER_CTX_new();
    s->ecb = s->fast ? EVP_CIPHER_CTX_new() : NULL;
    if (s->ctx && (!s->fast || s->ecb)) return 0;
    pr_seal_free(s);
    return KM_ENOMEM;
}

void pr_seal_free(pr_seal *s)
{
    EVP_CIPHER_CTX_free(s->ctx);
    EVP_CIPHER_CTX_free(s->ecb);
    s->ctx = s->ecb = NULL;
}

/* gmac.c's message: H's powers when the key changes, E_K(J0) for every message. */
static int pr_seal_begin_gmac(pr_seal *s, const uint8_t page_key[PR_KEY_BYTES],
                              const uint8_t iv[12])
{
    int ol = 0;
    if (!s->gk_keyed || memcmp(s->gk_key, page_key, PR_KEY_BYTES)) {
        static const uint8_t zero[16];
        uint8_t h[16];
        s->gk_keyed = 0;
        if (EVP_EncryptInit_ex(s->ecb, EVP_aes_256_ecb(), NULL, page_key, NULL) != 1 ||
            EVP_CIPHER_CTX_set_padding(s->ecb, 0) != 1 ||
            EVP_EncryptUpdate(s->ecb, h, &ol, zero, 16) != 1 || ol != 16)
            return KM_EIO;
        pr_gmac_key_init(&s->gk, h);
        memcpy(s->gk_key, page_key, PR_KEY_BYTES);
        s->gk_keyed = 1;
    }
    uint8_t j0[16] = {0};
    memcpy(j0, iv, 12);
    j0[15] = 1;
    if (EVP_EncryptUpdate(s->ecb, s->ekj0, &ol, j0, 16) != 1 || ol != 16) return KM_EIO;
    pr_gmac_begin(&s->g);
    s->gm = 1;
    return 0;
}

int pr_seal_begin(pr_seal *s, const uint8_t page_key[PR_KEY_BYTES], const pr_data_hdr *h, int open)
{
    uint8_t iv[12];
    pr_nonce(h, iv);
    s->open = open;
    s->enc = (h->flags & PR_DATA_ENCRYPTED) != 0;
    s->gm = 0;
    if (!s->enc && s->fast) return pr_seal_begin_gmac(s, page_key, iv);
    /* the key schedule is kept while the key stays (the fragments of one lease): only the
     * nonce changes */
    const int same = s->keyed && s->keyed_open == open && !memcmp(s->key, page_key, PR_KEY_BYTES);
    const EVP_CIPHER *c = same ? NULL : EVP_aes_256_gcm();
    const uint8_t *k = same ? NULL : page_key;
    s->keyed = 0;
    if ((open ? EVP_DecryptInit_ex(s->ctx, c, NULL, k, iv)
              : EVP_EncryptInit_ex(s->ctx, c, NULL, k, iv)) != 1)
        return KM_EIO;
    memcpy(s->key, page_key, PR_KEY_BYTES);
    s->keyed = 1;
    s->keyed_open = open;
    return 0;
}

int pr_seal_update(pr_seal *s, const void *in, void *out, size_t len)
{
    int ol = 0;
    if (s->gm) {
        pr_gmac_update(&s->g, &s->gk, in, len);
        return 0;
    }
    if (len > INT32_MAX) return KM_EINVAL;
    uint8_t *to = s->enc ? out : NULL; /* GMAC: the bytes go in as additional data */
    int ok = s->open ? EVP_DecryptUpdate(s->ctx, to, &ol, in, (int)len)
                     : EVP_EncryptUpdate(s->ctx, to, &ol, in, (int)len);
    return ok == 1 ? 0 : KM_EIO;
}

int pr_seal_end(pr_seal *s, uint8_t tag[PR_TAG_BYTES])
{
    uint8_t rest[16];
    int ol = 0;
    if (s->gm) {
        pr_gmac_end(&s->g, &s->gk, rest);
        for (int i = 0; i < 16; i++) rest[i] ^= s->ekj0[i];
        if (!s->open) memcpy(tag, rest, PR_TAG_BYTES);
        return !s->open || CRYPTO_memcmp(rest, tag, PR_TAG_BYTES) == 0 ? 0 : KM_ECORRUPT;
    }
    if (s->open)
        return EVP_CIPHER_CTX_ctrl(s->ctx, EVP_CTRL_GCM_SET_TAG, PR_TAG_BYTES, tag) == 1 &&
                       EVP_DecryptFinal_ex(s->ctx, rest, &ol) == 1
                   ? 0
                   : KM_ECORRUPT;
    return EVP_EncryptFinal_ex(s->ctx, rest, &ol) == 1 &&
                   EVP_CIPHER_CTX_ctrl(s->ctx, EVP_CTRL_GCM_GET_TAG, PR_TAG_BYTES, tag) == 1
               ? 0
               : KM_EIO;
}
