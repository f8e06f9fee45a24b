/*
 * rundir.c — what a `kvmesh up` run directory tells the other commands (--run-dir, env
 * KVMESH_RUN_DIR): the endpoints in its cluster.env and the keys under keys/private, so that
 * `kvmesh generate`, `status` and `recover` reach a cluster whose ports were picked at random
 * (--base-port 0) without copying endpoints and key paths by hand. A flag given explicitly
 * always wins over what the run directory says.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"

int cli_run_read(const char *cmd, const char *dir, cli_run *out)
{
    memset(out, 0, sizeof *out);
    if (!dir || !dir[0]) return 0;
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, KVM_CLUSTER_FILE);
    km_errbuf err = {{0}};
    out->n = kvm_cluster_read(path, out->procs, KVM_CLUSTER_MAX, &err);
    if (out->n < 0) {
        fprintf(stderr, "kvmesh %s: --run-dir %s: %s (is it a `kvmesh up` run directory?)\n", cmd,
                dir, err.msg);
        return 1;
    }
    /* keys: present unless the cluster runs --insecure */
    snprintf(out->client_cert, sizeof out->client_cert, "%s/keys/private/client.key", dir);
    snprintf(out->admin_cert, sizeof out->admin_cert, "%s/keys/private/admin.key", dir);
    if (access(out->client_cert, R_OK)) out->client_cert[0] = 0;
    if (access(out->admin_cert, R_OK)) out->admin_cert[0] = 0;
    snprintf(path, sizeof path, "%s/keys/private/api_key.admin", dir);
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(out->api_key, sizeof out->api_key, f)) out->api_key[0] = 0;
        out->api_key[strcspn(out->api_key, "\r\n")] = 0;
        fclose(f);
    }
    return 0;
}

const kvm_cluster_proc *cli_run_find(const char *cmd, const cli_run *run, const char *id,
                                     const char *role)
{
    for (int i = 0; i < run->n; i++) {
        const kvm_cluster_proc *p = &run->procs[i];
        if (id ? !strcmp(p->id, id) : !strcmp(p->role, role)) return p;
    }
    fprintf(stderr, "kvmesh %s: %s/%s names no %s%s\n", cmd, run->dir, KVM_CLUSTER_FILE,
            id ? "process " : "", id ? id : role);
    return NULL;
}

int cli_run_endpoint(const char *cmd, const cli_run *run, const char *given, const char *role,
                     int field, const char *fallback, char *out, size_t cap)
{
    /* an endpoint as typed, unless it is a bare name from the run directory (router1, ...) */
    bool name = given && !strstr(given, "://") && !strchr(given, ':');
    bool zmq = field == CLI_RUN_REQUESTS || field == CLI_RUN_LISTEN;
    if (given && !(name && run->n > 0)) {
        if (zmq)
            cli_endpoint(given, out, cap);
        else
            snprintf(out, cap, "%s", given);
        return 0;
    }
    if (run->n <= 0) {
        snprintf(out, cap, "%s", fallback);
        return 0;
    }
    const kvm_cluster_proc *p = cli_run_find(cmd, run, given, role);
    if (!p) return 1;
    const char *ep = field == CLI_RUN_HTTP     ? p->http
                     : field == CLI_RUN_LISTEN ? p->listen
                     : field == CLI_RUN_ADMIN  ? p->admin
                                               : p->requests;
    if (!ep[0]) {
        fprintf(stderr, "kvmesh %s: %s in %s/%s has no endpoint yet (not started?)\n", cmd, p->id,
                run->dir, KVM_CLUSTER_FILE);
        return 1;
    }
    snprintf(out, cap, "%s", ep);
    return 0;
}
