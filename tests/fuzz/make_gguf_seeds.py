#!/usr/bin/env python3
"""make_gguf_seeds.py — writes the seed corpus of tests/fuzz/fuzz_gguf.c.

Small valid GGUF files (a few hundred bytes each) that between them use every value type,
string and numeric arrays, v2 and v3, a custom alignment, no tensors, and every tensor type the
reader knows, so the fuzzer starts from inputs that reach deep into the validation code.
Every file here is named valid_* and test_gguf.c checks that each one opens.

Usage: python3 tests/fuzz/make_gguf_seeds.py [outdir]   (default tests/fuzz/corpus/fuzz_gguf)
"""
import os
import struct
import sys

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
          BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}
# ggml type id -> (block elements, block bytes)
TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
         9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
         14: (256, 210), 15: (256, 292), 30: (1, 2)}


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(t, v):
    if t == STR:
        return gstr(v)
    if t == ARR:
        et, items = v
        out = struct.pack("<IQ", et, len(items))
        return out + b"".join(value(et, x) for x in items)
    return struct.pack(SCALAR[t], v)


def gguf(kvs, tensors, version=3, alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, [ne...], type)] laid out back to back."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for k, t, v in kvs:
        out += gstr(k) + struct.pack("<I", t) + value(t, v)
    offset, blobs = 0, []
    for name, ne, typ in tensors:
        be, bb = TYPES[typ]
        n = 1
        for x in ne:
            n *= x
        size = n // be * bb
        out += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", x) for x in ne)
        out += struct.pack("<IQ", typ, offset)
        blobs.append((offset, bytes((i * 37 + 11) & 0xFF for i in range(size))))
        offset = (offset + size + alignment - 1) // alignment * alignment
    if tensors:
        out += b"\0" * (-len(out) % alignment)
        data = bytearray(offset)
        for off, blob in blobs:
            data[off:off + len(blob)] = blob
        out += bytes(data)
    return out


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus", "fuzz_gguf")
    os.makedirs(outdir, exist_ok=True)
    seeds = {
        "valid_tiny_v3.gguf": gguf(
            [("general.architecture", STR, "llama"), ("llama.block_count", U32, 2),
             ("t.u8", U8, 7), ("t.i8", I8, -7), ("t.u16", U16, 700), ("t.i16", I16, -700),
             ("t.i32", I32, -70000), ("t.u64", U64, 1 << 40), ("t.i64", I64, -(1 << 40)),
             ("t.f32", F32, 0.5), ("t.f64", F64, 1e-5), ("t.bool", BOOL, 1),
             ("t.strs", ARR, (STR, ["<|endoftext|>", "a", ""])),
             ("t.ints", ARR, (I32, [1, -2, 3])), ("t.empty", ARR, (F32, []))],
            [("token_embd.weight", [32, 4], 8), ("output_norm.weight", [32], 0),
             ("blk.0.attn_q.weight", [32, 2], 3)]),
        "valid_v2_align64.gguf": gguf(
            [("general.alignment", U32, 64), ("general.name", STR, "v2"),
             ("t.bools", ARR, (BOOL, [0, 1, 1])), ("t.u64s", ARR, (U64, [1, 2]))],
            [("a", [256], 12), ("b", [3, 2], 1), ("c", [4, 1, 1, 2], 30)], version=2, alignment=64),
        "valid_vocab_only.gguf": gguf(
            [("tokenizer.ggml.model", STR, "gpt2"), ("tokenizer.ggml.pre", STR, "smollm"),
             ("tokenizer.ggml.tokens", ARR, (STR, ["<|endoftext|>", "h", "e", "he", "\u0120x"])),
             ("tokenizer.ggml.token_type", ARR, (I32, [3, 1, 1, 1, 1])),
             ("tokenizer.ggml.scores", ARR, (F32, [0.0, -1.0, -2.0, -3.0, -4.0])),
             ("tokenizer.ggml.merges", ARR, (STR, ["h e"])),
             ("tokenizer.ggml.bos_token_id", U32, 0), ("tokenizer.ggml.add_bos_token", BOOL, 0)],
            []),
        "valid_all_types.gguf": gguf(
            [("general.architecture", STR, "test")],
            [("t%d" % t, [be], t) for t, (be, _) in sorted(TYPES.items())]),
        "valid_header_only.gguf": gguf([], []),
    }
    for name, blob in seeds.items():
        with open(os.path.join(outdir, name), "wb") as f:
            f.write(blob)
        print("%s: %d bytes" % (name, len(blob)))


if __name__ == "__main__":
    main()
