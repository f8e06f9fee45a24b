/*
 * test_recovery.c — recovery on a real kvmesh-worker (127.0.0.1, ephemeral ports), driven over
 * ZeroMQ as the controller and a router drive it.
 *
 * Level 1 must leave a usable cache (issue 39, item 1): a prompt fully cached before the
 * operator's `evict` (recovery level 1, docs/operations.md) is recomputed in part once and then
 * found whole again. The regression took the oldest pages first, the head of the prompt's
 * chain, and left its tail indexed but unreachable: the recompute stopped publishing at the
 * first stranded page, so every later request found 256 of 505 tokens cached. Run from the
 * repository root after `make build` (make integration); without the default model every test
 * skips and says so.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "tests/integration/harness.h"

#define NPROMPT 505
#define PAGE    16 /* the worker's page_tokens */

static bool have_model(void)
{
    return it_have((const char *const[]){IT_MODEL, IT_WORKER, NULL});
}

/* Sends the prompt and returns the cached_tokens its done message reports. */
static uint32_t serve(void *s, uint64_t id, const int32_t *toks, int n)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    m.req.id = id;
    m.req.model = "SmolLM2-135M-Instruct";
    m.req.tokens = toks;
    m.req.n_tokens = (uint32_t)n;
    m.req.temperature = 0;
    m.req.max_tokens = 1;
    m.req.stream = true;
    it_send_msg(s, &m);
    for (;;) {
        cr_assert(it_recv_msg(s, &m, 60000), "request %llu: no answer", (unsigned long long)id);
        cr_assert_neq(m.type, KM_MSG_ERROR, "request %llu failed", (unsigned long long)id);
        if (m.type == KM_MSG_DONE) {
            uint32_t cached = m.done.cached_tokens;
            km_msg_clear(&m);
            return cached;
        }
        km_msg_clear(&m);
    }
}

/* The operator's `evict` (recovery level 1) with the controller's fraction. */
static uint64_t level_1(void *s, uint64_t id)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN);
    m.admin.id = id;
    m.admin.cmd = KM_ADMIN_EVICT;
    m.admin.fraction = 0.25;
    it_send_msg(s, &m);
    cr_assert(it_recv_msg(s, &m, 10000), "no admin reply");
    cr_assert_eq(m.type, KM_MSG_ADMIN_REPLY);
    cr_assert(m.admin_reply.ok);
    uint64_t n = m.admin_reply.evicted_pages;
    km_msg_clear(&m);
    return n;
}

static void prompt_after_level_1(const char *const *extra)
{
    if (!have_model()) return;
    it_proc w;
    memset(&w, 0, sizeof w);
    const char *flags[] = {"--admin-port=0", "--threads=2", "--log-level=warn", NULL};
    it_start_worker(&w, "recovery", flags, extra);
    void *s = it_dealer(w.req);
    int32_t toks[NPROMPT];
    for (int i = 0; i < NPROMPT; i++) toks[i] = 300 + (i * 37) % 9000;
    const uint32_t whole = (NPROMPT - 1) / PAGE * PAGE; /* the last token is always computed */
    cr_assert_eq(serve(s, 1, toks, NPROMPT), 0);
    cr_assert_eq(serve(s, 2, toks, NPROMPT), whole, "fully cached before the level 1");
    uint64_t evicted = level_1(s, 3);
    cr_assert_gt(evicted, 0);
    uint32_t first = serve(s, 4, toks, NPROMPT);
    cr_assert_lt(first, whole, "level 1 took pages of the prompt (%llu evicted)",
                 (unsigned long long)evicted);
    uint32_t second = serve(s, 5, toks, NPROMPT);
    cr_assert_eq(second, whole, "the full prefix again on the second request: %u of %u tokens",
                 second, whole);
    cr_assert_gt(first, 0, "it took the chain's tail, not its head");
    cr_assert_eq(serve(s, 6, toks, NPROMPT), whole);
    km_zsock_close(s);
    it_stop(&w);
}

TestSuite(recovery, .fini = it_kill_all);

Test(recovery, level_1_then_the_prompt_is_whole_again_on_the_second_request, .timeout = 120)
{
    prompt_after_level_1(NULL);
}

/* A host tier smaller than what level 1 moves: most of it is dropped there. */
Test(recovery, level_1_with_a_host_tier_then_the_prompt_is_whole_again, .timeout = 120)
{
    prompt_after_level_1((const char *const[]){"--kv-host-bytes=1M", NULL});
}
