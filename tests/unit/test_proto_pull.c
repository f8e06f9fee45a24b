/*
 * test_proto_pull.c — the page transfer's frames (kv_pull, kv_offer, kv_pull_done) and the
 * transfer keys of req (the pull hint), hb (peer_addr, xfer) and view (peer_addr, rates): every
 * field survives encode -> decode, the largest pull and offer fit the default frame, frames that
 * break their own shape (counts that disagree, gaps in indexes, a hint without its address) are
 * refused with the field named, every truncation fails cleanly, and the fuzz seeds of these
 * frames (tests/fuzz/corpus/fuzz_proto/{kv_pull,kv_offer,kv_pull_done,kv_push,...}) are these
 * frames.
 */
#define _GNU_SOURCE
#include "common/svc.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void roundtrip(const km_msg *in, km_msg *out)
{
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(in, NULL, &b, &err), 0, "encode: %s", err.msg);
    cr_assert_eq(km_msg_decode(b.data, b.len, NULL, out, &err), 0, "decode: %s", err.msg);
    cr_assert_eq(out->type, in->type);
    km_buf_free(&b);
}

static void expect_encode_fail(const km_msg *in, const char *needle)
{
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_lt(km_msg_encode(in, NULL, &b, &err), 0, "encoded, expected '%s'", needle);
    cr_assert(strstr(err.msg, needle), "error '%s' does not name '%s'", err.msg, needle);
    km_buf_free(&b);
}

enum { PT = 16 };

/* A chain of n pages with distinct hashes and token ids. */
typedef struct chain {
    uint8_t hashes[KM_PROTO_MAX_PULL_PAGES * 16];
    int32_t tokens[KM_PROTO_MAX_PULL_PAGES * PT];
    km_kv_page_desc pages[KM_PROTO_MAX_PULL_PAGES];
} chain;

static chain *chain_make(int n)
{
    chain *c = calloc(1, sizeof *c);
    for (int i = 0; i < n * 16; i++) c->hashes[i] = (uint8_t)(i * 7 + 3);
    for (int i = 0; i < n * PT; i++) c->tokens[i] = 49151 - (i % 49152);
    for (int i = 0; i < n; i++) {
        km_kv_page_desc *p = &c->pages[i];
        p->index = (uint32_t)(i + 2);
        p->format = (uint32_t)(i % 5);
        memcpy(p->hash, c->hashes + 16 * i, 16);
        memset(p->parent, i, 16);
        p->region = (uint32_t)(i % 2);
        p->addr = 0x7f0000000000ull + (uint64_t)i * 368640;
        p->bytes = 368640;
        p->checksum = 0xfedcba9876543210ull ^ (uint64_t)i;
    }
    return c;
}

static void pull_init(km_msg *m, const chain *c, uint32_t n)
{
    km_msg_init(m, KM_MSG_KV_PULL);
    m->kv_pull.id = 0x1234567890ull;
    m->kv_pull.first = 2;
    m->kv_pull.n_pages = n;
    m->kv_pull.page_tokens = PT;
    m->kv_pull.hashes = c->hashes;
    m->kv_pull.tokens = c->tokens;
}

static const uint8_t g_addr[] = {'K', 'V', 'M', 'P', 'E', 'E', 'R', '1', 1, 0, 0, 0};

static void push_init(km_msg *m, const chain *c, uint32_t n)
{
    km_msg_init(m, KM_MSG_KV_PUSH);
    m->kv_push.chain = (km_msg_kv_pull){
        .id = 42, .n_pages = n, .page_tokens = PT, .hashes = c->hashes, .tokens = c->tokens};
    m->kv_push.from = "w-a";
    m->kv_push.endpoint = "tcp://127.0.0.1:7100";
    m->kv_push.addr = g_addr;
    m->kv_push.addr_len = sizeof g_addr;
}

static void offer_init(km_msg *m, const chain *c, uint32_t n)
{
    km_msg_init(m, KM_MSG_KV_OFFER);
    m->kv_offer.id = 0x1234567890ull;
    m->kv_offer.lease_id = 77;
    m->kv_offer.lease_ms = 10000;
    m->kv_offer.page_tokens = PT;
    m->kv_offer.pages = c->pages;
    m->kv_offer.n_pages = n;
    m->kv_offer.tokens = c->tokens;
}

Test(proto_pull, kv_pull_roundtrips_its_chain)
{
    chain *c = chain_make(8);
    km_msg in, out;
    pull_init(&in, c, 8);
    roundtrip(&in, &out);
    cr_assert_eq(out.kv_pull.id, 0x1234567890ull);
    cr_assert_eq(out.kv_pull.first, 2);
    cr_assert_eq(out.kv_pull.n_pages, 8);
    cr_assert_eq(out.kv_pull.page_tokens, PT);
    cr_assert_eq(memcmp(out.kv_pull.hashes, c->hashes, 8 * 16), 0);
    cr_assert_eq(memcmp(out.kv_pull.tokens, c->tokens, 8 * PT * sizeof(int32_t)), 0);
    km_msg_clear(&out);
    free(c);
}

Test(proto_pull, kv_offer_roundtrips_every_page_field)
{
    chain *c = chain_make(5);
    km_msg in, out;
    offer_init(&in, c, 5);
    roundtrip(&in, &out);
    const km_msg_kv_offer *o = &out.kv_offer;
    cr_assert_eq(o->id, 0x1234567890ull);
    cr_assert_eq(o->lease_id, 77);
    cr_assert_eq(o->status, 0);
    cr_assert_eq(o->lease_ms, 10000);
    cr_assert_eq(o->n_pages, 5);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(memcmp(&o->pages[i], &c->pages[i], sizeof c->pages[i]), 0, "page %d", i);
    cr_assert_eq(memcmp(o->tokens, c->tokens, 5 * PT * sizeof(int32_t)), 0);
    km_msg_clear(&out);
    free(c);
}

Test(proto_pull, a_refusal_is_an_offer_with_a_status_and_no_pages)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_KV_OFFER);
    in.kv_offer.id = 9;
    in.kv_offer.status = KM_ENOTFOUND;
    roundtrip(&in, &out);
    cr_assert_eq(out.kv_offer.status, KM_ENOTFOUND);
    cr_assert_eq(out.kv_offer.n_pages, 0);
    cr_assert_null(out.kv_offer.pages);
    cr_assert_eq(out.kv_offer.lease_id, 0);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_KV_PULL_DONE);
    in.kv_pull_done.lease_id = 77;
    in.kv_pull_done.pages_ok = 12;
    roundtrip(&in, &out);
    cr_assert_eq(out.kv_pull_done.lease_id, 77);
    cr_assert_eq(out.kv_pull_done.pages_ok, 12);
    km_msg_clear(&out);
}

Test(proto_pull, kv_push_roundtrips_and_refuses_what_it_cannot_be)
{
    chain *c = chain_make(5);
    km_msg in, out;
    push_init(&in, c, 5);
    roundtrip(&in, &out);
    const km_msg_kv_push *p = &out.kv_push;
    cr_assert_eq(p->chain.id, 42);
    cr_assert_eq(p->chain.first, 0);
    cr_assert_eq(p->chain.n_pages, 5);
    cr_assert_eq(p->chain.page_tokens, PT);
    cr_assert_eq(memcmp(p->chain.hashes, c->hashes, 5 * 16), 0);
    cr_assert_eq(memcmp(p->chain.tokens, c->tokens, sizeof(int32_t) * 5 * PT), 0);
    cr_assert_str_eq(p->from, "w-a");
    cr_assert_str_eq(p->endpoint, "tcp://127.0.0.1:7100");
    cr_assert_eq(p->addr_len, sizeof g_addr);
    cr_assert_eq(memcmp(p->addr, g_addr, sizeof g_addr), 0);
    cr_assert_not(p->position_free, "absent: a prefix chain");
    km_msg_clear(&out);
    in.kv_push.position_free = true; /* a chunk's chain (docs/blend.md) */
    roundtrip(&in, &out);
    cr_assert(out.kv_push.position_free);
    km_msg_clear(&out);
    push_init(&in, c, 5);
    in.kv_push.chain.first = 1;
    expect_encode_fail(&in, "kv_push.first");
    push_init(&in, c, 5);
    in.kv_push.from = NULL;
    expect_encode_fail(&in, "kv_push.from");
    push_init(&in, c, 5);
    in.kv_push.endpoint = "";
    expect_encode_fail(&in, "kv_push.endpoint");
    push_init(&in, c, 5);
    in.kv_push.addr_len = 0;
    expect_encode_fail(&in, "kv_push.addr");
    push_init(&in, c, 0);
    expect_encode_fail(&in, "kv_push.n_pages");
    push_init(&in, c, 5);
    c->tokens[7] = -2;
    expect_encode_fail(&in, "kv_push.tokens[7]");
    free(c);
}

Test(proto_pull, kv_warm_roundtrips_and_bounds_its_ask)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_KV_WARM);
    in.kv_warm.id = 7;
    in.kv_warm.max_pages = 512;
    roundtrip(&in, &out);
    cr_assert_eq(out.kv_warm.id, 7);
    cr_assert_eq(out.kv_warm.max_pages, 512);
    km_msg_clear(&out);
    in.kv_warm.max_pages = 0;
    expect_encode_fail(&in, "kv_warm.max_pages");
    in.kv_warm.max_pages = KM_PROTO_MAX_WARM_PAGES + 1;
    expect_encode_fail(&in, "kv_warm.max_pages");
}

Test(proto_pull, the_largest_pull_and_offer_fit_the_default_frame)
{
    chain *c = chain_make(KM_PROTO_MAX_PULL_PAGES);
    for (int i = 0; i < KM_PROTO_MAX_PULL_PAGES * PT; i++) c->tokens[i] = INT32_MAX - i;
    km_msg in, out;
    pull_init(&in, c, KM_PROTO_MAX_PULL_PAGES);
    roundtrip(&in, &out);
    cr_assert_eq(out.kv_pull.tokens[KM_PROTO_MAX_PULL_PAGES * PT - 1],
                 INT32_MAX - (KM_PROTO_MAX_PULL_PAGES * PT - 1));
    km_msg_clear(&out);
    offer_init(&in, c, KM_PROTO_MAX_PULL_PAGES - 2); /* indexes 2 .. 4095 */
    for (int i = 0; i < KM_PROTO_MAX_PULL_PAGES; i++) c->pages[i].checksum = UINT64_MAX - i;
    roundtrip(&in, &out);
    cr_assert_eq(out.kv_offer.pages[KM_PROTO_MAX_PULL_PAGES - 3].index,
                 KM_PROTO_MAX_PULL_PAGES - 1);
    km_msg_clear(&out);
    free(c);
}

Test(proto_pull, frames_that_break_their_own_shape_are_refused)
{
    chain *c = chain_make(8);
    km_msg m;
    pull_init(&m, c, 8);
    m.kv_pull.first = 8;
    expect_encode_fail(&m, "kv_pull.first");
    pull_init(&m, c, 0);
    expect_encode_fail(&m, "kv_pull.n_pages");
    pull_init(&m, c, KM_PROTO_MAX_PULL_PAGES + 1);
    expect_encode_fail(&m, "kv_pull.n_pages");
    pull_init(&m, c, 8);
    m.kv_pull.page_tokens = 0;
    expect_encode_fail(&m, "kv_pull.page_tokens");
    pull_init(&m, c, 8);
    c->tokens[3] = -1;
    expect_encode_fail(&m, "kv_pull.tokens[3]");
    c->tokens[3] = 3;

    offer_init(&m, c, 4);
    c->pages[2].index = 9;
    expect_encode_fail(&m, "kv_offer.pages[2].index");
    c->pages[2].index = 4;
    c->pages[1].format = 5;
    expect_encode_fail(&m, "kv_offer.pages[1].format");
    c->pages[1].format = 1;
    m.kv_offer.lease_id = 0;
    expect_encode_fail(&m, "without a lease");
    offer_init(&m, c, 4);
    m.kv_offer.status = 3;
    expect_encode_fail(&m, "kv_offer.status");

    km_msg_init(&m, KM_MSG_KV_PULL_DONE);
    expect_encode_fail(&m, "kv_pull_done.lease_id");
    free(c);
}

/* A frame whose hashes or tokens disagree with its counts decodes to an error naming them. */
Test(proto_pull, counts_that_disagree_with_the_arrays_are_rejected_on_decode)
{
    chain *c = chain_make(8);
    km_msg m, out;
    km_buf b = {0};
    km_errbuf err = {{0}};
    pull_init(&m, c, 8);
    cr_assert_eq(km_msg_encode(&m, NULL, &b, &err), 0, "%s", err.msg);
    /* n_pages 8 -> 7 in place: "n_pages" then a positive fixint 8 */
    uint8_t *p = memmem(b.data, b.len, "n_pages\x08", 8);
    cr_assert_not_null(p);
    p[7] = 7;
    cr_assert_lt(km_msg_decode(b.data, b.len, NULL, &out, &err), 0);
    cr_assert(strstr(err.msg, "kv_pull.hashes"), "%s", err.msg);
    cr_assert_eq(out.rejected_id, 0x1234567890ull, "the rejected pull is named");
    /* every truncation fails without a crash */
    p[7] = 8;
    for (size_t n = 0; n < b.len; n++) {
        cr_assert_lt(km_msg_decode(b.data, n, NULL, &out, &err), 0, "truncated at %zu", n);
    }
    km_buf_free(&b);
    free(c);
}

Test(proto_pull, request_pull_hint_roundtrips_and_is_all_or_nothing)
{
    static const uint8_t addr[] = {'K', 'V', 'M', 'P', 'E', 'E', 'R', '1', 1, 0, 0, 0};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.id = 5;
    in.req.model = "m";
    in.req.prompt = "hello";
    roundtrip(&in, &out);
    cr_assert_null(out.req.pull_from, "no hint by default");
    km_msg_clear(&out);

    in.req.pull_from = "w-a";
    in.req.pull_endpoint = "tcp://127.0.0.1:7100";
    in.req.pull_addr = addr;
    in.req.pull_addr_len = sizeof addr;
    in.req.pull_pages = 12;
    in.req.pull_ms = 250;
    roundtrip(&in, &out);
    cr_assert_str_eq(out.req.pull_from, "w-a");
    cr_assert_str_eq(out.req.pull_endpoint, "tcp://127.0.0.1:7100");
    cr_assert_eq(out.req.pull_addr_len, sizeof addr);
    cr_assert_eq(memcmp(out.req.pull_addr, addr, sizeof addr), 0);
    cr_assert_eq(out.req.pull_pages, 12);
    cr_assert_eq(out.req.pull_ms, 250);
    km_msg_clear(&out);

    in.req.pull_addr = NULL;
    expect_encode_fail(&in, "req.pull_addr");
    in.req.pull_addr = addr;
    in.req.pull_endpoint = NULL;
    expect_encode_fail(&in, "req.pull_endpoint");
    in.req.pull_endpoint = "tcp://127.0.0.1:7100";
    in.req.pull_pages = 0;
    expect_encode_fail(&in, "req.pull_pages");
}

/* Chunk pulls (docs/blend.md, "Routing"): a bit per chunk, pull_pages 0 allowed with them, no
 * bit past the request's chunks; more holders (pull_more) each with chunks of their own. */
Test(proto_pull, request_pull_chunks_roundtrip_and_name_only_its_chunks)
{
    static const uint8_t addr[] = {'K', 'V', 'M', 'P', 'E', 'E', 'R', '1', 1, 0, 0, 0};
    static const int32_t toks[64] = {1, 2, 3};
    static const km_chunk_seg segs[3] = {{0, 20}, {20, 20}, {40, 20}};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.id = 6;
    in.req.model = "m";
    in.req.tokens = toks;
    in.req.n_tokens = 64;
    in.req.chunks = segs;
    in.req.n_chunks = 3;
    in.req.pull_from = "w-a";
    in.req.pull_endpoint = "tcp://127.0.0.1:7100";
    in.req.pull_addr = addr;
    in.req.pull_addr_len = sizeof addr;
    in.req.pull_chunks = 0x3;
    roundtrip(&in, &out);
    cr_assert_eq(out.req.pull_pages, 0);
    cr_assert_eq(out.req.pull_chunks, 0x3);
    km_msg_clear(&out);
    in.req.pull_chunks = 0x8;
    expect_encode_fail(&in, "req.pull_chunks");
    /* more holders: each its own chunks, none twice, none past the request's */
    const km_pull_more more[2] = {{"w-b", 0x2}, {"w-c", 0x4}};
    in.req.pull_chunks = 0x1;
    in.req.pull_more = more;
    in.req.n_pull_more = 2;
    roundtrip(&in, &out);
    cr_assert_eq(out.req.n_pull_more, 2);
    cr_assert_str_eq(out.req.pull_more[0].from, "w-b");
    cr_assert_eq(out.req.pull_more[0].chunks, 0x2);
    cr_assert_str_eq(out.req.pull_more[1].from, "w-c");
    cr_assert_eq(out.req.pull_more[1].chunks, 0x4);
    km_msg_clear(&out);
    in.req.pull_chunks = 0x2; /* chunk 1 named twice */
    expect_encode_fail(&in, "req.pull_more[0]");
    in.req.pull_chunks = 0x1;
    const km_pull_more past[1] = {{"w-b", 0x8}}, none[1] = {{"w-b", 0}};
    in.req.pull_more = past;
    in.req.n_pull_more = 1;
    expect_encode_fail(&in, "req.pull_more[0]");
    in.req.pull_more = none;
    expect_encode_fail(&in, "req.pull_more[0]");
    in.req.pull_more = more;
    in.req.n_pull_more = KM_PROTO_MAX_PULL_MORE + 1;
    expect_encode_fail(&in, "req.pull_more");
}

Test(proto_pull, heartbeat_and_view_carry_the_peer_address_and_rates)
{
    static const uint8_t addr[40] = {'K', 'V', 'M', 'P', 'E', 'E', 'R', '1'};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_HEARTBEAT);
    in.hb.worker = "w-a";
    in.hb.seq = 3;
    roundtrip(&in, &out);
    cr_assert_null(out.hb.peer_addr, "absent without a node");
    cr_assert_not(out.hb.has_xfer);
    km_msg_clear(&out);
    in.hb.peer_addr = addr;
    in.hb.peer_addr_len = sizeof addr;
    in.hb.has_xfer = true;
    in.hb.xfer = (km_xfer_stats){.bytes_in = 1u << 30,
                                 .bytes_out = 5,
                                 .pages_in = 2913,
                                 .pages_out = 1,
                                 .pulls_ok = 10,
                                 .pulls_failed = 2,
                                 .offers = 11,
                                 .rate_bps = 1.5e9,
                                 .latency_ms = 0.75,
                                 .page_bytes = 368640};
    roundtrip(&in, &out);
    cr_assert_eq(out.hb.peer_addr_len, sizeof addr);
    cr_assert_eq(memcmp(out.hb.peer_addr, addr, sizeof addr), 0);
    cr_assert(out.hb.has_xfer);
    cr_assert_eq(memcmp(&out.hb.xfer, &in.hb.xfer, sizeof in.hb.xfer), 0);
    km_msg_clear(&out);
    in.hb.xfer.rate_bps = -1;
    expect_encode_fail(&in, "hb.xfer.rate_bps");

    km_view_worker w = {.id = "w-a",
                        .state = KM_MEMBER_READY,
                        .peer_addr = addr,
                        .peer_addr_len = sizeof addr,
                        .prefill_tps = 812.5,
                        .xfer_rate_bps = 2.5e9,
                        .xfer_lat_ms = 0.4,
                        .page_bytes = 207360,
                        .xfer_bytes_in = 4423680,
                        .xfer_bytes_out = 1ull << 40};
    km_msg_init(&in, KM_MSG_VIEW);
    in.view.controller = "c";
    in.view.workers = &w;
    in.view.n_workers = 1;
    roundtrip(&in, &out);
    const km_view_worker *o = &out.view.workers[0];
    cr_assert_eq(o->peer_addr_len, sizeof addr);
    cr_assert_eq(memcmp(o->peer_addr, addr, sizeof addr), 0);
    cr_assert_eq(o->prefill_tps, 812.5);
    cr_assert_eq(o->xfer_rate_bps, 2.5e9);
    cr_assert_eq(o->xfer_lat_ms, 0.4);
    cr_assert_eq(o->page_bytes, 207360);
    cr_assert_eq(o->xfer_bytes_in, 4423680);
    cr_assert_eq(o->xfer_bytes_out, 1ull << 40);
    km_msg_clear(&out);
    w.peer_addr_len = KM_PROTO_MAX_PEER_ADDR + 1;
    expect_encode_fail(&in, "view.workers[0].peer_addr");
}

Test(proto_pull, per_holder_pull_figures_travel_in_the_heartbeat_and_the_view)
{
    static const km_xfer_pair pairs[2] = {{.from = "w-b", .rate_bps = 2.5e9, .latency_ms = 0.4},
                                          {.from = "w-c", .rate_bps = 1.2e8, .latency_ms = 9}};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_HEARTBEAT);
    in.hb.worker = "w-a";
    in.hb.has_xfer = true;
    in.hb.xfer = (km_xfer_stats){.rate_bps = 1e9, .pairs = pairs, .n_pairs = 2};
    roundtrip(&in, &out);
    cr_assert_eq(out.hb.xfer.n_pairs, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_str_eq(out.hb.xfer.pairs[i].from, pairs[i].from);
        cr_assert_eq(out.hb.xfer.pairs[i].rate_bps, pairs[i].rate_bps);
        cr_assert_eq(out.hb.xfer.pairs[i].latency_ms, pairs[i].latency_ms);
    }
    km_msg_clear(&out);
    km_xfer_pair bad[KM_PROTO_MAX_XFER_PAIRS + 1];
    for (int i = 0; i <= KM_PROTO_MAX_XFER_PAIRS; i++) bad[i] = pairs[0];
    in.hb.xfer.pairs = bad;
    in.hb.xfer.n_pairs = KM_PROTO_MAX_XFER_PAIRS + 1;
    expect_encode_fail(&in, "hb.xfer.pairs");
    in.hb.xfer.n_pairs = 1;
    bad[0].rate_bps = 0; /* a pair is only reported once measured */
    expect_encode_fail(&in, "hb.xfer.pairs[0].rate_bps");
    bad[0] = pairs[0];
    bad[0].from = NULL;
    expect_encode_fail(&in, "hb.xfer.pairs[0].from");

    km_view_worker w = {
        .id = "w-a", .state = KM_MEMBER_READY, .xfer_pairs = pairs, .n_xfer_pairs = 2};
    km_msg_init(&in, KM_MSG_VIEW);
    in.view.controller = "c";
    in.view.workers = &w;
    in.view.n_workers = 1;
    roundtrip(&in, &out);
    const km_view_worker *o = &out.view.workers[0];
    cr_assert_eq(o->n_xfer_pairs, 2);
    cr_assert_str_eq(o->xfer_pairs[1].from, "w-c");
    cr_assert_eq(o->xfer_pairs[1].latency_ms, 9);
    km_msg_clear(&out);
    w.n_xfer_pairs = 1;
    w.xfer_pairs = bad;
    bad[0] = pairs[0];
    bad[0].latency_ms = -1;
    expect_encode_fail(&in, "view.workers[0].xfer_pairs[0].latency_ms");
}

/* Writes the fuzz seeds of these frames when KVMESH_WRITE_SEEDS names the corpus directory
 * (how tests/fuzz/corpus/fuzz_proto/kv_*.msgpack were made); otherwise checks nothing. */
Test(proto_pull, fuzz_seeds_can_be_regenerated)
{
    const char *dir = getenv("KVMESH_WRITE_SEEDS");
    if (!dir) cr_skip_test("KVMESH_WRITE_SEEDS not set");
    chain *c = chain_make(3);
    const uint8_t *addr = g_addr;
    km_msg m[7];
    const char *names[7] = {"kv_pull",      "kv_offer", "kv_pull_done", "req_pull_hint",
                            "hb_peer_xfer", "kv_push",  "kv_warm"};
    pull_init(&m[0], c, 3);
    offer_init(&m[1], c, 1);
    km_msg_init(&m[2], KM_MSG_KV_PULL_DONE);
    m[2].kv_pull_done.lease_id = 77;
    m[2].kv_pull_done.pages_ok = 1;
    km_msg_init(&m[3], KM_MSG_REQUEST);
    m[3].req = (km_msg_request){.id = 5,
                                .model = "m",
                                .prompt = "hi",
                                .temperature = 0,
                                .top_p = 1,
                                .repeat_penalty = 1,
                                .pull_from = "w-a",
                                .pull_endpoint = "tcp://127.0.0.1:7100",
                                .pull_addr = addr,
                                .pull_addr_len = sizeof g_addr,
                                .pull_pages = 2};
    km_msg_init(&m[4], KM_MSG_HEARTBEAT);
    m[4].hb.worker = "w";
    m[4].hb.peer_addr = addr;
    m[4].hb.peer_addr_len = sizeof g_addr;
    m[4].hb.has_xfer = true;
    m[4].hb.xfer.rate_bps = 1e9;
    static const km_xfer_pair pair = {.from = "w-b", .rate_bps = 2e9, .latency_ms = 0.5};
    m[4].hb.xfer.pairs = &pair;
    m[4].hb.xfer.n_pairs = 1;
    push_init(&m[5], c, 3);
    km_msg_init(&m[6], KM_MSG_KV_WARM);
    m[6].kv_warm = (km_msg_kv_warm){.id = 1, .max_pages = 256};
    for (int i = 0; i < 7; i++) {
        km_buf b = {0};
        km_errbuf err = {{0}};
        cr_assert_eq(km_msg_encode(&m[i], NULL, &b, &err), 0, "%s: %s", names[i], err.msg);
        char path[512];
        snprintf(path, sizeof path, "%s/%s.msgpack", dir, names[i]);
        FILE *fp = fopen(path, "wb");
        cr_assert_not_null(fp, "%s", path);
        fwrite(b.data, 1, b.len, fp);
        fclose(fp);
        km_buf_free(&b);
    }
    free(c);
}
