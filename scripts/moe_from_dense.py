#!/usr/bin/env python3
"""moe_from_dense.py - turns a dense llama-architecture GGUF into a Mixtral-layout MoE GGUF.

Each layer's FFN (ffn_gate, ffn_up: [n_embd, n_ff]; ffn_down: [n_ff, n_embd]) is split along its
n_ff intermediate neurons into E experts of n_ff/E contiguous neurons each, written as the 3-D
tensors llama.cpp's llama architecture loads (blk.N.ffn_gate_exps / ffn_up_exps: [n_embd,
n_ff/E, E]; ffn_down_exps: [n_ff/E, n_embd, E]) with a router blk.N.ffn_gate_inp ([n_embd, E],
F32). llama.feed_forward_length becomes n_ff/E (llama.cpp reads it as the expert width) and
llama.expert_count / llama.expert_used_count are added.

Weights stay in their quantized type, byte for byte: an expert's gate/up rows are the dense
matrix's rows, and its down slice is whole quantization blocks of the dense rows (n_ff/E must be a
multiple of the block size), so nothing is dequantized or re-quantized. The one change: the routed
weights of the top-k experts sum to 1 (llama.cpp's llama arch renormalizes them), so each expert's
down projection is scaled by `scale` (E with --router uniform, k otherwise), done exactly on the
per-block f16 scale and min (Q4_0/Q4_1/Q8_0: a power of two multiplies them without rounding).

Routers (--router):
  uniform   all logits 0: every expert gets 1/k; with k = E and scale = E the layer computes the
            dense FFN exactly (up to float summation order).
  gate-mean MoEfication-style: expert e's router row is the mean of its neurons' (dequantized)
            gate rows, so its logit is the mean pre-activation of the expert's gate neurons.
  mirror    top-k = E/2 over E/2 slices of the FFN, each written twice: expert e and expert
            e + E/2 are the same neurons, their router rows +r and -r (r: the mean gate row of
            the slice's first half of neurons less that of its second half). Of the logits {+s, -s} per slice the top E/2 are exactly one of each pair, the
            one whose sign is positive, so every token runs every slice once (the dense FFN's
            neurons), weighted by the softmax of |s| over the slices: which copy runs follows the
            text, and a copy flipped by rounding (s near 0) is the same neurons at the same
            weight. A sparse router whose output is continuous in its input: the top-k < E test
            that rounding cannot derail (docs/moe.md).

Other architectures (--arch), from the same llama-architecture source; every key `llama.X` is
written as `ARCH.X`:
  qwen2moe   llama.cpp's Qwen2-MoE: softmax weights NOT renormalized (each of E experts under a
             uniform router weighs 1/E whatever k, so down is scaled by E), plus a shared expert
             every token runs: the first --shared neurons of each FFN (ffn_{gate,up,down}_shexp,
             expert_shared_feed_forward_length; the routed experts split the rest,
             expert_feed_forward_length), its output times sigmoid(ffn_gate_inp_shexp . x). The
             gate vector is 2^-40 at element 0 and 0 elsewhere, so the logit is tiny but non-zero
             (llama.cpp takes the sigmoid as silu(z)/z, NaN at z = 0; it is non-zero unless that
             element of the normed input is exactly 0) and the sigmoid rounds to exactly 1/2 in
             f32: the shared down projection is scaled by 2. NeoX rope: the rows of attn_q and
             attn_k are permuted within each head from llama's interleaved pairs (2i, 2i+1) to
             (i, i + d/2), the inverse of the permutation llama's converter applies, so the
             attention scores are the dense model's (up to float summation order). Zero q/k/v
             biases (qwen2's) and an output.weight (llama.cpp requires one for qwen2moe: a copy
             of token_embd) are added.
  granitemoe llama.cpp's Granite-MoE: the Mixtral layout plus four multipliers, made non-trivial
             and compensated exactly on the f16 block scales (powers of two): embedding_scale 1/2
             (token_embd x 2; the tied output then gives logits x 2, undone by logit_scale 2),
             residual_scale 1/4 (attn_output x 4, every expert's down x 4 more), attention.scale
             1/16 (attn_q x 2 against the default 1/sqrt(64) = 1/8).
  olmoe      llama.cpp's OLMoE: weights not renormalized (down scaled by E as for qwen2moe), NeoX
             rope (q/k rows permuted as for qwen2moe), and RMS norms over each token's whole q and
             k (attn_q_norm, attn_k_norm, n_embd wide in llama.cpp's loader, so the kv heads are
             repeated to n_head: attn_k/attn_v rows copied per query head, exact), their weights
             the constant --qk-norm-weight. Those norms change the attention: this model is not
             the dense one (docs/moe.md). An output.weight is added as for qwen2moe.

Usage: moe_from_dense.py SRC DST --experts 8 --used 2 --router gate-mean [--arch A] [--shared N]
"""
import argparse
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

# Block layout of the types whose per-block scales can be multiplied exactly:
# type -> (elements per block, bytes per block, byte offsets of the f16 scale fields).
BLOCKS = {
    QT.Q4_0: (32, 18, (0,)),
    QT.Q4_1: (32, 20, (0, 2)),
    QT.Q5_0: (32, 22, (0,)),
    QT.Q5_1: (32, 24, (0, 2)),
    QT.Q8_0: (32, 34, (0,)),
}


def die(msg):
    print(f"moe_from_dense: error: {msg}", file=sys.stderr)
    sys.exit(1)


def copy_fields(reader, writer, skip, arch="llama"):
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in skip:
            continue
        if name.startswith("llama."):
            name = arch + name[len("llama"):]
        vtype = f.types[0]
        if vtype == VT.ARRAY:
            writer.add_key_value(name, f.contents(), vtype, sub_type=f.types[-1])
        else:
            writer.add_key_value(name, f.contents(), vtype)


def scale_blocks(data, qtype, scale):
    """data: uint8 [..., bytes]; multiplies every block's f16 scale fields by `scale` in place."""
    if scale == 1:
        return data
    _, bsize, offs = BLOCKS[qtype]
    blocks = data.reshape(-1, bsize)
    for o in offs:
        f = blocks[:, o:o + 2].copy().view(np.float16)
        g = (f.astype(np.float32) * scale).astype(np.float16)
        if not np.all(np.isfinite(g)) or not np.array_equal(g.astype(np.float32),
                                                           f.astype(np.float32) * scale):
            die(f"scaling {qtype.name} blocks by {scale} is not exact in f16")
        blocks[:, o:o + 2] = g.view(np.uint8).reshape(-1, 2)
    return data


def balanced_kmeans(rows, E, iters=15):
    """Spherical k-means of `rows` into E clusters of exactly len(rows)/E (greedy balanced
    assignment, best similarity first); deterministic (seeded start, stable sorts)."""
    n = rows.shape[0]
    cap = n // E
    x = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
    c = x[np.random.default_rng(0).choice(n, E, replace=False)]
    lab = np.zeros(n, dtype=np.int64)
    for _ in range(iters):
        order = np.argsort(-(x @ c.T), axis=None, kind="stable")
        lab[:] = -1
        cnt = np.zeros(E, dtype=np.int64)
        for f in order.tolist():
            i, e = divmod(f, E)
            if lab[i] < 0 and cnt[e] < cap:
                lab[i] = e
                cnt[e] += 1
        c = np.stack([x[lab == e].mean(axis=0) for e in range(E)])
        c /= np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-30)
    return lab


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--used", type=int, default=2)
    ap.add_argument("--router", choices=("uniform", "gate-mean", "mirror"), default="gate-mean")
    ap.add_argument("--split", choices=("contiguous", "kmeans"), default="contiguous",
                    help="neurons per expert: n_ff/E contiguous ones, or balanced k-means "
                    "clusters of their gate rows (re-quantizes ffn_down)")
    ap.add_argument("--router-scale", type=float, default=1.0,
                    help="multiplies the gate-mean router's logits (< 1: flatter weights)")
    ap.add_argument("--arch", choices=("llama", "qwen2moe", "granitemoe", "olmoe"),
                    default="llama")
    ap.add_argument("--qk-norm-weight", type=float, default=2.0,
                    help="olmoe: the constant weight of attn_q_norm and attn_k_norm")
    ap.add_argument("--shared", type=int, default=0,
                    help="qwen2moe: neurons of the shared expert (the first ones of each FFN)")
    a = ap.parse_args()
    E, k = a.experts, a.used
    if not 1 <= k <= E:
        die(f"--used {k} must be in [1, {E}]")
    mirror = a.router == "mirror"
    if mirror and (E % 2 or k != E // 2):
        die(f"--router mirror needs an even --experts and --used = experts / 2 (got {E}, {k})")
    if mirror and a.split != "contiguous":
        die("--router mirror takes --split contiguous")
    D = E // 2 if mirror else E  # distinct neuron slices
    # llama and granitemoe renormalize the chosen weights to sum 1, qwen2moe does not
    scale = E if a.router == "uniform" or a.arch in ("qwen2moe", "olmoe") else k
    if scale & (scale - 1):
        die(f"the down-projection scale {scale} must be a power of two (exact in f16)")
    S = a.shared
    if (S > 0) != (a.arch == "qwen2moe"):
        die("--shared N (N > 0) goes with --arch qwen2moe, and only with it")
    if S and a.split != "contiguous":
        die("--split kmeans is not supported with a shared expert")
    res_mul = 4 if a.arch == "granitemoe" else 1  # 1 / residual_scale

    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    if arch != "llama":
        die(f"architecture {arch} (only llama is supported)")
    n_ff = int(r.fields["llama.feed_forward_length"].contents())
    n_embd = int(r.fields["llama.embedding_length"].contents())
    if not 0 <= S < n_ff or (n_ff - S) % D:
        die(f"n_ff {n_ff} less {S} shared neurons is not a multiple of {D} slices")
    ff_e = (n_ff - S) // D
    tensors = {t.name: t for t in r.tensors}
    n_head = int(r.fields["llama.attention.head_count"].contents())
    n_head_kv = int(r.fields["llama.attention.head_count_kv"].contents())
    head_dim = n_embd // n_head

    w = gguf.GGUFWriter(a.dst, arch=a.arch)
    skip = {"general.architecture", "general.name", "llama.feed_forward_length"}
    if a.arch == "olmoe":
        skip.add("llama.attention.head_count_kv")
        w.add_head_count_kv(n_head)
    copy_fields(r, w, skip=skip, arch=a.arch)
    neox = a.arch in ("qwen2moe", "olmoe")  # llama.cpp's rope type for these
    name = r.fields["general.name"].contents() if "general.name" in r.fields else "model"
    if a.arch == "llama":
        w.add_name(f"{name} MoE {E}x{ff_e} top-{k} ({a.router} router)")
    else:
        w.add_name(f"{name} {a.arch} {E}x{ff_e}{f' + shared {S}' if S else ''} top-{k} "
                   f"({a.router} router)")
    if a.arch == "qwen2moe":
        w.add_feed_forward_length(n_ff)
        w.add_expert_feed_forward_length(ff_e)
        w.add_expert_shared_feed_forward_length(S)
    else:
        w.add_feed_forward_length(ff_e)
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    if a.arch == "granitemoe":
        w.add_float32("granitemoe.embedding_scale", 0.5)
        w.add_float32("granitemoe.residual_scale", 1.0 / res_mul)
        w.add_float32("granitemoe.attention.scale", 1.0 / (2 * head_dim ** 0.5))
        w.add_float32("granitemoe.logit_scale", 2.0)
    # tensors whose block scales a multiplier is compensated on (granitemoe)
    mult = {}
    if a.arch == "granitemoe":
        if head_dim != 64:
            die(f"head dim {head_dim}: attention.scale would not be a power of two")
        mult = {"token_embd": 2, "attn_q": 2, "attn_output": res_mul}

    def neox_rows(d, heads):
        """attn_q/attn_k rows from llama's interleaved rope pairs to NeoX halves, per head."""
        i = np.arange(head_dim // 2)
        per_head = np.concatenate([2 * i, 2 * i + 1])
        order = (np.arange(heads)[:, None] * head_dim + per_head[None, :]).reshape(-1)
        return np.ascontiguousarray(d[order])

    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up"):
            continue  # written with ffn_down, in the place of the dense FFN
        if not (len(parts) == 4 and parts[0] == "blk" and parts[2] == "ffn_down"):
            d = t.data
            base = parts[2] if parts[0] == "blk" else parts[0]
            if a.arch == "olmoe" and base in ("attn_k", "attn_v") and parts[-1] == "weight":
                # kv head h // (n_head / n_head_kv) for each query head h: the same attention
                kv = np.repeat(np.arange(n_head) // (n_head // n_head_kv), head_dim) * head_dim
                d = np.ascontiguousarray(d[kv + np.tile(np.arange(head_dim), n_head)])
            if neox and base in ("attn_q", "attn_k") and parts[-1] == "weight":
                d = neox_rows(d, n_head if base == "attn_q" or a.arch == "olmoe" else n_head_kv)
            if base in mult and parts[-1] == "weight":
                d = scale_blocks(np.array(d), t.tensor_type, mult[base])
            w.add_tensor(t.name, d, raw_shape=d.shape, raw_dtype=t.tensor_type)
            if a.arch == "qwen2moe" and base in ("attn_q", "attn_k", "attn_v") and \
                    parts[-1] == "weight" and f"{parts[0]}.{parts[1]}.{base}.bias" not in tensors:
                w.add_tensor(f"{parts[0]}.{parts[1]}.{base}.bias",
                             np.zeros(d.shape[0], dtype=np.float32))
            if a.arch == "olmoe" and base in ("attn_q", "attn_k") and parts[-1] == "weight":
                w.add_tensor(f"{parts[0]}.{parts[1]}.{base}_norm.weight",
                             np.full(n_embd, a.qk_norm_weight, dtype=np.float32))
            if t.name == "token_embd.weight" and neox and "output.weight" not in tensors:
                w.add_tensor("output.weight", d, raw_shape=d.shape, raw_dtype=t.tensor_type)
            continue
        blk = f"blk.{parts[1]}"
        gate, up, down = (tensors[f"{blk}.{n}.weight"] for n in ("ffn_gate", "ffn_up", "ffn_down"))
        for m in (gate, up, down):
            if m.tensor_type not in BLOCKS:
                die(f"{m.name} has type {m.tensor_type.name} (supported: "
                    f"{', '.join(q.name for q in BLOCKS)})")
        if list(gate.shape) != [n_embd, n_ff] or list(down.shape) != [n_ff, n_embd]:
            die(f"{blk}: FFN shapes {list(gate.shape)}, {list(down.shape)}")
        g = gguf.quants.dequantize(gate.data, gate.tensor_type).astype(np.float64)
        # neuron order: expert e owns perm[e*ff_e : (e+1)*ff_e] (after the S shared neurons)
        if a.split == "kmeans":
            perm = np.argsort(balanced_kmeans(g, E), kind="stable")
        else:
            perm = np.arange(S, n_ff)
        bel, bsize, _ = BLOCKS[down.tensor_type]
        if S:
            if S % bel:
                die(f"shared width {S} is not a multiple of the {bel}-element block")
            for src, dst in ((gate, "ffn_gate_shexp"), (up, "ffn_up_shexp")):
                d = np.ascontiguousarray(src.data[:S])
                w.add_tensor(f"{blk}.{dst}.weight", d, raw_shape=d.shape,
                             raw_dtype=src.tensor_type)
            d = np.ascontiguousarray(down.data[:, :S // bel * bsize])
            d = scale_blocks(d, down.tensor_type, 2)  # sigmoid(~0) = 1/2
            w.add_tensor(f"{blk}.ffn_down_shexp.weight", d, raw_shape=d.shape,
                         raw_dtype=down.tensor_type)
            gsh = np.zeros(n_embd, dtype=np.float32)
            gsh[0] = 2.0 ** -40
            w.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", gsh)
        # router from the gate rows (dequantized; f64 mean, then f32)
        if a.router == "uniform":
            router = np.zeros((E, n_embd), dtype=np.float32)
        else:
            gs = g[perm].reshape(D, ff_e, n_embd)
            if mirror:  # half the slice's gate rows less the other half: s = r . x has no sign
                h = ff_e // 2  # of its own, so both copies run (a gate-mean is mostly < 0)
                router = gs[:, :h].mean(axis=1) - gs[:, h:].mean(axis=1)
            else:
                router = gs.mean(axis=1)
            router = (router * a.router_scale).astype(np.float32)
            if mirror:
                router = np.concatenate([router, -router])
        w.add_tensor(f"{blk}.ffn_gate_inp.weight", router)
        # gate/up: rows are neurons -> [E, ff_e, row bytes], the quantized rows as they are
        for src, dst in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps")):
            d = np.ascontiguousarray(np.tile(src.data[perm].reshape(D, ff_e, -1),
                                             (E // D, 1, 1)))
            w.add_tensor(f"{blk}.{dst}.weight", d, raw_shape=d.shape, raw_dtype=src.tensor_type)
        # down: rows are output features, neurons along the row -> whole blocks per expert
        if ff_e % bel:
            die(f"expert width {ff_e} is not a multiple of the {bel}-element block")
        nb = ff_e // bel
        dd = down.data[:, S // bel * bsize:]
        if a.split == "kmeans":  # neurons moved across blocks: quantize the permuted columns
            dense = gguf.quants.dequantize(dd, down.tensor_type)
            dd = gguf.quants.quantize(np.ascontiguousarray(dense[:, perm]), down.tensor_type)
        d = np.tile(dd.reshape(n_embd, D, nb * bsize).transpose(1, 0, 2), (E // D, 1, 1))
        d = scale_blocks(np.ascontiguousarray(d), down.tensor_type, scale * res_mul)
        w.add_tensor(f"{blk}.ffn_down_exps.weight", d, raw_shape=d.shape,
                     raw_dtype=down.tensor_type)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
