"""first_token_kl: KL at the first continuation token only, where the answer depends most on the context."""

from __future__ import annotations

from evals.benchmarks._continuation import kl_per_item
from evals.benchmarks._spec import BenchmarkSpec


def run(context, condition, limit: int) -> dict[str, float]:
    return {item: float(kl[0]) for item, kl in kl_per_item(context, condition, limit).items()}


SPEC = BenchmarkSpec(
    name="first_token_kl",
    suites=("data_free", "quick", "full"),
    metric="KL(target native ‖ condition) at the first answer token, nats",
    higher_is_better=False,
    run=run,
    item_shards=True,
    description="the same held-out chats as corpus_kl, first answer token only",
)
