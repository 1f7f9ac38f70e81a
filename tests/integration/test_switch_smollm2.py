"""SmolLM2-135M-Instruct switched into itself with the identity translator at pre_norm reproduces its own greedy
generation token for token: through the single-switch runtime and through the multi-turn conversation."""

import copy

import pytest
import torch
from transformers import GenerationConfig

from infra.prompts import heldout_prefixes
from infra.synthetic_chat import recall_items
from infra.zoo import load_model
from translators.conversation import Conversation
from translators.generation import GenerationSettings
from translators.stage1 import Side
from translators.switch import switch_generate

pytestmark = pytest.mark.integration

NEW = 12


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m-instruct")


def hf_greedy(model, ids, eos):
    """transformers' own greedy generation, cut after the first eos (it pads after stopping)."""
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    ids = torch.as_tensor(ids).view(1, -1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, ids.shape[1]:].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def test_runtime_identity_switch_matches_native_greedy(smollm):
    side = Side(smollm.model, smollm.layout)
    eos = smollm.tokenizer.eos_token_id
    settings = GenerationSettings(max_new_tokens=NEW, stop_ids=(eos,))
    prefixes = heldout_prefixes(smollm.tokenizer, 20, seed=3)
    mismatches = []
    for i, prefix in enumerate(prefixes):
        switched = switch_generate(side, side, prefix, None, settings, point="pre_norm", tokenizer=smollm.tokenizer)
        if switched.token_ids != hf_greedy(smollm.model, prefix, eos):
            mismatches.append(i)
    assert not mismatches, f"prompts {mismatches} diverged from native greedy generation"


def test_multi_turn_identity_segment_matches_native_greedy(smollm):
    tok, eos = smollm.tokenizer, smollm.tokenizer.eos_token_id
    a = Side(smollm.model, smollm.layout)
    b = Side(copy.deepcopy(smollm.model), smollm.layout)
    settings = GenerationSettings(max_new_tokens=NEW, stop_ids=(eos,))
    turns = 0
    for item in recall_items(4, seed=5):
        conversation = Conversation({"a": a, "b": b}, holder="a", tokenizer=tok)
        users = [m["content"] for m in item.messages if m["role"] == "user"]
        first = tok.apply_chat_template([{"role": "user", "content": users[0]}], tokenize=True, add_generation_prompt=True)
        first = first["input_ids"] if hasattr(first, "keys") else first
        chunks = [list(first)] + [tok(f"\n<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n")["input_ids"] for u in users[1:]]
        for t, chunk in enumerate(chunks):
            conversation.append(chunk)
            conversation.switch_to("ab"[t % 2])
            expected = hf_greedy(smollm.model, conversation.tokens, eos)
            assert conversation.generate(settings).token_ids == expected, f"turn {t} diverged"
            turns += 1
        assert conversation.max_translation_count() <= 1
    assert turns >= 8
