/*
 * view.c — the pure parts of the router's use of the controller's cluster view (router.h,
 * "cluster view"): how two spellings of a worker's endpoint are recognised as the same worker,
 * and which workers may get new requests given the router's own liveness and the view.
 *
 * Why it is built this way: the controller names workers by the endpoints their heartbeats
 * report (the worker's bound address, e.g. tcp://127.0.0.1:7100), while the router's --workers
 * list is written by a person or by `kvmesh up` (tcp://localhost:7100 works as well). The router
 * matches the two by endpoint, not by id, because the endpoint is what it is connected to; a
 * loopback or wildcard host is therefore normalised to 127.0.0.1 before comparing. The decision
 * "routable or not" is one small function so that the rule the router daemon applies is the rule
 * the unit tests check.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "router/router.h"

int rt_endpoint_norm(const char *url, char *out, size_t cap)
{
    if (!url || !out || !cap) return KM_EINVAL;
    const char *sep = strstr(url, "://");
    if (!sep) {
        if ((size_t)snprintf(out, cap, "%s", url) >= cap) return KM_ERANGE;
        return 0;
    }
    char scheme[16];
    size_t sl = (size_t)(sep - url);
    if (sl >= sizeof scheme) return KM_EINVAL;
    for (size_t i = 0; i < sl; i++) scheme[i] = (char)tolower((unsigned char)url[i]);
    scheme[sl] = 0;
    const char *host = sep + 3;
    if (strcmp(scheme, "tcp")) { /* ipc://, inproc://: the path is the identity */
        if ((size_t)snprintf(out, cap, "%s://%s", scheme, host) >= cap) return KM_ERANGE;
        return 0;
    }
    /* host ends at the last ':' (the port); an IPv6 host is bracketed */
    const char *colon = strrchr(host, ':');
    if (!colon || colon == host) return KM_EINVAL;
    char h[256];
    size_t hl = (size_t)(colon - host);
    if (hl >= sizeof h) return KM_ERANGE;
    for (size_t i = 0; i < hl; i++) h[i] = (char)tolower((unsigned char)host[i]);
    h[hl] = 0;
    static const char *const loop[] = {"localhost", "0.0.0.0", "*", "[::1]", "[::]", "::1"};
    for (size_t i = 0; i < sizeof loop / sizeof *loop; i++)
        if (!strcmp(h, loop[i])) {
            snprintf(h, sizeof h, "127.0.0.1");
            break;
        }
    if ((size_t)snprintf(out, cap, "tcp://%s%s", h, colon) >= cap) return KM_ERANGE;
    return 0;
}

bool rt_endpoint_same(const char *a, const char *b)
{
    if (!a || !b || !*a || !*b) return false;
    char na[512], nb[512];
    if (rt_endpoint_norm(a, na, sizeof na) || rt_endpoint_norm(b, nb, sizeof nb))
        return !strcmp(a, b);
    return !strcmp(na, nb);
}

bool rt_member_routable(bool connected, bool view_fresh, bool in_view, km_member_state state)
{
    if (!connected) return false; /* the router's own liveness always has a veto */
    if (!view_fresh || !in_view) return true;
    return state == KM_MEMBER_READY;
}

bool rt_member_migrates(bool view_fresh, bool in_view, km_member_state state)
{
    return view_fresh && in_view && state == KM_MEMBER_DEAD;
}
