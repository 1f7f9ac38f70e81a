"""Chat rendering and stop tokens for any Hugging Face tokenizer: the one place that turns messages into text.

Every prompt the platform builds from messages (training samples, held-out switch prefixes, benchmark prompts,
multi-turn hand-offs, the local judge) goes through :func:`render_chat`, and every decoder that should end at
the end of an answer stops at :func:`stop_ids`, so training, evaluation and the runtime see the same format.

- With a chat template: the template's text, ``enable_thinking=False`` (a template with an empty-reasoning
  placeholder, Qwen3's ``<think>\\n\\n</think>\\n\\n``, puts it at the end of a generation prompt, as training
  prefixes have it; templates that do not know the flag ignore it).
- Without one (base models): one ``"Role: content\\n"`` line per message, then ``"Assistant:"`` for a
  generation prompt. Each line ends with its newline, so blocks rendered separately concatenate into the
  render of the whole conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

# End-of-turn markers of the chat formats in use: ChatML (Qwen, SmolLM2), Gemma, Llama 3, and the
# end-of-document token of GPT-style vocabularies. Only those the tokenizer's vocabulary holds are used.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> str:
    """The text of `messages` ({"role", "content"} dicts) in the tokenizer's chat format (module docstring).

    Args:
        generation_prompt: end with the header of the assistant's next turn (where generation starts).
    Raises:
        Whatever the chat template raises for messages it does not accept (e.g. jinja errors, role order).
    """
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                             enable_thinking=False)
    lines = "".join(line + "\n" for line in _plain_lines(messages))
    return lines + ("Assistant:" if generation_prompt else "")


def answer_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]], answer: str) -> str:
    """`answer` as the model's format continues after the generation prompt of `messages`: with the space or newline
    the format puts before it (``"Assistant:"`` is followed by ``" answer"``), without end-of-turn markers. The
    answer itself when the template changes it beyond recognition.

    Raises:
        As :func:`render_chat`.
    """
    prefix = render_chat(tokenizer, messages, generation_prompt=True)
    full = render_chat(tokenizer, [*messages, {"role": "assistant", "content": answer}], generation_prompt=False)
    stripped = answer.strip()
    if full.startswith(prefix) and stripped:
        rest = full[len(prefix):]
        end = rest.find(stripped)
        if end >= 0:
            return rest[:end + len(stripped)]
    return answer


def flatten_conversation(messages: Sequence[Mapping[str, Any]]) -> str:
    """A chat as plain text (a document, not a prompt): the plain format's lines joined by newlines, without a
    trailing one, e.g. ``"User: ...\nAssistant: ..."``."""
    return "\n".join(_plain_lines(messages))


def _plain_lines(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """One ``"Role: content"`` line per message (role capitalised)."""
    return [f"{str(m.get('role', '')).capitalize()}: {m.get('content', '')}" for m in messages]


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> torch.Tensor:
    """[n] int64 token ids of :func:`render_chat`, tokenized without added special tokens (a template places
    BOS itself where its model wants one).

    Raises:
        As :func:`render_chat`.
    """
    text = render_chat(tokenizer, messages, generation_prompt=generation_prompt)
    return torch.tensor(list(tokenizer(text, add_special_tokens=False)["input_ids"]), dtype=torch.long)


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """Sorted ids that end an answer: the tokenizer's EOS plus every END_OF_TURN_TOKENS entry its vocabulary
    holds (Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``, …). Empty when the tokenizer has none of them."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in END_OF_TURN_TOKENS if token in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
