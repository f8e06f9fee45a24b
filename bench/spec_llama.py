#!/usr/bin/env python3
"""spec_llama.py - the llama.cpp column of `make bench-spec` (bench/bench_spec.sh).

Sends every prompt of a bench-spec prompts file (one per line, "\\n" "\\t" "\\\\" escapes, '#'
lines skipped: the format bench_spec.c reads) to a running llama-server's /completion, one at a
time (concurrency 1), greedy, n_predict = --max-tokens, no prompt cache, and prints one line:

  llama label=L spec=S tok_s=X tokens=N wall_s=W drafted=D accepted=A decode_tok_s=Y

tok_s is completion tokens over the wall time of the whole phase (prompt processing included),
as bench_spec.c counts kvmesh's; decode_tok_s the same tokens over llama-server's
timings.predicted_ms summed (generation without the prompt, as bench_spec.c's decode figure). drafted/accepted are llama-server's timings.draft_n and
draft_n_accepted summed over the requests (0 without speculation). With --texts FILE the
completions are written there, one JSON string per line, so two phases can be compared
(speculation must not change a greedy output). A benchmark: it asserts nothing about time.
"""
import argparse
import json
import sys
import time
import urllib.request


def load_prompts(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            s, i = [], 0
            while i < len(line):
                c = line[i]
                if c == "\\" and i + 1 < len(line):
                    n = line[i + 1]
                    s.append({"n": "\n", "t": "\t", "\\": "\\"}.get(n, "\\" + n))
                    i += 2
                    continue
                s.append(c)
                i += 1
            out.append("".join(s))
    return out


def complete(url, prompt, max_tokens, timeout):
    body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                       "top_k": 1, "cache_prompt": False, "stream": False}).encode()
    req = urllib.request.Request(url + "/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="llama-server base URL, http://HOST:PORT")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--label", default="run")
    ap.add_argument("--spec", default="none", help="the server's --spec-type, for the line")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--texts", help="write the completions here, one JSON string per line")
    a = ap.parse_args()
    prompts = load_prompts(a.prompts)
    if not prompts:
        sys.exit(f"spec_llama.py: no prompts in {a.prompts}")
    tokens = drafted = accepted = 0
    decode_ms = 0.0
    texts = []
    t0 = time.monotonic()
    for p in prompts:
        r = complete(a.url, p, a.max_tokens, a.timeout)
        t = r.get("timings", {})
        tokens += int(t.get("predicted_n", r.get("tokens_predicted", 0)))
        drafted += int(t.get("draft_n", 0))
        accepted += int(t.get("draft_n_accepted", 0))
        decode_ms += float(t.get("predicted_ms", 0.0))
        texts.append(r.get("content", ""))
    wall = time.monotonic() - t0
    if a.texts:
        with open(a.texts, "w", encoding="utf-8") as f:
            for s in texts:
                f.write(json.dumps(s) + "\n")
    print(f"llama label={a.label} spec={a.spec} tok_s={tokens / wall:.1f} tokens={tokens} "
          f"wall_s={wall:.2f} drafted={drafted} accepted={accepted} "
          f"decode_tok_s={tokens / (decode_ms / 1e3) if decode_ms > 0 else 0:.1f}")


if __name__ == "__main__":
    main()
