/*
 * gguf_gen.c — kvmesh-gguf-gen: writes a Llama-family GGUF of a chosen shape with random weights
 * (md_gguf_gen, model/gguf_gen.c). Built from model/ and common/'s error code alone, so it builds
 * with only a C compiler wherever the GPU checks run (scripts/gpu_check.sh, docs/gpu.md).
 *
 *   kvmesh-gguf-gen [--shape tiny|1b|8b] [--layers N] [--dim N] [--heads N] [--kv-heads N]
 *                   [--ff N] [--vocab N] [--ctx N] [--type T] [--tied|--untied] [--seed N] -o PATH
 *
 * A shape preset sets every dimension; the flags after it override single ones. 1b is Llama
 * 3.2 1B's shape (tied output), 8b Llama 3 8B's. The weights are random: figures measured on
 * such a file hold for speed only, never for quality.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

static int usage(void)
{
    fprintf(stderr, "usage: kvmesh-gguf-gen [--shape tiny|1b|8b] [--layers N] [--dim N] "
                    "[--heads N] [--kv-heads N] [--ff N] [--vocab N] [--ctx N]\n"
                    "                       [--type F32|F16|BF16|Q4_0|Q4_1|Q8_0|Q4_K|Q6_K] "
                    "[--tied|--untied] [--seed N] -o PATH\n");
    return 2;
}

static int shape(const char *name, md_gguf_gen_cfg *c)
{
    if (!strcmp(name, "tiny")) {
        c->n_layers = 2, c->n_embd = 256, c->n_head = 4, c->n_head_kv = 2, c->n_ff = 512;
        c->n_vocab = 512, c->tied_output = 0;
    } else if (!strcmp(name, "1b")) {
        c->n_layers = 16, c->n_embd = 2048, c->n_head = 32, c->n_head_kv = 8, c->n_ff = 8192;
        c->n_vocab = 128256, c->tied_output = 1, c->rope_base = 500000.0f;
    } else if (!strcmp(name, "8b")) {
        c->n_layers = 32, c->n_embd = 4096, c->n_head = 32, c->n_head_kv = 8, c->n_ff = 14336;
        c->n_vocab = 128256, c->tied_output = 0, c->rope_base = 500000.0f;
    } else {
        return -1;
    }
    return 0;
}

static int type_of(const char *name, md_type *t)
{
    static const md_type types[] = {MD_TYPE_F32,  MD_TYPE_F16,  MD_TYPE_BF16, MD_TYPE_Q4_0,
                                    MD_TYPE_Q4_1, MD_TYPE_Q8_0, MD_TYPE_Q4_K, MD_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcasecmp(name, md_type_name(types[i]))) {
            *t = types[i];
            return 0;
        }
    return -1;
}

int main(int argc, char **argv)
{
    md_gguf_gen_cfg c = {.type = MD_TYPE_Q8_0, .seed = 1};
    shape("tiny", &c);
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int *num = !strcmp(a, "--layers")     ? &c.n_layers
                   : !strcmp(a, "--dim")      ? &c.n_embd
                   : !strcmp(a, "--heads")    ? &c.n_head
                   : !strcmp(a, "--kv-heads") ? &c.n_head_kv
                   : !strcmp(a, "--ff")       ? &c.n_ff
                   : !strcmp(a, "--vocab")    ? &c.n_vocab
                   : !strcmp(a, "--ctx")      ? &c.n_ctx
                                              : NULL;
        if (!strcmp(a, "--tied") || !strcmp(a, "--untied")) {
            c.tied_output = !strcmp(a, "--tied");
            continue;
        }
        if (!v) return usage();
        i++;
        if (num) {
            *num = atoi(v);
        } else if (!strcmp(a, "--shape")) {
            if (shape(v, &c)) return usage();
        } else if (!strcmp(a, "--type")) {
            if (type_of(v, &c.type)) return usage();
        } else if (!strcmp(a, "--seed")) {
            c.seed = strtoull(v, NULL, 0);
        } else if (!strcmp(a, "-o")) {
            out = v;
        } else {
            return usage();
        }
    }
    if (!out) return usage();
    km_errbuf err = {{0}};
    if (md_gguf_gen(&c, out, &err)) {
        fprintf(stderr, "kvmesh-gguf-gen: %s\n", err.msg);
        return 1;
    }
    printf("%s: llama, %d layers, dim %d, %d heads (%d kv), ff %d, vocab %d, %s%s, seed %llu\n",
           out, c.n_layers, c.n_embd, c.n_head, c.n_head_kv, c.n_ff, c.n_vocab,
           md_type_name(c.type), c.tied_output ? ", tied output" : "", (unsigned long long)c.seed);
    return 0;
}
