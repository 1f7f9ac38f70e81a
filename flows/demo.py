"""`kvlingo demo`: the main job on the embedded default pair, end to end on a laptop CPU.

Builds the two embedded models on first use, then for both directions: `kvlingo fit`'s default recipe (stage 1
+ stage 2), the data-free benchmarks on 60 items each (plus the local-file ones with --data-dir), an MLflow run
per fit, registration as `<source>--<target>` with the champion alias; then the multi-turn hand-off and the
switch speed at two lengths (MLflow runs too), the DuckDB summary and the HTML report page. Interrupted, it resumes: statistics
are content-addressed, stage 2 restarts from its last checkpoint.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def run_demo(*, steps: int | None = None, eval_limit: int | None = None, data_dir: Path | None = None,
             html: Path | None = None) -> dict[str, Any]:
    from flows.pipeline import DEMO_EVAL_LIMIT, demo_flow, start_local_prefect_api
    from registry.tracking import use_tracking_store

    from registry.html_report import check_page_path

    if html is not None:
        check_page_path(html)
    use_tracking_store()  # fail fast on an unreachable tracking server, before any compute
    # Prefect's temporary server takes ~6 s to start; started beside the build, which keeps one core busy (its
    # steps gain little from a second thread), it is ready when the flow needs it. Its errors re-raise here.
    with ThreadPoolExecutor(1) as pool:
        prefect = pool.submit(start_local_prefect_api)
        _build_embedded_pair()
        prefect.result()
    return demo_flow(steps=steps, eval_limit=eval_limit or DEMO_EVAL_LIMIT, data_dir=data_dir, html=html)


def _build_embedded_pair() -> None:
    """Build (first run) or find the two embedded models here, before the flow starts: the one-time build (about
    7-9 minutes on 2 cores) then shows its own progress bars and fails before any MLflow run is opened, and the
    flow's task timings are those of the fits alone."""
    from flows.pipeline import DEMO_PAIR
    from infra.tiny_models import ensure_tiny_model

    for name in sorted(DEMO_PAIR, key=lambda n: n != "kvlingo-tiny-s"):  # tiny-l grows from tiny-s
        ensure_tiny_model(name)
