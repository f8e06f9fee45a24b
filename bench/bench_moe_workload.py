#!/usr/bin/env python3
"""bench_moe_workload.py — the mixed workload of `make bench-moe` (bench/bench_moe.sh, docs/moe.md):
documents of four kinds, each asked about many times, sent to one kvmesh-worker one request at a
time, so that what a prefix cache keeps under memory pressure shows in the hit ratio.

  bench_moe_workload.py docs OUTDIR [--per-kind 3] [--bytes 1600]
      Writes OUTDIR/<kind>-<i>.txt, per_kind documents of about `bytes` bytes (cut at a line end)
      of each kind, all from files a bare Debian 12 has or the repository holds (nothing is
      downloaded):
        code     C source of the llama.cpp that bench/build_llamacpp.sh unpacked into third_party/
                 (pinned by its sdist's sha256, so the documents do not change with this
                 repository's commits), from the first line that opens a `static` definition
                 (before it: licence comments and #include lines, alike across files)
        english  licence texts in /usr/share/common-licenses (base-files)
        german   the translated messages of coreutils (Essential) in
                 /usr/share/locale/de/LC_MESSAGES/coreutils.mo
        french   those of dpkg (Essential) in /usr/share/locale/fr/LC_MESSAGES/dpkg.mo
      A .mo catalogue is read here (its format is a table of offsets); its longer messages
      (>= 60 bytes), in the order of their English originals, make one running text that is cut
      into documents spread over it.

  bench_moe_workload.py run --kvmesh EP --docs OUTDIR [--requests 60] [--seed 1] [--zipf 1.0]
                        [--admin URL] [--label NAME] [--kvmesh-bin build/bin/kvmesh]
      1. warm-up: every document once, kind by kind (with --admin: after each kind, the pages the
         worker placed per expert group since the previous kind, from its /metrics: where the
         model routes that kind of text);
      2. the sequence: `requests` requests, each a document (drawn with Zipf weights 1/rank^zipf
         over the documents, kinds taking the ranks in turn, so every kind has a popular and a
         rare document) followed by a numbered question; the same seed gives the same sequence.
      Every request is greedy with one completion token (the prefill is what a cache saves), sent
      by `kvmesh generate --json` straight to the worker; prints, for the sequence, per kind and
      in all: requests, prompt tokens, cached tokens (done.usage) and the hit ratio cached/prompt;
      and the full pages the worker computed, warm-up included (prompt minus cached, in pages).

Prints figures; asserts nothing about time. Lines start with a keyword (route, hits) and carry
key=value pairs, for bench_moe.sh to tabulate.
"""
import argparse
import json
import os
import random
import re
import struct
import subprocess
import sys
import time
import urllib.request

PAGE = 16  # the worker's --page-tokens (its default)
KINDS = ["code", "english", "german", "french"]
LLAMA_SRC = "third_party/llama.cpp/ggml/src"
CODE = ["ggml-alloc.c", "ggml.c", "ggml-quants.c", "ggml-backend.cpp", "gguf.cpp", "ggml-opt.cpp"]
LICENCES = ["Apache-2.0", "GPL-3", "MPL-2.0", "Artistic", "GFDL-1.3", "LGPL-3"]
CATALOGUES = {"german": "/usr/share/locale/de/LC_MESSAGES/coreutils.mo",
              "french": "/usr/share/locale/fr/LC_MESSAGES/dpkg.mo"}
QUESTIONS = ["What is the text above about?", "Summarize it in one sentence.",
             "Which word in it matters most?", "Who would read this?",
             "What comes next?", "Is anything in it wrong?",
             "Name one detail from it.", "Translate its first line into English."]


def cut(text, size):
    """The first `size` bytes of text or less, ending at a line end."""
    b = text.encode("utf-8")[:size]
    end = b.rfind(b"\n")
    return b[:end + 1 if end > 0 else len(b)].decode("utf-8", "ignore")


def mo_messages(path):
    """The translations in a GNU .mo catalogue, in the order of their originals."""
    data = open(path, "rb").read()
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">"
    _, n, orig, trans = struct.unpack(end + "4I", data[4:20])
    out = []
    for i in range(n):
        ln, off = struct.unpack(end + "2I", data[orig + 8 * i:orig + 8 * i + 8])
        tl, toff = struct.unpack(end + "2I", data[trans + 8 * i:trans + 8 * i + 8])
        msgid = data[off:off + ln]
        if not msgid:
            continue  # the catalogue's header
        # plural forms are NUL-separated: keep the first
        out.append((msgid, data[toff:toff + tl].split(b"\0")[0].decode("utf-8", "replace")))
    out.sort()
    return [t for _, t in out]


def write_docs(outdir, per_kind, size):
    os.makedirs(outdir, exist_ok=True)
    docs = {}
    code = []
    for name in CODE[:per_kind]:
        path = f"{LLAMA_SRC}/{name}"
        if not os.path.exists(path):
            sys.exit(f"bench_moe_workload: {path} missing (bash bench/build_llamacpp.sh unpacks it)")
        t = open(path, encoding="utf-8").read()
        m = re.search(r"^static ", t, re.M)
        code.append(t[m.start() if m else 0:])
    docs["code"] = code
    docs["english"] = [open(f"/usr/share/common-licenses/{x}", encoding="utf-8").read()
                       for x in LICENCES]
    for kind, path in CATALOGUES.items():
        run = "\n".join(m.strip() + "\n" for m in mo_messages(path) if len(m.encode()) >= 60)
        step = max(1, len(run) // per_kind)
        docs[kind] = [run[i * step:] for i in range(per_kind)]
    for kind in KINDS:
        if len(docs[kind]) < per_kind:
            sys.exit(f"bench_moe_workload: only {len(docs[kind])} {kind} sources")
        for i in range(per_kind):
            text = docs[kind][i]
            if kind in CATALOGUES:
                text = text[text.find("\n") + 1:] if i else text  # start at a message
            with open(f"{outdir}/{kind}-{i}.txt", "w", encoding="utf-8") as f:
                f.write(cut(text, size))


def read_docs(outdir):
    """[(kind, name, text)] with the kinds taking turns: code-0, english-0, ..., code-1, ..."""
    names = sorted(os.listdir(outdir))
    per = {k: sorted(n for n in names if n.startswith(k + "-")) for k in KINDS}
    out = []
    for i in range(max(len(v) for v in per.values())):
        for k in KINDS:
            if i < len(per[k]):
                name = per[k][i]
                out.append((k, name, open(f"{outdir}/{name}", encoding="utf-8").read()))
    return out


def generate(a, prompt):
    """One request; its done.usage. Counts the full pages the worker computed into a.computed."""
    r = subprocess.run([a.kvmesh_bin, "generate", "--router", a.kvmesh, "--max-tokens", "1",
                        "--temperature", "0", "--json", "--quiet", "--timeout", "600",
                        "--prompt", prompt], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench_moe_workload: kvmesh generate failed ({r.returncode}): {r.stderr}")
    res = json.loads(r.stdout)
    a.computed += res["prompt_tokens"] // PAGE - res["cached_tokens"] // PAGE
    return res


def placed(admin):
    """Pages placed so far per expert group, from the worker's /metrics."""
    time.sleep(0.6)  # the worker refreshes its series every 250 ms
    text = urllib.request.urlopen(f"{admin}/metrics", timeout=10).read().decode()
    got = {}
    for m in re.finditer(r'^kvmesh_kv_expert_group_events_total\{group="(\d+)",event="placed"\} '
                         r'(\S+)$', text, re.M):
        got[int(m.group(1))] = float(m.group(2))
    return got


def run(a):
    docs = read_docs(a.docs)
    a.computed = 0
    before = placed(a.admin) if a.admin else {}
    for kind in KINDS:
        for k, name, text in docs:
            if k == kind:
                generate(a, text)
        if a.admin:
            now = placed(a.admin)
            delta = {g: int(now[g] - before.get(g, 0)) for g in sorted(now)}
            before = now
            print(f"route label={a.label} kind={kind} "
                  + " ".join(f"g{g}={v}" for g, v in delta.items()), flush=True)
    rng = random.Random(a.seed)
    weights = [1 / (r + 1) ** a.zipf for r in range(len(docs))]
    sums = {}
    for i in range(a.requests):
        kind, name, text = rng.choices(docs, weights)[0]
        q = QUESTIONS[rng.randrange(len(QUESTIONS))]
        res = generate(a, f"{text}\nQuestion {i + 1}: {q}\nAnswer:")
        for key in (kind, "all"):
            s = sums.setdefault(key, [0, 0, 0])
            s[0] += 1
            s[1] += res["prompt_tokens"]
            s[2] += res["cached_tokens"]
    for key in KINDS + ["all"]:
        n, p, c = sums.get(key, [0, 0, 0])
        print(f"hits label={a.label} kind={key} requests={n} prompt_tokens={p} cached_tokens={c} "
              f"hit_ratio={c / p if p else 0:.4f}", flush=True)
    print(f"pages label={a.label} computed={a.computed}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("docs")
    d.add_argument("outdir")
    d.add_argument("--per-kind", type=int, default=3)
    d.add_argument("--bytes", type=int, default=1600)
    r = sub.add_parser("run")
    r.add_argument("--kvmesh", required=True)
    r.add_argument("--docs", required=True)
    r.add_argument("--requests", type=int, default=60)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--zipf", type=float, default=1.0)
    r.add_argument("--admin")
    r.add_argument("--label", default="run")
    r.add_argument("--kvmesh-bin", default="build/bin/kvmesh")
    a = ap.parse_args()
    if a.cmd == "docs":
        if a.per_kind > min(len(CODE), len(LICENCES)):
            sys.exit(f"bench_moe_workload: at most {min(len(CODE), len(LICENCES))} per kind")
        write_docs(a.outdir, a.per_kind, a.bytes)
    else:
        run(a)


if __name__ == "__main__":
    main()
