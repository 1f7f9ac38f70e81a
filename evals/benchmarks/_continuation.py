"""Per-position KL(target native ‖ condition) over the continuations of held-out embedded conversations,
shared by `corpus_kl` (mean over the continuation) and `first_token_kl` (its first token)."""

from __future__ import annotations

import torch

from evals.benchmarks._spec import BenchContext

# A seed far from the fits' (training draws the embedded corpus with the run's own seed, 0 by default).
CORPUS_SEED_OFFSET = 10_000
TEACHER_CACHE_FLOATS = 2_000_000  # per item: 8 MB of fp32 logits


def embedded_samples(context: BenchContext, limit: int) -> list:
    """Up to `limit` (prefix, continuation) samples of held-out embedded chats in the target's own format.

    More conversations are drawn than needed because short ones give no plain-text window for models without a
    chat template.
    """
    def build():
        from infra.conversations import load_conversations
        from infra.samples import build_samples

        corpus = load_conversations("embedded", limit=4 * limit, seed=CORPUS_SEED_OFFSET + context.seed)
        return build_samples(corpus, context.target.tokenizer, seed=context.seed, max_prefix_tokens=512,
                             max_continuation_tokens=48, prefix_tokens=32, continuation_tokens=8)[:limit]

    return context.cached(("embedded_samples", limit), build)


def kl_per_item(context: BenchContext, condition, limit: int) -> dict[str, torch.Tensor]:
    """item id → KL(target native ‖ condition) at each continuation position: [m] per item (nats); only the items
    of `context.shard`."""
    def build():
        from evals.conditions import continuation_logits
        from translators.continuation import kl_per_position, teacher_logits

        out = {}
        samples = embedded_samples(context, limit)
        with torch.no_grad():
            for i, s in enumerate(samples):
                if not context.owns(i, len(samples)):  # another item shard scores it (evaluation on Ray)
                    continue
                def teacher(s=s):
                    return teacher_logits(context.target.model, s.prefix_ids, s.continuation_ids)

                # Teacher logits [m, vocab] are kept for the next condition unless they are large (Gemma's
                # 262k vocabulary): then recomputing one forward is cheaper than holding them.
                vocab = getattr(context.target.model.config, "vocab_size", None)
                keep = vocab is not None and s.continuation_ids.numel() * vocab <= TEACHER_CACHE_FLOATS
                teacher_out = context.cached(("teacher_logits", limit, i), teacher) if keep else teacher()
                student = continuation_logits(condition, s.prefix_ids, s.continuation_ids)
                out[str(i)] = kl_per_position(teacher_out, student).cpu()
        return out

    # Keyed by the condition object (and item shard): every benchmark reading these KLs shares one pass per
    # condition.
    return context.cached(("kl_per_item", limit, id(condition), context.shard), build)
