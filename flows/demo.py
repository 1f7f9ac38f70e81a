"""`kvlingo demo`: the main job on the embedded default pair, end to end on a laptop CPU.

Builds the two embedded models on first use, then for both directions: stage 1 + a short stage 2, the
data-free quick benchmarks (plus the local-file ones with --data-dir), an MLflow run per fit, registration
as `<source>--<target>` with the champion alias, and the DuckDB summary. Interrupted, it resumes: statistics
are content-addressed, stage 2 restarts from its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_demo(*, steps: int | None = None, eval_limit: int = 6, data_dir: Path | None = None) -> dict[str, Any]:
    from flows.pipeline import demo_flow, start_local_prefect_api
    from registry.tracking import use_tracking_store

    use_tracking_store()  # fail fast on an unreachable tracking server, before any compute
    start_local_prefect_api()
    return demo_flow(steps=steps, eval_limit=eval_limit, data_dir=data_dir)
