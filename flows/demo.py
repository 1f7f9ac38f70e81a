"""`kvlingo demo`: the main job on the embedded default pair, end to end on a laptop CPU.

Today: the round-trip check on both embedded models, then a stage-1 translator in both directions with its
validation KL beside the two controls. Later stages (distillation, benchmarks, tracking) extend it.
"""

from __future__ import annotations

from typing import Any

from infra.config import FitConfig
from infra.settings import kvlingo_home

PAIR = ("kvlingo-tiny-l", "kvlingo-tiny-s")


def run_demo() -> dict[str, Any]:
    from flows.cli import DOCTOR_PROMPT, _doctor_report
    from flows.fit import run_fit

    doctor = {name: _doctor_report(name, ["pre_norm", "post_norm", "post_rope"], DOCTOR_PROMPT, 1e-4) for name in PAIR}
    fits = []
    for source, target in (PAIR, PAIR[::-1]):
        config = FitConfig(
            source=source,
            target=target,
            stage1_only=True,
            output_dir=kvlingo_home() / "runs" / "demo" / f"{source}--{target}",
        )
        fits.append(run_fit(config))
    return {"doctor": doctor, "fits": fits}
