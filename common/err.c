/*
 * err.c — km_err codes as text and the km_errbuf helper.
 *
 * Errors are plain negative integers (libuv style) so that every layer can pass them up without
 * translation; the human-readable context travels separately in a caller-owned km_errbuf, which
 * keeps the library free of hidden per-thread error state.
 */
#include "common/km.h"

#include <stdio.h>

const char *km_strerror(int err)
{
    switch (err) {
    case KM_OK:
        return "ok";
    case KM_EINVAL:
        return "invalid argument";
    case KM_ENOMEM:
        return "out of memory";
    case KM_EIO:
        return "i/o error";
    case KM_EFORMAT:
        return "malformed input";
    case KM_ERANGE:
        return "value out of range";
    case KM_ENOSPC:
        return "no space left in pool or buffer";
    case KM_ENOTFOUND:
        return "not found";
    case KM_EUNSUPPORTED:
        return "not supported";
    case KM_EAGAIN:
        return "try again";
    case KM_ETIMEDOUT:
        return "timed out";
    case KM_EPROTO:
        return "protocol violation";
    case KM_EOVERLOAD:
        return "overloaded";
    case KM_ECANCELED:
        return "canceled";
    case KM_ECORRUPT:
        return "checksum or consistency failure";
    case KM_EACCES:
        return "permission denied";
    }
    return "unknown error";
}

int km_errf(km_errbuf *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        if (n < 0) err->msg[0] = '\0';
    }
    return code;
}
