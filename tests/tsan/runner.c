/*
 * runner.c — the test runner of the ThreadSanitizer build (tests/tsan/criterion/criterion.h says
 * why it is not Criterion's): runs every registered test of the binary in one process, in the
 * order they were registered, with its suite's init and fini around it and SIGALRM as its
 * timeout (4 times the test's, else the suite's, else 300 s: ThreadSanitizer is slow). Prints a
 * line per test and a summary like Criterion's; stops at the first failure and exits 1 (the
 * failed test may have left threads running). `--filter SUITE/NAME` (a prefix, with
 * `*` allowed at its end) runs some of them.
 */
#include <criterion/criterion.h>

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <unistd.h>

#define CRS_MAX 512

typedef struct crs_test {
    const char *suite, *name;
    void (*fn)(void);
    const struct crs_extra *extra;
} crs_test;

typedef struct crs_suite {
    const char *name;
    const struct crs_extra *extra;
} crs_suite;

static crs_test g_tests[CRS_MAX];
static int g_n_tests;
static crs_suite g_suites[64];
static int g_n_suites;
static sigjmp_buf g_jmp;
static const crs_test *g_current;

void crs_register(const char *suite, const char *name, void (*fn)(void),
                  const struct crs_extra *extra)
{
    if (g_n_tests < CRS_MAX) g_tests[g_n_tests++] = (crs_test){suite, name, fn, extra};
}

void crs_register_suite(const char *suite, const struct crs_extra *extra)
{
    if (g_n_suites < 64) g_suites[g_n_suites++] = (crs_suite){suite, extra};
}

void crs_fail(const char *file, int line, const char *expr, const char *fmt, ...)
{
    fprintf(stderr, "[----] %s:%d: Assertion Failed: %s\n[----]  ", file, line, expr);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    siglongjmp(g_jmp, 1);
}

void crs_skip(const char *fmt, ...)
{
    fprintf(stderr, "[SKIP] %s::%s: ", g_current->suite, g_current->name);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    siglongjmp(g_jmp, 2);
}

void crs_log(const char *level, const char *fmt, ...)
{
    fprintf(stderr, "[%s] ", level);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static void crs_timeout(int sig)
{
    (void)sig;
    static const char msg[] = "[----] the test ran past its timeout\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(1); /* nothing is safe to run after a hung test */
}

static const struct crs_extra *crs_suite_extra(const char *suite)
{
    for (int i = 0; i < g_n_suites; i++)
        if (!strcmp(g_suites[i].name, suite)) return g_suites[i].extra;
    return NULL;
}

/* Runs g_current with its inits: 0 when it returned, 1 when an assertion failed, 2 skipped. */
static int crs_call(const struct crs_extra *se)
{
    static const struct crs_extra *suite; /* static: not clobbered by the longjmp */
    suite = se;
    int r = sigsetjmp(g_jmp, 1);
    if (r == 0) {
        if (suite && suite->init) suite->init();
        if (g_current->extra->init) g_current->extra->init();
        g_current->fn();
    }
    return r;
}

static bool crs_selected(const crs_test *t, const char *filter)
{
    if (!filter) return true;
    char full[512];
    snprintf(full, sizeof full, "%s/%s", t->suite, t->name);
    size_t n = strlen(filter);
    if (n && filter[n - 1] == '*') return !strncmp(full, filter, n - 1);
    return !strcmp(full, filter);
}

int main(int argc, char **argv)
{
    const char *filter = NULL;
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--filter") && i + 1 < argc)
            filter = argv[++i];
        else if (!strncmp(argv[i], "--filter=", 9))
            filter = argv[i] + 9;
        /* Criterion's other options (--jobs ...) mean nothing here */
    }
    signal(SIGALRM, crs_timeout);
    for (int i = 0; i < g_n_tests && !failed; i++) {
        const crs_test *t = &g_tests[i];
        const struct crs_extra *se = crs_suite_extra(t->suite);
        if (!crs_selected(t, filter) || t->extra->disabled || (se && se->disabled)) continue;
        int timeout = t->extra->timeout ? t->extra->timeout : se && se->timeout ? se->timeout : 300;
        g_current = t;
        fprintf(stderr, "[RUN ] %s::%s\n", t->suite, t->name);
        alarm((unsigned)timeout * 4); /* ThreadSanitizer slows tests several-fold */
        int r = crs_call(se);
        if (r != 1) {
            if (t->extra->fini) t->extra->fini();
            if (se && se->fini) se->fini();
        }
        alarm(0);
        if (r == 1) {
            failed++;
            fprintf(stderr, "[FAIL] %s::%s\n", t->suite, t->name);
        } else if (r == 2) {
            skipped++;
        } else {
            passed++;
            fprintf(stderr, "[PASS] %s::%s\n", t->suite, t->name);
        }
    }
    fprintf(stderr, "[====] Synthesis: Tested: %d | Passing: %d | Failing: %d | Skipped: %d\n",
            passed + failed, passed, failed, skipped);
    return failed ? 1 : 0;
}
