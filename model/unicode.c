/*
 * unicode.c — the little Unicode the tokenizer needs: UTF-8 decoding with llama.cpp's exact
 * leniency (so that invalid input splits and encodes the way llama.cpp's does), a strict UTF-8
 * check for the streaming detokenizer, category flags by binary search over the generated
 * ranges in unicode_data.c, and GPT-2's byte-to-code-point alphabet.
 */
#include "model/tok_internal.h"

uint16_t tok_ucd_flags(uint32_t cpt)
{
    if (cpt < 256) return md_unicode_latin1[cpt];
    if (cpt >= 0x110000) return 0;
    /* Last range whose first <= cpt; ranges[0].first == 0. */
    int lo = 0, hi = md_unicode_n_ranges - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (md_unicode_ranges[mid].first <= cpt)
            lo = mid;
        else
            hi = mid - 1;
    }
    return md_unicode_ranges[lo].flags;
}

int tok_utf8_lead_len(unsigned char lead)
{
    static const unsigned char len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[lead >> 4];
}

/* llama.cpp's unicode_cpt_from_utf8 checks the lead byte's prefix and that the continuation
 * bytes are 10xxxxxx, nothing more; a failure costs one byte and yields U+FFFD
 * (unicode_cpts_from_utf8). Code points past U+10FFFF (F4 90.. to F7 ..) make llama.cpp throw
 * later on; here they are invalid like any other bad byte. */
uint32_t tok_utf8_decode(const unsigned char *s, size_t n, size_t *used)
{
    unsigned char c = s[0];
    *used = 1;
    if (c < 0x80) return c;
    if ((c & 0x40) == 0) return 0xFFFD;
    if ((c & 0x20) == 0) {
        if (n < 2 || (s[1] & 0xC0) != 0x80) return 0xFFFD;
        *used = 2;
        return (uint32_t)(c & 0x1F) << 6 | (s[1] & 0x3F);
    }
    if ((c & 0x10) == 0) {
        if (n < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0xFFFD;
        *used = 3;
        return (uint32_t)(c & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
    }
    if ((c & 0x08) == 0) {
        if (n < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80)
            return 0xFFFD;
        uint32_t cpt = (uint32_t)(c & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 |
                       (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
        if (cpt > 0x10FFFF) return 0xFFFD;
        *used = 4;
        return cpt;
    }
    return 0xFFFD;
}

int tok_utf8_encode(uint32_t cpt, char *out)
{
    if (cpt <= 0x7F) {
        out[0] = (char)cpt;
        return 1;
    }
    if (cpt <= 0x7FF) {
        out[0] = (char)(0xC0 | cpt >> 6);
        out[1] = (char)(0x80 | (cpt & 0x3F));
        return 2;
    }
    if (cpt <= 0xFFFF) {
        out[0] = (char)(0xE0 | cpt >> 12);
        out[1] = (char)(0x80 | (cpt >> 6 & 0x3F));
        out[2] = (char)(0x80 | (cpt & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cpt >> 18 & 0x07));
    out[1] = (char)(0x80 | (cpt >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cpt >> 6 & 0x3F));
    out[3] = (char)(0x80 | (cpt & 0x3F));
    return 4;
}

/* Well-formed UTF-8 per the Unicode standard (table 3-7): the second byte's range depends on the
 * lead (no overlong forms, no surrogates, nothing past U+10FFFF). Bad input is replaced by
 * maximal subparts, as Python's errors="replace" and HF tokenizers do. */
int tok_utf8_check(const unsigned char *s, size_t n, size_t *len)
{
    unsigned char c = s[0];
    size_t need;
    unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c < 0x80) {
        *len = 1;
        return TOK_UTF8_OK;
    }
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        *len = 1;
        return TOK_UTF8_BAD;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) {
            *len = n;
            return TOK_UTF8_PARTIAL;
        }
        unsigned char b = s[i];
        int ok = i == 1 ? (b >= lo && b <= hi) : (b & 0xC0) == 0x80;
        if (!ok) {
            *len = i;
            return TOK_UTF8_BAD;
        }
    }
    *len = need;
    return TOK_UTF8_OK;
}

/* bytes_to_unicode() of GPT-2's encoder.py: printable Latin-1 stays, the 68 others are numbered
 * from U+0100 in byte order. */
void tok_byte_map(uint32_t byte_cpt[256])
{
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        byte_cpt[b] = printable ? (uint32_t)b : next++;
    }
}
