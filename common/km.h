/*
 * km.h — the common layer every kvmesh process links: errors, byte buffers, string views, logging,
 * clocks and the page-hash chain. (Model formats live in model/model.h.)
 *
 * Contract:
 *  - Every function that can fail returns 0 (or a count) on success and a negative km_err on
 *    failure; when the caller passes a km_errbuf, it receives a one-line message with context.
 *  - Nothing here exits or aborts on input that came from outside (files, sockets, users).
 *  - The only global state is the logger's level and format.
 */
#ifndef KM_H
#define KM_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

typedef enum km_err {
    KM_OK = 0,
    KM_EINVAL = -1,       /* bad argument or value */
    KM_ENOMEM = -2,       /* allocation failed */
    KM_EIO = -3,          /* read/write/open failed */
    KM_EFORMAT = -4,      /* malformed input (file, frame) */
    KM_ERANGE = -5,       /* value out of the accepted range */
    KM_ENOSPC = -6,       /* a pool or buffer is full: caller may evict, preempt or retry */
    KM_ENOTFOUND = -7,    /* key, tensor, page or id does not exist */
    KM_EUNSUPPORTED = -8, /* well-formed but not supported (architecture, tensor type) */
    KM_EAGAIN = -9,       /* try again later */
    KM_ETIMEDOUT = -10,   /* a deadline passed */
    KM_EPROTO = -11,      /* protocol violation */
    KM_EOVERLOAD = -12,   /* refused because of load */
    KM_ECANCELED = -13,   /* canceled by request */
    KM_ECORRUPT = -14,    /* checksum or consistency failure */
    KM_EACCES = -15,      /* authenticated, but not allowed (wrong role or identity): 403 */
} km_err;

const char *km_strerror(int err);

/* A caller-owned buffer for a one-line error message with context. */
typedef struct km_errbuf {
    char msg[512];
} km_errbuf;

/* Writes the formatted message into err (when not NULL) and returns code: `return km_errf(...)`. */
int km_errf(km_errbuf *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---------------------------------------------------------------- growable byte buffer (buf.c) */

/* Zero-initialise ({0}) before first use; km_buf_free releases the bytes. */
typedef struct km_buf {
    uint8_t *data;
    size_t len, cap;
} km_buf;

int km_buf_reserve(km_buf *b, size_t extra); /* room for `extra` more bytes */
int km_buf_append(km_buf *b, const void *p, size_t n);
int km_buf_printf(km_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void km_buf_reset(km_buf *b); /* len = 0, keeps the allocation */
void km_buf_free(km_buf *b);

/* ---------------------------------------------------------------- string views */

/* A string view (e.g. inside a file): not NUL-terminated. */
typedef struct km_str {
    const char *ptr;
    uint64_t len;
} km_str;

/* ---------------------------------------------------------------- logging */

typedef enum km_log_level { KM_LOG_DEBUG = 0, KM_LOG_INFO, KM_LOG_WARN, KM_LOG_ERROR } km_log_level;

void km_log_set_level(km_log_level level);
/* "text" (key=value, the default) or "json"; returns KM_EINVAL for anything else. */
int km_log_set_format(const char *format);
/* Parses "debug", "info", "warn", "error"; returns KM_EINVAL for anything else. */
int km_log_parse_level(const char *s, km_log_level *out);
/* One line per event to stderr: ts=... level=... event=EVENT then the key=value pairs in fmt.
 * fmt must itself be key=value pairs separated by spaces, e.g. "path=%s bytes=%zu". */
void km_log(km_log_level level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define KM_DEBUG(ev, ...) km_log(KM_LOG_DEBUG, ev, __VA_ARGS__)
#define KM_INFO(ev, ...)  km_log(KM_LOG_INFO, ev, __VA_ARGS__)
#define KM_WARN(ev, ...)  km_log(KM_LOG_WARN, ev, __VA_ARGS__)
#define KM_ERROR(ev, ...) km_log(KM_LOG_ERROR, ev, __VA_ARGS__)

/* ---------------------------------------------------------------- time */

uint64_t km_now_ns(void);  /* CLOCK_MONOTONIC */
uint64_t km_wall_ms(void); /* CLOCK_REALTIME, Unix ms */
void km_sleep_ms(int ms);  /* sleeps ms milliseconds, resuming after signals */

#ifdef __cplusplus
}
#endif
#endif /* KM_H */

/* ---------------------------------------------------------------- page-hash chain
 *
 * The identity of a KV page, shared by router and worker (common/pagehash.c):
 *   h[-1] = XXH3_128("kvmesh-pagehash-v1" ‖ u64le(len fp) ‖ fp ‖ u64le(cluster_seed)
 *                    ‖ u64le(len salt) ‖ salt)
 *   h[i]  = XXH3_128(canonical(h[i-1]) ‖ i32le(tokens of page i))
 * where fp is the model fingerprint, salt the request's cache_salt (tenant isolation: different
 * salts give unrelated chains) and canonical() the 16-byte big-endian form (XXH128 canonical),
 * which is also how hashes travel in KV events. Only full pages are hashed.
 */
#ifndef KM_PAGEHASH_H
#define KM_PAGEHASH_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_pagehash {
    uint64_t lo, hi; /* XXH128_hash_t low64 / high64 */
} km_pagehash;

/* h[-1]: fp may be NULL (len 0), salt may be NULL (same as ""). */
km_pagehash km_pagehash_seed(const void *model_fp, size_t fp_len, uint64_t cluster_seed,
                             const char *salt, size_t salt_len);
/* h[i] from h[i-1] and the n tokens of page i. */
km_pagehash km_pagehash_next(km_pagehash prev, const int32_t *tokens, int n);
/* The seed of a tenant's chunk chains (reusable chunks, docs/blend.md) from its prefix seed:
 * the seed hashed with one id no page holds, so no prefix chain reaches it. Workers
 * (en_blend_chunk_seed) and routers (their chunk credit) must agree on it, and on the text each
 * chunk is computed after, whose first page of tokens starts every chunk chain. */
km_pagehash km_pagehash_chunk_seed(km_pagehash tenant_seed);
#define KM_CHUNK_PREAMBLE                                                                          \
    "The text below is one of several documents retrieved for the question that follows them all."

/* Hashes of the full pages of tokens[0, n_tokens): writes min(n_tokens / page_tokens, max_out)
 * hashes and returns that count (KM_EINVAL on bad arguments). */
int km_pagehash_chain(km_pagehash seed, const int32_t *tokens, int n_tokens, int page_tokens,
                      km_pagehash *out, int max_out);
int km_pagehash_eq(km_pagehash a, km_pagehash b);
/* 16-byte big-endian form and back; 32 hex digits + NUL. */
void km_pagehash_canonical(km_pagehash h, uint8_t out[16]);
km_pagehash km_pagehash_from_canonical(const uint8_t in[16]);
void km_pagehash_hex(km_pagehash h, char out[33]);

#ifdef __cplusplus
}
#endif
#endif /* KM_PAGEHASH_H */
