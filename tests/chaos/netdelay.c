/*
 * netdelay.c — kvmesh-netdelay: delays and reorders the packets of one NFQUEUE queue, for
 * `kvmesh chaos netfault` (docs/chaos.md). This machine's kernel has no netem qdisc; an
 * iptables rule `-j NFQUEUE --queue-num N --queue-bypass` hands packets to this program, which
 * holds each for --delay-ms plus a random part of --jitter-ms and then lets it go (NF_ACCEPT).
 * A packet drawn a shorter hold than the one before it leaves first: that is the reordering.
 *
 *   kvmesh-netdelay --queue N [--delay-ms D] [--jitter-ms J] [--seed S]
 *
 * It runs in the namespace whose rules queue the packets (`ip netns exec NS ...`), until
 * SIGTERM or SIGINT; then it lets every held packet go, prints one line of counts (`held=`
 * packets held, `reordered=` packets that left before one that came earlier) and exits 0.
 * With --queue-bypass on the rule, packets pass unheld whenever this program is not running.
 * Verdicts are given in meta-copy mode (no payload is read) and GSO packets stay whole.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define ND_MAX_HELD 4096 /* more waiting than this: the newcomer goes at once */

typedef struct nd_held {
    uint32_t id;
    uint64_t due_us;
} nd_held;

typedef struct nd_state {
    nd_held held[ND_MAX_HELD];
    int n_held;
    unsigned delay_us, jitter_us;
    uint64_t n_in, n_reordered, n_overflow;
    uint32_t last_out; /* the largest id let go so far */
    struct nfq_q_handle *qh;
} nd_state;

static volatile sig_atomic_t g_stop;

static void on_stop(int sig)
{
    (void)sig;
    g_stop = 1;
}

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void let_go(nd_state *s, uint32_t id)
{
    if (id < s->last_out)
        s->n_reordered++;
    else
        s->last_out = id;
    nfq_set_verdict(s->qh, id, NF_ACCEPT, 0, NULL);
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *arg)
{
    (void)qh, (void)msg;
    nd_state *s = arg;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph) return 0;
    uint32_t id = ntohl(ph->packet_id);
    s->n_in++;
    if (s->n_held == ND_MAX_HELD) {
        s->n_overflow++;
        let_go(s, id);
        return 0;
    }
    unsigned extra = s->jitter_us ? (unsigned)random() % s->jitter_us : 0;
    s->held[s->n_held++] = (nd_held){id, now_us() + s->delay_us + extra};
    return 0;
}

/* Lets every packet whose time has come go (all of them when `all`); the next due time. */
static uint64_t release(nd_state *s, bool all)
{
    uint64_t now = now_us(), next = UINT64_MAX;
    for (int i = 0; i < s->n_held;) {
        if (all || s->held[i].due_us <= now) {
            let_go(s, s->held[i].id);
            s->held[i] = s->held[--s->n_held];
        } else {
            if (s->held[i].due_us < next) next = s->held[i].due_us;
            i++;
        }
    }
    return next;
}

int main(int argc, char **argv)
{
    int queue = -1;
    unsigned delay_ms = 2, jitter_ms = 10, seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--queue"))
            queue = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--delay-ms"))
            delay_ms = (unsigned)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--jitter-ms"))
            jitter_ms = (unsigned)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed"))
            seed = (unsigned)atoi(argv[i + 1]);
    }
    if (queue < 0 || queue > 65535) {
        fprintf(stderr, "usage: kvmesh-netdelay --queue N [--delay-ms D] [--jitter-ms J] "
                        "[--seed S]\n");
        return 2;
    }
    srandom(seed);
    static nd_state s;
    s.delay_us = delay_ms * 1000u;
    s.jitter_us = jitter_ms * 1000u;
    struct nfq_handle *h = nfq_open();
    if (!h) {
        fprintf(stderr, "kvmesh-netdelay: nfq_open: %s\n", strerror(errno));
        return 1;
    }
    s.qh = nfq_create_queue(h, (uint16_t)queue, on_packet, &s);
    if (!s.qh || nfq_set_mode(s.qh, NFQNL_COPY_META, 0) < 0) {
        fprintf(stderr, "kvmesh-netdelay: queue %d: %s\n", queue, strerror(errno));
        nfq_close(h);
        return 1;
    }
    nfq_set_queue_maxlen(s.qh, ND_MAX_HELD * 2);
    nfq_set_queue_flags(s.qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
    int fd = nfq_fd(h), one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sigaction sa = {.sa_handler = on_stop};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigset_t set; /* a parent may have blocked them */
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    printf("kvmesh-netdelay: queue %d, hold %u ms + up to %u ms\n", queue, delay_ms, jitter_ms);
    fflush(stdout);
    static char buf[65536 + 4096];
    while (!g_stop) {
        uint64_t next = release(&s, false), now = now_us();
        int wait_ms = next == UINT64_MAX ? 100 : (int)((next - now + 999) / 1000);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, wait_ms) <= 0) continue;
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) nfq_handle_packet(h, buf, (int)n);
    }
    release(&s, true);
    printf("kvmesh-netdelay: held=%llu reordered=%llu overflow=%llu\n", (unsigned long long)s.n_in,
           (unsigned long long)s.n_reordered, (unsigned long long)s.n_overflow);
    fflush(stdout);
    nfq_destroy_queue(s.qh);
    nfq_close(h);
    return 0;
}
