/*
 * hash_avx512.c — kn_ops.xxh3_update of the AVX-512 table forwards to the AVX2 build. This file
 * first compiled xxHash's AVX-512 loop (XXH_VECTOR XXH_AVX512), faster than the AVX2 one alone
 * in L1; but as a transfer's receiver hashes fragments between the kernel's and its own copies,
 * its 512-bit multiplies slowed the whole thread, and pulls read less with it than with the AVX2
 * loop (figures and how to measure them again: docs/benchmarks.md, "xxh3 inside a transfer's
 * receiver").
 */
#include "kernels/cpu/internal.h"

void kn_xxh3_update_avx512(void *state, const void *p, size_t n)
{
    kn_xxh3_update_avx2(state, p, n);
}
