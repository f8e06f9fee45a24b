/*
 * criterion.h (tests/tsan) — a stand-in for Criterion's header in the ThreadSanitizer build
 * (make unit-tests-tsan). Criterion runs each test in a forked sandbox whose shared arena cannot
 * be set up under ThreadSanitizer (Snaipe/Criterion#274: "Could not initialize inheritable
 * arena"), so the threaded unit tests are compiled as they are against this header instead
 * (-Itests/tsan comes before the system's) and linked with runner.c: the tests of a binary run
 * one after the other in one process, each with the suite's init and fini around it and an
 * alarm as its timeout; a failed assertion prints where and what, and the binary exits 1.
 *
 * Only what the threaded tests use is here: Test, TestSuite (.init, .fini, .timeout, .disabled),
 * cr_assert and its _not/_eq/_neq/_lt/_leq/_gt/_geq/_null/_not_null/_str_eq/_float_eq/_arr_eq
 * forms, cr_assert_fail, cr_skip_test, cr_log_info/_warn/_error. A test that uses more fails to
 * build in the TSan run, which is the place to add it.
 */
#ifndef KM_TSAN_CRITERION_H
#define KM_TSAN_CRITERION_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct crs_extra {
    int _first; /* so that an empty option list still makes a valid initializer */
    void (*init)(void);
    void (*fini)(void);
    int timeout; /* seconds; 0: the runner's default */
    bool disabled;
    const char *description;
};

void crs_register(const char *suite, const char *name, void (*fn)(void),
                  const struct crs_extra *extra);
void crs_register_suite(const char *suite, const struct crs_extra *extra);
void crs_fail(const char *file, int line, const char *expr, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 4, 5)));
void crs_skip(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
void crs_log(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define CRS_CAT_(a, b) a##b
#define CRS_CAT(a, b)  CRS_CAT_(a, b)

#define Test(suite, name, ...)                                                                     \
    static void suite##_##name##_impl(void);                                                       \
    static const struct crs_extra suite##_##name##_extra = {0, __VA_ARGS__};                       \
    __attribute__((constructor)) static void suite##_##name##_reg(void)                            \
    {                                                                                              \
        crs_register(#suite, #name, suite##_##name##_impl, &suite##_##name##_extra);               \
    }                                                                                              \
    static void suite##_##name##_impl(void)

#define TestSuite(suite, ...)                                                                      \
    static const struct crs_extra suite##_crs_suite_extra = {0, __VA_ARGS__};                      \
    __attribute__((constructor)) static void suite##_crs_suite_reg(void)                           \
    {                                                                                              \
        crs_register_suite(#suite, &suite##_crs_suite_extra);                                      \
    }

/* `" " __VA_ARGS__`: the optional message is a format string literal and its arguments. */
#define cr_assert(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) crs_fail(__FILE__, __LINE__, #cond, " " __VA_ARGS__);                         \
    } while (0)
#define cr_assert_fail(...)         crs_fail(__FILE__, __LINE__, "fail", " " __VA_ARGS__)
#define cr_assert_not(cond, ...)    cr_assert(!(cond), __VA_ARGS__)
#define cr_assert_eq(a, b, ...)     cr_assert((a) == (b), __VA_ARGS__)
#define cr_assert_neq(a, b, ...)    cr_assert((a) != (b), __VA_ARGS__)
#define cr_assert_lt(a, b, ...)     cr_assert((a) < (b), __VA_ARGS__)
#define cr_assert_leq(a, b, ...)    cr_assert((a) <= (b), __VA_ARGS__)
#define cr_assert_gt(a, b, ...)     cr_assert((a) > (b), __VA_ARGS__)
#define cr_assert_geq(a, b, ...)    cr_assert((a) >= (b), __VA_ARGS__)
#define cr_assert_null(a, ...)      cr_assert((a) == NULL, __VA_ARGS__)
#define cr_assert_not_null(a, ...)  cr_assert((a) != NULL, __VA_ARGS__)
#define cr_assert_str_eq(a, b, ...) cr_assert(strcmp((a), (b)) == 0, __VA_ARGS__)
#define cr_assert_float_eq(a, b, eps, ...)                                                         \
    cr_assert(fabs((double)(a) - (double)(b)) <= (eps), __VA_ARGS__)
#define cr_assert_arr_eq(a, b, size, ...) cr_assert(memcmp((a), (b), (size)) == 0, __VA_ARGS__)
#define cr_skip_test(...)                 crs_skip(" " __VA_ARGS__)
#define cr_log_info(...)                  crs_log("info", __VA_ARGS__)
#define cr_log_warn(...)                  crs_log("warn", __VA_ARGS__)
#define cr_log_error(...)                 crs_log("error", __VA_ARGS__)

#endif
