/*
 * http_tls.c — TLS for the HTTP server on OpenSSL memory BIOs (http_tls.h). The socket stays
 * the libuv loop's: ciphertext read is written into the read BIO, the handshake and SSL_read run
 * over it, and whatever OpenSSL queued in the write BIO (handshake messages, records, alerts) is
 * handed back for the loop to write.
 */
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/http_tls.h"

/* The TLS 1.2 suites offered, best first (docs/security.md, "TLS"). */
#define TLS12_CIPHERS                                                                              \
    "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:"                                   \
    "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"                                   \
    "ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305"

struct km_tls_ctx {
    SSL_CTX *ssl;
};

struct km_tls {
    SSL *ssl;
    BIO *rbio, *wbio; /* owned by ssl */
};

static const char *tls_reason(void)
{
    unsigned long e = ERR_peek_last_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    return r ? r : "unknown error";
}

int km_tls_ctx_new(const char *cert_file, const char *key_file, km_tls_ctx **out, km_errbuf *err)
{
    *out = NULL;
    if (!cert_file || !*cert_file || !key_file || !*key_file)
        return km_errf(err, KM_EINVAL, "TLS needs both a certificate and a key file");
    km_tls_ctx *c = calloc(1, sizeof *c);
    if (!c || !(c->ssl = SSL_CTX_new(TLS_server_method()))) {
        free(c);
        return km_errf(err, KM_ENOMEM, "TLS: cannot create a context");
    }
    ERR_clear_error();
    int rc = 0;
    if (!SSL_CTX_set_min_proto_version(c->ssl, TLS1_2_VERSION))
        rc = km_errf(err, KM_EIO, "TLS: cannot require TLS 1.2: %s", tls_reason());
    else if (SSL_CTX_use_certificate_chain_file(c->ssl, cert_file) != 1)
        rc = km_errf(err, KM_EIO, "TLS certificate %s: %s", cert_file, tls_reason());
    else if (SSL_CTX_use_PrivateKey_file(c->ssl, key_file, SSL_FILETYPE_PEM) != 1)
        rc = ERR_GET_REASON(ERR_peek_last_error()) == X509_R_KEY_VALUES_MISMATCH
                 ? km_errf(err, KM_EINVAL, "TLS key %s does not match certificate %s", key_file,
                           cert_file)
                 : km_errf(err, KM_EIO, "TLS key %s: %s", key_file, tls_reason());
    else if (SSL_CTX_check_private_key(c->ssl) != 1)
        rc = km_errf(err, KM_EINVAL, "TLS key %s does not match certificate %s: %s", key_file,
                     cert_file, tls_reason());
    if (rc) {
        km_tls_ctx_free(c);
        return rc;
    }
    /* TLS 1.2 offers only forward-secret AEAD suites (ECDHE with AES-GCM or ChaCha20-Poly1305:
     * no static RSA key exchange, no CBC, no SHA-1 MACs); TLS 1.3's suites all are already. */
    if (SSL_CTX_set_cipher_list(c->ssl, TLS12_CIPHERS) != 1) {
        rc = km_errf(err, KM_EIO, "TLS: cannot set the TLS 1.2 cipher suites: %s", tls_reason());
        km_tls_ctx_free(c);
        return rc;
    }
    /* No renegotiation (TLS 1.2) and no session tickets to manage: each handshake is whole. */
    SSL_CTX_set_options(c->ssl, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_TICKET);
    SSL_CTX_set_session_cache_mode(c->ssl, SSL_SESS_CACHE_OFF);
    *out = c;
    return 0;
}

void km_tls_ctx_free(km_tls_ctx *ctx)
{
    if (!ctx) return;
    SSL_CTX_free(ctx->ssl);
    free(ctx);
}

km_tls *km_tls_new(km_tls_ctx *ctx)
{
    km_tls *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->ssl = SSL_new(ctx->ssl);
    t->rbio = BIO_new(BIO_s_mem());
    t->wbio = BIO_new(BIO_s_mem());
    if (!t->ssl || !t->rbio || !t->wbio) {
        BIO_free(t->rbio);
        BIO_free(t->wbio);
        SSL_free(t->ssl);
        free(t);
        return NULL;
    }
    SSL_set_bio(t->ssl, t->rbio, t->wbio);
    SSL_set_accept_state(t->ssl);
    return t;
}

void km_tls_free(km_tls *t)
{
    if (!t) return;
    SSL_free(t->ssl); /* and both BIOs */
    free(t);
}

int km_tls_ready(const km_tls *t)
{
    return t && SSL_is_init_finished(t->ssl);
}

/* Moves what OpenSSL queued for the client into out. */
static int tls_drain(km_tls *t, km_buf *out)
{
    size_t pending;
    while ((pending = BIO_ctrl_pending(t->wbio)) > 0) {
        if (km_buf_reserve(out, pending)) return KM_ENOMEM;
        int n = BIO_read(t->wbio, out->data + out->len, (int)pending);
        if (n <= 0) break;
        out->len += (size_t)n;
    }
    return 0;
}

int km_tls_feed(km_tls *t, const void *data, size_t len, km_buf *plain, km_buf *out,
                const char **why)
{
    *why = NULL;
    ERR_clear_error();
    const uint8_t *p = data;
    while (len) { /* a memory BIO takes everything */
        int n = BIO_write(t->rbio, p, len > INT32_MAX ? INT32_MAX : (int)len);
        if (n <= 0) {
            *why = "cannot buffer input";
            return KM_ENOMEM;
        }
        p += n;
        len -= (size_t)n;
    }
    int rc = 0;
    for (;;) {
        if (km_buf_reserve(plain, 16384)) {
            rc = KM_ENOMEM;
            break;
        }
        int n = SSL_read(t->ssl, plain->data + plain->len, (int)(plain->cap - plain->len));
        if (n > 0) {
            plain->len += (size_t)n;
            continue;
        }
        int e = SSL_get_error(t->ssl, n);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) break;
        if (e == SSL_ERROR_ZERO_RETURN) {
            rc = 1;
            break;
        }
        *why = e == SSL_ERROR_SSL ? tls_reason() : "connection error";
        rc = KM_EIO;
        break;
    }
    int drc = tls_drain(t, out); /* the handshake's answer, or an alert saying why */
    return rc ? rc : drc;
}

int km_tls_seal(km_tls *t, const void *plain, size_t len, km_buf *out)
{
    if (!SSL_is_init_finished(t->ssl)) return KM_EPROTO;
    const uint8_t *p = plain;
    while (len) {
        int n = SSL_write(t->ssl, p, len > INT32_MAX ? INT32_MAX : (int)len);
        if (n <= 0) return KM_EIO;
        p += n;
        len -= (size_t)n;
    }
    return tls_drain(t, out);
}
