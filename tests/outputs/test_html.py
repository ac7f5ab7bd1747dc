"""report.html: content, self-containment, and a real headless Chromium loading it."""

import html
import re
import shutil
import subprocess

import numpy as np
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES
from trace_roofline.outputs.html_report import operator_rows, report_html, warnings

DECODE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
PREFILL = SAMPLES / "qwen2.5-7b_prefill_b1_t2048_h200.json.gz"
HF = SAMPLES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s2048_compiled_h200.json.gz"
# Test-only hooks put first in <head>: report console errors/warnings, uncaught errors and
# failed loads as log lines, then how many Bokeh views rendered once the page has loaded.
_HARNESS = """<script>
for (const k of ["error", "warn"]) { const o = console[k];
  console[k] = (...a) => { o(...a); console.log("HARNESS-" + k + " " + a.join(" ")); }; }
window.addEventListener("error", e => console.log("HARNESS-error " + (e.message || e.target.src)), true);
window.addEventListener("load", () => setTimeout(() => console.log(
  "HARNESS-views " + (window.Bokeh ? Object.keys(Bokeh.index).length : -1) +
  " rows " + document.querySelectorAll("table.sortable tbody tr").length), 500));
</script>"""


@pytest.fixture(scope="module")
def analyses():
    m = tr.get_model("qwen2.5-7b")
    return [tr.analyze_trace(DECODE, m), tr.analyze_trace(PREFILL, m)]


@pytest.fixture(scope="module")
def page(analyses):
    return report_html(analyses)


def test_content(analyses, page):
    rows = operator_rows(analyses)
    ops = sum(int(a.operators["layer"].isna().sum()) for a in analyses)
    assert len(rows) == ops + 2  # every aggregated operator and a whole model per trace
    table = page.split("<h2>Operators</h2>")[1].split("</table>")[0]
    assert table.count("<tr>") == len(rows) + 1
    # the figures are the analysis's: decode q_proj's % of roof, in the table and the chart data
    q = analyses[0].operators.query("operator == 'q_proj' and layer.isna()").iloc[0]
    assert f'data-v="{q.pct_of_roof}"' in table
    assert "ridge I* = 189 FLOP/B" in page  # Bokeh's document JSON escapes non-ASCII twice:
    assert "qwen2.5-7b_prefill_b1_t2048_h200 \\\\u00b7 prefill" in page  # a legend entry
    for field in ("operator", "layer", "shape", "time", "intensity", "% of roof", "evidence"):
        assert f'"{field}"' in page  # hover fields
    assert "Reconciliation" in page and "Warnings" in page


def test_self_contained(page):
    # Nothing is fetched: no script, stylesheet or image from elsewhere.
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', page)
    assert "Bokeh" in page and len(page) < 3_000_000


def test_warnings_name_what_was_not_explained(analyses):
    assert warnings(analyses[0]) == []  # fully attributed and costed, consistent with the preset
    # HF compile expands K/V to 28 heads (repeat_kv): consistent with the preset, no warning
    assert warnings(tr.analyze_trace(HF, tr.get_model("qwen2.5-7b"))) == []
    a = tr.analyze_trace(HF, tr.get_model("llama-3-8b"),
                         options=tr.AnalysisOptions(force=True))  # the wrong model
    w = warnings(a)
    assert w[0].startswith("the trace's shapes contradict model llama-3-8b")
    assert "they fit qwen2.5-7b" in w[0] and "analysed anyway (force)" in w[0]
    assert ("model preset mismatch: attention: n_q,n_kv,d=28,28,128 but llama-3-8b has 32,8,128"
            in w)
    assert re.findall(r'class="warn">([^<]*)', report_html([a])) == [html.escape(x) for x in w]


def _chromium() -> str | None:
    return next((p for n in ("chromium", "chromium-browser", "google-chrome")
                 if (p := shutil.which(n))), None)


def test_in_headless_chromium(page, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium found (.ci/run installs Debian's chromium; apt-get install chromium)")
    html = tmp_path / "report.html"
    html.write_text(page.replace("<head>", "<head>" + _HARNESS, 1), encoding="utf-8")
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0", "--window-size=1280,1500", "--virtual-time-budget=10000",
         f"--screenshot={shot}", html.as_uri()],
        capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    harness = re.findall(r'"(HARNESS-[^"]*)"', log) + re.findall(r'"(Uncaught[^"]*)"', log)
    assert not [h for h in harness if not h.startswith("HARNESS-views")], harness
    views = [h for h in harness if h.startswith("HARNESS-views")]
    assert views, log[-2000:]
    n_views, n_rows = map(int, re.match(r"HARNESS-views (-?\d+) rows (\d+)", views[0]).groups())
    assert n_views >= 1 and n_rows > 20
    assert "net::ERR" not in log
    # The screenshot shows the chart (trace 1's blue and trace 2's red points) and the table.
    from matplotlib.image import imread

    img = imread(shot)[..., :3]
    def near(rgb):
        return np.all(np.abs(img - np.array(rgb) / 255) < 0.08, axis=-1)

    chart, table = img.shape[0] // 2, slice(img.shape[0] * 2 // 3, None)
    assert near((31, 119, 180))[:chart].sum() > 200 and near((214, 39, 40))[:chart].sum() > 200
    assert (img[table].std(axis=-1) < 0.02).mean() > 0.5  # mostly grey/white table rows ...
    assert (img[table].mean(axis=-1) < 0.3).sum() > 2000  # ... with dark text


_EVIL = "</p><script>alert(1)</script><img src=x onerror=alert(2)>"


def _qwen_config(name: str) -> dict:
    """A Hugging Face config.json of Qwen2.5-7B (the sample traces' model) named `name`."""
    return {"_name_or_path": name, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
            "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}


def test_config_and_trace_strings_are_escaped(tmp_path):
    """A config's `_name_or_path` (and a trace's file name) holding markup is
    shown as text, never run: no tag of theirs reaches the page unescaped."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(_qwen_config(_EVIL)))
    trace = tmp_path / "<img src=x onerror=alert(3)>.json.gz"
    trace.write_bytes(DECODE.read_bytes())
    model = tr.get_model(str(config))
    assert model.name == _EVIL
    page = report_html([tr.analyze_trace(trace, model)])
    for tag in ("<script>alert", "<img src=x", "</p><script>"):
        assert tag not in page
    assert html.escape(_EVIL) in page  # shown, as text
    assert html.escape("<img src=x onerror=alert(3)>") in page
