"""translators.generation.decode_from, the one decoding loop: its stop semantics, and that the evaluation
conditions (evals.conditions.greedy_generate) decode through it with the same result."""

import pytest
import torch
from tiny_configs import tiny_model
from transformers import DynamicCache

from evals.conditions import greedy_generate, target_native
from translators.generation import GenerationSettings, decode_from
from translators.inject import decode_step
from translators.layout import cache_layout
from translators.stage1 import Side

PROMPT = torch.arange(3, 13)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def naive_greedy(model, n: int) -> list[int]:
    """n greedy tokens by full re-forwards (no cache), the reference."""
    ids, out = PROMPT.clone(), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=ids.view(1, -1)).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor(out[-1:])])
    return out


def decode(model, settings: GenerationSettings, **kwargs):
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = decode_step(model, cache, PROMPT, logits_to_keep=1)[-1]
        return decode_from(model, cache, logits, settings, **kwargs)


def test_stop_id_is_returned_last_and_counts_toward_the_budget(model):
    naive = naive_greedy(model, 6)
    stop = naive[2]
    first = naive.index(stop)
    out = decode(model, GenerationSettings(max_new_tokens=6, stop_ids=(stop,)))
    assert out.token_ids == naive[: first + 1] and out.stopped == "stop_id"
    assert out.answer_ids == naive[:first]
    # A budget that ends exactly on the stop id: still a stop.
    out = decode(model, GenerationSettings(max_new_tokens=first + 1, stop_ids=(stop,)))
    assert out.token_ids == naive[: first + 1] and out.stopped == "stop_id"
    # A budget below it: the budget ends generation and every token is part of the answer.
    out = decode(model, GenerationSettings(max_new_tokens=first, stop_ids=(stop,)))
    assert out.token_ids == naive[:first] and out.stopped == "max_new_tokens" and out.answer_ids == out.token_ids


def test_stop_on_the_first_token_and_should_stop(model):
    naive = naive_greedy(model, 5)
    out = decode(model, GenerationSettings(max_new_tokens=5, stop_ids=(naive[0],)))
    assert out.token_ids == naive[:1] and out.stopped == "stop_id" and out.answer_ids == [] and out.step_s == []
    seen = []
    out = decode(model, GenerationSettings(max_new_tokens=5), should_stop=lambda t: seen.append(list(t)) or len(t) == 3)
    assert out.token_ids == naive[:3] and out.stopped == "should_stop"
    assert seen == [naive[:1], naive[:2], naive[:3]]  # called after every token


def test_evaluation_conditions_decode_through_the_same_loop(model):
    naive = naive_greedy(model, 6)
    condition = target_native(Side(model, cache_layout(model)))
    assert greedy_generate(condition, PROMPT, 6) == naive
    stop = naive[3]
    assert greedy_generate(condition, PROMPT, 6, {stop}) == naive[: naive.index(stop) + 1]
    assert greedy_generate(condition, PROMPT, 6, {stop}) == decode(model, GenerationSettings(6, (stop,))).token_ids
    assert greedy_generate(condition, PROMPT, 0) == []
