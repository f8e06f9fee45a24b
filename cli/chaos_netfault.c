/*
 * chaos_netfault.c — faults of the network between workers, and a kill during a drain handoff
 * (issue 31 point 6).
 *
 * (k) netfault: w1 runs in a network namespace, w0 on the host; each worker's transfer node
 * listens on its own end of the veth (the table's peer_split), so every page pulled either way,
 * every heartbeat and every request to w1 crosses that link. While the load runs, the link is
 * made bad in three ways, each by the tool this kernel has (it has no netem qdisc):
 *   - tbf on both ends: bandwidth, and delay by queueing (a full queue drops);
 *   - iptables' statistic match in the namespace: random loss, both directions;
 *   - NFQUEUE on a random share of the namespace's TCP packets, held by kvmesh-netdelay
 *     (tests/chaos/netdelay.c, libnetfilter-queue) for a random time: delay and reordering
 *     (left out, and said so, where that program was not built).
 * Under the fault, pull rounds of chaos_pullkill.c run without a kill (a new long prefix, a burst
 * of it, the router's pull of it across the link), then w1 is drained (recovery level 3 through
 * the controller) and hands its cached chains to w0 across the same link; `kvmesh up` restarts
 * it. Then the link is made good again. The report gives the pulls and handoff chains by outcome
 * and what each tool did (packets dropped, held, reordered).
 *
 * (l) drainkill: both workers on loopback with transfer nodes; w1 is given long prefixes, drained
 * through the controller, and SIGKILLed once its handoff has begun (its pushed chains counter
 * grows; in the second round of a full run, once w0 reads its bytes). w0's pulls of the cut
 * handoff must end, the load's streams on w1 migrate, `kvmesh up` restarts w1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/chaos.h"

#define NF_RATE       "100mbit" /* tbf: the link's bandwidth under the fault */
#define NF_LOSS       "0.02"    /* iptables statistic: share of packets dropped, each way */
#define NF_HOLD_SHARE "0.25"    /* share of TCP packets NFQUEUE hands to kvmesh-netdelay */
#define NF_QUEUE      "7"
#define NF_RESTART_MS 60000 /* longest wait for a drained or killed worker's restart */
#define NF_HANDOFF_MS 20000 /* drainkill: longest wait for the handoff to begin */
#define NF_PUSHED     "kvmesh_kv_handoff_chains_total{outcome=\"pushed\"}"
#define NF_BYTES_IN   "kvmesh_kv_transfer_bytes_total{direction=\"in\"}"

/* What a worker counts of pulls and handoff chains (deltas over a fault are reported). */
enum { NF_OK, NF_PARTIAL, NF_FAILED, NF_PRESENT, NF_TAKEN, NF_DROPPED, NF_CPRESENT, NF_N };

static void nf_counts(chaos_run *r, const char *id, double out[NF_N])
{
    static const char *const series[NF_N] = {
        "kvmesh_kv_transfer_pulls_total{outcome=\"ok\"}",
        "kvmesh_kv_transfer_pulls_total{outcome=\"partial\"}",
        "kvmesh_kv_transfer_pulls_total{outcome=\"failed\"}",
        "kvmesh_kv_transfer_pulls_total{outcome=\"present\"}",
        "kvmesh_kv_handoff_chains_total{outcome=\"taken\"}",
        "kvmesh_kv_handoff_chains_total{outcome=\"dropped\"}",
        "kvmesh_kv_handoff_chains_total{outcome=\"present\"}",
    };
    for (int i = 0; i < NF_N; i++) out[i] = chaos_metric(r, id, series[i]);
}

static void nf_describe(char *buf, size_t cap, const char *what, const double a[NF_N],
                        const double b[NF_N])
{
    int d[NF_N];
    for (int i = 0; i < NF_N; i++) d[i] = a[i] >= 0 && b[i] >= 0 ? (int)(b[i] - a[i]) : -1;
    snprintf(buf, cap,
             "%s: pulls ok %d, partial %d, failed %d, present %d; handoff chains taken %d, "
             "dropped %d, present %d",
             what, d[NF_OK], d[NF_PARTIAL], d[NF_FAILED], d[NF_PRESENT], d[NF_TAKEN], d[NF_DROPPED],
             d[NF_CPRESENT]);
}

/* Long prefixes of their own for w1 to hand off: `want` round prompts from `first` on, sent
 * straight to w1. How many it served, or -1 when one failed (r->problem says why). */
static int nf_seed_target(chaos_run *r, int first, int want, int *sent)
{
    int on_target = 0;
    for (*sent = 0; *sent < want; (*sent)++) {
        char served[KM_PROTO_MAX_NAME + 1] = "";
        if (chaos_long_prompt(r, first + *sent, CHAOS_TARGET, served, sizeof served)) return -1;
        on_target += !served[0] || !strcmp(served, CHAOS_TARGET); /* a worker names none */
    }
    return on_target;
}

/* Level 3 (drain, handoff, restart by `kvmesh up`) for worker id, through the controller. */
static int nf_drain(chaos_run *r, const char *id)
{
    km_msg_admin a = {.cmd = KM_ADMIN_RECOVER, .worker = id, .level = 3};
    km_msg rep;
    km_errbuf err = {{0}};
    kvm_sec sec = {.cert = r->op_cert, .server = "controller"};
    if (kvm_admin_call(r->ctl_listen, &sec, &a, 10000, &rep, &err)) {
        snprintf(r->problem, sizeof r->problem, "recover %s level 3: %.400s", id, err.msg);
        return -1;
    }
    bool ok = rep.type == KM_MSG_ADMIN_REPLY && rep.admin_reply.ok;
    if (!ok)
        snprintf(r->problem, sizeof r->problem, "recover %s level 3 refused: %d %.300s", id,
                 rep.admin_reply.code,
                 rep.admin_reply.message ? rep.admin_reply.message : "(no message)");
    km_msg_clear(&rep);
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------------- the link's faults */

/* argv after `ip netns exec NS` (ns true) or alone; its exit status. */
static int nf_cmd(chaos_run *r, bool ns, const char *const *argv)
{
    const char *full[24] = {0};
    int k = 0;
    if (ns) full[k++] = "ip", full[k++] = "netns", full[k++] = "exec", full[k++] = r->netns;
    for (int i = 0; argv[i] && k < 23; i++) full[k++] = argv[i];
    return chaos_run_cmd(full, true);
}

/* The sum of the first column (packets) of the namespace's iptables rules whose target is
 * `target`, or -1. */
static long nf_rule_packets(chaos_run *r, const char *target)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "ip netns exec %s iptables -nvxL 2>/dev/null", r->netns);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    long sum = 0;
    char line[512], t[32];
    long pkts;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, " %ld %*s %31s", &pkts, t) == 2 && !strcmp(t, target)) sum += pkts;
    pclose(f);
    return sum;
}

/* Packets tbf dropped on dev (in the namespace when ns), or -1. */
static long nf_tbf_dropped(chaos_run *r, bool ns, const char *dev)
{
    char cmd[200];
    snprintf(cmd, sizeof cmd, "%s%s tc -s qdisc show dev %s 2>/dev/null",
             ns ? "ip netns exec " : "", ns ? r->netns : "", dev);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    long dropped = -1;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        const char *d = strstr(line, "dropped ");
        if (d && dropped < 0) dropped = atol(d + 8);
    }
    pclose(f);
    return dropped;
}

static int nf_tbf(chaos_run *r, bool ns, const char *dev)
{
    const char *a[] = {"tc",   "qdisc", "replace", "dev",   dev,       "root", "tbf",
                       "rate", NF_RATE, "burst",   "128kb", "latency", "50ms", NULL};
    return nf_cmd(r, ns, a);
}

int chaos_precheck_netfault(chaos_run *r)
{
    const char *del[] = {"tc", "qdisc", "del", "dev", r->veth_ns, "root", NULL};
    const char *list[] = {"iptables", "-nL", NULL};
    if (nf_tbf(r, true, r->veth_ns)) {
        snprintf(r->note, sizeof r->note,
                 "`tc qdisc ... tbf` failed in the namespace (no tc, "
                 "or no sch_tbf in this kernel)");
        return 1;
    }
    nf_cmd(r, true, del);
    if (nf_cmd(r, true, list)) {
        snprintf(r->note, sizeof r->note, "`iptables` is missing or does not work here");
        return 1;
    }
    return 0;
}

/* kvmesh-netdelay next to this binary, run in the namespace (its output in the run's
 * directory): its pid, or 0 where it was not built or did not start. */
static pid_t nf_start_delayer(chaos_run *r, char *log, size_t cap)
{
    char bin[4096];
    ssize_t l = readlink("/proc/self/exe", bin, sizeof bin - 32);
    if (l <= 0) return 0;
    bin[l] = 0;
    char *slash = strrchr(bin, '/');
    if (!slash) return 0;
    snprintf(slash + 1, sizeof bin - (size_t)(slash + 1 - bin), "kvmesh-netdelay");
    if (access(bin, X_OK)) return 0;
    snprintf(log, cap, "%s/netdelay.log", r->dir);
    pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        sigset_t set; /* chaos_signals_start blocked them: SIGTERM must reach the delayer */
        sigemptyset(&set);
        sigaddset(&set, SIGINT);
        sigaddset(&set, SIGTERM);
        sigprocmask(SIG_UNBLOCK, &set, NULL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) dup2(fd, 1), dup2(fd, 2), close(fd);
        const char *argv[] = {"ip",     "netns",      "exec", r->netns,      bin, "--queue",
                              NF_QUEUE, "--delay-ms", "1",    "--jitter-ms", "8", NULL};
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    chaos_netns_helper(pid);
    return pid;
}

typedef struct nf_link {
    pid_t delayer;
    char delayer_log[160];
    bool tbf, loss, hold;
} nf_link;

static void nf_link_bad(chaos_run *r, nf_link *L)
{
    L->tbf = !nf_tbf(r, false, r->veth_host) && !nf_tbf(r, true, r->veth_ns);
    const char *dirs[2][2] = {{"INPUT", "-i"}, {"OUTPUT", "-o"}};
    L->loss = true;
    for (int i = 0; i < 2; i++) {
        const char *a[] = {"iptables", "-A",        dirs[i][0], dirs[i][1], r->veth_ns,
                           "-m",       "statistic", "--mode",   "random",   "--probability",
                           NF_LOSS,    "-j",        "DROP",     NULL};
        L->loss &= !nf_cmd(r, true, a);
    }
    L->delayer = nf_start_delayer(r, L->delayer_log, sizeof L->delayer_log);
    L->hold = L->delayer > 0;
    for (int i = 0; L->hold && i < 2; i++) {
        const char *a[] = {
            "iptables",    "-A", dirs[i][0],  dirs[i][1],    r->veth_ns, "-p",
            "tcp",         "-m", "statistic", "--mode",      "random",   "--probability",
            NF_HOLD_SHARE, "-j", "NFQUEUE",   "--queue-num", NF_QUEUE,   "--queue-bypass",
            NULL};
        L->hold &= !nf_cmd(r, true, a);
    }
}

/* The link made good again; what each tool did, appended to r->note. */
static void nf_link_good(chaos_run *r, nf_link *L)
{
    long lost = nf_rule_packets(r, "DROP"), queued = nf_rule_packets(r, "NFQUEUE");
    long tbf_h = nf_tbf_dropped(r, false, r->veth_host),
         tbf_n = nf_tbf_dropped(r, true, r->veth_ns);
    const char *flush[] = {"iptables", "-F", NULL};
    const char *del_h[] = {"tc", "qdisc", "del", "dev", r->veth_host, "root", NULL};
    const char *del_n[] = {"tc", "qdisc", "del", "dev", r->veth_ns, "root", NULL};
    nf_cmd(r, true, flush);
    nf_cmd(r, false, del_h);
    nf_cmd(r, true, del_n);
    char held[200] = "kvmesh-netdelay not built (libnetfilter-queue-dev missing): no delay or "
                     "reordering";
    if (L->delayer > 0) {
        chaos_netns_helper(0);
        kill(L->delayer, SIGTERM);
        int st = 0;
        for (int i = 0; i < 100 && waitpid(L->delayer, &st, WNOHANG) == 0; i++) km_sleep_ms(20);
        FILE *f = fopen(L->delayer_log, "r");
        char line[256];
        held[0] = 0;
        while (f && fgets(line, sizeof line, f))
            if (strstr(line, "held="))
                snprintf(held, sizeof held, "%.*s", (int)strcspn(line, "\n"), line);
        if (f) fclose(f);
        if (!held[0])
            snprintf(held, sizeof held, "kvmesh-netdelay said nothing (see %s)", L->delayer_log);
    }
    size_t n = strlen(r->note);
    snprintf(r->note + n, sizeof r->note - n,
             "; the link: tbf %s %s (dropped %ld host side, %ld namespace side), random loss %s "
             "%s (%ld packets dropped), NFQUEUE %s of TCP packets %s (%ld queued; %s)",
             NF_RATE, L->tbf ? "on" : "FAILED", tbf_h, tbf_n, NF_LOSS, L->loss ? "on" : "FAILED",
             lost, NF_HOLD_SHARE, L->hold ? "on" : "off", queued, held);
    if (!L->tbf || !L->loss)
        snprintf(r->problem, sizeof r->problem, "could not make the link bad (tbf %s, loss %s)",
                 L->tbf ? "on" : "failed", L->loss ? "on" : "failed");
}

/* ---------------------------------------------------------------- (k) netfault */

int chaos_fault_netfault(chaos_run *r)
{
    nf_link L = {0};
    double w0a[NF_N], w1a[NF_N], w0b[NF_N], w0c[NF_N], w1c[NF_N];
    nf_counts(r, "w0", w0a);
    nf_counts(r, "w1", w1a);
    nf_link_bad(r, &L);
    /* pulls across the link: the router sends a burst's request to the worker that lacks the
     * round's prefix, with a hint to pull it from the other */
    chaos_pull_rounds(r, r->k.short_run ? 1 : 3, 0, false);
    nf_counts(r, "w0", w0b);
    nf_counts(r, "w1", w1c);
    char pulls[600], handoff[600] = "";
    nf_describe(pulls, sizeof pulls, "w0 under the fault", w0a, w0b);
    /* the handoff across the link: w1, given long prefixes w0 lacks, drained; w0 pulls them */
    int seeded = 0,
        on_w1 = r->problem[0] ? 0 : nf_seed_target(r, 10, r->k.short_run ? 1 : 2, &seeded);
    nf_counts(r, "w0", w0b);
    int pid = chaos_proc_pid(r, CHAOS_TARGET);
    double pushed0 = chaos_metric(r, CHAOS_TARGET, NF_PUSHED), pushed = pushed0;
    if (!r->problem[0] && !nf_drain(r, CHAOS_TARGET)) {
        for (uint64_t until = km_wall_ms() + NF_RESTART_MS;
             km_wall_ms() < until && chaos_proc_pid(r, CHAOS_TARGET) == pid;) {
            double p = chaos_metric(r, CHAOS_TARGET, NF_PUSHED);
            if (p > pushed) pushed = p;
            km_sleep_ms(50);
        }
        if (!chaos_wait_restarted(r, CHAOS_TARGET, pid, NF_RESTART_MS * r->k.slow))
            snprintf(r->problem, sizeof r->problem, "after the drain: %.480s", r->note);
        nf_counts(r, "w0", w0c);
        char what[160];
        snprintf(what, sizeof what,
                 "w1's drain handoff under the fault (%d of %d new long prefixes on w1, %d chains "
                 "pushed), w0",
                 on_w1, seeded, pushed0 >= 0 && pushed >= 0 ? (int)(pushed - pushed0) : -1);
        nf_describe(handoff, sizeof handoff, what, w0b, w0c);
        if (!r->problem[0] && !(pushed > pushed0))
            snprintf(r->problem, sizeof r->problem,
                     "w1's drain pushed no chain to w0: no handoff crossed the faulty link");
    }
    nf_link_good(r, &L);
    size_t n = strlen(r->note);
    /* w1's own pulls: from its first process (its counters restart with it) */
    char w1pulls[400];
    nf_describe(w1pulls, sizeof w1pulls, "w1 under the fault, before its drain", w1a, w1c);
    snprintf(r->note + n, sizeof r->note - n, "; %s; %s; %s", pulls, w1pulls, handoff);
    return 0;
}

/* ---------------------------------------------------------------- (l) drainkill */

static int dk_round(chaos_run *r, int round, bool when_reading, char *what, size_t cap)
{
    int n_prompts = 0,
        on_w1 = nf_seed_target(r, 40 + 8 * round, r->k.short_run ? 2 : 3, &n_prompts);
    if (on_w1 < 0) return -1;
    double before[NF_N], after[NF_N];
    nf_counts(r, "w0", before);
    int pid = chaos_proc_pid(r, CHAOS_TARGET);
    double pushed0 = chaos_metric(r, CHAOS_TARGET, NF_PUSHED);
    double in0 = chaos_metric(r, "w0", NF_BYTES_IN);
    uint64_t t0 = km_wall_ms();
    if (nf_drain(r, CHAOS_TARGET)) return -1;
    /* the handoff has begun: w1 pushed its first chains (or w0 reads their bytes) */
    bool begun = false;
    double pushed = -1;
    for (uint64_t until = t0 + NF_HANDOFF_MS; !begun && km_wall_ms() < until;) {
        pushed = chaos_metric(r, CHAOS_TARGET, NF_PUSHED);
        begun = when_reading ? in0 >= 0 && chaos_metric(r, "w0", NF_BYTES_IN) > in0
                             : pushed0 >= 0 && pushed > pushed0;
        if (!begun) km_sleep_ms(2);
    }
    int delay = (int)(km_wall_ms() - t0);
    if (pid <= 0 || kill(pid, SIGKILL)) {
        snprintf(r->problem, sizeof r->problem, "round %d: no process %d to kill", round + 1, pid);
        return -1;
    }
    r->counts.kills++;
    bool back = chaos_wait_restarted(r, CHAOS_TARGET, pid, NF_RESTART_MS * r->k.slow);
    nf_counts(r, "w0", after);
    char outcome[400];
    nf_describe(outcome, sizeof outcome, "w0", before, after);
    r->counts.pulls_ok += (int)(after[NF_OK] - before[NF_OK]);
    r->counts.pulls_partial += (int)(after[NF_PARTIAL] - before[NF_PARTIAL]);
    r->counts.pulls_failed += (int)(after[NF_FAILED] - before[NF_FAILED]);
    snprintf(what, cap,
             "%d: %d of %d long prefixes on w1, killed +%d ms after the drain order %s "
             "(%d chains pushed by then); %s",
             round + 1, on_w1, n_prompts, delay,
             !begun         ? "with no handoff seen (NOT during its handoff)"
             : when_reading ? "once w0's bytes in grew"
                            : "once it had pushed",
             pushed0 >= 0 && pushed >= 0 ? (int)(pushed - pushed0) : -1, outcome);
    if (!begun && !r->problem[0])
        snprintf(r->problem, sizeof r->problem, "round %d: w1's handoff did not begin within %d s",
                 round + 1, NF_HANDOFF_MS / 1000);
    if (!back && !r->problem[0])
        snprintf(r->problem, sizeof r->problem, "round %d: %.480s", round + 1, r->note);
    return back ? 0 : -1;
}

int chaos_fault_drainkill(chaos_run *r)
{
    r->counts.set = r->counts.pulls = true;
    double mig0 = chaos_metric(r, "router", "kvmesh_router_migrations_total");
    int rounds = r->k.short_run ? 1 : 2;
    char notes[2][600] = {"", ""};
    for (int i = 0; i < rounds; i++)
        if (dk_round(r, i, i % 2 == 1, notes[i], sizeof notes[i])) break;
    double mig1 = chaos_metric(r, "router", "kvmesh_router_migrations_total");
    r->counts.migrations = mig0 >= 0 && mig1 >= 0 ? (int)(mig1 - mig0) : -1;
    snprintf(r->note, sizeof r->note, "rounds %s%s%s; %d migrations", notes[0],
             notes[1][0] ? "; " : "", notes[1], r->counts.migrations);
    return 0;
}
