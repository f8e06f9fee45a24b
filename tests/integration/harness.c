/*
 * harness.c — the integration suites' shared helpers (harness.h): children on ephemeral ports
 * found through their ports files, stopped with deadlines and never left running; DEALER
 * sockets speaking km_msg; HTTP GET and /metrics on an admin port. Plain sockets for HTTP, so
 * the suites do not depend on the client library they may be testing.
 */
#include "tests/integration/harness.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define IT_MAX_CHILDREN 64

static pid_t g_children[IT_MAX_CHILDREN]; /* running children, 0 where free */
static void *g_zctx;

static void it_remember(pid_t pid)
{
    for (int i = 0; i < IT_MAX_CHILDREN; i++)
        if (!g_children[i]) {
            g_children[i] = pid;
            return;
        }
    cr_assert_fail("more than %d children at once", IT_MAX_CHILDREN);
}

static void it_forget(pid_t pid)
{
    for (int i = 0; i < IT_MAX_CHILDREN; i++)
        if (g_children[i] == pid) g_children[i] = 0;
}

bool it_have(const char *const *paths)
{
    for (int i = 0; paths[i]; i++)
        if (access(paths[i], strstr(paths[i], "/bin/") ? X_OK : R_OK)) {
            cr_skip_test("needs %s (%s)", paths[i],
                         strstr(paths[i], "models/") ? "make deps" : "make build");
            return false;
        }
    return true;
}

void it_proc_dir(it_proc *p, const char *tag)
{
    if (p->dir[0]) return;
    snprintf(p->dir, sizeof p->dir, "/tmp/kvmesh-%s-XXXXXX", tag);
    cr_assert_not_null(mkdtemp(p->dir), "mkdtemp %s", p->dir);
}

static void it_read_ports(it_proc *p, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[600];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        const char *eq = strchr(line, '=');
        if (!eq) continue;
        const char *v = eq + 1;
        size_t k = (size_t)(eq - line);
        if (k == 6 && !strncmp(line, "listen", k)) snprintf(p->listen, sizeof p->listen, "%s", v);
        if (k == 4 && !strncmp(line, "view", k)) snprintf(p->view, sizeof p->view, "%s", v);
        if (k == 8 && !strncmp(line, "requests", k)) snprintf(p->req, sizeof p->req, "%s", v);
        if (k == 6 && !strncmp(line, "events", k)) snprintf(p->ev, sizeof p->ev, "%s", v);
        if (k == 5 && !strncmp(line, "front", k)) snprintf(p->front, sizeof p->front, "%s", v);
        if (k == 4 && !strncmp(line, "http", k)) p->http_port = atoi(v);
        if (k == 5 && !strncmp(line, "admin", k)) { /* "PORT" or "HOST:PORT" */
            const char *c = strrchr(v, ':');
            p->admin_port = atoi(c ? c + 1 : v);
        }
    }
    fclose(f);
}

void it_spawn(it_proc *p, const char *const *argv, const char *const *extra, const char *logname)
{
    const char *args[64];
    int n = 0;
    for (int i = 0; argv[i] && n < 63; i++) args[n++] = argv[i];
    for (int i = 0; extra && extra[i] && n < 63; i++) args[n++] = extra[i];
    args[n] = NULL;
    char ports[128], log[128];
    snprintf(ports, sizeof ports, "%s/ports", p->dir);
    snprintf(log, sizeof log, "%s/%s", p->dir, logname);
    unlink(ports);
    p->pid = fork();
    cr_assert(p->pid >= 0, "fork");
    if (p->pid == 0) {
        FILE *f = freopen(log, "a", stderr);
        FILE *o = freopen("/dev/null", "w", stdout);
        (void)f, (void)o;
        /* the suites on this harness are about other things: the daemons run without CURVE, on
         * purpose (the security suite, test_security.c, runs them with keys) */
        setenv("KVMESH_INSECURE", "1", 1);
        execvp(args[0], (char *const *)args);
        _exit(127);
    }
    it_remember(p->pid);
    for (int i = 0; i < 600; i++) {
        if (!access(ports, R_OK)) {
            it_read_ports(p, ports);
            return;
        }
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            it_forget(p->pid);
            p->pid = 0;
            cr_assert_fail("%s exited at start (log: %s)", args[0], log);
        }
        usleep(50000);
    }
    cr_assert_fail("%s did not start in 30 s (log: %s)", args[0], log);
}

void it_start_worker(it_proc *p, const char *tag, const char *const *flags,
                     const char *const *extra)
{
    it_proc_dir(p, tag);
    char ports[128];
    snprintf(ports, sizeof ports, "%s/ports", p->dir);
    const char *argv[48] = {IT_WORKER, "--listen=tcp://127.0.0.1:*", "--events=tcp://127.0.0.1:*",
                            "--ports-file", ports};
    int n = 5;
    for (int i = 0; flags && flags[i] && n < 47; i++) argv[n++] = flags[i];
    argv[n] = NULL;
    it_spawn(p, argv, extra, "worker.log");
}

int it_wait_exit(it_proc *p, int timeout_ms)
{
    if (p->pid <= 0) return -1;
    int st = 0;
    pid_t pid = p->pid;
    p->pid = 0;
    for (int i = 0; i < timeout_ms / 20; i++) {
        if (waitpid(pid, &st, WNOHANG) == pid) {
            it_forget(pid);
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    it_forget(pid);
    return -1;
}

void it_stop(it_proc *p)
{
    if (p->pid <= 0) return;
    kill(p->pid, SIGCONT);
    kill(p->pid, SIGTERM);
    it_wait_exit(p, 5000);
}

void it_kill_all(void)
{
    for (int i = 0; i < IT_MAX_CHILDREN; i++)
        if (g_children[i] > 0) {
            kill(g_children[i], SIGCONT);
            kill(g_children[i], SIGKILL);
            waitpid(g_children[i], NULL, 0);
            g_children[i] = 0;
        }
}

/* ---------------------------------------------------------------- ZeroMQ */

void *it_zctx(void)
{
    if (!g_zctx) g_zctx = km_zctx_create();
    cr_assert_not_null(g_zctx);
    return g_zctx;
}

void *it_dealer(const char *ep)
{
    void *s = NULL;
    km_errbuf err = {{0}};
    cr_assert_eq(km_zsock_open(it_zctx(), KM_ZDEALER, NULL, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(km_zsock_connect(s, ep, &err), 0, "%s", err.msg);
    return s;
}

void it_send_raw(void *s, const void *p, size_t n)
{
    km_zframe f = {p, n};
    cr_assert_eq(km_zsend(s, &f, 1, 0, NULL), 0);
}

void it_send_msg(void *s, const km_msg *m)
{
    km_buf b = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(km_msg_encode(m, NULL, &b, &err), 0, "%s", err.msg);
    it_send_raw(s, b.data, b.len);
    km_buf_free(&b);
}

bool it_recv_msg(void *s, km_msg *m, int timeout_ms)
{
    km_zmsg z = {0};
    if (km_zrecv(s, &z, timeout_ms, NULL)) {
        km_zmsg_clear(&z);
        return false;
    }
    const km_zframe *b = km_zmsg_body(&z);
    cr_assert_not_null(b, "a message without a body frame");
    km_errbuf err = {{0}};
    int rc = km_msg_decode(b->data, b->len, NULL, m, &err);
    km_zmsg_clear(&z);
    cr_assert_eq(rc, 0, "an undecodable frame: %s", err.msg);
    return true;
}

/* ---------------------------------------------------------------- HTTP and metrics */

int it_http_get(int port, const char *path, char *out, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {.tv_sec = 10}; /* a server that accepts and never answers */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    char req[256];
    int n =
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t len = 0;
    ssize_t r;
    while (len + 1 < cap && (r = read(fd, out + len, cap - 1 - len)) > 0) len += (size_t)r;
    out[len] = 0;
    close(fd);
    int code = -1;
    if (sscanf(out, "HTTP/1.%*d %d", &code) != 1) code = -1;
    return code;
}

double it_metric_in(const char *text, const char *series)
{
    const char *p = text;
    size_t sl = strlen(series);
    while ((p = strstr(p, series))) {
        if ((p == text || p[-1] == '\n') && p[sl] == ' ') return atof(p + sl + 1);
        p += sl;
    }
    return -1;
}

double it_metric(int admin_port, const char *series)
{
    static char text[1 << 18];
    int code = it_http_get(admin_port, "/metrics", text, sizeof text);
    cr_assert_eq(code, 200, "GET /metrics on port %d answered %d", admin_port, code);
    return it_metric_in(text, series);
}
