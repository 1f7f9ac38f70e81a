"""`kvlingo report --html PATH`: one self-contained HTML page of what the tracking store holds.

Per direction (the newest top-level fit run of each): the stage-2 validation-KL curve, closed form vs distilled
validation KL beside the empty-prefix and random-map controls, the benchmark scores per condition with
intervals, and the switch-speed table when a speed run was logged; per pair, the multi-turn hand-off plot. Each
condition is explained in one line. Figures are the PNGs of `registry.plots` (the same functions draw the fit,
benchmark and multi-turn runs' MLflow artifacts), embedded as data URIs so the page is one file that opens
offline. A small script records on <body> how many figures the browser decoded (`data-figures-rendered`), which
the screenshot test reads.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from registry.errors import RegistryError
from registry.tracking import KIND_TAG, kvlingo_experiments, tracking_client, tracking_uri

# One line per condition: what a reader needs to interpret its numbers.
CONDITION_NOTES = {
    "target_native": "the target prefills the whole context itself: the reference a translated cache should match",
    "source_native": "the source answers from its own cache: the model we switch away from (on KL rows, how far "
                     "the source's predictions are from the target's, not a translation error)",
    "closed_form": "the target decodes from the stage-1 translation (per-layer linear maps solved in closed form "
                   "from Gram statistics)",
    "distilled": "the target decodes from the stage-2 translation (the closed form refined by self-distillation)",
    "empty_prefix": "the floor: the target reads only the last context token, nothing of the history",
    "random_map": "a control: random maps of the translator's shapes (validation KL only)",
}
MODE_NOTES = {
    "reprefill": "each model re-reads what it lacks itself (the reference, and the cost the switch avoids)",
    "segment": "only the span written since a model last held the conversation is translated",
    "naive": "the incoming model's whole cache is a translation of the outgoing one's, so old text is translated "
             "again at every hand-off",
}
_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#1a202c}
h1{font-size:1.6em} h2{border-bottom:1px solid #cbd5e0;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.8em 0} td,th{border:1px solid #e2e8f0;padding:.25em .6em;text-align:right}
th{background:#f7fafc} td:first-child,th:first-child{text-align:left}
figure{display:inline-block;margin:.5em 1em .5em 0} img.figure{max-width:100%;border:1px solid #e2e8f0}
.note{color:#4a5568;font-size:.92em} dt{font-weight:600;margin-top:.4em} dd{margin-left:1.5em;color:#4a5568}
"""
_SCRIPT = """
window.addEventListener('load', function () {
  var figures = Array.prototype.slice.call(document.querySelectorAll('img.figure'));
  document.body.setAttribute('data-figures', figures.length);
  document.body.setAttribute('data-figures-rendered',
    figures.filter(function (f) { return f.complete && f.naturalWidth > 0; }).length);
});
"""


# ---------------------------------------------------------------------------------------------------------------
# What the store holds
# ---------------------------------------------------------------------------------------------------------------


def collect_page_data() -> dict[str, Any]:
    """{"directions": [...], "multiturn": [...]} from the tracking store.

    A direction: source, target, run_id, val_kl and val_kl_se ({condition: value}), history (train/val KL per
    step), bench (rows as in `registry.report.bench_rows`), speed (the newest speed result or None). A multi-turn
    entry: the newest `tasks.multiturn` result logged for a pair.

    Raises:
        TrackingUnavailableError: the store cannot be reached.
    """
    from registry.bench_runs import latest_result

    client = tracking_client()
    directions, multiturn = [], []
    for experiment in sorted(kvlingo_experiments(client), key=lambda e: e.name):
        source, target = experiment.tags.get("source"), experiment.tags.get("target")
        run = _newest_fit(client, experiment.experiment_id)
        if run is not None:
            directions.append(_direction(client, run, source, target))
            directions[-1]["speed"] = latest_result("speed", source, target)
        handoff = latest_result("multiturn", source, target)
        if handoff is not None:
            multiturn.append(handoff)
    return {"directions": directions, "multiturn": multiturn}


def _newest_fit(client, experiment_id: str):
    """The newest finished fit run that is not a sweep cell (a cell is nested under its sweep), else the newest
    finished fit run; None when the experiment has none."""
    runs = client.search_runs([experiment_id],
                              filter_string=f"tags.`{KIND_TAG}` = 'fit' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=200)
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return (top or runs or [None])[0]


def _direction(client, run, source: str, target: str) -> dict[str, Any]:
    from registry.report import bench_rows

    metrics = run.data.metrics
    record = {"run_id": run.info.run_id, "tags.source": source, "tags.target": target,
              **{f"metrics.{k}": v for k, v in metrics.items()}}
    history: dict[int, dict[str, Any]] = {}
    for key in ("train_kl", "val_kl"):
        for point in client.get_metric_history(run.info.run_id, key):
            history.setdefault(point.step, {"step": point.step})[key] = point.value
    return {
        "source": source, "target": target, "run_id": run.info.run_id, "stage": run.data.tags.get("stage"),
        "val_kl": _group(metrics, "val_kl."), "val_kl_se": _group(metrics, "val_kl_se."),
        "history": [history[s] for s in sorted(history)], "bench": bench_rows(record),
    }


def _group(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------------------------


def check_page_path(path: str | Path) -> Path:
    """The page's path, checked before any work: not a folder, and its nearest existing parent is a writable folder.

    Raises:
        RegistryError: what is wrong and what to pass instead.
    """
    import os

    path = Path(path)
    if path.is_dir():
        raise RegistryError(f"{path} is a folder: give the HTML file to write, e.g. {path / 'report.html'}")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise RegistryError(f"cannot write the report page {path}: {parent} is not a writable folder")
    return path


def write_html_report(path: str | Path, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the page to `path` (parent folders created). Returns {"path", "figures", "directions",
    "multiturn"}: the file, how many figures it embeds, and what it covers.

    Args:
        data: `collect_page_data()`'s result; read from the store when None.
    Raises:
        RegistryError: nothing to report (no fit run logged), `path` is a folder, or it cannot be written.
        TrackingUnavailableError: the store cannot be reached.
    """
    path = check_page_path(path)
    data = collect_page_data() if data is None else data
    if not data["directions"]:
        raise RegistryError(f"no finished fit run in the tracking store {tracking_uri()}: run `kvlingo demo` or "
                            "`kvlingo fit SOURCE TARGET --track` first")
    with tempfile.TemporaryDirectory(prefix="kvlingo-page-") as tmp:
        page, figures = _render(data, Path(tmp))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(page, encoding="utf-8")
        partial.replace(path)
    except OSError as err:
        raise RegistryError(f"cannot write the report page {path}: {err}") from err
    return {"path": str(path), "figures": figures,
            "directions": [f"{d['source']} → {d['target']}" for d in data["directions"]],
            "multiturn": [f"{m['model_a']} ⇄ {m['model_b']}" for m in data["multiturn"]]}


def _render(data: dict[str, Any], tmp: Path) -> tuple[str, int]:
    from registry import plots

    figures: list[str] = []

    def figure(draw, name: str, *args, **kwargs) -> str:
        png = draw(*args, tmp / f"{len(figures)}-{name}.png", **kwargs)
        if png is None:
            return ""
        figures.append(name)
        encoded = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        return f'<figure><img class="figure" alt="{html.escape(name)}" src="data:image/png;base64,{encoded}"></figure>'

    parts = [f"<h1>kvlingo report</h1><p class='note'>{len(data['directions'])} direction(s) from the tracking store "
             f"{html.escape(tracking_uri())}, written {dt.datetime.now().isoformat(timespec='seconds')}. Validation KL "
             "is KL(target reading its own prefill ‖ target reading the condition's cache) over the held-out "
             "continuations, in nats per token: lower is better.</p>", _conditions_section()]
    for d in data["directions"]:
        title = f"{d['source']} → {d['target']}"
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(_kl_summary(d))
        parts.append(figure(plots.kl_curve, "kl_curve", d["history"], title=f"stage 2: {title}"))
        parts.append(figure(plots.kl_bars, "val_kl_bars", d["val_kl"], d["val_kl_se"], title=f"validation KL: {title}"))
        if d["bench"]:
            parts.append("<h3>Benchmarks</h3>" + _bench_table(d["bench"]))
            parts.append(figure(plots.benchmark_scores, "benchmark_scores", d["bench"], title=f"benchmarks: {title}"))
        if d.get("speed"):
            parts.append("<h3>Switch speed</h3>" + _speed_table(d["speed"]))
    for m in data["multiturn"]:
        title = f"{m['model_a']} ⇄ {m['model_b']}"
        parts.append(f"<h2>Multi-turn hand-off: {html.escape(title)}</h2>" + _multiturn_table(m))
        parts.append(figure(plots.multiturn_per_turn, "multiturn", m["modes"], title=f"hand-off {title}"))
    body = "\n".join(p for p in parts if p)
    page = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>kvlingo report</title>"
            f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>{body}</body></html>")
    return page, len(figures)


def _conditions_section() -> str:
    items = "".join(f"<dt>{name}</dt><dd>{html.escape(note)}</dd>" for name, note in CONDITION_NOTES.items())
    return f"<h2>Conditions</h2><dl>{items}</dl>"


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


def _kl_summary(d: dict[str, Any]) -> str:
    kl, se = d["val_kl"], d["val_kl_se"]
    rows = "".join(f"<tr><td>{c}</td><td>{_fmt(kl.get(c))}</td><td>{_fmt(se.get(c))}</td></tr>"
                   for c in ("closed_form", "distilled", "empty_prefix", "random_map") if c in kl)
    ratio = ""
    if kl.get("distilled") is not None and kl.get("closed_form"):
        ratio = f"<p>Stage 2 brings the validation KL to <b>{kl['distilled'] / kl['closed_form']:.2f}×</b> the closed form's.</p>"
    return (f"<p class='note'>fit run {html.escape(d['run_id'])}</p><table><tr><th>condition</th><th>validation KL"
            f"</th><th>± SE</th></tr>{rows}</table>{ratio}")


def _ci(row: dict[str, Any]) -> str:
    return "" if row.get("ci_low") is None else f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]"


def _bench_table(rows: list[dict[str, Any]]) -> str:
    body = "".join(
        f"<tr><td>{html.escape(r['benchmark'])}</td><td>{html.escape(r['condition'])}</td><td>{_fmt(r['score'], '.3f')}"
        f"</td><td>{_fmt(r.get('se'), '.3f')}</td><td>{_fmt(r.get('n'), '.0f')}</td><td>{_fmt(r.get('delta'), '+.3f')}</td>"
        f"<td>{_ci(r)}</td></tr>"
        for r in rows)
    return ("<table><tr><th>benchmark</th><th>condition</th><th>score</th><th>± SE</th><th>n</th>"
            "<th>Δ vs target native</th><th>paired 95% CI</th></tr>" + body + "</table>")


def _speed_table(result: dict[str, Any]) -> str:
    body = "".join(
        f"<tr><td>{r['n']}</td><td>{r['prefill_s'] * 1e3:.1f}</td><td>{r['switch_s'] * 1e3:.1f}</td>"
        f"<td>{r['ratio']:.2f}×</td><td>{r['flop_ratio']:.1f}×</td><td>{'yes' if r['first_token_match'] else 'no'}</td></tr>"
        for r in result["rows"])
    return (f"<p class='note'>translator: {html.escape(str(result.get('translator')))}; {result.get('device')}, "
            f"{result.get('threads')} thread(s); medians of {result['rows'][0]['repeats'] if result['rows'] else 0} runs."
            "</p><table><tr><th>prefix tokens</th><th>re-prefill ms</th><th>switch ms</th><th>speed-up</th>"
            "<th>FLOP ratio</th><th>same first token</th></tr>" + body + "</table>")


def _multiturn_table(result: dict[str, Any]) -> str:
    body = "".join(
        f"<tr><td>{mode}</td><td>{row['mean']:.3f}</td><td>{row['max_times_a_span_was_translated']}</td>"
        f"<td>{html.escape(MODE_NOTES.get(mode, ''))}</td></tr>" for mode, row in result["modes"].items())
    return (f"<p class='note'>{result['n_conversations']} conversations × {result['turns']} turns, "
            f"{html.escape(str(result.get('stage')))} translators.</p><table><tr><th>mode</th><th>mean recall</th>"
            "<th>max translations of one span</th><th>what it is</th></tr>" + body + "</table>")
