/*
 * main.c — the `kvmesh` command: one table from subcommand to the file that implements it
 * (cli/cli.h lists them). Local engine commands load the model in-process; cluster commands go
 * through a router or the controller with libkvmesh; operator commands start and test clusters.
 */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *what;
} commands[] = {
    {"run", cli_cmd_run, "generate from a prompt with the local engine"},
    {"perplexity", cli_cmd_perplexity, "perplexity of a text file (llama.cpp's method)"},
    {"bench", cli_cmd_bench, "engine speed: prefill and decode at several batch sizes"},
    {"tokenize", cli_cmd_tokenize, "print the token ids of a text"},
    {"sparse-calibrate", cli_cmd_sparse_calibrate,
     "sparse attention budgets per (layer, kv head) from a text"},
    {"generate", cli_cmd_generate, "stream a completion from the cluster"},
    {"chat", cli_cmd_chat, "interactive chat through the cluster"},
    {"status", cli_cmd_status,
     "workers, KV usage per tier, hit ratio (--controller: member\n"
     "                   states, recovery levels, pressure, recovery history)"},
    {"recover", cli_cmd_recover, "force a recovery level on a worker, through the controller"},
    {"role", cli_cmd_role, "change a running worker's role: both, prefill or decode"},
    {"up", cli_cmd_up, "start a controller, N workers and a router on loopback"},
    {"scale", cli_cmd_scale, "add or remove workers of a running `kvmesh up` (drained)"},
    {"chaos", cli_cmd_chaos, "fault-injection scenarios against a local cluster"},
    {"keys", cli_cmd_keys, "cluster keys (CURVE certificates with roles) and HTTP API keys"},
};
#define N_COMMANDS (sizeof commands / sizeof *commands)

static void usage(void)
{
    printf("usage: kvmesh COMMAND [options]\n\ncommands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++) {
        if (i == 5) printf("cluster commands (through a router):\n");
        printf("  %-16s %s\n", commands[i].name, commands[i].what);
    }
    printf("\n`kvmesh COMMAND --help` lists the command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "help")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "kvmesh: unknown command '%s' (kvmesh --help lists them)\n", argv[1]);
    return 2;
}
