#!/usr/bin/env bash
# The minimum-versions leg: a fresh venv with EXACTLY the lowest versions pyproject.toml declares for
# the libraries the analyzer and its tests use (pandas, pyarrow, numpy, matplotlib, msgspec, bokeh,
# dask + distributed, isal), then the tests of what those libraries do for the analyzer
# (MIN_TESTS below). torch and transformers are not installed: only workloads/ and the tests
# that build models use them, and their versions are not the analyzer's to declare. pytest,
# pytest-xdist and hypothesis resolve to their newest.
#
# It runs on a copy of the work tree (tracked and untracked, not ignored files) in a temporary
# folder, so the editable install's in-place build of the compiled scanner never touches the
# checkout. Usage: bash .ci/min_versions.sh [extra pytest arguments]. KEEP=1 keeps the folder.
# With MIN_VERSIONS_DIR=DIR it installs into DIR (kept) and reuses an install already there;
# `--install-only` stops after the install (CI installs while another leg runs).
#
# The pins below must equal pyproject.toml's ">=" minimums: the script checks that before it
# installs anything, so raising a minimum without updating this list (or the reverse) fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

PINS=(
    "pandas==3.0.0"
    "pyarrow==14.0.0"
    "numpy==1.26.0"
    "matplotlib==3.7.0"
    "msgspec==0.23.0"
    "bokeh==3.4.0"
    "dask==2024.8.0"
    "distributed==2024.8.0"
    "isal==1.6.0"
)

# Every pin must be the declared minimum (distributed comes with dask[distributed]'s minimum).
python3 - "${PINS[@]}" <<'EOF'
import re, sys, tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
declared = list(project["dependencies"])
for extra in project["optional-dependencies"].values():
    declared += extra
minimums = {}
for req in declared:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*", req)
    if m:
        minimums[m.group(1).lower()] = m.group(3)
minimums["distributed"] = minimums.get("dask")
bad = []
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    want = minimums.get(name)
    # pyproject may say ">=14" for the pin 14.0.0: compare release tuples padded with zeros.
    norm = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)) + (0,) * 4
    if want is None or norm(want)[:4] != norm(version)[:4]:
        bad.append(f"{pin}: pyproject.toml declares {name}>={want}")
if bad:
    sys.exit("min_versions.sh pins differ from pyproject.toml:\n  " + "\n  ".join(bad))
EOF

# The tests of what the pinned libraries do for the analyzer: msgspec, numpy and isal read the
# trace (ingest, the scanner's msgspec reference), pandas and numpy carry every stage (attribution,
# costs, roofline), Matplotlib, Bokeh and pyarrow write the outputs (charts, report.html, Parquet,
# the Arrow IPC cache), Dask runs the cluster.
MIN_TESTS=(
    tests/trace/test_trace.py tests/trace/test_scan.py tests/trace/test_hostile_ingest.py
    tests/attribution/test_attribute.py tests/costs/test_costs.py tests/roofline/test_roofline.py
    tests/outputs/test_report.py tests/outputs/test_plot.py tests/outputs/test_html.py
    tests/outputs/test_perfetto.py tests/outputs/test_diff.py
    tests/cli/test_cache.py tests/cli/test_parallel.py tests/cli/test_cli_analyze.py
)

start=$(date +%s)
if [[ -n "${MIN_VERSIONS_DIR:-}" ]]; then  # a folder of the caller's: kept, and reused once installed
    work=$MIN_VERSIONS_DIR
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/trace-roofline-min.XXXXXX")
    cleanup() { if [[ "${KEEP:-}" != 1 ]]; then rm -rf "$work"; else echo "kept $work"; fi; }
    trap cleanup EXIT
fi
py="$work/venv/bin/python"

if [[ ! -f "$work/installed" ]]; then
    # The work tree as git sees it (what a commit of it would hold), without build outputs.
    rm -rf "$work/src" "$work/venv"
    mkdir -p "$work/src"
    git ls-files -z --cached --others --exclude-standard \
        | (cd "$repo" && xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' _) \
        | tar -C "$repo" --null -T - -cf - | tar -C "$work/src" -xf -

    python3 -m venv "$work/venv"
    printf '%s\n' "${PINS[@]}" > "$work/constraints.txt"
    "$py" -m pip install -q --upgrade pip
    # The pins as constraints: if anything asks for a newer version the resolver fails loudly
    # instead of upgrading past the minimum.
    "$py" -m pip install -q -c "$work/constraints.txt" "${PINS[@]}"
    (cd "$work/src" && "$py" -m pip install -q -c "$work/constraints.txt" -e ".[dask,gzip]" \
        "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6")
    touch "$work/installed"
fi

echo "installed:"
"$py" - <<'EOF'
from importlib.metadata import version
print("  " + ", ".join(f"{n} {version(n)}" for n in
      ["pandas", "pyarrow", "numpy", "matplotlib", "msgspec", "bokeh", "dask", "distributed", "isal",
       "pytest", "hypothesis"]))
EOF
if [[ "${1:-}" == --install-only ]]; then
    echo "min_versions.sh: installed in $work after $(( $(date +%s) - start )) s"
    exit 0
fi

set +e
(cd "$work/src" && "$py" -m pytest -q -x -p no:cacheprovider "$@" "${MIN_TESTS[@]}")
rc=$?
set -e
echo "min_versions.sh: pytest exit $rc after $(( $(date +%s) - start )) s"
exit $rc
