#!/usr/bin/env python3
"""What clients cost the router's HTTP front before and around authentication (issue 41, item 5).

Starts ROUTER (a kvmesh-router binary) with --api-keys KEYFILE and one worker slot nothing
listens on, then prints: its RSS idle; its RSS after 150 keyless connections each sent a 4 MiB
body; and its CPU seconds while 16 connections with the key TOKEN trickle a chunked body (one
1-byte chunk per connection every 2 ms) for 10 s. Run from the repository root (the router
loads the default model's tokenizer):

    build/bin/kvmesh keys api-add /tmp/keys acme            # prints TOKEN
    bench/bench_http_preauth.py build/bin/kvmesh-router /tmp/keys TOKEN

Figures: docs/benchmarks.md, "HTTP front before authentication".
"""
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time


def main():
    router, keyfile, token = sys.argv[1:4]
    d = tempfile.mkdtemp(prefix="kvmesh-preauth-")
    env = dict(os.environ, KVMESH_INSECURE="1")
    p = subprocess.Popen(
        [router, "--front=tcp://127.0.0.1:*", "--workers=w0=tcp://127.0.0.1:9+tcp://127.0.0.1:9",
         "--http-port=0", "--log-level=error", "--ports-file=%s/ports" % d,
         "--api-keys=%s" % keyfile], env=env, stderr=open(d + "/log", "w"))
    try:
        deadline = time.time() + 30
        while not os.path.exists(d + "/ports"):
            if time.time() > deadline or p.poll() is not None:
                sys.exit("the router did not start (see %s/log)" % d)
            time.sleep(0.05)
        time.sleep(0.2)  # the ports file is written whole before the rename; let the loop run
        port = int([l.split("=")[1] for l in open(d + "/ports") if l.startswith("http=")][0])
        run(p.pid, port, token)
    finally:
        p.terminate()
        p.wait()


def rss_mb(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return -1


def cpu_s(pid):
    f = open("/proc/%d/stat" % pid).read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def run(pid, port, token):
    print("idle: RSS %d MB" % rss_mb(pid))
    body = b"x" * (4 << 20)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))

    def push(s):
        try:
            s.sendall(head)
            s.sendall(body)
        except OSError:
            pass  # answered 401 and closed

    socks, threads = [], []
    for _ in range(150):
        s = socket.create_connection(("127.0.0.1", port))
        socks.append(s)
        t = threading.Thread(target=push, args=(s,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=60)
    time.sleep(1)
    print("150 keyless connections, 4 MiB bodies: RSS %d MB" % rss_mb(pid))
    for s in socks:
        s.close()
    c0, chunks = cpu_s(pid), 0
    trickles = []
    for _ in range(16):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" % token.encode())
        trickles.append(s)
    stop = time.time() + 10
    while time.time() < stop:
        for s in trickles:
            s.sendall(b"1\r\n \r\n")
        chunks += 1
        time.sleep(0.002)
    print("16 keyed chunked trickles, 10 s, %d chunks each: router CPU %.2f s, RSS %d MB"
          % (chunks, cpu_s(pid) - c0, rss_mb(pid)))
    for s in trickles:
        s.close()


if __name__ == "__main__":
    main()
