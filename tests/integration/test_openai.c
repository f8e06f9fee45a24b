/*
 * test_openai.c — the OpenAI front's fields and small endpoints, through kvmesh-router in front of
 * a real kvmesh-worker on 127.0.0.1, driven by curl as a client would: /health, /tokenize and
 * /detokenize in vLLM's shapes; CORS preflights for the configured origin only; logprobs of
 * greedy tokens equal to the engine's own log-softmax (the test loads the model itself and runs
 * the same tokens); echo, logit_bias, prompts as token ids, several prompts and n choices (seeded
 * choices reproducible), streamed and not; echo with logprobs (the prompt's tokens' equal to the
 * engine's too); what the server refuses (suffix, too many choices) answered 400 naming the field;
 * ZeroMQ clients' logprobs and logit_bias; tests/openai_sdk.py, the official Python SDK unchanged,
 * when python3 has the `openai` package.
 *
 * Run from the repository root after `make build`; without the default model or curl every test
 * skips and says so. The worker runs one thread: the machine is small and shared.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/sec.h"
#include "engine/engine.h"
#include "tests/integration/harness.h"

typedef it_proc proc;

static proc g_w, g_r;
static char g_base[64], g_body[128];

/* One worker and a router in front of it (extra router flags NULL-terminated), or false
 * (skipped) without the model, the binaries or curl. */
static bool cluster(const char **extra)
{
    if (!it_have_curl() || !it_router_http_start(&g_r, &g_w, 1, 1, "oai", extra)) return false;
    snprintf(g_base, sizeof g_base, "http://127.0.0.1:%d", g_r.http_port);
    snprintf(g_body, sizeof g_body, "%s/body.json", g_r.dir);
    return true;
}

static void stop_cluster(void)
{
    it_stop(&g_r);
    it_stop(&g_w);
}

/* POSTs body to path; the response body (malloc'd), *status its HTTP status. */
static char *post(const char *path, const char *body, int *status)
{
    FILE *f = fopen(g_body, "w");
    cr_assert_not_null(f);
    fputs(body, f);
    fclose(f);
    char url[256];
    snprintf(url, sizeof url, "%s%s", g_base, path);
    return it_curl_post(url, g_body, 120, status);
}

/* POSTs body and parses the 200 JSON answer. */
static json_t *post_json(const char *path, const char *body)
{
    int st;
    char *out = post(path, body, &st);
    cr_assert_eq(st, 200, "%s: %d %s", path, st, out);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert_not_null(o, "%s", out);
    free(out);
    return o;
}

/* POSTs body, expects 400 naming param; returns nothing. */
static void expect_400(const char *path, const char *body, const char *param)
{
    int st;
    char *out = post(path, body, &st);
    cr_assert_eq(st, 400, "%s: %d %s", body, st, out);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert_not_null(o, "%s", out);
    json_t *e = json_object_get(o, "error");
    cr_assert_str_eq(json_string_value(json_object_get(e, "param")), param, "%s", out);
    json_decref(o);
    free(out);
}

static json_t *choice(json_t *o, size_t i)
{
    return json_array_get(json_object_get(o, "choices"), i);
}

static const char *choice_text(json_t *o, size_t i)
{
    json_t *c = choice(o, i);
    json_t *t = json_object_get(c, "text");
    return t ? json_string_value(t)
             : json_string_value(json_object_get(json_object_get(c, "message"), "content"));
}

TestSuite(openai, .fini = it_kill_all, .timeout = 300);

Test(openai, health_tokenize_detokenize_and_cors_preflights)
{
    const char *extra[] = {"--cors-origins=https://app.example, https://other.example", NULL};
    if (!cluster(extra)) return;
    char out[64];
    cr_assert_eq(it_http_get(g_r.http_port, "/health", out, sizeof out), 200);

    json_t *t = post_json("/tokenize", "{\"prompt\":\"Hello world\",\"return_token_strs\":true}");
    cr_assert_eq(json_integer_value(json_object_get(t, "count")), 2);
    cr_assert_eq(json_integer_value(json_object_get(t, "max_model_len")), 4096);
    json_t *strs = json_object_get(t, "token_strs");
    cr_assert_str_eq(json_string_value(json_array_get(strs, 1)), " world");
    char body[256];
    snprintf(body, sizeof body, "{\"tokens\":[%lld,%lld]}",
             json_integer_value(json_array_get(json_object_get(t, "tokens"), 0)),
             json_integer_value(json_array_get(json_object_get(t, "tokens"), 1)));
    json_decref(t);
    json_t *d = post_json("/detokenize", body);
    cr_assert_str_eq(json_string_value(json_object_get(d, "prompt")), "Hello world");
    json_decref(d);
    /* a chat is rendered with the template: more tokens than its text, ending in the
     * assistant's header */
    t = post_json("/tokenize", "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}");
    cr_assert_gt(json_integer_value(json_object_get(t, "count")), 5);
    json_decref(t);
    expect_400("/detokenize", "{\"tokens\":[99999999]}", "tokens");
    expect_400("/tokenize", "{\"prompt\":[1,2]}", "prompt");

    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "curl -si -X OPTIONS %s/v1/chat/completions -H 'Origin: https://other.example' "
             "-H 'Access-Control-Request-Method: POST' "
             "-H 'Access-Control-Request-Headers: authorization, content-type'",
             g_base);
    char *o = it_stdout(cmd);
    cr_assert(strstr(o, "HTTP/1.1 200"), "%s", o);
    cr_assert(strstr(o, "Access-Control-Allow-Origin: https://other.example\r\n"), "%s", o);
    cr_assert(strstr(o, "Access-Control-Allow-Methods: GET, POST, OPTIONS"), "%s", o);
    cr_assert(strstr(o, "Access-Control-Allow-Headers: authorization, content-type"), "%s", o);
    free(o);
    snprintf(cmd, sizeof cmd,
             "curl -si -X OPTIONS %s/v1/chat/completions -H 'Origin: https://evil.example' "
             "-H 'Access-Control-Request-Method: POST'",
             g_base);
    o = it_stdout(cmd);
    cr_assert(strstr(o, "HTTP/1.1 405"), "another origin gets no preflight: %s", o);
    cr_assert_null(strstr(o, "Access-Control-Allow-Origin"), "%s", o);
    free(o);
    /* the real request from the allowed origin carries the header too, streamed or not */
    snprintf(cmd, sizeof cmd,
             "curl -si %s/v1/completions -H 'Origin: https://app.example' -d "
             "'{\"prompt\":\"Hi\",\"max_tokens\":1,\"stream\":true}'",
             g_base);
    o = it_stdout(cmd);
    cr_assert(strstr(o, "Access-Control-Allow-Origin: https://app.example\r\n"), "%s", o);
    cr_assert(strstr(o, "data: [DONE]"), "%s", o);
    free(o);
    stop_cluster();
}

Test(openai, with_api_keys_health_and_preflights_need_none_tokenize_needs_one)
{
    char dir[] = "/tmp/kvmesh-oaikeys-XXXXXX", path[128], key[128], flag[160];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/api_keys", dir);
    km_errbuf err = {{0}};
    cr_assert_eq(km_apikeys_add(path, "acme", KM_ROLE_CLIENT, NULL, key, sizeof key, &err), 0, "%s",
                 err.msg);
    snprintf(flag, sizeof flag, "--api-keys=%s", path);
    const char *extra[] = {flag, "--cors-origins=*", NULL};
    if (!cluster(extra)) return;
    char cmd[768];
    snprintf(cmd, sizeof cmd,
             "curl -s -o /dev/null -w '%%{http_code} ' %s/health; "
             "curl -s -o /dev/null -w '%%{http_code} ' %s/tokenize -d '{\"prompt\":\"a\"}'; "
             "curl -s -o /dev/null -w '%%{http_code} ' -H 'Authorization: Bearer %s' "
             "%s/tokenize -d '{\"prompt\":\"a\"}'; "
             "curl -s -o /dev/null -w '%%{http_code}' -X OPTIONS -H 'Origin: https://x.example' "
             "-H 'Access-Control-Request-Method: POST' %s/v1/completions",
             g_base, g_base, key, g_base, g_base);
    char *o = it_stdout(cmd);
    cr_assert_str_eq(o, "200 401 200 200", "health, tokenize keyless, keyed, preflight: %s", o);
    free(o);
    stop_cluster();
    unlink(path);
    rmdir(dir);
}

Test(openai, cors_is_off_by_default)
{
    if (!cluster(NULL)) return;
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "curl -si -X OPTIONS %s/v1/completions -H 'Origin: https://app.example' "
             "-H 'Access-Control-Request-Method: POST'",
             g_base);
    char *o = it_stdout(cmd);
    cr_assert(strstr(o, "HTTP/1.1 405"), "%s", o);
    cr_assert_null(strstr(o, "Access-Control"), "%s", o);
    free(o);
    stop_cluster();
}

/* The engine's own log-softmax of each token of ids[n_prompt..n) after the ones before it: the
 * test loads the model and runs them, token by token after the prompt. */
static void engine_logprobs(const int32_t *ids, int n_prompt, int n, double *out)
{
    en_model *m = NULL;
    en_engine *e = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(en_model_load(IT_MODEL, &m, &err), 0, "%s", err.msg);
    en_engine_opts o = {.n_threads = 1, .max_batch_tokens = 512};
    cr_assert_eq(en_engine_create(m, &o, &e, &err), 0, "%s", err.msg);
    int nv = en_model_hparams(m)->n_vocab;
    kv_store *kv = en_engine_kv(e);
    kv_seq *s;
    kv_seq_create(kv, &s);
    int32_t pos[512];
    kv_seq *seqs[512];
    cr_assert_lt(n, 512);
    for (int i = 0; i < n; i++) pos[i] = i, seqs[i] = s;
    const float *lg;
    en_batch b = {.n_tokens = n_prompt, .tokens = ids, .pos = pos, .seqs = seqs};
    cr_assert_eq(en_engine_step(e, &b, &lg), 1);
    for (int i = n_prompt; i < n; i++) {
        out[i - n_prompt] = -en_token_nll(lg, nv, ids[i]);
        cr_assert_eq(en_argmax(lg, nv), ids[i], "token %d is not the greedy one", i);
        en_batch one = {.n_tokens = 1, .tokens = &ids[i], .pos = &pos[i], .seqs = &seqs[i]};
        cr_assert_eq(en_engine_step(e, &one, &lg), 1);
    }
    kv_seq_destroy(kv, s);
    en_engine_destroy(e);
    en_model_free(m);
}

/* The engine's own log-softmax of each prompt token ids[1..n) after the ones before it (one
 * forward with logits at every position). */
static void engine_prompt_logprobs(const int32_t *ids, int n, double *out)
{
    en_model *m = NULL;
    en_engine *e = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(en_model_load(IT_MODEL, &m, &err), 0, "%s", err.msg);
    en_engine_opts o = {.n_threads = 1, .max_batch_tokens = 64};
    cr_assert_eq(en_engine_create(m, &o, &e, &err), 0, "%s", err.msg);
    int nv = en_model_hparams(m)->n_vocab;
    kv_seq *s;
    kv_seq_create(en_engine_kv(e), &s);
    int32_t pos[64];
    kv_seq *seqs[64];
    uint8_t want[64];
    cr_assert_lt(n, 64);
    for (int i = 0; i < n; i++) pos[i] = i, seqs[i] = s, want[i] = i + 1 < n;
    const float *lg;
    en_batch b = {.n_tokens = n, .tokens = ids, .pos = pos, .seqs = seqs, .logits = want};
    cr_assert_eq(en_engine_step(e, &b, &lg), n - 1);
    for (int i = 1; i < n; i++) out[i] = -en_token_nll(lg + (size_t)(i - 1) * nv, nv, ids[i]);
    kv_seq_destroy(en_engine_kv(e), s);
    en_engine_destroy(e);
    en_model_free(m);
}

Test(openai, logprobs_of_greedy_tokens_equal_the_engines_own_log_softmax)
{
    if (!cluster(NULL)) return;
    json_t *t = post_json("/tokenize", "{\"prompt\":\"The capital of France is\"}");
    json_t *pt = json_object_get(t, "tokens");
    int np = (int)json_array_size(pt);
    int32_t ids[64];
    km_buf body = {0};
    km_buf_printf(&body, "{\"prompt\":[");
    for (int i = 0; i < np; i++) {
        ids[i] = (int32_t)json_integer_value(json_array_get(pt, i));
        km_buf_printf(&body, "%s%d", i ? "," : "", ids[i]);
    }
    json_decref(t);
    km_buf_printf(&body, "],\"max_tokens\":8,\"temperature\":0,\"logprobs\":5}");
    json_t *o = post_json("/v1/completions", (const char *)body.data);
    km_buf_free(&body);
    json_t *lp = json_object_get(choice(o, 0), "logprobs");
    json_t *toks = json_object_get(lp, "tokens"), *lps = json_object_get(lp, "token_logprobs");
    json_t *tops = json_object_get(lp, "top_logprobs");
    int ng = (int)json_array_size(lps);
    cr_assert_eq(ng, 8, "%d logprobs", ng);
    /* the generated ids: the router's own /tokenize of the text would merge pieces, so each
     * token's text is looked up through /tokenize one by one (each is one vocabulary entry) */
    for (int i = 0; i < ng; i++) {
        char b[600];
        json_t *piece = json_array_get(toks, (size_t)i);
        char *js = json_dumps(piece, JSON_ENCODE_ANY);
        snprintf(b, sizeof b, "{\"prompt\":%s,\"add_special_tokens\":false}", js);
        free(js);
        json_t *one = post_json("/tokenize", b);
        cr_assert_eq(json_integer_value(json_object_get(one, "count")), 1, "%s", b);
        ids[np + i] =
            (int32_t)json_integer_value(json_array_get(json_object_get(one, "tokens"), 0));
        json_decref(one);
        /* greedy: the chosen token is the most likely one, and top lists 5 */
        json_t *top = json_array_get(tops, (size_t)i);
        cr_assert_eq(json_object_size(top), 5);
        double best = -INFINITY;
        const char *k;
        json_t *v;
        json_object_foreach(top, k, v) best = fmax(best, json_real_value(v));
        cr_assert_float_eq(best, json_real_value(json_array_get(lps, (size_t)i)), 1e-6);
    }
    double want[16];
    engine_logprobs(ids, np, np + ng, want);
    for (int i = 0; i < ng; i++) {
        double got = json_real_value(json_array_get(lps, (size_t)i));
        cr_assert(fabs(got - want[i]) < 1e-4, "token %d: logprob %.6f, the engine's %.6f", i, got,
                  want[i]);
    }
    json_decref(o);

    /* echo with logprobs: the prompt's tokens first, the first without one (null), the others
     * the engine's own log-softmax given the tokens before; streamed, in the first chunk */
    double pwant[64];
    engine_prompt_logprobs(ids, np, pwant);
    for (int stream = 0; stream < 2; stream++) {
        km_buf eb = {0};
        km_buf_printf(&eb, "{\"prompt\":[");
        for (int i = 0; i < np; i++) km_buf_printf(&eb, "%s%d", i ? "," : "", ids[i]);
        km_buf_printf(&eb, "],\"max_tokens\":2,\"temperature\":0,\"logprobs\":2,\"echo\":true%s}",
                      stream ? ",\"stream\":true" : "");
        int est;
        char *raw = post("/v1/completions", (const char *)eb.data, &est);
        km_buf_free(&eb);
        cr_assert_eq(est, 200, "%s", raw);
        const char *js = stream ? strstr(raw, "data: {") : raw;
        cr_assert_not_null(js, "%s", raw);
        json_t *eo = json_loads(stream ? js + 6 : js, JSON_DISABLE_EOF_CHECK, NULL);
        json_t *elp = json_object_get(choice(eo, 0), "logprobs");
        json_t *elps = json_object_get(elp, "token_logprobs");
        cr_assert_geq((int)json_array_size(elps), np, "%s", raw);
        cr_assert(json_is_null(json_array_get(elps, 0)), "%s", raw);
        cr_assert(json_is_null(json_array_get(json_object_get(elp, "top_logprobs"), 0)));
        cr_assert_eq(json_integer_value(json_array_get(json_object_get(elp, "text_offset"), 0)), 0);
        for (int i = 1; i < np; i++) {
            double got = json_real_value(json_array_get(elps, (size_t)i));
            cr_assert(fabs(got - pwant[i]) < 1e-3, "prompt token %d: %.6f, the engine's %.6f", i,
                      got, pwant[i]);
        }
        if (!stream) /* then the completion's own, as without echo */
            cr_assert_float_eq(json_real_value(json_array_get(elps, (size_t)np)), want[0], 1e-4);
        json_decref(eo);
        free(raw);
    }

    /* chat, streamed: every content chunk carries its token's entry */
    int st;
    char *s = post("/v1/chat/completions",
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"}],\"max_tokens\":4,"
                   "\"temperature\":0,\"logprobs\":true,\"top_logprobs\":3,\"stream\":true}",
                   &st);
    cr_assert_eq(st, 200, "%s", s);
    int entries = 0;
    for (char *p = strstr(s, "\"top_logprobs\":["); p; p = strstr(p + 1, "\"top_logprobs\":["))
        entries++;
    cr_assert_eq(entries, 4, "%s", s);
    cr_assert(strstr(s, "\"bytes\":["), "%s", s);
    free(s);
    stop_cluster();
}

Test(openai, echo_logit_bias_token_prompts_and_refusals)
{
    if (!cluster(NULL)) return;
    json_t *a = post_json("/v1/completions", "{\"prompt\":\"The capital of France is\","
                                             "\"max_tokens\":3,\"temperature\":0}");
    const char *plain = choice_text(a, 0);
    cr_assert(strstr(plain, "Paris"), "%s", plain);
    /* echo: the prompt's text first; the same with the prompt as token ids */
    json_t *e = post_json("/v1/completions", "{\"prompt\":\"The capital of France is\","
                                             "\"max_tokens\":3,\"temperature\":0,\"echo\":true}");
    char want[256];
    snprintf(want, sizeof want, "The capital of France is%s", plain);
    cr_assert_str_eq(choice_text(e, 0), want);
    json_decref(e);
    json_t *t = post_json("/tokenize", "{\"prompt\":\"The capital of France is\"}");
    char *ids = json_dumps(json_object_get(t, "tokens"), 0);
    json_decref(t);
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\":%s,\"max_tokens\":3,\"temperature\":0,\"echo\":true}",
             ids);
    e = post_json("/v1/completions", body);
    cr_assert_str_eq(choice_text(e, 0), want);
    json_decref(e);
    /* streamed echo: the prompt is the first chunk */
    int st;
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"max_tokens\":2,\"temperature\":0,\"echo\":true,\"stream\":true}",
             ids);
    char *s = post("/v1/completions", body, &st);
    cr_assert(strstr(s, "\"text\":\"The capital of France is\""), "%s", s);
    free(s);
    /* logit_bias -100 on the greedy first token: another one comes first */
    snprintf(body, sizeof body,
             "{\"prompt\":\"The capital of France is\",\"max_tokens\":1,"
             "\"temperature\":0,\"logprobs\":0}");
    json_t *one = post_json("/v1/completions", body);
    json_t *first =
        json_array_get(json_object_get(json_object_get(choice(one, 0), "logprobs"), "tokens"), 0);
    char *fj = json_dumps(first, JSON_ENCODE_ANY);
    snprintf(body, sizeof body, "{\"prompt\":%s,\"add_special_tokens\":false}", fj);
    free(fj);
    json_t *ft = post_json("/tokenize", body);
    long long fid = json_integer_value(json_array_get(json_object_get(ft, "tokens"), 0));
    json_decref(ft);
    snprintf(body, sizeof body,
             "{\"prompt\":\"The capital of France is\",\"max_tokens\":1,\"temperature\":0,"
             "\"logit_bias\":{\"%lld\":-100}}",
             fid);
    json_t *b = post_json("/v1/completions", body);
    cr_assert_str_neq(choice_text(b, 0), choice_text(one, 0), "the bias did not move the pick");
    json_decref(b);
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"}],\"max_tokens\":1,"
             "\"temperature\":0,\"logit_bias\":{\"%lld\":100}}",
             fid);
    b = post_json("/v1/chat/completions", body);
    cr_assert_str_eq(choice_text(b, 0), choice_text(one, 0), "+100 forces the token");
    json_decref(b);
    json_decref(one);
    free(ids);

    expect_400("/v1/completions", "{\"prompt\":\"x\",\"suffix\":\"y\"}", "suffix");
    expect_400("/v1/completions", "{\"prompt\":\"x\",\"logit_bias\":{\"99999999\":1}}",
               "logit_bias");
    expect_400("/v1/completions", "{\"prompt\":[99999999]}", "prompt");
    json_decref(a);
    stop_cluster();
}

/* The texts of o's choices, joined by '|' (malloc'd). */
static char *texts(json_t *o)
{
    km_buf b = {0};
    for (size_t i = 0; i < json_array_size(json_object_get(o, "choices")); i++) {
        cr_assert_eq(json_integer_value(json_object_get(choice(o, i), "index")), (json_int_t)i);
        km_buf_printf(&b, "%s%s", i ? "|" : "", choice_text(o, i));
    }
    km_buf_append(&b, "", 1);
    return (char *)b.data;
}

Test(openai, n_choices_and_prompt_lists_streamed_and_not_seeded_reproducibly)
{
    const char *extra[] = {"--max-n=6", NULL};
    if (!cluster(extra)) return;
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":6,\"temperature\":1,"
                       "\"seed\":11,\"n\":3}";
    json_t *a = post_json("/v1/completions", body), *b = post_json("/v1/completions", body);
    cr_assert_eq(json_array_size(json_object_get(a, "choices")), 3);
    char *ta = texts(a), *tb = texts(b);
    cr_assert_str_eq(ta, tb, "seeded choices are reproducible");
    /* the choices draw differently (seed + index): not all three the same */
    json_t *u = json_object_get(a, "usage");
    cr_assert_eq(json_integer_value(json_object_get(u, "completion_tokens")), 18);
    json_t *one = post_json("/tokenize", "{\"prompt\":\"Once upon a time\"}");
    cr_assert_eq(json_integer_value(json_object_get(u, "prompt_tokens")),
                 json_integer_value(json_object_get(one, "count")), "the prompt counts once");
    json_decref(one);
    cr_assert(strcmp(choice_text(a, 0), choice_text(a, 1)) ||
                  strcmp(choice_text(a, 1), choice_text(a, 2)),
              "%s", ta);
    free(ta);
    free(tb);
    json_decref(a);
    json_decref(b);

    /* several prompts, strings and token ids, each n times, in order prompt-major */
    a = post_json("/v1/completions", "{\"prompt\":[\"The capital of France is\",\"Hello\"],"
                                     "\"max_tokens\":3,\"temperature\":0,\"n\":2,\"echo\":true}");
    cr_assert_eq(json_array_size(json_object_get(a, "choices")), 4);
    cr_assert_str_eq(choice_text(a, 0), choice_text(a, 1), "greedy choices agree");
    cr_assert(!strncmp(choice_text(a, 1), "The capital of France is", 24), "%s", choice_text(a, 1));
    cr_assert(!strncmp(choice_text(a, 2), "Hello", 5), "%s", choice_text(a, 2));
    json_t *t = post_json("/tokenize", "{\"prompt\":\"Hello\"}");
    char *ids = json_dumps(json_object_get(t, "tokens"), 0);
    json_decref(t);
    char req[512];
    snprintf(req, sizeof req,
             "{\"prompt\":[%s,%s],\"max_tokens\":3,\"temperature\":0,\"echo\":true}", ids, ids);
    free(ids);
    b = post_json("/v1/completions", req);
    cr_assert_eq(json_array_size(json_object_get(b, "choices")), 2);
    cr_assert_str_eq(choice_text(b, 1), choice_text(a, 2), "token ids give what text gives");
    json_decref(a);
    json_decref(b);

    /* a chat streamed with n = 2: every choice has its role chunk, its tokens and its finish,
     * and one usage chunk and one [DONE] end the stream */
    int st;
    char *s =
        post("/v1/chat/completions",
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":3,"
             "\"n\":2,\"seed\":5,\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
             &st);
    cr_assert_eq(st, 200, "%s", s);
    int roles[2] = {0}, finishes[2] = {0}, usage = 0, done = 0;
    for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "data: [DONE]", 12)) {
            done++;
            continue;
        }
        if (strncmp(line, "data: ", 6)) continue;
        json_t *o = json_loads(line + 6, 0, NULL);
        cr_assert_not_null(o, "%s", line);
        if (json_object_get(o, "usage")) usage++;
        json_t *c = choice(o, 0);
        if (c) {
            int i = (int)json_integer_value(json_object_get(c, "index"));
            cr_assert(i == 0 || i == 1, "%s", line);
            roles[i] += json_object_get(json_object_get(c, "delta"), "role") != NULL;
            finishes[i] += json_is_string(json_object_get(c, "finish_reason"));
        }
        json_decref(o);
    }
    free(s);
    cr_assert(roles[0] == 1 && roles[1] == 1 && finishes[0] == 1 && finishes[1] == 1);
    cr_assert(usage == 1 && done == 1);

    /* over --max-n: 400 naming n */
    expect_400("/v1/completions", "{\"prompt\":[\"a\",\"b\"],\"n\":4}", "n");
    expect_400("/v1/completions", "{\"prompt\":[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\"]}",
               "prompt");
    /* a failing choice fails the response once: a prompt over the context in a list */
    km_buf big = {0};
    km_buf_printf(&big, "{\"prompt\":[\"short\",\"");
    for (int i = 0; i < 5000; i++) km_buf_printf(&big, "word ");
    km_buf_printf(&big, "\"],\"max_tokens\":2}");
    s = post("/v1/completions", (const char *)big.data, &st);
    km_buf_free(&big);
    cr_assert_eq(st, 400, "%s", s);
    cr_assert(strstr(s, "context_length_exceeded"), "%s", s);
    free(s);
    /* and the router still answers, with nothing left in flight */
    a = post_json("/v1/completions", "{\"prompt\":\"Hi\",\"max_tokens\":1,\"n\":2}");
    json_decref(a);
    char out[4096];
    IT_WAIT(it_http_get(g_r.http_port, "/v1/status", out, sizeof out) == 200 &&
                strstr(out, "\"inflight\":0,\"queued\":0"),
            30000, "requests left in flight: %s", out);
    stop_cluster();
}

Test(openai, a_client_gone_mid_stream_ends_every_choice)
{
    if (!cluster(NULL)) return;
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "curl -sN --max-time 2 %s/v1/completions -d '{\"prompt\":\"Tell me a long story\","
             "\"n\":4,\"max_tokens\":2000,\"stream\":true,\"speculate\":\"off\"}' | head -c 2000",
             g_base);
    free(it_stdout(cmd));
    char out[4096];
    IT_WAIT(it_http_get(g_r.http_port, "/v1/status", out, sizeof out) == 200 &&
                strstr(out, "\"inflight\":0,\"queued\":0"),
            30000, "choices left running after the client left: %s", out);
    stop_cluster();
}

/* A python3 that has the `openai` package (build/venv-openai's first), or NULL. */
static const char *sdk_python(void)
{
    static const char *const candidates[] = {"build/venv-openai/bin/python", "python3"};
    for (size_t i = 0; i < sizeof candidates / sizeof *candidates; i++) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "%s -c 'import openai' >/dev/null 2>&1", candidates[i]);
        if (system(cmd) == 0) return candidates[i];
    }
    return NULL;
}

Test(openai, the_official_python_sdk_works_unchanged)
{
    const char *py = sdk_python();
    if (!py) {
        cr_skip_test("python3 with the `openai` package is not at hand (make openai-sdk-venv)");
        return;
    }
    if (!cluster(NULL)) return;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s tests/openai_sdk.py %s 2>&1; echo \"rc=$?\"", py, g_base);
    char *out = it_stdout(cmd);
    cr_assert(strstr(out, "rc=0\n"), "the SDK run failed:\n%s", out);
    free(out);
    stop_cluster();
}

/* A greedy streamed request of 3 tokens over ZeroMQ, with logprobs (2 alternatives) and the
 * given bias (n: 0 for none): its first token. Every tok frame carries its logprobs. */
static int32_t zmq_first_token(void *s, uint64_t id, const km_token_value *bias, uint32_t n)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    m.req.id = id;
    m.req.model = "default";
    m.req.prompt = "The capital of France is";
    m.req.temperature = 0;
    m.req.max_tokens = 3;
    m.req.stream = true;
    m.req.logprobs = true;
    m.req.top_logprobs = 2;
    m.req.logit_bias = bias;
    m.req.n_logit_bias = n;
    it_send_msg(s, &m);
    int toks = 0;
    int32_t first = -1;
    for (;;) {
        km_msg a;
        cr_assert(it_recv_msg(s, &a, 60000), "no answer");
        if (a.type == KM_MSG_DONE) {
            km_msg_clear(&a);
            break;
        }
        cr_assert_eq(a.type, KM_MSG_TOKEN, "got %s", km_msg_type_name(a.type));
        cr_assert(a.tok.has_logprob && a.tok.logprob <= 0);
        cr_assert_eq(a.tok.n_top, 2u);
        if (!n) { /* unbiased greedy: the chosen token is the most likely one */
            cr_assert_eq(a.tok.top[0].token, a.tok.token);
            cr_assert_float_eq(a.tok.top[0].value, a.tok.logprob, 1e-6);
        }
        if (!toks++) first = a.tok.token;
        km_msg_clear(&a);
    }
    cr_assert_eq(toks, 3);
    return first;
}

Test(openai, zeromq_clients_get_logprobs_and_their_logit_bias_too)
{
    if (!cluster(NULL)) return;
    void *s = it_dealer(g_r.front);
    int32_t t = zmq_first_token(s, 3, NULL, 0);
    km_token_value ban = {t, -100}; /* copied by the router from the client's frame */
    cr_assert_neq(zmq_first_token(s, 4, &ban, 1), t, "the bias did not reach the sampler");
    km_zsock_close(s);
    stop_cluster();
}
