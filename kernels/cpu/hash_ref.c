/*
 * hash_ref.c — XXH3's streaming update in plain C (kn_ops.xxh3_update of the scalar table):
 * xxHash compiled inline with no vector unit at all (XXH_SCALAR), the reference the SIMD builds
 * (hash_avx2.c, hash_avx512.c) are held to. The state it updates is the one of <xxhash.h>,
 * identical in every build, so a caller may reset and digest it anywhere.
 */
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_SCALAR
#include <xxhash.h>

#include "kernels/cpu/internal.h"

void kn_xxh3_update_ref(void *state, const void *p, size_t n)
{
    XXH3_64bits_update((XXH3_state_t *)state, p, n);
}
