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

Usage: moe_from_dense.py SRC DST --experts 8 --used 2 --router gate-mean
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


def copy_fields(reader, writer, skip):
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in skip:
            continue
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
    ap.add_argument("--router", choices=("uniform", "gate-mean"), default="gate-mean")
    ap.add_argument("--split", choices=("contiguous", "kmeans"), default="contiguous",
                    help="neurons per expert: n_ff/E contiguous ones, or balanced k-means "
                    "clusters of their gate rows (re-quantizes ffn_down)")
    ap.add_argument("--router-scale", type=float, default=1.0,
                    help="multiplies the gate-mean router's logits (< 1: flatter weights)")
    a = ap.parse_args()
    E, k = a.experts, a.used
    if not 1 <= k <= E:
        die(f"--used {k} must be in [1, {E}]")
    scale = E if a.router == "uniform" else k
    if scale & (scale - 1):
        die(f"the down-projection scale {scale} must be a power of two (exact in f16)")

    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    if arch != "llama":
        die(f"architecture {arch} (only llama is supported)")
    n_ff = int(r.fields["llama.feed_forward_length"].contents())
    n_embd = int(r.fields["llama.embedding_length"].contents())
    if n_ff % E:
        die(f"n_ff {n_ff} is not a multiple of {E} experts")
    ff_e = n_ff // E
    tensors = {t.name: t for t in r.tensors}

    w = gguf.GGUFWriter(a.dst, arch="llama")
    copy_fields(r, w, skip={"general.architecture", "general.name", "llama.feed_forward_length"})
    name = r.fields["general.name"].contents() if "general.name" in r.fields else "model"
    w.add_name(f"{name} MoE {E}x{ff_e} top-{k} ({a.router} router)")
    w.add_feed_forward_length(ff_e)
    w.add_expert_count(E)
    w.add_expert_used_count(k)

    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up"):
            continue  # written with ffn_down, in the place of the dense FFN
        if not (len(parts) == 4 and parts[0] == "blk" and parts[2] == "ffn_down"):
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
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
        # neuron order: expert e owns perm[e*ff_e : (e+1)*ff_e]
        if a.split == "kmeans":
            perm = np.argsort(balanced_kmeans(g, E), kind="stable")
        else:
            perm = np.arange(n_ff)
        # router from the gate rows (dequantized; f64 mean, then f32)
        if a.router == "uniform":
            router = np.zeros((E, n_embd), dtype=np.float32)
        else:
            router = (g[perm].reshape(E, ff_e, n_embd).mean(axis=1) * a.router_scale)
            router = router.astype(np.float32)
        w.add_tensor(f"{blk}.ffn_gate_inp.weight", router)
        # gate/up: rows are neurons -> [E, ff_e, row bytes], the quantized rows as they are
        for src, dst in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps")):
            d = np.ascontiguousarray(src.data[perm].reshape(E, ff_e, -1))
            w.add_tensor(f"{blk}.{dst}.weight", d, raw_shape=d.shape, raw_dtype=src.tensor_type)
        # down: rows are output features, neurons along the row -> whole blocks per expert
        bel, bsize, _ = BLOCKS[down.tensor_type]
        if ff_e % bel:
            die(f"expert width {ff_e} is not a multiple of the {bel}-element block")
        nb = ff_e // bel
        dd = down.data
        if a.split == "kmeans":  # neurons moved across blocks: quantize the permuted columns
            dense = gguf.quants.dequantize(dd, down.tensor_type)
            dd = gguf.quants.quantize(np.ascontiguousarray(dense[:, perm]), down.tensor_type)
        d = dd.reshape(n_embd, E, nb * bsize).transpose(1, 0, 2)
        d = scale_blocks(np.ascontiguousarray(d), down.tensor_type, scale)
        w.add_tensor(f"{blk}.ffn_down_exps.weight", d, raw_shape=d.shape,
                     raw_dtype=down.tensor_type)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
