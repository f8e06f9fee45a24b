/*
 * http_tls.h — TLS for the HTTP server (http_server.c, `--tls-cert/--tls-key` on the router's
 * OpenAI front), on OpenSSL through memory BIOs: the server's libuv loop keeps the socket, this
 * layer only turns the bytes read into plaintext and the plaintext written into records.
 *
 * Contract:
 *  - A context holds one certificate chain and key (PEM), TLS 1.2 or later; a context whose
 *    files cannot be read, or whose key does not match its certificate, is refused with the
 *    file and OpenSSL's reason.
 *  - km_tls_feed never blocks: it takes every byte given, appends what decrypts to *plain and
 *    what must go back to the client (handshake, alerts) to *out, and returns KM_EIO on a
 *    handshake or record failure (the connection then closes; *why says why, for the log) and
 *    1 once the client's close_notify arrived (an end of stream, like a TCP EOF).
 *  - km_tls_seal appends to *out the records carrying plain; only after the handshake.
 *  - Single-threaded per connection, like the loop that calls it.
 */
#ifndef KM_HTTP_TLS_H
#define KM_HTTP_TLS_H

#include <stddef.h>

#include "common/km.h"

typedef struct km_tls_ctx km_tls_ctx;
typedef struct km_tls km_tls;

int km_tls_ctx_new(const char *cert_file, const char *key_file, km_tls_ctx **out, km_errbuf *err);
void km_tls_ctx_free(km_tls_ctx *ctx);

km_tls *km_tls_new(km_tls_ctx *ctx); /* NULL when out of memory */
void km_tls_free(km_tls *t);

int km_tls_feed(km_tls *t, const void *data, size_t len, km_buf *plain, km_buf *out,
                const char **why);
int km_tls_seal(km_tls *t, const void *plain, size_t len, km_buf *out);
/* 1 once the handshake is done. */
int km_tls_ready(const km_tls *t);

#endif
