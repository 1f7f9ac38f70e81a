"""ruler_essay: RULER single-needle retrieval in the Paul Graham essay haystack, per context length."""

from __future__ import annotations

from evals.benchmarks._ruler import check_lengths, runner
from evals.benchmarks._spec import BenchmarkSpec

ESSAY_FILE = "ruler/PaulGrahamEssays.json"

SPEC = BenchmarkSpec(
    name="ruler_essay",
    suites=("full",),
    metric="recall (RULER string match), fraction; one row per length",
    higher_is_better=True,
    run=runner("essay", ESSAY_FILE),
    required_files=(ESSAY_FILE,),
    check=check_lengths,
    row_groups=True,
    item_shards=True,
    description="RULER NIAH, essay haystack, rows `ruler_essay_<length>`",
)
