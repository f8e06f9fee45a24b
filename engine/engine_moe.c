/*
 * engine_moe.c — the FFN of MoE layers (hp.n_expert > 0; docs/moe.md), run inside engine.c's
 * step job in place of the dense P8-P11 (en_moe_ffn):
 *   R  tokens  router logits = xn · Wgate_inp^T (scalar f32), softmax, top k; the chosen
 *              probabilities divided by their sum (hp.moe_norm_w: llama, mistral, granitemoe) or
 *              kept as they are (qwen2moe, olmoe): llama.cpp's build_moe_ffn with each arch's
 *              norm_w (no arch here reads expert_weights_scale); qwen2moe's shared-expert gate
 *              sigmoid(Wgate_inp_shexp · xn)
 *              (when the batch asks for en_batch.route, each token's chosen weights are also
 *              summed per expert over the layers: its dominant expert, which places its page)
 *   G  slots   every thread groups the batch's (token, choice) pairs by expert ("slots", in
 *              expert then token order) and copies the quantized xn rows of its share of slots
 *   P8 rows    per expert over its slots: gate, up = xq · {Wgate_e,Wup_e}^T (each expert's rows
 *              are read once per step, however many tokens chose it); the shared expert's gate
 *              and up over every token
 *   P9 slots   silu(gate) * up, quantized (then the shared expert's, per token, into xq)
 *   P10 rows   per expert: out = xq · Wdown_e^T; the shared expert's down into tmp
 *   P11 tokens x += sum over the token's choices, in selection order, of weight * out, plus the
 *              shared expert's output times its gate (granitemoe's shared expert: gate 1),
 *              scaled by granite's residual_scale if it has one
 * through the same matmul kernels as the dense path (a slice of a 3-D expert tensor is one more
 * matrix). The split of rows phases counts rows, not rows times tokens, so experts chosen by many
 * tokens weigh no more than others in it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

/* ------------------------------------------------------------------ MoE */

/* One thread's MoE scratch: the batch's (token, choice) pairs grouped by expert into slots. */
typedef struct en_moe_scr {
    int32_t *off;      /* [n_expert + 1]: expert x's slots are off[x] .. off[x + 1] - 1 */
    int32_t *cur;      /* [n_expert] */
    int32_t *slot_tok; /* [T * k]: the token of each slot */
    int32_t *slot_of;  /* [T * k]: the slot of token i's choice j, at i * k + j */
    en_mm *mm;         /* [2 * n_expert + 2] */
} en_moe_scr;

int en_moe_alloc(en_engine *e, int nth)
{
    const en_hparams *hp = &e->m->hp;
    const size_t S = (size_t)e->max_tokens * hp->n_expert_used, E = hp->n_expert;
    e->sel = en_alloc(S * sizeof(int32_t));
    e->rw = en_alloc(S * 4);
    e->xqg = en_alloc(S * e->xq_row_bytes);
    e->moe_out = en_alloc(S * hp->n_embd * 4);
    e->moe = calloc((size_t)nth, sizeof *e->moe);
    e->route_w = en_alloc((size_t)e->max_tokens * E * sizeof(float));
    if (!e->sel || !e->rw || !e->xqg || !e->moe_out || !e->moe || !e->route_w) return KM_ENOMEM;
    if (hp->n_ff_shexp) {
        const size_t T = (size_t)e->max_tokens;
        e->shw = en_alloc(T * 4);
        e->sh_gate = en_alloc(T * hp->n_ff_shexp * 4);
        e->sh_up = en_alloc(T * hp->n_ff_shexp * 4);
        if (!e->shw || !e->sh_gate || !e->sh_up) return KM_ENOMEM;
    }
    for (int i = 0; i < nth; i++) {
        en_moe_scr *s = &e->moe[i];
        s->off = en_alloc((E + 1) * sizeof(int32_t));
        s->cur = en_alloc(E * sizeof(int32_t));
        s->slot_tok = en_alloc(S * sizeof(int32_t));
        s->slot_of = en_alloc(S * sizeof(int32_t));
        s->mm = en_alloc((2 * E + 2) * sizeof(en_mm)); /* and the shared expert */
        if (!s->off || !s->cur || !s->slot_tok || !s->slot_of || !s->mm) return KM_ENOMEM;
    }
    return 0;
}

void en_moe_free(en_engine *e)
{
    for (int i = 0; e->moe && e->pool && i < kn_pool_size(e->pool); i++) {
        free(e->moe[i].off);
        free(e->moe[i].cur);
        free(e->moe[i].slot_tok);
        free(e->moe[i].slot_of);
        free(e->moe[i].mm);
    }
    free(e->moe);
    free(e->sel);
    free(e->rw);
    free(e->xqg);
    free(e->moe_out);
    free(e->route_w);
    free(e->shw);
    free(e->sh_gate);
    free(e->sh_up);
}

/* The router of one token, as llama.cpp's build_moe_ffn runs it with softmax gating: logits =
 * Wgate_inp · xn, probabilities = softmax (max subtracted, the sum in double, scaled by its
 * inverse as ggml_soft_max does), the k most probable experts (the lower id first on a tie), with
 * norm_w their probabilities divided by their sum (clamped to >= 2^-14). sel, w: k entries, most
 * probable first. Plain C, so every ISA routes alike. */
static void en_route(const en_weight *gate_inp, int n_embd, int n_exp, int k, int norm_w,
                     const float *xn, int32_t *sel, float *w)
{
    float p[EN_MAX_EXPERTS] = {0};
    uint8_t used[EN_MAX_EXPERTS] = {0};
    const float *W = gate_inp->data;
    float mx = -INFINITY;
    for (int x = 0; x < n_exp; x++) {
        const float *r = W + (size_t)x * n_embd;
        float s = 0;
        for (int j = 0; j < n_embd; j++) s += r[j] * xn[j];
        p[x] = s;
        if (s > mx) mx = s;
    }
    double sum = 0;
    for (int x = 0; x < n_exp; x++) {
        p[x] = expf(p[x] - mx);
        sum += p[x];
    }
    const float inv = (float)(1.0 / sum);
    for (int x = 0; x < n_exp; x++) p[x] *= inv;
    double wsum = 0;
    for (int j = 0; j < k; j++) {
        int best = 0;
        while (used[best]) best++;
        for (int x = best + 1; x < n_exp; x++)
            if (!used[x] && p[x] > p[best]) best = x;
        used[best] = 1;
        sel[j] = best;
        wsum += p[best];
    }
    float ws = (float)wsum;
    if (!(ws >= 6.103515625e-5f)) ws = 6.103515625e-5f;
    for (int j = 0; j < k; j++) w[j] = norm_w ? p[sel[j]] / ws : p[sel[j]];
}

/* qwen2moe's shared-expert gate: sigmoid(Wgate_inp_shexp · xn) (llama.cpp takes silu(z) / z, the
 * same but for z = 0, where it is NaN). */
static float en_shexp_gate(const en_weight *g, int n_embd, const float *xn)
{
    const float *w = g->data;
    float z = 0;
    for (int j = 0; j < n_embd; j++) z += w[j] * xn[j];
    return 1.0f / (1.0f + expf(-z));
}

/* Groups the n tokens' k choices by expert: slots in expert order, tokens in order within one. */
static void en_moe_group(const int32_t *sel, int n, int k, int n_exp, en_moe_scr *s)
{
    memset(s->off, 0, (size_t)(n_exp + 1) * sizeof(int32_t));
    memset(s->cur, 0, (size_t)n_exp * sizeof(int32_t));
    for (int i = 0; i < n * k; i++) s->off[sel[i] + 1]++;
    for (int x = 0; x < n_exp; x++) s->off[x + 1] += s->off[x];
    for (int i = 0; i < n * k; i++) {
        const int x = sel[i], slot = s->off[x] + s->cur[x]++;
        s->slot_tok[slot] = i / k;
        s->slot_of[i] = slot;
    }
}

/* The MoE FFN of layer L (P8-P11 of a MoE layer, see the top of the file); xn holds the normed
 * tokens and xq their quantized rows for the experts' gate/up. Lanes: every thread routes and
 * gathers every token itself. */
void en_moe_ffn(const en_step *st, const en_layer *L, int n, int ith, int nth, int64_t t0,
                int64_t t1, float *x, float *xn, float *act, uint8_t *xq)
{
    en_engine *e = st->e;
    const en_hparams *hp = &e->m->hp;
    const kn_ops *ops = e->ops;
    const int embd = hp->n_embd, ff = hp->n_ff, lanes = st->lanes;
    const int n_exp = hp->n_expert, k = hp->n_expert_used;
    const size_t xrb = e->xq_row_bytes;
    int32_t *sel = lanes ? e->lanes[ith].sel : e->sel;
    float *rw = lanes ? e->lanes[ith].rw : e->rw;
    uint8_t *xqg = lanes ? e->lanes[ith].xqg : e->xqg;
    en_moe_scr *s = &e->moe[ith];
    const int ffs = hp->n_ff_shexp;
    float *shw = lanes ? e->lanes[ith].shw : e->shw;
    /* R */
    for (int64_t i = t0; i < t1; i++) {
        en_route(&L->gate_inp, embd, n_exp, k, hp->moe_norm_w, xn + i * embd, sel + i * k,
                 rw + i * k);
        if (ffs)
            shw[i] =
                L->gate_inp_sh.data ? en_shexp_gate(&L->gate_inp_sh, embd, xn + i * embd) : 1.0f;
    }
    for (int64_t i = t0; st->route && i < t1; i++) /* lanes: each token by its owner */
        if (!lanes || i % nth == ith)
            for (int j = 0; j < k; j++) e->route_w[i * n_exp + sel[i * k + j]] += rw[i * k + j];
    if (!lanes) kn_pool_barrier(e->pool);
    /* G */
    en_moe_group(sel, n, k, n_exp, s);
    int64_t s0 = 0, s1 = (int64_t)n * k;
    if (!lanes) kn_split(s1, ith, nth, &s0, &s1);
    for (int64_t j = s0; j < s1; j++) memcpy(xqg + j * xrb, xq + (size_t)s->slot_tok[j] * xrb, xrb);
    if (!lanes) kn_pool_barrier(e->pool);
    /* P8 */
    int nmm = 0;
    for (int xe = 0; xe < n_exp; xe++) {
        const int c = s->off[xe + 1] - s->off[xe];
        const size_t o = (size_t)s->off[xe];
        if (!c) continue;
        s->mm[nmm++] = (en_mm){&L->exp_gate[xe], e->gate + o * ff, ff, NULL, xqg + o * xrb, c};
        s->mm[nmm++] = (en_mm){&L->exp_up[xe], e->up + o * ff, ff, NULL, xqg + o * xrb, c};
    }
    if (ffs) {
        s->mm[nmm++] = (en_mm){&L->w_gate, e->sh_gate, ffs, NULL, xq, n};
        s->mm[nmm++] = (en_mm){&L->w_up, e->sh_up, ffs, NULL, xq, n};
    }
    en_matmul_group(e, xqg, s->mm, nmm, 0, ith, nth);
    kn_pool_barrier(e->pool);
    /* P9 (lanes: into the thread's own buffers; gate is shared) */
    float *a = lanes ? act : e->gate;
    for (int64_t j = s0; j < s1; j++)
        ops->silu_mul(a + j * ff, e->gate + j * ff, e->up + j * ff, ff);
    en_quantize_rows(e, &L->exp_down[0], a, xqg, s0, s1);
    if (ffs) { /* xq is free since P8's barrier (lanes: act, once the slots are quantized) */
        float *sa = lanes ? act : e->sh_gate;
        for (int64_t i = t0; i < t1; i++)
            ops->silu_mul(sa + i * ffs, e->sh_gate + i * ffs, e->sh_up + i * ffs, ffs);
        en_quantize_rows(e, &L->w_down, sa, xq, t0, t1);
    }
    if (!lanes) kn_pool_barrier(e->pool);
    /* P10 */
    nmm = 0;
    for (int xe = 0; xe < n_exp; xe++) {
        const int c = s->off[xe + 1] - s->off[xe];
        const size_t o = (size_t)s->off[xe];
        if (!c) continue;
        s->mm[nmm++] =
            (en_mm){&L->exp_down[xe], e->moe_out + o * embd, embd, NULL, xqg + o * xrb, c};
    }
    if (ffs) s->mm[nmm++] = (en_mm){&L->w_down, e->tmp, embd, NULL, xq, n};
    en_matmul_group(e, xqg, s->mm, nmm, 0, ith, nth);
    kn_pool_barrier(e->pool);
    /* P11: the weighted outputs added in selection order (ggml_mul, then ggml_add of the views in
     * llama.cpp), into xn (free until the next layer's P1), then the shared expert's output times
     * its gate (ggml_mul, ggml_add), then the residual */
    for (int64_t i = t0; i < t1; i++) {
        float *acc = xn + i * embd;
        for (int j = 0; j < k; j++) {
            const float wj = rw[i * k + j];
            const float *o = e->moe_out + (size_t)s->slot_of[i * k + j] * embd;
            if (!j)
                for (int d = 0; d < embd; d++) acc[d] = wj * o[d];
            else
                for (int d = 0; d < embd; d++) acc[d] += wj * o[d];
        }
        if (ffs) {
            const float g = shw[i], *o = e->tmp + i * embd;
            for (int d = 0; d < embd; d++) {
                const float v = g * o[d];
                acc[d] += v;
            }
        }
        en_residual_add(e, x + i * embd, acc);
    }
}
