/*
 * policy.c — which worker gets a request (router.h, "policy"): the cost model of DESIGN.md
 * "Routing" and rendezvous hashing for ties and cold prefixes, plus round-robin and random
 * placement, which exist as baselines for bench/bench_router.sh.
 *
 * cost(w) = w_prefill * (prompt tokens - cached credit on w + prefill backlog of w)
 *         + w_decode  * requests running on w (up to its slots)
 *         + w_queue   * requests waiting on w (beyond its slots)
 *
 * The backlog (prompt tokens w has yet to compute for others) is filled in by the caller for a
 * prefix no worker holds only, so that first prefills spread instead of stacking on one worker;
 * for a held prefix affinity and in-flight load decide, as before.
 *
 * Why it is built this way: the cost is in units of "prompt tokens to compute", so one running
 * decode is worth w_decode tokens of prefill and a queued request w_queue; a worker holding a
 * 1k-token system prompt keeps winning until it is really busier than recomputing the prefix
 * elsewhere. Costs within tie_band are equal, and among equals the worker with the highest
 * rendezvous weight of (first page hash, worker id) wins: requests sharing a prefix keep landing
 * on the same worker even before its pages are published, different prefixes spread evenly, and
 * every router replica makes the same choice from the same inputs (no shared state, no
 * randomness).
 */
#include <string.h>

#include "router/route.h"

static const char *const mode_names[RT_MODE_COUNT] = {"kv", "round-robin", "random"};

const char *rt_mode_name(rt_mode m)
{
    return (unsigned)m < RT_MODE_COUNT ? mode_names[m] : "?";
}

int rt_mode_parse(const char *s, rt_mode *out)
{
    if (!s) return KM_EINVAL;
    for (int i = 0; i < RT_MODE_COUNT; i++)
        if (!strcmp(s, mode_names[i])) {
            *out = (rt_mode)i;
            return 0;
        }
    if (!strcmp(s, "rr") || !strcmp(s, "round_robin")) {
        *out = RT_MODE_ROUND_ROBIN;
        return 0;
    }
    return KM_EINVAL;
}

void rt_policy_default(rt_policy *p)
{
    memset(p, 0, sizeof *p);
    p->mode = RT_MODE_KV;
    p->w_prefill = 1.0;
    p->w_decode = 32.0;
    p->w_queue = 256.0;
    p->tier_credit[KM_TIER_HOT] = 1.0;
    p->tier_credit[KM_TIER_HOST] = 0.8;
    p->tier_credit[KM_TIER_DISK] = 0.5;
    p->tie_band = 16.0;
    p->pull_margin = 0.8;
    p->pull_default_bps = RT_PULL_DEFAULT_BPS;
    p->pd_min_tokens = RT_PD_MIN_TOKENS;
    p->chunk_credit = 0.5;
}

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t rt_rendezvous(km_pagehash key, const char *worker_id)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a of the id */
    for (const unsigned char *p = (const unsigned char *)(worker_id ? worker_id : ""); *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    return mix64(mix64(key.lo ^ h) ^ key.hi);
}

double rt_cost(const rt_policy *p, const rt_candidate *c, int n_prompt)
{
    double uncached = (double)n_prompt - c->cached_tokens;
    if (uncached < 0) uncached = 0;
    int slots = c->slots > 0 ? c->slots : 1;
    int running = c->inflight < slots ? c->inflight : slots;
    int waiting = c->inflight - running;
    return p->w_prefill * (uncached + c->backlog) + p->w_decode * running + p->w_queue * waiting;
}

static bool eligible(const rt_candidate *c)
{
    return c->usable && (c->max_inflight <= 0 || c->inflight < c->max_inflight);
}

int rt_pick(const rt_policy *p, const rt_candidate *c, int n, int n_prompt, km_pagehash key,
            uint64_t *state)
{
    int usable = 0, open = 0;
    for (int i = 0; i < n; i++) {
        usable += c[i].usable;
        open += eligible(&c[i]);
    }
    if (!usable) return KM_ENOTFOUND;
    if (!open) return KM_EOVERLOAD;

    if (p->mode == RT_MODE_ROUND_ROBIN || p->mode == RT_MODE_RANDOM) {
        uint64_t start;
        if (p->mode == RT_MODE_ROUND_ROBIN) {
            start = (*state)++;
        } else {
            *state = mix64(*state);
            start = *state;
        }
        for (int k = 0; k < n; k++) {
            int i = (int)((start + (uint64_t)k) % (uint64_t)n);
            if (eligible(&c[i])) return i;
        }
        return KM_EOVERLOAD; /* not reached: open > 0 */
    }

    double best = 0;
    bool have = false;
    for (int i = 0; i < n; i++) {
        if (!eligible(&c[i])) continue;
        double cost = rt_cost(p, &c[i], n_prompt);
        if (!have || cost < best) best = cost;
        have = true;
    }
    int pick = -1;
    uint64_t pick_w = 0;
    for (int i = 0; i < n; i++) {
        if (!eligible(&c[i]) || rt_cost(p, &c[i], n_prompt) > best + p->tie_band) continue;
        uint64_t w = rt_rendezvous(key, c[i].id);
        if (pick < 0 || w > pick_w) {
            pick = i;
            pick_w = w;
        }
    }
    return pick;
}
