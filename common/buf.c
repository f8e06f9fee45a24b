/*
 * buf.c — km_buf, the growable byte buffer (km.h): frames, HTTP bodies, metrics text and JSON are
 * all built in one. It doubles its capacity as it grows and keeps it across km_buf_reset, so a
 * buffer reused per message stops allocating once it has seen the largest one.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/km.h"

int km_buf_reserve(km_buf *b, size_t extra)
{
    if (extra <= b->cap - b->len) return 0;
    if (extra > SIZE_MAX / 2 - b->len) return KM_ENOMEM;
    size_t need = b->len + extra;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    uint8_t *p = realloc(b->data, cap);
    if (!p) return KM_ENOMEM;
    b->data = p;
    b->cap = cap;
    return 0;
}

int km_buf_append(km_buf *b, const void *p, size_t n)
{
    if (n == 0) return 0;
    int rc = km_buf_reserve(b, n);
    if (rc) return rc;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

int km_buf_printf(km_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return KM_EINVAL;
    int rc = km_buf_reserve(b, (size_t)n + 1);
    if (rc) return rc;
    va_start(ap, fmt);
    vsnprintf((char *)b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

void km_buf_reset(km_buf *b)
{
    b->len = 0;
}

void km_buf_free(km_buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}
