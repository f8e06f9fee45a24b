/*
 * monitor.h — private to client/: a ZeroMQ socket monitor that tells a client why its connection
 * does not work. libzmq retries a failed CURVE handshake forever and says nothing to the socket's
 * user, so without this a missing or wrong key looks like a silent server ("no answer") or a
 * broken one ("connection lost").
 */
#ifndef KVMESH_CLIENT_MONITOR_H
#define KVMESH_CLIENT_MONITOR_H

#include <stdint.h>

#include "client/kvmesh.h"

/* What the monitor reported since the last kvm_mon_read. */
typedef struct kvm_mon_seen {
    int disconnects;
    int handshake_event; /* ZMQ_EVENT_HANDSHAKE_FAILED_*; 0 = none */
    uint32_t handshake_value;
    int vague; /* failures with no detail (the server hung up first) since the last success */
} kvm_mon_seen;

/* A PAIR socket in zctx receiving sock's disconnects and failed handshakes (*mon; close it with
 * kvm_mon_close before sock). tag makes the inproc address unique. */
int kvm_mon_open(void *zctx, void *sock, const void *tag, void **mon, km_errbuf *err);
void kvm_mon_close(void *sock, void *mon);
/* Drains what the monitor queued into *seen (added to what it holds). */
void kvm_mon_read(void *mon, kvm_mon_seen *seen);
/* When seen holds a failed handshake: an error (KM_EACCES) that says which key to pass to talk
 * to endpoint, and returns it; 0 otherwise. A failure without detail counts only from the third
 * on: the next attempt usually says why (mechanism mismatch, ZAP refusal). */
int kvm_mon_explain(const kvm_mon_seen *seen, const kvm_sec *sec, const char *endpoint,
                    km_errbuf *err);

#endif
