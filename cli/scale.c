/*
 * scale.c — `kvmesh scale --workers N`: changes the number of workers of a running `kvmesh up`
 * cluster. It makes the CURVE keys of the workers to add in <run-dir>/keys (as `kvmesh keys add`
 * does: a member key bound to the worker id), writes <run-dir>/scale and sends SIGUSR1 to
 * `kvmesh up` (<run-dir>/up.pid), which starts and supervises the added workers and drains the
 * removed ones (cli/up_scale.c). Then it waits until cluster.env and the workers' /readyz say the
 * cluster has exactly w0..w<N-1>, each ready. Why through `kvmesh up`: the processes stay
 * children of one supervisor (restarted on exit, stopped by Ctrl-C, listed in cluster.env), which
 * a second command starting daemons on its own could not give (docs/operations.md).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/sec.h"

/* What <run-dir>/up.pid says: kvmesh up's pid, whether the cluster has keys and a controller. */
typedef struct scale_up {
    int pid, keys, controller;
} scale_up;

/* 0 when a `kvmesh up` runs for dir, else 1 after saying why not. */
static int scale_find_up(const char *dir, scale_up *up)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/up.pid", dir);
    FILE *f = fopen(path, "r");
    int got =
        f ? fscanf(f, "pid=%d keys=%d controller=%d", &up->pid, &up->keys, &up->controller) : 0;
    if (f) fclose(f);
    if (got != 3 || up->pid <= 0 || (kill(up->pid, 0) && errno == ESRCH)) {
        fprintf(stderr,
                "kvmesh scale: no running cluster in %s (no `kvmesh up` there: start one with "
                "kvmesh up --run-dir %s)\n",
                dir, dir);
        return 1;
    }
    if (!up->controller) {
        fprintf(stderr,
                "kvmesh scale: the cluster in %s runs without a controller "
                "(--no-controller): routers would not find added workers\n",
                dir);
        return 1;
    }
    return 0;
}

/* The member keys of w0..w<n-1> that are missing, made in <dir>/keys; 0, or 1 after saying why. */
static int scale_keys(const char *dir, int n)
{
    char keydir[4200], secret[4300];
    snprintf(keydir, sizeof keydir, "%s/keys", dir);
    snprintf(secret, sizeof secret, "%s/cluster.secret", keydir);
    km_cert_info ci;
    km_errbuf err = {{0}};
    if (access(secret, R_OK) || km_keydir_find(keydir, KM_ROLE_MEMBER, "controller", &ci, &err)) {
        fprintf(stderr,
                "kvmesh scale: keys missing: the cluster runs with CURVE but %s has no "
                "cluster.secret or controller key (%s); restore the run directory's keys/\n",
                keydir, err.msg[0] ? err.msg : strerror(errno));
        return 1;
    }
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "w%d", i);
        if (!km_keydir_find_worker(keydir, name, &ci, &err)) continue;
        if (km_keydir_new_cert(keydir, KM_ROLE_MEMBER, name, name, &err)) {
            fprintf(stderr, "kvmesh scale: cannot make %s's key in %s: %s\n", name, keydir,
                    err.msg);
            return 1;
        }
        printf("kvmesh scale: made %s's member key in %s\n", name, keydir);
    }
    return 0;
}

/* Does worker p answer /readyz with 200? */
static bool scale_ready(const kvm_cluster_proc *p)
{
    if (!p->pid || !p->admin[0]) return false;
    char url[256];
    snprintf(url, sizeof url, "%s/readyz", p->admin);
    km_buf body = {0};
    int status = 0;
    int rc = kvm_http_get(url, 500, &body, &status, NULL);
    km_buf_free(&body);
    return rc == 0 && status == 200;
}

/* The worker ids cluster.env names: a bit per wI. */
static uint64_t scale_listed(const cli_run *run)
{
    uint64_t set = 0;
    for (int i = 0; i < run->n; i++) {
        int wi;
        if (!strcmp(run->procs[i].role, "worker") && sscanf(run->procs[i].id, "w%d", &wi) == 1 &&
            wi >= 0 && wi < 64)
            set |= 1ull << wi;
    }
    return set;
}

/* Waits until cluster.env lists exactly w0..w<n-1> and each answers /readyz, saying when a
 * worker not in `had` is ready and when one leaves; 0, or 1 when wait_s passed first (after saying
 * what is missing). */
static int scale_wait(const char *dir, int n, uint64_t had, int64_t wait_s)
{
    static cli_run run; /* large: off the stack */
    uint64_t want = n >= 64 ? ~0ull : (1ull << n) - 1, said = had & want, leaving = 0;
    int64_t deadline = (int64_t)(km_now_ns() / 1000000) + wait_s * 1000;
    char missing[256] = "";
    for (;;) {
        bool done = true;
        missing[0] = 0;
        if (cli_run_read("scale", dir, &run)) return 1;
        uint64_t listed = scale_listed(&run);
        for (int wi = 0; wi < 64; wi++) {
            char id[16];
            snprintf(id, sizeof id, "w%d", wi);
            const kvm_cluster_proc *p = kvm_cluster_find(run.procs, run.n, id);
            uint64_t bit = 1ull << wi;
            bool wanted = want & bit, ok = wanted ? p && scale_ready(p) : !(listed & bit);
            if (!ok && !wanted) leaving |= bit; /* draining: "left" is said when it has gone */
            if (ok && (wanted ? !(said & bit) : (leaving & bit) != 0))
                printf("kvmesh scale: %s %s\n", id, wanted ? "ready" : "left");
            if (ok) said |= bit, leaving &= ~bit;
            if (!ok && strlen(missing) < 200)
                snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " %s (%s)",
                         id, wanted ? "not ready" : "still draining");
            done &= ok;
        }
        fflush(stdout);
        if (done) return 0;
        if ((int64_t)(km_now_ns() / 1000000) >= deadline) {
            fprintf(stderr,
                    "kvmesh scale: not done after %lld s:%s (the logs of `kvmesh up` say why)\n",
                    (long long)wait_s, missing);
            return 1;
        }
        usleep(200000);
    }
}

int cli_cmd_scale(int argc, char **argv)
{
    int64_t workers = 0, wait_s = 0;
    const char *run_dir = NULL;
    const km_opt opts[] = {
        {"workers", NULL, KM_OPT_INT, NULL, "the number of workers wanted (1..64): w0..w<N-1>",
         &workers, 0, 64},
        CLI_RUN_ROW(&run_dir),
        {"wait", "KVMESH_SCALE_WAIT", KM_OPT_INT, "300",
         "seconds to wait until every wanted worker is ready and every removed one has left; 0 = "
         "return at once",
         &wait_s, 0, 86400},
    };
    km_config *cfg = NULL;
    int prc = cli_parse_opts(
        "scale",
        "change the number of workers of a running `kvmesh up` cluster: added workers get keys "
        "and are supervised by kvmesh up; removed ones (the highest ids) drain, handing their KV "
        "pages to peers, and exit",
        opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    int rc = 2;
    static cli_run run; /* large: off the stack */
    scale_up up = {0};
    if (workers < 1) {
        fprintf(stderr, "kvmesh scale: --workers N wants N >= 1 (kvmesh scale --help)\n");
    } else if (!run_dir) {
        fprintf(stderr, "kvmesh scale: which cluster? give --run-dir (the run directory of "
                        "`kvmesh up`) or set KVMESH_RUN_DIR\n");
    } else if (scale_find_up(run_dir, &up) || cli_run_read("scale", run_dir, &run) ||
               (up.keys && scale_keys(run_dir, (int)workers))) {
        rc = 1;
    } else {
        uint64_t listed = scale_listed(&run);
        int now = __builtin_popcountll(listed);
        char path[4200], body[32];
        snprintf(path, sizeof path, "%s/scale", run_dir);
        snprintf(body, sizeof body, "workers=%lld\n", (long long)workers);
        km_errbuf err = {{0}};
        if (km_write_file_atomic(path, body, strlen(body), 0644, &err) || kill(up.pid, SIGUSR1)) {
            fprintf(stderr, "kvmesh scale: cannot ask kvmesh up (pid %d): %s\n", up.pid,
                    err.msg[0] ? err.msg : strerror(errno));
            rc = 1;
        } else {
            printf("kvmesh scale: %d -> %lld workers (kvmesh up, pid %d)\n", now,
                   (long long)workers, up.pid);
            fflush(stdout);
            rc = wait_s ? scale_wait(run_dir, (int)workers, listed, wait_s) : 0;
            if (!rc && wait_s)
                printf("kvmesh scale: %lld workers; kvmesh status --run-dir %s --controller "
                       "controller shows them\n",
                       (long long)workers, run_dir);
        }
    }
    km_config_destroy(cfg);
    return rc;
}
