/*
 * model.c — loads a Llama-family GGUF into a en_model: hyper-parameters from the `{arch}.*`
 * metadata, every tensor looked up and checked (type supported by the kernels, shape consistent
 * with the hyper-parameters), and the tokenizer. Weights stay in the GGUF's read-only map.
 *
 * Supported architectures: llama (Llama 1/2/3, Mistral, SmolLM), qwen2 (adds q/k/v biases and
 * NeoX rope), and the MoE ones of docs/moe.md, read as llama.cpp reads them. Anything else is
 * KM_EUNSUPPORTED with the architecture's name in the message. A llama/mistral GGUF with
 * `{arch}.expert_count` is a Mixtral-layout MoE: every layer's FFN is a router (ffn_gate_inp)
 * and n_expert experts (ffn_{gate,up,down}_exps, 3-D); each expert is loaded as its own matrix,
 * a slice of the 3-D tensor in the map. qwen2moe adds a shared expert (ffn_{gate,up,down}_shexp,
 * gated by ffn_gate_inp_shexp; its widths from expert_feed_forward_length and
 * expert_shared_feed_forward_length), keeps the routed weights unrenormalized and ropes NeoX;
 * granitemoe is the Mixtral layout with Granite's four multipliers (and an ungated shared expert
 * when it declares one); olmoe normalizes each token's whole q and k (attn_{q,k}_norm), keeps
 * the weights unrenormalized and ropes NeoX. The three require expert_count.
 *
 * The first engine over a model repacks its matrices once into the panel layout its kernels
 * stream (en_model_pack; kernels/cpu/packed.h), so that no matmul transposes weights per call.
 * The packed copy is the model's, shared by every engine on it; the GGUF pages it replaces are
 * given back to the page cache.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/model_internal.h"

const char *en_default_model_path(void)
{
    return md_default_model_path();
}

static int en_get_u32(const md_gguf *g, const char *arch, const char *key, uint32_t *out,
                      int required, km_errbuf *err)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    int rc = md_gguf_get_u32(g, full, out);
    if (rc == KM_ENOTFOUND && !required) return 0;
    if (rc)
        return km_errf(err, rc == KM_ENOTFOUND ? KM_EFORMAT : rc, "model: metadata %s is %s", full,
                       rc == KM_ENOTFOUND ? "missing" : "not an unsigned integer");
    return 0;
}

static int en_get_f32(const md_gguf *g, const char *arch, const char *key, float *out)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    int rc = md_gguf_get_f32(g, full, out);
    return rc == KM_ENOTFOUND ? 0 : rc;
}

/* Finds a tensor and checks its type and shape; expect ne1 = 0 for a 1-D tensor. */
static int en_tensor(const md_gguf *g, const char *name, int64_t ne0, int64_t ne1, int optional,
                     en_weight *out, km_errbuf *err)
{
    memset(out, 0, sizeof *out);
    const md_gguf_tensor *t = md_gguf_find_tensor(g, name);
    if (!t) {
        if (optional) return 0;
        return km_errf(err, KM_EFORMAT, "model: tensor %s is missing", name);
    }
    int want_dims = ne1 ? 2 : 1;
    if (t->n_dims != want_dims || t->ne[0] != ne0 || (ne1 && t->ne[1] != ne1))
        return km_errf(err, KM_EFORMAT,
                       "model: tensor %s has shape [%lld, %lld] (%d dims), expected [%lld, %lld]",
                       name, (long long)t->ne[0], (long long)t->ne[1], t->n_dims, (long long)ne0,
                       (long long)ne1);
    if (ne1) {
        if (!kn_weight_type_supported((md_type)t->type))
            return km_errf(err, KM_EUNSUPPORTED, "model: tensor %s has type %s, not supported",
                           name, md_type_name(t->type));
    } else if (t->type != MD_TYPE_F32) {
        return km_errf(err, KM_EUNSUPPORTED, "model: vector %s has type %s, expected F32", name,
                       md_type_name(t->type));
    }
    out->data = t->data;
    out->type = (md_type)t->type;
    out->rows = ne1 ? ne1 : 1;
    out->k = ne0;
    out->row_bytes = md_type_row_bytes(t->type, ne0);
    return 0;
}

/* Finds a 3-D expert tensor [ne0, ne1, n] and loads expert e's [ne0, ne1] slice into out[e]. */
static int en_tensor_exps(const md_gguf *g, const char *name, int64_t ne0, int64_t ne1, int n,
                          en_weight *out, km_errbuf *err)
{
    const md_gguf_tensor *t = md_gguf_find_tensor(g, name);
    if (!t) return km_errf(err, KM_EFORMAT, "model: tensor %s is missing", name);
    if (t->n_dims != 3 || t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != n)
        return km_errf(err, KM_EFORMAT,
                       "model: tensor %s has shape [%lld, %lld, %lld] (%d dims), expected [%lld, "
                       "%lld, %d]",
                       name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                       t->n_dims, (long long)ne0, (long long)ne1, n);
    if (!kn_weight_type_supported((md_type)t->type))
        return km_errf(err, KM_EUNSUPPORTED, "model: tensor %s has type %s, not supported", name,
                       md_type_name(t->type));
    const size_t row_bytes = md_type_row_bytes(t->type, ne0);
    for (int e = 0; e < n; e++)
        out[e] = (en_weight){.data = (const uint8_t *)t->data + (size_t)e * ne1 * row_bytes,
                             .type = (md_type)t->type,
                             .rows = ne1,
                             .k = ne0,
                             .row_bytes = row_bytes};
    return 0;
}

static int en_load_hparams(en_model *m, km_errbuf *err)
{
    const md_gguf *g = m->gguf;
    en_hparams *hp = &m->hp;
    km_str arch;
    if (md_gguf_get_str(g, "general.architecture", &arch))
        return km_errf(err, KM_EFORMAT, "model: general.architecture is missing");
    if (arch.len >= sizeof hp->arch) arch.len = sizeof hp->arch - 1;
    memcpy(hp->arch, arch.ptr, arch.len);
    hp->arch[arch.len] = 0;
    static const char *const archs[] = {"llama",    "mistral",    "qwen2",
                                        "qwen2moe", "granitemoe", "olmoe"};
    int known = 0, moe_only = 0;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (!strcmp(hp->arch, archs[i])) known = 1, moe_only = i >= 3;
    if (!known)
        return km_errf(err, KM_EUNSUPPORTED,
                       "model: architecture '%s' is not supported (llama, mistral, qwen2, "
                       "qwen2moe, granitemoe, olmoe are)",
                       hp->arch);
    const int qwen2moe = !strcmp(hp->arch, "qwen2moe"), granite = !strcmp(hp->arch, "granitemoe");
    uint32_t v;
    int rc;
#define EN_U32(key, field, req)                                                                    \
    v = 0;                                                                                         \
    if ((rc = en_get_u32(g, hp->arch, key, &v, req, err))) return rc;                              \
    hp->field = (int)v;
    EN_U32("block_count", n_layers, 1);
    EN_U32("embedding_length", n_embd, 1);
    EN_U32("feed_forward_length", n_ff, !qwen2moe);
    EN_U32("attention.head_count", n_head, 1);
    EN_U32("attention.head_count_kv", n_head_kv, 0);
    EN_U32("context_length", n_ctx_train, 0);
    EN_U32("rope.dimension_count", n_rot, 0);
    EN_U32("vocab_size", n_vocab, 0);
    EN_U32("expert_count", n_expert, 0);
    EN_U32("expert_used_count", n_expert_used, 0);
    /* qwen2moe: feed_forward_length is the dense width; the experts' and the shared expert's
     * widths have keys of their own (llama.cpp's defaults: n_ff / n_expert_used and n_ff) */
    EN_U32("expert_shared_feed_forward_length", n_ff_shexp, 0);
    if (qwen2moe) {
        if (!hp->n_ff_shexp) hp->n_ff_shexp = hp->n_ff;
        const int dense_ff = hp->n_ff;
        EN_U32("expert_feed_forward_length", n_ff, 0);
        if (!hp->n_ff && hp->n_expert_used > 0) hp->n_ff = dense_ff / hp->n_expert_used;
    }
#undef EN_U32
    if (moe_only && !hp->n_expert)
        return km_errf(err, KM_EFORMAT, "model: architecture '%s' without %s.expert_count",
                       hp->arch, hp->arch);
    if (!strcmp(hp->arch, "qwen2") && hp->n_expert)
        return km_errf(err, KM_EUNSUPPORTED,
                       "model: MoE layers of architecture 'qwen2' are not supported (qwen2moe "
                       "are: docs/moe.md)");
    if (!qwen2moe && !granite) hp->n_ff_shexp = 0;
    hp->moe_norm_w = !qwen2moe && strcmp(hp->arch, "olmoe");
    hp->qk_norm = !strcmp(hp->arch, "olmoe");
    if (hp->n_ff_shexp < 0 || hp->n_ff_shexp > 1 << 20)
        return km_errf(err, KM_EFORMAT, "model: shared expert width %d", hp->n_ff_shexp);
    if (hp->n_expert < 0 || hp->n_expert > EN_MAX_EXPERTS ||
        (hp->n_expert && (hp->n_expert_used < 1 || hp->n_expert_used > hp->n_expert)))
        return km_errf(err, KM_EFORMAT, "model: %d experts, %d used: out of range (at most %d)",
                       hp->n_expert, hp->n_expert_used, EN_MAX_EXPERTS);
    if (!hp->n_expert) hp->n_expert_used = 0;
    if (!hp->n_head_kv) hp->n_head_kv = hp->n_head;
    hp->norm_eps = 1e-5f;
    hp->rope_base = 10000.0f;
    if ((rc = en_get_f32(g, hp->arch, "attention.layer_norm_rms_epsilon", &hp->norm_eps)) ||
        (rc = en_get_f32(g, hp->arch, "rope.freq_base", &hp->rope_base)))
        return km_errf(err, rc, "model: rope/norm metadata has the wrong type");
    if (granite) {
        /* where llama.cpp applies each: see en_hparams; logit_scale is required there */
        if ((rc = en_get_f32(g, hp->arch, "embedding_scale", &hp->f_embedding_scale)) ||
            (rc = en_get_f32(g, hp->arch, "residual_scale", &hp->f_residual_scale)) ||
            (rc = en_get_f32(g, hp->arch, "attention.scale", &hp->f_attention_scale)) ||
            (rc = en_get_f32(g, hp->arch, "logit_scale", &hp->f_logit_scale)))
            return km_errf(err, rc, "model: a granite multiplier has the wrong type");
        if (!(hp->f_logit_scale > 0) || !isfinite(hp->f_embedding_scale) ||
            !isfinite(hp->f_residual_scale) || !isfinite(hp->f_attention_scale) ||
            !isfinite(hp->f_logit_scale))
            return km_errf(err, KM_EFORMAT,
                           "model: granite multipliers embedding %g residual %g attention %g "
                           "logit %g (logit_scale is required and positive)",
                           hp->f_embedding_scale, hp->f_residual_scale, hp->f_attention_scale,
                           hp->f_logit_scale);
    }
    if (hp->n_layers < 1 || hp->n_layers > 1024 || hp->n_embd < 1 || hp->n_embd > 65536 ||
        hp->n_head < 1 || hp->n_head > 1024 || hp->n_ff < 1 || hp->n_ff > 1 << 20 ||
        hp->n_embd % hp->n_head || hp->n_head % hp->n_head_kv)
        return km_errf(err, KM_EFORMAT,
                       "model: inconsistent shape layers=%d embd=%d ff=%d heads=%d kv_heads=%d",
                       hp->n_layers, hp->n_embd, hp->n_ff, hp->n_head, hp->n_head_kv);
    hp->head_dim = hp->n_embd / hp->n_head;
    if (!hp->n_rot) hp->n_rot = hp->head_dim;
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2)
        return km_errf(err, KM_EFORMAT, "model: rope.dimension_count %d does not fit head dim %d",
                       hp->n_rot, hp->head_dim);
    hp->rope_neox = !strcmp(hp->arch, "qwen2") || qwen2moe || hp->qk_norm; /* llama.cpp's types */
    if (!(hp->norm_eps > 0 && hp->norm_eps < 1) || !(hp->rope_base > 0))
        return km_errf(err, KM_EFORMAT, "model: bad norm epsilon %g or rope base %g", hp->norm_eps,
                       hp->rope_base);
    return 0;
}

static int en_load_weights(en_model *m, km_errbuf *err)
{
    const md_gguf *g = m->gguf;
    en_hparams *hp = &m->hp;
    const md_gguf_tensor *emb = md_gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return km_errf(err, KM_EFORMAT, "model: tensor token_embd.weight is missing");
    if (!hp->n_vocab) hp->n_vocab = (int)emb->ne[1];
    int rc;
    if ((rc = en_tensor(g, "token_embd.weight", hp->n_embd, hp->n_vocab, 0, &m->tok_embd, err)))
        return rc;
    if ((rc = en_tensor(g, "output_norm.weight", hp->n_embd, 0, 0, &m->output_norm, err)))
        return rc;
    if ((rc = en_tensor(g, "output.weight", hp->n_embd, hp->n_vocab, 1, &m->output, err)))
        return rc;
    hp->tied_output = m->output.data == NULL;
    if (hp->tied_output) m->output = m->tok_embd;

    int qd = hp->n_head * hp->head_dim, kvd = hp->n_head_kv * hp->head_dim;
    m->layers = calloc(hp->n_layers, sizeof(en_layer));
    if (!m->layers) return km_errf(err, KM_ENOMEM, "model: out of memory");
    const int ne = hp->n_expert;
    if (ne) {
        m->experts = calloc((size_t)hp->n_layers * 3 * ne, sizeof(en_weight));
        if (!m->experts) return km_errf(err, KM_ENOMEM, "model: out of memory");
    }
    for (int l = 0; l < hp->n_layers; l++) {
        en_layer *L = &m->layers[l];
        char name[96];
#define EN_T(field, suffix, ne0, ne1, opt)                                                         \
    snprintf(name, sizeof name, "blk.%d.%s", l, suffix);                                           \
    if ((rc = en_tensor(g, name, ne0, ne1, opt, &L->field, err))) return rc;
        EN_T(attn_norm, "attn_norm.weight", hp->n_embd, 0, 0);
        EN_T(wq, "attn_q.weight", hp->n_embd, qd, 0);
        EN_T(wk, "attn_k.weight", hp->n_embd, kvd, 0);
        EN_T(wv, "attn_v.weight", hp->n_embd, kvd, 0);
        EN_T(wo, "attn_output.weight", qd, hp->n_embd, 0);
        EN_T(bq, "attn_q.bias", qd, 0, 1);
        EN_T(bk, "attn_k.bias", kvd, 0, 1);
        EN_T(bv, "attn_v.bias", kvd, 0, 1);
        if (hp->qk_norm) {
            EN_T(q_norm, "attn_q_norm.weight", qd, 0, 0);
            EN_T(k_norm, "attn_k_norm.weight", kvd, 0, 0);
        }
        EN_T(ffn_norm, "ffn_norm.weight", hp->n_embd, 0, 0);
        if (!ne) {
            EN_T(w_gate, "ffn_gate.weight", hp->n_embd, hp->n_ff, 0);
            EN_T(w_up, "ffn_up.weight", hp->n_embd, hp->n_ff, 0);
            EN_T(w_down, "ffn_down.weight", hp->n_ff, hp->n_embd, 0);
            continue;
        }
        EN_T(gate_inp, "ffn_gate_inp.weight", hp->n_embd, ne, 0);
        if (L->gate_inp.type != MD_TYPE_F32)
            return km_errf(err, KM_EUNSUPPORTED, "model: router %s has type %s, expected F32", name,
                           md_type_name(L->gate_inp.type));
        L->exp_gate = m->experts + ((size_t)l * 3 + 0) * ne;
        L->exp_up = m->experts + ((size_t)l * 3 + 1) * ne;
        L->exp_down = m->experts + ((size_t)l * 3 + 2) * ne;
#define EN_X(field, suffix, ne0, ne1)                                                              \
    snprintf(name, sizeof name, "blk.%d.%s", l, suffix);                                           \
    if ((rc = en_tensor_exps(g, name, ne0, ne1, ne, L->field, err))) return rc;
        EN_X(exp_gate, "ffn_gate_exps.weight", hp->n_embd, hp->n_ff);
        EN_X(exp_up, "ffn_up_exps.weight", hp->n_embd, hp->n_ff);
        EN_X(exp_down, "ffn_down_exps.weight", hp->n_ff, hp->n_embd);
#undef EN_X
        if (!hp->n_ff_shexp) continue;
        EN_T(w_gate, "ffn_gate_shexp.weight", hp->n_embd, hp->n_ff_shexp, 0);
        EN_T(w_up, "ffn_up_shexp.weight", hp->n_embd, hp->n_ff_shexp, 0);
        EN_T(w_down, "ffn_down_shexp.weight", hp->n_ff_shexp, hp->n_embd, 0);
        if (!strcmp(hp->arch, "qwen2moe")) {
            EN_T(gate_inp_sh, "ffn_gate_inp_shexp.weight", hp->n_embd, 0, 0);
        }
#undef EN_T
    }
    return 0;
}

/* ------------------------------------------------------------------ packing */

/* The matrices the engine multiplies, in a fixed order; returns how many (at most
 * en_matrices_max). */
static int en_matrices_max(const en_model *m)
{
    const int ffn = 3 + 3 * m->hp.n_expert; /* a MoE layer's shared expert and its experts */
    return (4 + ffn) * m->hp.n_layers + 1;
}

static int en_matrices(en_model *m, en_weight **ws)
{
    int n = 0;
    for (int l = 0; l < m->hp.n_layers; l++) {
        en_layer *L = &m->layers[l];
        en_weight *lw[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        const size_t nl = m->hp.n_expert && !L->w_gate.data ? 4 : sizeof lw / sizeof lw[0];
        for (size_t i = 0; i < nl; i++) ws[n++] = lw[i];
        for (int e = 0; e < m->hp.n_expert; e++) {
            ws[n++] = &L->exp_gate[e];
            ws[n++] = &L->exp_up[e];
            ws[n++] = &L->exp_down[e];
        }
    }
    ws[n++] = &m->output;
    return n;
}

typedef struct en_pack_job {
    const kn_ops *ops;
    en_weight **ws;
    void **dst;
    int n;
} en_pack_job;

#define EN_PACK_ROWS (64 * KN_PACK_ALIGN)

static void en_pack_run(void *ctx, int ith, int nth)
{
    const en_pack_job *j = ctx;
    int64_t c = 0;
    for (int i = 0; i < j->n; i++) {
        const en_weight *w = j->ws[i];
        if (!j->dst[i]) continue;
        for (int64_t r0 = 0; r0 < w->rows; r0 += EN_PACK_ROWS, c++) { /* chunks round-robin */
            if (c % nth != ith) continue;
            const int64_t n = w->rows - r0 < EN_PACK_ROWS ? w->rows - r0 : EN_PACK_ROWS;
            /* rows from a multiple of KN_PACK_ALIGN start a panel, pack_size(r0) bytes in */
            j->ops->pack(w->type, (const uint8_t *)w->data + (size_t)r0 * w->row_bytes,
                         w->row_bytes, n, w->k,
                         (uint8_t *)j->dst[i] + j->ops->pack_size(w->type, r0, w->k));
        }
    }
}

int en_model_pack(en_model *m, const kn_ops *ops, kn_pool *pool, km_errbuf *err)
{
    if (m->packed_isa >= 0) return 0; /* one layout per model */
    const int cap = en_matrices_max(m);
    en_weight **ws = calloc((size_t)cap, sizeof *ws);
    void **dst = calloc((size_t)cap, sizeof *dst);
    size_t *sz = calloc((size_t)cap, sizeof *sz);
    if (!ws || !dst || !sz) {
        free(ws), free(dst), free(sz);
        return km_errf(err, KM_ENOMEM, "model: out of memory");
    }
    const int n = en_matrices(m, ws);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        sz[i] = (ops->pack_size(ws[i]->type, ws[i]->rows, ws[i]->k) + 63) & ~(size_t)63;
        total += sz[i];
    }
    if (total) {
        /* 2 MiB aligned and advised huge: the decode step streams all of it per token */
        const size_t huge = (size_t)2 << 20, bytes = (total + huge - 1) & ~(huge - 1);
        if (posix_memalign(&m->packed_arena, huge, bytes)) {
            m->packed_arena = NULL;
            free(ws), free(dst), free(sz);
            return km_errf(err, KM_ENOMEM, "model: cannot allocate %zu bytes of packed weights",
                           bytes);
        }
#ifdef MADV_HUGEPAGE
        madvise(m->packed_arena, bytes, MADV_HUGEPAGE);
#endif
        m->packed_bytes = bytes;
        uint8_t *at = m->packed_arena;
        for (int i = 0; i < n; i++) {
            dst[i] = sz[i] ? at : NULL;
            at += sz[i];
        }
        en_pack_job job = {.ops = ops, .ws = ws, .dst = dst, .n = n};
        kn_pool_run(pool, en_pack_run, &job);
        const long page = sysconf(_SC_PAGESIZE);
        for (int i = 0; i < n; i++) {
            if (!dst[i]) continue;
            const void *rows = ws[i]->data;
            ws[i]->packed = dst[i];
            /* The packed copy replaces the rows, except where the embedding lookup still reads
             * them (a tied output): let the kernel drop their pages (a read re-faults them). */
            if (rows == m->tok_embd.data || page <= 0) continue;
            const uintptr_t a = ((uintptr_t)rows + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
            const uintptr_t b = ((uintptr_t)rows + (uintptr_t)ws[i]->rows * ws[i]->row_bytes) &
                                ~(uintptr_t)(page - 1);
            if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
        }
        m->packed_isa = (int)ops->isa;
    }
    free(ws), free(dst), free(sz);
    return 0;
}

int en_model_load(const char *path, en_model **out, km_errbuf *err)
{
    *out = NULL;
    en_model *m = calloc(1, sizeof *m);
    if (!m) return km_errf(err, KM_ENOMEM, "model: out of memory");
    m->packed_isa = -1;
    int rc = md_gguf_open(path, &m->gguf, err);
    if (!rc) rc = en_load_hparams(m, err);
    if (!rc) rc = en_load_weights(m, err);
    if (!rc) rc = md_tok_create(m->gguf, &m->tok, err);
    if (!rc && md_tok_n_vocab(m->tok) != m->hp.n_vocab)
        rc = km_errf(err, KM_EFORMAT, "model: tokenizer has %d tokens but the model %d",
                     md_tok_n_vocab(m->tok), m->hp.n_vocab);
    if (rc) {
        en_model_free(m);
        return rc;
    }
    /* name and fingerprint as model/modelinfo.c gives them to the router */
    md_model_display_name(path, m->name, sizeof m->name);
    m->chat = md_chat_detect(m->gguf);
    md_model_fingerprint_hex(m->gguf, m->fingerprint);
    *out = m;
    return 0;
}

void en_model_free(en_model *m)
{
    if (!m) return;
    md_tok_destroy(m->tok);
    md_gguf_close(m->gguf);
    free(m->layers);
    free(m->experts);
    free(m->packed_arena);
    free(m);
}

const en_hparams *en_model_hparams(const en_model *m)
{
    return &m->hp;
}
const md_tokenizer *en_model_tokenizer(const en_model *m)
{
    return m->tok;
}
const md_gguf *en_model_gguf(const en_model *m)
{
    return m->gguf;
}
const char *en_model_name(const en_model *m)
{
    return m->name;
}
md_chat_kind en_model_chat_kind(const en_model *m)
{
    return m->chat;
}
void en_model_fingerprint_hex(const en_model *m, char out[33])
{
    memcpy(out, m->fingerprint, 33);
}
