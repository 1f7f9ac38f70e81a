"""An lm-eval model (`LM` subclass) that answers every request under one evaluation `Condition`.

The same benchmark YAML then scores the same items as target native, source native and translated, so the
anchors are paired item by item. Requests are served one at a time (no batching, no padding): the translated
condition builds a fresh cache per request anyway.

Registering under lm-eval's model registry is explicit (`register()`), never at import.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from tqdm import tqdm

from evals.conditions import Condition, continuation_logits, greedy_generate
from infra.chat import stop_ids
from translators.errors import ConfigError


MODEL_NAME = "kvlingo"
DEFAULT_MAX_GEN_TOKS = 256


class KvlingoLM(LM):
    """lm-eval's model interface over one `Condition` and the tokenizer its models share.

    Args:
        condition: which model decodes and from which cache (evals.conditions).
        tokenizer: a Hugging Face tokenizer (encode/decode) shared by the condition's models.
        max_gen_toks: generation budget when a request's gen_kwargs do not set `max_gen_toks`.
        max_length: longest sequence fed to the models; default (and upper bound) the condition's max positions.
        add_bos_token: prepend the tokenizer's BOS to every context (models such as Gemma-3 expect it).
        batch_size: accepted for lm-eval's CLI plumbing; only 1 (one request at a time) is supported.
        device, max_batch_size: accepted for lm-eval's CLI plumbing and unused (the models are already placed).
        show_progress: a tqdm bar per request list.
    Raises:
        ConfigError: non-positive max_gen_toks/max_length, max_length beyond the models, batch size > 1,
            add_bos_token with a tokenizer that has no BOS token.
    """

    def __init__(
        self,
        condition: Condition,
        tokenizer: Any,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        max_length: int | None = None,
        add_bos_token: bool = False,
        batch_size: int | str | None = 1,
        show_progress: bool = True,
        device: str | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(condition, Condition):
            raise ConfigError(f"KvlingoLM needs an evals.conditions.Condition, got {type(condition).__name__}")
        if int(max_gen_toks) < 1:
            raise ConfigError(f"max_gen_toks must be ≥ 1, got {max_gen_toks}")
        if batch_size not in (None, 1, "1"):
            raise ConfigError(f"KvlingoLM scores one request at a time; use batch_size=1 (got {batch_size!r})")
        limit = condition.max_positions
        if max_length is not None and not 1 < int(max_length) <= limit:
            raise ConfigError(f"max_length must be in 2..{limit} (the models' max positions), got {max_length}")
        if add_bos_token and tokenizer.bos_token_id is None:
            raise ConfigError("add_bos_token=True but the tokenizer defines no BOS token")
        # device/max_batch_size arrive from lm-eval's create_from_arg_* plumbing; the condition's models are
        # already placed and requests are never batched, so both are accepted and unused.
        del device, max_batch_size
        self.condition = condition
        self.tokenizer = tokenizer
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length is not None else limit
        self.add_bos_token = add_bos_token
        self.show_progress = show_progress

    # ---- properties lm-eval reads -------------------------------------------------------------------------

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context conditions on (BOS if the tokenizer has one, else EOS).

        Raises:
            ConfigError: the tokenizer has neither.
        """
        for tok in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id):
            if tok is not None:
                return int(tok)
        raise ConfigError("the tokenizer has neither a BOS nor an EOS token to condition an empty context on")

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """What simple_evaluate records under results['config']."""
        return {"kvlingo_condition": self.condition.name, "max_length": self.max_length}

    # ---- tokenisation ---------------------------------------------------------------------------------------

    def tok_encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of a (context, continuation) request, HFLM-style.

        Trailing whitespace moves from the context to the continuation (word-boundary tokenisers attach it
        to the next word); the pair is encoded whole and split after the context's tokens so that merges
        across the boundary tokenise as in running text. An empty context becomes `prefix_token_id`.

        Raises:
            ConfigError: the continuation encodes to no tokens.
        """
        if context == "":
            context_ids = [self.prefix_token_id]
            continuation_ids = self.tok_encode(continuation)
        else:
            stripped = context.rstrip()
            continuation = context[len(stripped) :] + continuation
            whole = self.tok_encode(stripped + continuation)
            context_ids = self.tok_encode(stripped)
            continuation_ids = whole[len(context_ids) :]
            context_ids = self._with_bos(context_ids)
        if not continuation_ids:
            raise ConfigError(f"the continuation {continuation!r} encodes to no tokens; nothing to score")
        return context_ids, continuation_ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        return [int(self.tokenizer.bos_token_id)] + ids if self.add_bos_token else ids

    # ---- lm-eval request types -----------------------------------------------------------------------------

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p(continuation tokens), whether greedy decoding would produce them) per request.

        Raises:
            ConfigError: a continuation longer than max_length, or one that encodes to no tokens.
        """
        results = []
        for request in self._progress(requests, "loglikelihood", disable_tqdm):
            context, continuation = request.args
            result = self.loglikelihood_tokens(*self.encode_pair(context, continuation))
            self.cache_hook.add_partial("loglikelihood", request.args, result)
            results.append(result)
        return results

    def loglikelihood_tokens(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """Score token ids: (Σ log p, is_greedy). The context is cut from the left to fit max_length.

        Raises:
            ConfigError: the continuation alone does not fit max_length.
        """
        m = len(continuation_ids)
        room = self.max_length - m + 1  # context tokens that fit: n + m - 1 ≤ max_length
        if room < 1:
            raise ConfigError(
                f"a continuation of {m} tokens does not fit max_length {self.max_length}; raise max_length or "
                "shorten the task's targets"
            )
        logits = continuation_logits(self.condition, context_ids[-room:], continuation_ids)  # [m, vocab]
        targets = torch.tensor(continuation_ids, device=logits.device)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        total = float(logprobs.gather(-1, targets.view(-1, 1)).sum())
        is_greedy = bool((logprobs.argmax(-1) == targets).all())
        return total, is_greedy

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string (perplexity tasks), scored in windows of at most max_length.

        The first window conditions on `prefix_token_id`; later windows carry as much preceding text as fits,
        and every token is scored exactly once (lm-eval's rolling windows).
        """
        results = []
        for request in self._progress(requests, "loglikelihood_rolling", disable_tqdm):
            (text,) = request.args
            tokens = self.tok_encode(text)
            windows = lm_utils.get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
            )
            total = 0.0
            for window in windows:
                context_ids, scored_ids = lm_utils.make_disjoint_window(window)
                total += self.loglikelihood_tokens(context_ids, scored_ids)[0]
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            results.append(total)
        return results

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut before the first `until` stop string (or at EOS).

        Request args: (context, gen_kwargs) with `until` (str or list of str) and optional `max_gen_toks`.

        Raises:
            ConfigError: sampling requested (do_sample true), malformed `until`, or a context that leaves no
                room for generation within max_length.
        """
        results = []
        for request in self._progress(requests, "generate_until", disable_tqdm):
            context, gen_kwargs = request.args
            until, max_new = self._generation_args(gen_kwargs or {})
            text = self.generate_text(context, until, max_new)
            self.cache_hook.add_partial("generate_until", request.args, text)
            results.append(text)
        return results

    def generate_text(self, context: str, until: list[str], max_new_tokens: int) -> str:
        """Greedy text after `context`, stopped at EOS or an end-of-turn token (`infra.chat.stop_ids`), after
        max_new_tokens, or before the first stop string."""
        room = self.max_length - max_new_tokens + 1  # the last generated token is never fed back
        if room < 1:
            raise ConfigError(
                f"max_gen_toks {max_new_tokens} leaves no room for the context within max_length {self.max_length}: "
                f"lower it (task generation_kwargs, or run_lm_eval(..., gen_kwargs={{'max_gen_toks': N}}))"
            )
        context_ids = self._with_bos(self.tok_encode(context)) if context else [self.prefix_token_id]

        def hit_stop_string(generated: list[int]) -> bool:
            # Decoding the whole prefix each step (not token by token) keeps multi-token characters intact.
            return any(s in self.tok_decode(generated) for s in until)

        stopper = hit_stop_string if until else None
        ids = greedy_generate(self.condition, context_ids[-room:], max_new_tokens, stop_ids(self.tokenizer),
                              should_stop=stopper)
        return cut_at_stop(self.tok_decode(ids), until)

    def _generation_args(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int]:
        """(stop strings, max new tokens) from a request's gen_kwargs.

        Raises:
            ConfigError: do_sample true, `until` neither a string nor a list of strings, max_gen_toks < 1.
        """
        if gen_kwargs.get("do_sample"):
            raise ConfigError("KvlingoLM decodes greedily; set do_sample: false in the task's generation_kwargs")
        until = gen_kwargs.get("until", [])
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(s, str) and s for s in until):
            raise ConfigError(f"`until` must be a non-empty string or a list of them, got {gen_kwargs.get('until')!r}")
        max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        if max_new < 1:
            raise ConfigError(f"max_gen_toks must be ≥ 1, got {max_new}")
        return until, max_new

    def _progress(self, requests: list[Instance], what: str, disable: bool):
        return tqdm(requests, desc=f"kvlingo {self.condition.name} {what}", disable=disable or not self.show_progress)


def cut_at_stop(text: str, until: list[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in until) if i >= 0), default=len(text))
    return text[:cut]


def register() -> type[KvlingoLM]:
    """Register KvlingoLM in lm-eval's model registry as "kvlingo" (idempotent); returns the class.

    Then `simple_evaluate(model="kvlingo", model_args={"condition": ..., "tokenizer": ...})` works too.
    """
    from lm_eval.api.registry import register_model

    return register_model(MODEL_NAME)(KvlingoLM)
