/*
 * test_kernel_bounds.c — under SAN=1, a kernel handed a buffer too small for what its contract
 * lets it touch ends the process with AddressSanitizer's report, although the SAN tree builds the
 * SIMD kernels without ASan's instrumentation: tests/san/kernel_bounds.c checks the caller's
 * buffers at the call (the Makefile's KERNELS_WRAP). Each overrun test expects ASan's exit status
 * and fails if the call returns. Without ASan (the plain build) there is nothing to test.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kernels/kernels.h"

#ifdef __SANITIZE_ADDRESS__

/* The best table, or a skip where it is the scalar one (not built apart, so not wrapped). */
static const kn_ops *simd_ops(void)
{
    const kn_ops *o = kn_ops_best();
    if (o->isa == KN_ISA_SCALAR) cr_skip_test("no SIMD table on this CPU");
    return o;
}

/* ASan's report is expected: it goes to /dev/null rather than into the suite's log. */
static void quiet(void)
{
    FILE *null = fopen("/dev/null", "w");
    if (null) dup2(fileno(null), 2);
}

Test(kernel_bounds, rmsnorm_within_its_buffers_runs)
{
    const kn_ops *o = simd_ops();
    enum { n = 100 };
    float *x = calloc(n, 4), *w = calloc(n, 4), *y = calloc(n, 4);
    for (int i = 0; i < n; i++) x[i] = w[i] = 1.0f;
    o->rmsnorm(y, x, w, n, 1e-5f);
    cr_assert_float_eq(y[n - 1], 1.0f, 1e-3f);
    free(x), free(w), free(y);
}

Test(kernel_bounds, rmsnorm_into_an_output_one_float_short_is_reported, .exit_code = 1)
{
    const kn_ops *o = simd_ops();
    enum { n = 100 };
    float *x = calloc(n, 4), *w = calloc(n, 4), *y = calloc(n - 1, 4);
    quiet();
    o->rmsnorm(y, x, w, n, 1e-5f);
    cr_assert_fail("rmsnorm wrote %d floats into %d without a report", n, n - 1);
}

Test(kernel_bounds, matmul_reading_past_its_activations_is_reported, .exit_code = 1)
{
    const kn_ops *o = simd_ops();
    enum { k = 64, rows = 16, m = 2 };
    float *w = calloc(rows * k, 4), *y = calloc(m * rows, 4);
    float *x = calloc(m * k - 1, 4); /* the second row is one float short */
    quiet();
    o->matmul(MD_TYPE_F32, w, k * 4, x, k * 4, k, m, y, rows, 0, rows);
    cr_assert_fail("matmul read %d floats of %d without a report", m * k, m * k - 1);
}

#else

Test(kernel_bounds, needs_address_sanitizer)
{
    cr_skip_test("only under SAN=1: make build/san/tests/test_kernel_bounds");
}

#endif
