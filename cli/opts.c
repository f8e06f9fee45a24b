/*
 * opts.c — the option plumbing every cluster subcommand shares: the project's option table
 * (common/svc.h: each flag has a KVMESH_ environment twin and --help lists them with defaults),
 * with -p, -n, -m, -r, -f as short forms of --prompt, --max-tokens, --model, --router, --file;
 * and reading a whole file (a prompt, a text to score).
 */
#include <errno.h>
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
