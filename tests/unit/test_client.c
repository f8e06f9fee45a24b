/*
 * test_client.c — libkvmesh's local helpers (client/kvmesh.h) that need no server: the cluster
 * state file `kvmesh up` writes (kvm_cluster_read / kvm_cluster_find) and kvm_view_all_ready.
 * The network calls are exercised against real daemons by the integration and chaos suites.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/kvmesh.h"

static char *write_tmp(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kvm_cluster_XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

Test(client, cluster_file_lines_become_processes)
{
    char *path = write_tmp(
        "role=controller id=controller pid=10 restarts=0 listen=tcp://127.0.0.1:7200 "
        "view=tcp://127.0.0.1:7201 admin=http://127.0.0.1:9200\n"
        "role=worker id=w0 pid=11 restarts=2 requests=tcp://127.0.0.1:7100 "
        "events=tcp://127.0.0.1:7101 admin=http://127.0.0.1:9100 peer=127.0.0.1:7103\n"
        "garbage without equals signs\n"
        "role=worker pid=99\n" /* no id: not a process */
        "role=router id=router pid=0 requests=tcp://127.0.0.1:7000 http=http://127.0.0.1:8080 "
        "unknown=key\n");
    kvm_cluster_proc p[8];
    km_errbuf err = {{0}};
    int n = kvm_cluster_read(path, p, 8, &err);
    unlink(path);
    cr_assert_eq(n, 3, "%s", err.msg);
    const kvm_cluster_proc *w0 = kvm_cluster_find(p, n, "w0");
    cr_assert_not_null(w0);
    cr_assert_str_eq(w0->role, "worker");
    cr_assert_eq(w0->pid, 11);
    cr_assert_eq(w0->restarts, 2);
    cr_assert_str_eq(w0->requests, "tcp://127.0.0.1:7100");
    cr_assert_str_eq(w0->peer, "127.0.0.1:7103");
    const kvm_cluster_proc *c = kvm_cluster_find(p, n, "controller");
    cr_assert_str_eq(c->view, "tcp://127.0.0.1:7201");
    cr_assert_eq(kvm_cluster_find(p, n, "router")->pid, 0, "pid=0: down");
    cr_assert_null(kvm_cluster_find(p, n, "w9"));
}

Test(client, cluster_file_limits_hold)
{
    /* an over-long line is skipped whole; over-long values are cut to the field; max is kept */
    size_t big = 5000;
    char *text = malloc(big + 512);
    strcpy(text, "role=worker id=");
    size_t k = strlen(text);
    memset(text + k, 'x', big);
    strcpy(text + k + big, " pid=1\nrole=worker id=w1 requests=tcp://");
    k = strlen(text);
    memset(text + k, 'a', 300);
    strcpy(text + k + 300, "\nrole=worker id=w2\nrole=worker id=w3\n");
    char *path = write_tmp(text);
    free(text);
    kvm_cluster_proc p[2];
    km_errbuf err = {{0}};
    int n = kvm_cluster_read(path, p, 2, &err);
    unlink(path);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(p[0].id, "w1", "the over-long line is not read as a process");
    cr_assert_eq(strlen(p[0].requests), sizeof p[0].requests - 1);
    cr_assert_str_eq(p[1].id, "w2");
    cr_assert_lt(kvm_cluster_read("/nonexistent/cluster.env", p, 2, &err), 0);
    cr_assert(strstr(err.msg, "cannot open"));
}

Test(client, a_view_is_all_ready_only_with_enough_ready_workers)
{
    km_view_worker w[2] = {{.id = "w0", .state = KM_MEMBER_READY},
                           {.id = "w1", .state = KM_MEMBER_RESTARTING}};
    km_msg_view v = {.controller = "c", .workers = w, .n_workers = 2};
    cr_assert_not(kvm_view_all_ready(&v, 2));
    w[1].state = KM_MEMBER_READY;
    cr_assert(kvm_view_all_ready(&v, 2));
    cr_assert_not(kvm_view_all_ready(&v, 3), "fewer workers than asked");
}

/* Issue 39: drafts that arrive with the first token made the statistics line print an absurd rate
 * (three tokens over the microseconds between frames of one step). */
Test(client, the_decode_rate_leaves_out_the_first_steps_tokens)
{
    kvm_result r = {0};
    /* plain decoding: 11 tokens, 10 steps after the first over 1 s */
    r.completion_tokens = 11;
    r.client_ttft_ms = 100;
    r.client_total_ms = 1100;
    cr_assert_float_eq(kvm_result_decode_rate(&r), 10.0, 1e-9);
    /* one step made all 4 tokens (3 drafts accepted): no rate, however close the frames came */
    r.completion_tokens = 4;
    r.accepted_draft_tokens = 3;
    r.client_total_ms = 100.0181;
    cr_assert_eq(kvm_result_decode_rate(&r), 0);
    /* 12 tokens in 4 steps (8 drafts accepted): 3 steps after the first, 9 tokens, over 0.5 s */
    r.completion_tokens = 12;
    r.accepted_draft_tokens = 8;
    r.client_total_ms = 600;
    cr_assert_float_eq(kvm_result_decode_rate(&r), 18.0, 1e-9);
    /* a single token, or no time after it */
    r.completion_tokens = 1;
    r.accepted_draft_tokens = 0;
    cr_assert_eq(kvm_result_decode_rate(&r), 0);
    r.completion_tokens = 5;
    r.client_total_ms = r.client_ttft_ms;
    cr_assert_eq(kvm_result_decode_rate(&r), 0);
}

/* Issue 39: `kvmesh status --controller` said "oldest first" but listed the history worker by
 * worker. */
Test(client, the_views_recovery_history_is_one_list_oldest_first)
{
    km_recovery_action h0[] = {{.at_ms = 100, .level = 1}, {.at_ms = 400, .level = 2}};
    km_recovery_action h1[] = {{.at_ms = 200, .level = 3}, {.at_ms = 400, .level = 1}};
    km_view_worker ws[2] = {{.id = "w0", .history = h0, .n_history = 2},
                            {.id = "w1", .history = h1, .n_history = 2}};
    km_msg_view v = {.workers = ws, .n_workers = 2};
    kvm_view_action out[4];
    cr_assert_eq(kvm_view_history(&v, out, 4), 4);
    const char *want_id[] = {"w0", "w1", "w0", "w1"};
    const uint64_t want_at[] = {100, 200, 400, 400}; /* a tie keeps view order */
    for (int i = 0; i < 4; i++) {
        cr_assert_str_eq(out[i].worker->id, want_id[i], "entry %d", i);
        cr_assert_eq(out[i].action->at_ms, want_at[i], "entry %d", i);
    }
    cr_assert_eq(kvm_view_history(&v, out, 3), 3, "at most max");
}
