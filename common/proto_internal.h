/*
 * proto_internal.h — what the protocol's files share: the wire spellings of the enumerations,
 * the codec table (one validate/encode/decode triple per message type), and the helpers the
 * message files are written with. Private to common/: common/proto.h is the contract.
 *
 * Files: proto.c (entry points, names, limits, message memory), proto_wire.c (validation,
 * encoding and decoding helpers), proto_scan.c (the bounds scan), and one file per message
 * family: proto_stream.c (req, tok, done, err, cancel), proto_admin.c (admin, admin_reply),
 * proto_hb.c (hb), proto_kv.c (kv), proto_view.c (view), proto_pull.c (kv_pull, kv_offer,
 * kv_pull_done). These files and this header are the
 * only product code that includes <msgpack.h>.
 *
 * How a message file reads: km_enc_* write one key/value pair of a map (or count it: every map
 * is written twice, first counting its keys, then writing them, so optional keys cost nothing
 * when absent); km_dec_* read one key of a decoded map, checking its wire type and that it fits
 * the C field (a missing optional key leaves the field as km_msg_init set it); km_val_* check a
 * value's range, with the field named in the message.
 */
#ifndef KM_PROTO_INTERNAL_H
#define KM_PROTO_INTERNAL_H

#include <msgpack.h>
#include <stdbool.h>

#include "common/proto.h"

/* ---------------------------------------------------------------- names (proto.c) */

extern const char *const km_proto_type_names[KM_MSG_TYPE_COUNT];
extern const char *const km_proto_finish_names[KM_FINISH_COUNT];
extern const char *const km_proto_speculate_names[KM_SPECULATE_COUNT];
extern const char *const km_proto_admin_names[KM_ADMIN_CMD_COUNT];
extern const char *const km_proto_state_names[KM_STATE_COUNT];
extern const char *const km_proto_member_names[KM_MEMBER_STATE_COUNT];
extern const char *const km_proto_role_names[KM_WROLE_COUNT];
extern const char *const km_proto_kind_names[KM_KV_KIND_COUNT];
#define KM_PROTO_N_FORMATS 5 /* the KV formats, in kv_format order */
extern const char *const km_proto_format_names[KM_PROTO_N_FORMATS];

/* The index of s[0..len) in names[0..n), or -1. */
int km_proto_name_index(const char *const *names, int n, const char *s, size_t len);
/* One of the KV formats: f16, bf16, fp8, int8, int4. */
bool km_proto_is_format(const char *s);

/* Memory owned by a decoded message (freed by km_msg_clear); NULL when out of memory. */
void *km_msg_alloc(km_msg *m, size_t n);

/* ---------------------------------------------------------------- the codec of each type */

typedef struct km_enc {
    msgpack_packer pk;
    bool counting; /* this pass counts the map's keys in n instead of writing them */
    uint32_t n;
    int rc; /* nonzero once a write failed (out of memory) */
} km_enc;

typedef struct km_dec {
    km_msg *m;
    km_errbuf *err;
    const km_proto_limits *lim;
    char path[64]; /* "req", "hb.kv[3]", ... for messages */
} km_dec;

typedef struct km_proto_codec {
    /* Range and presence checks on a message of this type (the encoder runs them first, the
     * decoder last). lim is never NULL. */
    int (*validate)(const km_msg *m, const km_proto_limits *lim, km_errbuf *err);
    /* The type's keys (not "v" and "t"), with km_enc_* (called twice: counting, writing). */
    void (*encode)(km_enc *e, const km_msg *m);
    /* The type's keys from the frame's map into d->m (initialised for the type). */
    int (*decode)(km_dec *d, const msgpack_object_map *mp);
} km_proto_codec;

extern const km_proto_codec km_proto_codec_req, km_proto_codec_tok, km_proto_codec_done,
    km_proto_codec_err, km_proto_codec_cancel;                                /* proto_stream.c */
extern const km_proto_codec km_proto_codec_admin, km_proto_codec_admin_reply; /* proto_admin.c */
extern const km_proto_codec km_proto_codec_hb;                                /* proto_hb.c */
extern const km_proto_codec km_proto_codec_kv;                                /* proto_kv.c */
extern const km_proto_codec km_proto_codec_view;                              /* proto_view.c */
extern const km_proto_codec km_proto_codec_kv_pull, km_proto_codec_kv_offer,
    km_proto_codec_kv_pull_done, km_proto_codec_kv_push, km_proto_codec_kv_warm; /* proto_pull.c */
/* A bin value of 1..max bytes copied into the message's memory (peer addresses). */
int km_dec_bin(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               uint32_t max, const uint8_t **out, uint32_t *len);
void km_enc_bin(km_enc *e, const char *k, const uint8_t *p, size_t len); /* NULL p: left out */

/* ---------------------------------------------------------------- the bounds scan (proto_scan.c)
 * Checks that p[0..len) is exactly one msgpack object whose every length and count fits in the
 * bytes that remain, nested at most 8 deep, with arrays of at most max_array elements and maps
 * of at most 64 entries, before msgpack-c allocates anything for it. On the way it notes the
 * value of the root map's first "id" key in *id when that is an unsigned integer (*id is left
 * untouched otherwise), so a rejected frame can still be attributed to its request. */
int km_proto_scan(const uint8_t *p, size_t len, uint64_t max_array, uint64_t *id, km_errbuf *err);

/* ---------------------------------------------------------------- helpers (proto_wire.c) */

/* Returns the first failing call's code. */
#define CK(x)                                                                                      \
    do {                                                                                           \
        int rc_ = (x);                                                                             \
        if (rc_) return rc_;                                                                       \
    } while (0)

/* validation: return a KM_EFORMAT with the message from a validate function (err in scope) */
#define VFAIL(...) return km_errf(err, KM_EFORMAT, __VA_ARGS__)

/* A text field's length: the explicit one, or strlen when it is 0. */
size_t km_text_len(const char *s, size_t len);
/* A name: NULL is fine unless required; otherwise min..max bytes. */
int km_val_name(const char *what, const char *s, bool required, size_t min, size_t max,
                km_errbuf *err);
int km_val_range(const char *what, double x, double lo, double hi, km_errbuf *err);
int km_val_nonneg(const char *what, double x, km_errbuf *err); /* finite and >= 0 */

/* encoding: the bare key or string value */
void km_enc_key(km_enc *e, const char *k);
void km_enc_text(km_enc *e, const char *s, size_t n);
/* Starts the value of key k: counts it and returns false, or writes the key and returns true
 * (the caller then writes the value). Inline: every key of every frame goes through it. */
static inline bool km_enc_begin(km_enc *e, const char *k)
{
    if (e->counting) {
        e->n++;
        return false;
    }
    km_enc_key(e, k);
    return true;
}
/* One key/value pair each. */
void km_enc_u64(km_enc *e, const char *k, uint64_t v);
void km_enc_i64(km_enc *e, const char *k, int64_t v);
void km_enc_f32(km_enc *e, const char *k, float v);
void km_enc_f64(km_enc *e, const char *k, double v);
void km_enc_bool(km_enc *e, const char *k, bool v);
void km_enc_strn(km_enc *e, const char *k, const char *s, size_t len); /* NULL s: left out */
void km_enc_str(km_enc *e, const char *k, const char *s);              /* NULL s: left out */
/* A nested map written with the same helpers by body(e, arg): counted first, then written. */
void km_enc_map(km_enc *e, void (*body)(km_enc *, const void *), const void *arg);

/* decoding */
#define DFAIL(d, code, ...) km_errf((d)->err, (code), __VA_ARGS__)

const char *km_dec_type_name(msgpack_object_type t); /* "string", "map", ... for messages */
/* Every key a string, none twice. */
int km_dec_check_map(km_dec *d, const msgpack_object_map *mp);
/* The value of key, or NULL when absent or nil (nil means "absent" everywhere). */
const msgpack_object *km_dec_find(const msgpack_object_map *mp, const char *key);
/* The getters below return 0 when the value was read, or was optional and is absent (out
 * untouched), or an error naming d->path.key. */
int km_dec_absent(km_dec *d, const char *key, bool required);
int km_dec_wrong_type(km_dec *d, const char *key, const char *want, const msgpack_object *o);
int km_dec_uint(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                uint64_t max, uint64_t *out);
int km_dec_u32(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               uint32_t *out);
int km_dec_i32(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               int32_t *out);
/* Numbers: floats and integers both accepted; NaN and infinities are not. */
int km_dec_num(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               double *out);
int km_dec_f32(km_dec *d, const msgpack_object_map *mp, const char *key, float *out);
int km_dec_bool(km_dec *d, const msgpack_object_map *mp, const char *key, bool required, bool *out);
/* A flag sent as a bool or as an unsigned integer (nonzero = true); optional. */
int km_dec_flag(km_dec *d, const msgpack_object_map *mp, const char *key, bool *out);
/* Copies a string value into the message's memory, NUL-terminated. Text that may hold any byte
 * (prompts, pieces) passes binary_ok; names and messages must not contain NUL. */
int km_dec_copy_str(km_dec *d, const char *what, const msgpack_object *o, size_t max,
                    bool binary_ok, const char **out, size_t *len);
int km_dec_str(km_dec *d, const msgpack_object_map *mp, const char *key, bool required, size_t max,
               bool binary_ok, const char **out, size_t *len);
/* A string that must be one of names; *out is its index. */
int km_dec_enum(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                const char *const *names, int n, int *out);
int km_dec_tier(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                km_tier *out);
/* A nested container under key, typed; *out NULL when absent. */
int km_dec_obj(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
               msgpack_object_type type, const msgpack_object **out);
/* The map at a->ptr[i], with the path set to "<path at n0><what>[i]" for its messages. */
int km_dec_array_map(km_dec *d, const msgpack_object_array *a, uint32_t i, size_t n0,
                     const char *what, const msgpack_object_map **out);
/* The array under key, its size checked against max entries, and zeroed room for that many
 * elem_size-byte entries in the message's memory; *a and *out NULL when absent or empty. */
int km_dec_array(km_dec *d, const msgpack_object_map *mp, const char *key, bool required,
                 uint32_t max, size_t elem_size, const msgpack_object_array **a, void **out);
/* The map under key (optional) whose keys are names: its keys checked (strings, none twice) with
 * the path pushed to "<path>.<key>" (left there for the caller's messages; the caller sets it
 * back), its size against max, and zeroed room for that many elem_size-byte entries; *em and
 * *out NULL when absent or empty. */
int km_dec_named_map(km_dec *d, const msgpack_object_map *mp, const char *key, uint32_t max,
                     size_t elem_size, const msgpack_object_map **em, void **out);
void km_dec_path_push(km_dec *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Per-holder transfer figures (km_xfer_pair; hb.xfer.pairs and view.workers[].xfer_pairs), written
 * once for both: an array of maps {from, rate_bps, latency_ms} under key. Decoding sets the path
 * back to n0; validation names the field as what. */
void km_enc_xfer_pairs(km_enc *e, const char *key, const km_xfer_pair *p, uint32_t n);
int km_dec_xfer_pairs(km_dec *d, const msgpack_object_map *mp, const char *key, size_t n0,
                      const km_xfer_pair **out, uint32_t *n);
int km_val_xfer_pairs(const char *what, const km_xfer_pair *p, uint32_t n, km_errbuf *err);
void km_dec_path_set(km_dec *d, size_t n);

#endif /* KM_PROTO_INTERNAL_H */
