"""`kvlingo bench serve`: time to first token through vLLM after a switch vs vLLM's own prefill of the same prompt.

A producer engine (SOURCE) prefills one prompt per length and saves its K/V; then one consumer engine (TARGET,
serving the translator) answers, per length, the prompt as an ordinary request (vLLM's prefill) and the same
prompt naming the saved conversation (the switch: gate, load, translate, write, compute the last token). Both
are one `LLM.generate` call of one output token on the same engine, one run each, timed around the call.
A short warm-up pair runs first so one-time costs (the connector's first load) are not in the table.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from translators.errors import ConfigError

WARMUP_TOKENS = 64


def run_serve_bench(source: str, target: str, lengths: list[int], translator: str = "identity") -> dict[str, Any]:
    """Returns {"rows": [{"n", "switch_s", "prefill_s", "ratio", "status"}, ...]} (ratio = prefill_s / switch_s).

    Raises:
        ConfigError: lengths that are not positive; ServingError: the serving venv is missing or an engine
            failed (its output is quoted); the errors of `tasks.serve.plan_servers` for the pair.
    """
    from transformers import AutoTokenizer

    from infra.prompts import prompt_of_length
    from infra.vllm_servers import ROOT, serve_python
    from tasks.serve import plan_servers

    if not lengths or any(n < 2 for n in lengths):
        raise ConfigError(f"--lengths must be integers of at least 2 tokens, got {lengths}")
    python = serve_python()
    with tempfile.TemporaryDirectory(prefix="kvlingo-bench-serve-") as tmp:
        tmp = Path(tmp)
        producer, consumer = plan_servers(source, target, translator, store=tmp / "store")
        tokenizer = AutoTokenizer.from_pretrained(consumer.model_dir)
        prompts = [prompt_of_length(tokenizer, WARMUP_TOKENS, seed=1).tolist()]
        prompts += [prompt_of_length(tokenizer, n).tolist() for n in lengths]
        max_model_len = max(lengths) + 8
        produced = _run(python, ROOT, tmp, "producer", {
            "model": producer.model_dir, "kv_role": producer.kv_role, "extra_config": producer.extra,
            "max_tokens": 1, "max_model_len": max_model_len, "phases": [[{"prompt_token_ids": p} for p in prompts]]})
        keys = [out["kv_transfer_params"]["conversation"] for out in produced["phases"][0]]
        phase = []
        for prompt, key in zip(prompts, keys):
            phase += [{"prompt_token_ids": prompt},
                      {"prompt_token_ids": prompt, "kv_transfer_params": {"source_conversation": key}}]
        consumed = _run(python, ROOT, tmp, "consumer", {
            "model": consumer.model_dir, "kv_role": consumer.kv_role, "extra_config": consumer.extra,
            "max_tokens": 1, "max_model_len": max_model_len, "timed": True, "phases": [phase]})
    results = consumed["phases"][0][2:]  # past the warm-up pair
    rows = []
    for i, n in enumerate(lengths):
        native, switched = results[2 * i], results[2 * i + 1]
        rows.append({"n": n, "switch_s": switched["seconds"], "prefill_s": native["seconds"],
                     "ratio": native["seconds"] / switched["seconds"],
                     "status": switched["kv_transfer_params"]["status"]})
    return {"rows": rows}


def _run(python: Path, root: Path, tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    from infra.serving import ServingError
    from infra.vllm_servers import engine_env, engine_errors

    spec_path, out_path = tmp / f"{name}.json", tmp / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    done = subprocess.run([str(python), "-m", "infra.vllm_run", str(spec_path), str(out_path)], cwd=root,
                          env=engine_env(), capture_output=True, text=True)
    if done.returncode != 0:
        errors = engine_errors(done.stderr + done.stdout)
        raise ServingError(f"the {name} engine failed (exit {done.returncode}):\n{errors or done.stderr[-3000:]}")
    return json.loads(out_path.read_text())
