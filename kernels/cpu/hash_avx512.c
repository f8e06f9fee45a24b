/*
 * hash_avx512.c — kn_ops.xxh3_update of the AVX-512 table forwards to the AVX2 build. This file
 * first compiled xxHash's AVX-512 loop (XXH_VECTOR XXH_AVX512), ~14% faster than the AVX2 one
 * alone in L1 (a scratch loop over 16 KiB pieces, Intel Xeon); but as a transfer's receiver
 * hashes fragments between the kernel's and its own copies, its 512-bit multiplies slowed the
 * whole thread: pulls of 16 pages over TCP read 3.83-3.96 GB/s with it and 4.02-4.19 with the
 * AVX2 loop (bench_transfer --only-tls tcp --only-mode am, KVMESH_ISA=avx512 vs avx2 alternated
 * three times, Intel Xeon with AVX-512). To measure it again: put the AVX-512 loop back here and
 * run the same (and bench_kernels -x for the loops alone).
 */
#include "kernels/cpu/internal.h"

void kn_xxh3_update_avx512(void *state, const void *p, size_t n)
{
    kn_xxh3_update_avx2(state, p, n);
}
