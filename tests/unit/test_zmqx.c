/*
 * test_zmqx.c — the ZeroMQ helpers over real sockets: ROUTER/DEALER round trips with identity
 * frames over inproc:// and tcp://127.0.0.1 (ephemeral ports), PUB/SUB prefix filtering, receive
 * timeouts, unroutable identities, the per-frame size cap, over-long multipart messages, polling
 * and the fd/readable pair an external event loop uses.
 */
#include "common/svc.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

static void *ctx;

static void setup(void)
{
    ctx = km_zctx_create();
    cr_assert_not_null(ctx);
}

static void teardown(void)
{
    km_zctx_destroy(ctx);
}

/* cppcheck-suppress unknownMacro ; criterion macros are unknown to cppcheck */
TestSuite(zmqx, .init = setup, .fini = teardown, .timeout = 30);

static void *open_sock(km_zsock_type t, const km_zsock_opts *o)
{
    void *s = NULL;
    km_errbuf err = {{0}};
    int rc = km_zsock_open(ctx, t, o, &s, &err);
    cr_assert_eq(rc, 0, "%s", err.msg);
    return s;
}

static void send_str(void *s, const char *body)
{
    km_zframe f = {body, strlen(body)};
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsend(s, &f, 1, 0, &err), 0, "%s", err.msg);
}

static int part_is(const km_zframe *f, const char *s)
{
    return f->len == strlen(s) && memcmp(f->data, s, f->len) == 0;
}

/* The request/reply exchange every daemon does: the ROUTER sees [identity, body] and answers by
 * putting the identity back in front. */
static void router_dealer_exchange(const char *bind_ep)
{
    km_errbuf err = {{0}};
    void *router = open_sock(KM_ZROUTER, NULL);
    cr_assert_eq(km_zsock_bind(router, bind_ep, &err), 0, "%s", err.msg);
    char ep[256];
    cr_assert_eq(km_zsock_last_endpoint(router, ep, sizeof ep, &err), 0, "%s", err.msg);
    cr_assert(strstr(ep, "*") == NULL, "last endpoint %s still has a wildcard", ep);

    km_zsock_opts o;
    km_zsock_opts_default(&o);
    o.routing_id = "client-1";
    void *dealer = open_sock(KM_ZDEALER, &o);
    cr_assert_eq(km_zsock_connect(dealer, ep, &err), 0, "%s", err.msg);

    send_str(dealer, "ping");
    km_zmsg m = {0};
    cr_assert_eq(km_zrecv(router, &m, 5000, &err), 0, "%s", err.msg);
    cr_assert_eq(m.n, 2);
    cr_assert(part_is(&m.part[0], "client-1"));
    cr_assert(part_is(km_zmsg_body(&m), "ping"));

    km_zframe reply[2] = {m.part[0], {"pong", 4}};
    cr_assert_eq(km_zsend(router, reply, 2, 0, &err), 0, "%s", err.msg);
    km_zmsg r = {0};
    cr_assert_eq(km_zrecv(dealer, &r, 5000, &err), 0, "%s", err.msg);
    cr_assert_eq(r.n, 1);
    cr_assert(part_is(km_zmsg_body(&r), "pong"));

    km_zmsg_clear(&m);
    km_zmsg_clear(&r);
    km_zsock_close(dealer);
    km_zsock_close(router);
}

Test(zmqx, router_and_dealer_exchange_messages_over_inproc)
{
    router_dealer_exchange("inproc://test-router");
}

Test(zmqx, router_and_dealer_exchange_messages_over_tcp_on_an_ephemeral_port)
{
    router_dealer_exchange("tcp://127.0.0.1:*");
}

Test(zmqx, a_protocol_frame_travels_intact)
{
    km_errbuf err = {{0}};
    void *router = open_sock(KM_ZROUTER, NULL);
    void *dealer = open_sock(KM_ZDEALER, NULL);
    cr_assert_eq(km_zsock_bind(router, "inproc://frames", &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_connect(dealer, "inproc://frames", &err), 0, "%s", err.msg);

    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.id = 77;
    in.req.model = "smol";
    in.req.prompt = "Hello";
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), 0, "%s", err.msg);
    km_zframe f = {b.data, b.len};
    cr_assert_eq(km_zsend(dealer, &f, 1, 0, &err), 0, "%s", err.msg);

    km_zmsg m = {0};
    cr_assert_eq(km_zrecv(router, &m, 5000, &err), 0, "%s", err.msg);
    const km_zframe *body = km_zmsg_body(&m);
    cr_assert_eq(km_msg_decode(body->data, body->len, NULL, &out, &err), 0, "%s", err.msg);
    cr_assert_eq(out.req.id, 77);
    cr_assert_str_eq(out.req.prompt, "Hello");
    km_msg_clear(&out);
    km_zmsg_clear(&m);
    km_buf_free(&b);
    km_zsock_close(dealer);
    km_zsock_close(router);
}

Test(zmqx, recv_times_out_with_eagain)
{
    km_errbuf err = {{0}};
    void *router = open_sock(KM_ZROUTER, NULL);
    cr_assert_eq(km_zsock_bind(router, "inproc://quiet", &err), 0, "%s", err.msg);
    km_zmsg m = {0};
    cr_assert_eq(km_zrecv(router, &m, 50, &err), KM_EAGAIN);
    cr_assert(strstr(err.msg, "nothing within 50 ms"), "%s", err.msg);
    cr_assert_eq(km_zrecv(router, &m, 0, &err), KM_EAGAIN);
    cr_assert_eq(m.n, 0);
    km_zmsg_clear(&m);
    km_zsock_close(router);
}

Test(zmqx, pub_sub_delivers_only_the_subscribed_prefix)
{
    km_errbuf err = {{0}};
    void *pub = open_sock(KM_ZPUB, NULL);
    void *sub = open_sock(KM_ZSUB, NULL);
    cr_assert_eq(km_zsock_bind(pub, "tcp://127.0.0.1:*", &err), 0, "%s", err.msg);
    char ep[256];
    cr_assert_eq(km_zsock_last_endpoint(pub, ep, sizeof ep, &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_subscribe(sub, "kv.", 3, &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_connect(sub, ep, &err), 0, "%s", err.msg);

    /* A subscription takes a moment to reach the publisher: publish until one arrives. */
    km_zmsg m = {0};
    int got = KM_EAGAIN;
    for (int i = 0; i < 200 && got == KM_EAGAIN; i++) {
        send_str(pub, "other.topic");
        km_zframe parts[2] = {{"kv.w1", 5}, {"event", 5}};
        cr_assert_eq(km_zsend(pub, parts, 2, 0, &err), 0, "%s", err.msg);
        got = km_zrecv(sub, &m, 20, &err);
    }
    cr_assert_eq(got, 0, "%s", err.msg);
    cr_assert_eq(m.n, 2);
    cr_assert(part_is(&m.part[0], "kv.w1"));
    cr_assert(part_is(&m.part[1], "event"));
    /* whatever else is queued is also kv.*, never other.topic */
    while (km_zrecv(sub, &m, 50, &err) == 0) cr_assert(part_is(&m.part[0], "kv.w1"));
    km_zmsg_clear(&m);
    km_zsock_close(sub);
    km_zsock_close(pub);
}

Test(zmqx, router_mandatory_reports_an_unknown_identity)
{
    km_errbuf err = {{0}};
    km_zsock_opts o;
    km_zsock_opts_default(&o);
    o.router_mandatory = true;
    void *router = open_sock(KM_ZROUTER, &o);
    cr_assert_eq(km_zsock_bind(router, "inproc://mandatory", &err), 0, "%s", err.msg);
    km_zframe parts[2] = {{"nobody", 6}, {"x", 1}};
    cr_assert_eq(km_zsend(router, parts, 2, KM_ZDONTWAIT, &err), KM_ENOTFOUND);
    cr_assert(strstr(err.msg, "part 1 of 2"), "%s", err.msg);
    km_zsock_close(router);
}

Test(zmqx, frames_above_max_msg_size_never_arrive)
{
    km_errbuf err = {{0}};
    km_zsock_opts o;
    km_zsock_opts_default(&o);
    o.max_msg_size = 1000;
    void *router = open_sock(KM_ZROUTER, &o);
    cr_assert_eq(km_zsock_bind(router, "tcp://127.0.0.1:*", &err), 0, "%s", err.msg);
    char ep[256];
    cr_assert_eq(km_zsock_last_endpoint(router, ep, sizeof ep, &err), 0, "%s", err.msg);

    void *big = open_sock(KM_ZDEALER, NULL);
    cr_assert_eq(km_zsock_connect(big, ep, &err), 0, "%s", err.msg);
    static char payload[2000];
    memset(payload, 'x', sizeof payload);
    km_zframe f = {payload, sizeof payload};
    cr_assert_eq(km_zsend(big, &f, 1, 0, &err), 0, "%s", err.msg);
    km_zmsg m = {0};
    cr_assert_eq(km_zrecv(router, &m, 300, &err), KM_EAGAIN, "an oversized frame was delivered");

    /* the socket still serves well-behaved peers */
    void *small = open_sock(KM_ZDEALER, NULL);
    cr_assert_eq(km_zsock_connect(small, ep, &err), 0, "%s", err.msg);
    send_str(small, "fine");
    cr_assert_eq(km_zrecv(router, &m, 5000, &err), 0, "%s", err.msg);
    cr_assert(part_is(km_zmsg_body(&m), "fine"));
    km_zmsg_clear(&m);
    km_zsock_close(small);
    km_zsock_close(big);
    km_zsock_close(router);
}

Test(zmqx, a_message_with_too_many_parts_is_consumed_and_reported)
{
    km_errbuf err = {{0}};
    void *router = open_sock(KM_ZROUTER, NULL);
    void *dealer = open_sock(KM_ZDEALER, NULL);
    cr_assert_eq(km_zsock_bind(router, "inproc://parts", &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_connect(dealer, "inproc://parts", &err), 0, "%s", err.msg);
    km_zframe parts[KM_ZMSG_MAX_PARTS + 3];
    for (int i = 0; i < KM_ZMSG_MAX_PARTS + 3; i++) parts[i] = (km_zframe){"p", 1};
    cr_assert_eq(km_zsend(dealer, parts, KM_ZMSG_MAX_PARTS + 3, 0, &err), 0, "%s", err.msg);
    send_str(dealer, "next");

    km_zmsg m = {0};
    cr_assert_eq(km_zrecv(router, &m, 5000, &err), KM_EPROTO);
    cr_assert(strstr(err.msg, "12 parts, limit 8"), "%s", err.msg);
    cr_assert_eq(m.n, 0);
    cr_assert_eq(km_zrecv(router, &m, 5000, &err), 0, "%s", err.msg);
    cr_assert(part_is(km_zmsg_body(&m), "next"), "the following message is intact");
    km_zmsg_clear(&m);
    km_zsock_close(dealer);
    km_zsock_close(router);
}

Test(zmqx, empty_parts_are_delivered_as_empty_frames)
{
    km_errbuf err = {{0}};
    void *router = open_sock(KM_ZROUTER, NULL);
    void *dealer = open_sock(KM_ZDEALER, NULL);
    cr_assert_eq(km_zsock_bind(router, "inproc://empty", &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_connect(dealer, "inproc://empty", &err), 0, "%s", err.msg);
    km_zframe parts[2] = {{NULL, 0}, {"body", 4}};
    cr_assert_eq(km_zsend(dealer, parts, 2, 0, &err), 0, "%s", err.msg);
    km_zmsg m = {0};
    cr_assert_eq(km_zrecv(router, &m, 5000, &err), 0, "%s", err.msg);
    cr_assert_eq(m.n, 3);
    cr_assert_eq(m.part[1].len, 0);
    cr_assert(part_is(km_zmsg_body(&m), "body"));
    km_zmsg_clear(&m);
    km_zsock_close(dealer);
    km_zsock_close(router);
}

Test(zmqx, poll_reports_which_socket_is_readable)
{
    km_errbuf err = {{0}};
    void *a = open_sock(KM_ZROUTER, NULL), *b = open_sock(KM_ZROUTER, NULL);
    void *da = open_sock(KM_ZDEALER, NULL), *db = open_sock(KM_ZDEALER, NULL);
    cr_assert_eq(km_zsock_bind(a, "inproc://pa", &err), 0);
    cr_assert_eq(km_zsock_bind(b, "inproc://pb", &err), 0);
    cr_assert_eq(km_zsock_connect(da, "inproc://pa", &err), 0);
    cr_assert_eq(km_zsock_connect(db, "inproc://pb", &err), 0);

    km_zpollitem items[2] = {{.sock = a, .events = KM_ZPOLLIN}, {.sock = b, .events = KM_ZPOLLIN}};
    cr_assert_eq(km_zpoll(items, 2, 20, &err), 0, "nothing is readable yet");
    send_str(db, "hello b");
    cr_assert_eq(km_zpoll(items, 2, 5000, &err), 1, "%s", err.msg);
    cr_assert_eq(items[0].revents, 0);
    cr_assert_eq(items[1].revents, KM_ZPOLLIN);
    km_zsock_close(da);
    km_zsock_close(db);
    km_zsock_close(a);
    km_zsock_close(b);
}

Test(zmqx, fd_and_readable_support_an_external_event_loop)
{
    km_errbuf err = {{0}};
    void *router = open_sock(KM_ZROUTER, NULL);
    void *dealer = open_sock(KM_ZDEALER, NULL);
    cr_assert_eq(km_zsock_bind(router, "inproc://fd", &err), 0);
    cr_assert_eq(km_zsock_connect(dealer, "inproc://fd", &err), 0);
    int fd = -1;
    cr_assert_eq(km_zsock_fd(router, &fd, &err), 0, "%s", err.msg);
    cr_assert_geq(fd, 0);
    cr_assert_eq(km_zsock_readable(router), 0);
    send_str(dealer, "x");
    int readable = 0;
    for (int i = 0; i < 500 && !readable; i++) {
        km_zpollitem it = {.fd = fd, .events = KM_ZPOLLIN};
        km_zpoll(&it, 1, 10, &err);
        readable = km_zsock_readable(router);
    }
    cr_assert_eq(readable, 1);
    km_zsock_close(dealer);
    km_zsock_close(router);
}

Test(zmqx, bad_endpoints_and_options_are_errors_naming_them)
{
    km_errbuf err = {{0}};
    void *s = open_sock(KM_ZROUTER, NULL);
    cr_assert_lt(km_zsock_bind(s, "bogus://nowhere", &err), 0);
    cr_assert(strstr(err.msg, "bind bogus://nowhere"), "%s", err.msg);
    cr_assert_lt(km_zsock_connect(s, "tcp://", &err), 0);
    cr_assert(strstr(err.msg, "connect tcp://"), "%s", err.msg);
    km_zsock_close(s);

    km_zsock_opts o;
    km_zsock_opts_default(&o);
    o.routing_id = "";
    void *d = NULL;
    cr_assert_eq(km_zsock_open(ctx, KM_ZDEALER, &o, &d, &err), KM_EINVAL);
    cr_assert_null(d);
    cr_assert_eq(km_zsock_open(ctx, (km_zsock_type)9, NULL, &d, &err), KM_EINVAL);
    char small[4];
    void *r = open_sock(KM_ZROUTER, NULL);
    cr_assert_eq(km_zsock_bind(r, "inproc://long-name", &err), 0);
    cr_assert_eq(km_zsock_last_endpoint(r, small, sizeof small, &err), KM_ENOSPC);
    km_zsock_close(r);
}
