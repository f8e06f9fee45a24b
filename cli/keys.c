/*
 * keys.c — `kvmesh keys`: the cluster's key directory (docs/security.md) and HTTP API key files.
 *
 *   kvmesh keys init DIR [--workers w0,w1]       layout, cluster.secret, member keys (controller,
 *                                                router, one per worker id), admin, client
 *   kvmesh keys add DIR NAME --role R [--worker ID] [--public KEY|FILE]
 *                                                a new key pair, or admit a public key made
 * elsewhere kvmesh keys remove DIR NAME                  its new connections are refused from then
 * on kvmesh keys list DIR kvmesh keys api-add FILE TENANT [--role client|operator] [--salt S] a new
 * API key, printed once; only its hash is kept kvmesh keys api-remove FILE TENANT
 *
 * Everything is done by common/sec.h (km_keydir_*, km_apikeys_*); this file parses the command
 * line and prints. Daemons pick changes up without a restart.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/sec.h"

static void keys_usage(FILE *f)
{
    fprintf(f, "usage: kvmesh keys init DIR [--workers w0,w1,...]\n"
               "       kvmesh keys add DIR NAME --role member|operator|client [--worker ID] "
               "[--public KEY|FILE]\n"
               "       kvmesh keys remove DIR NAME\n"
               "       kvmesh keys list DIR\n"
               "       kvmesh keys api-add FILE TENANT [--role client|operator] [--salt SALT]\n"
               "       kvmesh keys api-remove FILE TENANT\n"
               "(docs/security.md; kvmesh keys SUBCOMMAND --help for the options)\n");
}

/* Parses the options of one subcommand and wants exactly n_pos positional arguments. */
static int keys_args(const char *sub, const char *summary, const km_opt *opts, size_t n_opts,
                     int argc, char **argv, int n_pos, km_config **cfg, char *const **pos)
{
    char cmd[32];
    snprintf(cmd, sizeof cmd, "keys %s", sub);
    int prc = cli_parse_opts(cmd, summary, opts, n_opts, argc, argv, cfg);
    if (prc) return prc == 1 ? 1 : 2;
    int n = 0;
    *pos = km_config_args(*cfg, &n);
    if (n != n_pos) {
        fprintf(stderr, "kvmesh keys %s: want %d argument%s, got %d\n", sub, n_pos,
                n_pos == 1 ? "" : "s", n);
        keys_usage(stderr);
        km_config_destroy(*cfg);
        return 2;
    }
    return 0;
}

static int keys_fail(const char *sub, const km_errbuf *err, km_config *cfg)
{
    fprintf(stderr, "kvmesh keys %s: %s\n", sub, err->msg);
    km_config_destroy(cfg);
    return 1;
}

static int keys_init(int argc, char **argv)
{
    const char *workers = NULL;
    const km_opt opts[] = {
        {"workers", "KVMESH_KEYS_WORKERS", KM_OPT_STR, "w0",
         "worker ids, comma-separated: one bound member key each", &workers, 0, 0},
    };
    km_config *cfg;
    char *const *pos;
    int rc = keys_args("init", "make a cluster key directory (keeps keys that exist)", opts, 1,
                       argc, argv, 1, &cfg, &pos);
    if (rc) return rc == 1 ? 0 : 2;
    char *list = strdup(workers ? workers : "");
    const char *ids[256];
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(list, ",", &save); t && n < 256; t = strtok_r(NULL, ",", &save))
        ids[n++] = t;
    km_errbuf err = {{0}};
    int made = km_keydir_init_cluster(pos[0], ids, n, &err);
    free(list);
    if (made < 0) return keys_fail("init", &err, cfg);
    printf("%s: %d key%s made; hand each host its own private/NAME.key and .key_secret\n", pos[0],
           made, made == 1 ? "" : "s");
    km_config_destroy(cfg);
    return 0;
}

static int keys_add(int argc, char **argv)
{
    const char *role = NULL, *worker = NULL, *pub = NULL;
    const km_opt opts[] = {
        {"role", "KVMESH_KEYS_ROLE", KM_OPT_STR, NULL, "member, operator or client (required)",
         &role, 0, 0},
        {"worker", "KVMESH_KEYS_WORKER", KM_OPT_STR, NULL, "the worker id a member key is bound to",
         &worker, 0, 0},
        {"public", "KVMESH_KEYS_PUBLIC", KM_OPT_STR, NULL,
         "admit this public key (Z85, or a .key file) instead of making a key pair", &pub, 0, 0},
    };
    km_config *cfg;
    char *const *pos;
    int rc = keys_args("add", "add a key to a cluster key directory", opts, 3, argc, argv, 2, &cfg,
                       &pos);
    if (rc) return rc == 1 ? 0 : 2;
    km_role r;
    if (!role || km_role_parse(role, &r)) {
        fprintf(stderr, "kvmesh keys add: --role member, operator or client\n");
        km_config_destroy(cfg);
        return 2;
    }
    km_errbuf err = {{0}};
    char key[41];
    if (!pub) {
        rc = km_keydir_new_cert(pos[0], r, pos[1], worker, &err);
    } else if (strlen(pub) == 40 && !strchr(pub, '/')) {
        rc = km_keydir_add_public(pos[0], r, pos[1], pub, worker, &err);
    } else {
        rc = km_cert_read_public(pub, key, &err);
        if (!rc) rc = km_keydir_add_public(pos[0], r, pos[1], key, worker, &err);
    }
    if (rc) return keys_fail("add", &err, cfg);
    printf("%s %s added to %s/%s%s\n", km_role_name(r), pos[1], pos[0], km_role_dir(r),
           pub ? "" : " (key pair in private/)");
    km_config_destroy(cfg);
    return 0;
}

static int keys_remove(int argc, char **argv)
{
    km_config *cfg;
    char *const *pos;
    int rc = keys_args("remove", "remove a key: its new connections are refused", NULL, 0, argc,
                       argv, 2, &cfg, &pos);
    if (rc) return rc == 1 ? 0 : 2;
    km_errbuf err = {{0}};
    if (km_keydir_remove(pos[0], pos[1], &err)) return keys_fail("remove", &err, cfg);
    printf("%s removed (connections already open stay open until they reconnect)\n", pos[1]);
    km_config_destroy(cfg);
    return 0;
}

static int keys_list(int argc, char **argv)
{
    km_config *cfg;
    char *const *pos;
    int rc = keys_args("list", "list the keys of a cluster key directory", NULL, 0, argc, argv, 1,
                       &cfg, &pos);
    if (rc) return rc == 1 ? 0 : 2;
    km_errbuf err = {{0}};
    int n = km_keydir_list(pos[0], KM_ROLES_ALL, NULL, 0, &err);
    km_cert_info *all = n > 0 ? calloc((size_t)n, sizeof *all) : NULL;
    if (n > 0 && all) n = km_keydir_list(pos[0], KM_ROLES_ALL, all, n, &err);
    if (n < 0 || (n > 0 && !all)) {
        free(all);
        return keys_fail("list", &err, cfg);
    }
    printf("%-9s %-24s %-12s %s\n", "ROLE", "NAME", "WORKER", "PUBLIC KEY");
    for (int i = 0; i < n; i++)
        printf("%-9s %-24s %-12s %s\n", km_role_name(all[i].role), all[i].name,
               all[i].worker[0] ? all[i].worker : "-", all[i].public_txt);
    free(all);
    km_config_destroy(cfg);
    return 0;
}

static int keys_api_add(int argc, char **argv)
{
    const char *role = NULL, *salt = NULL;
    const km_opt opts[] = {
        {"role", "KVMESH_KEYS_ROLE", KM_OPT_STR, "client",
         "client or operator (operators may read /v1/status)", &role, 0, 0},
        {"salt", "KVMESH_KEYS_SALT", KM_OPT_STR, NULL,
         "a prefix-cache salt shared on purpose with other keys (default: one of its own)", &salt,
         0, 0},
    };
    km_config *cfg;
    char *const *pos;
    int rc = keys_args("api-add", "make an HTTP API key for a tenant", opts, 2, argc, argv, 2, &cfg,
                       &pos);
    if (rc) return rc == 1 ? 0 : 2;
    km_role r;
    if (km_role_parse(role, &r)) r = KM_ROLE_NONE;
    km_errbuf err = {{0}};
    char token[64];
    if (km_apikeys_add(pos[0], pos[1], r, salt, token, sizeof token, &err))
        return keys_fail("api-add", &err, cfg);
    fprintf(stderr, "API key for %s (%s) added to %s; it is shown this once:\n", pos[1], role,
            pos[0]);
    printf("%s\n", token);
    km_config_destroy(cfg);
    return 0;
}

static int keys_api_remove(int argc, char **argv)
{
    km_config *cfg;
    char *const *pos;
    int rc = keys_args("api-remove", "remove every API key of a tenant", NULL, 0, argc, argv, 2,
                       &cfg, &pos);
    if (rc) return rc == 1 ? 0 : 2;
    km_errbuf err = {{0}};
    int n = km_apikeys_remove(pos[0], pos[1], &err);
    if (n < 0) return keys_fail("api-remove", &err, cfg);
    printf("%d key%s of %s removed\n", n, n == 1 ? "" : "s", pos[1]);
    km_config_destroy(cfg);
    return n ? 0 : 1;
}

int cli_cmd_keys(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*run)(int, char **);
    } subs[] = {
        {"init", keys_init}, {"add", keys_add},         {"remove", keys_remove},
        {"list", keys_list}, {"api-add", keys_api_add}, {"api-remove", keys_api_remove},
    };
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        keys_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof subs / sizeof *subs; i++)
        if (!strcmp(argv[1], subs[i].name)) return subs[i].run(argc - 1, argv + 1);
    fprintf(stderr, "kvmesh keys: unknown subcommand '%s'\n", argv[1]);
    keys_usage(stderr);
    return 2;
}
