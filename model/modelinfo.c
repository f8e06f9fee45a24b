/*
 * modelinfo.c — a model's metadata without its weights (km.h, "model metadata"): the GGUF's
 * tokenizer and chat template, its display name and its fingerprint. The router needs exactly
 * these to tokenize and to seed the page-hash chain like the workers, and gets them here instead
 * of loading (and checking every weight tensor of) the model the way a worker does, which keeps
 * the engine out of kvmesh-router's link.
 *
 * The fingerprint and the name are computed here for the workers too (engine/model.c calls the
 * same two functions), so the two sides cannot drift apart.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/km.h"
#include "model/model.h"

struct md_model_info {
    md_gguf *gguf;
    md_tokenizer *tok;
    md_chat_kind chat;
    char name[128];
    char fingerprint[33];
};

const char *md_default_model_path(void)
{
    const char *env = getenv("KVMESH_MODEL");
    return env && *env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

void md_model_display_name(const char *path, char *out, size_t cap)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    snprintf(out, cap, "%s", base);
    char *dot = strstr(out, ".gguf");
    if (dot) *dot = 0;
}

void md_model_fingerprint_hex(const md_gguf *g, char out[33])
{
    size_t size;
    const uint8_t *p = md_gguf_file_data(g, &size);
    /* The header and metadata (first MiB) plus 64 KiB samples every 1/64 of the file: cheap,
     * and any re-quantization or fine-tune changes it. */
    XXH3_state_t *st = XXH3_createState();
    XXH3_128bits_reset(st);
    size_t head = size < (1u << 20) ? size : (1u << 20);
    XXH3_128bits_update(st, p, head);
    for (int i = 1; i < 64; i++) {
        size_t off = size / 64 * i, n = 65536;
        if (off + n > size) n = size - off;
        XXH3_128bits_update(st, p + off, n);
    }
    XXH3_128bits_update(st, &size, sizeof size);
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
}

int md_model_info_open(const char *path, md_model_info **out, km_errbuf *err)
{
    *out = NULL;
    md_model_info *m = calloc(1, sizeof *m);
    if (!m) return km_errf(err, KM_ENOMEM, "model: out of memory");
    int rc = md_gguf_open(path, &m->gguf, err);
    if (!rc) rc = md_tok_create(m->gguf, &m->tok, err);
    if (rc) {
        md_model_info_close(m);
        return rc;
    }
    m->chat = md_chat_detect(m->gguf);
    md_model_display_name(path, m->name, sizeof m->name);
    md_model_fingerprint_hex(m->gguf, m->fingerprint);
    *out = m;
    return 0;
}

void md_model_info_close(md_model_info *m)
{
    if (!m) return;
    md_tok_destroy(m->tok);
    md_gguf_close(m->gguf);
    free(m);
}

const md_tokenizer *md_model_info_tokenizer(const md_model_info *m)
{
    return m->tok;
}

md_chat_kind md_model_info_chat(const md_model_info *m)
{
    return m->chat;
}

const char *md_model_info_name(const md_model_info *m)
{
    return m->name;
}

const char *md_model_info_fingerprint(const md_model_info *m)
{
    return m->fingerprint;
}
