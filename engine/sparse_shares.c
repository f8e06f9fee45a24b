/*
 * sparse_shares.c — the reader of sparse attention budget-shares files (docs/sparse.md "Per-head
 * budgets"): a few lines an operator may edit by hand, so every line is checked against the
 * model's shape and every share against its range, and an error names the line. Kept apart from
 * the engine so that its fuzz target (tests/fuzz/fuzz_sparse_shares.c) links it alone.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

#define EN_SHARES_MAGIC "kvmesh-sparse-shares"
#define EN_SHARES_MAX   1e6

/* Parses one share: a finite number in [0, EN_SHARES_MAX]. */
static int en_share_num(const char *tok, float *out)
{
    char *end;
    errno = 0;
    const double v = strtod(tok, &end);
    if (end == tok || *end || errno || !isfinite(v) || v < 0 || v > EN_SHARES_MAX) return -1;
    *out = (float)v;
    return 0;
}

/* Parses one line's words (comments stripped) into the state; 0 or KM_EINVAL with err. */
static int en_shares_line(char *line, int ln, int *stage, int n_layers, int n_head_kv,
                          float *shares, uint8_t *seen, km_errbuf *err)
{
    char *save = NULL, *w = strtok_r(line, " \t\r", &save);
    if (!w) return 0;
    if (*stage == 0) {
        const char *ver = strtok_r(NULL, " \t\r", &save);
        if (strcmp(w, EN_SHARES_MAGIC) || !ver || strcmp(ver, "1") ||
            strtok_r(NULL, " \t\r", &save))
            return km_errf(err, KM_EINVAL, "line %d: expected `" EN_SHARES_MAGIC " 1` first", ln);
        *stage = 1;
        return 0;
    }
    if (*stage == 1) {
        const char *a = strtok_r(NULL, " \t\r", &save), *b = strtok_r(NULL, " \t\r", &save);
        if (strcmp(w, "shape") || !a || !b || strtok_r(NULL, " \t\r", &save))
            return km_errf(err, KM_EINVAL, "line %d: expected `shape LAYERS KV_HEADS`", ln);
        if (atoi(a) != n_layers || atoi(b) != n_head_kv || strspn(a, "0123456789") != strlen(a) ||
            strspn(b, "0123456789") != strlen(b))
            return km_errf(err, KM_EINVAL,
                           "line %d: shape %s x %s, but the model has %d layers x %d kv heads", ln,
                           a, b, n_layers, n_head_kv);
        *stage = 2;
        return 0;
    }
    const char *ls = strtok_r(NULL, " \t\r", &save);
    char *end = NULL;
    const long l = ls ? strtol(ls, &end, 10) : -1;
    if (strcmp(w, "layer") || !ls || *end || l < 0 || l >= n_layers)
        return km_errf(err, KM_EINVAL, "line %d: expected `layer L SHARE...` with L < %d", ln,
                       n_layers);
    if (seen[l]) return km_errf(err, KM_EINVAL, "line %d: layer %ld given twice", ln, l);
    seen[l] = 1;
    for (int h = 0; h < n_head_kv; h++) {
        const char *t = strtok_r(NULL, " \t\r", &save);
        if (!t) return km_errf(err, KM_EINVAL, "line %d: %d shares, not %d", ln, h, n_head_kv);
        if (en_share_num(t, &shares[l * n_head_kv + h]))
            return km_errf(err, KM_EINVAL, "line %d: share `%s` is not a number in [0, %g]", ln, t,
                           EN_SHARES_MAX);
    }
    if (strtok_r(NULL, " \t\r", &save))
        return km_errf(err, KM_EINVAL, "line %d: more than %d shares", ln, n_head_kv);
    return 0;
}

int en_sparse_shares_parse(const char *text, size_t len, int n_layers, int n_head_kv, float *shares,
                           km_errbuf *err)
{
    char line[1024];
    int stage = 0, ln = 0, rc = 0;
    uint8_t *seen = calloc((size_t)(n_layers > 0 ? n_layers : 1), 1);
    if (!seen) return km_errf(err, KM_ENOMEM, "out of memory");
    for (size_t at = 0; at < len && !rc;) {
        size_t e = at;
        while (e < len && text[e] != '\n') e++;
        ln++;
        const size_t n = e - at;
        if (n >= sizeof line) {
            rc = km_errf(err, KM_EINVAL, "line %d: longer than %zu bytes", ln, sizeof line - 1);
            break;
        }
        memcpy(line, text + at, n);
        line[n] = 0;
        at = e + 1;
        if (memchr(line, 0, n)) rc = km_errf(err, KM_EINVAL, "line %d: a NUL byte", ln);
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        if (!rc) rc = en_shares_line(line, ln, &stage, n_layers, n_head_kv, shares, seen, err);
    }
    double sum = 0;
    if (!rc && stage < 2) rc = km_errf(err, KM_EINVAL, "no `shape` line: not a shares file");
    for (int l = 0; !rc && l < n_layers; l++) {
        if (!seen[l]) rc = km_errf(err, KM_EINVAL, "layer %d has no shares (`layer %d ...`)", l, l);
        for (int h = 0; !rc && h < n_head_kv; h++) sum += shares[l * n_head_kv + h];
    }
    if (!rc && !(sum > 0)) rc = km_errf(err, KM_EINVAL, "every share is 0");
    free(seen);
    return rc;
}
