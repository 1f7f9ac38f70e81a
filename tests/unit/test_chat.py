"""infra.chat: the one chat renderer and the one stop-id function, on small tokenizers built here."""

import pytest
import torch
from tiny_configs import tiny_tokenizer

from infra.chat import chat_ids, render_chat, stop_ids

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
          "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
        {"role": "user", "content": "hello world"}]


def word_tokenizer(specials: list[str], eos: str, chat_template: str | None = None):
    """A whitespace word-level fast tokenizer whose vocabulary is <unk>, `specials` and a few words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", *specials, "hello", "world", "User:", "Assistant:"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=eos,
                                        additional_special_tokens=[s for s in specials if s != eos])
    tokenizer.chat_template = chat_template
    return tokenizer


def test_gemma_stops_at_end_of_turn_and_eos():
    tok = word_tokenizer(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], eos="<eos>")
    vocab = tok.get_vocab()
    assert stop_ids(tok) == tuple(sorted((vocab["<eos>"], vocab["<end_of_turn>"])))


def test_chatml_stops_at_im_end_and_end_of_text():
    tok = word_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>")
    vocab = tok.get_vocab()
    assert stop_ids(tok) == tuple(sorted((vocab["<|im_end|>"], vocab["<|endoftext|>"])))
    assert vocab["<|im_start|>"] not in stop_ids(tok)


def test_eos_only_and_added_special_tokens():
    tok = tiny_tokenizer()
    assert stop_ids(tok) == (tok.eos_token_id,)  # no end-of-turn token in the vocabulary: never the <unk> id
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_turn>", "<|im_end|>"]})
    vocab = tok.get_vocab()
    assert stop_ids(tok) == tuple(sorted((tok.eos_token_id, vocab["<end_of_turn>"], vocab["<|im_end|>"])))


def test_template_render_uses_the_template_without_thinking():
    tok = word_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>", chat_template=CHATML)
    prompt = render_chat(tok, CHAT[:1], generation_prompt=True)
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render_chat(tok, CHAT[:2], generation_prompt=False).endswith("<|im_start|>assistant\nworld<|im_end|>\n")
    ids = chat_ids(tok, CHAT[:1], generation_prompt=True)
    assert ids.dtype == torch.long and ids.tolist() == tok(prompt, add_special_tokens=False)["input_ids"]


def test_plain_render_lines_concatenate_and_end_at_the_assistant_header():
    tok = word_tokenizer(["<eos>"], eos="<eos>")
    assert render_chat(tok, CHAT, generation_prompt=True) == "User: hello\nAssistant: world\nUser: hello world\nAssistant:"
    # Blocks rendered separately (as the multi-turn benchmark appends them) add up to the whole conversation.
    assert render_chat(tok, CHAT[:2], generation_prompt=False) + render_chat(tok, CHAT[2:], generation_prompt=False) == \
        render_chat(tok, CHAT, generation_prompt=False)
    assert chat_ids(tok, CHAT[:1], generation_prompt=True).tolist() == [tok.get_vocab()[w] for w in
                                                                        ("User:", "hello", "Assistant:")]


def test_template_errors_propagate():
    tok = word_tokenizer(["<eos>"], eos="<eos>", chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(Exception, match="roles must alternate"):
        render_chat(tok, CHAT, generation_prompt=True)
