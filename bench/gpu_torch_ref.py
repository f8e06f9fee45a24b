#!/usr/bin/env python3
"""gpu_torch_ref.py — the ceilings and the PyTorch figures `make gpu-check` prints beside kvmesh's
kernels (docs/gpu.md): device-to-device copy bandwidth, the bf16 matrix-product rate, and
PyTorch's own f16 and bf16 matrix-vector product on the shape test_cuda_kernels times
(14336 x 4096, one activation row), as GB/s of weight bytes.

Method as the device entry's METHOD.md: random data (never zeros), warm-ups, CUDA-event timing,
the median of repetitions, weight copies rotated so repeated runs do not hit in the L2. Without
PyTorch or a GPU it says so and exits 0. Output: a few table lines, also appended to the file
named by KVMESH_GPU_TABLE.
"""
import os
import statistics
import sys


def median_ms(fn, reps, torch):
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    try:
        import torch
    except ImportError as e:
        print(f"gpu_torch_ref: SKIP: no PyTorch ({e})")
        return 0
    if not torch.cuda.is_available():
        print("gpu_torch_ref: SKIP: PyTorch sees no CUDA device")
        return 0
    dev = torch.device("cuda")
    lines = [f"PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}"]

    n = 1 << 28  # 1 GiB of float32
    src = torch.rand(n, device=dev)
    dst = torch.empty_like(src)
    ms = median_ms(lambda i: dst.copy_(src), 20, torch)
    lines.append(f"torch copy (read + write, 1 GiB): {2 * n * 4 / ms / 1e6:.0f} GB/s")
    del src, dst

    s = 8192
    a = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    b = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    ms = median_ms(lambda i: a @ b, 10, torch)
    lines.append(f"torch bf16 matmul 8192^3 (random data): {2 * s**3 / ms / 1e9:.0f} TFLOP/s")
    del a, b

    rows, k = 14336, 4096
    for dt, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        ws = [torch.randn(rows, k, device=dev, dtype=dt) / k**0.5 for _ in range(4)]
        x = torch.randn(k, device=dev, dtype=dt)
        ms = median_ms(lambda i: torch.mv(ws[i % 4], x), 40, torch)
        lines.append(
            f"torch matvec {name} {rows} x {k}, m=1: {rows * k * 2 / ms / 1e6:.0f} GB/s of weights"
        )
        del ws, x

    for line in lines:
        print(line)
    table = os.environ.get("KVMESH_GPU_TABLE")
    if table:
        with open(table, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
