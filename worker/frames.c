/*
 * frames.c — frames out, and the counts of frames refused (service_internal.h): a body behind
 * its envelope, an `err` reply, and the copies of an envelope kept by whoever answers later.
 * Loop thread only: the sockets written here are the loop's own.
 */
#include <stdio.h>
#include <string.h>

#include "worker/service_peer_internal.h"

/* Sends body behind an envelope on sock (the ROUTER, or the controller DEALER with no envelope). */
int wk_svc_send(wk_service *s, void *sock, const km_zframe *env, int n_env, const km_buf *body)
{
    km_zframe parts[KM_ZMSG_MAX_PARTS];
    int n = 0;
    for (int i = 0; i < n_env && n < KM_ZMSG_MAX_PARTS - 1; i++) parts[n++] = env[i];
    parts[n++] = (km_zframe){body->data, body->len};
    int rc = km_zsend(sock, parts, n, KM_ZDONTWAIT, NULL);
    if (rc) s->send_errors++;
    return rc;
}

int wk_svc_send_error(wk_service *s, void *sock, const km_zframe *env, int n_env, uint64_t id,
                      int code, uint32_t retry_ms, const char *msg)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ERROR);
    m.error.id = id;
    m.error.code = code;
    char buf[KM_PROTO_MAX_MESSAGE];
    snprintf(buf, sizeof buf, "%s", msg ? msg : km_proto_code_name(code));
    m.error.message = buf;
    m.error.retry_after_ms = retry_ms;
    if (km_msg_encode(&m, &s->lim, &s->out, NULL)) return KM_EINVAL;
    return wk_svc_send(s, sock, env, n_env, &s->out);
}

void wk_svc_count_bad(wk_service *s, wk_bad b)
{
    s->errors[b]++;
    km_counter_inc(s->s_bad[b]);
}

void wk_svc_count_bad_from(wk_service *s, wk_bad b, const km_zpeer *peer)
{
    /* Only members' frames feed the heartbeat's error counts (the controller's error-storm
     * rule): an operator's typo is counted in the metric, never a reason to restart. peer NULL:
     * the controller's pinned connection. */
    if (peer && !km_zsec_insecure(s->o.sec) && peer->role != KM_ROLE_MEMBER) {
        km_counter_inc(s->s_bad[b]);
        return;
    }
    wk_svc_count_bad(s, b);
}

int wk_env_copy(uint8_t *dst, size_t *lens, const km_zframe *env, int n_env)
{
    size_t total = 0;
    for (int i = 0; i < n_env; i++) total += env[i].len;
    if (n_env > WK_ENV_MAX || total > WK_ENV_BYTES) return KM_ERANGE;
    size_t off = 0;
    for (int i = 0; i < n_env; i++) {
        memcpy(dst + off, env[i].data, env[i].len);
        lens[i] = env[i].len;
        off += env[i].len;
    }
    return 0;
}

int wk_env_view(const uint8_t *src, const size_t *lens, int n_env, km_zframe *env)
{
    size_t off = 0;
    for (int i = 0; i < n_env; i++) {
        env[i] = (km_zframe){src + off, lens[i]};
        off += lens[i];
    }
    return n_env;
}
