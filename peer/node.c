/*
 * node.c — the transfer node: picks the back end, collects the store's memory regions for it to
 * register once, keeps the peers (puller side), and runs the owner's housekeeping
 * (pr_node_poll): leases that ran out, pulls that were given up while reads were still in
 * flight and whose reads have now completed, peers whose endpoints are closed; and the
 * background prefault of the page arena (pr_config.prefault_bytes).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "peer/internal.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#define PR_PREFAULT_CHUNK ((size_t)256 << 10)
#define PR_PREFAULT_IDLE  9 /* sleep per chunk, in chunk durations */

/* ---------------------------------------------------------------- the arena's prefault */

/* Makes the first prefault_target bytes of the arena resident, a chunk at a time, each followed
 * by a sleep of PR_PREFAULT_IDLE times its own duration (a tenth of one CPU at most), until done
 * or the node is destroyed. Why: a first write to anonymous memory is a page fault per 4 KiB
 * (zeroed and charged to the memory cgroup), several times slower than writing resident memory,
 * and a pull lands its pages on the progress thread, so a fresh worker's pulls took twice as long
 * (docs/transfer.md, "Tuning", has the figures). Not SCHED_IDLE: a populate holds the process's
 * mmap lock, and an idle-class thread starved by busy CPUs held it for seconds, stalling the
 * worker's own thread (heartbeats missed, the worker declared dead). Populating a present page
 * changes nothing in it, so this runs beside the engine and the transfers without touching
 * kvshard. A kernel without MADV_POPULATE_WRITE refuses it: pages are faulted in. */
static void *pr_prefault_main(void *arg)
{
    pr_node *n = arg;
    uint8_t *base = (uint8_t *)n->regions[0].base;
    const uint64_t t0 = km_now_ns();
    uint64_t done = 0;
    while (done < n->prefault_target &&
           !atomic_load_explicit(&n->prefault_stop, memory_order_relaxed)) {
        size_t len = n->prefault_target - done < PR_PREFAULT_CHUNK ? n->prefault_target - done
                                                                   : PR_PREFAULT_CHUNK;
        const uint64_t c0 = km_now_ns();
        if (madvise(base + done, len, MADV_POPULATE_WRITE)) {
            KM_INFO("peer_prefault_stopped", "bytes=%llu msg=\"%s\"", (unsigned long long)done,
                    strerror(errno));
            return NULL;
        }
        done += len;
        atomic_store_explicit(&n->prefaulted, done, memory_order_relaxed);
        uint64_t rest = (km_now_ns() - c0) * PR_PREFAULT_IDLE;
        if (rest > 20000000ull) rest = 20000000ull; /* a stop waits 20 ms at most */
        struct timespec ts = {(time_t)(rest / 1000000000ull), (long)(rest % 1000000000ull)};
        while (nanosleep(&ts, &ts) && errno == EINTR) {
        }
    }
    if (done == n->prefault_target)
        KM_INFO("peer_prefault_done", "bytes=%llu ms=%.0f", (unsigned long long)done,
                (double)(km_now_ns() - t0) / 1e6);
    return NULL;
}

static void pr_prefault_start(pr_node *n)
{
    atomic_init(&n->prefault_stop, 0);
    atomic_init(&n->prefaulted, 0);
    if (n->cfg.prefault_bytes < 0) return;
    kv_store_stats st;
    kv_store_stats_get(n->store, &st);
    uint64_t want =
        n->cfg.prefault_bytes ? (uint64_t)n->cfg.prefault_bytes : st.tier[KV_TIER_HOT].budget;
    if (want > n->regions[0].bytes) want = n->regions[0].bytes;
    want &= ~(uint64_t)4095; /* whole pages of the region (it starts at a page) */
    n->prefault_target = want;
    if (want && !pthread_create(&n->prefault_thr, NULL, pr_prefault_main, n))
        n->prefault_started = 1;
}

static void pr_prefault_stop(pr_node *n)
{
    if (!n->prefault_started) return;
    atomic_store_explicit(&n->prefault_stop, 1, memory_order_relaxed);
    pthread_join(n->prefault_thr, NULL); /* waits for one chunk at most */
    n->prefault_started = 0;
}

static const pr_backend_ops *pr_backend_find(const char *name)
{
    if (!name || !strcmp(name, "ucx")) return &pr_ucx_ops;
    return NULL;
}

int pr_node_create(const pr_config *cfg, pr_node **out, km_errbuf *err)
{
    *out = NULL;
    if (!cfg || !cfg->store) return km_errf(err, KM_EINVAL, "peer node: no store");
    const pr_backend_ops *ops = pr_backend_find(cfg->backend);
    if (!ops) return km_errf(err, KM_EUNSUPPORTED, "peer node: unknown back end %s", cfg->backend);
    if (cfg->mode != PR_MODE_GET && cfg->mode != PR_MODE_AM)
        return km_errf(err, KM_EINVAL, "peer node: unknown mode %d", (int)cfg->mode);
    if (sodium_init() < 0) return km_errf(err, KM_EIO, "peer node: libsodium did not start");
    pr_node *n = calloc(1, sizeof *n);
    if (!n) return km_errf(err, KM_ENOMEM, "peer node: out of memory");
    n->cfg = *cfg;
    if (!n->cfg.listen_host) n->cfg.listen_host = "0.0.0.0";
    if (!n->cfg.advertise_host) n->cfg.advertise_host = "127.0.0.1";
    if (n->cfg.lease_ms <= 0) n->cfg.lease_ms = 10000;
    if (n->cfg.max_inflight <= 0) n->cfg.max_inflight = 32;
    if (n->cfg.am_fragment == 0) n->cfg.am_fragment = PR_FRAGMENT_DEFAULT;
    if (n->cfg.stream_bytes == 0) n->cfg.stream_bytes = PR_STREAM_DEFAULT;
    n->store = cfg->store;
    n->ops = ops;
    n->next_pull_id = 1;
    atomic_init(&n->endpoints, 0);
    atomic_init(&n->fetches_refused, 0);
    atomic_init(&n->fetches_unkeyed, 0);
    atomic_init(&n->fetches_dropped, 0);
    atomic_init(&n->answers_forged, 0);
    atomic_init(&n->am_unknown, 0);
    pthread_mutex_init(&n->lease_mu, NULL);
    n->n_regions = kv_store_mem_regions(n->store, n->regions, PR_MAX_REGIONS);
    n->wait_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    int rc = n->n_regions <= 0 || n->n_regions > PR_MAX_REGIONS
                 ? km_errf(err, KM_EINVAL,
                           "peer node: the store has no page arena (create it with arena = 1)")
             : n->wait_fd < 0 ? km_errf(err, KM_EIO, "peer node: cannot make an eventfd")
                              : ops->open(n, err);
    if (rc) {
        if (n->wait_fd >= 0) close(n->wait_fd);
        pthread_mutex_destroy(&n->lease_mu);
        free(n);
        return rc;
    }
    pr_prefault_start(n);
    *out = n;
    return 0;
}

void pr_node_destroy(pr_node *n)
{
    if (!n) return;
    pr_prefault_stop(n);
    /* The back end cancels every read and closes every endpoint first: only then may the
     * pages being read into go back to the store. */
    n->ops->close(n);
    n->closed = 1;
    while (n->pulls) {
        pr_pull *p = n->pulls;
        n->pulls = p->next;
        kv_import_abort(n->store, p->import_id);
        pr_pull_free(n, p);
    }
    while (n->zombies) {
        pr_pull *p = n->zombies;
        n->zombies = p->next;
        kv_import_abort(n->store, p->import_id);
        pr_pull_free(n, p);
    }
    pr_leases_free(n);
    while (n->peers) {
        pr_peer *p = n->peers;
        n->peers = p->next;
        free(p->addr_buf);
        free(p);
    }
    free(n->addr);
    close(n->wait_fd);
    pthread_mutex_destroy(&n->lease_mu);
    free(n);
}

int pr_node_address(const pr_node *n, const uint8_t **addr, size_t *len)
{
    *addr = n->addr;
    *len = n->addr_len;
    return n->addr ? 0 : KM_ENOTFOUND;
}

/* ---------------------------------------------------------------- peers */

/* PR_ENCRYPT_AUTO: pages cross a network unless the holder is on a loopback address or is
 * advertised under this node's own host. */
static int pr_peer_encrypt(const pr_node *n, const char *host)
{
    if (n->cfg.encrypt != PR_ENCRYPT_AUTO) return n->cfg.encrypt == PR_ENCRYPT_ON;
    const int loopback = !strncmp(host, "127.", 4) || !strcmp(host, "::1") ||
                         !strcmp(host, "localhost") || !strcmp(host, n->cfg.advertise_host);
    return !loopback;
}

int pr_peer_connect(pr_node *n, const uint8_t *addr, size_t len, pr_peer **out, km_errbuf *err)
{
    *out = NULL;
    pr_peer *p = calloc(1, sizeof *p);
    if (!p || !(p->addr_buf = malloc(len ? len : 1))) {
        free(p);
        return km_errf(err, KM_ENOMEM, "peer: out of memory");
    }
    memcpy(p->addr_buf, addr, len);
    int rc = pr_addr_parse(p->addr_buf, len, &p->addr);
    if (rc) {
        free(p->addr_buf);
        free(p);
        return km_errf(err, rc, "peer: malformed node address (%zu bytes)", len);
    }
    atomic_init(&p->failed, 0);
    atomic_init(&p->closed, 0);
    p->refs = 1;
    p->encrypt = pr_peer_encrypt(n, p->addr.host);
    if ((rc = n->ops->connect(n, p, err))) {
        free(p->addr_buf);
        free(p);
        return rc;
    }
    p->next = n->peers;
    n->peers = p;
    n->st.peers++;
    *out = p;
    return 0;
}

int pr_peer_failed(const pr_peer *p)
{
    return atomic_load_explicit(&p->failed, memory_order_acquire);
}

void pr_peer_unref(pr_node *n, pr_peer *p)
{
    if (--p->refs > 0) return;
    p->disconnecting = 1;
    if (!n->closed) n->ops->disconnect(n, p); /* freed by pr_node_poll once closed */
}

void pr_peer_release(pr_node *n, pr_peer *p)
{
    if (!p || p->released) return;
    p->released = 1;
    pr_peer_unref(n, p);
}

/* ---------------------------------------------------------------- housekeeping */

int pr_node_wait_fd(const pr_node *n)
{
    return n->wait_fd;
}

void pr_pull_fetched(pr_node *n, pr_pull *p)
{
    atomic_store_explicit(&p->fetch_done, 1, memory_order_release);
    const uint64_t one = 1;
    if (write(n->wait_fd, &one, sizeof one) < 0) { /* EAGAIN: already readable */
    }
}

int pr_node_poll(pr_node *n, pr_offer *out, int max)
{
    uint64_t v;
    if (read(n->wait_fd, &v, sizeof v) < 0) { /* EAGAIN: nothing new */
    }
    pr_leases_expire(n, km_now_ns());
    for (pr_pull **pp = &n->zombies; *pp;) {
        pr_pull *p = *pp;
        if (atomic_load_explicit(&p->fetch_done, memory_order_acquire)) {
            *pp = p->next;
            pr_pull_reap(n, p);
        } else {
            pp = &p->next;
        }
    }
    for (pr_peer **pp = &n->peers; *pp;) {
        pr_peer *p = *pp;
        if (!p->failure_seen && atomic_load_explicit(&p->failed, memory_order_acquire)) {
            p->failure_seen = 1;
            n->st.peers_failed++;
        }
        if (p->disconnecting && atomic_load_explicit(&p->closed, memory_order_acquire)) {
            *pp = p->next;
            n->st.peers--;
            free(p->addr_buf);
            free(p);
        } else {
            pp = &p->next;
        }
    }
    return pr_leases_emit(n, out, max);
}

void pr_node_stats(const pr_node *n, pr_stats *out)
{
    *out = n->st;
    out->endpoints = atomic_load_explicit(&((pr_node *)n)->endpoints, memory_order_relaxed);
    pr_node *m = (pr_node *)n;
    out->fetches_refused = atomic_load_explicit(&m->fetches_refused, memory_order_relaxed);
    out->fetches_unkeyed = atomic_load_explicit(&m->fetches_unkeyed, memory_order_relaxed);
    out->fetches_dropped = atomic_load_explicit(&m->fetches_dropped, memory_order_relaxed);
    out->answers_forged = atomic_load_explicit(&m->answers_forged, memory_order_relaxed);
    out->am_unknown = atomic_load_explicit(&m->am_unknown, memory_order_relaxed);
    out->pulls_active = 0;
    for (const pr_pull *p = n->pulls; p; p = p->next) out->pulls_active++;
    for (const pr_pull *p = n->zombies; p; p = p->next) out->pulls_active++;
    out->leases_active = 0;
    for (const pr_lease *l = n->leases; l; l = l->next) out->leases_active++;
    out->prefaulted = atomic_load_explicit(&((pr_node *)n)->prefaulted, memory_order_relaxed);
    out->prefault_target = n->prefault_target;
}
