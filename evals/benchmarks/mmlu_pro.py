"""mmlu_pro: MMLU-Pro multiple choice (ten options), zero-shot, scored by log-likelihood through lm-eval."""

from __future__ import annotations

from evals.benchmarks._lm_eval import required_files, runner
from evals.benchmarks._spec import BenchmarkSpec

TASK = "kvlingo_mmlu_pro"

SPEC = BenchmarkSpec(
    name="mmlu_pro",
    suites=("quick", "full"),
    metric="accuracy (lm-eval `acc`), fraction",
    higher_is_better=True,
    run=runner(TASK, metric="acc", filter_name="none"),
    required_files=required_files(TASK),
    description="MMLU-Pro test split, log-likelihood multiple choice",
)
