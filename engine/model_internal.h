/*
 * model_internal.h — the inside of en_model, shared by model.c (loading) and engine.c (the
 * forward pass). Private to worker/.
 */
#ifndef EN_MODEL_INTERNAL_H
#define EN_MODEL_INTERNAL_H

#include "engine/engine.h"

/* A weight matrix in place in the GGUF map: `rows` rows of `k` elements of `type`. A 1-D
 * vector (norms, biases) has rows = 1 and type F32. data == NULL: absent (optional tensor).
 * packed: the same matrix in the panel layout of the kernels of en_model.packed_isa (kn_ops.pack),
 * or NULL; the engine multiplies by it when it runs those kernels. */
typedef struct en_weight {
    const void *data;
    md_type type;
    int64_t rows, k;
    size_t row_bytes;
    const void *packed;
} en_weight;

/* A MoE layer (hp.n_expert > 0): gate_inp is its router ([n_expert] rows of n_embd, F32) and
 * exp_gate/exp_up/exp_down[e] are expert e's matrices, slices of the GGUF's 3-D
 * ffn_{gate,up,down}_exps tensors (into en_model.experts); w_gate/w_up/w_down hold its shared
 * expert (ffn_{gate,up,down}_shexp, hp.n_ff_shexp wide) or nothing, and gate_inp_sh the shared
 * expert's gate vector (qwen2moe: ffn_gate_inp_shexp, n_embd F32; absent: gate 1).
 * q_norm, k_norm: olmoe's attn_{q,k}_norm (absent elsewhere). */
typedef struct en_layer {
    en_weight attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm;
    en_weight ffn_norm, w_gate, w_up, w_down;
    en_weight gate_inp, *exp_gate, *exp_up, *exp_down, gate_inp_sh;
} en_layer;

struct en_model {
    md_gguf *gguf;
    md_tokenizer *tok;
    en_hparams hp;
    en_weight tok_embd, output_norm, output;
    en_layer *layers;
    en_weight *experts; /* MoE: 3 * n_expert per layer, the layers' exp_* point here */
    md_chat_kind chat;
    char name[128];
    char fingerprint[33];
    /* The packed copies of the matrices, built by the first engine (en_model_pack). */
    void *packed_arena;
    size_t packed_bytes;
    int packed_isa; /* kn_isa of the layout; -1 before packing */
};

/* Repacks every matrix the engine multiplies into the layout `ops` streams (once per model: later
 * calls with the same table do nothing; ops without packing leave the rows alone). The threads
 * of `pool` share the work. */
int en_model_pack(en_model *m, const kn_ops *ops, kn_pool *pool, km_errbuf *err);

#endif
