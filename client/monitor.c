/*
 * monitor.c — the client's socket monitor (client/monitor.h): disconnects, which end a request
 * in flight at once, and failed handshakes, which are turned into an error that names the key
 * the server wants (docs/security.md).
 */
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "client/monitor.h"

#define KVM_MON_EVENTS                                                                             \
    (ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |                                      \
     ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |                  \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

int kvm_mon_open(void *zctx, void *sock, const void *tag, void **mon, km_errbuf *err)
{
    char addr[64];
    snprintf(addr, sizeof addr, "inproc://kvm-monitor-%p", tag);
    *mon = NULL;
    if (zmq_socket_monitor(sock, addr, KVM_MON_EVENTS) != 0)
        return km_errf(err, KM_EIO, "zmq_socket_monitor: %s", zmq_strerror(zmq_errno()));
    void *m = zmq_socket(zctx, ZMQ_PAIR);
    if (!m) return km_errf(err, KM_EIO, "monitor socket: %s", zmq_strerror(zmq_errno()));
    int linger = 0;
    zmq_setsockopt(m, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(m, addr) != 0) {
        zmq_close(m);
        return km_errf(err, KM_EIO, "monitor socket: %s", zmq_strerror(zmq_errno()));
    }
    *mon = m;
    return 0;
}

void kvm_mon_close(void *sock, void *mon)
{
    if (sock) zmq_socket_monitor(sock, NULL, 0);
    if (mon) zmq_close(mon);
}

void kvm_mon_read(void *mon, kvm_mon_seen *seen)
{
    if (!mon) return;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        int r = zmq_msg_recv(&m, mon, ZMQ_DONTWAIT);
        if (r < 0) {
            zmq_msg_close(&m);
            return;
        }
        /* frame 1: event (u16) + value (u32); frame 2: the endpoint */
        if (r >= 6) {
            uint16_t ev;
            uint32_t value;
            memcpy(&ev, zmq_msg_data(&m), sizeof ev);
            memcpy(&value, (const char *)zmq_msg_data(&m) + sizeof ev, sizeof value);
            if (ev == ZMQ_EVENT_DISCONNECTED) {
                seen->disconnects++;
            } else if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
                seen->handshake_event = 0; /* the keys work (now) */
                seen->vague = 0;
            } else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
                seen->vague++;
                if (!seen->handshake_event)
                    seen->handshake_event = ev, seen->handshake_value = value;
            } else if (ev & KVM_MON_EVENTS) {
                seen->handshake_event = ev;
                seen->handshake_value = value;
            }
        }
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        while (more) {
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) < 0)
                more = 0;
            else
                more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
    }
}

int kvm_mon_explain(const kvm_mon_seen *seen, const kvm_sec *sec, const char *endpoint,
                    km_errbuf *err)
{
    bool curve = sec && sec->cert && sec->cert[0];
    const char *server = sec && sec->server && sec->server[0] ? sec->server : NULL;
    if (!seen->handshake_event) return 0;
    if (seen->handshake_event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && seen->vague < 3) return 0;
    bool mismatch = seen->handshake_event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL &&
                    seen->handshake_value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH;
    if (!curve)
        return km_errf(err, KM_EACCES,
                       "%s %s: pass --cert with one of the cluster's client keys (NAME.key beside "
                       "NAME.key_secret; a `kvmesh up` cluster keeps them in RUN/keys/private/: "
                       "client.key for requests, admin.key for status and recover), or set "
                       "KVMESH_CERT",
                       endpoint,
                       mismatch ? "wants CURVE and this client has no key"
                                : "did not take a plain connection (it most likely wants CURVE)");
    if (mismatch)
        return km_errf(err, KM_EACCES, "%s is a plain server (no CURVE): connect without --cert",
                       endpoint);
    if (seen->handshake_event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
        return km_errf(err, KM_EACCES,
                       "%s refused the client key %s (ZAP status %u): its key directory does not "
                       "hold that key, or the key's role may not connect there (status and recover "
                       "need an operator key such as a `kvmesh up` cluster's admin.key)",
                       endpoint, sec->cert, seen->handshake_value);
    return km_errf(err, KM_EACCES,
                   "the CURVE handshake with %s failed: the server's public key (%s) is not the "
                   "key of the server listening there, or the server does not know %s; pass "
                   "--cert with a key of the cluster whose server you name",
                   endpoint, server ? server : "the key directory's own", sec->cert);
}
