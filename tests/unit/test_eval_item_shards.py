"""Evaluation on Ray splits each item-sharded benchmark's items over workers (units (benchmark, condition, item
shard)); items are assigned by their index in the runner's deterministic item list, and the shards' {item id:
score} mappings merge into the one-process mapping (same ids, scores and order), so the rows and paired CIs
equal a one-process run's exactly. Checked here without Ray: the actors' unit function runs in this process."""

import json

import pytest
from tiny_configs import save_tiny_model_dir, words

from evals.benchmarks import BenchContext, ItemScores, all_specs, get, merge_shards, suite
from tasks.evaluate import EvalConfig, _eval_unit, build_conditions, eval_units, rows_from_units, score_benchmark
from translators.errors import ConfigError

# The data-free suite, the quick suite's benchmarks that need no files (RULER noise: row groups) and XQuAD
# multi-turn (several ids per item) on a small SQuAD-format file.
BENCHMARKS = [*suite("data_free"), "ruler_noise", "switch_quality", "xquad_multiturn"]
LIMIT = 5


def test_owns_splits_items_into_contiguous_blocks():
    for total in range(0, 12):
        assert all(BenchContext().owns(i, total) for i in range(total))  # (0, 1): every item
        for count in (2, 3, 5):
            owners = [[k for k in range(count) if BenchContext(shard=(k, count)).owns(i, total)] for i in range(total)]
            assert all(len(o) == 1 for o in owners)  # every item in exactly one shard
            assert [o[0] for o in owners] == sorted(o[0] for o in owners)  # in shard order: concatenation restores it
    context = BenchContext(options={"x": 1})
    shard = context.for_shard(1, 2)
    assert shard.shard == (1, 2) and shard.memo is context.memo and shard.options == context.options
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ConfigError, match="item shard"):
            BenchContext(shard=bad)


def test_merge_shards_concatenates_in_shard_order_and_refuses_disagreeing_shards():
    merged = merge_shards([ItemScores({"0": 1.0, "1": 0.0}, extra={"a": 1}), {}, {"10": 0.5, "2": 1.0}])
    assert list(merged.items()) == [("0", 1.0), ("1", 0.0), ("10", 0.5), ("2", 1.0)] and merged.extra == {"a": 1}
    assert merge_shards([{"0": 1.0}, {"0": 1.0}]) == {"0": 1.0}  # a runner ignoring its shard: same items
    with pytest.raises(ConfigError, match="scored 1.0 and 0.0 by two shards"):
        merge_shards([{"0": 1.0}, {"0": 0.0}])


def test_units_split_only_item_sharded_benchmarks():
    specs = [get("recall"), get("gsm8k"), get("mt_bench_judge")]
    assert eval_units(specs, ["target_native", "x"], 2) == [
        ("recall", "target_native", (0, 2)), ("recall", "target_native", (1, 2)),
        ("recall", "x", (0, 2)), ("recall", "x", (1, 2)),
        ("gsm8k", "target_native", (0, 1)), ("gsm8k", "x", (0, 1)),
        ("mt_bench_judge", "target_native", (0, 1)), ("mt_bench_judge", "x", (0, 1))]
    # Every runner reading items without lm-eval or a judge is item-sharded, except needle_codes: its gap_share
    # (a ratio of sums over all items) is a row extra, which item shards cannot report.
    assert {n for n, s in all_specs().items() if not s.item_shards} == {"mmlu_pro", "arc_challenge", "gsm8k",
                                                                        "mt_bench_judge", "needle_codes"}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    # 256 positions: the needle conversations fit the tiny word-level tokenizer.
    return str(save_tiny_model_dir("qwen3", tmp_path_factory.mktemp("shards") / "qwen3", max_position_embeddings=256))


def _xquad(data_dir):
    """LIMIT paragraphs of tiny-vocabulary words, two questions each (answers: words of the paragraph)."""
    paragraphs = []
    for p in range(LIMIT):
        context = words(30, seed=p)
        qas = [{"id": f"{p}-{q}", "question": words(5, seed=100 + 2 * p + q),
                "answers": [{"text": " ".join(context.split()[3 * q: 3 * q + 2]), "answer_start": 0}]} for q in range(2)]
        paragraphs.append({"context": context, "qas": qas})
    (data_dir / "xquad").mkdir(parents=True)
    (data_dir / "xquad" / "xquad.en.json").write_text(json.dumps({"data": [{"title": "t", "paragraphs": paragraphs}]}))
    return data_dir


def test_item_shards_give_the_one_process_scores_and_rows(qwen_dir, kvlingo_home, tmp_path):
    from infra.zoo import load_model

    config = EvalConfig(source=qwen_dir, target=qwen_dir, benchmarks=BENCHMARKS, translators=["identity"],
                        fit_dir=tmp_path / "no-fit", limit=LIMIT, ruler_lengths=[24, 40], max_new_tokens=6,
                        data_dir=_xquad(tmp_path / "data"))
    pair = load_model(qwen_dir)
    conditions = build_conditions(config, pair, pair)
    assert list(conditions) == ["target_native", "source_native", "empty_prefix", "identity"]
    specs = [get(name) for name in BENCHMARKS]

    # One process, as run_eval scores it: one context for the whole evaluation.
    context = config.context(pair, pair)
    rows_one = [row for spec in specs for row in score_benchmark(spec, context, conditions, config.limit)]

    # Each runner: its two shards' items are disjoint, and merged they are the unsharded mapping, in its order.
    for spec in specs:
        for name, condition in conditions.items():
            whole = spec.run(config.context(pair, pair), condition, LIMIT)
            fresh = config.context(pair, pair)
            parts = [spec.run(fresh.for_shard(k, 2), condition, LIMIT) for k in range(2)]
            assert len(whole) >= 3 and all(parts), (spec.name, name, whole, parts)
            assert not parts[0].keys() & parts[1].keys()
            assert list(merge_shards(parts).items()) == list(whole.items()), (spec.name, name)

    # The driver's path without Ray: every (benchmark, condition, item shard) unit through the actors' function,
    # merged into rows (2 shards, and 3: uneven blocks).
    for shards in (2, 3):
        units = eval_units(specs, list(conditions), shards)
        assert len(units) == len(specs) * len(conditions) * shards
        results = {unit: _eval_unit(pair, pair, config.model_dump_json(), unit) for unit in units}
        assert all("scores" in r for r in results.values())
        rows, errors = rows_from_units(specs, list(conditions), results)
        assert errors == [] and rows == rows_one
    paired = [r for r in rows_one if r["condition"] == "empty_prefix"]
    assert len(paired) == len(BENCHMARKS) + 1 and all(r["ci_low"] is not None for r in paired)  # real paired CIs
