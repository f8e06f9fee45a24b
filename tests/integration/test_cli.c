/*
 * test_cli.c — the `kvmesh` command as a user types it (issue 12's CLI defects, one test each):
 * --seed takes any 64-bit value, --timeout is seconds and its message says how long it waited,
 * -r HOST:PORT works and a bad endpoint says what is wrong, option ranges print as integers,
 * `up` refuses a missing model at once, `generate` against a worker works with the default
 * --model, --stop is repeatable, Ctrl-C cancels the request on the server, `run` prints its
 * statistics on a line of their own, and `chat` warns when --template is not the model's.
 *
 * Run from the repository root after `make build` (make integration); the tests that need a
 * worker skip without the default model.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kvmesh.h"
#include "tests/integration/harness.h" /* IT_WAIT */

#define MODEL  "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define WORKER "build/bin/kvmesh-worker"
#define KVMESH "build/bin/kvmesh"

static pid_t g_worker;
static it_up g_up;

static void kill_worker(void)
{
    if (g_worker > 0) {
        kill(g_worker, SIGKILL);
        waitpid(g_worker, NULL, 0);
        g_worker = 0;
    }
}

static void stop_all(void)
{
    kill_worker();
    it_up_stop(&g_up);
}

TestSuite(cli, .fini = stop_all, .timeout = 240);

#define run    it_shell /* a shell command: its exit status and output */
#define expect it_shell_expect

Test(cli, flags_parse_as_documented_or_say_what_is_wrong)
{
    if (access(KVMESH, X_OK)) cr_skip_test("needs %s (make build)", KVMESH);
    expect(KVMESH " generate -p x --seed abc", 2, "--seed abc: give an integer from 0 to");
    expect(KVMESH " generate -p x --timeout 5x", 2, "--timeout 5x: not a duration");
    /* any u64 seed; HOST:PORT is tcp://HOST:PORT; --timeout 0.5 is half a second (an old bug
     * read it as milliseconds, then rounded it to 0); nothing listens on port 9 */
    expect(KVMESH " generate -p x --seed 18446744073709551615 -r 127.0.0.1:9 --timeout 0.5", 1,
           "no answer from the server for 0.5 s");
    expect(KVMESH " generate -p x -r tcp://127.0.0.1 --timeout 1", 1, "needs a port");
    expect(KVMESH " generate -p x --max-tokens 99999999", 2, "outside [0, 1048576]");
    expect(KVMESH " perplexity --sparse-radius 20", 2, "bad value for --sparse-radius: 20");
    expect(WORKER " --sparse-radius -1", 2, "--sparse-radius is between 0 and 16");
    expect(KVMESH " run -p x -n 1 --sparse-attn 64 --sparse-budgets /missing-shares", 1,
           "sparse budgets /missing-shares: No such file or directory");
    expect(WORKER " --insecure --listen='tcp://127.0.0.1:*' --events='tcp://127.0.0.1:*' "
                  "--admin-port=0 --sparse-attn 64 --sparse-budgets /missing-shares",
           1, "sparse budgets /missing-shares: No such file or directory");
    expect(KVMESH " up --model /missing.gguf --run-dir /tmp/kvmesh-cli-test-up", 2,
           "model /missing.gguf: No such file or directory");
    rmdir("/tmp/kvmesh-cli-test-up");
}

/* Starts a worker (one thread, its admin port for metrics; extra flags, NULL-terminated, may be
 * NULL) and returns its request endpoint. */
static void start_worker_with(char *req, size_t cap, int *admin_port, const char *const *extra)
{
    char dir[] = "/tmp/kvmesh-cli-XXXXXX", ports[128];
    cr_assert(mkdtemp(dir));
    snprintf(ports, sizeof ports, "%s/ports", dir);
    g_worker = fork();
    cr_assert(g_worker >= 0);
    if (g_worker == 0) {
        FILE *f = freopen("/dev/null", "w", stderr);
        (void)f;
        setenv("KVMESH_INSECURE", "1", 1); /* a plain worker on loopback, as the other tests */
        const char *argv[32] = {WORKER,
                                "--listen=tcp://127.0.0.1:*",
                                "--events=tcp://127.0.0.1:*",
                                "--admin-port=0",
                                "--threads=1",
                                "--log-level=warn",
                                "--ports-file",
                                ports};
        for (int i = 0, n = 8; extra && extra[i] && n < 31; i++) argv[n++] = extra[i];
        execv(WORKER, (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; i < 600; i++, usleep(50000)) {
        FILE *f = fopen(ports, "r");
        if (!f) continue;
        char line[512];
        while (fgets(line, sizeof line, f)) {
            line[strcspn(line, "\n")] = 0;
            if (!strncmp(line, "requests=", 9)) snprintf(req, cap, "%s", line + 9);
            if (!strncmp(line, "admin=", 6)) *admin_port = atoi(strrchr(line, ':') + 1);
        }
        fclose(f);
        unlink(ports);
        rmdir(dir);
        return;
    }
    cr_assert_fail("worker did not start in 30 s");
}

static void start_worker(char *req, size_t cap, int *admin_port)
{
    start_worker_with(req, cap, admin_port, NULL);
}

static double canceled_requests(int admin_port)
{
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", admin_port);
    km_buf b = {0};
    int st = 0;
    if (kvm_http_get(url, 5000, &b, &st, NULL) || st != 200) return -1;
    km_buf_append(&b, "", 1);
    const char *p =
        strstr((const char *)b.data, "kvmesh_worker_requests_total{outcome=\"canceled\"}");
    double v = p ? atof(strchr(p, '}') + 1) : 0;
    km_buf_free(&b);
    return v;
}

static bool have_worker_binaries(void)
{
    if (access(MODEL, R_OK) || access(WORKER, X_OK) || access(KVMESH, X_OK)) {
        cr_skip_test("needs %s (make deps), %s and %s (make build)", MODEL, WORKER, KVMESH);
        return false;
    }
    return true;
}

Test(cli, generate_against_a_worker_with_default_model_repeated_stops_and_short_floats)
{
    if (!have_worker_binaries()) return;
    char req[512], cmd[2048], *out;
    int admin = 0;
    start_worker(req, sizeof req, &admin);
    snprintf(cmd, sizeof cmd,
             KVMESH " generate -r %s --json -n 24 -p 'The capital of France is' 2>/dev/null", req);
    cr_assert_eq(run(cmd, &out), 0, "generate against a worker, --model default: %s", out);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert_not_null(o, "%s", out);
    const char *text = json_string_value(json_object_get(o, "text"));
    cr_assert(text && strlen(text) > 20, "%s", out);
    /* floats as a person writes them: no 17-digit tails */
    const char *ttft = strstr(out, "\"ttft_ms\":");
    cr_assert(ttft && strcspn(ttft + 10, ",}") <= 12, "%s", out);
    /* two stop strings, the earlier one first: generation ends at the first to appear (only the
     * last --stop used to be kept) */
    size_t len = strlen(text);
    char a[8], b[8];
    snprintf(a, sizeof a, "%.4s", text + len / 3);
    snprintf(b, sizeof b, "%.4s", text + 2 * len / 3);
    size_t want = (size_t)(strstr(text, a) - text);
    snprintf(cmd, sizeof cmd,
             KVMESH " generate -r %s --json -n 24 -p 'The capital of France is' --stop '%s' "
                    "--stop '%s' 2>/dev/null",
             req, a, b);
    free(out);
    cr_assert_eq(run(cmd, &out), 0, "%s", out);
    json_t *o2 = json_loads(out, 0, NULL);
    cr_assert_not_null(o2, "%s", out);
    const char *cut = json_string_value(json_object_get(o2, "text"));
    cr_assert(cut && strlen(cut) == want && !strncmp(cut, text, want),
              "stops '%s' then '%s' on '%s' gave '%s'", a, b, text, cut);
    json_decref(o);
    json_decref(o2);
    free(out);
    /* chat says when --template is not the model's (SmolLM2 is ChatML) */
    snprintf(cmd, sizeof cmd, "echo hi | " KVMESH " chat -r %s -n 2 --template llama3", req);
    expect(cmd, 0, "--template llama3 differs from the model's (chatml)");
    kill_worker();
}

Test(cli, ctrl_c_on_generate_cancels_the_request_on_the_server)
{
    if (!have_worker_binaries()) return;
    char req[512];
    int admin = 0;
    start_worker(req, sizeof req, &admin);
    cr_assert_eq(canceled_requests(admin), 0);
    int pipe_out[2], pipe_err[2];
    cr_assert_eq(pipe(pipe_out), 0);
    cr_assert_eq(pipe(pipe_err), 0);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipe_out[1], 1);
        dup2(pipe_err[1], 2);
        execl(KVMESH, KVMESH, "generate", "-r", req, "-n", "3000", "-p",
              "Count from 1 to 10000: 1, 2, 3, 4, 5,", NULL);
        _exit(127);
    }
    close(pipe_out[1]);
    close(pipe_err[1]);
    struct pollfd p = {.fd = pipe_out[0], .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 120000), 1, "no token in 120 s");
    char buf[4096];
    cr_assert_gt(read(pipe_out[0], buf, sizeof buf), 0);
    kill(pid, SIGINT); /* tokens are streaming: Ctrl-C */
    int st = 0;
    for (int i = 0; i < 600 && waitpid(pid, &st, WNOHANG) != pid; i++) usleep(50000);
    if (!WIFEXITED(st)) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        cr_assert_fail("generate did not end on SIGINT");
    }
    cr_assert_eq(WEXITSTATUS(st), 130);
    ssize_t n = read(pipe_err[0], buf, sizeof buf - 1);
    buf[n > 0 ? n : 0] = 0;
    cr_assert(strstr(buf, "interrupted; the request was canceled"), "stderr: %s", buf);
    double c = 0;
    for (int i = 0; i < 300 && (c = canceled_requests(admin)) < 1; i++) usleep(100000);
    cr_assert_eq(c, 1, "the worker did not see the request canceled");
    close(pipe_out[0]);
    close(pipe_err[0]);
    kill_worker();
}

Test(cli, run_prints_its_statistics_on_a_line_of_their_own)
{
    if (!have_worker_binaries()) return;
    char *out;
    /* stdout to a pipe is block-buffered, stderr not: the text used to come after the stats */
    cr_assert_eq(run(KVMESH " run -t 1 -n 4 -p 'Hello' 2>&1 | cat", &out), 0, "%s", out);
    const char *stats = strstr(out, "kvmesh run: model="), *text = strstr(out, "Hello");
    cr_assert(stats && text && text < stats && stats[-1] == '\n', "got:\n%s", out);
    free(out);
}

/* `kvmesh status --worker`: the KV shards and expert groups of a worker serving the MoE test
 * model with expert-aware shards (issue 16), from its /metrics; a dense model refuses the key. */
/* Runs `kvmesh status` (cmd; its output into *out, the last one freed): the pages it says were
 * placed by expert, or -1 when it does not say. */
static int status_placed(const char *cmd, char **out)
{
    free(*out);
    cr_assert_eq(run(cmd, out), 0, "%s", *out);
    const char *placed = strstr(*out, "expert): ");
    return placed ? atoi(placed + 9) : -1;
}

Test(cli, status_worker_shows_shards_and_expert_groups)
{
    if (!have_worker_binaries()) return;
    const char *moe = "models/SmolLM2-135M-Instruct-MoE8-top4.Q4_1.gguf";
    expect("KVMESH_INSECURE=1 " WORKER " --model " MODEL " --kv-shards 2 --kv-shard-key expert "
           "--listen 'tcp://127.0.0.1:*' --events '' --admin-port -1",
           1, "the `expert` KV shard key needs an MoE model");
    expect(WORKER " --kv-shard-key pikv", 2, "--kv-shard-key is hash or expert");
    if (access(moe, R_OK)) cr_skip_test("%s absent: run `make moe-model`", moe);
    const char *extra[] = {"--model", moe, "--kv-shards=4", "--kv-shard-key=expert", NULL};
    char req[512], cmd[2048], *out;
    int admin = 0;
    start_worker_with(req, sizeof req, &admin, extra);
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 "head -c 1200 /usr/share/common-licenses/GPL-3 | " KVMESH
                 " generate -r %s --model SmolLM2-135M-Instruct-MoE8-top4 -n 2 --file /dev/stdin",
                 req);
        char *o;
        cr_assert_eq(run(cmd, &o), 0, "%s", o);
        cr_assert(strstr(o, "cached (") && (!i || !strstr(o, " 0 cached")), "request %d: %s", i, o);
        free(o);
    }
    /* the worker refreshes its KV gauges every so often: until they count the placements */
    snprintf(cmd, sizeof cmd, KVMESH " status --worker http://127.0.0.1:%d", admin);
    out = NULL;
    IT_WAIT(status_placed(cmd, &out) > 10, 10000, "pages placed: %s", out);
    cr_assert(strstr(out, "4 KV shards") && strstr(out, "expert groups (--kv-shard-key expert)") &&
                  strstr(out, "moved to their expert's shard") && strstr(out, "max/mean"),
              "%s", out);
    free(out);
    expect(KVMESH " status --worker http://127.0.0.1:9", 1, "kvmesh status:");
    kill_worker();
}

/* A secure `kvmesh up` cluster of one worker (its keys in g_up.dir/keys); returns once
 * cluster.env names a running router and controller, copied to *router and *ctl. */
static void up_secure(kvm_cluster_proc *router, kvm_cluster_proc *ctl, const char *worker_args)
{
    it_up_start(&g_up, "cli",
                (const char *const[]){"--workers=1", "--threads=1", worker_args, NULL});
    for (int i = 0; i < 1200; i++) {
        kvm_cluster_proc procs[KVM_CLUSTER_MAX];
        int n = kvm_cluster_read(g_up.cluster, procs, KVM_CLUSTER_MAX, NULL);
        const kvm_cluster_proc *r = n > 0 ? kvm_cluster_find(procs, n, "router") : NULL;
        const kvm_cluster_proc *c = n > 0 ? kvm_cluster_find(procs, n, "controller") : NULL;
        if (r && r->pid && r->requests[0] && c && c->pid && c->listen[0]) {
            *router = *r;
            *ctl = *c;
            return;
        }
        cr_assert_eq(waitpid(g_up.pid, NULL, WNOHANG), 0, "kvmesh up exited (%s/up.log)", g_up.dir);
        usleep(50000);
    }
    cr_assert_fail("the cluster did not come up in 60 s (%s/up.log)", g_up.dir);
}

/* Issue 39: a missing or wrong CURVE key used to read "connection lost" or "no answer", and a
 * bad --cert path was blamed on the router's address. */
Test(cli, a_missing_or_wrong_curve_key_is_named_and_a_bad_cert_path_blamed_on_the_path)
{
    if (!it_have((const char *const[]){IT_MODEL, IT_KVMESH, NULL})) return;
    kvm_cluster_proc router, ctl;
    up_secure(&router, &ctl, NULL);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, KVMESH " generate -r %s -n 1 -p Hi --timeout 20", router.requests);
    expect(cmd, 1, "wants CURVE");
    expect(cmd, 1, "pass --cert");
    snprintf(cmd, sizeof cmd, KVMESH " status --controller %s", ctl.listen);
    expect(cmd, 1, "RUN/keys/private/");
    snprintf(cmd, sizeof cmd, KVMESH " recover --controller %s --worker w0 --level 1", ctl.listen);
    expect(cmd, 1, "wants CURVE");
    /* a client key is not an operator's: the controller's ZAP handler refuses it */
    snprintf(cmd, sizeof cmd, KVMESH " status --controller %s --cert %s/keys/private/client.key",
             ctl.listen, g_up.dir);
    expect(cmd, 1, "refused the client key");
    /* a path that is not there is the path's fault, not the endpoint's */
    snprintf(cmd, sizeof cmd, KVMESH " generate -r %s -n 1 -p Hi --cert /nonexistent/c.key",
             router.requests);
    char *out;
    cr_assert_eq(run(cmd, &out), 1, "%s", out);
    cr_assert(strstr(out, "--cert /nonexistent/c.key: ") && !strstr(out, "HOST must be"), "%s",
              out);
    free(out);
    it_up_stop(&g_up);
}

/* Issue 39: `kvmesh status` ignored the run directory (a --base-port 0 cluster read "cannot
 * connect to 127.0.0.1:8080") and `up` printed no line saying when the cluster was ready. */
Test(cli, up_says_when_ready_and_commands_find_the_cluster_through_its_run_directory)
{
    if (!it_have((const char *const[]){IT_MODEL, IT_KVMESH, NULL})) return;
    kvm_cluster_proc router, ctl;
    /* with the transfer node every worker has by default (issue 31): cluster.env names its
     * port (issue 39) */
    up_secure(&router, &ctl, NULL);
    char log[160], cmd[1024], *out = NULL;
    snprintf(log, sizeof log, "%s/up.log", g_up.dir);
    bool ready = false;
    for (int i = 0; i < 1200 && !ready; i++) {
        FILE *f = fopen(log, "r");
        char line[2048];
        while (f && fgets(line, sizeof line, f)) ready |= strstr(line, "cluster ready:") != NULL;
        if (f) fclose(f);
        if (!ready) usleep(50000);
    }
    cr_assert(ready, "no 'cluster ready:' line in %s", log);
    snprintf(cmd, sizeof cmd, "cat %s", log);
    run(cmd, &out);
    char want[256];
    snprintf(want, sizeof want, "kvmesh status --run-dir %s\n", g_up.dir);
    cr_assert(strstr(out, want), "%s", out);
    free(out);
    /* the router's status (with the run directory's operator API key), a completion (with its
     * client key), the controller's view and a recover (with its admin key) */
    snprintf(cmd, sizeof cmd, KVMESH " status --run-dir %s", g_up.dir);
    expect(cmd, 0, "prefix hits:");
    snprintf(cmd, sizeof cmd, KVMESH " generate --run-dir %s -n 2 -p Hi", g_up.dir);
    expect(cmd, 0, "[worker w0 |");
    snprintf(cmd, sizeof cmd, "KVMESH_RUN_DIR=%s " KVMESH " status --controller controller",
             g_up.dir);
    expect(cmd, 0, "w0           ready");
    snprintf(cmd, sizeof cmd, KVMESH " recover --run-dir %s --worker w0 --level 1", g_up.dir);
    expect(cmd, 0, "w0: level 1 (evict) applied");
    snprintf(cmd, sizeof cmd, KVMESH " status --run-dir %s/nothing", g_up.dir);
    expect(cmd, 2, "cluster.env");
    /* every connection above passed ZAP: at info level that is no log line (issue 39) */
    snprintf(cmd, sizeof cmd, "cat %s/logs/*.log | grep -c event=zap_allow", g_up.dir);
    expect(cmd, 1, "0");
    kvm_cluster_proc procs[KVM_CLUSTER_MAX];
    int n = kvm_cluster_read(g_up.cluster, procs, KVM_CLUSTER_MAX, NULL);
    const kvm_cluster_proc *w0 = n > 0 ? kvm_cluster_find(procs, n, "w0") : NULL;
    cr_assert(w0 && w0->pid > 0);
    const char *colon = strrchr(w0->peer, ':');
    cr_assert(!strncmp(w0->peer, "127.0.0.1:", 10) && colon && atoi(colon + 1) > 0,
              "cluster.env: w0 peer='%s'", w0->peer);
    snprintf(cmd, sizeof cmd, "ss -ltn | grep -q ':%d '", atoi(colon + 1));
    expect(cmd, 0, ""); /* the worker listens there */
    /* a worker killed by a signal is reported as such, not as "status 0" (issue 39) */
    cr_assert_eq(kill(w0->pid, SIGKILL), 0);
    snprintf(cmd, sizeof cmd, "grep 'w0 exited' %s", log);
    bool said = false;
    for (int i = 0; i < 400 && !said; i++) {
        said = run(cmd, &out) == 0;
        if (said)
            cr_assert(strstr(out, "w0 exited (killed by signal 9 (Killed)); restarting"), "%s",
                      out);
        free(out);
        if (!said) usleep(50000);
    }
    cr_assert(said, "up never reported w0's death");
    it_up_stop(&g_up);
}

/* Issue 39: KVMESH_WORKER meant a worker id to `recover` and an admin URL to `status`, and the
 * controller's endpoint was KVMESH_CONTROLLER to one and KVMESH_STATUS_CONTROLLER to the other;
 * `recover --level` gave two ranges. One meaning each now; the old spellings warn. */
Test(cli, each_environment_variable_has_one_meaning_and_old_spellings_warn)
{
    /* KVMESH_WORKER is a worker id: status does not take it for an address */
    expect("KVMESH_WORKER=w1 " KVMESH " status --http http://127.0.0.1:9", 1,
           "cannot connect to 127.0.0.1:9");
    /* the old status spelling, an admin URL, still works, with a warning */
    expect("KVMESH_WORKER=http://127.0.0.1:9 " KVMESH " status", 1,
           "KVMESH_WORKER is deprecated here: set KVMESH_STATUS_WORKER");
    /* KVMESH_CONTROLLER is the controller's --listen for status as for recover */
    expect("KVMESH_CONTROLLER=nohost " KVMESH " status", 1, "nohost");
    expect("KVMESH_CONTROLLER=nohost " KVMESH " recover --worker w0 --level 1", 1, "nohost");
    expect("KVMESH_STATUS_CONTROLLER=nohost " KVMESH " status", 1,
           "KVMESH_STATUS_CONTROLLER is deprecated here: set KVMESH_CONTROLLER");
    /* one range for --level, whichever way it is wrong */
    expect(KVMESH " recover --worker w0 --level 9", 2, "[1, 3]");
    expect(KVMESH " recover --worker w0 --level 0", 2, "[1, 3]");
    expect(KVMESH " recover --worker w0", 2, "--level 1..3");
}

/* Issue 39: --help listed no short options although README uses -p -n -r -f -m, and -m was a
 * model name for generate but a path for run; a path now names the model its file serves. */
Test(cli, help_lists_the_short_options_and_m_takes_the_model_file_everywhere)
{
    expect(KVMESH " generate --help", 0,
           "short options: -p = --prompt, -n = --max-tokens, -m = --model, -r = --router, "
           "-f = --file");
    expect(KVMESH " status --help", 0, "--run-dir");
    expect(KVMESH " run --help", 0, "-m, --model PATH");
    if (!have_worker_binaries()) return;
    char req[512], cmd[1024];
    int admin = 0;
    start_worker_with(req, sizeof req, &admin, NULL);
    snprintf(cmd, sizeof cmd, KVMESH " generate -r %s -m " MODEL " -n 2 -p Hi", req);
    expect(cmd, 0, "[worker ");
    snprintf(cmd, sizeof cmd, KVMESH " generate -r %s -m models/no-such-model.gguf -n 2 -p Hi",
             req);
    expect(cmd, 1, "no-such-model");
    kill_worker();
}

/* Issue 39: --peer-lease-ms and --peer-pull-ms took durations ("10s") under a name that says
 * milliseconds; they are --peer-lease and --peer-pull now, the old names warn and still work. */
Test(cli, the_peer_durations_are_named_as_durations_and_the_old_names_warn)
{
    const char *tail = " --insecure --model /nonexistent.gguf --admin-port -1 2>&1";
    char cmd[512];
    snprintf(cmd, sizeof cmd, WORKER " --peer-lease 500ms --peer-pull 1s%s", tail);
    expect(cmd, 1, "event=model_load"); /* the flags were taken: the model is what fails */
    snprintf(cmd, sizeof cmd, WORKER " --peer-lease-ms 5s%s", tail);
    expect(cmd, 1, "--peer-lease-ms is deprecated: use --peer-lease");
    expect(WORKER " --peer-lease 5x", 2, "--peer-lease: '5x' is not a duration");
}

/* Issue 39: over ZeroMQ a prompt longer than the worker's context got 413 "prompt too long for
 * the context limit", without the counts the HTTP front's 413 gives. */
Test(cli, a_prompt_over_the_context_gets_413_with_the_counts)
{
    if (!have_worker_binaries()) return;
    char req[512], cmd[1024];
    int admin = 0;
    start_worker_with(req, sizeof req, &admin, (const char *const[]){"--max-ctx=32", NULL});
    snprintf(cmd, sizeof cmd,
             "head -c 600 /usr/share/common-licenses/GPL-3 | " KVMESH
             " generate -r %s -n 2 --file /dev/stdin",
             req);
    expect(cmd, 1, "exceeds the limit of 31 (context 32)");
    expect(cmd, 1, "prompt of ");
    kill_worker();
}
