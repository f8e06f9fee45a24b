/*
 * main.c — the kvmesh-controller binary: flags (each with a KVMESH_ environment twin and an
 * optional config file, common/svc.h), the ports file, signals, and ctl_controller_run.
 * Everything else is in controller.c and policy.c; see controller.h for the contract and
 * docs/controller.md for operation.
 *
 * SIGINT/SIGTERM stop the loop; the controller holds nothing that needs saving (a restarted one
 * rebuilds its view from the next heartbeats), so stopping is immediate.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "controller/controller.h"

static ctl_controller *g_ctl;

/* The longest duration most flags accept: a day, in ms. */
#define DAY_MS 86400000LL

static void on_signal(int signo)
{
    (void)signo;
    if (g_ctl) ctl_controller_stop(g_ctl); /* sets a flag: async-signal-safe */
}

static int write_ports(const char *path, ctl_controller *c)
{
    char listen[256] = "", view[256] = "", tmp[1024];
    ctl_controller_listen_endpoint(c, listen, sizeof listen);
    ctl_controller_view_endpoint(c, view, sizeof view);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return KM_EIO;
    fprintf(f, "listen=%s\nview=%s\nadmin=%d\npid=%d\n", listen, view, ctl_controller_admin_port(c),
            (int)getpid());
    if (fclose(f) || rename(tmp, path)) return KM_EIO;
    return 0;
}

/* What the option table cannot say: the on/off flags read into c, and that --pressure-low does
 * not exceed --pressure-high. 0, or -1 with the message on stderr. */
static int check_flags(ctl_config *c, const char *recovery, const char *roles)
{
    const struct {
        const char *flag, *word;
        bool *on;
    } words[] = {
        {"recovery", recovery, &c->policy.recovery},
        {"roles-follow-load", roles, &c->roles.on},
    };
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
        if (km_parse_bool(words[i].word, words[i].on)) {
            fprintf(stderr, "kvmesh-controller: --%s must be on or off\n", words[i].flag);
            return -1;
        }
    if (c->policy.pressure_low > c->policy.pressure_high) {
        fprintf(stderr, "kvmesh-controller: --pressure-low must not exceed --pressure-high\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    ctl_config c;
    ctl_config_default(&c);
    ctl_policy_cfg *pc = &c.policy;
    ctl_roles_cfg *rc = &c.roles;
    const char *log_level = NULL, *log_format = NULL, *ports_file = NULL, *recovery = NULL;
    const char *roles = NULL;
    int64_t admin_port, l1_repeat, dead_after;
    km_sec_args sec_args = {0};
    const km_opt opts[] = {
        {"listen", NULL, KM_OPT_STR, "tcp://127.0.0.1:7200",
         "ZeroMQ ROUTER: workers' heartbeats (commands go back on the connection a worker's "
         "heartbeats come on) and operators' admin frames",
         &c.listen_url, 0, 0},
        {"view", NULL, KM_OPT_STR, "tcp://127.0.0.1:7201",
         "ZeroMQ PUB: [\"view\", frame] on every change and every --view-interval", &c.view_url, 0,
         0},
        {"view-interval", NULL, KM_OPT_DURATION, "1s", "publish the view at least this often",
         &c.view_interval_ms, 10, 3600000},
        {"admin-host", NULL, KM_OPT_STR, "127.0.0.1", "admin HTTP host", &c.admin_host, 0, 0},
        {"admin-port", NULL, KM_OPT_INT, "9200",
         "admin HTTP port (/metrics, /healthz, /readyz); 0 = ephemeral, -1 = off", &admin_port, -1,
         65535},
        {"controller-id", NULL, KM_OPT_STR, "controller", "this controller's name in its views",
         &c.controller_id, 0, 0},
        {"recovery", NULL, KM_OPT_STR, "on",
         "on: apply the recovery policy; off: observe and publish only (forced levels still work)",
         &recovery, 0, 0},
        {"pressure-high", NULL, KM_OPT_FLOAT, "0.90",
         "level 1 (evict 25%) at or above this pressure (hot-tier pinned bytes / budget)",
         &pc->pressure_high, 0, 100},
        {"pressure-low", NULL, KM_OPT_FLOAT, "0.70",
         "calm at or below this pressure (level 2 reverts after --revert-after)", &pc->pressure_low,
         0, 100},
        {"cooldown", NULL, KM_OPT_DURATION, "5s", "wait between levels 1 -> 2 -> 3",
         &pc->cooldown_ms, 0, DAY_MS},
        {"l1-repeat", NULL, KM_OPT_INT, "3",
         "level 1 fired this often within --l1-window: level 2 next; 0 = off", &l1_repeat, 0, 64},
        {"l1-window", NULL, KM_OPT_DURATION, "60s", "window of --l1-repeat", &pc->l1_window_ms, 1,
         DAY_MS},
        {"revert-after", NULL, KM_OPT_DURATION, "30s",
         "level 2 (fp8) reverted to f16 after pressure stayed low this long", &pc->revert_after_ms,
         0, DAY_MS},
        {"stall-timeout", NULL, KM_OPT_DURATION, "15s",
         "busy with no token computed this long: level 3; 0 = off", &pc->stall_timeout_ms, 0,
         DAY_MS},
        {"error-storm", NULL, KM_OPT_FLOAT, "50",
         "errors rising faster than this per second: level 3; 0 = off", &pc->error_storm, 0, 1e12},
        {"max-gpu", NULL, KM_OPT_SIZE, "0",
         "worker GPU memory at or above this: level 3 (and GPU/max counts as pressure); 0 = off",
         &pc->max_gpu, 0, 0},
        {"max-rss", NULL, KM_OPT_SIZE, "0",
         "worker RSS at or above this: level 3 (and RSS/max counts as pressure); 0 = off",
         &pc->max_rss, 0, 0},
        {"heartbeat", NULL, KM_OPT_DURATION, "1s", "the workers' heartbeat interval",
         &pc->heartbeat_ms, 10, 3600000},
        {"dead-after", NULL, KM_OPT_INT, "3",
         "missed heartbeat intervals before a worker is dead (one whose last heartbeat said "
         "stopping is left at once instead)",
         &dead_after, 1, 1000},
        {"restart-timeout", NULL, KM_OPT_DURATION, "2m",
         "a worker drained by level 3 and silent this long (no supervisor restarted it) is dead; "
         "0 = wait forever",
         &pc->restart_timeout_ms, 0, DAY_MS},
        {"forget-after", NULL, KM_OPT_DURATION, "10m",
         "a member silent this long (dead or left) is forgotten: removed from the view (routers "
         "free its slot); 0 = never",
         &pc->forget_after_ms, 0, 30LL * DAY_MS},
        {"action-timeout", NULL, KM_OPT_DURATION, "30s",
         "a worker silent while it carries out a command it has not yet acknowledged (e.g. an "
         "fp8 conversion) is declared dead only after this",
         &pc->action_timeout_ms, 0, DAY_MS},
        {"roles-follow-load", NULL, KM_OPT_STR, "on",
         "on: move workers between the prefill and decode pools when one misses its targets and "
         "the other has room (docs/disaggregation.md); off: only an operator changes roles",
         &roles, 0, 0},
        {"ttft-target", NULL, KM_OPT_DURATION, "10s",
         "the prefill pool misses when a busy prefill worker's time to first token p90 is above "
         "this; 0 = off",
         &rc->ttft_target_ms, 0, DAY_MS},
        {"itl-target", NULL, KM_OPT_DURATION, "250ms",
         "the decode pool misses when a busy decode worker's time per output token p90 is above "
         "this; 0 = off",
         &rc->itl_target_ms, 0, DAY_MS},
        {"role-queue", NULL, KM_OPT_FLOAT, "4",
         "a pool misses above this many requests per worker (prefill: running + queued, decode: "
         "queued)",
         &rc->queue_target, 0, 1e6},
        {"role-window", NULL, KM_OPT_DURATION, "30s",
         "a pool misses (or both meet their targets) this long before a worker moves",
         &rc->window_ms, 0, DAY_MS},
        {"role-hold", NULL, KM_OPT_DURATION, "2m",
         "a worker keeps a role at least this long before the controller moves it", &rc->hold_ms, 0,
         DAY_MS},
        {"ports-file", NULL, KM_OPT_STR, NULL, "write listen=, view=, admin=, pid= here once ready",
         &ports_file, 0, 0},
        KM_SEC_OPT_ROWS(&sec_args),
        {"log-level", NULL, KM_OPT_STR, "info", "debug, info, warn, error", &log_level, 0, 0},
        {"log-format", NULL, KM_OPT_STR, "text", "text or json", &log_format, 0, 0},
    };
    km_errbuf err = {{0}};
    km_config *cfg = NULL;
    int crc = km_daemon_config(
        "kvmesh-controller", "membership, health and three-level recovery of a kvmesh cluster",
        opts, sizeof opts / sizeof opts[0], argc, argv, &log_level, &log_format, &cfg);
    if (crc) return crc == 1 ? 0 : 2;
    if (check_flags(&c, recovery, roles)) {
        km_config_destroy(cfg);
        return 2;
    }
    pc->l1_repeat = (uint32_t)l1_repeat;
    pc->dead_after = (uint32_t)dead_after;
    c.admin_port = (int)admin_port;

    km_zsec *sec = NULL;
    if (km_sec_daemon_open(&sec_args, "kvmesh-controller", "controller", &sec, &err)) {
        fprintf(stderr, "kvmesh-controller: %s\n", err.msg);
        km_config_destroy(cfg);
        return 2;
    }
    c.sec = sec;
    int status = 1;
    if (ctl_controller_create(&c, &g_ctl, &err)) {
        KM_ERROR("controller_create", "msg=\"%s\"", err.msg);
        goto out;
    }
    if (ports_file && write_ports(ports_file, g_ctl))
        KM_WARN("ports_file", "path=%s msg=\"cannot write\"", ports_file);
    km_daemon_signals(on_signal);
    ctl_controller_run(g_ctl);
    status = 0;
out:
    if (g_ctl) {
        ctl_controller *ctl = g_ctl;
        g_ctl = NULL;
        ctl_controller_destroy(ctl);
    }
    km_zsec_close(sec);
    km_config_destroy(cfg);
    return status;
}
