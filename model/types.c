/*
 * types.c — the ggml tensor-type table: elements and bytes per block, names, row sizes.
 *
 * The ids and block geometry are ggml's (ggml.h / ggml.c type_traits), so a GGUF written by
 * llama.cpp is read without translation. Only the types kvmesh can compute with are listed;
 * every other id reads as unknown (0 elements, 0 bytes, "unknown"), which the GGUF reader turns
 * into a clear "unsupported tensor type" error instead of a guess.
 */
#include "common/km.h"
#include "model/model.h"

#include <stdint.h>

typedef struct md_type_info {
    const char *name;
    int block_elems;
    int block_bytes;
} md_type_info;

static const md_type_info md_types[MD_TYPE_COUNT] = {
    [MD_TYPE_F32] = {"F32", 1, 4},       [MD_TYPE_F16] = {"F16", 1, 2},
    [MD_TYPE_Q4_0] = {"Q4_0", 32, 18},   [MD_TYPE_Q4_1] = {"Q4_1", 32, 20},
    [MD_TYPE_Q5_0] = {"Q5_0", 32, 22},   [MD_TYPE_Q5_1] = {"Q5_1", 32, 24},
    [MD_TYPE_Q8_0] = {"Q8_0", 32, 34},   [MD_TYPE_Q8_1] = {"Q8_1", 32, 36},
    [MD_TYPE_Q2_K] = {"Q2_K", 256, 84},  [MD_TYPE_Q3_K] = {"Q3_K", 256, 110},
    [MD_TYPE_Q4_K] = {"Q4_K", 256, 144}, [MD_TYPE_Q5_K] = {"Q5_K", 256, 176},
    [MD_TYPE_Q6_K] = {"Q6_K", 256, 210}, [MD_TYPE_Q8_K] = {"Q8_K", 256, 292},
    [MD_TYPE_BF16] = {"BF16", 1, 2},
};

static const md_type_info *md_type_lookup(uint32_t type)
{
    if (type >= MD_TYPE_COUNT || md_types[type].block_elems == 0) return NULL;
    return &md_types[type];
}

int md_type_block_elems(uint32_t type)
{
    const md_type_info *t = md_type_lookup(type);
    return t ? t->block_elems : 0;
}

int md_type_block_bytes(uint32_t type)
{
    const md_type_info *t = md_type_lookup(type);
    return t ? t->block_bytes : 0;
}

const char *md_type_name(uint32_t type)
{
    const md_type_info *t = md_type_lookup(type);
    return t ? t->name : "unknown";
}

size_t md_type_row_bytes(uint32_t type, int64_t n)
{
    const md_type_info *t = md_type_lookup(type);
    if (!t || n <= 0 || n % t->block_elems != 0) return 0;
    uint64_t bytes;
    if (__builtin_mul_overflow((uint64_t)(n / t->block_elems), (uint64_t)t->block_bytes, &bytes))
        return 0;
    if (bytes > SIZE_MAX) return 0;
    return (size_t)bytes;
}
