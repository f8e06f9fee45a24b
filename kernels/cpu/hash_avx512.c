/*
 * hash_avx512.c — XXH3's streaming update built for AVX-512 (kn_ops.xxh3_update). xxHash is
 * compiled inline here with its vector unit chosen explicitly; the state it updates is the one of
 * <xxhash.h>, identical in every build, so a caller may reset and digest it anywhere.
 */
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX512
#include <xxhash.h>

#include "kernels/cpu/internal.h"

void kn_xxh3_update_avx512(void *state, const void *p, size_t n)
{
    XXH3_64bits_update((XXH3_state_t *)state, p, n);
}
