/*
 * dispatch.c — builds one kn_ops table per instruction set and picks the best one the CPU
 * supports. The choice is made at run time (cpuid + OS support via __builtin_cpu_supports), so a
 * binary built here runs on any x86-64; KVMESH_ISA caps it for tests and comparisons.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/internal.h"

#define KN_TABLE(sfx, id, nm)                                                                      \
    {                                                                                              \
        .isa = id, .name = nm, .quantize_row = kn_quantize_row_##sfx,                              \
        .dequantize_row = kn_dequantize_row_##sfx, .matmul = kn_matmul_##sfx,                      \
        .pack_size = kn_pack_size_##sfx, .pack = kn_pack_##sfx,                                    \
        .matmul_packed = kn_matmul_packed_##sfx, .rmsnorm = kn_rmsnorm_##sfx,                      \
        .rope = kn_rope_##sfx, .silu_mul = kn_silu_mul_##sfx, .add = kn_add_##sfx,                 \
        .f32_to_f16 = kn_f32_to_f16_##sfx, .f16_to_f32 = kn_f16_to_f32_##sfx,                      \
        .attention = kn_attention_##sfx, .attention_multi = kn_attention_multi_##sfx,              \
        .xxh3_update = kn_xxh3_update_##sfx, .page_scores = kn_page_scores_##sfx,                  \
    }

static const kn_ops kn_tables[KN_ISA_COUNT] = {
    KN_TABLE(ref, KN_ISA_SCALAR, "scalar"),
    KN_TABLE(avx2, KN_ISA_AVX2, "avx2"),
    KN_TABLE(avx512, KN_ISA_AVX512, "avx512"),
};

static int kn_cpu_has(kn_isa isa)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    switch (isa) {
    case KN_ISA_SCALAR:
        return 1;
    case KN_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case KN_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma");
    default:
        return 0;
    }
#else
    return isa == KN_ISA_SCALAR;
#endif
}

const kn_ops *kn_ops_get(kn_isa isa)
{
    if ((int)isa < 0 || isa >= KN_ISA_COUNT || !kn_cpu_has(isa)) return NULL;
    return &kn_tables[isa];
}

const kn_ops *kn_ops_best(void)
{
    int cap = KN_ISA_COUNT - 1;
    const char *env = getenv("KVMESH_ISA");
    if (env) {
        if (!strcmp(env, "scalar"))
            cap = KN_ISA_SCALAR;
        else if (!strcmp(env, "avx2"))
            cap = KN_ISA_AVX2;
        else if (!strcmp(env, "avx512"))
            cap = KN_ISA_AVX512;
    }
    for (int i = cap; i > 0; i--)
        if (kn_cpu_has((kn_isa)i)) return &kn_tables[i];
    return &kn_tables[KN_ISA_SCALAR];
}

int kn_ops_slowdown(const kn_ops *o)
{
    return o && o->isa == KN_ISA_SCALAR ? 30 : 1;
}
