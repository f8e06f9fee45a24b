/*
 * test_pd_roles.c — roles follow the load (issue 32 item 5, docs/disaggregation.md) on a real
 * `kvmesh up` cluster of one prefill and three decode workers, a router and a controller whose
 * thresholds are made small by flags (--role-queue=1 --role-window=1s --role-hold=2s; the
 * latency targets off so that only the queue decides): a burst of long prompts, each
 * disaggregated onto the one prefill worker, makes the controller lend it a decode worker
 * (kvmesh_controller_role_changes_total{from="decode",to="prefill"}, a `role_change` log line
 * with reason=prefill_queue); when the burst is over every lent worker goes back (as many
 * prefill -> decode changes, reason=calm) and `kvmesh status` shows 1 prefill + 3 decode again;
 * every request of the burst completed.
 *
 * Run from the repository root after `make build` (make integration); skips without the default
 * model.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "tests/integration/harness.h"

#define BURST 6

static it_up g_up;

static void stop_all(void)
{
    it_up_stop(&g_up);
}

TestSuite(pd_roles, .fini = stop_all, .timeout = 600);

/* The /metrics port of cluster.env's process id: its admin=, else its http= (-1: none). */
static int metrics_port(const char *id)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = kvm_cluster_read(g_up.cluster, procs, KVM_CLUSTER_MAX, NULL);
    const kvm_cluster_proc *p = n > 0 ? kvm_cluster_find(procs, n, id) : NULL;
    const char *url = p ? (p->admin[0] ? p->admin : p->http) : NULL;
    const char *colon = url ? strrchr(url, ':') : NULL;
    return colon ? atoi(colon + 1) : -1;
}

/* How often `what` occurs in cmd's stdout (-1: the command gave nothing). */
static int count_in(const char *cmd, const char *what)
{
    char *out = it_stdout(cmd);
    if (!out) return -1;
    int n = 0;
    for (const char *s = out; (s = strstr(s, what)); s += strlen(what)) n++;
    free(out);
    return n;
}

/* About 1.5k tokens of lines no other variant shares (no page of one is cached for another). */
static void write_prompt(const char *path, int variant)
{
    static const char *const birds[] = {"heron", "finch", "owl", "wren", "swift", "crane", "kite"};
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "Log %d. Which bird was seen last?\n", variant);
    for (int i = 0; i < 100; i++)
        fprintf(f, "Entry %d of log %d: a %s landed on post %d at minute %d.\n", i + 1, variant,
                birds[(i * 3 + variant) % 7], 11 * i + variant, (i * 7 + variant) % 60);
    fprintf(f, "Answer:");
    fclose(f);
}

static double changes(int port, const char *from, const char *to)
{
    char series[128];
    snprintf(series, sizeof series, "kvmesh_controller_role_changes_total{from=\"%s\",to=\"%s\"}",
             from, to);
    double v = it_metric(port, series);
    return v > 0 ? v : 0;
}

Test(pd_roles, a_burst_of_long_prompts_lends_a_decode_worker_to_prefill_and_it_goes_back)
{
    if (!it_have(
            (const char *const[]){IT_MODEL, IT_WORKER, IT_ROUTER, IT_CONTROLLER, IT_KVMESH, NULL}))
        return;
    it_up_start(&g_up, "pdroles",
                (const char *const[]){"--prefill-workers=1", "--decode-workers=3", "--threads=1",
                                      "--insecure",
                                      "--controller-args=--role-queue=1 --role-window=1s "
                                      "--role-hold=2s --ttft-target=0 --itl-target=0",
                                      NULL});
    char log[160], cmd[512];
    snprintf(log, sizeof log, "grep -q 'cluster ready:' %s/up.log", g_up.dir);
    IT_WAIT(system(log) == 0, 180000, "no 'cluster ready:' in %s/up.log", g_up.dir);
    snprintf(cmd, sizeof cmd, IT_KVMESH " status --run-dir %s --controller controller", g_up.dir);
    IT_WAIT(count_in(cmd, " prefill ") == 1 && count_in(cmd, " decode ") == 3, 60000,
            "kvmesh status does not show 1 prefill + 3 decode");
    int cport = metrics_port("controller"), rport = metrics_port("router");
    cr_assert(cport > 0 && rport > 0, "no admin ports in %s", g_up.cluster);
    for (int i = 0; i < 4; i++) {
        char up[96];
        snprintf(up, sizeof up, "kvmesh_router_worker_up{worker=\"w%d\"}", i);
        IT_WAIT(it_metric(rport, up) == 1, 60000, "the router does not have w%d up", i);
    }
    cr_assert_eq(changes(cport, "decode", "prefill"), 0, "a role moved before any load");

    /* the burst: BURST long prompts at once */
    char prompt[BURST][48];
    FILE *bg[BURST];
    for (int i = 0; i < BURST; i++) {
        snprintf(prompt[i], sizeof prompt[i], "/tmp/kvmesh-pdroles-%d-XXXXXX", i);
        int fd = mkstemp(prompt[i]);
        cr_assert(fd >= 0);
        close(fd);
        write_prompt(prompt[i], i);
        char gen[1024];
        snprintf(gen, sizeof gen,
                 IT_KVMESH " generate --run-dir %s --quiet --temperature 0 -n 4 --timeout 300 "
                           "--file %s 2>/dev/null",
                 g_up.dir, prompt[i]);
        bg[i] = popen(gen, "r");
        cr_assert_not_null(bg[i]);
    }
    IT_WAIT(changes(cport, "decode", "prefill") >= 1, 120000,
            "no decode worker became a prefill worker (logs in %s/logs)", g_up.dir);
    cr_log_info("pd_roles: lent during the burst: %.0f", changes(cport, "decode", "prefill"));

    /* no request lost: every one of the burst completes */
    int done = 0;
    for (int i = 0; i < BURST; i++) {
        static char got[4096];
        size_t n = fread(got, 1, sizeof got - 1, bg[i]);
        got[n] = 0;
        int rc = pclose(bg[i]);
        done += rc == 0 && n > 0;
        unlink(prompt[i]);
    }
    cr_assert_eq(done, BURST, "%d of %d requests of the burst completed (logs in %s/logs)", done,
                 BURST, g_up.dir);
    double lent = changes(cport, "decode", "prefill");

    /* the burst is over: every lent worker goes back */
    IT_WAIT(changes(cport, "prefill", "decode") == lent && count_in(cmd, " prefill ") == 1 &&
                count_in(cmd, " decode ") == 3,
            60000, "the lent workers did not go back: %.0f of %.0f (logs in %s/logs)",
            changes(cport, "prefill", "decode"), lent, g_up.dir);
    cr_assert_eq(changes(cport, "decode", "prefill"), lent, "a worker was lent after the burst");
    char grep[256];
    snprintf(grep, sizeof grep,
             "grep -q 'role_change.*from=decode to=prefill reason=prefill_queue' %s/logs/*",
             g_up.dir);
    cr_assert_eq(system(grep), 0, "no role_change line with its reason in %s/logs", g_up.dir);
    snprintf(grep, sizeof grep,
             "grep -q 'role_change.*from=prefill to=decode reason=calm' %s/logs/*", g_up.dir);
    cr_assert_eq(system(grep), 0, "no role_change line going back in %s/logs", g_up.dir);
    it_up_stop(&g_up);
}
