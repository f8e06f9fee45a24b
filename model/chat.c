/*
 * chat.c — chat templates: the two families kvmesh serves (ChatML for SmolLM2 and Qwen2, the
 * Llama 3 header format), written out by hand instead of interpreting the GGUF's Jinja template.
 *
 * The output is exactly what the model's Jinja template renders (strings as in llama.cpp's
 * src/llama-chat.cpp), including the special-token texts, so the caller encodes it with
 * parse_special on and add_special off: the Llama 3 template writes <|begin_of_text|> itself.
 */
#define _GNU_SOURCE /* memmem */
#include <limits.h>
#include <string.h>

#include "common/km.h"
#include "model/model.h"

static int chat_contains(km_str s, const char *needle)
{
    return s.ptr && memmem(s.ptr, s.len, needle, strlen(needle)) != NULL;
}

md_chat_kind md_chat_detect(const md_gguf *g)
{
    km_str tmpl;
    if (!g || md_gguf_get_str(g, "tokenizer.chat_template", &tmpl)) return MD_CHAT_NONE;
    /* llama_chat_detect_template's tests for these two (other <|im_start|> families, such as
     * Phi-4's <|im_sep|>, are not ChatML proper). */
    if (chat_contains(tmpl, "<|im_start|>"))
        return chat_contains(tmpl, "<|im_sep|>") || chat_contains(tmpl, "<end_of_utterance>")
                   ? MD_CHAT_NONE
                   : MD_CHAT_CHATML;
    if (chat_contains(tmpl, "<|start_header_id|>") && chat_contains(tmpl, "<|end_header_id|>"))
        return MD_CHAT_LLAMA3;
    return MD_CHAT_NONE;
}

md_chat_kind md_chat_parse(const char *name)
{
    if (!name) return MD_CHAT_NONE;
    if (strcmp(name, "chatml") == 0) return MD_CHAT_CHATML;
    if (strcmp(name, "llama3") == 0) return MD_CHAT_LLAMA3;
    return MD_CHAT_NONE;
}

/* Output that counts what it cannot hold, like snprintf. */
typedef struct chat_out {
    char *buf;
    size_t cap, n;
} chat_out;

static void chat_put(chat_out *o, const char *s, size_t n)
{
    if (o->n < o->cap) {
        size_t room = o->cap - o->n;
        memcpy(o->buf + o->n, s, n < room ? n : room);
    }
    o->n += n;
}

static void chat_puts(chat_out *o, const char *s)
{
    chat_put(o, s, strlen(s));
}

static int chat_is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

int md_chat_apply(md_chat_kind kind, const md_chat_msg *msgs, int n, int add_assistant,
                  const char *default_system, char *out, size_t cap)
{
    if (n < 0 || (n > 0 && !msgs) || (cap > 0 && !out)) return KM_EINVAL;
    for (int i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content) return KM_EINVAL;
    if (kind != MD_CHAT_CHATML && kind != MD_CHAT_LLAMA3) return KM_EUNSUPPORTED;

    /* Room for the terminating NUL, which is written when anything fits. */
    chat_out o = {out, cap ? cap - 1 : 0, 0};
    if (kind == MD_CHAT_CHATML) {
        /* {% if loop.first and messages[0]['role'] != 'system' %} the default system turn */
        if (n > 0 && default_system && strcmp(msgs[0].role, "system") != 0) {
            chat_puts(&o, "<|im_start|>system\n");
            chat_puts(&o, default_system);
            chat_puts(&o, "<|im_end|>\n");
        }
        for (int i = 0; i < n; i++) {
            chat_puts(&o, "<|im_start|>");
            chat_puts(&o, msgs[i].role);
            chat_puts(&o, "\n");
            chat_puts(&o, msgs[i].content);
            chat_puts(&o, "<|im_end|>\n");
        }
        if (add_assistant) chat_puts(&o, "<|im_start|>assistant\n");
    } else {
        /* Meta-Llama-3-Instruct: bos_token before the first turn, each content | trim. */
        for (int i = 0; i < n; i++) {
            if (i == 0) chat_puts(&o, "<|begin_of_text|>");
            chat_puts(&o, "<|start_header_id|>");
            chat_puts(&o, msgs[i].role);
            chat_puts(&o, "<|end_header_id|>\n\n");
            const char *c = msgs[i].content;
            size_t len = strlen(c);
            while (len > 0 && chat_is_space(*c)) c++, len--;
            while (len > 0 && chat_is_space(c[len - 1])) len--;
            chat_put(&o, c, len);
            chat_puts(&o, "<|eot_id|>");
        }
        if (add_assistant) chat_puts(&o, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    }
    if (cap > 0) out[o.n < o.cap ? o.n : o.cap] = 0;
    if (o.n > INT_MAX) return KM_ERANGE;
    return (int)o.n;
}
