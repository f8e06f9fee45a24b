/*
 * hash_avx512.c — kn_ops.xxh3_update of the AVX-512 table forwards to the AVX2 build. xxHash's
 * AVX-512 loop hashes a page ~14% faster alone in L1 (54.6 vs 47.7 GB/s, Intel Xeon), but as a
 * transfer's receiver hashes fragments between the kernel's and its own copies, its 512-bit
 * multiplies slowed the whole thread: pulls of 16 pages over TCP read 3.83-3.96 GB/s with it and
 * 4.02-4.19 with the AVX2 loop (bench_transfer, three alternated rounds, Intel Xeon with AVX-512).
 */
#include "kernels/cpu/internal.h"

void kn_xxh3_update_avx512(void *state, const void *p, size_t n)
{
    kn_xxh3_update_avx2(state, p, n);
}
