/*
 * chaos_slowloris.c — the slowloris fault (scenario "slowloris"): many HTTP connections that send
 * a request head a byte at a time and never finish it, against the router's OpenAI port (more
 * than its 1,024 connections) and every worker's admin port (more than its 64), reopened as soon
 * as the server drops them, as an attacker would. Meanwhile new clients must be served: the
 * router's /healthz and /v1/models (401 counts as served when the cluster runs with API keys)
 * and each worker's /healthz are probed twice a second, and one failed probe fails the scenario
 * (the ZeroMQ load runs beside it, lost 0 and failed 0 as for every fault). What keeps them served
 * is common/http_server.c: a deadline per request head that trickling bytes do not move, and a full
 * server evicting its longest-waiting idle connection rather than refusing the new one.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cli/chaos.h"

#define SLOW_ROUTER  1100 /* over the front's max_conns (1,024), where descriptors allow */
#define SLOW_WORKER  80   /* over an admin port's (64) */
#define SLOW_TARGETS (1 + CHAOS_WORKERS)

typedef struct slow_target {
    char base[128]; /* http://127.0.0.1:PORT */
    int port, n, *fd, *sent;
} slow_target;

static int slow_dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

/* One more byte of a head that never ends on every connection; a dropped one is reopened. */
static void slow_drip(slow_target *t, int *reopened)
{
    static const char head[] = "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    for (int i = 0; i < t->n; i++) {
        if (t->fd[i] >= 0) {
            char c = t->sent[i] < (int)sizeof head - 1 ? head[t->sent[i]] : 'a';
            if (send(t->fd[i], &c, 1, MSG_NOSIGNAL) == 1) {
                t->sent[i]++;
                continue;
            }
            if (errno == EAGAIN || errno == ENOTCONN) continue; /* still connecting */
            close(t->fd[i]);
            (*reopened)++;
        }
        t->fd[i] = slow_dial(t->port);
        t->sent[i] = 0;
    }
}

/* A new client's GET answered within 5 s: 200, or 401 where the cluster runs with API keys
 * (the probe has none; the server answering at all is what is checked), else a line in note. */
static bool probe(chaos_run *r, const char *base, const char *path, int *failed)
{
    char url[200];
    snprintf(url, sizeof url, "%s%s", base, path);
    km_buf b = {0};
    int st = 0;
    km_errbuf err = {{0}};
    int rc = kvm_http_get(url, 5000, &b, &st, &err);
    km_buf_free(&b);
    if (!rc && (st == 200 || st == 401)) return true;
    if ((*failed)++ == 0)
        snprintf(r->note, sizeof r->note, "%.150s during the attack: %.300s", url,
                 rc ? err.msg : "not 200");
    return false;
}

int chaos_fault_slowloris(chaos_run *r)
{
    slow_target t[SLOW_TARGETS] = {0};
    const char *ids[SLOW_TARGETS] = {"router", "w0", "w1"};
    int rc = 0;
    /* as many descriptors as this process may have; with fewer than the attack needs it stays
     * over the router's max_conns, which the server keeps 256 below the same limit */
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
    int fds = rl.rlim_cur > 100000 ? 100000 : (int)rl.rlim_cur;
    int n_router = fds - CHAOS_WORKERS * SLOW_WORKER - 300 < SLOW_ROUTER
                       ? fds - CHAOS_WORKERS * SLOW_WORKER - 300
                       : SLOW_ROUTER;
    for (int i = 0; i < SLOW_TARGETS; i++) {
        chaos_proc_field(r, ids[i], i ? "admin" : "http", t[i].base, sizeof t[i].base);
        const char *colon = strrchr(t[i].base, ':');
        t[i].port = colon ? atoi(colon + 1) : 0;
        t[i].n = i ? SLOW_WORKER : n_router;
        t[i].fd = malloc(sizeof *t[i].fd * (size_t)t[i].n);
        t[i].sent = calloc((size_t)t[i].n, sizeof *t[i].sent);
        if (!t[i].port || !t[i].fd || !t[i].sent) {
            snprintf(r->note, sizeof r->note, "no HTTP port for %s in cluster.env", ids[i]);
            rc = -1;
        }
        for (int k = 0; t[i].fd && k < t[i].n; k++) t[i].fd[k] = -1;
    }
    int probes = 0, failed = 0, reopened = 0;
    uint64_t end = km_wall_ms() + (uint64_t)r->k.stop_ms;
    for (int tick = 0; !rc && km_wall_ms() < end; tick++) {
        for (int i = 0; i < SLOW_TARGETS; i++) slow_drip(&t[i], &reopened);
        if (tick % 2 == 1) {
            probes += 2 + CHAOS_WORKERS;
            probe(r, t[0].base, "/healthz", &failed);
            probe(r, t[0].base, "/v1/models", &failed);
            for (int i = 1; i < SLOW_TARGETS; i++) probe(r, t[i].base, "/healthz", &failed);
        }
        km_sleep_ms(250);
    }
    for (int i = 0; i < SLOW_TARGETS; i++) {
        for (int k = 0; t[i].fd && k < t[i].n; k++)
            if (t[i].fd[k] >= 0) close(t[i].fd[k]);
        free(t[i].fd);
        free(t[i].sent);
    }
    if (rc) return rc;
    if (failed) {
        char first[400];
        snprintf(first, sizeof first, "%.399s", r->note);
        snprintf(r->note, sizeof r->note, "%d of %d probes failed; first: %.380s", failed, probes,
                 first);
        return -1;
    }
    snprintf(r->note, sizeof r->note,
             "%d slow connections held (%d reopened after the servers dropped them); %d probes "
             "all answered",
             n_router + CHAOS_WORKERS * SLOW_WORKER, reopened, probes);
    return 0;
}
