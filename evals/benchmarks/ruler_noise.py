"""ruler_noise: RULER single-needle retrieval in the noise haystack, per context length (`--ruler-lengths`).

The embedded tiny models cannot read RULER's format (they score 0 under every condition); for them the data-free
suite has `needle`, in their own chat format. Real chat models read it."""

from __future__ import annotations

from evals.benchmarks._ruler import check_lengths, runner
from evals.benchmarks._spec import BenchmarkSpec

SPEC = BenchmarkSpec(
    name="ruler_noise",
    suites=("quick", "full"),
    metric="recall (RULER string match), fraction; one row per length",
    higher_is_better=True,
    run=runner("noise"),
    check=check_lengths,
    row_groups=True,
    item_shards=True,
    description="RULER NIAH, noise haystack, rows `ruler_noise_<length>` (needs a model that follows instructions)",
)
