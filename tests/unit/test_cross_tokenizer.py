"""Cross-tokenizer pairs end to end on tiny models and two in-process tokenizers (KV-Lingo App. K).

Tokenizer A: byte-level BPE with a ChatML chat template ("ĠHello" tokens, no BOS).
Tokenizer B: a small SentencePiece-style BPE ("▁Hello" tokens) without a chat template, whose post-processor
adds a BOS by itself, so the plain "User: …\\nAssistant:" format after <s> is its rendering.

References are independent of the code under test: the decoded text of the tokens, the target's own native
prefill (same model and tokenizer on both sides: the mixed cache must then be exact), torch.linalg.lstsq on
explicitly built design matrices, and hand-built layouts.
"""

import pytest
import torch
from tiny_configs import tiny_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from infra.chat import render_chat
from infra.cross_samples import cross_chat_samples, render_prefix
from translators.alignment import AlignmentError
from translators.capture import capture
from translators.cross import (
    PREFILL,
    TRANSLATED,
    CrossSample,
    accumulate_cross,
    accumulate_samples,
    cross_sample_loss,
    group_attention_weights,
    cross_validation_kl,
    source_capture,
    student_hidden_cross,
    teacher_hidden_cross,
    translated_tensors,
)
from translators.distill import Objective, logits_from_hidden
from translators.errors import ConfigError
from translators.layout import cache_layout
from translators.stage1 import (
    ReferenceMemo,
    Side,
    assign_layers,
    candidate_layers,
    attention_weights,
    empty_stats,
    matched_attention_types,
    solve_translator,
)
from translators.switch import identity_translator
from translators.train import TrainSettings, Trainer

CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "My cat is called Biscuit."},
     {"role": "assistant", "content": "Noted, a fine name."},
     {"role": "user", "content": "What is my cat called?"},
     {"role": "assistant", "content": "Your cat is called Biscuit."}],
    [{"role": "user", "content": "What is the code for ORCHID-27?"},
     {"role": "assistant", "content": "The code is 4817."}],
    [{"role": "user", "content": "Hello there, how are you today?"},
     {"role": "assistant", "content": "I am well, thank you for asking."}],
    [{"role": "user", "content": "Name a quick animal."},
     {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."}],
    [{"role": "user", "content": "Count to five, please."},
     {"role": "assistant", "content": "One, two, three, four, five."},
     {"role": "user", "content": "And back?"},
     {"role": "assistant", "content": "Five, four, three, two, one."}],
    [{"role": "user", "content": "Is water wet?"},
     {"role": "assistant", "content": "Yes, water makes things wet."}],
]

_CORPUS = ["My cat is called Biscuit and she is 7.", "What is the code for ORCHID-27? The code is 4817.",
           "Be brief. Noted. Understood. Hello there, how are you today?",
           "The quick brown fox jumps over the lazy dog.",
           "One, two, three, four, five. Is water wet? Yes, please thank you for asking. I am well."]


class _NoTemplate:
    chat_template = None


def byte_level_chatml():
    """Tokenizer A: byte-level BPE (exact round trips), ChatML template, no BOS."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_CORPUS * 3, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def metaspace_with_bos():
    """Tokenizer B: a small "▁word" BPE over the plain chat format, BOS added by its post-processor."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    # Newlines are their own pre-tokens, so no token straddles the end of a line (a message) and the next role.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Metaspace()])
    backend.decoder = decoders.Metaspace()
    plain = [render_chat(_NoTemplate(), c, generation_prompt=False) for c in CONVERSATIONS]
    trainer = trainers.BpeTrainer(vocab_size=110, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator((plain + _CORPUS) * 2, trainer)
    bos = ("<s>", backend.token_to_id("<s>"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tok_a():
    return byte_level_chatml()


@pytest.fixture(scope="module")
def tok_b():
    return metaspace_with_bos()


@pytest.fixture(scope="module")
def samples_ab(tok_a, tok_b):
    return cross_chat_samples(CONVERSATIONS, tok_a, tok_b, seed=0, samples_per_conversation=2)


def tiny_model(family, seed=0, *, vocab_size=97, **fields):
    """tests/tiny_configs' model, with config fields its families pin (Gemma's window and layer types) set after."""
    config = tiny_config(family, vocab_size=vocab_size, max_position_embeddings=256)
    for key, value in fields.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)


def side(family, tokenizer, seed=0, **fields):
    model = tiny_model(family, seed, vocab_size=len(tokenizer), **fields)
    return Side(model, cache_layout(model))


@pytest.fixture(scope="module")
def llama_a(tok_a):
    return side("llama", tok_a, seed=1)


@pytest.fixture(scope="module")
def gemma_b(tok_b):
    return side("gemma3", tok_b, seed=2)


def _turn_of(sample, tokenizer):
    """The assistant turn a sample was cut at, found by re-rendering (independent of the sample builder)."""
    messages = CONVERSATIONS[sample.conversation]
    for turn in range(1, len(messages)):
        _, ids, _ = render_prefix(tokenizer, messages[:turn])
        if ids == sample.target_ids.tolist():
            return turn
    raise AssertionError("no turn of the conversation renders to the sample's target ids")


def _message_tokens(text, offsets, messages, candidates):
    """Per message: the candidate token indices whose characters overlap the message's content in `text`."""
    out, cursor = [], 0
    for message in messages:
        content = message["content"].strip()
        start = text.index(content, cursor)
        end = cursor = start + len(content)
        out.append([i for i in candidates if offsets[i][0] < end and offsets[i][1] > start])
    return out


# ---------------------------------------------------------------------------------------- 1. sample invariants


def test_a_to_b_samples_hold_their_invariants(samples_ab, tok_a, tok_b):
    assert len(samples_ab) == 8  # 2 samples from each of the two 2-turn chats, 1 from each 1-turn chat
    for sample in samples_ab:
        q, k = sample.target_ids.numel(), sample.translated.numel()
        tg, sg = sample.target_group.tolist(), sample.source_group.tolist()
        positions, translated = sample.positions.tolist(), sample.translated.tolist()
        assert k > 0 and tg[-1] == -1
        assert sample.target_ids[0] == tok_b.bos_token_id  # B renders after the BOS it adds itself
        assert all(tg[p] == g for p, g in zip(positions, sg))
        assert positions == sorted(positions) and max(positions) < q - 1
        assert all(a < b for a, b in zip(translated, translated[1:]))
        assert sg == sorted(sg) and set(sg) == {g for g in tg if g >= 0}  # every group has both sides
        # The runs cover target_ids[:-1] exactly once, in order, and every translated token once, in order.
        covered, written = [], []
        for kind, lo, hi in sample.segments():
            if kind == PREFILL:
                assert all(tg[j] == -1 for j in range(lo, hi))
                covered.extend(range(lo, hi))
            else:
                assert kind == TRANSLATED and hi > lo
                groups = set(sg[lo:hi])
                covered.extend(j for j in range(q) if tg[j] in groups)
                written.extend(range(lo, hi))
        assert covered == list(range(q - 1))
        assert written == list(range(k))
        # Each group holds the same text on both sides.
        for g in set(sg):
            src_ids = [int(sample.source_ids[translated[i]]) for i in range(k) if sg[i] == g]
            tgt_ids = [int(sample.target_ids[j]) for j in range(q) if tg[j] == g]
            assert tok_a.decode(src_ids).strip() == tok_b.decode(tgt_ids).strip()
        # Decoding each message's content tokens, on both sides, gives back the message.
        turn = _turn_of(sample, tok_b)
        context = CONVERSATIONS[sample.conversation][:turn]
        tgt_text, tgt_ids, tgt_off = render_prefix(tok_b, context)
        src_text, src_ids, src_off = render_prefix(tok_a, context)
        assert src_ids == sample.source_ids.tolist()
        content_t = [j for j in range(q) if tg[j] >= 0]
        per_message_t = _message_tokens(tgt_text, tgt_off, context, content_t)
        per_message_s = _message_tokens(src_text, src_off, context, translated)
        assert sorted(j for m in per_message_t for j in m) == content_t
        assert sorted(i for m in per_message_s for i in m) == translated
        for message, t_idx, s_idx in zip(context, per_message_t, per_message_s):
            assert tok_b.decode([tgt_ids[j] for j in t_idx]).strip() == message["content"]
            assert tok_a.decode([src_ids[i] for i in s_idx]).strip() == message["content"]
        # The continuation is the answer in B's plain format.
        answer = CONVERSATIONS[sample.conversation][turn]["content"]
        assert tok_b.decode(sample.continuation_ids.tolist()).strip() == answer


def test_tokenizers_really_differ(samples_ab):
    # Guards the fixtures: A→B must exercise many-to-one and one-to-many groups, not only 1:1 ones.
    shapes = set()
    for s in samples_ab:
        sg, tg = s.source_group.tolist(), s.target_group.tolist()
        shapes |= {(sg.count(g), tg.count(g)) for g in set(sg)}
    assert any(p > 1 for p, _ in shapes) and any(q > 1 for _, q in shapes) and (1, 1) in shapes
    assert any(len(set(s.positions.tolist())) < s.positions.numel() for s in samples_ab)  # shared positions


# --------------------------------------------------------------- 2. exact mixed cache against the native prefill


@pytest.mark.parametrize(
    "family, point, overrides",
    [
        ("llama", "pre_norm", {}),
        ("qwen3", "pre_norm", {}),  # k-norm and RoPE applied by the target at injection
        ("qwen3", "post_norm", {}),  # RoPE only
        ("gemma3", "pre_norm", {"sliding_window": 6}),  # window far shorter than the prompts (23..79 tokens)
        ("gemma3", "pre_norm", {"sliding_window": 200}),  # window longer than the prompts
    ],
)
def test_self_pair_identity_reproduces_native_prefill(tok_a, family, point, overrides):
    me = side(family, tok_a, seed=3, **overrides)
    samples = cross_chat_samples(CONVERSATIONS, tok_a, tok_a, seed=0, samples_per_conversation=2)
    identity = identity_translator(me.layout, point)
    for sample in samples:
        # Same tokenizer: every group is 1:1 and each token is rotated at its own position.
        assert torch.equal(sample.source_ids, sample.target_ids)
        assert torch.equal(sample.positions, sample.translated)
        assert sample.n_prefilled == sample.target_ids.numel() - sample.translated.numel()
        tensors = translated_tensors(identity, source_capture(me, sample, point), sample)
        with torch.no_grad():
            student = logits_from_hidden(me.model, student_hidden_cross(me.model, me.layout, sample, tensors, point))
        teacher = logits_from_hidden(me.model, teacher_hidden_cross(me.model, sample))
        # Native reference, straight from the model's own forward over the whole sequence.
        ids = torch.cat([sample.target_ids, sample.continuation_ids[:-1]]).view(1, -1)
        with torch.no_grad():
            native = me.model(input_ids=ids, use_cache=False).logits[0, -sample.continuation_ids.numel():].float()
        torch.testing.assert_close(teacher, native, atol=1e-5, rtol=1e-5)
        # Measured |Δ| ≤ 9.1e-6 (llama), 5.8e-6 (qwen3), 3.4e-6 (gemma3) on logits of magnitude ≤ 7.2; rotating
        # every translated key one position late instead gives KL 0.4 (llama), 0.1 (qwen3), 1e-3 (gemma3).
        torch.testing.assert_close(student, teacher, atol=5e-5, rtol=1e-5)
    kl = cross_validation_kl(me, me, samples, identity)
    assert kl.n == len(samples) and kl.mean < 1e-6 and kl.first_token < 1e-6
    boilerplate = cross_validation_kl(me, me, samples, None, condition="boilerplate_only")
    empty = cross_validation_kl(me, me, samples, None, condition="empty_prefix")
    assert boilerplate.mean > 1e-3 and empty.mean > 1e-3


# ------------------------------------------------------------------------ 3. stage 1 against plain least squares


def test_stage1_maps_equal_lstsq_on_explicit_design_matrices(samples_ab, llama_a, gemma_b):
    src, tgt = llama_a, gemma_b
    candidates = candidate_layers(src.layout, tgt.layout, "depth", 1)
    assert sorted(candidates) == list(range(tgt.layout.n_layers))
    stats = accumulate_cross(empty_stats(src.layout, tgt.layout, candidates), src, tgt, samples_ab, "pre_norm")
    translator = solve_translator(stats, {"keys": candidates, "values": candidates}, src.layout, tgt.layout,
                                  "pre_norm", ridge=0.0)
    d_src, d_tgt = src.layout.kv_width, tgt.layout.kv_width
    assert (d_src, d_tgt) == (32, 16)
    rows = {"keys": {}, "values": {}}  # name → source layer → [X rows]; name → ("y", t) → [Y rows]
    for sample in samples_ab:
        xs = capture(src.model, src.layout, sample.source_ids, "pre_norm")
        ys = capture(tgt.model, tgt.layout, sample.target_ids, "pre_norm")
        tg = sample.target_group.tolist()
        for name in ("keys", "values"):
            for s in range(src.layout.n_layers):
                rows[name].setdefault(s, []).append(xs.objects[name][s][sample.translated].double())
            for t in range(tgt.layout.n_layers):
                means = []
                for g in sample.source_group.tolist():
                    members = [ys.objects[name][t][j].double() for j in range(len(tg)) if tg[j] == g]
                    means.append(sum(members) / len(members))
                rows[name].setdefault(("y", t), []).append(torch.stack(means))
    n = sum(s.translated.numel() for s in samples_ab)
    assert n > 3 * d_src  # overdetermined
    for name in ("keys", "values"):
        for t, (s,) in candidates.items():
            x, y = torch.cat(rows[name][s]), torch.cat(rows[name][("y", t)])
            assert x.shape == (n, d_src) and y.shape == (n, d_tgt)
            assert torch.linalg.matrix_rank(x) == d_src
            reference = torch.linalg.lstsq(x, y, driver="gelsd").solution.T  # [d_tgt, d_src]: y_hat = T @ x
            weight = translator.weight(name, t).detach().double()
            assert weight.shape == (d_tgt, d_src)
            torch.testing.assert_close(weight, reference, atol=1e-4 * reference.abs().max().item(), rtol=1e-4)
            # The map's predictions: the normal equations' residual is orthogonal to the design.
            residual = y - x @ weight.T
            assert (x.T @ residual).abs().max() < 1e-3 * (x.T @ y).abs().max()


def test_group_weights_give_each_group_its_target_mass_split_over_its_source_rows():
    # Groups: 0 = one target token ↔ one source token, 1 = two target ↔ three source, 2 = three target ↔ one source;
    # boilerplate (-1) before, between and at the end receives attention but has no row.
    target_group = torch.tensor([-1, 0, 1, 1, -1, 2, 2, 2, -1])
    source_group = torch.tensor([0, 1, 1, 1, 2])
    per_target = torch.tensor([0.30, 0.05, 0.02, 0.04, 0.10, 0.01, 0.06, 0.03, 0.20], dtype=torch.float64)
    weights = group_attention_weights(per_target, target_group, source_group)
    expected = torch.tensor([0.05, 0.02, 0.02, 0.02, 0.10], dtype=torch.float64)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-15)
    # Every group's rows carry exactly its target tokens' mass; boilerplate's mass goes to no row.
    assert weights.sum().item() == pytest.approx(per_target[target_group >= 0].sum().item(), abs=1e-15)


def test_attention_weighted_stage1_equals_weighted_lstsq(samples_ab, llama_a, gemma_b):
    """App. O across tokenizers: each row of the regression is weighted by its group's share of the attention the
    target's continuation queries pay to the group's target tokens; the maps equal a weighted least-squares solve
    on explicit design matrices (rows scaled by √w), with the group rule written out here token by token."""
    src, tgt = llama_a, gemma_b
    candidates = candidate_layers(src.layout, tgt.layout, "depth", 1)
    stats = accumulate_cross(empty_stats(src.layout, tgt.layout, candidates), src, tgt, samples_ab, "pre_norm",
                             weighting="attention")
    translator = solve_translator(stats, {"keys": candidates, "values": candidates}, src.layout, tgt.layout,
                                  "pre_norm", ridge=0.0)
    uniform = solve_translator(
        accumulate_cross(empty_stats(src.layout, tgt.layout, candidates), src, tgt, samples_ab, "pre_norm"),
        {"keys": candidates, "values": candidates}, src.layout, tgt.layout, "pre_norm", ridge=0.0)
    x_rows, y_rows, w_rows = {}, {}, []
    for sample in samples_ab:
        a = attention_weights(tgt, sample.target_ids, sample.continuation_ids).double()  # [q]
        tg, sg = sample.target_group.tolist(), sample.source_group.tolist()
        for g in sg:
            w_rows.append(sum(a[j].item() for j in range(len(tg)) if tg[j] == g) / sg.count(g))
        xs = capture(src.model, src.layout, sample.source_ids, "pre_norm")
        ys = capture(tgt.model, tgt.layout, sample.target_ids, "pre_norm")
        for name in ("keys", "values"):
            for t, (s,) in candidates.items():
                x_rows.setdefault((name, t), []).append(xs.objects[name][s][sample.translated].double())
                means = [torch.stack([ys.objects[name][t][j].double() for j in range(len(tg)) if tg[j] == g]).mean(0)
                         for g in sg]
                y_rows.setdefault((name, t), []).append(torch.stack(means))
    root_w = torch.tensor(w_rows, dtype=torch.float64).sqrt()[:, None]
    assert (root_w > 0).all()
    for (name, t), xs in x_rows.items():
        x, y = torch.cat(xs), torch.cat(y_rows[(name, t)])
        reference = torch.linalg.lstsq(root_w * x, root_w * y, driver="gelsd").solution.T
        weight = translator.weight(name, t).detach().double()
        torch.testing.assert_close(weight, reference, atol=1e-4 * reference.abs().max().item(), rtol=1e-4)
        # The weighting moves the maps: it is not the uniform solve under another name.
        assert (weight - uniform.weight(name, t).detach().double()).abs().max() > 1e-3 * reference.abs().max()


# ------------------------------------------------------------------------------ 4. stage 2 through mixed caches


@pytest.fixture(scope="module")
def closed_form_ab(samples_ab, llama_a, gemma_b):
    candidates = candidate_layers(llama_a.layout, gemma_b.layout, "depth", 1)
    stats = accumulate_cross(empty_stats(llama_a.layout, gemma_b.layout, candidates), llama_a, gemma_b, samples_ab,
                             "pre_norm")
    return lambda: solve_translator(stats, {"keys": candidates, "values": candidates}, llama_a.layout,
                                    gemma_b.layout, "pre_norm", ridge=1e-3)


def test_cross_sample_loss_reaches_every_map(samples_ab, llama_a, gemma_b, closed_form_ab):
    translator = closed_form_ab()
    sample = max(samples_ab, key=lambda s: s.translated.numel())
    cap = source_capture(llama_a, sample, translator.point)
    loss = cross_sample_loss(translator, cap, gemma_b, sample, Objective())
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    for name, p in translator.maps.items():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    # The loss is the mean KL that validation reports for this one sample.
    kl = cross_validation_kl(llama_a, gemma_b, [sample], translator)
    assert loss.item() == pytest.approx(kl.mean, rel=1e-4, abs=1e-6)


def test_cross_reference_memo_scores_bit_identically(samples_ab, llama_a, gemma_b, closed_form_ab, monkeypatch):
    import translators.cross as cross

    translator = closed_form_ab()
    fresh = cross_validation_kl(llama_a, gemma_b, samples_ab, translator)
    boilerplate = cross_validation_kl(llama_a, gemma_b, samples_ab, None, condition="boilerplate_only")
    calls = []
    for name in ("source_capture", "teacher_hidden_cross"):
        real = getattr(cross, name)
        monkeypatch.setattr(cross, name, lambda *args, real=real, name=name: (calls.append(name), real(*args))[1])
    memo = ReferenceMemo()
    for _ in range(2):
        assert cross_validation_kl(llama_a, gemma_b, samples_ab, translator, memo=memo) == fresh
    assert cross_validation_kl(llama_a, gemma_b, samples_ab, None, condition="boilerplate_only", memo=memo) == boilerplate
    assert calls.count("teacher_hidden_cross") == len(samples_ab)
    assert calls.count("source_capture") == len(samples_ab)


def test_trainer_lowers_the_cross_kl_from_the_closed_form_start(samples_ab, llama_a, gemma_b, closed_form_ab):
    translator = closed_form_ab()
    before = cross_validation_kl(llama_a, gemma_b, samples_ab, translator).mean
    settings = TrainSettings(lr=3e-3, steps=8, batch=len(samples_ab), warmup_frac=0.0, eval_every=1000,
                             checkpoint_every=1000)
    trainer = Trainer(translator, llama_a, gemma_b, samples_ab, samples_ab, settings, run_signature={})
    losses = [trainer.train_step(step) for step in range(settings.steps)]
    after = cross_validation_kl(llama_a, gemma_b, samples_ab, translator).mean
    boilerplate = cross_validation_kl(llama_a, gemma_b, samples_ab, None, condition="boilerplate_only").mean
    # Full-batch steps: the first step's loss is the closed form's KL over the same samples. Measured: KL 0.139
    # → 0.074 after 8 steps, the train loss falling at every step; the boilerplate-only control is at 0.218.
    assert losses[0] == pytest.approx(before, rel=1e-4)
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert after < 0.9 * before
    assert after < boilerplate


# ----------------------------------------------------------------------------------------------- 5. clear errors


class _Slow:
    """A tokenizer that reports itself slow (no offsets), delegating everything else."""

    is_fast = False

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)


class _NoOffsets(_Slow):
    """A tokenizer that claims nothing but refuses offsets as HF's slow tokenizers do."""

    is_fast = True

    def __call__(self, *args, return_offsets_mapping=False, **kwargs):
        if return_offsets_mapping:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self._inner(*args, **kwargs)


@pytest.mark.parametrize("wrap", [_Slow, _NoOffsets])
@pytest.mark.parametrize("which", ["source", "target"])
def test_tokenizer_without_offsets_is_refused_naming_fast(tok_a, tok_b, wrap, which):
    src, tgt = (wrap(tok_a), tok_b) if which == "source" else (tok_a, wrap(tok_b))
    with pytest.raises(AlignmentError, match="fast"):
        cross_chat_samples(CONVERSATIONS, src, tgt, seed=0)


def test_bad_samples_and_calls_are_refused(samples_ab, llama_a, gemma_b):
    good = samples_ab[0]
    content_last = good.target_group.clone()
    content_last[-1] = int(good.target_group.max())
    with pytest.raises(ConfigError, match="last target prefix token must be boilerplate"):
        CrossSample(good.source_ids, good.target_ids, good.continuation_ids, good.translated, good.positions,
                    good.source_group, content_last, good.conversation)
    candidates = candidate_layers(llama_a.layout, gemma_b.layout, "depth", 1)
    stats = empty_stats(llama_a.layout, gemma_b.layout, candidates)
    with pytest.raises(ConfigError, match="unknown weighting 'fisher'; choose from uniform, attention"):
        accumulate_samples(stats, llama_a, gemma_b, samples_ab, "pre_norm", weighting="fisher")
    no_continuation = CrossSample(good.source_ids, good.target_ids, good.continuation_ids[:0], good.translated,
                                  good.positions, good.source_group, good.target_group, good.conversation)
    with pytest.raises(ConfigError, match="zero-length continuation"):
        accumulate_samples(stats, llama_a, gemma_b, [no_continuation], "pre_norm", weighting="attention")
    with pytest.raises(ConfigError, match="translated condition needs a translator"):
        cross_validation_kl(llama_a, gemma_b, samples_ab, None, condition="translated")
    with pytest.raises(ConfigError, match="boilerplate_only"):
        cross_validation_kl(llama_a, gemma_b, samples_ab, None, condition="nothing")
    with pytest.raises(ConfigError, match="empty validation set"):
        cross_validation_kl(llama_a, gemma_b, [], None, condition="empty_prefix")


# ------------------------------------------------------------------------------ 6. attention types across pairs


def _layout(family, **overrides):
    return cache_layout(tiny_model(family, **overrides))


def test_all_global_source_into_sliding_target_ignores_types():
    llama, gemma = _layout("llama"), _layout("gemma3")
    assert set(llama.attention_types) != set(gemma.attention_types)
    assert matched_attention_types(llama, gemma) == (None, None)
    assert matched_attention_types(gemma, llama) == (None, None)
    depth = candidate_layers(llama, gemma, "depth", 1)
    assert sorted(depth) == list(range(gemma.n_layers))
    chosen = [src for (src,) in depth.values()]
    assert chosen == sorted(chosen) and set(chosen) <= set(range(llama.n_layers))
    assert chosen[0] == 0 and chosen[-1] == llama.n_layers - 1  # the band spans the whole source depth
    for method in ("greedy", "r2"):
        every = candidate_layers(llama, gemma, method, 1)
        assert every == {t: tuple(range(llama.n_layers)) for t in range(gemma.n_layers)}


def test_two_mixed_type_layouts_keep_their_types():
    small = _layout("gemma3")
    deep = _layout("gemma3", num_hidden_layers=6, layer_types=["sliding_attention"] * 2 + ["full_attention"]
                   + ["sliding_attention"] * 2 + ["full_attention"])
    assert deep.n_layers == 6 and small.n_layers == 4
    src_types, tgt_types = matched_attention_types(deep, small)
    assert src_types == deep.attention_types and tgt_types == small.attention_types
    depth = candidate_layers(deep, small, "depth", 1)
    for t, (s,) in depth.items():
        assert deep.attention_types[s] == small.attention_types[t]
    every = candidate_layers(deep, small, "greedy", 1)
    for t, sources in every.items():
        assert sources and all(deep.attention_types[s] == small.attention_types[t] for s in sources)
        assert len(sources) == sum(a == small.attention_types[t] for a in deep.attention_types)


def test_depth_assignment_agrees_with_its_candidates_across_type_sets():
    llama, gemma = _layout("llama"), _layout("gemma3")
    candidates = candidate_layers(llama, gemma, "depth", 1)
    stats = empty_stats(llama, gemma, candidates)
    assert assign_layers(stats, llama, gemma, "depth", 1) == {"keys": candidates, "values": candidates}


# --- Plain-text windows (long documents) --------------------------------------------------------------------


TEXT = ("The river flows to the sea, and the old bridge is made of stone. Birds sing in the trees while the "
        "market is busy today; snow falls in the mountains.")


def test_text_prompt_translates_everything_but_the_last_group(tok_a, tok_b):
    from infra.cross_samples import cross_text_prompt
    from translators.alignment import align, token_offsets

    sample = cross_text_prompt(tok_a, tok_b, TEXT, continuation_ids=[5, 6])
    _, src_off = token_offsets(tok_a, TEXT)
    _, tgt_off = token_offsets(tok_b, TEXT)
    reference = align(src_off, tgt_off, text=TEXT)
    lead_b = sample.target_ids.numel() - len(tgt_off)  # tok_b adds its BOS by itself, tok_a adds nothing
    assert lead_b == 1 and sample.source_ids.numel() == len(src_off)
    last = len(reference.groups) - 1
    # Every source token outside the last group is translated, at its assigned target position (after the BOS).
    expected = [i for i, g in enumerate(reference.group_of_source) if g < last]
    assert sample.translated.tolist() == expected
    assert sample.positions.tolist() == [lead_b + reference.assigned[i] for i in expected]
    # The target prefills its BOS and the last group (whose final token it decodes with the continuation).
    prefilled = (sample.target_group < 0).nonzero().flatten().tolist()
    assert prefilled == [0] + [lead_b + j for j in reference.groups[last].target]
    assert sample.segments()[0] == ("prefill", 0, 1) and sample.segments()[-1][0] in ("prefill", "translated")


def test_text_samples_window_in_target_tokens(tok_a, tok_b):
    from infra.cross_samples import cross_text_samples

    docs = [TEXT * 3, "too short"]
    samples = cross_text_samples(docs, tok_a, tok_b, seed=0, prefix_tokens=20, continuation_tokens=4)
    assert len(samples) == 1 and samples[0].conversation == 0
    assert samples[0].continuation_ids.numel() == 4
    # The prefix text re-tokenized by the target is about 20 tokens (+ BOS; edges may re-merge by a token).
    assert abs(samples[0].target_ids.numel() - 21) <= 2
    with pytest.raises(ConfigError, match="none of 1 documents"):
        cross_text_samples(["too short"], tok_a, tok_b, seed=0, prefix_tokens=20, continuation_tokens=4)


# ------------------------------------------------------------------------ layer attribution across tokenizers


def test_cross_attribution_finds_the_one_perturbed_map(tok_a):
    """Self pair through the cross-tokenizer path: the identity is exact, so with one map perturbed, making that one
    object the target's own must remove all of the KL and every other substitution none of it."""
    from translators.attribution import cross_layer_attribution

    me = side("llama", tok_a, seed=3)
    samples = cross_chat_samples(CONVERSATIONS, tok_a, tok_a, seed=0, samples_per_conversation=2)
    translator = identity_translator(me.layout, "pre_norm")
    with torch.no_grad():
        translator.maps["keys_1"].add_(0.5 * torch.randn(translator.maps["keys_1"].shape,
                                                         generator=torch.Generator().manual_seed(0)))
    translated, rows = cross_layer_attribution(me, me, samples, translator)
    # The baseline is validation's own KL (an independent code path: cross_validation_kl).
    assert translated.mean == pytest.approx(cross_validation_kl(me, me, samples, translator).mean, rel=1e-5)
    assert translated.mean > 1e-2
    by_key = {(r.layer, r.objects): r for r in rows}
    assert set(by_key) == {(layer, o) for layer in range(me.layout.n_layers) for o in ("keys", "values", "all")}
    for (layer, objects), row in by_key.items():
        if layer == 1 and objects in ("keys", "all"):
            assert row.kl.mean < 1e-6 and row.removed == pytest.approx(translated.mean, rel=1e-4)
        else:
            assert row.kl.mean == pytest.approx(translated.mean, rel=1e-5)


def test_cross_attribution_on_a_real_cross_pair_and_its_refusals(samples_ab, llama_a, gemma_b, closed_form_ab):
    from translators.attribution import cross_layer_attribution

    translator = closed_form_ab()
    val = samples_ab[:3]
    translated, rows = cross_layer_attribution(llama_a, gemma_b, val, translator)
    assert translated.mean == pytest.approx(cross_validation_kl(llama_a, gemma_b, val, translator).mean, rel=1e-5)
    assert len(rows) == gemma_b.layout.n_layers * 3
    assert all(r.kl.n == 3 and r.removed == pytest.approx(translated.mean - r.kl.mean, abs=1e-6) for r in rows)
    with pytest.raises(ConfigError, match="at least 2 samples"):
        cross_layer_attribution(llama_a, gemma_b, val[:1], translator)
