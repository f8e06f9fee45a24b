/*
 * test_config.c — the option table: defaults, the four sources and their precedence (flags > env
 * > file > default), every flag spelling, the size/duration/bool parsers, errors that name where a
 * bad value came from, positional arguments, and the exact --help text.
 */
#include "common/svc.h"

#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct cfg {
    const char *model;
    const char *salt;
    int64_t port;
    double temp;
    bool stream;
    uint64_t kv_bytes;
    int64_t hb_ms;
} cfg;

static cfg C;

static const km_opt OPTS[] = {
    {"model", NULL, KM_OPT_STR, "models/smol.gguf", "GGUF file to serve", &C.model, 0, 0},
    {"cache-salt", NULL, KM_OPT_STR, NULL, "tenant salt", &C.salt, 0, 0},
    {"admin-port", NULL, KM_OPT_INT, "9100", "admin HTTP port", &C.port, 0, 65535},
    {"temperature", "KM_TEMP", KM_OPT_FLOAT, "0.8", "sampling temperature", &C.temp, 0, 0},
    {"stream", NULL, KM_OPT_BOOL, "false", "stream tokens", &C.stream, 0, 0},
    {"kv-bytes", NULL, KM_OPT_SIZE, "256M", "KV budget", &C.kv_bytes, 0, 0},
    {"heartbeat", NULL, KM_OPT_DURATION, "1s", "heartbeat interval", &C.hb_ms, 0, 0},
};
#define N_OPTS (sizeof OPTS / sizeof OPTS[0])

static km_config *make(void)
{
    memset(&C, 0, sizeof C);
    km_config *c = NULL;
    km_errbuf err = {{0}};
    int rc = km_config_create("kvmesh-test", "A test program.", OPTS, N_OPTS, &c, &err);
    cr_assert_eq(rc, 0, "%s", err.msg);
    return c;
}

static int parse(km_config *c, char *const *argv, char *const *envp, km_errbuf *err)
{
    int argc = 0;
    while (argv[argc]) argc++;
    return km_config_parse(c, argc, argv, envp, err);
}

static char *const NOENV[] = {NULL};

static char *write_file(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kvmesh-test-config-%d.conf", (int)getpid());
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

Test(config, defaults_fill_every_dest_when_nothing_is_given)
{
    km_config *c = make();
    char *argv[] = {"prog", NULL};
    km_errbuf err = {{0}};
    cr_assert_eq(parse(c, argv, NOENV, &err), 0, "%s", err.msg);
    cr_assert_str_eq(C.model, "models/smol.gguf");
    cr_assert_null(C.salt);
    cr_assert_eq(C.port, 9100);
    cr_assert_eq(C.temp, 0.8);
    cr_assert(!C.stream);
    cr_assert_eq(C.kv_bytes, 256u << 20);
    cr_assert_eq(C.hb_ms, 1000);
    cr_assert_str_eq(km_config_source(c, "admin-port"), "default");
    cr_assert_str_eq(km_config_source(c, "cache-salt"), "unset");
    cr_assert_null(km_config_source(c, "nope"));
    cr_assert(!km_config_help_requested(c));
    km_config_destroy(c);
}

Test(config, flags_beat_env_beat_file_beat_defaults)
{
    char *path = write_file("# a comment\n"
                            "admin-port = 9200\n"
                            "temperature = 0.5\n"
                            "kv_bytes = \"1G\"\n"
                            "\n"
                            "  heartbeat=250ms  \n");
    km_config *c = make();
    char cfgarg[128];
    snprintf(cfgarg, sizeof cfgarg, "--config=%s", path);
    char *argv[] = {"prog", cfgarg, "--admin-port", "9400", NULL};
    char *envp[] = {"KVMESH_ADMIN_PORT=9300", "KM_TEMP=0.25", "PATH=/bin", NULL};
    km_errbuf err = {{0}};
    cr_assert_eq(parse(c, argv, envp, &err), 0, "%s", err.msg);
    cr_assert_eq(C.port, 9400);
    cr_assert_str_eq(km_config_source(c, "admin-port"), "flag");
    cr_assert_eq(C.temp, 0.25);
    cr_assert_str_eq(km_config_source(c, "temperature"), "env");
    cr_assert_eq(C.kv_bytes, 1u << 30);
    cr_assert_str_eq(km_config_source(c, "kv-bytes"), "file");
    cr_assert_eq(C.hb_ms, 250);
    cr_assert_str_eq(C.model, "models/smol.gguf");
    cr_assert_str_eq(km_config_source(c, "model"), "default");
    km_config_destroy(c);
    unlink(path);
}

Test(config, the_config_file_can_come_from_the_environment)
{
    char *path = write_file("model = /srv/m.gguf\n");
    char env[128];
    snprintf(env, sizeof env, "KVMESH_CONFIG=%s", path);
    km_config *c = make();
    char *argv[] = {"prog", NULL};
    char *envp[] = {env, NULL};
    km_errbuf err = {{0}};
    cr_assert_eq(parse(c, argv, envp, &err), 0, "%s", err.msg);
    cr_assert_str_eq(C.model, "/srv/m.gguf");
    km_config_destroy(c);
    unlink(path);
}

Test(config, every_flag_spelling_works)
{
    km_config *c = make();
    char *argv[] = {"prog",           "--model=/a.gguf", "--cache-salt", "t1", "--stream",
                    "--kv-bytes=64K", "--heartbeat",     "2s",           NULL};
    km_errbuf err = {{0}};
    cr_assert_eq(parse(c, argv, NOENV, &err), 0, "%s", err.msg);
    cr_assert_str_eq(C.model, "/a.gguf");
    cr_assert_str_eq(C.salt, "t1");
    cr_assert(C.stream);
    cr_assert_eq(C.kv_bytes, 65536);
    cr_assert_eq(C.hb_ms, 2000);

    char *argv2[] = {"prog", "--stream", "--no-stream", NULL};
    cr_assert_eq(parse(c, argv2, NOENV, &err), 0, "%s", err.msg);
    cr_assert(!C.stream, "the last flag wins");
    cr_assert_null(C.salt, "a second parse starts from the defaults");
    char *argv3[] = {"prog", "--stream=yes", NULL};
    cr_assert_eq(parse(c, argv3, NOENV, &err), 0, "%s", err.msg);
    cr_assert(C.stream);
    km_config_destroy(c);
}

Test(config, positional_arguments_and_double_dash_are_kept)
{
    km_config *c = make();
    char *argv[] = {"prog", "serve", "--admin-port", "1", "-", "--", "--not-a-flag", NULL};
    km_errbuf err = {{0}};
    cr_assert_eq(parse(c, argv, NOENV, &err), 0, "%s", err.msg);
    int n = 0;
    char *const *args = km_config_args(c, &n);
    cr_assert_eq(n, 3);
    cr_assert_str_eq(args[0], "serve");
    cr_assert_str_eq(args[1], "-");
    cr_assert_str_eq(args[2], "--not-a-flag");
    km_config_destroy(c);
}

Test(config, errors_name_the_option_and_where_the_value_came_from)
{
    km_config *c = make();
    km_errbuf err = {{0}};
    char *a1[] = {"prog", "--admin-prot", "1", NULL};
    cr_assert_eq(parse(c, a1, NOENV, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "unknown option --admin-prot (see --help)");

    char *a2[] = {"prog", "--admin-port", "http", NULL};
    cr_assert_eq(parse(c, a2, NOENV, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "--admin-port: 'http' is not an integer");

    char *a3[] = {"prog", "--admin-port", "70000", NULL};
    cr_assert_eq(parse(c, a3, NOENV, &err), KM_ERANGE);
    cr_assert_str_eq(err.msg, "--admin-port: '70000' is outside [0, 65535]");

    char *a4[] = {"prog", "--model", NULL};
    cr_assert_eq(parse(c, a4, NOENV, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "--model needs a value");

    char *a5[] = {"prog", "-x", NULL};
    cr_assert_eq(parse(c, a5, NOENV, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "unknown option -x (see --help)");

    char *argv[] = {"prog", NULL};
    char *env[] = {"KVMESH_KV_BYTES=12Q", NULL};
    cr_assert_eq(parse(c, argv, env, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg,
                     "env KVMESH_KV_BYTES: '12Q' is not a size such as 512, 64K, 1.5M, 2G");

    char *path = write_file("model = x\nbogus = 1\n");
    char cfgarg[128];
    snprintf(cfgarg, sizeof cfgarg, "--config=%s", path);
    char *a6[] = {"prog", cfgarg, NULL};
    cr_assert_eq(parse(c, a6, NOENV, &err), KM_EINVAL);
    char want[256];
    snprintf(want, sizeof want, "%s:2: unknown option 'bogus'", path);
    cr_assert_str_eq(err.msg, want);

    write_file("stream = maybe\n");
    cr_assert_eq(parse(c, a6, NOENV, &err), KM_EINVAL);
    snprintf(want, sizeof want, "%s:1: stream: 'maybe' is not true/false, yes/no, on/off or 1/0",
             path);
    cr_assert_str_eq(err.msg, want);

    write_file("just words\n");
    cr_assert_eq(parse(c, a6, NOENV, &err), KM_EINVAL);
    snprintf(want, sizeof want, "%s:1: expected 'name = value'", path);
    cr_assert_str_eq(err.msg, want);
    unlink(path);

    char *a7[] = {"prog", "--config=/nonexistent/kvmesh.conf", NULL};
    cr_assert_eq(parse(c, a7, NOENV, &err), KM_EIO);
    cr_assert(strstr(err.msg, "/nonexistent/kvmesh.conf"), "%s", err.msg);
    km_config_destroy(c);
}

Test(config, help_is_reported_even_next_to_bad_options)
{
    km_config *c = make();
    char *argv[] = {"prog", "--bogus", "--help", NULL};
    km_errbuf err = {{0}};
    cr_assert_eq(parse(c, argv, NOENV, &err), 0);
    cr_assert(km_config_help_requested(c));
    char *argv2[] = {"prog", "-h", NULL};
    cr_assert_eq(parse(c, argv2, NOENV, &err), 0);
    cr_assert(km_config_help_requested(c));
    km_config_destroy(c);
}

Test(config, help_text_lists_every_option_with_default_and_env)
{
    km_config *c = make();
    km_buf b = {0};
    cr_assert_eq(km_config_help(c, &b), 0);
    cr_assert_eq(km_buf_append(&b, "", 1), 0);
    const char *want =
        "usage: kvmesh-test [options]\n"
        "\n"
        "A test program.\n"
        "\n"
        "options:\n"
        "  --model STR              GGUF file to serve (default: models/smol.gguf; env "
        "KVMESH_MODEL)\n"
        "  --cache-salt STR         tenant salt (env KVMESH_CACHE_SALT)\n"
        "  --admin-port INT         admin HTTP port (default: 9100; env KVMESH_ADMIN_PORT)\n"
        "  --temperature NUM        sampling temperature (default: 0.8; env KM_TEMP)\n"
        "  --[no-]stream            stream tokens (default: false; env KVMESH_STREAM)\n"
        "  --kv-bytes SIZE          KV budget (default: 256M; env KVMESH_KV_BYTES)\n"
        "  --heartbeat DURATION     heartbeat interval (default: 1s; env KVMESH_HEARTBEAT)\n"
        "  --config FILE            read options from FILE, 'name = value' lines (env "
        "KVMESH_CONFIG)\n"
        "  -h, --help               show this help and exit\n"
        "\n"
        "precedence: flags > environment > config file > defaults\n";
    cr_assert_str_eq((char *)b.data, want);
    km_buf_free(&b);
    km_config_destroy(c);
}

Test(config, sizes_parse_with_binary_suffixes)
{
    struct {
        const char *s;
        uint64_t v;
    } ok[] = {{"0", 0},           {"512", 512},   {"512B", 512},     {"64K", 65536},
              {"64k", 65536},     {"4KiB", 4096}, {"1.5M", 1572864}, {"2G", 2ull << 30},
              {"1T", 1ull << 40}, {"16EiB", 0},   {"0.5K", 512},     {"3MB", 3u << 20}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        uint64_t v = 1;
        int rc = km_parse_size(ok[i].s, &v);
        if (strcmp(ok[i].s, "16EiB") == 0) {
            cr_assert_eq(rc, KM_EINVAL, "no E suffix");
            continue;
        }
        cr_assert_eq(rc, 0, "%s", ok[i].s);
        cr_assert_eq(v, ok[i].v, "%s -> %llu", ok[i].s, (unsigned long long)v);
    }
    const char *bad[] = {"", "K", "-1", "1.5", "12Q", " 5", "5 ", "1e3", "1.M", "99999999999T"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t v;
        cr_assert_lt(km_parse_size(bad[i], &v), 0, "'%s' parsed", bad[i]);
    }
    uint64_t v;
    cr_assert_eq(km_parse_size("18446744073709551615", &v), 0);
    cr_assert_eq(v, UINT64_MAX);
    cr_assert_eq(km_parse_size("18446744073709551616", &v), KM_ERANGE);
}

Test(config, durations_parse_to_milliseconds)
{
    struct {
        const char *s;
        int64_t ms;
    } ok[] = {{"0", 0},       {"42", 42},      {"250ms", 250},  {"2s", 2000},
              {"1.5s", 1500}, {"1.5m", 90000}, {"1h", 3600000}, {"0.001s", 1}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        int64_t v = -1;
        cr_assert_eq(km_parse_duration_ms(ok[i].s, &v), 0, "%s", ok[i].s);
        cr_assert_eq(v, ok[i].ms, "%s -> %lld", ok[i].s, (long long)v);
    }
    const char *bad[] = {"", "s", "-1s", "5x", "1.5", "0.0001s", "2 s", "1d"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int64_t v;
        cr_assert_lt(km_parse_duration_ms(bad[i], &v), 0, "'%s' parsed", bad[i]);
    }
}

Test(config, bools_accept_the_usual_words)
{
    const char *t[] = {"1", "true", "TRUE", "yes", "on"};
    const char *f[] = {"0", "false", "No", "off"};
    bool v;
    for (int i = 0; i < 5; i++) cr_assert(km_parse_bool(t[i], &v) == 0 && v, "%s", t[i]);
    for (int i = 0; i < 4; i++) cr_assert(km_parse_bool(f[i], &v) == 0 && !v, "%s", f[i]);
    cr_assert_eq(km_parse_bool("2", &v), KM_EINVAL);
    cr_assert_eq(km_parse_bool("", &v), KM_EINVAL);
}

Test(config, bad_tables_are_refused_at_create)
{
    int64_t x;
    km_config *c = NULL;
    km_errbuf err = {{0}};
    km_opt dup[] = {{"a", NULL, KM_OPT_INT, "1", "", &x, 0, 0},
                    {"a", NULL, KM_OPT_INT, "1", "", &x, 0, 0}};
    cr_assert_eq(km_config_create("p", NULL, dup, 2, &c, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "option 'a' is declared twice");
    km_opt baddef[] = {{"n", NULL, KM_OPT_INT, "ten", "", &x, 0, 0}};
    cr_assert_eq(km_config_create("p", NULL, baddef, 1, &c, &err), KM_EINVAL);
    cr_assert_str_eq(err.msg, "default of --n: 'ten' is not an integer");
    km_opt upper[] = {{"Name", NULL, KM_OPT_INT, NULL, "", &x, 0, 0}};
    cr_assert_eq(km_config_create("p", NULL, upper, 1, &c, &err), KM_EINVAL);
    km_opt reserved[] = {{"help", NULL, KM_OPT_BOOL, NULL, "", &x, 0, 0}};
    cr_assert_eq(km_config_create("p", NULL, reserved, 1, &c, &err), KM_EINVAL);
    cr_assert_null(c);
}

Test(config, empty_environment_values_count_as_unset)
{
    km_config *c = make();
    char *argv[] = {"prog", NULL};
    char *env[] = {"KVMESH_ADMIN_PORT=", NULL};
    km_errbuf err = {{0}};
    cr_assert_eq(parse(c, argv, env, &err), 0, "%s", err.msg);
    cr_assert_eq(C.port, 9100);
    km_config_destroy(c);
}

Test(config, daemon_config_parses_prints_help_and_refuses_bad_log_options,
     .init = cr_redirect_stdout)
{
    const char *lvl = NULL, *fmt = NULL;
    int64_t n = 0;
    km_opt opts[] = {{"n", "KVMESH_TEST_DAEMON_N", KM_OPT_INT, "3", "a number", &n, 0, 10},
                     {"log-level", "KVMESH_TEST_DAEMON_LL", KM_OPT_STR, "info", "", &lvl, 0, 0},
                     {"log-format", "KVMESH_TEST_DAEMON_LF", KM_OPT_STR, "text", "", &fmt, 0, 0}};
    km_config *c = NULL;
    char *ok[] = {"d", "--n", "7", NULL};
    cr_assert_eq(km_daemon_config("d", "s", opts, 3, 3, ok, &lvl, &fmt, &c), 0);
    cr_assert_eq(n, 7);
    km_config_destroy(c);
    char *help[] = {"d", "--help", NULL};
    cr_assert_eq(km_daemon_config("d", "s", opts, 3, 2, help, &lvl, &fmt, &c), 1);
    cr_assert_null(c);
    char *bad[] = {"d", "--n", "11", NULL};
    cr_assert_eq(km_daemon_config("d", "s", opts, 3, 3, bad, &lvl, &fmt, &c), 2);
    char *badlog[] = {"d", "--log-level", "loud", NULL};
    cr_assert_eq(km_daemon_config("d", "s", opts, 3, 3, badlog, &lvl, &fmt, &c), 2);
    cr_assert_null(c);
}
