/*
 * state.c — the bottom of router/'s layers (internal.h): the clock, and the loop's hooks that
 * the lower files call up through (rt_pump drains every socket, router.c sets what it runs).
 */
#include <uv.h>

#include "router/internal.h"

uint64_t rt_now_ms(void)
{
    return km_now_ns() / 1000000ull;
}

void rt_pump(rt_router *r)
{
    r->pump(r);
}

static void on_zpoll(uv_poll_t *p, int status, int events)
{
    rt_pump(p->data);
}

int rt_open_poll(rt_router *r, uv_poll_t *p, void *sock, km_errbuf *err)
{
    int fd;
    int rc = km_zsock_fd(sock, &fd, err);
    if (rc) return rc;
    uv_poll_init(&r->loop, p, fd);
    p->data = r;
    uv_poll_start(p, UV_READABLE, on_zpoll);
    return 0;
}
