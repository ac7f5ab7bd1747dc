"""README.md and docs/*.md as a user reads them: every example command runs as written against the
committed sample traces, every transcript is what the CLI prints today, every link and image
exists, and the analyzer never needs torch.

Example commands are the lines of ```bash blocks that start with `trace-roofline` (or hold
`&& trace-roofline`; a trailing backslash continues a line) and the `$ trace-roofline ...` lines
of ```text blocks, whose following lines are the expected output. A ```text block without `$`
right after a ```bash block of one command is that command's output (README's example table).
Expected lines must appear in the actual output in order; `...` stands for any text, a line of
its own for any lines. A trailing comment `# exits N` gives the expected exit code (else 0), and
`# needs ...` (a GPU, torch, a cluster, traces not in this repository) skips the command with
that reason; `run`, `sweep` and `calibrate` must carry one.

Commands run in doc order in one temporary directory holding a link to sample_traces/, so
relative outputs (`--out report`) land there, and `/tmp/...` paths are moved under it: nothing is
written into the repository. They run in this process through the console script's module (one
import of pandas instead of one per command), each with its own stdout/stderr capture; a command
shown on two pages runs once.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.builders import ROOT, walk

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
OTHERS_PAGES = {DOCS / "security.md", DOCS / "architecture.md"}  # written by others
TORCH_COMMANDS = {"run", "sweep", "calibrate"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Command:
    page: Path
    line: int
    text: str  # as written, comment included
    argv: list[str]
    exit_code: int = 0
    skip: str | None = None
    expected: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _command(page: Path, line: int, text: str) -> Command:
    argv = shlex.split(text, comments=True)
    assert argv[0] == "trace-roofline", text
    comment = text.split(" #", 1)[1].strip() if " #" in text else ""
    exits = re.search(r"\bexits? (\d+)", comment)
    skip = comment if comment.startswith("needs ") else None
    return Command(page, line, text, argv[1:], int(exits.group(1)) if exits else 0, skip)


def _commands(page: Path) -> list[Command]:
    text = page.read_text()
    found: list[Command] = []
    previous_bash: list[Command] | None = None
    for block in FENCE.finditer(text):
        lang, body = block.group(1), block.group(2)
        first = text.count("\n", 0, block.start()) + 2  # 1-based line of the block's first line
        if lang in ("bash", "sh", "shell"):
            cmds = []
            logical, start = "", first
            for i, raw in enumerate(body.splitlines()):
                if not logical:
                    start = first + i
                logical += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
                if raw.endswith("\\"):
                    continue
                m = re.search(r"(?:^|&&\s*)(trace-roofline\s.*)$", logical.strip())
                if m:
                    cmds.append(_command(page, start, m.group(1)))
                logical = ""
            found += cmds
            previous_bash = cmds
            continue
        if lang == "text":
            lines = body.splitlines()
            if not any(x.startswith("$ ") for x in lines):
                if previous_bash is not None and len(previous_bash) == 1 and not previous_bash[0].expected:
                    previous_bash[0].expected = lines
            else:
                for i, x in enumerate(lines):
                    if x.startswith("$ trace-roofline"):
                        found.append(_command(page, first + i, x[2:]))
                    elif found and found[-1].page == page and found[-1].line >= first:
                        found[-1].expected.append(x)
        previous_bash = None
    return found


COMMANDS = [c for page in PAGES for c in _commands(page)]


def _cli_main():
    """The console script's module's `main(argv) -> exit code` (its `run` would os._exit)."""
    (ep,) = entry_points(group="console_scripts", name="trace-roofline")
    return importlib.import_module(ep.module).main


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = _cli_main()(argv)
        except SystemExit as e:  # argparse: --help, usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return code, out.getvalue()


def _first_missing(expected: list[str], output: str) -> str | None:
    """The first expected line not found, in order, among the output's lines (`...` = any text)."""
    actual = [x.rstrip() for x in output.splitlines()]
    pos = 0
    for want in (x.rstrip() for x in expected):
        if not want or want == "...":
            continue
        pattern = re.compile(".*?".join(map(re.escape, want.split("..."))))
        hit = next((i for i in range(pos, len(actual)) if pattern.fullmatch(actual[i])), None)
        if hit is None:
            return want
        pos = hit + 1
    return None


_RESULTS: dict[tuple[str, ...], tuple[int, str]] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs-examples")
    (d / "sample_traces").symlink_to(ROOT / "sample_traces")
    return d


def test_every_page_has_examples():
    pages = {c.page for c in COMMANDS}
    assert README in pages
    assert len(COMMANDS) >= 30, [c.id for c in COMMANDS]


def _make_inputs(cmd: Command, workdir: Path) -> None:
    """Run the page's earlier commands that write a /tmp/ file this one reads, where it is not
    there yet (under xdist the example that wrote it may have run on another worker)."""
    for path in (a for a in cmd.argv[1:] if a.startswith("/tmp/")):
        if Path(str(workdir) + path).exists():
            continue
        for prev in COMMANDS[:COMMANDS.index(cmd)]:
            if prev.page == cmd.page and path in prev.argv and not prev.skip:
                _run([str(workdir) + a if a.startswith("/tmp/") else a for a in prev.argv])


@pytest.mark.parametrize("cmd", walk(COMMANDS, lambda c: c.page, lambda c: c.id))
def test_example_command(cmd: Command, workdir: Path, monkeypatch):
    if cmd.argv[0] in TORCH_COMMANDS:
        assert cmd.skip, f"{cmd.id}: `{cmd.text}` needs torch: mark it `# needs a GPU` or `# needs torch`"
    if cmd.skip:
        pytest.skip(f"{cmd.id}: {cmd.skip}")
    monkeypatch.chdir(workdir)
    if cmd.argv[0] == "cache":  # never clear the session's cache (the other examples reuse it)
        monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", str(workdir / "cache-example"))
    argv = [str(workdir) + a if a.startswith("/tmp/") else a for a in cmd.argv]
    for a in argv:
        if a.startswith(str(workdir) + "/tmp/"):
            Path(a).parent.mkdir(parents=True, exist_ok=True)
    _make_inputs(cmd, workdir)
    key = tuple(argv)
    if key not in _RESULTS or argv[0] == "cache":  # a command shown on two pages runs once
        _RESULTS[key] = _run(argv)
    code, output = _RESULTS[key]
    assert code == cmd.exit_code, f"{cmd.id}: `{cmd.text}` exited {code}:\n{output[-3000:]}"
    missing = _first_missing(cmd.expected, output)
    assert missing is None, (f"{cmd.id}: `{cmd.text}` no longer prints\n{missing}\n"
                             f"(regenerate the transcript from its output:)\n{output[-6000:]}")


def test_readme_starts_with_the_two_commands():
    commands = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    lines = [x for x in commands.splitlines() if x and not x.startswith("#")]
    assert len(lines) == 2
    assert "trace-roofline analyze sample_traces/" in lines[0]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert lines[1].split("&& ", 1)[1] == ci[-1]  # CI runs exactly README's test command
    for path in re.findall(r"sample_traces/\S+\.json\.gz", lines[0]):
        assert (ROOT / path).is_file(), path
    first = next(c for c in COMMANDS if c.page == README)
    assert first.line < 20 and len(first.expected) > 15  # its output is shown and checked


def test_readme_is_short_and_lists_every_command_once():
    text = README.read_text()
    assert len(text.encode()) <= 12_000, "README.md is the front page: the reference lives in docs/"
    code, usage = _run(["--help"])
    assert code == 0
    subcommands = re.search(r"\{([a-z,]+)\}", usage).group(1).split(",")
    assert {"analyze", "diff", "cache"} <= set(subcommands)
    for sub in subcommands:
        rows = re.findall(rf"^\| `trace-roofline {sub}\b", text, re.M)
        assert len(rows) == 1, f"README's commands table lists `{sub}` {len(rows)} times"


def test_wording():
    for page in [p for p in PAGES if p not in OTHERS_PAGES]:
        text = page.read_text()
        assert "this project" not in text.lower(), page
        assert not re.search(r"\bissues? #?\d+|(?<![\w/])#\d+\b", text, re.I), page
    readme = README.read_text()
    for term in ("the lesson", "M-knob", "M\\*", "S\\*", "I\\*", "op instance", "banded LCS",
                 "evidence levels"):
        assert term in readme, f"README must explain {term!r}"


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _make_images():
    spec = importlib.util.spec_from_file_location("make_images", DOCS / "make_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_links_and_images_exist():
    images = set()
    for page in PAGES:
        for target in _links(page):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
            if path.suffix in (".png", ".svg", ".jpg"):
                images.add(path)
    on_disk = {p.resolve() for p in DOCS.iterdir() if p.suffix in (".png", ".svg", ".jpg")}
    assert images == on_disk, "every image in docs/ is shown, and every image shown is in docs/"
    made = {(DOCS / name).resolve() for name in _make_images().IMAGES}
    assert made == images, "docs/make_images.py regenerates exactly the images the pages show"


def test_every_page_is_linked_from_the_readme():
    linked = {(ROOT / t.split("#", 1)[0]).resolve() for t in _links(README)}
    for page in PAGES[1:]:
        if page not in OTHERS_PAGES:
            assert page.resolve() in linked, f"README.md does not link {page.relative_to(ROOT)}"


def test_python_examples_run(workdir):
    blocks = [(p, b.group(2)) for p in PAGES for b in FENCE.finditer(p.read_text())
              if b.group(1) == "python"]
    assert blocks
    for page, code in blocks:
        check = "\nimport sys\nassert 'torch' not in sys.modules, 'torch imported'\n"
        if "tr.analyze_trace" in code:
            check += "assert callable(tr.attribute)\nprint(a.whole['intensity'])\n"
        r = subprocess.run([sys.executable, "-c", code + check], cwd=workdir, capture_output=True,
                           text=True)
        assert r.returncode == 0, f"{page.relative_to(ROOT)}: {r.stderr}"
        if "tr.analyze_trace" in code:  # decode layer: weights dominate the bytes
            assert 1.0 < float(r.stdout.strip().splitlines()[-1]) < 1.1


def test_python_page_names_only_public_api():
    import trace_roofline as tr

    text = (DOCS / "python.md").read_text()
    listed = re.search(r"besides those above: (.*?)\.", text, re.S).group(1)
    names = set(re.findall(r"`(\w+)`", listed)) | set(re.findall(r"\btr\.(\w+)", text))
    assert names and names <= set(tr.__all__), names - set(tr.__all__)
    assert set(tr.__all__) <= names, f"docs/python.md does not name {set(tr.__all__) - names}"


def test_a_script_beside_a_clone_named_trace_roofline(tmp_path):
    """docs/python.md's "Where to save a script": the clone folder beside a script is imported as
    an empty namespace package (the AttributeError a newcomer met), and `python3 -P` avoids it."""
    clone = tmp_path / "trace_roofline"
    clone.mkdir()
    (clone / "README.md").write_text("a clone: no __init__.py at its top\n")
    script = tmp_path / "script.py"
    script.write_text("import trace_roofline as tr\nprint(tr.__file__)\nprint(tr.load_trace)\n")
    # The package as `pip install -e .` puts it: a finder after Python's own path search (a
    # folder on sys.path that holds a regular package would win over the namespace one).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.machinery, sys\n"
        "class Editable:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name == 'trace_roofline':\n"
        f"            return importlib.machinery.PathFinder.find_spec(name, [{str(ROOT)!r}])\n"
        "sys.meta_path.append(Editable)\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    beside = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert beside.returncode == 1 and beside.stdout.splitlines() == ["None"]
    assert "has no attribute 'load_trace'" in beside.stderr
    fixed = subprocess.run([sys.executable, "-P", str(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.startswith(str(ROOT / "trace_roofline" / "__init__.py"))
    page = " ".join((DOCS / "python.md").read_text().split())
    for said in ("## Where to save a script", "has no attribute 'load_trace'", "python3 -P script.py",
                 "git clone URL trace-roofline"):
        assert said in page, said


def test_analyzer_modules_never_import_torch():
    package = ROOT / "trace_roofline"
    mods = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                  for p in package.rglob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(mods) > 10
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_outputs_page_documents_the_report_schema_and_share_scale():
    import trace_roofline as tr

    text = (DOCS / "outputs.md").read_text()
    version = tr.report_dict([])["schema_version"]
    assert f'{{"schema_version": {version}, "traces": [...]}}' in text
    assert "`roof_fraction`" in text and "fractions from 0 to 1" in text
    a = tr.analyze_trace(tr.load_trace(ROOT / "sample_traces" / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"),
                         tr.get_model("qwen2.5-7b"))
    row = tr.report_dict([a])["traces"][0]["operators"][0]
    assert "roof_fraction" in row and "pct_of_roof" not in row
    assert 0 < row["roof_fraction"] <= 1
