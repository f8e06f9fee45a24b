/*
 * test_scale.c — `kvmesh scale` against a real `kvmesh up` cluster (issue 39.3): 2 -> 3 -> 2
 * workers under a light load of completions loses no request, the added worker becomes ready and
 * warms up from its peers, the removed one hands its pages off and shows as "left" and comes back
 * when asked for again; a worker stopped by SIGTERM is "left" at once, never "dead"; and the
 * command's errors say what is wrong.
 *
 * Run from the repository root after `make build` (make integration); the cluster test skips
 * without the default model.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "tests/integration/harness.h"

#define KVMESH "build/bin/kvmesh"

static it_up g_up;

static void stop_all(void)
{
    it_up_stop(&g_up);
}

TestSuite(scale, .fini = stop_all, .timeout = 420);

#define expect it_shell_expect

/* Does the output of cmd contain `says`? */
static bool says(const char *cmd, const char *what)
{
    char *out;
    it_shell(cmd, &out);
    bool yes = strstr(out, what) != NULL;
    free(out);
    return yes;
}

/* The light load: one completion after another through the router, each a prompt of its own
 * after a shared preamble (so that workers hold chains to hand off and to warm up from). */
typedef struct load {
    pthread_t thread;
    atomic_bool stop;
    atomic_int done, failed;
    char last_error[2048];
} load;

static void *load_main(void *arg)
{
    load *l = arg;
    for (int i = 0; !atomic_load(&l->stop); i++) {
        char cmd[4400];
        snprintf(cmd, sizeof cmd,
                 KVMESH " generate --run-dir %s -n 4 --timeout 120 -p \"You are a careful "
                        "assistant who answers in one short sentence. Question %d: name a "
                        "colour.\" 2>&1",
                 g_up.dir, i);
        FILE *f = popen(cmd, "r");
        char buf[2048] = "";
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        buf[n] = 0;
        int st = f ? pclose(f) : -1;
        if (st == 0) {
            atomic_fetch_add(&l->done, 1);
        } else {
            atomic_fetch_add(&l->failed, 1);
            snprintf(l->last_error, sizeof l->last_error, "%s", buf);
        }
    }
    return NULL;
}

/* The process of cluster.env with this id (zeroed when none). */
static kvm_cluster_proc proc_of(const char *id)
{
    kvm_cluster_proc procs[KVM_CLUSTER_MAX], none = {0};
    int n = kvm_cluster_read(g_up.cluster, procs, KVM_CLUSTER_MAX, NULL);
    const kvm_cluster_proc *p = n > 0 ? kvm_cluster_find(procs, n, id) : NULL;
    return p ? *p : none;
}

/* A worker's admin port, from cluster.env's admin=http://127.0.0.1:PORT. */
static int admin_port(const kvm_cluster_proc *p)
{
    const char *colon = strrchr(p->admin, ':');
    return colon ? atoi(colon + 1) : -1;
}

static bool file_has(const char *path, const char *what)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "grep -q -- '%s' %s", what, path);
    return system(cmd) == 0;
}

Test(scale, two_to_three_to_two_under_load_loses_nothing_and_a_stopped_worker_is_left)
{
    if (!it_have(
            (const char *const[]){IT_MODEL, IT_WORKER, IT_ROUTER, IT_CONTROLLER, KVMESH, NULL}))
        return;
    it_up_start(&g_up, "scale",
                (const char *const[]){"--workers=2", "--threads=1",
                                      "--worker-args=--peer-listen 127.0.0.1:0", NULL});
    char log[160], cmd[1024], ctl_log[160];
    snprintf(log, sizeof log, "%s/up.log", g_up.dir);
    snprintf(ctl_log, sizeof ctl_log, "%s/logs/controller.log", g_up.dir);
    IT_WAIT(file_has(log, "cluster ready:"), 120000, "no 'cluster ready:' in %s", log);

    static load l;
    memset(&l, 0, sizeof l);
    cr_assert_eq(pthread_create(&l.thread, NULL, load_main, &l), 0);
    IT_WAIT(atomic_load(&l.done) >= 3, 120000, "the load did not get going: %s", l.last_error);

    /* 2 -> 3: w2 gets its key, starts, is ready and warms up from its peers */
    snprintf(cmd, sizeof cmd, KVMESH " scale --run-dir %s --workers 3 --wait 180", g_up.dir);
    expect(cmd, 0, "w2 ready");
    snprintf(cmd, sizeof cmd, "ls %s/keys/members", g_up.dir);
    expect(cmd, 0, "w2");
    kvm_cluster_proc w2 = proc_of("w2");
    cr_assert(w2.pid > 0 && w2.admin[0], "cluster.env names no running w2");
    IT_WAIT(it_metric(admin_port(&w2), "kvmesh_kv_handoff_chains_total{outcome=\"taken\"}") > 0,
            60000, "w2 warmed up from no peer (logs in %s/logs)", g_up.dir);
    snprintf(cmd, sizeof cmd, KVMESH " status --run-dir %s --controller controller", g_up.dir);
    IT_WAIT(says(cmd, "w2           ready"), 30000, "the controller does not show w2 ready");
    int before = atomic_load(&l.done);
    IT_WAIT(atomic_load(&l.done) >= before + 3, 120000, "the load stalled at 3 workers: %s",
            l.last_error);

    /* 3 -> 2: w2 drains, hands its pages to its peers, exits, and is not restarted */
    snprintf(cmd, sizeof cmd, KVMESH " scale --run-dir %s --workers 2 --wait 180", g_up.dir);
    expect(cmd, 0, "w2 left");
    char w2_log[160];
    snprintf(w2_log, sizeof w2_log, "%s/logs/w2.log", g_up.dir);
    cr_assert(file_has(w2_log, "event=handoff worker=w2 peers=[1-9][0-9]* chains=[1-9]"),
              "w2 handed nothing off (%s)", w2_log);
    cr_assert(file_has(log, "w2 left the cluster"), "%s", log);
    /* the router's view said so at once: nothing more is routed to it */
    char router_log[160];
    snprintf(router_log, sizeof router_log, "%s/logs/router.log", g_up.dir);
    cr_assert(file_has(router_log, "member_state worker=w2 from=[a-z]* to=left"), "%s", router_log);
    cr_assert_eq(proc_of("w2").pid, 0, "w2 is still in cluster.env");
    snprintf(cmd, sizeof cmd, KVMESH " status --run-dir %s --controller controller", g_up.dir);
    expect(cmd, 0, "w2           left");
    before = atomic_load(&l.done);
    IT_WAIT(atomic_load(&l.done) >= before + 3, 120000, "the load stalled at 2 workers: %s",
            l.last_error);

    /* a worker stopped by SIGTERM is "left" at once, never "dead"; kvmesh up restarts it */
    kvm_cluster_proc w1 = proc_of("w1");
    cr_assert(w1.pid > 0);
    cr_assert_eq(kill(w1.pid, SIGTERM), 0);
    /* (ready, or draining first when it had requests to finish) */
    IT_WAIT(file_has(ctl_log, "member_state worker=w1 from=[a-z]* to=left"), 60000,
            "the controller never showed w1 left (%s)", ctl_log);
    IT_WAIT(file_has(ctl_log, "member_state worker=w1 from=left to="), 120000,
            "w1 never came back (%s)", log);
    cr_assert(!file_has(ctl_log, "worker=w1 from=[a-z]* to=dead"), "w1 was dead (%s)", ctl_log);

    /* the removed w2 comes back under its old key, supervised again */
    snprintf(cmd, sizeof cmd, KVMESH " scale --run-dir %s --workers 3 --wait 180", g_up.dir);
    expect(cmd, 0, "w2 ready");
    snprintf(cmd, sizeof cmd, KVMESH " status --run-dir %s --controller controller", g_up.dir);
    IT_WAIT(says(cmd, "w2           ready"), 30000, "the controller does not show w2 back");

    atomic_store(&l.stop, true);
    pthread_join(l.thread, NULL);
    cr_assert_eq(atomic_load(&l.failed), 0, "%d of %d requests lost; the last said: %s",
                 atomic_load(&l.failed), atomic_load(&l.failed) + atomic_load(&l.done),
                 l.last_error);
    cr_log_info("scale: %d completions, none lost", atomic_load(&l.done));
    it_up_stop(&g_up);
}

Test(scale, errors_say_what_is_wrong)
{
    if (!it_have((const char *const[]){KVMESH, NULL})) return;
    expect(KVMESH " scale --help", 0, "--workers");
    expect(KVMESH " scale --run-dir /tmp --workers 0", 2, "N >= 1");
    expect("env -u KVMESH_RUN_DIR " KVMESH " scale --workers 3", 2, "give --run-dir");
    char dir[] = "/tmp/kvmesh-scale-err-XXXXXX", cmd[512], path[256];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd, KVMESH " scale --run-dir %s --workers 3", dir);
    expect(cmd, 1, "no running cluster");
    /* a run directory whose kvmesh up (this process stands in) runs with keys that are gone */
    snprintf(path, sizeof path, "%s/up.pid", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "pid=%d keys=1 controller=1\n", (int)getpid());
    fclose(f);
    snprintf(path, sizeof path, "%s/cluster.env", dir);
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fclose(f);
    expect(cmd, 1, "keys missing");
    snprintf(path, sizeof path, "%s/up.pid", dir);
    f = fopen(path, "w");
    fprintf(f, "pid=%d keys=0 controller=0\n", (int)getpid());
    fclose(f);
    expect(cmd, 1, "without a controller");
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}
