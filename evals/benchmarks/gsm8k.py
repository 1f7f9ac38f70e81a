"""gsm8k: GSM8K grade-school maths, zero-shot greedy generation, exact match of the final number."""

from __future__ import annotations

from evals.benchmarks._lm_eval import required_files, runner
from evals.benchmarks._spec import BenchmarkSpec

TASK = "kvlingo_gsm8k"

SPEC = BenchmarkSpec(
    name="gsm8k",
    suites=("quick", "full"),
    metric="exact match (lm-eval `exact_match`, strict-match filter), fraction",
    higher_is_better=True,
    run=runner(TASK, metric="exact_match", filter_name="strict-match", generates=True),
    required_files=required_files(TASK),
    description="GSM8K test split, greedy generation",
)
