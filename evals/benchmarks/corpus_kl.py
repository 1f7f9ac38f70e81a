"""corpus_kl: the target's continuation distribution under each condition against its own prefill, on held-out
embedded conversations (the eval's counterpart of the fit's `val_kl`, which is measured on the fit's own
held-out split)."""

from __future__ import annotations

from evals.benchmarks._continuation import kl_per_item
from evals.benchmarks._spec import BenchmarkSpec


def run(context, condition, limit: int) -> dict[str, float]:
    return {item: float(kl.mean()) for item, kl in kl_per_item(context, condition, limit).items()}


SPEC = BenchmarkSpec(
    name="corpus_kl",
    suites=("data_free", "quick", "full"),
    metric="KL(target native ‖ condition), nats/token, mean over the continuation",
    higher_is_better=False,
    run=run,
    item_shards=True,
    description="teacher-forced continuation KL on held-out embedded chats (0 for target native)",
)
