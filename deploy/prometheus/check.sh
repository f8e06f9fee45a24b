#!/usr/bin/env bash
# check.sh — `make check-rules`: the Grafana dashboard plots only series the rules record, then
# promtool checks the rules' syntax and expressions and runs their unit tests (kvmesh.test.yml).
# The promtool part is skipped, with the reason, where promtool is missing
# (`bash deploy/image-deps.sh monitoring` installs Debian's prometheus package, which has it).
set -euo pipefail
cd "$(dirname "$0")"
python3 ../grafana/check_dashboard.py ../grafana/kvmesh.json kvmesh.rules.yml
if ! command -v promtool >/dev/null; then
    echo "check-rules: promtool part skipped: promtool not found (bash deploy/image-deps.sh monitoring installs it)"
    exit 0
fi
promtool check rules kvmesh.rules.yml
promtool test rules kvmesh.test.yml
