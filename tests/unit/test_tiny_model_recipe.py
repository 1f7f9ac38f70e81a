"""Unit tests of the tiny-model training recipe: token annotation and attention supervision.

The attention tap is checked against transformers' own eager attention probabilities, and the
supervision losses against hand-computed values on crafted attention patterns.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config

from infra.tiny_models import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TINY_MODELS,
    _annotate,
    _AttentionTap,
    _copy_supervision_loss,
    _layer_placement,
    grow_qwen3,
)
from tiny_configs import tiny_config, tiny_model
from translators.errors import ConfigError

IDS_OF = {ENDOFTEXT: 0, IM_START: 1, IM_END: 2, "assistant": 3}
NEWLINE, USER = 9, 10
SPEC = TINY_MODELS["kvlingo-tiny-s"]

# One conversation: user says [20 21], assistant answers [20 22], then end of text and a second
# conversation in which the assistant answers [21] although 21 only occurred in the first one.
ROW = [1, USER, NEWLINE, 20, 21, 2, NEWLINE,          # 0-6: user turn
       1, 3, NEWLINE, 20, 22, 2, NEWLINE,             # 7-13: assistant turn, content at 10-11
       0,                                             # 14: end of text
       1, USER, NEWLINE, 23, 2, NEWLINE,              # 15-20: user turn of conversation 2
       1, 3, NEWLINE, 21, 2]                          # 21-25: assistant turn, content at 24


def test_annotate_weights_answers_and_marks_copy_targets():
    weights, conv_start, copy_limit = _annotate(ROW, IDS_OF, SPEC)
    answer = {10, 11, 12, 24, 25}  # assistant content and its closing <|im_end|>
    assert [i for i, w in enumerate(weights) if w == SPEC.answer_weight] == sorted(answer)
    assert all(w == SPEC.context_weight for i, w in enumerate(weights) if i not in answer)
    assert conv_start == [0] * 15 + [15] * 11
    # Only position 9 (predicting 20, which the user said) is a copy target: 22 is new, <|im_end|>
    # is never supervised, and 21 in conversation 2 comes from another conversation.
    assert [i for i, limit in enumerate(copy_limit) if limit >= 0] == [9]
    assert copy_limit[9] == 10


def test_attention_tap_matches_eager_attention_probabilities():
    model = tiny_model("qwen3", seed=3, attn_implementation="eager")
    tap = _AttentionTap(model.model.layers[-1].self_attn)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            reference = model(input_ids=ids, output_attentions=True).attentions[-1]  # (2, 4, 12, 12)
            index = torch.arange(12)
            probs = tap.probabilities(3, torch.zeros(2, 12, dtype=torch.long), index)
    finally:
        tap.close()
    torch.testing.assert_close(probs, reference[:, :3], rtol=1e-5, atol=1e-6)


def test_attention_tap_keeps_packed_conversations_apart():
    model = tiny_model("qwen3", seed=3, attn_implementation="eager")
    tap = _AttentionTap(model.model.layers[-1].self_attn)
    first, second = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 7))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    conv_start = torch.tensor([[0] * 5 + [5] * 7])
    try:
        with torch.no_grad():
            model(input_ids=packed, position_ids=positions, use_cache=False)
            probs = tap.probabilities(2, conv_start, torch.arange(12))[0]  # (2, 12, 12)
            alone = model(input_ids=second, output_attentions=True).attentions[-1][0, :2]
    finally:
        tap.close()
    assert probs[:, 5:, :5].abs().max() == 0  # the second conversation never sees the first
    torch.testing.assert_close(probs[:, 5:, 5:], alone, rtol=1e-5, atol=1e-6)


class _UniformTap:
    """Stand-in tap: every head attends uniformly over its allowed (causal, same-conversation) keys."""

    def probabilities(self, heads, conv_start, causal_index):
        batch, length = conv_start.shape
        keys = causal_index.view(1, 1, length)
        allowed = (keys <= causal_index.view(1, length, 1)) & (keys >= conv_start.unsqueeze(-1))
        uniform = allowed.float() / allowed.sum(-1, keepdim=True)
        return uniform.unsqueeze(1).expand(batch, heads, length, length)


def test_copy_loss_is_minus_log_mass_on_earlier_occurrences():
    weights, conv_start, copy_limit = _annotate(ROW, IDS_OF, SPEC)
    batch = {"input_ids": torch.tensor([ROW]), "conv_start": torch.tensor([conv_start]),
             "copy_limit": torch.tensor([copy_limit])}
    loss = _copy_supervision_loss(_UniformTap(), 2, batch)
    # Position 9 sees keys 0..9 uniformly; token 20 (the copy target) sits at key 3 only.
    assert loss.item() == pytest.approx(-math.log(1 / 10), rel=1e-6)


def test_copy_loss_is_zero_without_copy_targets():
    batch = {"input_ids": torch.tensor([[1, USER, 20, 2]]), "conv_start": torch.zeros(1, 4, dtype=torch.long),
             "copy_limit": torch.full((1, 4), -1)}
    assert _copy_supervision_loss(_UniformTap(), 1, batch).item() == 0.0


def test_layer_placement_keeps_ends_and_spreads_new_layers():
    assert _layer_placement(4, 6) == [0, None, 1, 2, None, 3]
    assert _layer_placement(3, 3) == [0, 1, 2]
    assert _layer_placement(3, 5) == [0, None, 1, None, 2]


def test_grown_model_computes_the_parents_function_and_keeps_its_kv():
    parent = tiny_model("qwen3", seed=4)
    settings = {**parent.config.to_dict(), "hidden_size": 96, "intermediate_size": 160,
                "num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 5, "layer_types": None}
    wider = Qwen3Config(**settings)
    torch.manual_seed(0)
    child = grow_qwen3(parent, wider).eval()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = parent(input_ids=ids), child(input_ids=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    # The parent's layers sit at child layers 0, 2 and 4; their leading KV heads are the parent's.
    for p_layer, c_layer in ((0, 0), (1, 2), (2, 4)):
        parent_keys = want.past_key_values.layers[p_layer].keys  # (batch, kv_heads, T, head_dim)
        child_keys = got.past_key_values.layers[c_layer].keys
        torch.testing.assert_close(child_keys[:, :2], parent_keys, rtol=1e-4, atol=1e-4)


def test_grow_refuses_a_smaller_or_incompatible_config_naming_every_problem():
    parent = tiny_model("qwen3", seed=4)
    bad = tiny_config("qwen3", hidden_size=32)
    bad.head_dim = 8
    with pytest.raises(ConfigError, match=r"hidden_size 64 -> 32 must not shrink.*head_dim differs \(16 vs 8\)"):
        grow_qwen3(parent, bad)


def test_builds_of_different_models_proceed_while_one_is_locked_and_the_same_model_waits(tmp_path):
    """Two test workers (or users) deriving different embedded models build them at the same time; a second
    builder of the same model waits for the first and then reuses its build instead of training again."""
    import threading

    from infra import tiny_models

    models = tmp_path / "models"
    writes = []

    def write(tmp):
        writes.append(tmp.name)
        (tmp / "weights").write_text("w")

    release = threading.Event()
    holding = threading.Event()

    def hold_a():
        with tiny_models._build_lock(models / "a"):
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold_a)
    holder.start()
    assert holding.wait(10)
    assert tiny_models.build_under_lock(models / "b", {"r": 1}, write, threads=1) == models / "b"  # not blocked by a's lock
    waiting = threading.Thread(target=tiny_models.build_under_lock, args=(models / "a", {"r": 2}, write),
                               kwargs={"threads": 1})
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and len(writes) == 1  # a's builder waits for a's lock
    release.set()
    holder.join(10)
    waiting.join(10)
    assert not waiting.is_alive() and len(writes) == 2 and tiny_models.is_built(models / "a", {"r": 2})
    assert tiny_models.build_under_lock(models / "a", {"r": 2}, write, threads=1) == models / "a" and len(writes) == 2


def test_a_whole_build_runs_on_its_pinned_thread_count_and_restores_the_callers(tmp_path):
    """Not only the training loop: the conversion before it (an SVD) rounds differently on another thread count."""
    from infra import tiny_models

    seen = []

    def write(tmp):
        seen.append(torch.get_num_threads())
        (tmp / "weights").write_text("w")

    def failing_write(tmp):
        seen.append(torch.get_num_threads())
        raise RuntimeError("conversion failed")

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tiny_models.build_under_lock(tmp_path / "a", {"r": 1}, write, threads=1)
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="conversion failed"):
            tiny_models.build_under_lock(tmp_path / "b", {"r": 1}, failing_write, threads=1)
        assert torch.get_num_threads() == 2 and not (tmp_path / "b").exists()
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1]


def test_the_shared_training_loop_matches_a_plain_adamw_loop_and_pins_threads():
    """`optimise` against a hand-written loop on a least-squares problem: same losses and weights, on the thread
    count asked for, the caller's count restored, ``after_step`` after every step."""
    from infra.tiny_models import lr_at, optimise

    generator = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(8, 3, generator=generator), "y": torch.randn(8, generator=generator)}] * 6

    def run_reference() -> tuple[list[float], torch.Tensor]:
        weight = torch.nn.Parameter(torch.zeros(3))
        optimizer = torch.optim.AdamW([weight], lr=0.1)
        losses = []
        for step, batch in enumerate(batches):
            optimizer.param_groups[0]["lr"] = lr_at(step, len(batches), 0.1, 0.2)
            loss = (batch["x"] @ weight - batch["y"]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([weight], 1.0)
            optimizer.step()
            losses.append(loss.item())
        return losses, weight.detach()

    weight = torch.nn.Parameter(torch.zeros(3))
    threads_seen, after = [], []

    def loss_of(batch):
        threads_seen.append(torch.get_num_threads())
        return (batch["x"] @ weight - batch["y"]).pow(2).mean()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        losses = optimise(torch.optim.AdamW([weight], lr=0.1), [weight], loss_of, iter(batches),
                          lambda step: lr_at(step, len(batches), 0.1, 0.2), steps=len(batches), threads=1,
                          progress=False, description="lsq", after_step=after.append)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    reference_losses, reference_weight = run_reference()
    assert losses == pytest.approx(reference_losses, rel=1e-6)
    assert torch.allclose(weight.detach(), reference_weight, atol=1e-6)
    assert threads_seen == [1] * 6 and after == list(range(6))
    assert losses[-1] < losses[0]


def test_the_schedule_warms_up_linearly_then_decays_to_a_tenth():
    from infra.tiny_models import lr_at

    assert [lr_at(step, 10, 1.0, 0.2) for step in (0, 1)] == [0.5, 1.0]
    assert lr_at(9, 10, 1.0, 0.2) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_at(10, 10, 1.0, 0.2) == pytest.approx(0.1)
