"""The report page (`kvlingo report --html`), the multi-turn and speed runs it reads, and terminal tables that fit
100 columns. The page is opened in headless Chromium, which must decode every embedded figure."""

import json
import re
import shutil
import subprocess

import pytest
from rich.console import Console
from test_registry import fake_fit, migrated_db, store  # noqa: F401  (fixtures)
from typer.testing import CliRunner

from flows.cli import app, print_demo_summary
from registry.bench_runs import latest_result, log_multiturn_run, log_speed_run
from registry.errors import RegistryError
from registry.html_report import CONDITION_NOTES, write_html_report
from registry.report import print_report, refresh_duckdb, short_direction
from registry.tracking import log_benchmark_rows, log_fit_run, tracking_client

runner = CliRunner()
SRC = {"name": "kvlingo-tiny-l", "identity": {"gguf_sha256": "1" * 64}, "config_sha256": "c1", "tokenizer_sha256": "t",
       "layout": {"n_layers": 3}}
TGT = {"name": "kvlingo-tiny-s", "identity": {"gguf_sha256": "2" * 64}, "config_sha256": "c2", "tokenizer_sha256": "t",
       "layout": {"n_layers": 2}}
MULTITURN = {"model_a": "kvlingo-tiny-l", "model_b": "kvlingo-tiny-s", "stage": "distilled", "turns": 3,
             "n_conversations": 4, "modes": {
                 "reprefill": {"per_turn": [1.0, 0.75, 1.0], "mean": 11 / 12, "max_times_a_span_was_translated": 0},
                 "segment": {"per_turn": [1.0, 0.5, 0.75], "mean": 0.75, "max_times_a_span_was_translated": 1},
                 "naive": {"per_turn": [1.0, 0.25, 0.0], "mean": 5 / 12, "max_times_a_span_was_translated": 2}}}
SPEED_ROW = {"switch_s": 0.004, "prefill_s": 0.012, "ratio": 3.0, "flop_ratio": 5.5, "switch_peak_mb": 1.0,
             "prefill_peak_mb": 2.0, "first_token_match": True, "repeats": 3}
SPEED = {"source": "kvlingo-tiny-l", "target": "kvlingo-tiny-s", "translator": "path x", "device": "cpu", "threads": 2,
         "rows": [{"n": 256, **SPEED_ROW}, {"n": 1024, **SPEED_ROW, "ratio": 7.25}]}


def bench_row(benchmark, condition, score, ci=None):
    return {"benchmark": benchmark, "condition": condition, "score": score, "se": 0.05, "n": 60,
            "ci_low": None if ci is None else ci[0], "ci_high": None if ci is None else ci[1],
            "extra": {} if ci is None else {"delta": score - 0.95}}


@pytest.fixture
def logged(store, tmp_path):
    """One fit of tiny-l → tiny-s with benchmark rows, a multi-turn run and a speed run in a fresh store."""
    summary, config, out = fake_fit(tmp_path, source=SRC, target=TGT, distilled_kl=0.2)
    run_id = log_fit_run(summary, config, out)
    log_benchmark_rows(run_id, [bench_row("recall", "target_native", 0.95), bench_row("recall", "distilled", 0.9, (-0.1, 0.0)),
                                bench_row("recall", "empty_prefix", 0.0, (-1.0, -0.9))])
    return {"run_id": run_id, "multiturn": log_multiturn_run(MULTITURN), "speed": log_speed_run(SPEED)}


def test_multiturn_and_speed_runs_round_trip_with_per_turn_metrics(logged):
    client = tracking_client()
    assert [m.value for m in client.get_metric_history(logged["multiturn"], "multiturn.segment.recall")] == [1.0, 0.5, 0.75]
    assert [m.step for m in client.get_metric_history(logged["multiturn"], "multiturn.segment.recall")] == [1, 2, 3]
    assert client.get_run(logged["speed"]).data.metrics["speed.1024.ratio"] == 7.25
    assert latest_result("multiturn", "kvlingo-tiny-l", "kvlingo-tiny-s") == {**MULTITURN, "run_id": logged["multiturn"]}
    assert latest_result("speed", "kvlingo-tiny-s", "kvlingo-tiny-l") is None  # no such experiment
    artifacts = {a.path for a in client.list_artifacts(logged["multiturn"], "plots")}
    assert artifacts == {"plots/multiturn.png"}
    # The fit run carries the page's fit plots as artifacts too.
    assert {a.path for a in client.list_artifacts(logged["run_id"], "plots")} >= {
        "plots/kl_curve.png", "plots/val_kl_bars.png", "plots/scores.png"}


def test_page_embeds_every_figure_and_explains_each_condition(logged, tmp_path):
    page = write_html_report(tmp_path / "out" / "report.html")
    text = (tmp_path / "out" / "report.html").read_text()
    # KL curve and bars, benchmark scores (fit), per-turn plot (multi-turn).
    assert page["figures"] == 4 == text.count('<img class="figure"') == text.count("data:image/png;base64,")
    assert page["directions"] == ["kvlingo-tiny-l → kvlingo-tiny-s"] and len(page["multiturn"]) == 1
    for note in CONDITION_NOTES.values():
        assert note in text.replace("&#x27;", "'")
    assert "0.50×" in text  # distilled 0.2 / closed form 0.4
    assert "[-0.100, +0.000]" in text  # the paired CI of the distilled recall row
    assert re.search(r"<td>1024</td><td>12\.0</td><td>4\.0</td><td>7\.25×</td>", text)  # the speed table
    assert "src=\"http" not in text and "<link" not in text  # self-contained


def test_page_refuses_a_folder_an_empty_store_and_reports_through_the_cli(store, tmp_path):
    with pytest.raises(RegistryError, match="is a folder"):
        write_html_report(tmp_path)
    with pytest.raises(RegistryError, match="no finished fit run .* run `kvlingo demo`"):
        write_html_report(tmp_path / "page.html")
    assert not (tmp_path / "page.html").exists()
    result = runner.invoke(app, ["report", "--html", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.stderr


def test_report_cli_writes_the_page(logged, tmp_path):
    result = runner.invoke(app, ["report", "--html", str(tmp_path / "page.html")])
    assert result.exit_code == 0, result.output
    assert "(4 figures)" in " ".join(result.stderr.split())
    assert (tmp_path / "page.html").read_text().count('<img class="figure"') == 4


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert found, "headless Chromium is needed for the report-page test: infra/bootstrap.sh installs it (apt chromium)"
    return found


def test_chromium_renders_every_figure_of_the_page(logged, tmp_path):
    from PIL import Image

    page = tmp_path / "report.html"
    write_html_report(page)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium(), *flags, "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    # The page's script counts the figures the browser decoded (complete, with a width) after load.
    found = re.search(r'<body data-figures="(\d+)" data-figures-rendered="(\d+)"', dom)
    assert found, dom[:500]
    assert found.groups() == ("4", "4")
    shot = tmp_path / "shot.png"
    subprocess.run([chromium(), *flags, "--window-size=1200,4000", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 4000)
    colours = image.getcolors(maxcolors=1 << 20)
    # The bars' fill colours are on screen: distilled green and closed-form orange (registry.plots).
    present = {rgb for _, rgb in colours}
    assert (0x2F, 0x85, 0x5A) in present and (0xDD, 0x6B, 0x20) in present


def test_report_tables_fit_100_columns_with_one_line_per_row(logged):
    db = refresh_duckdb()
    console = Console(width=100, record=True, color_system=None)
    print_report(db, console=console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 100
    run_lines = [line for line in lines if logged["run_id"][:8] in line]
    assert len(run_lines) == 3  # closed form and distilled rows, best translator: each on one line
    assert any("0.4000" in line and "closed_form" in line for line in run_lines)


def test_demo_summary_fits_100_columns(logged):
    conditions = ["target_native", "source_native", "empty_prefix", "closed_form", "distilled"]
    rows = [bench_row(b, c, 0.5) for b in ("corpus_kl", "first_token_kl", "needle", "recall") for c in conditions]
    fit = {"source": "kvlingo-tiny-l", "target": "kvlingo-tiny-s", "benchmarks": rows,
           "val_kl": {"closed_form": 0.2536, "distilled": 0.0732, "empty_prefix": 3.704, "random_map": 6.772},
           "registry": {"model_uri": "models:/kvlingo-tiny-l--kvlingo-tiny-s/1", "champion": {"version": "1"}}}
    result = {"fits": [fit, {**fit, "source": fit["target"], "target": fit["source"]}], "multiturn": MULTITURN,
              "speed": [SPEED], "html": {"path": "/home/user/.cache/kvlingo/report.html", "figures": 8}}
    console = Console(width=100, record=True, color_system=None)
    print_demo_summary(result, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert re.search(r"tiny-l → tiny-s\s+│\s+0\.254\s+│\s+0\.073\s+│\s+0\.29×", text)
    assert re.search(r"recall\s+│\s+0\.500 \(60\)", text)  # a benchmark row on one line
    assert "switch speed-up tiny-l → tiny-s: 3.00× at 256 tokens, 7.25× at 1024 tokens" in text


def test_short_direction_drops_only_a_shared_prefix():
    assert short_direction("kvlingo-tiny-l", "kvlingo-tiny-s") == "tiny-l → tiny-s"
    assert short_direction("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B") == "Qwen3-0.6B → Qwen3-1.7B"
    assert short_direction("smollm2-135m-instruct", "gemma3-270m") == "smollm2-135m-instruct → gemma3-270m"
    assert short_direction("a", "a-b") == "a → a-b"


def test_demo_refuses_an_unwritable_page_path_before_any_work(tmp_path, monkeypatch):
    import flows.pipeline

    def no_flow(**kwargs):
        raise AssertionError("the demo started although its page path is a folder")

    monkeypatch.setattr(flows.pipeline, "demo_flow", no_flow)
    result = runner.invoke(app, ["demo", "--html", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder: give the HTML file to write" in " ".join(result.stderr.split())
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = runner.invoke(app, ["demo", "--html", str(blocked / "sub" / "page.html")])
    assert result.exit_code == 2 and "is not a writable folder" in " ".join(result.stderr.split())
