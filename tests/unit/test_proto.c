/*
 * test_proto.c — the msgpack wire protocol: every frame type survives encode -> decode with every
 * field intact, defaults fill absent optional fields, and malformed frames (wrong types, missing
 * fields, truncation at every byte, random bytes, oversized frames, huge claimed arrays, bad
 * versions) come back as errors with a message that names the problem — never a crash or a leak
 * (the ASan build checks the latter).
 *
 * Hand-made frames are built with msgpack-c's packer so each test breaks exactly one thing.
 */
#define _GNU_SOURCE
#include "common/svc.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <math.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- helpers */

static void roundtrip(const km_msg *in, km_msg *out)
{
    km_buf b = {0};
    km_errbuf err = {{0}};
    int rc = km_msg_encode(in, NULL, &b, &err);
    cr_assert_eq(rc, 0, "encode: %s", err.msg);
    rc = km_msg_decode(b.data, b.len, NULL, out, &err);
    cr_assert_eq(rc, 0, "decode: %s", err.msg);
    cr_assert_eq(out->type, in->type);
    km_buf_free(&b);
}

/* A frame under construction. */
typedef struct fb {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} fb;

static void fb_init(fb *f)
{
    msgpack_sbuffer_init(&f->sb);
    msgpack_packer_init(&f->pk, &f->sb, msgpack_sbuffer_write);
}
static void fb_free(fb *f)
{
    msgpack_sbuffer_destroy(&f->sb);
}
static void p_str(fb *f, const char *s)
{
    msgpack_pack_str(&f->pk, strlen(s));
    msgpack_pack_str_body(&f->pk, s, strlen(s));
}
static void p_kstr(fb *f, const char *k, const char *v)
{
    p_str(f, k);
    p_str(f, v);
}
static void p_kuint(fb *f, const char *k, uint64_t v)
{
    p_str(f, k);
    msgpack_pack_uint64(&f->pk, v);
}
/* The map header and the "v"/"t" pair; n counts the other keys. */
static void p_head(fb *f, uint32_t n, const char *type)
{
    msgpack_pack_map(&f->pk, n + 2);
    p_kuint(f, "v", KM_PROTO_VERSION);
    p_kstr(f, "t", type);
}

static int decode_fb(fb *f, km_msg *m, km_errbuf *err)
{
    return km_msg_decode(f->sb.data, f->sb.size, NULL, m, err);
}

/* Asserts the frame fails with `code` and a message containing `needle`. */
static void expect_fail(fb *f, int code, const char *needle)
{
    km_msg m;
    km_errbuf err = {{0}};
    int rc = decode_fb(f, &m, &err);
    cr_assert_eq(rc, code, "rc %d (%s), want %d", rc, err.msg, code);
    cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
    cr_assert_eq(m.mem_, NULL, "a failed decode must leave nothing allocated");
    km_msg_clear(&m);
    fb_free(f);
}

/* A valid minimal request frame with one key replaced: the value is written by `val`. */
static void request_with(fb *f, const char *key, void (*val)(fb *))
{
    fb_init(f);
    p_head(f, 3, "req");
    p_kuint(f, "id", 7);
    if (strcmp(key, "model") == 0) {
        p_str(f, "model");
        val(f);
    } else {
        p_kstr(f, "model", "smol");
    }
    if (strcmp(key, "prompt") == 0) {
        p_str(f, "prompt");
        val(f);
    } else {
        p_kstr(f, "prompt", "hi");
        if (strcmp(key, "model") != 0) {
            /* replace the map size: one more key */
            f->sb.data[0] = (char)(0x80 | 6);
            p_str(f, key);
            val(f);
        }
    }
}

/* ---------------------------------------------------------------- round trips */

Test(proto, request_with_text_roundtrips_every_field)
{
    const char *stops[] = {"\n\n", "</s>"};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    km_msg_request *r = &in.req;
    r->id = UINT64_MAX - 3;
    r->model = "SmolLM2-135M";
    r->prompt = "Hello, wörld";
    r->temperature = 0.7f;
    r->top_k = 40;
    r->top_p = 0.9f;
    r->min_p = 0.05f;
    r->repeat_penalty = 1.1f;
    r->repeat_last_n = 128;
    r->presence_penalty = -0.5f;
    r->frequency_penalty = 1.5f;
    r->has_seed = true;
    r->seed = 0xdeadbeefcafeULL;
    r->max_tokens = 512;
    r->stop = stops;
    r->n_stop = 2;
    r->cache_salt = "tenant-42";
    r->priority = -7;
    r->deadline_ms = 30000;
    r->stream = true;
    roundtrip(&in, &out);
    const km_msg_request *o = &out.req;
    cr_assert_eq(o->id, r->id);
    cr_assert_str_eq(o->model, "SmolLM2-135M");
    cr_assert_str_eq(o->prompt, "Hello, wörld");
    cr_assert_eq(o->prompt_len, strlen("Hello, wörld"));
    cr_assert_eq(o->n_tokens, 0);
    cr_assert_float_eq(o->temperature, 0.7f, 1e-7);
    cr_assert_eq(o->top_k, 40);
    cr_assert_float_eq(o->top_p, 0.9f, 1e-7);
    cr_assert_float_eq(o->min_p, 0.05f, 1e-7);
    cr_assert_float_eq(o->repeat_penalty, 1.1f, 1e-7);
    cr_assert_eq(o->repeat_last_n, 128);
    cr_assert_float_eq(o->presence_penalty, -0.5f, 1e-7);
    cr_assert_float_eq(o->frequency_penalty, 1.5f, 1e-7);
    cr_assert(o->has_seed);
    cr_assert_eq(o->seed, 0xdeadbeefcafeULL);
    cr_assert_eq(o->max_tokens, 512);
    cr_assert_eq(o->n_stop, 2);
    cr_assert_str_eq(o->stop[0], "\n\n");
    cr_assert_str_eq(o->stop[1], "</s>");
    cr_assert_str_eq(o->cache_salt, "tenant-42");
    cr_assert_eq(o->priority, -7);
    cr_assert_eq(o->deadline_ms, 30000);
    cr_assert(o->stream);
    km_msg_clear(&out);
}

Test(proto, request_with_token_ids_roundtrips_and_keeps_binary_prompt_bytes)
{
    int32_t toks[] = {1, 0, 49151, 2147483647};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.id = 1;
    in.req.model = "m";
    in.req.tokens = toks;
    in.req.n_tokens = 4;
    roundtrip(&in, &out);
    cr_assert_eq(out.req.prompt, NULL);
    cr_assert_eq(out.req.n_tokens, 4);
    cr_assert_arr_eq(out.req.tokens, toks, sizeof toks);
    cr_assert(!out.req.has_seed);
    cr_assert(!out.req.stream);
    cr_assert_eq(out.req.generated, 0);
    km_msg_clear(&out);

    /* a continuation after a migration: the last ids were generated earlier */
    in.req.generated = 3;
    roundtrip(&in, &out);
    cr_assert_eq(out.req.generated, 3);
    km_msg_clear(&out);
    in.req.generated = 4; /* the whole prompt: nothing left that the client sent */
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), KM_EFORMAT);
    cr_assert(strstr(err.msg, "req.generated"), "%s", err.msg);
    km_buf_free(&b);
    in.req.generated = 0;

    /* a text prompt with a NUL byte inside keeps its length */
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "m";
    in.req.prompt = "a\0b";
    in.req.prompt_len = 3;
    roundtrip(&in, &out);
    cr_assert_eq(out.req.prompt_len, 3);
    cr_assert_eq(memcmp(out.req.prompt, "a\0b", 4), 0);
    km_msg_clear(&out);
}

Test(proto, token_frame_roundtrips)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_TOKEN);
    in.tok.id = 99;
    in.tok.index = 12;
    in.tok.token = 4321;
    in.tok.text = " wörld";
    roundtrip(&in, &out);
    cr_assert_eq(out.tok.id, 99);
    cr_assert_eq(out.tok.index, 12);
    cr_assert_eq(out.tok.token, 4321);
    cr_assert_str_eq(out.tok.text, " wörld");
    cr_assert_eq(out.tok.text_len, strlen(" wörld"));
    km_msg_clear(&out);

    /* an empty piece (a character still incomplete) is legal */
    km_msg_init(&in, KM_MSG_TOKEN);
    in.tok.text = "";
    roundtrip(&in, &out);
    cr_assert_str_eq(out.tok.text, "");
    km_msg_clear(&out);
}

Test(proto, done_frame_roundtrips_usage_and_timings)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_DONE);
    in.done.id = 5;
    in.done.finish = KM_FINISH_LENGTH;
    in.done.text = "whole text";
    in.done.prompt_tokens = 100;
    in.done.cached_tokens = 64;
    in.done.completion_tokens = 16;
    in.done.queue_ms = 1.25;
    in.done.ttft_ms = 20.5;
    in.done.total_ms = 300.125;
    roundtrip(&in, &out);
    cr_assert_eq(out.done.id, 5);
    cr_assert_eq(out.done.finish, KM_FINISH_LENGTH);
    cr_assert_str_eq(out.done.text, "whole text");
    cr_assert_eq(out.done.prompt_tokens, 100);
    cr_assert_eq(out.done.cached_tokens, 64);
    cr_assert_eq(out.done.completion_tokens, 16);
    cr_assert_eq(out.done.queue_ms, 1.25);
    cr_assert_eq(out.done.ttft_ms, 20.5);
    cr_assert_eq(out.done.total_ms, 300.125);
    km_msg_clear(&out);

    for (int f = 0; f < KM_FINISH_COUNT; f++) {
        km_msg_init(&in, KM_MSG_DONE);
        in.done.finish = (km_finish)f;
        roundtrip(&in, &out);
        cr_assert_eq(out.done.finish, (km_finish)f);
        cr_assert_eq(out.done.text, NULL);
        km_msg_clear(&out);
    }
}

Test(proto, error_and_cancel_frames_roundtrip)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_ERROR);
    in.error.id = 17;
    in.error.code = KM_CODE_OVERLOADED;
    in.error.message = "queue full (256 waiting)";
    in.error.retry_after_ms = 250;
    roundtrip(&in, &out);
    cr_assert_eq(out.error.id, 17);
    cr_assert_eq(out.error.code, KM_CODE_OVERLOADED);
    cr_assert_str_eq(out.error.message, "queue full (256 waiting)");
    cr_assert_eq(out.error.retry_after_ms, 250);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_CANCEL);
    in.cancel.id = 123456789;
    roundtrip(&in, &out);
    cr_assert_eq(out.cancel.id, 123456789);
    km_msg_clear(&out);
}

Test(proto, admin_commands_roundtrip_with_their_arguments)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.id = 1;
    in.admin.cmd = KM_ADMIN_EVICT;
    in.admin.fraction = 0.25;
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.cmd, KM_ADMIN_EVICT);
    cr_assert_eq(out.admin.fraction, 0.25);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.id = 2;
    in.admin.cmd = KM_ADMIN_SET_KV_FORMAT;
    in.admin.format = "fp8";
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.id, 2);
    cr_assert_eq(out.admin.cmd, KM_ADMIN_SET_KV_FORMAT);
    cr_assert_str_eq(out.admin.format, "fp8");
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_DRAIN;
    in.admin.timeout_ms = 5000;
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.cmd, KM_ADMIN_DRAIN);
    cr_assert_eq(out.admin.timeout_ms, 5000);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_SHUTDOWN;
    in.admin.restart = true;
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.cmd, KM_ADMIN_SHUTDOWN);
    cr_assert(out.admin.restart);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_STATUS;
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.cmd, KM_ADMIN_STATUS);
    km_msg_clear(&out);
}

Test(proto, admin_replies_roundtrip_success_and_failure)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_ADMIN_REPLY);
    in.admin_reply.id = 9;
    in.admin_reply.cmd = KM_ADMIN_STATUS;
    in.admin_reply.state = KM_STATE_DRAINING;
    in.admin_reply.kv_format = "f16";
    in.admin_reply.inflight = 3;
    in.admin_reply.queued = 4;
    in.admin_reply.kv_pages = 1000;
    in.admin_reply.kv_bytes = 1ull << 33;
    in.admin_reply.evicted_pages = 10;
    in.admin_reply.freed_bytes = 20;
    in.admin_reply.converted_pages = 30;
    roundtrip(&in, &out);
    const km_msg_admin_reply *a = &out.admin_reply;
    cr_assert_eq(a->id, 9);
    cr_assert(a->ok);
    cr_assert_eq(a->state, KM_STATE_DRAINING);
    cr_assert_str_eq(a->kv_format, "f16");
    cr_assert_eq(a->inflight, 3);
    cr_assert_eq(a->queued, 4);
    cr_assert_eq(a->kv_pages, 1000);
    cr_assert_eq(a->kv_bytes, 1ull << 33);
    cr_assert_eq(a->evicted_pages, 10);
    cr_assert_eq(a->freed_bytes, 20);
    cr_assert_eq(a->converted_pages, 30);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN_REPLY);
    in.admin_reply.cmd = KM_ADMIN_SET_KV_FORMAT;
    in.admin_reply.ok = false;
    in.admin_reply.code = KM_CODE_BAD_REQUEST;
    in.admin_reply.message = "int4 needs a kernel this build lacks";
    roundtrip(&in, &out);
    cr_assert(!out.admin_reply.ok);
    cr_assert_eq(out.admin_reply.code, KM_CODE_BAD_REQUEST);
    cr_assert_str_eq(out.admin_reply.message, "int4 needs a kernel this build lacks");
    km_msg_clear(&out);
}

Test(proto, heartbeat_roundtrips_every_section)
{
    km_endpoint eps[] = {{"requests", "tcp://10.0.0.5:7100"},
                         {"events", "tcp://10.0.0.5:7101"},
                         {"admin", "http://10.0.0.5:9100"}};
    km_kv_usage kv[] = {{0, KM_TIER_HOT, "f16", 100, 1 << 20, 4 << 20, 1 << 18},
                        {1, KM_TIER_HOST, "fp8", 50, 1 << 19, 8 << 20, 0},
                        {1, KM_TIER_DISK, "fp8", 7, 7 << 16, 1ull << 36, 7 << 16}};
    km_latency_q lat[] = {{0.5, 12.5, 4.25}, {0.99, 80, 9.5}};
    km_error_count errs[] = {{"bad_frame", 3}, {"oom", 1}};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_HEARTBEAT);
    km_msg_heartbeat *h = &in.hb;
    h->worker = "w-1";
    h->seq = 77;
    h->uptime_ms = 123456;
    h->state = KM_STATE_READY;
    h->endpoints = eps;
    h->n_endpoints = 3;
    h->model = "SmolLM2-135M-Instruct";
    h->fingerprint = "b179c9523d0e6a0f98a330c7562b6827";
    h->slots = 16;
    h->max_ctx = 8192;
    h->page_tokens = 16;
    h->kv = kv;
    h->n_kv = 3;
    h->rss_bytes = 1ull << 31;
    h->gpu_bytes = 0;
    h->queue_depth = 5;
    h->running = 9;
    h->decode_tps = 812.5;
    h->prefill_tps = 12000;
    h->latency = lat;
    h->n_latency = 2;
    h->errors = errs;
    h->n_errors = 2;
    h->tokens_total = 1ull << 40;
    h->kv_format_base = "f16";
    roundtrip(&in, &out);
    const km_msg_heartbeat *o = &out.hb;
    cr_assert_str_eq(o->worker, "w-1");
    cr_assert_eq(o->seq, 77);
    cr_assert_eq(o->uptime_ms, 123456);
    cr_assert_eq(o->state, KM_STATE_READY);
    cr_assert_eq(o->n_endpoints, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_str_eq(o->endpoints[i].name, eps[i].name);
        cr_assert_str_eq(o->endpoints[i].url, eps[i].url);
    }
    cr_assert_str_eq(o->model, "SmolLM2-135M-Instruct");
    cr_assert_str_eq(o->fingerprint, "b179c9523d0e6a0f98a330c7562b6827");
    cr_assert_eq(o->slots, 16);
    cr_assert_eq(o->max_ctx, 8192);
    cr_assert_eq(o->page_tokens, 16);
    cr_assert_eq(o->n_kv, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(o->kv[i].shard, kv[i].shard);
        cr_assert_eq(o->kv[i].tier, kv[i].tier);
        cr_assert_str_eq(o->kv[i].format, kv[i].format);
        cr_assert_eq(o->kv[i].pages, kv[i].pages);
        cr_assert_eq(o->kv[i].bytes, kv[i].bytes);
        cr_assert_eq(o->kv[i].capacity_bytes, kv[i].capacity_bytes);
        cr_assert_eq(o->kv[i].pinned_bytes, kv[i].pinned_bytes);
    }
    cr_assert_eq(o->rss_bytes, 1ull << 31);
    cr_assert_eq(o->queue_depth, 5);
    cr_assert_eq(o->running, 9);
    cr_assert_eq(o->decode_tps, 812.5);
    cr_assert_eq(o->prefill_tps, 12000);
    cr_assert_eq(o->tokens_total, 1ull << 40);
    cr_assert_str_eq(o->kv_format_base, "f16");
    cr_assert_eq(o->n_latency, 2);
    cr_assert_eq(o->latency[1].q, 0.99);
    cr_assert_eq(o->latency[1].ttft_ms, 80);
    cr_assert_eq(o->latency[1].tpot_ms, 9.5);
    cr_assert_eq(o->n_errors, 2);
    cr_assert_str_eq(o->errors[0].name, "bad_frame");
    cr_assert_eq(o->errors[0].count, 3);
    cr_assert_str_eq(o->errors[1].name, "oom");
    km_msg_clear(&out);
}

Test(proto, kv_events_roundtrip_for_each_kind)
{
    uint8_t hashes[3 * 16];
    for (int i = 0; i < (int)sizeof hashes; i++) hashes[i] = (uint8_t)(i * 37 + 1);
    km_kv_event_kind kinds[] = {KM_KV_STORED, KM_KV_REMOVED, KM_KV_TIER};
    for (int k = 0; k < 3; k++) {
        km_msg in, out;
        km_msg_init(&in, KM_MSG_KV_EVENT);
        in.kv.worker = "w-2";
        in.kv.seq = 1000 + (uint64_t)k;
        in.kv.kind = kinds[k];
        in.kv.tier = KM_TIER_HOST;
        in.kv.from_tier = KM_TIER_HOT;
        in.kv.hashes = hashes;
        in.kv.n_hashes = 3;
        in.kv.position_free = k == 1; /* chunk pages (docs/blend.md); absent = false */
        roundtrip(&in, &out);
        cr_assert_eq(out.kv.position_free, k == 1);
        cr_assert_str_eq(out.kv.worker, "w-2");
        cr_assert_eq(out.kv.seq, 1000 + (uint64_t)k);
        cr_assert_eq(out.kv.kind, kinds[k]);
        if (kinds[k] != KM_KV_REMOVED) cr_assert_eq(out.kv.tier, KM_TIER_HOST);
        if (kinds[k] == KM_KV_TIER) cr_assert_eq(out.kv.from_tier, KM_TIER_HOT);
        cr_assert_eq(out.kv.n_hashes, 3);
        cr_assert_arr_eq(out.kv.hashes, hashes, sizeof hashes);
        km_msg_clear(&out);
    }
}

/* ---------------------------------------------------------------- defaults and leniency */

Test(proto, absent_optional_fields_take_their_defaults)
{
    fb f;
    fb_init(&f);
    p_head(&f, 3, "req");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "model", "m");
    p_kstr(&f, "prompt", "x");
    km_msg m;
    km_errbuf err = {{0}};
    cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(m.req.temperature, 1.0f);
    cr_assert_eq(m.req.top_p, 1.0f);
    cr_assert_eq(m.req.repeat_penalty, 1.0f);
    cr_assert_eq(m.req.top_k, 0);
    cr_assert_eq(m.req.max_tokens, 0);
    cr_assert_eq(m.req.priority, 0);
    cr_assert(!m.req.has_seed);
    cr_assert(!m.req.stream);
    cr_assert_eq(m.req.cache_salt, NULL);
    km_msg_clear(&m);
    fb_free(&f);
}

Test(proto, unknown_keys_are_ignored_and_nil_means_absent)
{
    fb f;
    fb_init(&f);
    p_head(&f, 5, "req");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "model", "m");
    p_kstr(&f, "prompt", "x");
    p_kstr(&f, "future_field", "from a newer peer");
    p_str(&f, "cache_salt");
    msgpack_pack_nil(&f.pk);
    km_msg m;
    km_errbuf err = {{0}};
    cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(m.req.cache_salt, NULL);
    km_msg_clear(&m);
    fb_free(&f);
}

static void val_int_one(fb *f)
{
    msgpack_pack_int(&f->pk, 1);
}

Test(proto, integers_are_accepted_where_a_float_is_expected)
{
    fb f;
    request_with(&f, "temperature", val_int_one);
    km_msg m;
    km_errbuf err = {{0}};
    cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(m.req.temperature, 1.0f);
    km_msg_clear(&m);
    fb_free(&f);
}

/* ---------------------------------------------------------------- malformed frames */

static void val_str_hot(fb *f)
{
    p_str(f, "hot");
}
static void val_nan(fb *f)
{
    msgpack_pack_double(&f->pk, NAN);
}
static void val_big_temp(fb *f)
{
    msgpack_pack_double(&f->pk, 1000.0);
}
static void val_neg(fb *f)
{
    msgpack_pack_int(&f->pk, -5);
}
static void val_u64_max(fb *f)
{
    msgpack_pack_uint64(&f->pk, UINT64_MAX);
}
static void val_long_name(fb *f)
{
    char s[KM_PROTO_MAX_NAME + 2];
    memset(s, 'a', sizeof s - 1);
    s[sizeof s - 1] = '\0';
    p_str(f, s);
}
static void val_nul_name(fb *f)
{
    msgpack_pack_str(&f->pk, 3);
    msgpack_pack_str_body(&f->pk, "a\0b", 3);
}
static void val_17_stops(fb *f)
{
    msgpack_pack_array(&f->pk, 17);
    for (int i = 0; i < 17; i++) p_str(f, "x");
}
static void val_stop_not_str(fb *f)
{
    msgpack_pack_array(&f->pk, 1);
    msgpack_pack_int(&f->pk, 3);
}
static void val_tokens_bad(fb *f)
{
    msgpack_pack_array(&f->pk, 2);
    msgpack_pack_int(&f->pk, 3);
    msgpack_pack_int(&f->pk, -3);
}
static void val_bin(fb *f)
{
    msgpack_pack_bin(&f->pk, 2);
    msgpack_pack_bin_body(&f->pk, "hi", 2);
}

Test(proto, wrong_field_types_are_rejected_with_the_field_named)
{
    fb f;
    request_with(&f, "temperature", val_str_hot);
    expect_fail(&f, KM_EFORMAT, "req.temperature: expected a number, got string");
    request_with(&f, "stream", val_int_one);
    expect_fail(&f, KM_EFORMAT, "req.stream: expected a bool");
    request_with(&f, "model", val_int_one);
    expect_fail(&f, KM_EFORMAT, "req.model: expected a string");
    request_with(&f, "prompt", val_bin);
    expect_fail(&f, KM_EFORMAT, "req.prompt: expected a string, got binary");
    request_with(&f, "stop", val_stop_not_str);
    expect_fail(&f, KM_EFORMAT, "req.stop[0]: expected a string");
    request_with(&f, "tokens", val_tokens_bad);
    expect_fail(&f, KM_EFORMAT, "req.tokens[1]");
}

Test(proto, out_of_range_values_are_rejected)
{
    fb f;
    request_with(&f, "temperature", val_nan);
    expect_fail(&f, KM_EFORMAT, "req.temperature: not a finite number");
    request_with(&f, "temperature", val_big_temp);
    expect_fail(&f, KM_EFORMAT, "req.temperature: 1000 outside [0, 100]");
    request_with(&f, "max_tokens", val_neg);
    expect_fail(&f, KM_EFORMAT, "req.max_tokens: negative value -5");
    request_with(&f, "deadline_ms", val_u64_max);
    expect_fail(&f, KM_EFORMAT, "req.deadline_ms: 18446744073709551615 exceeds 4294967295");
    request_with(&f, "top_p", val_big_temp);
    expect_fail(&f, KM_EFORMAT, "req.top_p");
    request_with(&f, "priority", val_u64_max);
    expect_fail(&f, KM_EFORMAT, "req.priority");
}

Test(proto, strings_and_arrays_past_their_limits_are_rejected)
{
    fb f;
    request_with(&f, "model", val_long_name);
    expect_fail(&f, KM_EFORMAT, "req.model: 257 bytes, limit 256");
    request_with(&f, "cache_salt", val_nul_name);
    expect_fail(&f, KM_EFORMAT, "req.cache_salt: contains a NUL byte");
    request_with(&f, "stop", val_17_stops);
    expect_fail(&f, KM_EFORMAT, "req.stop: 17 strings, limit 16");

    /* prompt token ids past the configured limit */
    km_proto_limits lim;
    km_proto_limits_default(&lim);
    lim.max_prompt_tok = 4;
    int32_t toks[5] = {1, 2, 3, 4, 5};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "m";
    in.req.tokens = toks;
    in.req.n_tokens = 5;
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), 0, "%s", err.msg);
    int rc = km_msg_decode(b.data, b.len, &lim, &out, &err);
    cr_assert_eq(rc, KM_ERANGE, "%s", err.msg);
    cr_assert(strstr(err.msg, "req.tokens: 5 ids, limit 4"), "%s", err.msg);
    km_buf_free(&b);
}

Test(proto, missing_required_fields_are_named)
{
    fb f;
    fb_init(&f);
    p_head(&f, 2, "req");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "prompt", "x");
    expect_fail(&f, KM_EFORMAT, "req.model: required field missing");

    fb_init(&f);
    p_head(&f, 2, "req");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "model", "m");
    expect_fail(&f, KM_EFORMAT, "exactly one of prompt and tokens");

    fb_init(&f);
    p_head(&f, 1, "tok");
    p_kuint(&f, "id", 1);
    expect_fail(&f, KM_EFORMAT, "tok.index: required field missing");

    fb_init(&f);
    p_head(&f, 2, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "evict");
    expect_fail(&f, KM_EFORMAT, "admin.fraction: required field missing");

    fb_init(&f);
    p_head(&f, 3, "kv");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "seq", 1);
    p_kstr(&f, "kind", "tier");
    expect_fail(&f, KM_EFORMAT, "kv.tier: required field missing");

    fb_init(&f);
    p_head(&f, 2, "done");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "finish", "stop");
    expect_fail(&f, KM_EFORMAT, "done.usage: required field missing");

    fb_init(&f);
    p_head(&f, 1, "hb");
    p_kstr(&f, "worker", "w");
    expect_fail(&f, KM_EFORMAT, "hb.seq: required field missing");
}

Test(proto, unknown_types_versions_and_enum_values_are_rejected)
{
    fb f;
    fb_init(&f);
    p_head(&f, 1, "teleport");
    p_kuint(&f, "id", 1);
    expect_fail(&f, KM_EUNSUPPORTED, "unknown message type 'teleport'");

    fb_init(&f);
    msgpack_pack_map(&f.pk, 3);
    p_kuint(&f, "v", 2);
    p_kstr(&f, "t", "cancel");
    p_kuint(&f, "id", 1);
    expect_fail(&f, KM_EUNSUPPORTED, "protocol version 2 not supported");

    fb_init(&f);
    msgpack_pack_map(&f.pk, 2);
    p_kstr(&f, "t", "cancel");
    p_kuint(&f, "id", 1);
    expect_fail(&f, KM_EFORMAT, "no protocol version");

    fb_init(&f);
    p_head(&f, 2, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "reboot");
    expect_fail(&f, KM_EFORMAT, "admin.cmd: unknown value 'reboot'");

    fb_init(&f);
    p_head(&f, 3, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "set_kv_format");
    p_kstr(&f, "format", "f64");
    expect_fail(&f, KM_EFORMAT, "admin.format: 'f64' is not one of");

    fb_init(&f);
    p_head(&f, 4, "kv");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "seq", 1);
    p_kstr(&f, "kind", "stored");
    p_kuint(&f, "tier", 3);
    expect_fail(&f, KM_EFORMAT, "kv.tier: 3 exceeds 2");
}

Test(proto, structural_problems_are_rejected)
{
    fb f;
    /* not a map */
    fb_init(&f);
    msgpack_pack_array(&f.pk, 1);
    msgpack_pack_int(&f.pk, 1);
    expect_fail(&f, KM_EFORMAT, "expected a map");

    /* duplicate key */
    fb_init(&f);
    p_head(&f, 2, "cancel");
    p_kuint(&f, "id", 1);
    p_kuint(&f, "id", 2);
    expect_fail(&f, KM_EFORMAT, "key 'id' appears twice");

    /* non-string key */
    fb_init(&f);
    p_head(&f, 1, "cancel");
    msgpack_pack_int(&f.pk, 5);
    msgpack_pack_int(&f.pk, 5);
    expect_fail(&f, KM_EFORMAT, "keys must be strings");

    /* trailing bytes after the frame */
    fb_init(&f);
    p_head(&f, 1, "cancel");
    p_kuint(&f, "id", 1);
    msgpack_pack_nil(&f.pk);
    expect_fail(&f, KM_EFORMAT, "1 trailing bytes");

    /* nesting past the depth limit */
    fb_init(&f);
    p_head(&f, 2, "cancel");
    p_kuint(&f, "id", 1);
    p_str(&f, "deep");
    for (int i = 0; i < 20; i++) msgpack_pack_array(&f.pk, 1);
    msgpack_pack_nil(&f.pk);
    expect_fail(&f, KM_EFORMAT, "nesting deeper than");

    /* kv hashes not a multiple of 16 bytes */
    fb_init(&f);
    p_head(&f, 4, "kv");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "seq", 1);
    p_kstr(&f, "kind", "removed");
    p_str(&f, "hashes");
    msgpack_pack_bin(&f.pk, 17);
    msgpack_pack_bin_body(&f.pk, "0123456789abcdefg", 17);
    expect_fail(&f, KM_EFORMAT, "not a whole number of 16-byte hashes");
}

Test(proto, huge_claimed_arrays_and_strings_fail_before_any_allocation)
{
    /* {"v":1,"t":"req","tokens": array32 of 4 billion} in a dozen bytes */
    uint8_t frame[64];
    size_t n = 0;
    const uint8_t head[] = {0x83, 0xa1, 'v', 0x01, 0xa1, 't', 0xa3, 'r', 'e',
                            'q',  0xa6, 't', 'o',  'k',  'e', 'n',  's'};
    memcpy(frame, head, sizeof head);
    n = sizeof head;
    const uint8_t arr[] = {0xdd, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02};
    memcpy(frame + n, arr, sizeof arr);
    n += sizeof arr;
    km_msg m;
    km_errbuf err = {{0}};
    int rc = km_msg_decode(frame, n, NULL, &m, &err);
    cr_assert_eq(rc, KM_ERANGE, "%s", err.msg);
    cr_assert(strstr(err.msg, "array of 4294967295 elements"), "%s", err.msg);

    /* a map claiming 2^32-1 entries */
    const uint8_t map32[] = {0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 'v', 0x01};
    rc = km_msg_decode(map32, sizeof map32, NULL, &m, &err);
    cr_assert_eq(rc, KM_EFORMAT, "%s", err.msg);
    cr_assert(strstr(err.msg, "map of 4294967295 entries"), "%s", err.msg);

    /* a str32 claiming 4 GB */
    const uint8_t str32[] = {0x81, 0xa1, 'v', 0xdb, 0xff, 0xff, 0xff, 0xf0, 'x'};
    rc = km_msg_decode(str32, sizeof str32, NULL, &m, &err);
    cr_assert_eq(rc, KM_EFORMAT, "%s", err.msg);
    cr_assert(strstr(err.msg, "truncated"), "%s", err.msg);

    /* an array of moderate size but more elements than bytes left */
    const uint8_t arr16[] = {0xdc, 0x10, 0x00, 0x01, 0x02};
    rc = km_msg_decode(arr16, sizeof arr16, NULL, &m, &err);
    cr_assert_eq(rc, KM_EFORMAT, "%s", err.msg);
    cr_assert(strstr(err.msg, "claims 4096 items in 2 bytes"), "%s", err.msg);
}

Test(proto, oversized_frames_are_rejected_by_the_configured_limit)
{
    km_proto_limits lim;
    km_proto_limits_default(&lim);
    cr_assert_eq(lim.max_frame, 1u << 20);
    size_t big = (1u << 20) + 1;
    uint8_t *p = calloc(1, big);
    cr_assert_not_null(p);
    km_msg m;
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_decode(p, big, NULL, &m, &err), KM_ERANGE);
    cr_assert(strstr(err.msg, "exceeds the limit of 1048576"), "%s", err.msg);
    free(p);

    /* a smaller configured limit applies to encoding too */
    lim.max_frame = 64;
    char prompt[100];
    memset(prompt, 'p', sizeof prompt - 1);
    prompt[99] = '\0';
    km_msg in;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "m";
    in.req.prompt = prompt;
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&in, &lim, &b, &err), KM_EFORMAT, "%s", err.msg);
    cr_assert(strstr(err.msg, "req.prompt: longer than the frame limit 64"), "%s", err.msg);
    lim.max_frame = 110;
    cr_assert_eq(km_msg_encode(&in, &lim, &b, &err), KM_ERANGE, "%s", err.msg);
    cr_assert(strstr(err.msg, "limit 110"), "%s", err.msg);
    cr_assert_eq(b.len, 0);
    km_buf_free(&b);
}

Test(proto, every_truncation_of_a_valid_frame_is_an_error)
{
    km_endpoint eps[] = {{"requests", "tcp://127.0.0.1:7100"}};
    km_kv_usage kv[] = {{0, KM_TIER_HOT, "f16", 1, 2, 3, 1}};
    km_msg in;
    km_msg_init(&in, KM_MSG_HEARTBEAT);
    in.hb.worker = "w";
    in.hb.endpoints = eps;
    in.hb.n_endpoints = 1;
    in.hb.kv = kv;
    in.hb.n_kv = 1;
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), 0, "%s", err.msg);
    for (size_t n = 0; n < b.len; n++) {
        /* an exact-size heap copy, so ASan sees any read past the end */
        uint8_t *p = malloc(n ? n : 1);
        memcpy(p, b.data, n);
        km_msg m;
        int rc = km_msg_decode(p, n, NULL, &m, &err);
        cr_assert_lt(rc, 0, "prefix of %zu/%zu bytes decoded", n, b.len);
        km_msg_clear(&m);
        free(p);
    }
    km_buf_free(&b);
}

Test(proto, random_bytes_and_bit_flips_never_crash)
{
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    km_errbuf err;
    for (int iter = 0; iter < 20000; iter++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        size_t n = 1 + s % 200;
        uint8_t *p = malloc(n);
        for (size_t i = 0; i < n; i++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            p[i] = (uint8_t)s;
        }
        if (iter % 2) p[0] = (uint8_t)(0x80 | (p[0] & 0x0f)); /* make it look like a map */
        km_msg m;
        if (km_msg_decode(p, n, NULL, &m, &err) == 0) km_msg_clear(&m);
        free(p);
    }

    /* single bit flips of a valid request */
    int32_t toks[] = {1, 2, 3};
    km_msg in;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "m";
    in.req.tokens = toks;
    in.req.n_tokens = 3;
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), 0);
    for (size_t i = 0; i < b.len * 8; i++) {
        uint8_t *p = malloc(b.len);
        memcpy(p, b.data, b.len);
        p[i / 8] ^= (uint8_t)(1u << (i % 8));
        km_msg m;
        if (km_msg_decode(p, b.len, NULL, &m, &err) == 0) km_msg_clear(&m);
        free(p);
    }
    km_buf_free(&b);
}

Test(proto, encoder_refuses_messages_the_decoder_would_reject)
{
    km_msg in;
    km_buf b = {0};
    km_errbuf err = {{0}};
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.prompt = "x";
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), KM_EFORMAT);
    cr_assert(strstr(err.msg, "req.model: required"), "%s", err.msg);

    km_msg_init(&in, KM_MSG_KV_EVENT);
    in.kv.worker = "w";
    in.kv.kind = KM_KV_TIER;
    in.kv.tier = KM_TIER_DISK;
    in.kv.from_tier = KM_TIER_DISK;
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), KM_EFORMAT);
    cr_assert(strstr(err.msg, "kv.from_tier: equals tier"), "%s", err.msg);

    km_msg_init(&in, KM_MSG_ERROR);
    in.error.code = 0;
    in.error.message = "x";
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), KM_EFORMAT);
    cr_assert(strstr(err.msg, "err.code"), "%s", err.msg);

    km_msg_init(&in, KM_MSG_NONE);
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), KM_EUNSUPPORTED);
    km_buf_free(&b);
}

Test(proto, encoding_is_the_documented_byte_layout)
{
    /* docs/protocol.md shows this cancel frame byte by byte */
    km_msg in;
    km_msg_init(&in, KM_MSG_CANCEL);
    in.cancel.id = 42;
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, NULL), 0);
    const uint8_t want[] = {0x83, 0xa1, 'v', 0x01, 0xa1, 't', 0xa6, 'c', 'a',
                            'n',  'c',  'e', 'l',  0xa2, 'i', 'd',  0x2a};
    cr_assert_eq(b.len, sizeof want);
    cr_assert_arr_eq(b.data, want, sizeof want);
    km_buf_free(&b);
}

Test(proto, names_and_codes_map_both_ways)
{
    cr_assert_str_eq(km_msg_type_name(KM_MSG_HEARTBEAT), "hb");
    cr_assert_str_eq(km_msg_type_name((km_msg_type)99), "?");
    cr_assert_str_eq(km_finish_name(KM_FINISH_DEADLINE), "deadline");
    cr_assert_str_eq(km_admin_cmd_name(KM_ADMIN_SET_KV_FORMAT), "set_kv_format");
    cr_assert_str_eq(km_worker_state_name(KM_STATE_DRAINING), "draining");
    cr_assert_str_eq(km_msg_type_name(KM_MSG_VIEW), "view");
    cr_assert_str_eq(km_admin_cmd_name(KM_ADMIN_RECOVER), "recover");
    cr_assert_str_eq(km_admin_cmd_name(KM_ADMIN_PRESSURE), "pressure");
    const char *members[] = {"starting", "ready", "draining", "restarting", "dead", "left"};
    for (int i = 0; i < KM_MEMBER_STATE_COUNT; i++)
        cr_assert_str_eq(km_member_state_name((km_member_state)i), members[i]);
    cr_assert_str_eq(km_member_state_name(KM_MEMBER_STATE_COUNT), "?");
    cr_assert_str_eq(km_proto_code_name(KM_CODE_OVERLOADED), "overloaded");
    cr_assert_str_eq(km_proto_code_name(777), "unknown");
    cr_assert_eq(km_proto_code_from_err(KM_EFORMAT), KM_CODE_BAD_REQUEST);
    cr_assert_eq(km_proto_code_from_err(KM_EOVERLOAD), KM_CODE_OVERLOADED);
    cr_assert_eq(km_proto_code_from_err(KM_ETIMEDOUT), KM_CODE_DEADLINE);
    cr_assert_eq(km_proto_code_from_err(KM_EIO), KM_CODE_INTERNAL);
}

Test(proto, buf_grows_and_formats)
{
    km_buf b = {0};
    for (int i = 0; i < 1000; i++) cr_assert_eq(km_buf_printf(&b, "%d,", i), 0);
    cr_assert_eq(b.len, 3890);
    cr_assert_eq(memcmp(b.data, "0,1,2,", 6), 0);
    cr_assert_eq(b.data[b.len], '\0', "printf leaves a NUL after the text");
    km_buf_reset(&b);
    cr_assert_eq(b.len, 0);
    km_buf_free(&b);
    cr_assert_eq(b.data, NULL);
}

/* ---------------------------------------------------------------- the controller's frames */

/* A two-worker view: one ready with a full history, one dead with nothing optional. */
static km_recovery_action view_history[] = {
    {1763700000000ull, 1, "kv_pressure", true},
    {1763700005000ull, 2, "kv_pressure", true},
    {1763700035000ull, 0, "kv_pressure", true},
    {1763700040000ull, 3, "operator", false},
};
static km_view_worker view_workers[] = {
    {.id = "w-0",
     .state = KM_MEMBER_READY,
     .level = 2,
     .requests = "tcp://10.0.0.5:7100",
     .events = "tcp://10.0.0.5:7101",
     .admin = "http://10.0.0.5:9100",
     .model = "SmolLM2-135M-Instruct",
     .fingerprint = "b179c952",
     .kv_format = "fp8",
     .pressure = 0.9375,
     .last_seen_ms = 412,
     .running = 7,
     .queue_depth = 3,
     .history = view_history,
     .n_history = 4},
    {.id = "w-1", .state = KM_MEMBER_DEAD},
};

static void view_init(km_msg *m)
{
    km_msg_init(m, KM_MSG_VIEW);
    m->view.controller = "ctl-a";
    m->view.epoch = 1763699999000ull;
    m->view.seq = 42;
    m->view.workers = view_workers;
    m->view.n_workers = 2;
}

static void expect_encode_fail(const km_msg *in, const char *needle)
{
    km_buf b = {0};
    km_errbuf err = {{0}};
    int rc = km_msg_encode(in, NULL, &b, &err);
    cr_assert_eq(rc, KM_EFORMAT, "rc %d (%s)", rc, err.msg);
    cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
    cr_assert_eq(b.len, 0);
    km_buf_free(&b);
}

Test(proto, view_roundtrips_every_worker_and_history_entry)
{
    km_msg in, out;
    view_init(&in);
    roundtrip(&in, &out);
    const km_msg_view *v = &out.view;
    cr_assert_str_eq(v->controller, "ctl-a");
    cr_assert_eq(v->epoch, 1763699999000ull);
    cr_assert_eq(v->seq, 42);
    cr_assert_eq(v->n_workers, 2);
    const km_view_worker *w = &v->workers[0];
    cr_assert_str_eq(w->id, "w-0");
    cr_assert_eq(w->state, KM_MEMBER_READY);
    cr_assert_eq(w->level, 2);
    cr_assert_str_eq(w->requests, "tcp://10.0.0.5:7100");
    cr_assert_str_eq(w->events, "tcp://10.0.0.5:7101");
    cr_assert_str_eq(w->admin, "http://10.0.0.5:9100");
    cr_assert_str_eq(w->model, "SmolLM2-135M-Instruct");
    cr_assert_str_eq(w->fingerprint, "b179c952");
    cr_assert_str_eq(w->kv_format, "fp8");
    cr_assert_eq(w->pressure, 0.9375);
    cr_assert_eq(w->last_seen_ms, 412);
    cr_assert_eq(w->running, 7);
    cr_assert_eq(w->queue_depth, 3);
    cr_assert_eq(w->n_history, 4);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(w->history[i].at_ms, view_history[i].at_ms);
        cr_assert_eq(w->history[i].level, view_history[i].level);
        cr_assert_str_eq(w->history[i].reason, view_history[i].reason);
        cr_assert_eq(w->history[i].ok, view_history[i].ok);
    }
    w = &v->workers[1];
    cr_assert_str_eq(w->id, "w-1");
    cr_assert_eq(w->state, KM_MEMBER_DEAD);
    cr_assert_eq(w->level, 0);
    cr_assert_eq(w->requests, NULL, "an unknown endpoint stays NULL");
    cr_assert_eq(w->events, NULL);
    cr_assert_eq(w->admin, NULL);
    cr_assert_eq(w->kv_format, NULL);
    cr_assert_eq(w->n_history, 0);
    cr_assert_eq(w->history, NULL);
    km_msg_clear(&out);

    /* every member state, and a view with no workers at all */
    for (int s = 0; s < KM_MEMBER_STATE_COUNT; s++) {
        km_view_worker one = {.id = "w", .state = (km_member_state)s};
        km_msg_init(&in, KM_MSG_VIEW);
        in.view.controller = "c";
        in.view.workers = &one;
        in.view.n_workers = 1;
        roundtrip(&in, &out);
        cr_assert_eq(out.view.workers[0].state, (km_member_state)s);
        km_msg_clear(&out);
    }
    km_msg_init(&in, KM_MSG_VIEW);
    in.view.controller = "c";
    roundtrip(&in, &out);
    cr_assert_eq(out.view.n_workers, 0);
    cr_assert_eq(out.view.workers, NULL);
    km_msg_clear(&out);
}

Test(proto, largest_view_fits_the_default_frame_and_roundtrips)
{
    /* 256 workers with endpoints and a full 32-entry history each */
    static km_view_worker ws[KM_PROTO_MAX_VIEW_WORKERS];
    static char ids[KM_PROTO_MAX_VIEW_WORKERS][24];
    km_recovery_action hist[KM_PROTO_MAX_HISTORY];
    for (int k = 0; k < KM_PROTO_MAX_HISTORY; k++)
        hist[k] = (km_recovery_action){1763700000000ull + (uint64_t)k, (uint32_t)(k % 4),
                                       "kv_pressure", k % 3 != 0};
    for (int i = 0; i < KM_PROTO_MAX_VIEW_WORKERS; i++) {
        snprintf(ids[i], sizeof ids[i], "worker-%d", i);
        ws[i] = (km_view_worker){.id = ids[i],
                                 .state = (km_member_state)(i % KM_MEMBER_STATE_COUNT),
                                 .level = (uint32_t)(i % 4),
                                 .requests = "tcp://10.0.0.5:7100",
                                 .events = "tcp://10.0.0.5:7101",
                                 .admin = "http://10.0.0.5:9100",
                                 .kv_format = "f16",
                                 .pressure = i / 256.0,
                                 .history = hist,
                                 .n_history = KM_PROTO_MAX_HISTORY};
    }
    km_msg in, out;
    km_msg_init(&in, KM_MSG_VIEW);
    in.view.controller = "c";
    in.view.workers = ws;
    in.view.n_workers = KM_PROTO_MAX_VIEW_WORKERS;
    roundtrip(&in, &out);
    cr_assert_eq(out.view.n_workers, KM_PROTO_MAX_VIEW_WORKERS);
    cr_assert_str_eq(out.view.workers[255].id, "worker-255");
    cr_assert_eq(out.view.workers[255].n_history, KM_PROTO_MAX_HISTORY);
    cr_assert_eq(out.view.workers[255].history[31].at_ms, 1763700000031ull);
    cr_assert_eq(out.view.workers[100].pressure, 100 / 256.0);
    km_msg_clear(&out);
}

Test(proto, recover_and_pressure_commands_roundtrip_and_worker_is_optional_elsewhere)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.id = 11;
    in.admin.cmd = KM_ADMIN_RECOVER;
    in.admin.worker = "w-3";
    in.admin.level = 3;
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.id, 11);
    cr_assert_eq(out.admin.cmd, KM_ADMIN_RECOVER);
    cr_assert_str_eq(out.admin.worker, "w-3");
    cr_assert_eq(out.admin.level, 3);
    km_msg_clear(&out);

    double fractions[] = {0, 0.5, 1};
    for (int i = 0; i < 3; i++) {
        km_msg_init(&in, KM_MSG_ADMIN);
        in.admin.cmd = KM_ADMIN_PRESSURE;
        in.admin.fraction = fractions[i];
        roundtrip(&in, &out);
        cr_assert_eq(out.admin.cmd, KM_ADMIN_PRESSURE);
        cr_assert_eq(out.admin.fraction, fractions[i]);
        cr_assert_eq(out.admin.worker, NULL);
        km_msg_clear(&out);
    }

    /* an operator may name the worker on any command; the controller forwards it */
    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_EVICT;
    in.admin.fraction = 0.25;
    in.admin.worker = "w-0";
    roundtrip(&in, &out);
    cr_assert_str_eq(out.admin.worker, "w-0");
    cr_assert_eq(out.admin.fraction, 0.25);
    km_msg_clear(&out);

    /* a reply to recover carries the command name back */
    km_msg_init(&in, KM_MSG_ADMIN_REPLY);
    in.admin_reply.cmd = KM_ADMIN_RECOVER;
    in.admin_reply.ok = false;
    in.admin_reply.code = KM_CODE_NOT_FOUND;
    in.admin_reply.message = "no worker 'w-9'";
    roundtrip(&in, &out);
    cr_assert_eq(out.admin_reply.cmd, KM_ADMIN_RECOVER);
    cr_assert_eq(out.admin_reply.code, KM_CODE_NOT_FOUND);
    km_msg_clear(&out);
}

Test(proto, older_frames_without_the_new_optional_keys_still_decode)
{
    /* a heartbeat from before pinned_bytes and tokens_total */
    fb f;
    fb_init(&f);
    p_head(&f, 4, "hb");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "seq", 1);
    p_kstr(&f, "state", "ready");
    p_str(&f, "kv");
    msgpack_pack_array(&f.pk, 1);
    msgpack_pack_map(&f.pk, 4);
    p_kuint(&f, "shard", 0);
    p_kuint(&f, "tier", 0);
    p_kstr(&f, "format", "f16");
    p_kuint(&f, "bytes", 4096);
    km_msg m;
    km_errbuf err = {{0}};
    cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(m.hb.n_kv, 1);
    cr_assert_eq(m.hb.kv[0].bytes, 4096);
    cr_assert_eq(m.hb.kv[0].pinned_bytes, 0);
    cr_assert_eq(m.hb.tokens_total, 0);
    cr_assert_null(m.hb.kv_format_base);
    km_msg_clear(&m);
    fb_free(&f);

    /* an admin command without "worker" */
    fb_init(&f);
    p_head(&f, 2, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "drain");
    cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(m.admin.worker, NULL);
    km_msg_clear(&m);
    fb_free(&f);

    /* a minimal view: optional worker fields absent, unknown keys ignored */
    fb_init(&f);
    p_head(&f, 4, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 9);
    p_kstr(&f, "future", "x");
    p_str(&f, "workers");
    msgpack_pack_array(&f.pk, 1);
    msgpack_pack_map(&f.pk, 3);
    p_kstr(&f, "id", "w");
    p_kstr(&f, "state", "restarting");
    p_kstr(&f, "future", "y");
    cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(m.view.seq, 9);
    cr_assert_eq(m.view.epoch, 0);
    cr_assert_eq(m.view.n_workers, 1);
    cr_assert_eq(m.view.workers[0].state, KM_MEMBER_RESTARTING);
    cr_assert_eq(m.view.workers[0].level, 0);
    cr_assert_eq(m.view.workers[0].pressure, 0);
    cr_assert_eq(m.view.workers[0].requests, NULL);
    km_msg_clear(&m);
    fb_free(&f);
}

Test(proto, recover_and_pressure_arguments_are_validated)
{
    fb f;
    fb_init(&f);
    p_head(&f, 3, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "recover");
    p_kuint(&f, "level", 1);
    expect_fail(&f, KM_EFORMAT, "admin.worker: required field missing");

    fb_init(&f);
    p_head(&f, 3, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "recover");
    p_kstr(&f, "worker", "w");
    expect_fail(&f, KM_EFORMAT, "admin.level: required field missing");

    fb_init(&f);
    p_head(&f, 4, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "recover");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "level", 4);
    {
        /* the range is the controller's to check: it answers admin_reply 400 with the id */
        km_msg m;
        km_errbuf err = {{0}};
        cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
        cr_assert_eq(m.admin.level, 4);
        km_msg_clear(&m);
        fb_free(&f);
    }

    fb_init(&f);
    p_head(&f, 4, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "recover");
    p_kstr(&f, "worker", "");
    p_kuint(&f, "level", 2);
    expect_fail(&f, KM_EFORMAT, "admin.worker: length 0 outside [1, 256]");

    fb_init(&f);
    p_head(&f, 2, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "pressure");
    expect_fail(&f, KM_EFORMAT, "admin.fraction: required field missing");

    fb_init(&f);
    p_head(&f, 3, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "pressure");
    p_str(&f, "fraction");
    msgpack_pack_double(&f.pk, 1.5);
    expect_fail(&f, KM_EFORMAT, "admin.fraction: 1.5 outside [0, 1]");

    fb_init(&f);
    p_head(&f, 3, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "status");
    p_kuint(&f, "worker", 5);
    expect_fail(&f, KM_EFORMAT, "admin.worker: expected a string, got integer");

    km_msg in;
    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_RECOVER;
    in.admin.worker = "w";
    in.admin.level = 1;
    in.admin.worker = NULL;
    expect_encode_fail(&in, "admin.worker: required");
    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_PRESSURE;
    in.admin.fraction = -0.1;
    expect_encode_fail(&in, "admin.fraction: -0.1 outside [0, 1]");
}

Test(proto, pinned_bytes_above_bytes_are_rejected)
{
    fb f;
    fb_init(&f);
    p_head(&f, 4, "hb");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "seq", 1);
    p_kstr(&f, "state", "ready");
    p_str(&f, "kv");
    msgpack_pack_array(&f.pk, 1);
    msgpack_pack_map(&f.pk, 5);
    p_kuint(&f, "shard", 0);
    p_kuint(&f, "tier", 0);
    p_kstr(&f, "format", "f16");
    p_kuint(&f, "bytes", 8);
    p_kuint(&f, "pinned_bytes", 9);
    expect_fail(&f, KM_EFORMAT, "hb.kv[0].pinned_bytes: 9 > bytes 8");

    fb_init(&f);
    p_head(&f, 4, "hb");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "seq", 1);
    p_kstr(&f, "state", "ready");
    p_kstr(&f, "tokens_total", "many");
    expect_fail(&f, KM_EFORMAT, "hb.tokens_total: expected an unsigned integer, got string");

    fb_init(&f);
    p_head(&f, 4, "hb");
    p_kstr(&f, "worker", "w");
    p_kuint(&f, "seq", 1);
    p_kstr(&f, "state", "ready");
    p_kstr(&f, "kv_format_base", "f17");
    expect_fail(&f, KM_EFORMAT, "hb.kv_format_base: unknown KV format 'f17'");
}

/* A view frame with one worker whose map gets `extra` more keys written by `fill`. */
static void view_with(fb *f, uint32_t extra, void (*fill)(fb *))
{
    fb_init(f);
    p_head(f, 3, "view");
    p_kstr(f, "controller", "c");
    p_kuint(f, "seq", 1);
    p_str(f, "workers");
    msgpack_pack_array(&f->pk, 1);
    msgpack_pack_map(&f->pk, 2 + extra);
    p_kstr(f, "id", "w-0");
    p_kstr(f, "state", "ready");
    fill(f);
}
static void vw_level5(fb *f)
{
    p_kuint(f, "level", 5);
}
static void vw_neg_pressure(fb *f)
{
    p_str(f, "pressure");
    msgpack_pack_double(&f->pk, -0.5);
}
static void vw_bad_format(fb *f)
{
    p_kstr(f, "kv_format", "f64");
}
static void vw_history_no_reason(fb *f)
{
    p_str(f, "history");
    msgpack_pack_array(&f->pk, 2);
    msgpack_pack_map(&f->pk, 2);
    p_kuint(f, "level", 1);
    p_kstr(f, "reason", "stall");
    msgpack_pack_map(&f->pk, 1);
    p_kuint(f, "level", 2);
}
static void vw_history_level9(fb *f)
{
    p_str(f, "history");
    msgpack_pack_array(&f->pk, 1);
    msgpack_pack_map(&f->pk, 2);
    p_kuint(f, "level", 9);
    p_kstr(f, "reason", "stall");
}
static void vw_history_33(fb *f)
{
    p_str(f, "history");
    msgpack_pack_array(&f->pk, 33);
    for (int i = 0; i < 33; i++) {
        msgpack_pack_map(&f->pk, 2);
        p_kuint(f, "level", 1);
        p_kstr(f, "reason", "kv_pressure");
    }
}
static void vw_history_not_map(fb *f)
{
    p_str(f, "history");
    msgpack_pack_array(&f->pk, 1);
    p_str(f, "level 1");
}
static void vw_queue_depth_as_str(fb *f)
{
    p_kuint(f, "running", 3);
    p_kstr(f, "queue_depth", "3");
}

Test(proto, view_fields_are_validated_with_the_worker_named)
{
    fb f;
    view_with(&f, 1, vw_level5);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].level: 5 outside [0, 3]");
    view_with(&f, 1, vw_neg_pressure);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].pressure: -0.5 must be finite and >= 0");
    view_with(&f, 1, vw_bad_format);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].kv_format: unknown KV format 'f64'");
    view_with(&f, 1, vw_history_no_reason);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].history[1].reason: required field missing");
    view_with(&f, 1, vw_history_level9);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].history[0].level: 9 outside [0, 3]");
    view_with(&f, 1, vw_history_33);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].history: 33 entries, limit 32");
    view_with(&f, 1, vw_history_not_map);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].history[0]: expected a map, got string");
    view_with(&f, 2, vw_queue_depth_as_str);
    expect_fail(&f, KM_EFORMAT, "view.workers[0].queue_depth: expected an unsigned integer");

    /* unknown state, missing id, worker not a map, workers not an array, no controller */
    fb_init(&f);
    p_head(&f, 3, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 1);
    p_str(&f, "workers");
    msgpack_pack_array(&f.pk, 2);
    msgpack_pack_map(&f.pk, 2);
    p_kstr(&f, "id", "w-0");
    p_kstr(&f, "state", "ready");
    msgpack_pack_map(&f.pk, 2);
    p_kstr(&f, "id", "w-1");
    p_kstr(&f, "state", "zombie");
    expect_fail(&f, KM_EFORMAT, "view.workers[1].state: unknown value 'zombie'");

    fb_init(&f);
    p_head(&f, 3, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 1);
    p_str(&f, "workers");
    msgpack_pack_array(&f.pk, 1);
    msgpack_pack_map(&f.pk, 1);
    p_kstr(&f, "state", "ready");
    expect_fail(&f, KM_EFORMAT, "view.workers[0].id: required field missing");

    fb_init(&f);
    p_head(&f, 3, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 1);
    p_str(&f, "workers");
    msgpack_pack_array(&f.pk, 1);
    msgpack_pack_int(&f.pk, 7);
    expect_fail(&f, KM_EFORMAT, "view.workers[0]: expected a map, got integer");

    fb_init(&f);
    p_head(&f, 3, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 1);
    p_str(&f, "workers");
    msgpack_pack_map(&f.pk, 0);
    expect_fail(&f, KM_EFORMAT, "view.workers: expected an array, got map");

    fb_init(&f);
    p_head(&f, 2, "view");
    p_kuint(&f, "seq", 1);
    p_str(&f, "workers");
    msgpack_pack_array(&f.pk, 0);
    expect_fail(&f, KM_EFORMAT, "view.controller: required field missing");

    fb_init(&f);
    p_head(&f, 2, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 1);
    expect_fail(&f, KM_EFORMAT, "view.workers: required field missing");
}

Test(proto, view_worker_ids_must_be_unique_and_the_worker_count_is_capped)
{
    fb f;
    fb_init(&f);
    p_head(&f, 3, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 1);
    p_str(&f, "workers");
    msgpack_pack_array(&f.pk, 3);
    const char *ids[] = {"w-0", "w-1", "w-0"};
    for (int i = 0; i < 3; i++) {
        msgpack_pack_map(&f.pk, 2);
        p_kstr(&f, "id", ids[i]);
        p_kstr(&f, "state", "ready");
    }
    expect_fail(&f, KM_EFORMAT, "view.workers: duplicate id 'w-0' (entries 0 and 2)");

    fb_init(&f);
    p_head(&f, 3, "view");
    p_kstr(&f, "controller", "c");
    p_kuint(&f, "seq", 1);
    p_str(&f, "workers");
    msgpack_pack_array(&f.pk, KM_PROTO_MAX_VIEW_WORKERS + 1);
    for (int i = 0; i <= KM_PROTO_MAX_VIEW_WORKERS; i++) {
        char id[16];
        snprintf(id, sizeof id, "w-%d", i);
        msgpack_pack_map(&f.pk, 2);
        p_kstr(&f, "id", id);
        p_kstr(&f, "state", "ready");
    }
    expect_fail(&f, KM_EFORMAT, "view.workers: 257 entries, limit 256");

    /* the encoder refuses the same things */
    km_msg in;
    km_view_worker dup[] = {{.id = "a"}, {.id = "a"}};
    km_msg_init(&in, KM_MSG_VIEW);
    in.view.controller = "c";
    in.view.workers = dup;
    in.view.n_workers = 2;
    expect_encode_fail(&in, "view.workers: duplicate id 'a'");
    in.view.n_workers = KM_PROTO_MAX_VIEW_WORKERS + 1;
    expect_encode_fail(&in, "view.workers: 257 entries, limit 256");
    km_view_worker noid[] = {{.state = KM_MEMBER_READY}};
    in.view.workers = noid;
    in.view.n_workers = 1;
    expect_encode_fail(&in, "view.workers[0].id: required");
    km_view_worker badstate[] = {{.id = "a", .state = KM_MEMBER_STATE_COUNT}};
    in.view.workers = badstate;
    expect_encode_fail(&in, "view.workers[0].state: unknown state 6");
    km_recovery_action nores[] = {{.level = 1}};
    km_view_worker nohist[] = {{.id = "a", .history = nores, .n_history = 1}};
    in.view.workers = nohist;
    expect_encode_fail(&in, "view.workers[0].history[0].reason: required");
    nohist[0].history = NULL;
    expect_encode_fail(&in, "view.workers[0].history: NULL with n_history 1");
    nohist[0].n_history = KM_PROTO_MAX_HISTORY + 1;
    expect_encode_fail(&in, "view.workers[0].history: 33 entries, limit 32");
    in.view.workers = NULL;
    expect_encode_fail(&in, "view.workers: NULL with n_workers 1");
    in.view.controller = NULL;
    expect_encode_fail(&in, "view.controller: required");
}

Test(proto, every_truncation_and_bit_flip_of_a_view_frame_is_handled)
{
    km_msg in;
    view_init(&in);
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, &err), 0, "%s", err.msg);
    for (size_t n = 0; n < b.len; n++) {
        uint8_t *p = malloc(n ? n : 1);
        memcpy(p, b.data, n);
        km_msg m;
        int rc = km_msg_decode(p, n, NULL, &m, &err);
        cr_assert_lt(rc, 0, "prefix of %zu/%zu bytes decoded", n, b.len);
        km_msg_clear(&m);
        free(p);
    }
    for (size_t i = 0; i < b.len * 8; i++) {
        uint8_t *p = malloc(b.len);
        memcpy(p, b.data, b.len);
        p[i / 8] ^= (uint8_t)(1u << (i % 8));
        km_msg m;
        if (km_msg_decode(p, b.len, NULL, &m, &err) == 0) km_msg_clear(&m);
        free(p);
    }
    km_buf_free(&b);
}

/* ---------------------------------------------------------------- keys added within version 1:
 * done.worker/migrations, the KV event replay keys of admin and admin_reply, the id of a
 * rejected frame */

Test(proto, done_worker_and_migrations_roundtrip_and_are_absent_by_default)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_DONE);
    in.done.id = 3;
    in.done.worker = "w-2";
    in.done.migrations = 2;
    roundtrip(&in, &out);
    cr_assert_str_eq(out.done.worker, "w-2");
    cr_assert_eq(out.done.migrations, 2);
    km_msg_clear(&out);

    /* a worker's done frame carries neither key: both stay absent */
    km_msg_init(&in, KM_MSG_DONE);
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, NULL), 0);
    cr_assert_null(memmem(b.data, b.len, "worker", 6));
    cr_assert_null(memmem(b.data, b.len, "migrations", 10));
    cr_assert_eq(km_msg_decode(b.data, b.len, NULL, &out, NULL), 0);
    cr_assert_null(out.done.worker);
    cr_assert_eq(out.done.migrations, 0);
    km_msg_clear(&out);
    km_buf_free(&b);

    char name[KM_PROTO_MAX_NAME + 2];
    memset(name, 'w', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    km_msg_init(&in, KM_MSG_DONE);
    in.done.worker = name;
    expect_encode_fail(&in, "done.worker: length 257");
}

Test(proto, done_frames_of_a_router_decode_with_their_extra_keys)
{
    /* what routers before km_msg modelled the keys appended to a worker's done frame */
    fb f;
    fb_init(&f);
    p_head(&f, 5, "done");
    p_kuint(&f, "id", 4);
    p_kstr(&f, "finish", "stop");
    p_str(&f, "usage");
    msgpack_pack_map(&f.pk, 2);
    p_kuint(&f, "prompt_tokens", 10);
    p_kuint(&f, "completion_tokens", 2);
    p_kstr(&f, "worker", "w0");
    p_kuint(&f, "migrations", 1);
    km_msg m;
    km_errbuf err = {{0}};
    cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
    cr_assert_str_eq(m.done.worker, "w0");
    cr_assert_eq(m.done.migrations, 1);
    km_msg_clear(&m);
    fb_free(&f);

    fb_init(&f);
    p_head(&f, 4, "done");
    p_kuint(&f, "id", 4);
    p_kstr(&f, "finish", "stop");
    p_str(&f, "usage");
    msgpack_pack_map(&f.pk, 2);
    p_kuint(&f, "prompt_tokens", 10);
    p_kuint(&f, "completion_tokens", 2);
    p_kstr(&f, "migrations", "one");
    expect_fail(&f, KM_EFORMAT, "done.migrations: expected an unsigned integer");
}

Test(proto, status_replay_keys_roundtrip_in_admin_and_admin_reply)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.id = 11;
    in.admin.cmd = KM_ADMIN_STATUS;
    in.admin.has_events_since = true;
    in.admin.events_since = 0; /* "from the start" is a value, not an absence */
    roundtrip(&in, &out);
    cr_assert(out.admin.has_events_since);
    cr_assert_eq(out.admin.events_since, 0);
    cr_assert(!out.admin.events_snapshot);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_STATUS;
    in.admin.has_events_since = true;
    in.admin.events_since = 1ull << 40;
    in.admin.events_snapshot = true;
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.events_since, 1ull << 40);
    cr_assert(out.admin.events_snapshot);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.cmd = KM_ADMIN_STATUS;
    roundtrip(&in, &out);
    cr_assert(!out.admin.has_events_since && !out.admin.events_snapshot, "a plain status");
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_ADMIN_REPLY);
    in.admin_reply.id = 11;
    in.admin_reply.has_events_next = true;
    in.admin_reply.events_next = 1042;
    in.admin_reply.events_snapshot = true;
    roundtrip(&in, &out);
    cr_assert(out.admin_reply.has_events_next);
    cr_assert_eq(out.admin_reply.events_next, 1042);
    cr_assert(out.admin_reply.events_snapshot);
    km_msg_clear(&out);

    /* a replay (not a snapshot) still says so: events_snapshot 0 goes on the wire */
    km_msg_init(&in, KM_MSG_ADMIN_REPLY);
    in.admin_reply.has_events_next = true;
    in.admin_reply.events_next = 7;
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, NULL), 0);
    const uint8_t snap0[] = {0xaf, 'e', 'v', 'e', 'n', 't', 's', '_', 's',
                             'n',  'a', 'p', 's', 'h', 'o', 't', 0x00};
    cr_assert_not_null(memmem(b.data, b.len, snap0, sizeof snap0));
    km_buf_free(&b);

    /* a worker that does not replay answers a plain reply */
    km_msg_init(&in, KM_MSG_ADMIN_REPLY);
    roundtrip(&in, &out);
    cr_assert(!out.admin_reply.has_events_next);
    km_msg_clear(&out);
}

Test(proto, replay_flags_decode_as_bool_or_uint_and_nothing_else)
{
    /* workers so far send admin_reply.events_snapshot as a uint; a bool means the same */
    const char *keys[] = {"events_snapshot", "events_snapshot"};
    for (int form = 0; form < 2; form++) {
        fb f;
        fb_init(&f);
        p_head(&f, 5, "admin_reply");
        p_kuint(&f, "id", 1);
        p_kstr(&f, "cmd", "status");
        p_str(&f, "ok");
        msgpack_pack_true(&f.pk);
        p_kuint(&f, "events_next", 99);
        p_str(&f, keys[form]);
        if (form)
            msgpack_pack_true(&f.pk);
        else
            msgpack_pack_uint64(&f.pk, 1);
        km_msg m;
        km_errbuf err = {{0}};
        cr_assert_eq(decode_fb(&f, &m, &err), 0, "%s", err.msg);
        cr_assert(m.admin_reply.has_events_next);
        cr_assert_eq(m.admin_reply.events_next, 99);
        cr_assert(m.admin_reply.events_snapshot, "form %d", form);
        km_msg_clear(&m);
        fb_free(&f);
    }

    fb f;
    fb_init(&f);
    p_head(&f, 3, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "status");
    p_kstr(&f, "events_snapshot", "yes");
    expect_fail(&f, KM_EFORMAT, "admin.events_snapshot: expected a bool or an unsigned integer");

    fb_init(&f);
    p_head(&f, 3, "admin");
    p_kuint(&f, "id", 1);
    p_kstr(&f, "cmd", "status");
    p_str(&f, "events_since");
    msgpack_pack_int64(&f.pk, -1);
    expect_fail(&f, KM_EFORMAT, "admin.events_since: negative value -1");
}

/* Decodes a frame that must fail and returns the id it was attributed to. */
static uint64_t rejected_id(const void *p, size_t n, int want_rc)
{
    km_msg m;
    km_errbuf err = {{0}};
    int rc = km_msg_decode(p, n, NULL, &m, &err);
    cr_assert_eq(rc, want_rc, "rc %d (%s), want %d", rc, err.msg, want_rc);
    cr_assert_eq(m.mem_, NULL);
    cr_assert_eq(m.type, KM_MSG_NONE);
    return m.rejected_id;
}

Test(proto, a_rejected_frame_names_its_id_when_it_has_a_readable_one)
{
    fb f;
    /* wrong version, wrong field type, unknown type: the id comes back */
    fb_init(&f);
    msgpack_pack_map(&f.pk, 3);
    p_kuint(&f, "v", 9);
    p_kstr(&f, "t", "req");
    p_kuint(&f, "id", 5);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_EUNSUPPORTED), 5);
    fb_free(&f);

    fb_init(&f);
    p_head(&f, 3, "req");
    p_kuint(&f, "id", 1ull << 50);
    p_kstr(&f, "model", "x");
    p_kuint(&f, "prompt", 7);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_EFORMAT), 1ull << 50);
    fb_free(&f);

    /* rejected by the bounds scan: a token array past the limit after the id, and a frame cut
     * short after it (no allocation is made for either) */
    fb_init(&f);
    p_head(&f, 3, "req");
    p_kuint(&f, "id", 300);
    p_kstr(&f, "model", "x");
    p_str(&f, "tokens");
    msgpack_pack_array(&f.pk, KM_PROTO_MAX_PROMPT_TOK + 1);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_ERANGE), 300);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size - 3, KM_EFORMAT), 300);
    fb_free(&f);

    /* trailing bytes after an otherwise good frame */
    fb_init(&f);
    p_head(&f, 1, "cancel");
    p_kuint(&f, "id", 70000);
    msgpack_pack_nil(&f.pk);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_EFORMAT), 70000);
    fb_free(&f);

    /* over the frame limit: the scan still reads the id */
    size_t big = (1u << 20) + 64;
    fb_init(&f);
    p_head(&f, 2, "req");
    p_kuint(&f, "id", 12);
    p_str(&f, "prompt");
    char *pad = malloc(big);
    memset(pad, 'p', big);
    msgpack_pack_str(&f.pk, big);
    msgpack_pack_str_body(&f.pk, pad, big);
    free(pad);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_ERANGE), 12);
    fb_free(&f);
}

Test(proto, a_rejected_frame_without_a_readable_id_names_none)
{
    cr_assert_eq(rejected_id("\xc1garbage", 8, KM_EFORMAT), 0);
    cr_assert_eq(rejected_id("\x93\x01\x02\x03", 4, KM_EFORMAT), 0); /* an array, not a map */
    fb f;
    /* an id that is negative, a string, or nested below the root is no id */
    fb_init(&f);
    p_head(&f, 1, "cancel");
    p_str(&f, "id");
    msgpack_pack_int64(&f.pk, -5);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_EFORMAT), 0);
    fb_free(&f);

    fb_init(&f);
    p_head(&f, 1, "cancel");
    p_kstr(&f, "id", "5");
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_EFORMAT), 0);
    fb_free(&f);

    fb_init(&f);
    p_head(&f, 1, "done");
    p_str(&f, "usage");
    msgpack_pack_map(&f.pk, 1);
    p_kuint(&f, "id", 8);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_EFORMAT), 0);
    fb_free(&f);

    /* the frame is cut inside the id's value */
    fb_init(&f);
    p_head(&f, 1, "cancel");
    p_kuint(&f, "id", 1ull << 40);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size - 2, KM_EFORMAT), 0);
    fb_free(&f);

    /* a duplicate id: the first one counts, as the rejection names the frame's first id */
    fb_init(&f);
    p_head(&f, 2, "cancel");
    p_kuint(&f, "id", 1);
    p_kuint(&f, "id", 2);
    cr_assert_eq(rejected_id(f.sb.data, f.sb.size, KM_EFORMAT), 1);
    fb_free(&f);

    /* a decoded frame never sets it */
    km_msg in, out;
    km_msg_init(&in, KM_MSG_CANCEL);
    in.cancel.id = 9;
    roundtrip(&in, &out);
    cr_assert_eq(out.rejected_id, 0);
    km_msg_clear(&out);
}

/* Every seed of the fuzz target decodes as its name says: bad_* fail, the others succeed and
 * re-encode to a frame that decodes again. */
Test(proto, fuzz_seed_corpus_decodes_as_named)
{
    DIR *dir = opendir("tests/fuzz/corpus/fuzz_proto");
    if (!dir) cr_skip_test("no fuzz corpus at tests/fuzz/corpus/fuzz_proto");
    int n = 0;
    for (struct dirent *e; (e = readdir(dir));) {
        if (e->d_name[0] == '.') continue;
        char path[512];
        snprintf(path, sizeof path, "tests/fuzz/corpus/fuzz_proto/%s", e->d_name);
        FILE *fp = fopen(path, "rb");
        cr_assert_not_null(fp, "%s", path);
        static uint8_t buf[1 << 16];
        size_t len = fread(buf, 1, sizeof buf, fp);
        fclose(fp);
        km_msg m;
        km_errbuf err = {{0}};
        int rc = km_msg_decode(buf, len, NULL, &m, &err);
        if (!strncmp(e->d_name, "bad_", 4)) {
            cr_assert_lt(rc, 0, "%s decoded", e->d_name);
        } else {
            cr_assert_eq(rc, 0, "%s: %s", e->d_name, err.msg);
            km_buf b = {0};
            cr_assert_eq(km_msg_encode(&m, NULL, &b, &err), 0, "%s: %s", e->d_name, err.msg);
            km_msg again;
            cr_assert_eq(km_msg_decode(b.data, b.len, NULL, &again, &err), 0, "%s", err.msg);
            km_msg_clear(&again);
            km_buf_free(&b);
        }
        km_msg_clear(&m);
        n++;
    }
    closedir(dir);
    cr_expect_gt(n, 0, "the seed corpus is empty");
}

static void val_str_sometimes(fb *f)
{
    p_str(f, "sometimes");
}

static void val_u32_257(fb *f)
{
    msgpack_pack_uint32(&f->pk, 257);
}

Test(proto, a_requests_grammar_roundtrips_and_is_absent_by_default)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "smol";
    in.req.prompt = "hi";
    in.req.grammar = "{\"type\":\"object\"}";
    roundtrip(&in, &out);
    cr_assert_str_eq(out.req.grammar, "{\"type\":\"object\"}");
    km_msg_clear(&out);
    in.req.grammar = NULL;
    roundtrip(&in, &out);
    cr_assert_null(out.req.grammar);
    km_msg_clear(&out);
    in.req.grammar = ""; /* 1 byte at least */
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_neq(km_msg_encode(&in, NULL, &b, &err), 0);
    cr_assert(strstr(err.msg, "req.grammar"), "%s", err.msg);
    km_buf_free(&b);
}

Test(proto, speculation_keys_roundtrip_and_are_absent_by_default)
{
    km_msg in, out;
    for (int s = 0; s < KM_SPECULATE_COUNT; s++) {
        km_msg_init(&in, KM_MSG_REQUEST);
        in.req.model = "smol";
        in.req.prompt = "hi";
        in.req.speculate = (km_speculate)s;
        in.req.max_draft_tokens = s == KM_SPECULATE_AUTO ? 8 : 0;
        roundtrip(&in, &out);
        cr_assert_eq(out.req.speculate, (km_speculate)s);
        cr_assert_eq(out.req.max_draft_tokens, s == KM_SPECULATE_AUTO ? 8u : 0u);
        km_msg_clear(&out);
    }
    cr_assert_str_eq(km_speculate_name(KM_SPECULATE_OFF), "off");
    /* A request that says nothing carries neither key (older workers see the same bytes). */
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "smol";
    in.req.prompt = "hi";
    km_buf b = {0};
    cr_assert_eq(km_msg_encode(&in, NULL, &b, NULL), 0);
    cr_assert_null(memmem(b.data, b.len, "speculate", 9));
    cr_assert_null(memmem(b.data, b.len, "max_draft", 9));
    km_buf_free(&b);

    km_msg_init(&in, KM_MSG_DONE);
    in.done.prompt_tokens = 10;
    in.done.completion_tokens = 40;
    in.done.draft_tokens = 36;
    in.done.accepted_draft_tokens = 30;
    roundtrip(&in, &out);
    cr_assert_eq(out.done.draft_tokens, 36);
    cr_assert_eq(out.done.accepted_draft_tokens, 30);
    km_msg_clear(&out);
    km_msg_init(&in, KM_MSG_DONE);
    cr_assert_eq(km_msg_encode(&in, NULL, &b, NULL), 0);
    cr_assert_null(memmem(b.data, b.len, "draft_tokens", 12));
    cr_assert_eq(km_msg_decode(b.data, b.len, NULL, &out, NULL), 0);
    cr_assert_eq(out.done.draft_tokens, 0);
    cr_assert_eq(out.done.accepted_draft_tokens, 0);
    km_msg_clear(&out);
    km_buf_free(&b);
}

Test(proto, speculation_keys_are_validated)
{
    fb f;
    request_with(&f, "speculate", val_str_sometimes);
    expect_fail(&f, KM_EFORMAT, "req.speculate: unknown value 'sometimes'");
    request_with(&f, "speculate", val_int_one);
    expect_fail(&f, KM_EFORMAT, "req.speculate: expected a string");
    request_with(&f, "max_draft_tokens", val_u32_257);
    expect_fail(&f, KM_EFORMAT, "req.max_draft_tokens: 257 outside [0, 256]");
    request_with(&f, "max_draft_tokens", val_neg);
    expect_fail(&f, KM_EFORMAT, "req.max_draft_tokens: negative value -5");
    km_msg in;
    km_msg_init(&in, KM_MSG_DONE);
    in.done.draft_tokens = 3;
    in.done.accepted_draft_tokens = 4;
    expect_encode_fail(&in, "done.usage: accepted_draft_tokens 4 > draft_tokens 3");
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "smol";
    in.req.prompt = "hi";
    in.req.speculate = KM_SPECULATE_COUNT;
    char want[64];
    snprintf(want, sizeof want, "req.speculate: unknown value %d", (int)KM_SPECULATE_COUNT);
    expect_encode_fail(&in, want);
}

static void val_bias_out_of_range(fb *f)
{
    msgpack_pack_array(&f->pk, 1);
    msgpack_pack_array(&f->pk, 2);
    msgpack_pack_uint32(&f->pk, 5);
    msgpack_pack_double(&f->pk, 150.0);
}

static void val_bias_not_a_pair(fb *f)
{
    msgpack_pack_array(&f->pk, 1);
    msgpack_pack_uint32(&f->pk, 5);
}

Test(proto, logprobs_and_logit_bias_roundtrip_and_are_absent_by_default)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "smol";
    in.req.prompt = "hi";
    in.req.logprobs = true;
    in.req.top_logprobs = 5;
    in.req.prompt_logprobs = true;
    km_token_value bias[2] = {{7, -100}, {9, 2.5f}};
    in.req.logit_bias = bias;
    in.req.n_logit_bias = 2;
    roundtrip(&in, &out);
    cr_assert(out.req.logprobs);
    cr_assert_eq(out.req.top_logprobs, 5u);
    cr_assert(out.req.prompt_logprobs);
    cr_assert_eq(out.req.n_logit_bias, 2u);
    cr_assert_eq(out.req.logit_bias[0].token, 7);
    cr_assert_float_eq(out.req.logit_bias[1].value, 2.5f, 1e-6);
    km_msg_clear(&out);

    km_msg_init(&in, KM_MSG_TOKEN);
    in.tok.text = "x";
    in.tok.has_logprob = true;
    in.tok.logprob = -0.5f;
    km_token_value top[2] = {{3, -0.5f}, {4, -1.25f}};
    in.tok.top = top;
    in.tok.n_top = 2;
    in.tok.prompt = true;
    roundtrip(&in, &out);
    cr_assert(out.tok.prompt);
    cr_assert(out.tok.has_logprob);
    cr_assert_float_eq(out.tok.logprob, -0.5f, 1e-6);
    cr_assert_eq(out.tok.n_top, 2u);
    cr_assert_eq(out.tok.top[1].token, 4);
    cr_assert_float_eq(out.tok.top[1].value, -1.25f, 1e-6);
    km_msg_clear(&out);

    /* frames that say nothing carry none of the keys (older peers see the same bytes) */
    km_buf b = {0};
    km_msg_init(&in, KM_MSG_TOKEN);
    in.tok.text = "x";
    cr_assert_eq(km_msg_encode(&in, NULL, &b, NULL), 0);
    cr_assert_null(memmem(b.data, b.len, "logprob", 7));
    cr_assert_eq(km_msg_decode(b.data, b.len, NULL, &out, NULL), 0);
    cr_assert(!out.tok.has_logprob && !out.tok.prompt);
    km_msg_clear(&out);
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "smol";
    in.req.prompt = "hi";
    cr_assert_eq(km_msg_encode(&in, NULL, &b, NULL), 0);
    cr_assert_null(memmem(b.data, b.len, "logprobs", 8));
    cr_assert_null(memmem(b.data, b.len, "logit_bias", 10));
    km_buf_free(&b);
}

Test(proto, logprobs_and_logit_bias_are_validated)
{
    fb f;
    request_with(&f, "logit_bias", val_bias_out_of_range);
    expect_fail(&f, KM_EFORMAT, "req.logit_bias[0]: 150 outside [-100, 100]");
    request_with(&f, "logit_bias", val_bias_not_a_pair);
    expect_fail(&f, KM_EFORMAT, "req.logit_bias[0]: expected [token id, number]");
    request_with(&f, "top_logprobs", val_u32_257);
    expect_fail(&f, KM_EFORMAT, "req.top_logprobs: 257, at most 20 and with logprobs");
    km_msg in;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.model = "smol";
    in.req.prompt = "hi";
    in.req.top_logprobs = 2;
    expect_encode_fail(&in, "req.top_logprobs: needs logprobs");
    km_msg_init(&in, KM_MSG_TOKEN);
    in.tok.text = "x";
    km_token_value top[1] = {{3, -0.5f}};
    in.tok.top = top;
    in.tok.n_top = 1;
    expect_encode_fail(&in, "tok.top: needs logprob");
}

Test(proto, worker_roles_roundtrip_and_both_is_the_default)
{
    for (int r = 0; r < KM_WROLE_COUNT; r++) {
        km_msg in, out;
        km_msg_init(&in, KM_MSG_HEARTBEAT);
        in.hb.worker = "w";
        in.hb.role = (km_worker_role)r;
        roundtrip(&in, &out);
        cr_assert_eq(out.hb.role, (km_worker_role)r);
        km_msg_clear(&out);
        km_view_worker one = {.id = "w", .role = (km_worker_role)r};
        km_msg_init(&in, KM_MSG_VIEW);
        in.view.controller = "c";
        in.view.workers = &one;
        in.view.n_workers = 1;
        roundtrip(&in, &out);
        cr_assert_eq(out.view.workers[0].role, (km_worker_role)r);
        km_msg_clear(&out);
        km_msg_init(&in, KM_MSG_ADMIN_REPLY);
        in.admin_reply.cmd = KM_ADMIN_STATUS;
        in.admin_reply.ok = true;
        in.admin_reply.role = (km_worker_role)r;
        roundtrip(&in, &out);
        cr_assert_eq(out.admin_reply.role, (km_worker_role)r);
        km_msg_clear(&out);
        km_worker_role back;
        cr_assert_eq(km_worker_role_parse(km_worker_role_name((km_worker_role)r), &back), 0);
        cr_assert_eq(back, (km_worker_role)r);
    }
    km_worker_role back;
    cr_assert_eq(km_worker_role_parse("mixed", &back), KM_EINVAL);
    km_msg in;
    km_msg_init(&in, KM_MSG_HEARTBEAT);
    in.hb.worker = "w";
    in.hb.role = KM_WROLE_COUNT;
    km_buf b = {0};
    cr_assert_neq(km_msg_encode(&in, NULL, &b, NULL), 0, "an unknown role is refused");
    km_buf_free(&b);
}

Test(proto, the_pd_mark_travels_with_a_pull_hint_and_means_nothing_without_one)
{
    static const uint8_t addr[4] = {1, 2, 3, 4};
    static const int32_t toks[3] = {1, 2, 3};
    km_msg in, out;
    km_msg_init(&in, KM_MSG_REQUEST);
    in.req.id = 9;
    in.req.model = "m";
    in.req.tokens = toks;
    in.req.n_tokens = 3;
    in.req.pull_from = "w0";
    in.req.pull_endpoint = "tcp://127.0.0.1:1";
    in.req.pull_addr = addr;
    in.req.pull_addr_len = 4;
    in.req.pull_pages = 1;
    in.req.pd = true;
    roundtrip(&in, &out);
    cr_assert(out.req.pd);
    cr_assert_str_eq(out.req.pull_from, "w0");
    km_msg_clear(&out);
    in.req.pd = false;
    roundtrip(&in, &out);
    cr_assert_not(out.req.pd);
    km_msg_clear(&out);
    in.req.pull_from = NULL;
    in.req.pd = true;
    roundtrip(&in, &out);
    cr_assert_not(out.req.pd, "no hint, no pd");
    km_msg_clear(&out);
}

Test(proto, set_role_carries_a_known_role)
{
    km_msg in, out;
    km_msg_init(&in, KM_MSG_ADMIN);
    in.admin.id = 5;
    in.admin.cmd = KM_ADMIN_SET_ROLE;
    in.admin.role = "prefill";
    roundtrip(&in, &out);
    cr_assert_eq(out.admin.cmd, KM_ADMIN_SET_ROLE);
    cr_assert_str_eq(out.admin.role, "prefill");
    km_msg_clear(&out);
    km_buf b = {0};
    in.admin.role = "mixed";
    cr_assert_neq(km_msg_encode(&in, NULL, &b, NULL), 0, "an unknown role is refused");
    in.admin.role = NULL;
    cr_assert_neq(km_msg_encode(&in, NULL, &b, NULL), 0, "set_role needs a role");
    km_buf_free(&b);
}
