"""The `kvlingo` command line. Commands validate their arguments before any model loads.

With `--json` a command prints exactly one JSON object on stdout (a public contract); logs, progress bars
and errors go to stderr. Exit code 0 means success, 1 a failed check, 2 bad input or an unavailable model.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from infra.settings import apply_offline_defaults
from translators.errors import KvlingoError

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


def _fail(err: Exception, code: int = 2) -> None:
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
def doctor(
    model: Annotated[str, typer.Argument(help="zoo name, hub id or local model directory")],
    point: Annotated[
        list[str] | None, typer.Option("--point", help="capture point(s) to check; default: all three")
    ] = None,
    prompt: Annotated[str, typer.Option(help="text of the round-trip prompt")] = DOCTOR_PROMPT,
    tolerance: Annotated[float, typer.Option(help="max |Δlogit| accepted (fp32)")] = 1e-4,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
) -> None:
    """Round-trip check before fitting: capture → inject → one decoding step vs a native prefill.

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
        "tolerance": tolerance,
        "points": rows,
        "ok": all(r["ok"] for r in rows.values()),
    }


def main() -> None:
    app()


if __name__ == "__main__":
    main()
