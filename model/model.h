/*
 * model.h — model formats, shared by the router and the engine: the ggml tensor-type table, the
 * GGUF reader, the tokenizer (BPE and SentencePiece), the streaming detokenizer, chat templates
 * and model metadata (name, fingerprint, default path).
 *
 * Contract:
 *  - Every function that can fail returns 0 (or a count) on success and a negative km_err on
 *    failure; when the caller passes a km_errbuf, it receives a one-line message with context.
 *  - Nothing here exits or aborts on input that came from outside: a broken GGUF file is an
 *    error code and a message, never a crash (fuzzed: tests/fuzz/fuzz_gguf.c, fuzz_tokenizer.c).
 *  - The GGUF reader never copies tensor data: tensors point into the read-only memory map, which
 *    lives until md_gguf_close.
 *  - No sockets, no threads, no global state: the router (which never reads weights) and the
 *    engine (which does) read a model through the same functions, so both seed page hashes from
 *    the same fingerprint.
 */
#ifndef MD_MODEL_H
#define MD_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/km.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- tensor types (ggml ids) */

typedef enum md_type {
    MD_TYPE_F32 = 0,
    MD_TYPE_F16 = 1,
    MD_TYPE_Q4_0 = 2,
    MD_TYPE_Q4_1 = 3,
    MD_TYPE_Q5_0 = 6,
    MD_TYPE_Q5_1 = 7,
    MD_TYPE_Q8_0 = 8,
    MD_TYPE_Q8_1 = 9,
    MD_TYPE_Q2_K = 10,
    MD_TYPE_Q3_K = 11,
    MD_TYPE_Q4_K = 12,
    MD_TYPE_Q5_K = 13,
    MD_TYPE_Q6_K = 14,
    MD_TYPE_Q8_K = 15,
    MD_TYPE_BF16 = 30,
    MD_TYPE_COUNT = 40,
} md_type;

/* Elements per block and bytes per block; 0 for ids that are unknown. */
int md_type_block_elems(uint32_t type);
int md_type_block_bytes(uint32_t type);
const char *md_type_name(uint32_t type); /* "Q4_1", ...; "unknown" */
/* Bytes of a row of n elements, or 0 when n is not a whole number of blocks or the type is
 * unknown. */
size_t md_type_row_bytes(uint32_t type, int64_t n);

/* ---------------------------------------------------------------- GGUF reader */

typedef enum md_gguf_type {
    MD_GGUF_UINT8 = 0,
    MD_GGUF_INT8 = 1,
    MD_GGUF_UINT16 = 2,
    MD_GGUF_INT16 = 3,
    MD_GGUF_UINT32 = 4,
    MD_GGUF_INT32 = 5,
    MD_GGUF_FLOAT32 = 6,
    MD_GGUF_BOOL = 7,
    MD_GGUF_STRING = 8,
    MD_GGUF_ARRAY = 9,
    MD_GGUF_UINT64 = 10,
    MD_GGUF_INT64 = 11,
    MD_GGUF_FLOAT64 = 12,
} md_gguf_type;

typedef struct md_gguf_tensor {
    km_str name;
    int n_dims;       /* 1..4 */
    int64_t ne[4];    /* elements per dimension, ne[0] is the row length; unused dims are 1 */
    uint32_t type;    /* md_type */
    uint64_t offset;  /* from the start of the data section */
    uint64_t size;    /* bytes */
    const void *data; /* into the map, aligned to the file's alignment */
} md_gguf_tensor;

typedef struct md_gguf md_gguf;

/* Maps and validates the whole file: header, every key/value, every tensor (type, shape, offset,
 * size inside the file, no overlap, alignment). */
int md_gguf_open(const char *path, md_gguf **out, km_errbuf *err);
/* Same over a caller's buffer, which must outlive the handle (used by the fuzz target). */
int md_gguf_open_memory(const void *data, size_t size, md_gguf **out, km_errbuf *err);
void md_gguf_close(md_gguf *g);

uint32_t md_gguf_version(const md_gguf *g);
int64_t md_gguf_n_kv(const md_gguf *g);
km_str md_gguf_key_at(const md_gguf *g, int64_t i);
/* Index of the key, or -1. */
int64_t md_gguf_find(const md_gguf *g, const char *key);
md_gguf_type md_gguf_kv_type(const md_gguf *g, int64_t i);

/* Typed getters by key. They return KM_ENOTFOUND when the key is absent and KM_EFORMAT when the
 * stored type does not fit (integers convert between widths when the value is in range). */
int md_gguf_get_u32(const md_gguf *g, const char *key, uint32_t *out);
int md_gguf_get_i64(const md_gguf *g, const char *key, int64_t *out);
int md_gguf_get_f32(const md_gguf *g, const char *key, float *out);
int md_gguf_get_bool(const md_gguf *g, const char *key, int *out);
int md_gguf_get_str(const md_gguf *g, const char *key, km_str *out);
/* Array metadata: element type and count. */
int md_gguf_get_arr(const md_gguf *g, const char *key, md_gguf_type *elem, uint64_t *n);
/* Element i of a string array (O(1): offsets are indexed at open). */
int md_gguf_arr_str(const md_gguf *g, const char *key, uint64_t i, km_str *out);
/* Raw little-endian data of a numeric array, or NULL (absent, or an array of strings/arrays). */
const void *md_gguf_arr_data(const md_gguf *g, const char *key);

int64_t md_gguf_n_tensors(const md_gguf *g);
const md_gguf_tensor *md_gguf_tensor_at(const md_gguf *g, int64_t i);
const md_gguf_tensor *md_gguf_find_tensor(const md_gguf *g, const char *name);
/* The whole file's bytes (for fingerprints). */
const void *md_gguf_file_data(const md_gguf *g, size_t *size);

/* ---------------------------------------------------------------- tokenizer */

/* Built from the GGUF's tokenizer.* metadata. Supports tokenizer.ggml.model "gpt2" (byte-level
 * BPE with the pre-tokenizer named by tokenizer.ggml.pre: smollm, llama3/llama-bpe, qwen2,
 * gpt2/default) and "llama" (SentencePiece-style BPE over scores, byte fallback). */
typedef struct md_tokenizer md_tokenizer;

int md_tok_create(const md_gguf *g, md_tokenizer **out, km_errbuf *err);
void md_tok_destroy(md_tokenizer *t);

int md_tok_n_vocab(const md_tokenizer *t);
int32_t md_tok_bos(const md_tokenizer *t); /* -1 when none */
int32_t md_tok_eos(const md_tokenizer *t);
int32_t md_tok_eot(const md_tokenizer *t); /* end-of-turn (<|im_end|>, <|eot_id|>), or -1 */
int md_tok_adds_bos(const md_tokenizer *t);
/* True for every end-of-generation token (eos, eot, and the other ids the vocabulary marks). */
int md_tok_is_eog(const md_tokenizer *t, int32_t id);
/* Looks up the id of an exact token text, -1 if none. */
int32_t md_tok_find(const md_tokenizer *t, const char *text);

/* Same semantics as llama.cpp's llama_tokenize: add_special adds BOS (and EOS) when the model
 * asks for it; parse_special turns special-token texts in `text` into their ids. Writes at most
 * max_out ids and returns the total count, which may exceed max_out (then call again with a
 * larger buffer); negative km_err on failure. */
int md_tok_encode(const md_tokenizer *t, const char *text, size_t len, int add_special,
                  int parse_special, int32_t *out, int max_out);

/* The bytes a token stands for (byte-level decoding done; special tokens give their text when
 * `special` is true and nothing otherwise). Returns the byte count, which may exceed cap (then
 * nothing useful was written); negative on a bad id. */
int md_tok_piece(const md_tokenizer *t, int32_t id, int special, char *buf, int cap);

/* Streaming detokenizer: emits only complete UTF-8 sequences, holding back a partial one until
 * the next token completes it. */
typedef struct md_detok {
    char pending[8];
    int n_pending;
} md_detok;

void md_detok_init(md_detok *d);
/* Appends the text of `id` to out (capacity cap, at least 64 + the longest token); returns bytes
 * written (>= 0) or a negative km_err. */
int md_detok_push(const md_tokenizer *t, md_detok *d, int32_t id, char *out, int cap);
/* Emits what is held back at the end of a stream (invalid bytes become U+FFFD). */
int md_detok_flush(md_detok *d, char *out, int cap);

/* Chat templates. */
typedef enum md_chat_kind {
    MD_CHAT_NONE = 0,
    MD_CHAT_CHATML = 1, /* <|im_start|>role\ncontent<|im_end|>\n (SmolLM2, Qwen2) */
    MD_CHAT_LLAMA3 = 2, /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
} md_chat_kind;

typedef struct md_chat_msg {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
} md_chat_msg;

/* Reads tokenizer.chat_template and recognises the family; MD_CHAT_NONE when unknown. */
md_chat_kind md_chat_detect(const md_gguf *g);
/* Parses "chatml" / "llama3"; MD_CHAT_NONE for anything else. */
md_chat_kind md_chat_parse(const char *name);
/* Renders the conversation (and the assistant header when add_assistant); for CHATML without a
 * system message and a default_system given, that system message is prepended (as SmolLM2's
 * template does). Returns the length needed (excluding NUL), which may exceed cap. */
int md_chat_apply(md_chat_kind kind, const md_chat_msg *msgs, int n, int add_assistant,
                  const char *default_system, char *out, size_t cap);

/* ---------------------------------------------------------------- model metadata
 * (appended as its own guarded section; model/modelinfo.c)
 *
 * What a process that does not run a model needs of it (the router): its tokenizer, chat format,
 * display name and fingerprint, read from the GGUF's metadata and a sample of its bytes — never
 * its weight tensors, which are neither read nor checked. The worker's loader (engine/model.c)
 * names and fingerprints a model with the same functions, so a router's page-hash chain seeds
 * from the workers' fingerprint to the bit.
 */

typedef struct md_model_info md_model_info;

/* Opens the GGUF at path (memory-mapped) and builds its tokenizer. */
int md_model_info_open(const char *path, md_model_info **out, km_errbuf *err);
void md_model_info_close(md_model_info *m);
const md_tokenizer *md_model_info_tokenizer(const md_model_info *m);
md_chat_kind md_model_info_chat(const md_model_info *m); /* md_chat_detect of the file */
const char *md_model_info_name(const md_model_info *m);  /* md_model_display_name of the path */
const char *md_model_info_fingerprint(const md_model_info *m); /* 32 hex digits */

/* 128-bit fingerprint of a GGUF file (XXH3 over its first MiB and 64 KiB samples every 1/64 of
 * it, and its size), hex-encoded into out[33]. Seeds the page-hash chain, so KV of one model
 * never serves another. */
void md_model_fingerprint_hex(const md_gguf *g, char out[33]);
/* "SmolLM2-135M-Instruct.Q4_1" for ".../SmolLM2-135M-Instruct.Q4_1.gguf": the file name without
 * its directory and its ".gguf". */
void md_model_display_name(const char *path, char *out, size_t cap);
/* $KVMESH_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf. */
const char *md_default_model_path(void);

/* ---------------------------------------------------------------- random models
 * (model/gguf_gen.c; docs/gpu.md)
 *
 * A Llama-family GGUF of a given shape whose weights are random from a seed, with a tiny
 * SentencePiece-style tokenizer (specials, the 256 byte tokens, printable characters, unused
 * fillers): what speed and agreement tests run where no real model can travel. Every matrix has
 * the one weight type; norms are F32. The file is a pure function of the configuration.
 */

typedef struct md_gguf_gen_cfg {
    int n_layers, n_embd, n_head, n_head_kv, n_ff, n_vocab;
    int n_ctx;       /* llama.context_length; 0: 4096 */
    md_type type;    /* F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K or Q6_K */
    int tied_output; /* 1: no output.weight (the output reuses token_embd) */
    float rope_base; /* 0: 10000 */
    uint64_t seed;
} md_gguf_gen_cfg;

/* The smallest n_vocab the tokenizer fits in. */
int md_gguf_gen_min_vocab(void);
/* Writes the file (replacing one at path). KM_EINVAL for a shape the type or the engine cannot
 * take (rows must be whole blocks), KM_EIO when writing fails (the partial file is removed). */
int md_gguf_gen(const md_gguf_gen_cfg *cfg, const char *path, km_errbuf *err);

#ifdef __cplusplus
}
#endif
#endif /* MD_MODEL_H */
