/*
 * km.h — the common layer every kvmesh process links: errors, logging, clocks, the GGUF reader,
 * the ggml tensor-type table and the tokenizer.
 *
 * Contract:
 *  - Every function that can fail returns 0 (or a count) on success and a negative km_err on
 *    failure; when the caller passes a km_errbuf, it receives a one-line message with context.
 *  - Nothing here exits or aborts on input that came from outside (files, sockets, users). A
 *    broken GGUF file is an error code and a message, never a crash (fuzzed: tests/fuzz).
 *  - The GGUF reader never copies tensor data: tensors point into the read-only memory map, which
 *    lives until km_gguf_close.
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

/* ---------------------------------------------------------------- tensor types (ggml ids) */

typedef enum km_type {
    KM_TYPE_F32 = 0,
    KM_TYPE_F16 = 1,
    KM_TYPE_Q4_0 = 2,
    KM_TYPE_Q4_1 = 3,
    KM_TYPE_Q5_0 = 6,
    KM_TYPE_Q5_1 = 7,
    KM_TYPE_Q8_0 = 8,
    KM_TYPE_Q8_1 = 9,
    KM_TYPE_Q2_K = 10,
    KM_TYPE_Q3_K = 11,
    KM_TYPE_Q4_K = 12,
    KM_TYPE_Q5_K = 13,
    KM_TYPE_Q6_K = 14,
    KM_TYPE_Q8_K = 15,
    KM_TYPE_BF16 = 30,
    KM_TYPE_COUNT = 40,
} km_type;

/* Elements per block and bytes per block; 0 for ids that are unknown. */
int km_type_block_elems(uint32_t type);
int km_type_block_bytes(uint32_t type);
const char *km_type_name(uint32_t type); /* "Q4_1", ...; "unknown" */
/* Bytes of a row of n elements, or 0 when n is not a whole number of blocks or the type is
 * unknown. */
size_t km_type_row_bytes(uint32_t type, int64_t n);

/* ---------------------------------------------------------------- GGUF reader */

typedef enum km_gguf_type {
    KM_GGUF_UINT8 = 0,
    KM_GGUF_INT8 = 1,
    KM_GGUF_UINT16 = 2,
    KM_GGUF_INT16 = 3,
    KM_GGUF_UINT32 = 4,
    KM_GGUF_INT32 = 5,
    KM_GGUF_FLOAT32 = 6,
    KM_GGUF_BOOL = 7,
    KM_GGUF_STRING = 8,
    KM_GGUF_ARRAY = 9,
    KM_GGUF_UINT64 = 10,
    KM_GGUF_INT64 = 11,
    KM_GGUF_FLOAT64 = 12,
} km_gguf_type;

/* A string inside the file: not NUL-terminated. */
typedef struct km_str {
    const char *ptr;
    uint64_t len;
} km_str;

typedef struct km_gguf_tensor {
    km_str name;
    int n_dims;       /* 1..4 */
    int64_t ne[4];    /* elements per dimension, ne[0] is the row length; unused dims are 1 */
    uint32_t type;    /* km_type */
    uint64_t offset;  /* from the start of the data section */
    uint64_t size;    /* bytes */
    const void *data; /* into the map, aligned to the file's alignment */
} km_gguf_tensor;

typedef struct km_gguf km_gguf;

/* Maps and validates the whole file: header, every key/value, every tensor (type, shape, offset,
 * size inside the file, no overlap, alignment). */
int km_gguf_open(const char *path, km_gguf **out, km_errbuf *err);
/* Same over a caller's buffer, which must outlive the handle (used by the fuzz target). */
int km_gguf_open_memory(const void *data, size_t size, km_gguf **out, km_errbuf *err);
void km_gguf_close(km_gguf *g);

uint32_t km_gguf_version(const km_gguf *g);
int64_t km_gguf_n_kv(const km_gguf *g);
km_str km_gguf_key_at(const km_gguf *g, int64_t i);
/* Index of the key, or -1. */
int64_t km_gguf_find(const km_gguf *g, const char *key);
km_gguf_type km_gguf_kv_type(const km_gguf *g, int64_t i);

/* Typed getters by key. They return KM_ENOTFOUND when the key is absent and KM_EFORMAT when the
 * stored type does not fit (integers convert between widths when the value is in range). */
int km_gguf_get_u32(const km_gguf *g, const char *key, uint32_t *out);
int km_gguf_get_i64(const km_gguf *g, const char *key, int64_t *out);
int km_gguf_get_f32(const km_gguf *g, const char *key, float *out);
int km_gguf_get_bool(const km_gguf *g, const char *key, int *out);
int km_gguf_get_str(const km_gguf *g, const char *key, km_str *out);
/* Array metadata: element type and count. */
int km_gguf_get_arr(const km_gguf *g, const char *key, km_gguf_type *elem, uint64_t *n);
/* Element i of a string array (O(1): offsets are indexed at open). */
int km_gguf_arr_str(const km_gguf *g, const char *key, uint64_t i, km_str *out);
/* Raw little-endian data of a numeric array, or NULL (absent, or an array of strings/arrays). */
const void *km_gguf_arr_data(const km_gguf *g, const char *key);

int64_t km_gguf_n_tensors(const km_gguf *g);
const km_gguf_tensor *km_gguf_tensor_at(const km_gguf *g, int64_t i);
const km_gguf_tensor *km_gguf_find_tensor(const km_gguf *g, const char *name);
/* The whole file's bytes (for fingerprints). */
const void *km_gguf_file_data(const km_gguf *g, size_t *size);

/* ---------------------------------------------------------------- tokenizer */

/* Built from the GGUF's tokenizer.* metadata. Supports tokenizer.ggml.model "gpt2" (byte-level
 * BPE with the pre-tokenizer named by tokenizer.ggml.pre: smollm, llama3/llama-bpe, qwen2,
 * gpt2/default) and "llama" (SentencePiece-style BPE over scores, byte fallback). */
typedef struct km_tokenizer km_tokenizer;

int km_tok_create(const km_gguf *g, km_tokenizer **out, km_errbuf *err);
void km_tok_destroy(km_tokenizer *t);

int km_tok_n_vocab(const km_tokenizer *t);
int32_t km_tok_bos(const km_tokenizer *t); /* -1 when none */
int32_t km_tok_eos(const km_tokenizer *t);
int32_t km_tok_eot(const km_tokenizer *t); /* end-of-turn (<|im_end|>, <|eot_id|>), or -1 */
int km_tok_adds_bos(const km_tokenizer *t);
/* True for every end-of-generation token (eos, eot, and the other ids the vocabulary marks). */
int km_tok_is_eog(const km_tokenizer *t, int32_t id);
/* Looks up the id of an exact token text, -1 if none. */
int32_t km_tok_find(const km_tokenizer *t, const char *text);

/* Same semantics as llama.cpp's llama_tokenize: add_special adds BOS (and EOS) when the model
 * asks for it; parse_special turns special-token texts in `text` into their ids. Writes at most
 * max_out ids and returns the total count, which may exceed max_out (then call again with a
 * larger buffer); negative km_err on failure. */
int km_tok_encode(const km_tokenizer *t, const char *text, size_t len, int add_special,
                  int parse_special, int32_t *out, int max_out);

/* The bytes a token stands for (byte-level decoding done; special tokens give their text when
 * `special` is true and nothing otherwise). Returns the byte count, which may exceed cap (then
 * nothing useful was written); negative on a bad id. */
int km_tok_piece(const km_tokenizer *t, int32_t id, int special, char *buf, int cap);

/* Streaming detokenizer: emits only complete UTF-8 sequences, holding back a partial one until
 * the next token completes it. */
typedef struct km_detok {
    char pending[8];
    int n_pending;
} km_detok;

void km_detok_init(km_detok *d);
/* Appends the text of `id` to out (capacity cap, at least 64 + the longest token); returns bytes
 * written (>= 0) or a negative km_err. */
int km_detok_push(const km_tokenizer *t, km_detok *d, int32_t id, char *out, int cap);
/* Emits what is held back at the end of a stream (invalid bytes become U+FFFD). */
int km_detok_flush(km_detok *d, char *out, int cap);

/* Chat templates. */
typedef enum km_chat_kind {
    KM_CHAT_NONE = 0,
    KM_CHAT_CHATML = 1, /* <|im_start|>role\ncontent<|im_end|>\n (SmolLM2, Qwen2) */
    KM_CHAT_LLAMA3 = 2, /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
} km_chat_kind;

typedef struct km_chat_msg {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
} km_chat_msg;

/* Reads tokenizer.chat_template and recognises the family; KM_CHAT_NONE when unknown. */
km_chat_kind km_chat_detect(const km_gguf *g);
/* Parses "chatml" / "llama3"; KM_CHAT_NONE for anything else. */
km_chat_kind km_chat_parse(const char *name);
/* Renders the conversation (and the assistant header when add_assistant); for CHATML without a
 * system message and a default_system given, that system message is prepended (as SmolLM2's
 * template does). Returns the length needed (excluding NUL), which may exceed cap. */
int km_chat_apply(km_chat_kind kind, const km_chat_msg *msgs, int n, int add_assistant,
                  const char *default_system, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* KM_H */

/* ---------------------------------------------------------------- page-hash chain
 * (appended as its own guarded section so that other sections of km.h stay untouched)
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

/* ---------------------------------------------------------------- model metadata
 * (appended as its own guarded section; common/modelinfo.c)
 *
 * What a process that does not run a model needs of it (the router): its tokenizer, chat format,
 * display name and fingerprint, read from the GGUF's metadata and a sample of its bytes — never
 * its weight tensors, which are neither read nor checked. The worker's loader (worker/model.c)
 * names and fingerprints a model with the same functions, so a router's page-hash chain seeds
 * from the workers' fingerprint to the bit.
 */
#ifndef KM_MODELINFO_H
#define KM_MODELINFO_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_model_info km_model_info;

/* Opens the GGUF at path (memory-mapped) and builds its tokenizer. */
int km_model_info_open(const char *path, km_model_info **out, km_errbuf *err);
void km_model_info_close(km_model_info *m);
const km_tokenizer *km_model_info_tokenizer(const km_model_info *m);
km_chat_kind km_model_info_chat(const km_model_info *m); /* km_chat_detect of the file */
const char *km_model_info_name(const km_model_info *m);  /* km_model_display_name of the path */
const char *km_model_info_fingerprint(const km_model_info *m); /* 32 hex digits */

/* 128-bit fingerprint of a GGUF file (XXH3 over its first MiB and 64 KiB samples every 1/64 of
 * it, and its size), hex-encoded into out[33]. Seeds the page-hash chain, so KV of one model
 * never serves another. */
void km_model_fingerprint_hex(const km_gguf *g, char out[33]);
/* "SmolLM2-135M-Instruct.Q4_1" for ".../SmolLM2-135M-Instruct.Q4_1.gguf": the file name without
 * its directory and its ".gguf". */
void km_model_display_name(const char *path, char *out, size_t cap);
/* $KVMESH_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf. */
const char *km_default_model_path(void);

#ifdef __cplusplus
}
#endif
#endif /* KM_MODELINFO_H */
