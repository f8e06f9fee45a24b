/*
 * cli.h — private to the `kvmesh` command (cli/): the subcommands, each in a file of its own, and
 * the option plumbing they share. The command is built on libkvmesh (client/kvmesh.h) and, for
 * the local engine commands only (run, perplexity, bench, tokenize, sparse-calibrate: cli/local.c),
 * on the engine.
 *
 *   cli/main.c      dispatch and the command list
 *   cli/opts.c      options (common/svc.h's table, with -p/-n/-m/-r short forms), reading a file
 *   cli/local.c     run, perplexity, bench, tokenize, sparse-calibrate: the engine in-process
 *   cli/generate.c  generate, chat: through a router with libkvmesh
 *   cli/status.c    status (router or controller), recover
 *   cli/role.c      role (a worker's, at run time)
 *   cli/rundir.c    --run-dir: endpoints and keys from a `kvmesh up` run directory
 *   cli/up*.c       up: a local cluster, supervised (up.h)
 *   cli/scale.c     scale: workers added to or drained from a running `up` (its side: up_scale.c)
 *   cli/chaos*.c    chaos: fault scenarios against local clusters (chaos.h)
 *   cli/keys.c      keys: the cluster key directory and HTTP API key files (common/sec.h)
 *
 * Every cli_cmd_* takes argv with the command itself in argv[0] (km_config wants a program name
 * first) and returns the process's exit status: 0, 1 (failed) or 2 (bad usage).
 */
#ifndef KVMESH_CLI_H
#define KVMESH_CLI_H

#include <stdio.h>

#include "client/kvmesh.h"

/* Parses argv (argv[0] = the command) against opts; returns 0, 1 (help shown) or 2 (error). */
int cli_parse_opts(const char *cmd, const char *summary, const km_opt *opts, size_t n, int argc,
                   char **argv, km_config **out);

/* The two option-table rows of a client's CURVE settings (client/kvmesh.h kvm_sec *s): --cert
 * (KVMESH_CERT) and --server-key (KVMESH_SERVER_KEY). */
#define CLI_SEC_ROWS(s)                                                                            \
    {"cert",                                                                                       \
     NULL,                                                                                         \
     KM_OPT_STR,                                                                                   \
     NULL,                                                                                         \
     "client certificate (NAME.key beside NAME.key_secret) for a secure cluster "                  \
     "(docs/security.md); unset = plain",                                                          \
     &(s)->cert,                                                                                   \
     0,                                                                                            \
     0},                                                                                           \
    {                                                                                              \
        "server-key", NULL, KM_OPT_STR, NULL,                                                      \
            "the server's public key (Z85 or .key file), or a member name in the key directory "   \
            "that holds --cert (default: router or controller)",                                   \
            &(s)->server, 0, 0                                                                     \
    }

/* The whole file, NUL-terminated (*len, when not NULL, excludes the NUL); NULL after saying why
 * on stderr. */
char *cli_read_file(const char *path, size_t *len);

/* A time-out flag's value in ms: a bare number is seconds ("5", "0.5"), or with a unit ("250ms",
 * "2s", "1.5m", "1h"). 0, or 2 after saying why on stderr. */
int cli_parse_seconds(const char *cmd, const char *flag, const char *text, int64_t *ms);
/* A --seed value: "random" or -1 (none), or any integer 0..2^64-1. 0, or 2 after saying why. */
int cli_parse_seed(const char *cmd, const char *text, bool *has, uint64_t *seed);
/* Every value of a repeatable flag ("--stop A --stop B", "--stop=A") in argv order, at most max;
 * the km_config table keeps only the last. Returns how many, or -1 when more than max. */
int cli_repeated(int argc, char **argv, const char *flag, const char **out, int max);
/* An environment variable that an option of cmd used to read (old, now renamed `now`): its value
 * after a warning on stderr, when set (and starting with prefix unless prefix is NULL: an old
 * spelling that meant something else then is used only in that form); else NULL. */
const char *cli_env_deprecated(const char *cmd, const char *old, const char *now,
                               const char *prefix);
/* A ZeroMQ endpoint from what a user typed: "HOST:PORT" becomes "tcp://HOST:PORT". */
void cli_endpoint(const char *in, char *out, size_t cap);
/* What to tell a user whose endpoint ZeroMQ refused. */
const char *cli_endpoint_hint(const char *endpoint);

/* What a `kvmesh up` run directory says (rundir.c): its processes and key files; n = 0 and empty
 * strings when no directory was given, key paths empty when the cluster runs --insecure. */
typedef struct cli_run {
    char dir[4096];
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n;
    char client_cert[4200], admin_cert[4200], api_key[256];
} cli_run;
enum { CLI_RUN_REQUESTS, CLI_RUN_HTTP, CLI_RUN_LISTEN, CLI_RUN_ADMIN };
#define CLI_RUN_ROW(dest)                                                                          \
    {                                                                                              \
        "run-dir", NULL, KM_OPT_STR, NULL,                                                         \
            "a `kvmesh up` run directory: the endpoints and keys not given come from its "         \
            "cluster.env "                                                                         \
            "and keys/private (and an endpoint flag may name a process of it: router1, w0)",       \
            dest, 0, 0                                                                             \
    }
/* Reads dir (NULL: nothing) into out; 0, or 1 after saying why. */
int cli_run_read(const char *cmd, const char *dir, cli_run *out);
/* The process with this id (or, id NULL, the first of this role); NULL after saying why. */
const kvm_cluster_proc *cli_run_find(const char *cmd, const cli_run *run, const char *id,
                                     const char *role);
/* An endpoint: `given` as typed (tcp:// added for ZeroMQ fields), or, when given is NULL or a bare
 * process name and run has a cluster, that process's field (CLI_RUN_*); fallback when neither.
 * 0, or 1 after saying why. */
int cli_run_endpoint(const char *cmd, const cli_run *run, const char *given, const char *role,
                     int field, const char *fallback, char *out, size_t cap);

int cli_cmd_run(int argc, char **argv);
int cli_cmd_perplexity(int argc, char **argv);
int cli_cmd_bench(int argc, char **argv);
int cli_cmd_tokenize(int argc, char **argv);
int cli_cmd_sparse_calibrate(int argc, char **argv);
int cli_cmd_generate(int argc, char **argv);
int cli_cmd_chat(int argc, char **argv);
int cli_cmd_status(int argc, char **argv);
/* `kvmesh status --worker URL` (status_kv.c): a worker's KV shards and expert groups. */
int cli_status_worker(const char *admin_url);
/* Bytes for a narrow column: 0B, 512B, 4.4M, 1.2G (status.c). */
void cli_fmt_bytes(char *out, size_t cap, uint64_t b);
int cli_cmd_recover(int argc, char **argv);
int cli_cmd_role(int argc, char **argv); /* role.c */
int cli_cmd_up(int argc, char **argv);
int cli_cmd_scale(int argc, char **argv);
int cli_cmd_chaos(int argc, char **argv);
int cli_cmd_keys(int argc, char **argv);

#endif /* KVMESH_CLI_H */
