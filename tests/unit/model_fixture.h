/*
 * model_fixture.h — the default model loaded once per suite, for the engine suites that run it
 * (test_engine_blend, test_engine_sparse, test_scheduler_blend): `TestSuite(x, .init = setup,
 * .fini = teardown)`; g_model stays NULL, and each test skips, where `make deps` has not run.
 */
#ifndef KM_TEST_MODEL_FIXTURE_H
#define KM_TEST_MODEL_FIXTURE_H

#include <criterion/criterion.h>
#include <unistd.h>

#include "engine/engine.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static en_model *g_model;

static void setup(void)
{
    if (access(MODEL, R_OK)) return;
    km_errbuf err = {{0}};
    cr_assert_eq(en_model_load(MODEL, &g_model, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    en_model_free(g_model);
    g_model = NULL;
}

#endif /* KM_TEST_MODEL_FIXTURE_H */
