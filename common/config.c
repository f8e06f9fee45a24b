/*
 * config.c — the declarative option table every kvmesh program is configured through: command-
 * line flags, their KVMESH_* environment twins and an optional `name = value` config file, with
 * precedence flags > environment > file > default, and --help generated from the same table.
 *
 * Why it is built this way:
 *  - One table is the single source of truth: the parser, the environment names, the file keys
 *    and the help text all come from it, so an option cannot exist in one place and not another.
 *  - Values land in the program's own plain config struct through typed dest pointers (the
 *    llama2.c way: configuration is a struct), and strings are owned by the km_config.
 *  - Every value from every source is parsed and checked, even one a higher source overrides:
 *    a typo in the environment is an error now, not a surprise when the flag is dropped later.
 *  - Errors name where the bad value came from (--flag, env VAR, file:line).
 */
#include "common/svc.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern char **environ;

enum { SRC_UNSET = 0, SRC_DEFAULT, SRC_FILE, SRC_ENV, SRC_FLAG };
static const char *const src_names[] = {"unset", "default", "file", "env", "flag"};

#define MAX_FILE_BYTES (1u << 20)

struct km_config {
    const char *prog, *summary;
    const km_opt *opts;
    size_t n;
    char **env_names; /* [n] */
    char **strs;      /* [n] storage behind KM_OPT_STR dests */
    int *src;         /* [n] SRC_* */
    bool help;
    char **args; /* positional arguments (pointers into argv) */
    int n_args;
};

/* ---------------------------------------------------------------- value parsers */

static bool str_ieq(const char *a, const char *b)
{
    return strcasecmp(a, b) == 0;
}

int km_parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (str_ieq(s, yes[i])) return *out = true, 0;
        if (str_ieq(s, no[i])) return *out = false, 0;
    }
    return KM_EINVAL;
}

/* Splits "1.5M" into a non-negative number and its unit suffix; rejects signs, spaces and
 * exponents so that "1e3" and "-1" are not silently accepted. is_int tells whether the number
 * had no fraction, and then ival holds it exactly. */
static int split_number(const char *s, double *val, bool *is_int, uint64_t *ival, const char **unit)
{
    const char *p = s;
    if (!isdigit((unsigned char)*p) && *p != '.') return KM_EINVAL;
    while (isdigit((unsigned char)*p)) p++;
    bool frac = *p == '.';
    if (frac) {
        p++;
        if (!isdigit((unsigned char)*p)) return KM_EINVAL;
        while (isdigit((unsigned char)*p)) p++;
    }
    size_t n = (size_t)(p - s);
    char num[64];
    if (n >= sizeof num) return KM_ERANGE;
    memcpy(num, s, n);
    num[n] = '\0';
    errno = 0;
    *val = strtod(num, NULL);
    *is_int = !frac;
    if (!frac) {
        errno = 0;
        *ival = strtoull(num, NULL, 10);
        if (errno == ERANGE) return KM_ERANGE;
    }
    *unit = p;
    return 0;
}

int km_parse_size(const char *s, uint64_t *out)
{
    double v;
    bool is_int;
    uint64_t iv = 0;
    const char *u;
    int rc = split_number(s, &v, &is_int, &iv, &u);
    if (rc) return rc;
    int shift = 0;
    switch (toupper((unsigned char)*u)) {
    case 'K':
        shift = 10;
        break;
    case 'M':
        shift = 20;
        break;
    case 'G':
        shift = 30;
        break;
    case 'T':
        shift = 40;
        break;
    default:
        break;
    }
    if (shift) u++;
    if (str_ieq(u, "ib") && shift)
        u += 2;
    else if (str_ieq(u, "b"))
        u += 1;
    if (*u) return KM_EINVAL;
    if (is_int) {
        if (shift && iv > (UINT64_MAX >> shift)) return KM_ERANGE;
        *out = iv << shift;
        return 0;
    }
    double bytes = ldexp(v, shift);
    if (bytes >= 18446744073709551616.0) return KM_ERANGE;
    if (bytes != floor(bytes)) return KM_EINVAL; /* a fraction of a byte */
    *out = (uint64_t)bytes;
    return 0;
}

int km_parse_duration_ms(const char *s, int64_t *out)
{
    double v;
    bool is_int;
    uint64_t iv = 0;
    const char *u;
    int rc = split_number(s, &v, &is_int, &iv, &u);
    if (rc) return rc;
    double mul;
    if (*u == '\0' || strcmp(u, "ms") == 0)
        mul = 1;
    else if (strcmp(u, "s") == 0)
        mul = 1e3;
    else if (strcmp(u, "m") == 0)
        mul = 60e3;
    else if (strcmp(u, "h") == 0)
        mul = 3600e3;
    else
        return KM_EINVAL;
    double ms = v * mul;
    if (ms >= 9.2e18) return KM_ERANGE;
    if (ms != floor(ms)) return KM_EINVAL; /* a fraction of a millisecond */
    if (is_int && mul == 1) {
        if (iv > INT64_MAX) return KM_ERANGE;
        *out = (int64_t)iv;
    } else {
        *out = (int64_t)ms;
    }
    return 0;
}

static const char *type_word(km_opt_type t)
{
    switch (t) {
    case KM_OPT_STR:
        return "STR";
    case KM_OPT_INT:
        return "INT";
    case KM_OPT_FLOAT:
        return "NUM";
    case KM_OPT_BOOL:
        return "";
    case KM_OPT_SIZE:
        return "SIZE";
    case KM_OPT_DURATION:
        return "DURATION";
    }
    return "?";
}

static const char *type_hint(km_opt_type t)
{
    switch (t) {
    case KM_OPT_INT:
        return "an integer";
    case KM_OPT_FLOAT:
        return "a number";
    case KM_OPT_BOOL:
        return "true/false, yes/no, on/off or 1/0";
    case KM_OPT_SIZE:
        return "a size such as 512, 64K, 1.5M, 2G";
    case KM_OPT_DURATION:
        return "a duration such as 250ms, 2s, 1.5m, 1h (bare numbers are ms)";
    default:
        return "a string";
    }
}

/* Parses text for option i and stores it; `where` names the source in error messages. */
static int set_value(km_config *c, size_t i, const char *text, int src, const char *where,
                     km_errbuf *err)
{
    const km_opt *o = &c->opts[i];
    int rc = 0;
    double num = 0;
    switch (o->type) {
    case KM_OPT_STR: {
        char *dup = strdup(text);
        if (!dup) return km_errf(err, KM_ENOMEM, "%s: out of memory", where);
        free(c->strs[i]);
        c->strs[i] = dup;
        *(const char **)o->dest = dup;
        c->src[i] = src;
        return 0;
    }
    case KM_OPT_INT: {
        char *end;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (end == text || *end || isspace((unsigned char)*text))
            rc = KM_EINVAL;
        else if (errno == ERANGE)
            rc = KM_ERANGE;
        num = (double)v;
        if (!rc && o->min < o->max && (num < o->min || num > o->max)) rc = KM_ERANGE;
        if (!rc) *(int64_t *)o->dest = v;
        break;
    }
    case KM_OPT_FLOAT: {
        char *end;
        double v = strtod(text, &end);
        if (end == text || *end || isspace((unsigned char)*text) || !isfinite(v)) rc = KM_EINVAL;
        num = v;
        if (!rc && o->min < o->max && (num < o->min || num > o->max)) rc = KM_ERANGE;
        if (!rc) *(double *)o->dest = v;
        break;
    }
    case KM_OPT_BOOL: {
        bool v;
        rc = km_parse_bool(text, &v);
        if (!rc) *(bool *)o->dest = v;
        break;
    }
    case KM_OPT_SIZE: {
        uint64_t v;
        rc = km_parse_size(text, &v);
        num = (double)v;
        if (!rc && o->min < o->max && (num < o->min || num > o->max)) rc = KM_ERANGE;
        if (!rc) *(uint64_t *)o->dest = v;
        break;
    }
    case KM_OPT_DURATION: {
        int64_t v;
        rc = km_parse_duration_ms(text, &v);
        num = (double)v;
        if (!rc && o->min < o->max && (num < o->min || num > o->max)) rc = KM_ERANGE;
        if (!rc) *(int64_t *)o->dest = v;
        break;
    }
    }
    if (rc == KM_ERANGE && o->min < o->max)
        return km_errf(err, KM_ERANGE, "%s: '%s' is outside [%.15g, %.15g]", where, text, o->min,
                       o->max);
    if (rc == KM_ERANGE) return km_errf(err, KM_ERANGE, "%s: '%s' is out of range", where, text);
    if (rc) return km_errf(err, KM_EINVAL, "%s: '%s' is not %s", where, text, type_hint(o->type));
    c->src[i] = src;
    return 0;
}

/* ---------------------------------------------------------------- table */

static bool valid_name(const char *s)
{
    if (!s || !*s || *s == '-') return false;
    for (; *s; s++)
        if (!(islower((unsigned char)*s) || isdigit((unsigned char)*s) || *s == '-')) return false;
    return true;
}

void km_config_destroy(km_config *c)
{
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) {
        if (c->env_names) free(c->env_names[i]);
        if (c->strs) free(c->strs[i]);
    }
    free(c->env_names);
    free(c->strs);
    free(c->src);
    free(c->args);
    free(c);
}

int km_config_create(const char *prog, const char *summary, const km_opt *opts, size_t n_opts,
                     km_config **out, km_errbuf *err)
{
    *out = NULL;
    for (size_t i = 0; i < n_opts; i++) {
        const km_opt *o = &opts[i];
        if (!valid_name(o->name))
            return km_errf(err, KM_EINVAL, "option %zu: name '%s' must be lowercase [a-z0-9-]", i,
                           o->name ? o->name : "(null)");
        if (strcmp(o->name, "help") == 0 || strcmp(o->name, "config") == 0 ||
            strncmp(o->name, "no-", 3) == 0)
            return km_errf(err, KM_EINVAL, "option '%s': name is reserved", o->name);
        if (!o->dest || (unsigned)o->type > KM_OPT_DURATION)
            return km_errf(err, KM_EINVAL, "option '%s': no dest or bad type", o->name);
        for (size_t j = 0; j < i; j++)
            if (strcmp(opts[j].name, o->name) == 0)
                return km_errf(err, KM_EINVAL, "option '%s' is declared twice", o->name);
    }
    km_config *c = calloc(1, sizeof *c);
    if (!c) return km_errf(err, KM_ENOMEM, "config: out of memory");
    c->prog = prog ? prog : "kvmesh";
    c->summary = summary;
    c->opts = opts;
    c->n = n_opts;
    c->env_names = calloc(n_opts + 1, sizeof *c->env_names);
    c->strs = calloc(n_opts + 1, sizeof *c->strs);
    c->src = calloc(n_opts + 1, sizeof *c->src);
    if (!c->env_names || !c->strs || !c->src) {
        km_config_destroy(c);
        return km_errf(err, KM_ENOMEM, "config: out of memory");
    }
    for (size_t i = 0; i < n_opts; i++) {
        const char *name = opts[i].name;
        size_t len = opts[i].env ? strlen(opts[i].env) : 7 + strlen(name);
        char *e = malloc(len + 1);
        if (!e) {
            km_config_destroy(c);
            return km_errf(err, KM_ENOMEM, "config: out of memory");
        }
        if (opts[i].env) {
            memcpy(e, opts[i].env, len + 1);
        } else {
            memcpy(e, "KVMESH_", 7);
            for (size_t k = 0; name[k]; k++)
                e[7 + k] = name[k] == '-' ? '_' : (char)toupper((unsigned char)name[k]);
            e[len] = '\0';
        }
        c->env_names[i] = e;
    }
    /* A default that does not parse is a bug in the table: report it now. */
    for (size_t i = 0; i < n_opts; i++) {
        if (!opts[i].def) continue;
        char where[160];
        snprintf(where, sizeof where, "default of --%s", opts[i].name);
        int rc = set_value(c, i, opts[i].def, SRC_DEFAULT, where, err);
        if (rc) {
            km_config_destroy(c);
            return rc;
        }
    }
    *out = c;
    return 0;
}

/* The option whose name is s[0..len), accepting '_' for '-' (config files). */
static int find_opt(const km_config *c, const char *s, size_t len)
{
    for (size_t i = 0; i < c->n; i++) {
        const char *name = c->opts[i].name;
        if (strlen(name) != len) continue;
        size_t k = 0;
        while (k < len && (s[k] == name[k] || (s[k] == '_' && name[k] == '-'))) k++;
        if (k == len) return (int)i;
    }
    return -1;
}

/* ---------------------------------------------------------------- sources */

typedef struct flag_set {
    int opt;
    const char *value;
    const char *arg; /* as typed, for messages */
} flag_set;

static char *trim(char *s)
{
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
    return s;
}

static int read_file(km_config *c, const char *path, km_errbuf *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) return km_errf(err, KM_EIO, "config file %s: %s", path, strerror(errno));
    char *text = malloc(MAX_FILE_BYTES + 1);
    if (!text) {
        fclose(f);
        return km_errf(err, KM_ENOMEM, "config file %s: out of memory", path);
    }
    size_t n = fread(text, 1, MAX_FILE_BYTES + 1, f);
    int io_err = ferror(f);
    fclose(f);
    int rc = 0;
    if (io_err)
        rc = km_errf(err, KM_EIO, "config file %s: read error", path);
    else if (n > MAX_FILE_BYTES)
        rc = km_errf(err, KM_ERANGE, "config file %s: larger than %u bytes", path, MAX_FILE_BYTES);
    text[n < MAX_FILE_BYTES ? n : MAX_FILE_BYTES] = '\0';
    if (!rc && memchr(text, 0, n))
        rc = km_errf(err, KM_EFORMAT, "config file %s: contains a NUL byte", path);
    int line = 0;
    for (char *p = text; !rc && *p;) {
        char *nl = strchr(p, '\n');
        if (nl) *nl = '\0';
        line++;
        char *s = trim(p);
        p = nl ? nl + 1 : p + strlen(p);
        if (*s == '\0' || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            rc = km_errf(err, KM_EINVAL, "%s:%d: expected 'name = value'", path, line);
            break;
        }
        *eq = '\0';
        char *key = trim(s), *val = trim(eq + 1);
        size_t vl = strlen(val);
        if (vl >= 2 && val[0] == '"' && val[vl - 1] == '"') {
            val[vl - 1] = '\0';
            val++;
        }
        int i = find_opt(c, key, strlen(key));
        if (i < 0) {
            rc = km_errf(err, KM_EINVAL, "%s:%d: unknown option '%s'", path, line, key);
            break;
        }
        char where[300];
        snprintf(where, sizeof where, "%s:%d: %s", path, line, c->opts[i].name);
        rc = set_value(c, (size_t)i, val, SRC_FILE, where, err);
    }
    free(text);
    return rc;
}

static const char *env_lookup(char *const *envp, const char *name)
{
    size_t n = strlen(name);
    for (; envp && *envp; envp++)
        if (strncmp(*envp, name, n) == 0 && (*envp)[n] == '=') return *envp + n + 1;
    return NULL;
}

int km_config_parse(km_config *c, int argc, char *const *argv, char *const *envp, km_errbuf *err)
{
    if (!envp) envp = environ;
    c->help = false;
    free(c->args);
    c->args = NULL;
    c->n_args = 0;
    flag_set *sets = calloc((size_t)(argc > 0 ? argc : 1), sizeof *sets);
    c->args = calloc((size_t)(argc > 0 ? argc : 1), sizeof *c->args);
    if (!sets || !c->args) {
        free(sets);
        return km_errf(err, KM_ENOMEM, "config: out of memory");
    }
    int n_sets = 0, rc = 0;
    const char *config_path = NULL;
    bool only_args = false;

    /* 1. Read the command line into a list (applied last, so it wins). */
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a];
        if (only_args || arg[0] != '-' || arg[1] == '\0') {
            c->args[c->n_args++] = (char *)arg;
            continue;
        }
        if (strcmp(arg, "--") == 0) {
            only_args = true;
            continue;
        }
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            c->help = true;
            continue;
        }
        if (arg[1] != '-') {
            if (!rc) rc = km_errf(err, KM_EINVAL, "unknown option %s (see --help)", arg);
            continue;
        }
        const char *name = arg + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const char *value = eq ? eq + 1 : NULL;
        if (len == 6 && strncmp(name, "config", 6) == 0) {
            if (!value && a + 1 < argc) value = argv[++a];
            if (!value) {
                if (!rc) rc = km_errf(err, KM_EINVAL, "--config needs a file name");
                continue;
            }
            config_path = value;
            continue;
        }
        int i = -1;
        for (size_t k = 0; k < c->n; k++)
            if (strlen(c->opts[k].name) == len && strncmp(c->opts[k].name, name, len) == 0)
                i = (int)k;
        if (i < 0 && !eq && len > 3 && strncmp(name, "no-", 3) == 0) {
            for (size_t k = 0; k < c->n; k++)
                if (c->opts[k].type == KM_OPT_BOOL && strcmp(c->opts[k].name, name + 3) == 0)
                    i = (int)k;
            if (i >= 0) value = "false";
        }
        if (i < 0) {
            if (!rc)
                rc = km_errf(err, KM_EINVAL, "unknown option --%.*s (see --help)", (int)len, name);
            continue;
        }
        if (!value) {
            if (c->opts[i].type == KM_OPT_BOOL) {
                value = "true";
            } else if (a + 1 < argc) {
                value = argv[++a];
            } else {
                if (!rc) rc = km_errf(err, KM_EINVAL, "--%s needs a value", c->opts[i].name);
                continue;
            }
        }
        sets[n_sets++] = (flag_set){i, value, arg};
    }
    if (c->help) { /* --help wins over every other problem */
        free(sets);
        return 0;
    }
    if (rc) goto out;

    /* 2. Defaults (re-applied, so a second parse starts clean). */
    for (size_t i = 0; i < c->n; i++) {
        c->src[i] = SRC_UNSET;
        if (c->opts[i].type == KM_OPT_STR && !c->opts[i].def) {
            free(c->strs[i]);
            c->strs[i] = NULL;
            *(const char **)c->opts[i].dest = NULL;
        }
        if (c->opts[i].def) {
            rc = set_value(c, i, c->opts[i].def, SRC_DEFAULT, c->opts[i].name, err);
            if (rc) goto out;
        }
    }
    /* 3. The config file. */
    if (!config_path) config_path = env_lookup(envp, "KVMESH_CONFIG");
    if (config_path && *config_path) {
        rc = read_file(c, config_path, err);
        if (rc) goto out;
    }
    /* 4. The environment (an empty variable counts as unset). */
    for (size_t i = 0; i < c->n; i++) {
        const char *v = env_lookup(envp, c->env_names[i]);
        if (!v || !*v) continue;
        char where[160];
        snprintf(where, sizeof where, "env %s", c->env_names[i]);
        rc = set_value(c, i, v, SRC_ENV, where, err);
        if (rc) goto out;
    }
    /* 5. The flags, in order: the last one of a name wins. */
    for (int k = 0; k < n_sets; k++) {
        char where[160];
        snprintf(where, sizeof where, "--%s", c->opts[sets[k].opt].name);
        rc = set_value(c, (size_t)sets[k].opt, sets[k].value, SRC_FLAG, where, err);
        if (rc) goto out;
    }
out:
    free(sets);
    return rc;
}

bool km_config_help_requested(const km_config *c)
{
    return c->help;
}

const char *km_config_source(const km_config *c, const char *name)
{
    int i = find_opt(c, name, strlen(name));
    return i < 0 ? NULL : src_names[c->src[i]];
}

char *const *km_config_args(const km_config *c, int *n)
{
    if (n) *n = c->n_args;
    return c->args;
}

int km_config_help(const km_config *c, km_buf *out)
{
    int rc = km_buf_printf(out, "usage: %s [options]\n", c->prog);
    if (!rc && c->summary) rc = km_buf_printf(out, "\n%s\n", c->summary);
    if (!rc) rc = km_buf_printf(out, "\noptions:\n");
    /* the left column: "--name TYPE" or "--[no-]name" */
    int width = 24;
    for (size_t i = 0; i < c->n; i++) {
        const km_opt *o = &c->opts[i];
        int w = (int)(2 + strlen(o->name) +
                      (o->type == KM_OPT_BOOL ? 5 : 1 + strlen(type_word(o->type))));
        if (w + 2 > width && w + 2 <= 40) width = w + 2;
    }
    for (size_t i = 0; !rc && i < c->n; i++) {
        const km_opt *o = &c->opts[i];
        char left[160];
        if (o->type == KM_OPT_BOOL)
            snprintf(left, sizeof left, "--[no-]%s", o->name);
        else
            snprintf(left, sizeof left, "--%s %s", o->name, type_word(o->type));
        rc = km_buf_printf(out, "  %-*s %s", width, left, o->help ? o->help : "");
        if (!rc && o->def)
            rc = km_buf_printf(out, " (default: %s; env %s)\n", o->def, c->env_names[i]);
        else if (!rc)
            rc = km_buf_printf(out, " (env %s)\n", c->env_names[i]);
    }
    if (!rc)
        rc = km_buf_printf(out, "  %-*s %s\n", width, "--config FILE",
                           "read options from FILE, 'name = value' lines (env KVMESH_CONFIG)");
    if (!rc) rc = km_buf_printf(out, "  %-*s %s\n", width, "-h, --help", "show this help and exit");
    if (!rc)
        rc = km_buf_printf(out, "\nprecedence: flags > environment > config file > defaults\n");
    return rc;
}

int km_daemon_config(const char *prog, const char *summary, const km_opt *opts, size_t n_opts,
                     int argc, char *const *argv, const char *const *log_level,
                     const char *const *log_format, km_config **out)
{
    *out = NULL;
    km_errbuf err = {{0}};
    km_config *cfg = NULL;
    if (km_config_create(prog, summary, opts, n_opts, &cfg, &err) ||
        km_config_parse(cfg, argc, argv, NULL, &err)) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        km_config_destroy(cfg);
        return 2;
    }
    if (km_config_help_requested(cfg)) {
        km_buf h = {0};
        km_config_help(cfg, &h);
        fwrite(h.data, 1, h.len, stdout);
        km_buf_free(&h);
        km_config_destroy(cfg);
        return 1;
    }
    km_log_level lvl = KM_LOG_INFO;
    if ((log_level && km_log_parse_level(*log_level, &lvl)) ||
        (log_format && km_log_set_format(*log_format))) {
        fprintf(stderr, "%s: bad --log-level or --log-format\n", prog);
        km_config_destroy(cfg);
        return 2;
    }
    if (log_level) km_log_set_level(lvl);
    *out = cfg;
    return 0;
}

void km_daemon_signals(void (*on_stop)(int))
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}
