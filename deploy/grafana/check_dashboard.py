#!/usr/bin/env python3
"""check_dashboard.py — every recorded series (a name with a colon) that the Grafana dashboard
plots is recorded by the Prometheus rules, so renaming a rule cannot leave a panel empty.
Usage: check_dashboard.py DASHBOARD.json RULES.yml; exits 1 naming what is missing."""
import json
import re
import sys


def exprs(panels):
    for p in panels:
        yield from exprs(p.get("panels", []))
        for t in p.get("targets", []):
            yield p.get("title", ""), t.get("expr", "")


def main():
    dash = json.load(open(sys.argv[1]))
    # the rules file is YAML; its "record:" lines are all this needs
    recorded = set(re.findall(r"^\s*- record:\s*(\S+)", open(sys.argv[2]).read(), re.M))
    missing = []
    n = 0
    for title, e in exprs(dash["panels"]):
        n += 1
        for name in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", e):
            if name not in recorded:
                missing.append(f"panel '{title}': {name}")
    if missing:
        print("dashboard: not recorded by the rules:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    print(f"dashboard: {n} queries, every recorded series exists in the rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
