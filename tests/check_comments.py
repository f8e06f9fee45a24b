#!/usr/bin/env python3
"""check_comments.py [--exclude PATH]... [PATH...] — comments say why, in a few lines.

Fails, listing file:line, for
  - a comment block longer than MAX_BLOCK lines (a run of consecutive lines holding only
    comment text: a /* ... */ block or // lines) other than the file's opening comment (the
    first comment block, with nothing but preprocessor lines before it);
  - a comment line that quotes a measurement (a throughput, a timing with decimals, a speed-up
    factor, a percentage tied to speed): figures go to docs/benchmarks.md, dated, where they can
    be redone; the comment may point there.
PATHs are files (checked whether git tracks them or not) or directories (their tracked files);
default: every tracked .c/.h/.cu file. --exclude drops the files under a path prefix. CONTRIBUTING.md, "Comments", says why.
"""
import os
import re
import subprocess
import sys

MAX_BLOCK = 12
EXTS = (".c", ".h", ".cu")

NUM = r"(?<![\w.])\d+(?:\.\d+)?"
THRU = (
    r"(?:[kKMGT]i?B|[kMGT]?FLOPS?|GFLOP|tok(?:en)?s?|t|ops|req(?:uest)?s?|lookups?|inserts?|"
    r"pages?|decisions?|[kM]?msgs?)/s\b"
)
MEASUREMENT = re.compile(
    "|".join(
        [
            # throughput with decimals or as a range (3.2 GB/s, 157-196 tok/s), or a round one
            # given as what something does (runs at about 1 GB/s); a bare "1 GB/s" is a setting
            r"(?<![\w.])\d+\.\d+\s?" + THRU,
            NUM + r"\s?[-–]\s?" + NUM + r"\s?" + THRU,
            r"(?:about|around|roughly|~|at|reads?|measured?|measures|ran|runs)\s+" + NUM + r"\s?" + THRU,
            # a timing with decimals, or a range of them: 1.5 ms, 10.6-23.9 ms, 0.8 us
            r"(?<![\w.])\d+\.\d+(?:\s?[-–]\s?\d+(?:\.\d+)?)?\s?(?:ms|us|µs|ns)\b",
            # a timing range, or one taken or compared: 57-72 ms, took 60 ms, 6 ms vs 3 ms
            NUM + r"\s?[-–]\s?\d+(?:\.\d+)?\s?(?:ms|us|µs|ns)\b",
            r"(?:took|takes|measured|ran in|runs in|costs?)\s+(?:about\s+|~)?" + NUM + r"\s?(?:ms|us|µs|ns|s)\b",
            NUM + r"\s?(?:ms|us|µs|ns)\s+(?:vs\.?|against|instead of)\s",
            # a speed-up factor: 1.65x, 49-51x, 3x faster
            r"(?<![\w.])\d+\.\d+x\b",
            r"(?<![\w.])\d+(?:\.\d+)?\s?[-–]\s?\d+(?:\.\d+)?x\b",
            NUM + r"\s?x\s+(?:faster|slower|quicker|lower|higher|less|more|the speed|speed-?up)",
            # a percentage tied to speed: 20% faster, +15% tok/s
            NUM + r"\s?%\s+(?:faster|slower|quicker|of the time|speed-?up|slow-?down|less time|"
            r"more time|of (?:the )?(?:step|decode|prefill|runtime|wall))",
            r"(?:faster|slower|speed-?up|slow-?down|regress\w*|gain\w*)\s+(?:by|of)\s+(?:about\s+|~)?"
            + NUM
            + r"\s?%",
        ]
    )
)


def tracked_files():
    out = subprocess.run(
        ["git", "ls-files", "*.c", "*.h", "*.cu"], capture_output=True, text=True, check=True
    ).stdout
    return out.split()


def scan(text):
    """Per line: (has_code, has_comment, comment_text, is_preprocessor)."""
    lines = text.split("\n")
    info = []
    state = "code"  # code | block (inside /* */)
    for line in lines:
        code = False
        comment = False
        ctext = []
        i, n = 0, len(line)
        if state == "block":
            comment = True
        stripped = line.lstrip()
        prep = state == "code" and stripped.startswith("#")
        while i < n:
            c = line[i]
            if state == "block":
                j = line.find("*/", i)
                if j < 0:
                    ctext.append(line[i:])
                    i = n
                else:
                    ctext.append(line[i:j])
                    i = j + 2
                    state = "code"
                continue
            if c in " \t\r\f\\":
                i += 1
            elif line.startswith("//", i):
                comment = True
                ctext.append(line[i + 2 :])
                i = n
            elif line.startswith("/*", i):
                comment = True
                state = "block"
                i += 2
            elif c in "\"'":
                code = True
                j = i + 1
                while j < n and line[j] != c:
                    j += 2 if line[j] == "\\" else 1
                i = j + 1
            else:
                code = True
                i += 1
        info.append((code, comment, " ".join(ctext), prep))
    return info


def check(path, problems):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            info = scan(f.read())
    except OSError as e:
        problems.append(f"{path}: {e}")
        return
    seen_code = False
    first_block = True
    run_start = None
    for ln, (code, comment, ctext, prep) in enumerate(info + [(True, False, "", False)], 1):
        if comment and not code:
            if run_start is None:
                run_start = ln
        else:
            if run_start is not None:
                length = ln - run_start
                opening = first_block and not seen_code
                if length > MAX_BLOCK and not opening:
                    problems.append(
                        f"{path}:{run_start}: comment block of {length} lines "
                        f"(at most {MAX_BLOCK}; the rest goes to docs/)"
                    )
                first_block = False
                run_start = None
            if code and not prep:
                seen_code = True
        if comment and ln <= len(info):
            m = MEASUREMENT.search(ctext)
            if m:
                problems.append(
                    f"{path}:{ln}: measurement in a comment ('{m.group(0)}'; "
                    "figures go to docs/benchmarks.md)"
                )


def self_test():
    """The checker on made-up files: what it must flag, and what it must leave alone."""
    import tempfile

    def block(n, style="//"):
        if style == "//":
            return ["// why"] * n
        return ["/*"] + [" * why"] * (n - 2) + [" */"]

    cases = [  # (lines, [(line, 'block' | 'measurement')])
        (["#ifndef X_H", "#define X_H"] + block(30, "/*") + ["int a;", "#endif"], []),
        (block(3) + ["int a;"] + block(12) + ["int b;"] + block(12, "/*"), []),
        (block(3) + ["int a;"] + block(13) + ["int b;"], [(5, "block")]),
        (["int a;"] + block(14, "/*"), [(2, "block")]),
        (["int a; /* 100 ms time-out, unrolled 4x, 10 MB/s until measured */"], []),
        (['const char *s = "/* 3.2 GB/s */";'], []),
        (["int a; // ran at 3.2 GB/s", "// took 60 ms", "/* 1.65x */"], [(1, "m"), (2, "m"), (3, "m")]),
        (["// 20% faster", "// 57-72 ms", "// 157-196 tok/s"], [(1, "m"), (2, "m"), (3, "m")]),
    ]
    ok = True
    for i, (lines, want) in enumerate(cases):
        with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
            f.write("\n".join(lines) + "\n")
        problems = []
        check(f.name, problems)
        os.unlink(f.name)
        got = sorted(
            (int(p.split(":")[1]), "block" if "comment block" in p else "m") for p in problems
        )
        if got != sorted(want):
            print(f"check-comments self-test {i}: got {got}, want {sorted(want)}", file=sys.stderr)
            ok = False
    return ok


def main(argv):
    if argv[:1] == ["--self-test"]:
        return 0 if self_test() else 1
    excludes, paths = [], []
    it = iter(argv)
    for a in it:
        if a == "--exclude":
            excludes.append(next(it, "").rstrip("/"))
        else:
            paths.append(a.rstrip("/"))
    files = tracked_files()
    if paths:
        named = [p for p in paths if os.path.isfile(p)]  # a file named is checked, tracked or not
        files = named + [
            f for f in files if f not in named and any(f.startswith(p + "/") for p in paths)
        ]
    files = [
        f
        for f in files
        if f.endswith(EXTS) and not any(x and (f == x or f.startswith(x)) for x in excludes)
    ]
    problems = []
    for f in files:
        check(f, problems)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check-comments: {len(problems)} problems in {len(files)} files", file=sys.stderr)
        return 1
    print(f"check-comments: {len(files)} files, no long comment block, no measurement")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
