/*
 * opts.c — the option plumbing every cluster subcommand shares: the project's option table
 * (common/svc.h: each flag has a KVMESH_ environment twin and --help lists them with defaults),
 * with -p, -n, -m, -r, -f as short forms of --prompt, --max-tokens, --model, --router, --file;
 * and reading a whole file (a prompt, a text to score).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"

/* Parses argv (argv[0] = the command) against opts; returns 0, 1 (help shown) or 2 (error). */
int cli_parse_opts(const char *cmd, const char *summary, const km_opt *opts, size_t n, int argc,
                   char **argv, km_config **out)
{
    static const char *const shorts[][2] = {
        {"-p", "--prompt"}, {"-n", "--max-tokens"}, {"-m", "--model"},
        {"-r", "--router"}, {"-f", "--file"},
    };
    char **av = calloc((size_t)argc + 1, sizeof *av);
    if (!av) return 2;
    for (int i = 0; i < argc; i++) {
        av[i] = argv[i];
        for (size_t k = 0; k < sizeof shorts / sizeof *shorts; k++)
            if (i > 0 && !strcmp(argv[i], shorts[k][0])) av[i] = (char *)shorts[k][1];
    }
    char prog[64];
    snprintf(prog, sizeof prog, "kvmesh %s", cmd);
    km_config *c = NULL;
    int rc = km_daemon_config(prog, summary, opts, n, argc, av, NULL, NULL, &c);
    free(av);
    if (rc == 1) { /* help shown: add the short forms this command has */
        const char *sep = "short options:";
        for (size_t k = 0; k < sizeof shorts / sizeof *shorts; k++)
            for (size_t i = 0; i < n; i++)
                if (opts[i].name && !strcmp(opts[i].name, shorts[k][1] + 2)) {
                    printf("%s %s = %s", sep, shorts[k][0], shorts[k][1]);
                    sep = ",";
                }
        if (strcmp(sep, ",") == 0) printf("\n");
    }
    if (rc) return rc;
    *out = c;
    return 0;
}

char *cli_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvmesh: cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    km_buf b = {0};
    char tmp[65536];
    size_t n;
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) km_buf_append(&b, tmp, n);
    fclose(f);
    if (len) *len = b.len;
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

int cli_parse_seconds(const char *cmd, const char *flag, const char *text, int64_t *ms)
{
    char *end;
    errno = 0;
    double s = strtod(text, &end);
    if (end != text && !*end && !errno) {
        if (!(s > 0) || s > 86400 * 365) {
            fprintf(stderr, "kvmesh %s: --%s %s: give seconds above 0 (or 250ms, 2s, 1.5m, 1h)\n",
                    cmd, flag, text);
            return 2;
        }
        *ms = (int64_t)(s * 1000 + 0.5);
        if (*ms < 1) *ms = 1;
        return 0;
    }
    if (km_parse_duration_ms(text, ms) || *ms <= 0) {
        fprintf(stderr,
                "kvmesh %s: --%s %s: not a duration (seconds such as 5 or 0.5, or 250ms, "
                "2s, 1.5m, 1h)\n",
                cmd, flag, text);
        return 2;
    }
    return 0;
}

int cli_parse_seed(const char *cmd, const char *text, bool *has, uint64_t *seed)
{
    *has = false;
    if (!text || !strcmp(text, "random") || !strcmp(text, "-1")) return 0;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 0);
    if (end == text || *end || errno || text[0] == '-' || text[0] == '+') {
        fprintf(stderr,
                "kvmesh %s: --seed %s: give an integer from 0 to %" PRIu64 " (or -1 / random)\n",
                cmd, text, UINT64_MAX);
        return 2;
    }
    *has = true;
    *seed = (uint64_t)v;
    return 0;
}

int cli_repeated(int argc, char **argv, const char *flag, const char **out, int max)
{
    size_t fl = strlen(flag);
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        const char *v = NULL;
        if (!strcmp(argv[i], flag) && i + 1 < argc)
            v = argv[++i];
        else if (!strncmp(argv[i], flag, fl) && argv[i][fl] == '=')
            v = argv[i] + fl + 1;
        if (!v) continue;
        if (n == max) return -1;
        out[n++] = v;
    }
    return n;
}

void cli_endpoint(const char *in, char *out, size_t cap)
{
    if (in && !strstr(in, "://") && strchr(in, ':'))
        snprintf(out, cap, "tcp://%s", in);
    else
        snprintf(out, cap, "%s", in ? in : "");
}

const char *cli_endpoint_hint(const char *endpoint)
{
    if (!strstr(endpoint, "://"))
        return "an endpoint is tcp://HOST:PORT (e.g. tcp://127.0.0.1:7000) or ipc://PATH";
    if (!strncmp(endpoint, "tcp://", 6) && !strrchr(endpoint + 6, ':'))
        return "a tcp endpoint needs a port: tcp://HOST:PORT";
    if (!strncmp(endpoint, "tcp://", 6))
        return "HOST must be an IP address or a resolvable name, PORT a number (1-65535)";
    return "an endpoint is tcp://HOST:PORT or ipc://PATH";
}

const char *cli_env_deprecated(const char *cmd, const char *old, const char *now,
                               const char *prefix)
{
    const char *v = getenv(old);
    if (!v || !v[0] || (prefix && strncmp(v, prefix, strlen(prefix)))) return NULL;
    fprintf(stderr, "kvmesh %s: %s is deprecated here: set %s instead (docs/operations.md)\n", cmd,
            old, now);
    return v;
}
