"""The `kvlingo` command line. Commands validate their arguments before any model loads.

With `--json` a command prints exactly one JSON object on stdout (a public contract); logs, progress bars
and errors go to stderr. Exit code 0 means success, 1 a failed check, 2 bad input or an unavailable model.
"""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from infra.settings import apply_offline_defaults, stop_local_services
from translators.errors import KvlingoError, NonFiniteError

app = typer.Typer(
    help="kvlingo: fit, evaluate and deploy KV-cache translators between language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)

DOCTOR_PROMPT = (
    "The committee met on Tuesday to review the budget. After a long discussion about the new library, "
    "the chair asked everyone to vote. The result was"
)


def _fail(err: Exception, code: int = 2) -> NoReturn:
    """Print `err` on stderr and exit with `code` (2: bad input or an unavailable model; 1: a failed check)."""
    err_console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback()
def _main() -> None:
    apply_offline_defaults()


@app.command()
def models() -> None:
    """List the model zoo (names usable wherever a MODEL is expected; hub ids and local dirs work too)."""
    from infra.zoo import ZOO

    table = Table("name", "source", "description")
    for spec in ZOO.values():
        table.add_row(spec.name, spec.source, spec.description)
    Console().print(table)


@app.command()
def build(
    names: Annotated[
        list[str] | None, typer.Argument(help="embedded models to build (with their parents); default: all")
    ] = None,
    jobs: Annotated[int | None, typer.Option(min=1, help="builds at a time, one process each (default: CPU count)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Build embedded models ahead of first use, independent lineages side by side (the weights do not change:
    every build trains on a pinned thread count). Exit code 1 if any build failed."""
    import os

    from infra.embedded import build_embedded, embedded_names

    started = time.perf_counter()
    try:  # every name is checked before anything builds
        outcomes = build_embedded(names or embedded_names(), jobs=jobs or os.cpu_count() or 1)
    except KvlingoError as err:
        _fail(err)
    wall = round(time.perf_counter() - started, 1)
    ok = all(o.status in ("built", "cached") for o in outcomes)
    if as_json:
        sys.stdout.write(json.dumps({"wall_seconds": wall, "ok": ok, "models": [vars(o) for o in outcomes]}) + "\n")
    else:
        table = Table("model", "status", "seconds", "detail", title=f"kvlingo build ({wall:.1f} s wall)")
        for o in outcomes:
            table.add_row(o.name, o.status, f"{o.seconds:.1f}", o.error or o.directory)
        Console().print(table)
    raise typer.Exit(0 if ok else 1)


@app.command()
def doctor(
    model: Annotated[str, typer.Argument(help="zoo name, hub id or local model directory")],
    point: Annotated[
        list[str] | None, typer.Option("--point", help="capture point(s) to check; default: all three")
    ] = None,
    prompt: Annotated[str, typer.Option(help="text of the round-trip prompt")] = DOCTOR_PROMPT,
    tolerance: Annotated[float, typer.Option(help="max |Δlogit| accepted (fp32)")] = 1e-4,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Round-trip check before fitting: capture → inject → one decoding step vs the model's own prefill + step.

    Exit code 0 iff every point reproduces the native logits within tolerance and gradients reach every layer.
    """
    from translators.points import CAPTURE_POINTS, check_point

    try:
        points = [check_point(p) for p in (point or CAPTURE_POINTS)]
        report = _doctor_report(model, points, prompt, tolerance)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        table = Table("point", "max |Δlogit|", "gradients", title=f"kvlingo doctor {model} ({report['n_tokens']} tokens)")
        for name, row in report["points"].items():
            table.add_row(name, f"{row['max_abs_logit_diff']:.2e}", "ok" if row["grad_ok"] else f"missing {row['layers_without_grad']}")
        Console().print(table)
        Console().print("[green]ok[/]" if report["ok"] else "[red]FAILED[/]")
    raise typer.Exit(0 if report["ok"] else 1)


def _doctor_report(model_name: str, points: list[str], prompt: str, tolerance: float) -> dict:
    from infra.zoo import load_model, resolve_model
    from translators.capture import check_length
    from translators.objects import object_names
    from translators.roundtrip import roundtrip

    resolve_model(model_name)  # fail on a bad name before any loading
    loaded = load_model(model_name)
    ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids[0]
    check_length(loaded.layout, int(ids.numel()), what="doctor prompt")
    rows = {}
    for p in points:
        result = roundtrip(loaded.model, loaded.layout, ids, p)
        rows[p] = {
            "max_abs_logit_diff": result.max_abs_logit_diff,
            "grad_ok": result.grad_ok,
            "layers_without_grad": list(result.layers_without_grad),
            "ok": result.grad_ok and result.max_abs_logit_diff <= tolerance,
        }
    return {
        "model": loaded.name,
        "family": loaded.layout.family,
        "n_layers": loaded.layout.n_layers,
        "n_tokens": int(ids.numel()),
        "objects": list(object_names(loaded.layout)),
        "tolerance": tolerance,
        "points": rows,
        "ok": all(r["ok"] for r in rows.values()),
    }


@app.command()
def fit(
    source: Annotated[str, typer.Argument(help="source model (its cache is translated)")],
    target: Annotated[str, typer.Argument(help="target model (decodes from the translated cache)")],
    stage1_only: Annotated[bool, typer.Option("--stage1-only", help="closed-form fit only, no distillation")] = False,
    assignment: Annotated[str | None, typer.Option(help="layer assignment: depth | greedy | r2")] = None,
    nu: Annotated[int | None, typer.Option(help="source layers per target layer (ν)")] = None,
    point: Annotated[str | None, typer.Option(help="capture point: pre_norm | post_norm | post_rope")] = None,
    ridge: Annotated[float | None, typer.Option(help="ridge λ relative to the mean diagonal (0: pseudo-inverse)")] = None,
    head_wise: Annotated[bool | None, typer.Option("--head-wise/--head-mixing", help="block-diagonal maps")] = None,
    state_ridge: Annotated[float | None, typer.Option(help="hybrid pairs: shrinkage of the state corrections towards "
                           "plain copy (λ relative to the mean Gram diagonal)")] = None,
    weighting: Annotated[str | None, typer.Option(help="stage-1 norm: uniform | attention (App. O)")] = None,
    token_identity: Annotated[str | None, typer.Option(help="append the target's embedding of each token id to the "
                              "maps' input: auto (the default: codebook for a same-tokenizer pair of GQA caches) | codebook (ids decoded "
                              "from the source's layer-0 cache) | ids | none")] = None,
    data: Annotated[list[str] | None, typer.Option(help="'embedded[:N]', a local json/jsonl file or a HF dataset id; "
                    "repeat it for a mixture (one item from each source in turn)")] = None,
    n_train: Annotated[int | None, typer.Option(help="training samples")] = None,
    stats_samples: Annotated[int | None, typer.Option(help="stage 1 reads the first N training samples (default: "
                             "the config's)")] = None,
    n_val: Annotated[int | None, typer.Option(help="held-out validation samples")] = None,
    seed: Annotated[int | None, typer.Option(help="seed for sampling and controls")] = None,
    steps: Annotated[int | None, typer.Option(help="stage-2 optimizer steps")] = None,
    lr: Annotated[float | None, typer.Option(help="stage-2 learning rate")] = None,
    n_select: Annotated[int | None, typer.Option(help="training conversations held out from stage 2 to choose the "
                                                      "checkpoint it returns (0: the last step)")] = None,
    workers: Annotated[int | None, typer.Option(help="Ray workers for stage-1 statistics and stage 2 (1: one process)")] = None,
    gpu: Annotated[bool | None, typer.Option("--gpu/--no-gpu", help="one GPU per Ray Train worker (nccl); needs "
                   "--workers > 1 and CUDA")] = None,
    ray_address: Annotated[str | None, typer.Option(envvar="RAY_ADDRESS", help="Ray cluster address (default: a "
                           "local Ray when --workers > 1, else one process)")] = None,
    output_dir: Annotated[Path | None, typer.Option(help="artifact directory (default: one per run fingerprint)")] = None,
    resume: Annotated[bool | None, typer.Option("--resume/--no-resume", help="resume stage 2 on an identical run "
                      "fingerprint (default; another run in the directory is refused) or start over")] = None,
    seeds: Annotated[str | None, typer.Option(help="comma-separated stage-2 seeds, e.g. 0,1,2: mean ± seed SD")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config; CLI options override it")] = None,
    track: Annotated[bool, typer.Option("--track", help="run as the Prefect flow: benchmarks, MLflow run, registry")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Fit a translator SOURCE → TARGET: stage 1 (closed form) and, without --stage1-only, stage 2.

    With --track the fit runs as the `kvlingo-fit` Prefect flow: quick benchmarks, an MLflow run in the pair's
    experiment, and registration as `<source>--<target>` (candidate; the best version becomes champion).

    A pair with a linear-attention hybrid side (Gated DeltaNet) fits every state strategy it admits (zero, copy,
    copy + correction, replay) and keeps the best on the selection conversations; --track does not take hybrids yet.

    Exit code 1 when training diverges (NaN/Inf loss or gradients: lower the learning rate) or the disk fills (the
    message says how to free the statistics store; a re-run resumes), 2 on bad input.
    """
    from flows.fit import run_fit
    from infra.config import FitConfig, load_config

    overrides = dict(
        source=source, target=target, stage1_only=stage1_only or None, assignment=assignment, nu=nu, point=point,
        ridge=ridge, head_wise=head_wise, state_ridge=state_ridge, weighting=weighting, token_identity=token_identity,
        data=data, n_train=n_train, stats_samples=stats_samples, n_val=n_val, seed=seed, output_dir=output_dir,
        steps=steps, lr=lr, n_select=n_select, workers=workers, gpu=gpu, ray_address=ray_address, resume=resume,
    )
    try:
        overrides["seeds"] = parse_seeds(seeds) if seeds is not None else None
        cfg = load_config(FitConfig, config, overrides)
        if track:
            from flows.pipeline import fit_flow, start_local_prefect_api
            from registry.tracking import use_tracking_store

            use_tracking_store()  # an unreachable tracking server fails here, before any compute
            start_local_prefect_api()
            summary = fit_flow(cfg)
        else:
            summary = run_fit(cfg)
    except NonFiniteError as err:  # divergence: a failed run, not bad input
        _fail(err, 1)
    except KvlingoError as err:
        _fail(err)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        from tasks.stats_store import disk_full_message

        _fail(disk_full_message(err), 1)  # the machine, not the input: a failed run
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    table = Table("condition", "validation KL (nats/token)", "± se", "first-token KL", title=f"{summary['source']} → {summary['target']}")
    for name, value in summary["val_kl"].items():
        table.add_row(name, f"{value:.4f}", f"{summary['val_kl_se'][name]:.4f}", f"{summary['first_token_kl'][name]:.4f}")
    console = Console()
    console.print(table)
    if summary.get("hybrid"):
        console.print(f"closed form: {summary['closed_form_strategy']} (of {', '.join(summary['strategies'])})")
        console.print(f"artifact: {summary['artifact']}")
        return
    console.print(f"held-out R²: keys {summary['r2']['keys']:.3f}, values {summary['r2']['values']:.3f}")
    if "stage2_gain" in summary:
        gain = summary["stage2_gain"]
        console.print(f"stage 2: distilled − closed form {gain['kl_difference']:+.4f} ± {gain['se']:.4f} nats/token "
                      f"(paired SE; ratio {gain['ratio']:.2f}×)")
    if "val_kl_seed_sd" in summary:
        console.print(f"distilled over seeds {summary['seeds']}: {summary['val_kl']['distilled']:.4f} "
                      f"± {summary['val_kl_seed_sd']['distilled']:.4f} (seed SD)")
    console.print(f"artifact: {summary['artifact']}")
    console.print(f"run fingerprint: {summary['fingerprint']}")


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' → [0, 1, 2].

    Raises:
        ConfigError: not comma-separated integers, or a seed repeated.
    """
    from translators.errors import ConfigError

    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers such as 0,1,2; got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds lists a seed twice: {text!r}")
    return seeds


@app.command()
def demo(
    steps: Annotated[int | None, typer.Option(help="stage-2 steps per direction (default: kvlingo fit's)")] = None,
    eval_limit: Annotated[int | None, typer.Option(min=1, help="items per benchmark (default 60)")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="also run the local-file benchmarks from this folder")] = None,
    html: Annotated[Path | None, typer.Option(help="report page to write (default $KVLINGO_HOME/report.html)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """The main job on the embedded pair: build the tiny models if needed, fit both directions with kvlingo fit's
    defaults, benchmark, hand off over many turns, time the switch, log to MLflow, register, summarise with
    DuckDB and write the report page."""
    from flows.demo import run_demo

    try:
        result = run_demo(steps=steps, eval_limit=eval_limit, data_dir=data_dir, html=html)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        return
    print_demo_summary(result, Console())


def print_demo_summary(result: dict, console: Console) -> None:
    """The demo's outcome in tables that fit 100 columns: validation KL per direction, one benchmark table per
    direction (scores; intervals are on the page), the hand-off means and the switch speed-ups."""
    table = Table("direction", "closed form", "distilled", "ratio", "empty prefix", "random map",
                  title="validation KL (nats/token, lower is better)")
    for fit in result["fits"]:
        kl = fit["val_kl"]
        ratio = kl["distilled"] / kl["closed_form"] if "distilled" in kl else float("nan")
        table.add_row(_direction(fit["source"], fit["target"]), f"{kl['closed_form']:.3f}",
                      f"{kl.get('distilled', float('nan')):.3f}", f"{ratio:.2f}×", f"{kl['empty_prefix']:.3f}",
                      f"{kl['random_map']:.3f}")
    console.print(table)
    for fit in result["fits"]:
        conditions = list(dict.fromkeys(row["condition"] for row in fit["benchmarks"]))
        if not conditions:
            continue
        bench = Table("benchmark", *(c.replace("_", " ") for c in conditions),
                      title=f"benchmarks {_direction(fit['source'], fit['target'])} (n per condition)")
        for name in dict.fromkeys(row["benchmark"] for row in fit["benchmarks"]):
            cells = {row["condition"]: row for row in fit["benchmarks"] if row["benchmark"] == name}
            bench.add_row(name, *(f"{cells[c]['score']:.3f} ({cells[c]['n']})" if c in cells else "—" for c in conditions))
        console.print(bench)
    if result.get("multiturn"):
        modes = result["multiturn"]["modes"]
        console.print("multi-turn hand-off, mean recall: " + ", ".join(f"{m} {row['mean']:.2f}" for m, row in modes.items()))
    for speed in result.get("speed", []):
        console.print(f"switch speed-up {_direction(speed['source'], speed['target'])}: "
                      + ", ".join(f"{row['ratio']:.2f}× at {row['n']} tokens" for row in speed["rows"]))
    for fit in result["fits"]:
        console.print(f"registered: {fit['registry']['model_uri']} (champion: version {fit['registry']['champion'].get('version')})")
    if result.get("html"):
        console.print(f"report page: [bold]{result['html']['path']}[/] ({result['html']['figures']} figures)")
    console.print("all runs: [bold].venv/bin/kvlingo report[/]; browse: [bold].venv/bin/kvlingo ui[/], then "
                  "http://127.0.0.1:5000")


def _direction(source: str, target: str) -> str:
    """"a → b" for a table cell, without the model names' common prefix (kvlingo-tiny-l → tiny-l)."""
    from registry.report import short_direction

    return short_direction(source, target)


bench_app = typer.Typer(
    help="Speed, memory and hand-off benchmarks: the switch (speed), one distillation step (step) and alternating "
    "multi-turn hand-offs (multiturn).",
    no_args_is_help=True, add_completion=False
)
app.add_typer(bench_app, name="bench")


@bench_app.command("speed")
def bench_speed(
    source: Annotated[str, typer.Argument(help="source model (holds the cache that gets translated)")],
    target: Annotated[str, typer.Argument(help="target model (decodes after the switch)")],
    lengths: Annotated[str, typer.Option(help="comma-separated prefix lengths n")] = "256,1024,2048,4096",
    translator: Annotated[
        str | None, typer.Option(help="PATH, models:/NAME@ALIAS or identity; default: dense identity maps (same "
                                 "model) or a quick closed form")
    ] = None,
    repeats: Annotated[int, typer.Option(help="timed runs per length; medians are reported")] = 3,
    decode_tokens: Annotated[int, typer.Option(help="tokens decoded after each path for the decoding speed")] = 16,
    point: Annotated[str, typer.Option(help="capture point without an artifact: pre_norm | post_norm | post_rope")] = "pre_norm",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads for both paths (default: torch's setting)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Time to first token after a switch (translate + one target step) vs the target's re-prefill.

    The source's capture is not timed (it already holds its cache). Also reports peak memory, decoding speed
    after each path and the FLOP-model ratio.
    """
    from tasks.bench_speed import parse_lengths, run_speed
    from infra.config import SpeedBenchConfig, load_config

    try:
        overrides = dict(source=source, target=target, lengths=parse_lengths(lengths), translator=translator,
                         repeats=repeats, decode_tokens=decode_tokens, point=point, threads=threads)
        cfg = load_config(SpeedBenchConfig, None, overrides)
        result = run_speed(cfg)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    _print_speed(result)


@bench_app.command("serve")
def bench_serve(
    source: Annotated[str, typer.Argument(help="source model (its engine saves the prompt's K/V)")],
    target: Annotated[str, typer.Argument(help="target model (its engine answers after the switch)")],
    lengths: Annotated[str, typer.Option(help="comma-separated prompt lengths n")] = "512,1024,2048",
    translator: Annotated[str, typer.Option(help="PATH, models:/NAME@ALIAS or identity (same model)")] = "identity",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Time to first token through vLLM after a switch vs vLLM's own prefill of the same prompt (same engine,
    one run each; needs the serving venv, `bash infra/bootstrap.sh --serve`)."""
    from tasks.bench_serve import run_serve_bench
    from tasks.bench_speed import parse_lengths

    try:
        result = run_serve_bench(source, target, parse_lengths(lengths), translator)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table("n", "switch s", "prefill s", "prefill / switch", "status")
    for row in result["rows"]:
        table.add_row(str(row["n"]), f"{row['switch_s']:.3f}", f"{row['prefill_s']:.3f}", f"{row['ratio']:.2f}×",
                      row["status"])
    Console().print(table)


@bench_app.command("step")
def bench_step(
    source: Annotated[str, typer.Argument(help="source model")],
    target: Annotated[str, typer.Argument(help="target model (trained through)")],
    prefix_tokens: Annotated[int, typer.Option(help="prefix length n")] = 512,
    continuation_tokens: Annotated[int, typer.Option(help="continuation length m")] = 64,
    repeats: Annotated[int, typer.Option(help="timed repeats (medians)")] = 3,
    translator: Annotated[str | None, typer.Option(help="PATH, models:/NAME@ALIAS or identity (dense identity maps); "
                                                   "default: random ν=1 maps")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """One stage-2 distillation step beside one plain forward+backward of the target on the same tokens."""
    from tasks.bench_step import run_step_bench

    try:
        result = run_step_bench(source, target, prefix_tokens=prefix_tokens, continuation_tokens=continuation_tokens,
                                repeats=repeats, translator_ref=translator)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table("path", "seconds (median)", "peak MB", title=f"{result['source']} → {result['target']}, "
                  f"n={result['prefix_tokens']}, m={result['continuation_tokens']}, {result['device']}")
    for name in ("distill_step", "teacher_prefill", "target_fwd_bwd"):
        table.add_row(name, f"{result['seconds'][name]:.3f}", _num(result["peak_mb"][name]))
    console = Console()
    console.print(table)
    console.print(f"distillation step / target forward+backward: time {result['time_ratio']:.2f}× "
                  f"({result['time_ratio_with_teacher']:.2f}× with an uncached teacher), memory "
                  f"{_num(result['memory_ratio'])}×  [{result['memory_measure']}]")


@bench_app.command("multiturn")
def bench_multiturn(
    model_a: Annotated[str, typer.Argument(help="model holding turns 1, 3, 5, …")],
    model_b: Annotated[str, typer.Argument(help="model holding turns 2, 4, 6, …")],
    stage: Annotated[str, typer.Option(help="which fitted translators: closed_form | distilled")] = "distilled",
    fit_dir_ab: Annotated[Path | None, typer.Option(help="fit directory of A → B (default: the pair's run dir)")] = None,
    fit_dir_ba: Annotated[Path | None, typer.Option(help="fit directory of B → A")] = None,
    translator_ab: Annotated[str | None, typer.Option(help="A → B translator: PATH, models:/NAME@ALIAS or identity "
                             "(instead of --fit-dir-ab)")] = None,
    translator_ba: Annotated[str | None, typer.Option(help="B → A translator (instead of --fit-dir-ba)")] = None,
    conversations: Annotated[int, typer.Option(help="held-out conversations")] = 8,
    turns: Annotated[int, typer.Option(help="alternating turns per conversation (2 to 12)")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Alternating hand-offs: per-turn recall under re-prefill, segment-wise and naive translation."""
    from tasks.multiturn import run_multiturn

    try:
        result = run_multiturn(model_a, model_b, stage=stage, fit_dir_ab=fit_dir_ab, fit_dir_ba=fit_dir_ba,
                               translator_ab=translator_ab, translator_ba=translator_ba,
                               n_conversations=conversations, turns=turns)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table("mode", *[f"turn {t + 1}" for t in range(result["turns"])], "mean", "max translations of a span",
                  title=f"recall per turn, {result['model_a']} ⇄ {result['model_b']} ({result['stage']})")
    for mode, row in result["modes"].items():
        table.add_row(mode, *[f"{x:.2f}" for x in row["per_turn"]], f"{row['mean']:.2f}", str(row["max_times_a_span_was_translated"]))
    Console().print(table)


def _print_speed(result: dict) -> None:
    if result.get("hybrid"):
        _print_hybrid_speed(result)
        return
    table = Table("n", "switch (s)", "translate (s)", "step (s)", "re-prefill (s)", "speed-up", "FLOP ratio",
                  "peak MB switch / prefill", "decode tok/s switch / native",
                  title=f"switch {result['source']} → {result['target']} ({result['translator']}, "
                        f"{result['device']}, {result['dtype']}, {result['threads']} threads)")
    for r in result["rows"]:
        table.add_row(
            str(r["n"]), f"{r['switch_s']:.3f}", f"{r['translate_s']:.3f}", f"{r['step_s']:.3f}", f"{r['prefill_s']:.3f}",
            f"{r['ratio']:.1f}×", f"{r['flop_ratio']:.1f}×",
            f"{_num(r['switch_peak_mb'])} / {_num(r['prefill_peak_mb'])}",
            f"{_num(r['switch_decode_tok_s'])} / {_num(r['native_decode_tok_s'])}",
        )
    console = Console()
    console.print(table)
    console.print(f"memory: {result['memory']}")


def _print_hybrid_speed(result: dict) -> None:
    """The stages in milliseconds; `same` says whether the switch's first greedy token equals re-prefill's."""
    table = Table("n", "route", "maps", "states", "inject", "step", "switch", "prefill", "×", "same",
                  title=f"switch {result['source']} → {result['target']}, ms ({result['device']}, "
                        f"{result['threads']} threads)")
    for r in result["rows"]:
        ms = [f"{1000 * r[key]:.1f}" for key in ("maps_s", "states_s", "inject_s", "first_step_s", "switch_s",
                                                  "prefill_s")]
        table.add_row(str(r["n"]), r["route"], *ms, f"{r['ratio']:.1f}", "yes" if r["first_token_match"] else "no")
    console = Console()
    console.print(table)
    console.print(result["translator"])


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


@app.command(name="eval")
def eval_command(
    source: Annotated[str, typer.Argument(help="source model")],
    target: Annotated[str, typer.Argument(help="target model")],
    suite: Annotated[str | None, typer.Option(help="data_free | quick | full (default: data_free without --data-dir, "
                                               "quick with it)")] = None,
    translator: Annotated[list[str] | None, typer.Option("--translator", help="PATH, models:/NAME@ALIAS, or identity (repeatable)")] = None,
    benchmark: Annotated[list[str] | None, typer.Option("--benchmark", help="run only these benchmarks (repeatable; "
                                                        "any module of evals/benchmarks/)")] = None,
    limit: Annotated[int | None, typer.Option(help="items per benchmark")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="folder with the local benchmark files")] = None,
    fit_dir: Annotated[Path | None, typer.Option(help="fit directory holding closed_form/ and distilled/")] = None,
    ruler_lengths: Annotated[str | None, typer.Option(help="comma-separated RULER context lengths in tokens")] = None,
    judge_url: Annotated[str | None, typer.Option(help="OpenAI-compatible judge endpoint")] = None,
    judge_model: Annotated[str | None, typer.Option(help="judge model (endpoint model name or zoo model)")] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Ray actors scoring (benchmark, condition, item shard) units; rows "
                       "equal the one-process run (1: one process)")] = None,
    ray_address: Annotated[str | None, typer.Option(envvar="RAY_ADDRESS", help="Ray cluster address (default: a "
                           "local Ray when --workers > 1, else one process)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Score the pair under target-native, source-native, empty-prefix and translated caches on the same items.

    Without --data-dir the data-free suite runs (continuation KL, first-token KL, recall, needle retrieval), so
    any pair with a fit (or --translator) can be evaluated out of the box; the benchmarks are listed in the
    README and in evals/benchmarks/ (one module each).
    """
    from tasks.evaluate import EvalConfig, run_eval
    from infra.config import load_config

    try:
        lengths = [int(x) for x in ruler_lengths.split(",")] if ruler_lengths else None
    except ValueError:
        _fail(KvlingoError(f"--ruler-lengths must be comma-separated integers, got {ruler_lengths!r}"))
    overrides = dict(source=source, target=target, suite=suite, translators=translator, benchmarks=benchmark,
                     limit=limit, data_dir=data_dir, fit_dir=fit_dir, ruler_lengths=lengths, judge_url=judge_url,
                     judge_model=judge_model, workers=workers, ray_address=ray_address)
    try:
        result = run_eval(load_config(EvalConfig, None, overrides),
                          on_benchmark=lambda name: err_console.print(f"[dim]benchmark: {name}[/]"))
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table("benchmark", "condition", "score", "± se", "n", "Δ vs target native [95% CI]",
                  title=f"{result['source']} → {result['target']}" + (f" ({result['suite']} suite)" if result.get("suite") else ""),
                  caption="↑ higher is better, ↓ lower is better")
    for row in result["rows"]:
        ci = f"{row['extra'].get('delta', float('nan')):+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]" if row.get("ci_low") is not None else ""
        better = row["extra"].get("higher_is_better")
        arrow = "" if better is None else (" ↑" if better else " ↓")
        table.add_row(row["benchmark"] + arrow, row["condition"], f"{row['score']:.3f}", f"{row['se']:.3f}", str(row["n"]), ci)
    Console().print(table)
    for error in result["errors"]:
        err_console.print(f"[yellow]{error['benchmark']} not scored:[/] {error['error']}")


@app.command()
def attribute(
    fit_dir: Annotated[Path, typer.Argument(help="directory of a finished `kvlingo fit` (its --output-dir or run dir)")],
    stage: Annotated[str, typer.Option(help="closed_form | distilled")] = "distilled",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Where a fit's remaining KL sits: for each target layer and cache object, the validation KL with that object
    the target's own and the rest translated, on the fit's own validation conversations (pairs that share a
    tokenizer, per-token caches: GQA, MLA, DSA)."""
    from tasks.attribute import attribute_fit

    try:
        result = attribute_fit(fit_dir, stage)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    base = result["translated"]
    table = Table("layer", "native object", "KL", "removed ± paired se", "share",
                  title=f"{result['source']} → {result['target']} ({result['stage']}): translated KL "
                        f"{base['mean']:.4f} ± {base['se']:.4f} on {result['n_val']} validation conversations",
                  caption="share: the fraction of the translated KL the native object removes (< 0: the translated "
                          "maps compensate each other)")
    for row in result["rows"]:
        table.add_row(str(row["layer"]), row["objects"], f"{row['kl']:.4f}",
                      f"{row['removed']:+.4f} ± {row['removed_se']:.4f}", f"{row['share']:+.0%}")
    Console().print(table)


@app.command()
def report(
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
    parquet: Annotated[Path | None, typer.Option("--parquet", help="also write every table as DIR/<table>.parquet")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="also write the report page (plots, one HTML file) to PATH")] = None,
) -> None:
    """Summarise logged fits: runs, best translator per direction, lr sweep, benchmark deltas (DuckDB).

    Refreshes $KVLINGO_HOME/kvlingo.duckdb from the MLflow store first.
    """
    from registry.html_report import check_page_path, write_html_report
    from registry.report import export_parquet, print_report, refresh_duckdb, report_json

    try:
        if html is not None:
            check_page_path(html)
        db = refresh_duckdb()
        summary = report_json(db)
        files = export_parquet(db, parquet) if parquet else []
        page = write_html_report(html) if html is not None else None
    except KvlingoError as err:
        _fail(err)
    err_console.print(f"[dim]DuckDB summary: {db}" + (f"; parquet: {parquet}" if files else "")
                      + (f"; page: {page['path']} ({page['figures']} figures)" if page else "") + "[/]")
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    print_report(db, Console())


store_app = typer.Typer(
    help="The stage-1 statistics store ($KVLINGO_HOME/stats): what it holds (show) and freeing space (prune).",
    no_args_is_help=True, add_completion=False
)
app.add_typer(store_app, name="stats-store")


@store_app.command("show")
def stats_store_show(
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """How many statistics shards the store holds, their size, and when a fit last read the oldest and newest."""
    from tasks.stats_store import store_root, store_usage

    usage = store_usage(store_root())
    if as_json:
        sys.stdout.write(json.dumps(usage) + "\n")
        return

    def when(stamp: float | None) -> str:
        return "—" if stamp is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))

    Console().print(f"{usage['root']}: {usage['entries']} shard(s), {usage['bytes'] / 1e9:.2f} GB"
                    f" ({usage['tmp_entries']} temporary); last read: oldest {when(usage['oldest_use'])},"
                    f" newest {when(usage['newest_use'])}", soft_wrap=True)


@store_app.command("prune")
def stats_store_prune(
    max_gb: Annotated[float | None, typer.Option(help="keep at most this many GB, the most recently read shards")] = None,
    unused_days: Annotated[float | None, typer.Option(help="remove shards no fit has read for this many days")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only list what would be removed")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Remove whole statistics shards (least recently read first) and temporary ones left by killed fits.

    A later fit recomputes any shard it needs. Do not prune while a fit of the same pair is in stage 1.
    """
    from tasks.stats_store import prune_store, store_root

    try:
        result = prune_store(store_root(), max_gb=max_gb, unused_days=unused_days, dry_run=dry_run)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    verb = "would remove" if dry_run else "removed"
    Console().print(f"{verb} {len(result['removed'])} shard(s), {result['freed_bytes'] / 1e9:.2f} GB; "
                    f"{result['kept']} kept, {result['kept_bytes'] / 1e9:.2f} GB ({result['root']})", soft_wrap=True)


@app.command()
def ui(
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 5000,
    host: Annotated[str, typer.Option(help="interface to bind (127.0.0.1 keeps the UI on this machine)")] = "127.0.0.1",
) -> None:
    """Serve the MLflow UI over the platform's tracking store until Ctrl-C (stops the server cleanly)."""
    from registry.tracking import tracking_uri
    from registry.ui import LOOPBACK, serve_forever

    if host != LOOPBACK:
        err_console.print(f"[yellow]warning:[/] binding {host}: the MLflow UI has no authentication")

    def ready(server) -> None:
        Console().print(f"MLflow UI at {server.url} (store {tracking_uri()}); Ctrl-C to stop", soft_wrap=True)

    try:
        code = serve_forever(port, host, ready)
    except KvlingoError as err:
        _fail(err)
    raise typer.Exit(code)


@app.command()
def serve(
    source: Annotated[str, typer.Argument(help="source model: its server saves every request's K/V")],
    target: Annotated[str, typer.Argument(help="target model: its server starts from translated caches")],
    translator: Annotated[str, typer.Option(help="PATH, models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/PATH "
                                                 "or identity (same model)")],
    port: Annotated[int, typer.Option(min=1, max=65534, help="source server port; the target's is port + 1")] = 8100,
    store: Annotated[Path | None, typer.Option(help="directory for saved conversations "
                                                     "(default $KVLINGO_HOME/serving/conversations)")] = None,
    max_prefix_tokens: Annotated[int | None, typer.Option(help="cap on the prefix length served translated")] = None,
    reverse_translator: Annotated[str | None, typer.Option(
        help="TARGET → SOURCE translator (same forms as --translator): both servers then save and load, so a "
             "conversation can switch back and forth")] = None,
) -> None:
    """Start vLLM OpenAI servers for SOURCE and TARGET on 127.0.0.1 with the kvlingo connector; Ctrl-C stops both.

    Needs the serving venv (`bash infra/bootstrap.sh --serve`). Ask the source server as usual: its responses
    carry `kv_transfer_params.conversation`; ask the target with `kv_transfer_params: {"source_conversation":
    KEY}` and its response says `applied`, `fallback_reprefill` or `unsupported` with a reason. With
    --reverse-translator the target's responses carry a conversation key too, and a switch back reuses the source
    model's own earlier rows, translating only the target's span.
    """
    from infra.settings import kvlingo_home
    from infra.vllm_servers import serve_python, start_server, stop_servers, wait_ready
    from tasks.serve import plan_servers

    try:
        python = serve_python()
        specs = plan_servers(source, target, translator, store, max_prefix_tokens, reverse_translator)
    except KvlingoError as err:
        _fail(err)
    logs = kvlingo_home() / "serving" / "logs"
    servers = []
    try:
        for offset, spec in enumerate(specs):
            servers.append(start_server(python, spec.model_dir, spec.name, port + offset, spec.kv_role, spec.extra,
                                        logs / f"{spec.kv_role}-{port + offset}.log"))
        wait_ready(servers)
        for role, server in zip(("source", "target"), servers):
            Console().print(f"{role} {server.name}: {server.url} (log {server.log})", soft_wrap=True, highlight=False)
        Console().print("Ctrl-C to stop both", highlight=False)
        while all(s.process.poll() is None for s in servers):
            time.sleep(1)
        gone = next(s for s in servers if s.process.poll() is not None)
        _fail(KvlingoError(f"the {gone.name} server exited with code {gone.process.returncode}; see {gone.log}"), 1)
    except KeyboardInterrupt:
        pass
    except KvlingoError as err:
        _fail(err, 1)
    finally:
        stop_servers(servers)


@app.command()
def sweep(
    source: Annotated[str, typer.Argument(help="source model")],
    target: Annotated[str, typer.Argument(help="target model")],
    centre_lr: Annotated[float, typer.Option(help="centre of the learning-rate window")] = 1e-3,
    n_rates: Annotated[int, typer.Option(help="rates in the window, half a decade apart (odd)")] = 5,
    seeds: Annotated[str, typer.Option(help="comma-separated seeds; the first selects the rate")] = "0",
    steps: Annotated[int | None, typer.Option(help="stage-2 steps per cell")] = None,
    one_direction: Annotated[bool, typer.Option("--one-direction", help="only SOURCE → TARGET")] = False,
    workers: Annotated[int | None, typer.Option(min=1, help="Ray actors: stage-1 shards, then that many cells at once "
                       "(1: one process, cells one after another)")] = None,
    ray_address: Annotated[str | None, typer.Option(envvar="RAY_ADDRESS", help="Ray cluster address (default: a "
                           "local Ray when --workers > 1, else one process)")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML with FitConfig fields shared by every cell")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Learning-rate sweep (App. E) as the `kvlingo-sweep` Prefect flow; re-running reuses finished cells."""
    from flows.pipeline import start_local_prefect_api, sweep_flow
    from infra.config import FitConfig, load_config, read_config_file
    from registry.tracking import use_tracking_store
    from translators.lr_selection import initial_rates

    try:
        seed_list = parse_seeds(seeds)
        base = sweep_base(read_config_file(config) if config else {}, steps)
        base.update({k: v for k, v in (("workers", workers), ("ray_address", ray_address)) if v is not None})
        load_config(FitConfig, None, {**base, "source": source, "target": target})  # validate before compute
        initial_rates(centre_lr, n_rates)
        use_tracking_store()
        start_local_prefect_api()
        result = sweep_flow([(source, target)], both_directions=not one_direction, centre_lr=centre_lr,
                            n_rates=n_rates, seeds=seed_list, base=base)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    for pair, cell in result.items():
        table = Table("learning rate", "validation KL", title=f"{pair}: selected lr {cell['selected_lr']:.3g}")
        for lr, kl in cell["val_kl_by_lr"].items():
            table.add_row(lr, f"{kl:.4f}")
        Console().print(table)


def sweep_base(values: dict, steps: int | None) -> dict:
    """The FitConfig fields every sweep cell shares: the config file's, with --steps over its `steps`. The pair
    comes from the command line (SOURCE TARGET, each direction in turn), so a `source` or `target` in the file
    is dropped, as `kvlingo fit`'s arguments override the file's."""
    base = {k: v for k, v in values.items() if k not in ("source", "target")}
    if steps is not None:
        base["steps"] = steps
    return base


@app.command(name="plan")
def plan_command(
    source: Annotated[str, typer.Argument(help="source model: zoo name, hub id or local directory (config.json only)")],
    target: Annotated[str, typer.Argument(help="target model")],
    tokens: Annotated[int, typer.Option(min=1, help="training prefix tokens for stage 1")] = 500_000,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs (one worker each)")] = 1,
    prefix_tokens: Annotated[int, typer.Option(min=2, help="mean prefix length per conversation")] = 512,
    continuation_tokens: Annotated[int, typer.Option(min=1, help="continuation tokens per conversation (stage 2)")] = 64,
    assignment: Annotated[str, typer.Option(help="layer assignment: depth | greedy | r2 (sets the candidate layers)")] = "r2",
    nu: Annotated[int | None, typer.Option(min=1, help="source layers per target layer (ν; default: kvlingo fit's)")] = None,
    steps: Annotated[int, typer.Option(min=1, help="stage-2 steps")] = 400,
    batch: Annotated[int, typer.Option(min=1, help="stage-2 conversations per step")] = 8,
    token_identity: Annotated[bool | None, typer.Option("--token-identity/--no-token-identity", help="cost the maps "
                              "with token identity (default: as kvlingo fit's auto, on when the two vocabularies have "
                              "the same size)")] = None,
    bf16_tflops: Annotated[float, typer.Option(help="assumed peak bf16 TFLOP/s per GPU (H100 SXM dense: 989)")] = 989.0,
    fp64_tflops: Annotated[float, typer.Option(help="assumed peak fp64 TFLOP/s per GPU (H100 SXM tensor cores: 67)")] = 67.0,
    mfu: Annotated[float, typer.Option(help="assumed fraction of the bf16 peak reached by model passes")] = 0.35,
    gpu_memory_gb: Annotated[float, typer.Option(help="memory per GPU (GB) for the fit check")] = 80.0,
    configs: Annotated[Path | None, typer.Option(help="folder of config.json files for hub ids "
                       "(FOLDER/org/name/config.json); offline, hub ids are otherwise read from the HF cache")] = None,
    measure: Annotated[bool, typer.Option("--measure", help="also time stage 1 per token on this CPU for the pair "
                       "(loads the models) beside the cost model's prediction")] = False,
    measure_samples: Annotated[int, typer.Option(min=1, help="conversations timed by --measure")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """What fitting SOURCE → TARGET costs, from the config.json files (no weights): capture and Gram FLOPs per
    token, statistics memory (fp64), bytes per shard merge, stage-2 step cost and wall time on GPUS GPUs.

    The model and its assumptions are documented in tasks/cost_model.py and the README (Running on a Ray cluster).
    """
    from tasks.cost_model import Throughput, Workload
    from tasks.plan import measure_stage1, plan

    try:
        workload = Workload(tokens=tokens, prefix_tokens=prefix_tokens, continuation_tokens=continuation_tokens,
                            assignment=assignment, nu=nu, steps=steps, batch=batch, token_identity=token_identity)
        throughput = Throughput(bf16_tflops=bf16_tflops, fp64_tflops=fp64_tflops, mfu=mfu, gpu_memory_gb=gpu_memory_gb)
        result = plan(source, target, workload, gpus, throughput, configs_dir=configs)
        if measure:
            result["measured"] = measure_stage1(source, target, prefix_tokens=min(prefix_tokens, 256),
                                                samples=measure_samples, assignment=assignment, nu=nu)
    except KvlingoError as err:
        _fail(err)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    _print_plan(result)


def _print_plan(r: dict) -> None:
    console = Console()
    w, s, m = r["workload"], r["seconds"], r["memory_gb_per_gpu"]
    table = Table("quantity", "value", title=f"plan {r['source']} → {r['target']}: {w['tokens']:,} tokens, "
                  f"{r['gpus']} GPU(s), {w['assignment']} ν={w['nu']}, {r['throughput']['name']} at MFU {r['throughput']['mfu']}")
    rows = [
        ("K/V width d_src / d_tgt", f"{r['kv_width']['source']} / {r['kv_width']['target']}"),
        ("token identity", "on (+ the target's embedding per source layer)" if w["token_identity"] else "off"),
        ("capture GFLOP/token source / target",
         f"{r['capture_flops_per_token']['source'] / 1e9:.3f} / {r['capture_flops_per_token']['target'] / 1e9:.3f}"),
        ("Gram fp64 GFLOP/token (K+V)", f"{r['gram_flops_per_token'] / 1e9:.3f}"),
        ("Gram sums xx / xy / yy per object", f"{r['candidates']['xx']} / {r['candidates']['xy']} / {r['candidates']['yy']}"),
        ("statistics (fp64)", f"{r['stats_bytes'] / 2**20:,.1f} MiB"),
        ("shards / bytes moved per merge", f"{r['shards']} / {r['merge_bytes_per_shard'] / 2**20:,.1f} MiB"),
        ("stage 1 PFLOP capture / Gram", f"{r['stage1_flops']['capture'] / 1e15:.3f} / {r['stage1_flops']['gram'] / 1e15:.3f}"),
        ("stage-2 step TFLOP", f"{r['stage2_step_flops'] / 1e12:.3f}"),
        ("translator parameters", f"{r['map_params']:,}"),
        ("memory per GPU (weights bf16 + stats)", f"{m['total']:.2f} GB"),
        ("wall: stage 1 capture / Gram / merge", f"{s['stage1_capture']:.3g} s / {s['stage1_gram']:.3g} s / {s['stage1_merge']:.3g} s"),
        ("wall: stage 2", f"{s['stage2']:.3g} s"),
        ("wall: total", f"{s['total']:.3g} s ({s['total'] / 3600:.3g} h)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for warning in r["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")
    if "measured" in r:
        meas = r["measured"]
        t = Table("part", "predicted µs/token", "measured µs/token", "measured / predicted",
                  title=f"stage 1 on this CPU ({meas['threads']} threads, {meas['prefix_tokens']}-token prefixes; "
                        f"matmul {meas['matmul_gflops']['fp32']:.1f} GFLOP/s fp32, {meas['matmul_gflops']['fp64']:.1f} fp64)")
        for part in ("source", "target", "gram", "total"):
            t.add_row(part, f"{meas['seconds_per_token']['predicted'][part] * 1e6:.1f}",
                      f"{meas['seconds_per_token']['measured'][part] * 1e6:.1f}", f"{meas['measured_over_predicted'][part]:.2f}")
        console.print(t)


def main() -> None:
    try:
        app()
    finally:
        stop_local_services()  # before interpreter exit, so their shutdown logs reach open streams


if __name__ == "__main__":
    main()
