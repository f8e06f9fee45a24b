/*
 * chaos_load.c — the client load of a chaos scenario: several threads, each with its own
 * libkvmesh connection to the router, greedy requests over prompts of mixed lengths, retrying
 * retryable answers (503, 529, 429, 500), broken connections and silences (a dead router) a bounded
 * number of times. The fault-free pass records every prompt's output; the faulted pass compares
 * against it. Every request ends as completed, failed (the client was told why) or lost.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/chaos.h"

static bool retryable(const kvm_result *res, int rc)
{
    if (rc == KM_ETIMEDOUT) return true; /* silence: a dead router or worker */
    if (!res->error_code) return true;   /* could not even send */
    return res->error_code == KM_CODE_UNAVAILABLE || res->error_code == KM_CODE_OVERLOADED ||
           res->error_code == KM_CODE_RATE_LIMIT || res->error_code == KM_CODE_INTERNAL;
}

static void load_note_error(chaos_load *l, const char *msg)
{
    if (l->n_errors < 4) snprintf(l->first_errors[l->n_errors++], 200, "%.190s", msg);
}

/* One logical request: up to k->attempts tries. */
static void load_one(chaos_load *l, kvm_client **c, int prompt)
{
    const chaos_knobs *k = l->k;
    km_msg_request q;
    kvm_request_init(&q);
    q.prompt = l->prompts[prompt];
    q.temperature = 0;
    q.max_tokens = (uint32_t)k->max_tokens;
    q.stream = true;
    q.speculate = l->speculate;
    pthread_mutex_lock(&l->mu);
    l->sent++;
    pthread_mutex_unlock(&l->mu);
    bool done = false, told = false;
    char last[200] = "";
    kvm_result res;
    memset(&res, 0, sizeof res);
    for (int attempt = 0; attempt < k->attempts && !done; attempt++) {
        if (attempt) {
            pthread_mutex_lock(&l->mu);
            l->retries++;
            pthread_mutex_unlock(&l->mu);
        }
        km_errbuf err = {{0}};
        kvm_result_free(&res);
        int rc = kvm_generate(*c, &q, NULL, NULL, &res, &err);
        if (rc == 0) {
            done = true;
            break;
        }
        told = res.error_code != 0;
        snprintf(last, sizeof last, "%.190s", err.msg);
        if (!retryable(&res, rc)) break;
        if (rc == KM_ETIMEDOUT) { /* a new connection: the old one may be to a dead router */
            kvm_close(*c);
            *c = NULL;
            kvm_opts o = {.timeout_ms = k->timeout_ms, .sec = l->sec};
            if (kvm_open(l->endpoint, &o, c, NULL)) break;
        } else {
            int wait = res.retry_after_ms ? (int)res.retry_after_ms : 200;
            km_sleep_ms(wait > 2000 ? 2000 : wait);
        }
    }
    uint64_t now = km_wall_ms();
    pthread_mutex_lock(&l->mu);
    if (done) {
        l->completed++;
        if (res.migrations) l->migrated++;
        l->migrations += (int)res.migrations;
        if (l->n_done == l->cap_done) {
            int cap = l->cap_done ? 2 * l->cap_done : 1024;
            uint64_t *nd = realloc(l->done_at, sizeof *nd * (size_t)cap);
            if (nd) l->done_at = nd, l->cap_done = cap;
        }
        if (l->n_done < l->cap_done) l->done_at[l->n_done++] = now;
        const char *text = res.text.data ? (const char *)res.text.data : "";
        if (l->reference) {
            free(l->ref[prompt]);
            l->ref[prompt] = malloc(res.text.len + 1);
            if (l->ref[prompt]) memcpy(l->ref[prompt], text, res.text.len);
            l->ref_len[prompt] = res.text.len;
        } else if (l->ref[prompt] && l->ref_len[prompt] == res.text.len &&
                   !memcmp(l->ref[prompt], text, res.text.len)) {
            l->equal++;
        } else {
            if (!l->differ) l->first_differ = prompt;
            l->differ++;
        }
    } else if (told) {
        l->failed++;
        load_note_error(l, last);
    } else {
        l->lost++;
        char m[240];
        snprintf(m, sizeof m, "lost: %s", last);
        load_note_error(l, m);
    }
    pthread_mutex_unlock(&l->mu);
    kvm_result_free(&res);
}

static void *client_main(void *arg)
{
    chaos_client *cl = arg;
    chaos_load *l = cl->load;
    kvm_client *c = NULL;
    kvm_opts o = {.timeout_ms = l->k->timeout_ms, .sec = l->sec};
    if (kvm_open(l->endpoint, &o, &c, NULL)) return NULL;
    if (l->reference) {
        for (int p = cl->index; p < l->n_prompts && c; p += l->k->clients) {
            load_one(l, &c, p);
            if (!c && kvm_open(l->endpoint, &o, &c, NULL)) break;
        }
    } else {
        for (int i = cl->index, n = 0;
             !atomic_load(&l->stop) && (!l->per_client || n < l->per_client);
             i += l->k->clients, n++) {
            load_one(l, &c, i % l->n_prompts);
            if (!c && kvm_open(l->endpoint, &o, &c, NULL)) break;
        }
    }
    kvm_close(c);
    return NULL;
}

void chaos_load_start(chaos_load *l, chaos_client *cls)
{
    for (int i = 0; i < l->k->clients; i++) {
        cls[i].load = l;
        cls[i].index = i;
        pthread_create(&cls[i].th, NULL, client_main, &cls[i]);
    }
}

void chaos_load_join(chaos_load *l, chaos_client *cls)
{
    if (!l->per_client) atomic_store(&l->stop, true); /* per_client: each sends its share */
    for (int i = 0; i < l->k->clients; i++) pthread_join(cls[i].th, NULL);
}

/* The first completion at or after t (wall ms), or 0. */
uint64_t chaos_first_done_after(chaos_load *l, uint64_t t)
{
    uint64_t best = 0;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->n_done; i++)
        if (l->done_at[i] >= t && (!best || l->done_at[i] < best)) best = l->done_at[i];
    pthread_mutex_unlock(&l->mu);
    return best;
}

/* Prompts of mixed lengths: short continuations, code, chat turns, and long ones sharing a
 * ~100-token system prefix (what the KV-aware router keeps together). */
#define CHAOS_SYS                                                                                  \
    "<|im_start|>system\nYou are a careful assistant for a shipping company. You answer "          \
    "questions about parcels, delivery times, customs forms and returns. Always answer in one "    \
    "short paragraph, mention the relevant form number when there is one, and never invent "       \
    "tracking numbers. Delivery within the country takes two to four working days; abroad it "     \
    "takes five to ten. Parcels above thirty kilograms need form F-30. Returns are free within "   \
    "thirty days with form R-1.<|im_end|>\n<|im_start|>user\n"

const char *const chaos_prompts[] = {
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "1. Apples\n2. Oranges\n3.",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n"
    "<|im_start|>assistant\n",
    CHAOS_SYS "How long does a parcel to Spain take?<|im_end|>\n<|im_start|>assistant\n",
    CHAOS_SYS "I want to return a jacket I bought last week.<|im_end|>\n<|im_start|>assistant\n",
    CHAOS_SYS "My parcel weighs 35 kg. What do I need?<|im_end|>\n<|im_start|>assistant\n",
    "The meeting is on Tuesday at 14:30 in room 4.12; the budget review follows at",
    "La tour Eiffel a été construite pour",
};
