"""`kvlingo eval` on pairs with a hybrid side (evals.conditions with a HybridTranslator): an exact translator
between copies of a tiny GDN model scores exactly like the target's own prefill, and the translators a hybrid pair
cannot use are refused by name."""

from __future__ import annotations

import pytest
import torch
from tiny_configs import exact_hybrid_copy, tiny_gdn_model, tiny_model

from evals.conditions import continuation_logits, greedy_generate, target_native, translated
from translators.errors import ConfigError
from translators.hybrid import HybridTranslator, strategies_for
from translators.layout import cache_layout
from translators.stage1 import Side
from translators.states import ZERO, StateMaps


@pytest.fixture(scope="module")
def gdn():
    model = tiny_gdn_model(seed=0)
    return Side(model, cache_layout(model))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed))


def test_an_exact_hybrid_translation_scores_like_the_targets_own_prefill(gdn):
    context, continuation = _ids(23, 1), _ids(6, 2)
    condition = translated(gdn, gdn, exact_hybrid_copy(gdn.layout))
    with torch.no_grad():  # the reference: one plain forward over context + continuation[:-1]
        ids = torch.cat([context, continuation[:-1]]).view(1, -1)
        native = gdn.model(input_ids=ids).logits[0, -continuation.numel():]
    got = continuation_logits(condition, context, continuation)  # [m, vocab]
    assert got.shape == native.shape
    assert torch.allclose(got, native, atol=1e-4), (got - native).abs().max()
    assert greedy_generate(condition, context, 8) == greedy_generate(target_native(gdn), context, 8)


def test_zeroed_states_change_the_translation(gdn):
    """The linear layers' states are really read from the translator: zeroing them moves the logits."""
    context, continuation = _ids(23, 3), _ids(4, 4)
    exact = continuation_logits(translated(gdn, gdn, exact_hybrid_copy(gdn.layout)), context, continuation)
    zero = exact_hybrid_copy(gdn.layout)
    zero.states = StateMaps(gdn.layout, gdn.layout, strategies_for(gdn.layout, ZERO))
    zeroed = continuation_logits(translated(gdn, gdn, zero), context, continuation)
    assert (zeroed - exact).abs().max() > 1e-2


def test_a_hybrid_pair_refuses_the_identity_and_per_token_translators(gdn):
    with pytest.raises(ConfigError, match=r"hybrid translator .*got no translator \(identity\).*kvlingo doctor"):
        translated(gdn, gdn, None)
    qwen = tiny_model("qwen3", seed=0)
    qwen_side = Side(qwen, cache_layout(qwen))
    from translators.translator import Translator

    per_token = Translator.__new__(Translator)  # the type alone is what is refused
    with pytest.raises(ConfigError, match="got a Translator"):
        translated(qwen_side, gdn, per_token)


def test_a_hybrid_translator_for_other_layouts_is_refused(gdn):
    llama = tiny_model("llama", seed=0, hidden_size=32)  # 2 K/V heads of 8: 16 wide where the GDN model's are 32
    llama_layout = cache_layout(llama)
    from_llama = HybridTranslator(llama_layout, gdn.layout, StateMaps(llama_layout, gdn.layout,
                                                                    strategies_for(gdn.layout, ZERO)))
    translated(Side(llama, llama_layout), gdn, from_llama)  # its own pair is accepted
    with pytest.raises(ConfigError, match=r"built for other layouts.*K/V maps keys_2 \(32, 16\) \(here \(32, 32\)\)"):
        translated(gdn, gdn, from_llama)
    wider = tiny_gdn_model(seed=0, linear_value_head_dim=16)  # recurrent states [2, 8, 16] instead of [2, 8, 12]
    with pytest.raises(ConfigError, match=r"linear layers and state shapes"):
        translated(gdn, Side(wider, cache_layout(wider)), exact_hybrid_copy(gdn.layout))
