/*
 * test_pd.c — prefill/decode disaggregation (issue 32) on a real `kvmesh up` cluster of one
 * prefill and one decode worker behind a router and a controller: the roles show in `kvmesh
 * status`; a long prompt (about 1.8k tokens) is disaggregated (the router says so), the decode
 * worker imports the prompt's pages from the prefill worker while the prefill still runs
 * (kvmesh_worker_pd_pages_imported_total{when="during_prefill"}), and its greedy output is the
 * one the same request gets from a cluster of one `both` worker; a short prompt is not
 * disaggregated; and when the prefill worker is SIGKILLed while the decode worker pulls, the
 * request completes with the same tokens (the decode worker computes what is missing); when the
 * decode worker is SIGKILLed mid-stream, the router migrates the request and the output is the
 * same; `kvmesh
 * role` changes the decode worker's role at run time and the controller's view shows it.
 *
 * Run from the repository root after `make build` (make integration); skips without the default
 * model.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "tests/integration/harness.h"

static it_up g_up;

static void stop_all(void)
{
    it_up_stop(&g_up);
}

TestSuite(pd, .fini = stop_all, .timeout = 600);

static bool file_has(const char *path, const char *what)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "grep -q -- '%s' %s", what, path);
    return system(cmd) == 0;
}

/* Does cmd's stdout contain both a and b? */
static bool says(const char *cmd, const char *a, const char *b)
{
    char *out = it_stdout(cmd);
    bool yes = out && strstr(out, a) && strstr(out, b);
    free(out);
    return yes;
}

/* A port of cluster.env's process id, from its admin=http://HOST:PORT (or http=). */
static int port_of(const char *id, bool http)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = kvm_cluster_read(g_up.cluster, procs, KVM_CLUSTER_MAX, NULL);
    const kvm_cluster_proc *p = n > 0 ? kvm_cluster_find(procs, n, id) : NULL;
    const char *url = p ? (http ? p->http : p->admin) : NULL;
    const char *colon = url ? strrchr(url, ':') : NULL;
    return colon ? atoi(colon + 1) : -1;
}

/* A prompt of numbered sentences, each different (so no page repeats): about 1.8k tokens;
 * another variant, another prompt. */
static void write_long_prompt(const char *path, int variant)
{
    static const char *const things[] = {"river",  "lantern", "orchard", "glacier", "violin",
                                         "harbor", "meadow",  "compass", "thunder", "saddle"};
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "Read these notes, then say which thing was mentioned first.\n");
    for (int i = 0; i < 120; i++)
        fprintf(f, "Note %d: the %s near house %d was painted %s on day %d.\n", i + 1,
                things[(i + variant) % 10], 7 * i + 3 + variant, i % 3 ? "blue" : "green",
                (i * 13) % 31 + 1);
    fprintf(f, "Answer:");
    fclose(f);
}

/* The greedy completion of the prompt in file through the cluster in dir (malloc'd). */
static char *generate(const char *dir, const char *file, int n)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             IT_KVMESH " generate --run-dir %s --quiet --temperature 0 -n %d --timeout 300 "
                       "--file %s 2>/dev/null",
             dir, n, file);
    char *out = it_stdout(cmd);
    cr_assert_not_null(out);
    return out;
}

/* A process id of cluster.env (0: none). */
static int pid_of(const char *id)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = kvm_cluster_read(g_up.cluster, procs, KVM_CLUSTER_MAX, NULL);
    const kvm_cluster_proc *p = n > 0 ? kvm_cluster_find(procs, n, id) : NULL;
    return p ? p->pid : 0;
}

static void up_ready(const char *tag, const char *const *args)
{
    it_up_start(&g_up, tag, args);
    char log[160];
    snprintf(log, sizeof log, "%s/up.log", g_up.dir);
    IT_WAIT(file_has(log, "cluster ready:"), 180000, "no 'cluster ready:' in %s", log);
}

Test(pd, long_prompt_pages_stream_from_the_prefill_worker_and_the_output_is_unchanged)
{
    if (!it_have(
            (const char *const[]){IT_MODEL, IT_WORKER, IT_ROUTER, IT_CONTROLLER, IT_KVMESH, NULL}))
        return;
    char prompt[] = "/tmp/kvmesh-pd-prompt-XXXXXX", short_prompt[] = "/tmp/kvmesh-pd-short-XXXXXX";
    char prompt2[] = "/tmp/kvmesh-pd-kill-XXXXXX", prompt3[] = "/tmp/kvmesh-pd-dkill-XXXXXX";
    int fd = mkstemp(prompt), fd2 = mkstemp(short_prompt), fd3 = mkstemp(prompt2);
    int fd4 = mkstemp(prompt3);
    cr_assert(fd >= 0 && fd2 >= 0 && fd3 >= 0 && fd4 >= 0);
    write_long_prompt(prompt, 0);
    write_long_prompt(prompt2, 3);
    write_long_prompt(prompt3, 6);
    cr_assert(write(fd2, "Say hello.", 10) == 10);

    /* the reference: one `both` worker */
    up_ready("pd-both", (const char *const[]){"--workers=1", "--threads=1", "--insecure", NULL});
    char *want = generate(g_up.dir, prompt, 24), *want2 = generate(g_up.dir, prompt2, 24);
    char *want3 = generate(g_up.dir, prompt3, 48);
    cr_assert(strlen(want) > 0, "the reference produced nothing (logs in %s/logs)", g_up.dir);
    it_up_stop(&g_up);

    /* 1 prefill + 1 decode */
    up_ready("pd", (const char *const[]){"--prefill-workers=1", "--decode-workers=1", "--threads=1",
                                         "--insecure", NULL});
    char cmd[512];
    snprintf(cmd, sizeof cmd, IT_KVMESH " status --run-dir %s --controller controller", g_up.dir);
    IT_WAIT(says(cmd, " prefill ", " decode "), 30000, "kvmesh status shows no roles");
    /* the router disaggregates only once its view has both roles with transfer addresses */
    int rport = port_of("router", true), dport = port_of("w1", false);
    cr_assert(rport > 0 && dport > 0, "no admin ports in %s", g_up.cluster);
    IT_WAIT(it_metric_at("127.0.0.1", rport, "kvmesh_router_worker_up{worker=\"w0\"}") == 1 &&
                it_metric_at("127.0.0.1", rport, "kvmesh_router_worker_up{worker=\"w1\"}") == 1,
            60000, "the router is not connected to both workers");

    char *got = generate(g_up.dir, prompt, 24);
    double dis =
        it_metric_at("127.0.0.1", rport, "kvmesh_router_pd_total{decision=\"disaggregated\"}");
    double during =
        it_metric(dport, "kvmesh_worker_pd_pages_imported_total{when=\"during_prefill\"}");
    double after =
        it_metric(dport, "kvmesh_worker_pd_pages_imported_total{when=\"after_prefill\"}");
    double complete = it_metric(dport, "kvmesh_worker_pd_requests_total{outcome=\"complete\"}");
    cr_log_info("pd: disaggregated=%.0f pages during_prefill=%.0f after_prefill=%.0f complete=%.0f",
                dis, during, after, complete);
    cr_assert_eq(dis, 1, "the router did not disaggregate the long prompt (logs in %s/logs)",
                 g_up.dir);
    cr_assert_eq(complete, 1, "the decode worker did not get every page (logs in %s/logs)",
                 g_up.dir);
    cr_assert_gt(during, 0, "no page was imported while the prefill ran (logs in %s/logs)",
                 g_up.dir);
    cr_assert_str_eq(got, want, "disaggregated output differs from one worker's");

    /* a short prompt is computed where it lands */
    double local = it_metric_at("127.0.0.1", rport, "kvmesh_router_pd_total{decision=\"local\"}");
    free(generate(g_up.dir, short_prompt, 4));
    cr_assert_eq(
        it_metric_at("127.0.0.1", rport, "kvmesh_router_pd_total{decision=\"disaggregated\"}"), 1);
    cr_assert_eq(it_metric_at("127.0.0.1", rport, "kvmesh_router_pd_total{decision=\"local\"}"),
                 local + 1);

    /* the prefill worker SIGKILLed once the decode worker has pulled pages of a new prompt */
    char cmd2[1024];
    snprintf(cmd2, sizeof cmd2,
             IT_KVMESH " generate --run-dir %s --quiet --temperature 0 -n 24 --timeout 300 "
                       "--file %s 2>/dev/null",
             g_up.dir, prompt2);
    FILE *bg = popen(cmd2, "r");
    cr_assert_not_null(bg);
    const char *during_s = "kvmesh_worker_pd_pages_imported_total{when=\"during_prefill\"}";
    IT_WAIT(it_metric(dport, during_s) > during, 120000, "no page of the second prompt arrived");
    int w0 = pid_of("w0");
    cr_assert(w0 > 0);
    cr_assert_eq(kill(w0, SIGKILL), 0);
    static char got2[8192];
    size_t n2 = fread(got2, 1, sizeof got2 - 1, bg);
    got2[n2] = 0;
    cr_assert_eq(pclose(bg), 0, "the request failed after the prefill worker was killed");
    cr_assert_str_eq(got2, want2, "the output changed after the prefill worker was killed");
    double partial = it_metric(dport, "kvmesh_worker_pd_requests_total{outcome=\"partial\"}");
    cr_log_info("pd kill: partial=%.0f", partial);
    cr_assert_eq(partial, 1, "the decode worker did not finish the prompt itself");

    /* the decode worker SIGKILLed mid-stream of a disaggregated request: the router migrates
     * it (to the prefill worker, then the only one left, or to w1 restarted) and the stream goes
     * on with the same tokens */
    snprintf(cmd2, sizeof cmd2,
             IT_KVMESH " generate --run-dir %s --quiet --temperature 0 -n 48 --timeout 300 "
                       "--file %s 2>/dev/null",
             g_up.dir, prompt3);
    bg = popen(cmd2, "r");
    cr_assert_not_null(bg);
    int first = fgetc(bg); /* the stream has begun at the decode worker */
    cr_assert_neq(first, EOF, "no token of the third prompt");
    int w1 = pid_of("w1");
    cr_assert(w1 > 0);
    cr_assert_eq(kill(w1, SIGKILL), 0);
    static char got3[8192];
    got3[0] = (char)first;
    size_t n3 = fread(got3 + 1, 1, sizeof got3 - 2, bg);
    got3[n3 + 1] = 0;
    cr_assert_eq(pclose(bg), 0, "the request failed after the decode worker was killed");
    cr_assert_str_eq(got3, want3, "the output changed after the decode worker was killed");
    IT_WAIT(pid_of("w1") > 0 && pid_of("w1") != w1 &&
                it_metric_at("127.0.0.1", rport, "kvmesh_router_worker_up{worker=\"w1\"}") == 1,
            120000, "w1 did not come back");
    dport = port_of("w1", false);

    /* a role changed at run time by the operator command: the controller's view follows */
    char rcmd[512];
    snprintf(rcmd, sizeof rcmd, IT_KVMESH " role --run-dir %s --worker w1 --role both", g_up.dir);
    it_shell_expect(rcmd, 0, "role both (was decode)");
    IT_WAIT(says(cmd, "w1           ready      both ", " prefill "), 30000,
            "kvmesh status does not show w1's new role");
    snprintf(rcmd, sizeof rcmd, IT_KVMESH " role --run-dir %s --worker w1 --role mixed", g_up.dir);
    it_shell_expect(rcmd, 2, "--role both|prefill|decode");
    free(got);
    free(want);
    free(want2);
    free(want3);
    it_up_stop(&g_up);
    unlink(prompt);
    unlink(short_prompt);
    unlink(prompt2);
    unlink(prompt3);
    close(fd);
    close(fd2);
    close(fd3);
    close(fd4);
}
