/*
 * role.c — `kvmesh role`: change a running worker's role (both, prefill, decode) with the
 * operator command set_role, sent to the worker's requests endpoint (docs/disaggregation.md).
 * Requests running there finish there; routers follow the new role once the controller's view
 * carries it (the next heartbeat).
 */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

int cli_cmd_role(int argc, char **argv)
{
    const char *worker = NULL, *role = NULL, *timeout_text = NULL, *run_dir = NULL;
    int64_t timeout_ms = 0;
    kvm_sec sec = {0};
    const km_opt opts[] = {
        CLI_RUN_ROW(&run_dir),
        {"worker", NULL, KM_OPT_STR, NULL,
         "the worker: its id in the run directory (w0), or its requests endpoint (required)",
         &worker, 0, 0},
        {"role", NULL, KM_OPT_STR, NULL, "both, prefill or decode (required)", &role, 0, 0},
        {"timeout", NULL, KM_OPT_STR, "10",
         "seconds to wait for the worker's answer (or 500ms, 2m)", &timeout_text, 0, 0},
        CLI_SEC_ROWS(&sec),
    };
    km_config *cfg = NULL;
    int prc = cli_parse_opts("role", "change a running worker's role (docs/disaggregation.md)",
                             opts, sizeof opts / sizeof *opts, argc, argv, &cfg);
    if (prc) return prc == 1 ? 0 : 2;
    km_worker_role r;
    int status = 2;
    static cli_run run; /* large: off the stack */
    char ep[512];
    if (cli_parse_seconds("role", "timeout", timeout_text, &timeout_ms)) goto out;
    if (!worker || km_worker_role_parse(role, &r)) {
        fprintf(stderr, "kvmesh role: give --worker ID and --role both|prefill|decode\n");
        goto out;
    }
    if (cli_run_read("role", run_dir, &run) ||
        cli_run_endpoint("role", &run, worker, "worker", CLI_RUN_REQUESTS, worker, ep, sizeof ep))
        goto out;
    if (!sec.cert && run.admin_cert[0]) sec.cert = run.admin_cert;
    if (!sec.server && run.n) sec.server = worker; /* its member key, by id */
    km_msg_admin a = {.cmd = KM_ADMIN_SET_ROLE, .role = role};
    km_msg rep;
    km_errbuf err = {{0}};
    status = 1;
    if (kvm_admin_call(ep, &sec, &a, (int)timeout_ms, &rep, &err)) {
        fprintf(stderr, "kvmesh role: %s\n", err.msg);
        goto out;
    }
    if (rep.type != KM_MSG_ADMIN_REPLY || !rep.admin_reply.ok) {
        fprintf(stderr, "kvmesh role: %s refused: %d %s\n", worker, rep.admin_reply.code,
                rep.admin_reply.message ? rep.admin_reply.message : "");
    } else {
        printf("%s: %s\n", worker, rep.admin_reply.message ? rep.admin_reply.message : role);
        status = 0;
    }
    km_msg_clear(&rep);
out:
    km_config_destroy(cfg);
    return status;
}
