"""Prompts for the switch runtime's benchmarks: fixed-length token prompts and held-out switch prefixes.

Both come from the embedded synthetic chat corpus (`infra.synthetic_chat`), so they need no data files and no
network, and are identical for identical arguments.
"""

from __future__ import annotations

from typing import Any

import torch

from infra.chat import chat_ids, flatten_conversation
from infra.synthetic_chat import generate_conversations, recall_items
from translators.errors import ConfigError

_CONVERSATIONS_PER_ROUND = 32


def prompt_of_length(tokenizer: Any, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """A [n_tokens] prompt: synthetic conversations flattened to text, tokenized, truncated to n_tokens.

    More conversations are drawn until the text is long enough, so any length works.

    Raises:
        ConfigError: n_tokens < 1.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ConfigError(f"a prompt length must be a positive integer, got {n_tokens!r}")
    ids: list[int] = []
    rounds = 0
    while len(ids) < n_tokens:
        rounds += 1
        chats = generate_conversations(_CONVERSATIONS_PER_ROUND * rounds, seed)
        text = "\n\n".join(flatten_conversation(chat) for chat in chats)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if rounds > 64:  # a tokenizer that yields nothing for this text would otherwise loop forever
            raise ConfigError(f"the tokenizer turned the synthetic corpus into only {len(ids)} tokens")
    return torch.tensor(ids[:n_tokens], dtype=torch.long)


def heldout_prefixes(tokenizer: Any, n_items: int, seed: int = 0) -> list[torch.Tensor]:
    """Held-out switch prefixes: conversations ending with a user question, cut where the assistant answers.

    Rendered by `infra.chat.chat_ids` (generation prompt included). Each is a [n_i] int64 tensor.

    Raises:
        ConfigError: n_items < 1.
    """
    if isinstance(n_items, bool) or not isinstance(n_items, int) or n_items < 1:
        raise ConfigError(f"the number of held-out items must be a positive integer, got {n_items!r}")
    return [chat_ids(tokenizer, item.messages, generation_prompt=True) for item in recall_items(n_items, seed)]
