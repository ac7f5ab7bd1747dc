#!/usr/bin/env bash
# CI: the compiled event scanner (trace_roofline/trace/_scan.c) under AddressSanitizer and
# UndefinedBehaviorSanitizer. Builds it with -fsanitize=address,undefined into a temporary
# directory (the normal build in the checkout is not touched), makes Python import that build
# (a meta-path finder in a temporary sitecustomize), then runs
#   1. the scanner's differential tests, tests/trace/test_scan.py (scanner vs msgspec: the
#      hand-written cases and one committed trace of each folder), and
#      tests/trace/test_hostile_ingest.py;
#   2. a bounded fuzz run: mutated batches of the committed traces' events through the scanner
#      and through msgspec, which must agree (or the scanner declines), for FUZZ_SECONDS
#      (default 60) or FUZZ_CASES (default 200000) batches, whichever comes first.
# Exits non-zero on a failing test, a disagreement, or any sanitizer report (in this process or
# in a forked parse worker, whose death the parent survives: every report goes to stderr, which
# pytest does not capture here (-s) and which is kept in a log that is searched at the end).
# Env: CC (default gcc), FUZZ_SECONDS, FUZZ_CASES, FUZZ_SEED, SANITIZE_PYTEST_ARGS.
set -euo pipefail  # (pipefail: a command piped into tee keeps its status)
cd "$(dirname "$0")/.."
started=$SECONDS
PY=${PYTHON:-python3}
CC=${CC:-gcc}
work=$(mktemp -d "${TMPDIR:-/tmp}/trace-roofline-sanitize.XXXXXX")
trap '[ -n "${KEEP_SANITIZE_DIR:-}" ] || rm -rf "$work"' EXIT
log="$work/sanitize.log"

suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
so="$work/_scan$suffix"
echo "sanitize: building $so with $CC -fsanitize=address,undefined"
"$CC" -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
    -fno-sanitize-recover=all -Wall -Werror -I"$include" trace_roofline/trace/_scan.c -o "$so"

mkdir -p "$work/site"
cat > "$work/site/sitecustomize.py" <<'EOF'
"""Make trace_roofline.trace._scan the sanitized build named by $TRACE_ROOFLINE_SANITIZED_SCAN."""
import importlib.util
import os
import sys


class _SanitizedScan:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "trace_roofline.trace._scan":
            return None
        return importlib.util.spec_from_file_location(name, os.environ["TRACE_ROOFLINE_SANITIZED_SCAN"])


sys.meta_path.insert(0, _SanitizedScan)
EOF

export TRACE_ROOFLINE_SANITIZED_SCAN="$so"
export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
export LD_PRELOAD="$("$CC" -print-file-name=libasan.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"  # (CPython keeps its objects at exit)
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONMALLOC=malloc  # (every buffer in malloc's heap, where ASan puts red zones)

logged() { "$@" 2>&1 | tee -a "$log"; }
reports() {  # any sanitizer report in the log fails the job
    if grep -qE "runtime error:|ERROR: AddressSanitizer|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$log"; then
        echo "sanitize: sanitizer reports (above, and in $log)" >&2
        return 1
    fi
}

"$PY" - <<'EOF'
import os
import trace_roofline.trace._scan as scan
from trace_roofline.trace import columns
assert scan.__file__ == os.environ["TRACE_ROOFLINE_SANITIZED_SCAN"], scan.__file__
assert columns.SCANNER is scan.Scanner
print("sanitize: the tests import", scan.__file__)
EOF

status=0
# (test_hostile_ingest's two compiler tests build their own scanner: nothing to sanitize there;
# whole files: one committed trace of each folder, the default walk; the fuzz below takes its
# events from every committed trace. -n 2: the xdist workers inherit this stderr, so their
# reports reach the log too)
logged "$PY" -m pytest -q -s -n 2 -p no:cacheprovider ${SANITIZE_PYTEST_ARGS:-} tests/trace/test_scan.py tests/trace/test_hostile_ingest.py \
    --deselect tests/trace/test_hostile_ingest.py::test_the_scanner_has_no_undefined_behaviour_on_empty_keys_and_batches \
    --deselect tests/trace/test_hostile_ingest.py::test_a_big_endian_build_of_the_scanner_is_refused || status=$?
reports || status=1
[ "$status" = 0 ] || { echo "sanitize: FAILED (tests, $((SECONDS - started)) s)" >&2; exit "$status"; }

logged "$PY" - <<'EOF' || status=$?
"""Differential fuzzing: mutated batches of real events, scanner vs msgspec."""
import gzip
import os
import random
import re
import time
from pathlib import Path

from tests.builders import check_batch
from trace_roofline.trace import decode

SECONDS = float(os.environ.get("FUZZ_SECONDS", 60))
CASES = int(os.environ.get("FUZZ_CASES", 200_000))
rng = random.Random(int(os.environ.get("FUZZ_SEED", 27)))
TOKENS = [b"{", b"}", b"[", b"]", b'"', b"\\", b",", b":", b" ", b"\n", b"0", b"-0", b"1e999", b"-1",
          b"9223372036854775807", b"9223372036854775808", b"-9223372036854775808", b"1.5e-300",
          b"null", b"true", b"false", b'"x"', b"\\u0041", b"\\ud800", b"\\u00e9", b"\xc3\xa9", b"\x00",
          b'"args":{}', b'"name":"', b'"ph":"X"', b'"ts":', b'"dur":1', b'"External id":', b'"grid":[1]',
          b'"Input Dims":[[1,2]]', b'"stream":"7"', b"{}", b"[]", b'"":1', b"0x10", b"01", b"1."]


def seeds() -> list[bytes]:
    """Runs of 1 to 12 consecutive events, as written, from every committed trace."""
    out = []
    for p in sorted(Path("sample_traces").rglob("*.json*")) + sorted(Path("tests/data").rglob("*.json*")):
        data = p.read_bytes()
        data = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        b = decode.events_bounds(data[: decode.HEAD_BYTES], data[-decode.SEARCH_BYTES :],
                                 max(len(data) - decode.SEARCH_BYTES, 0))
        if not b:
            continue
        cuts = [m.start() + 1 for m in decode.CUT.finditer(data, b[0], b[1])][:4000]
        starts = [b[0]] + [m.end() - 1 for m in decode.CUT.finditer(data, b[0], b[1])][:4000]
        for _ in range(50):
            i = rng.randrange(len(starts))
            j = min(i + rng.randint(1, 12), len(cuts))
            if j > i:
                out.append(data[starts[i] : cuts[j - 1]])
    return out


def mutate(s: bytes) -> bytes:
    s = bytearray(s)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 4))):
        at = rng.randrange(len(s) + 1)
        kind = rng.random()
        if kind < 0.3:
            s[at:at] = rng.choice(TOKENS)
        elif kind < 0.5 and s:
            s[min(at, len(s) - 1)] = rng.randrange(256)
        elif kind < 0.7:
            del s[at : at + rng.randint(1, 16)]
        elif kind < 0.85:
            n = rng.randint(1, 64)
            s[at:at] = s[max(at - n, 0) : at]
        else:
            m = re.search(rb"-?\d+(\.\d+)?([eE][-+]?\d+)?", bytes(s[at:]))
            if m:
                s[at + m.start() : at + m.end()] = rng.choice(TOKENS[10:20])
    return bytes(s)


corpus, cases, read, t0 = seeds(), 0, 0, time.monotonic()
assert len(corpus) > 100, len(corpus)
while cases < CASES and time.monotonic() - t0 < SECONDS:
    content = mutate(rng.choice(corpus))
    try:
        read += not isinstance(check_batch(content), str)  # (the scanner's columns are msgspec's)
    except AssertionError as e:
        raise AssertionError(("scanner and msgspec differ", content[:400])) from e
    cases += 1
print(f"sanitize: fuzz: {cases} mutated batches in {time.monotonic() - t0:.0f} s, "
      f"{read} read by the scanner (the rest declined), all as msgspec reads them")
EOF
reports || status=1
echo "sanitize: $([ "$status" = 0 ] && echo OK || echo FAILED) in $((SECONDS - started)) s"
exit "$status"
