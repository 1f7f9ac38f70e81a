"""indexer_topk: for a sparse-attention (DSA) target, the share of the positions its indexer selects with its
own keys that it also selects with translated indexer keys (everything else in the cache native)."""

from __future__ import annotations

from evals.benchmarks._continuation import embedded_samples
from evals.benchmarks._spec import BenchmarkSpec, BenchmarkUnavailableError


def run(context, condition, limit: int) -> dict[str, float]:
    import torch

    from evals.conditions import TRANSLATED
    from evals.indexer import has_indexer, translated_indexer_overlap
    from translators.capture import capture

    target = condition.decoder
    if not has_indexer(context.target.layout):
        raise BenchmarkUnavailableError(f"indexer_topk needs a sparse-attention target (DeepSeek-V3.2 DSA); "
                                        f"{context.target.name} has no indexer")
    if condition.name != TRANSLATED or condition.translator is None:
        return {}  # only a translated cache has translated indexer keys to compare
    point = condition.translator.point
    samples = embedded_samples(context, limit)
    scores = {}
    for i, s in enumerate(samples):
        if not context.owns(i, len(samples)):
            continue
        cached = s.prefix_ids[:-1]
        native = capture(target.model, target.layout, cached, point).objects
        src = capture(condition.source.model, condition.source.layout, cached, point)
        translated = condition.translator.translate_objects(src.objects, src.token_ids)
        reads = torch.cat([s.prefix_ids[-1:], s.continuation_ids[:-1]])  # the queries: x_n, y_1..y_{m-1}
        scores[str(i)] = translated_indexer_overlap(target.model, target.layout, native, translated, point, reads)
    return scores


SPEC = BenchmarkSpec(
    name="indexer_topk",
    suites=("full",),
    metric="share of the target's own indexer top-k positions also selected with translated indexer keys",
    higher_is_better=True,
    run=run,
    item_shards=True,
    description="DSA targets only: held-out embedded chats, translated condition (the rest of the cache native)",
)
