"""Run one vLLM engine with the kvlingo connector over prepared requests and record what it did (the serving
tests and `kvlingo bench serve` run it with the serving venv's python:
`.venv-serve/bin/python -m infra.vllm_run SPEC.json OUT.json`).

SPEC: {"model": dir, "kv_role": ..., "extra_config": {...}, "max_tokens": int, "max_model_len": int (2048),
       "timed": bool (false), "phases": [[{"prompt_token_ids": [...], "kv_transfer_params": {...} | null}, ...], ...]}
Each phase is one `LLM.generate` call, phases run in order (a later phase sees the prefix cache the earlier ones
left); with "timed" every request is its own call and its wall time is recorded. OUT: {"phases": [[{"token_ids",
"num_cached_tokens", "kv_transfer_params", "seconds"}, ...], ...], "block_size": int}.
"""

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    from pathlib import Path

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from infra.vllm_servers import runs_eager

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["model"], dtype="float32", max_model_len=spec.get("max_model_len", 2048), seed=0,
        enable_prefix_caching=True, enforce_eager=runs_eager(Path(sys.prefix)),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvlingoConnector", kv_connector_module_path="infra.vllm_connector",
            kv_role=spec["kv_role"], kv_connector_extra_config=spec["extra_config"]),
    )

    def params(item):
        extra = {"kv_transfer_params": item["kv_transfer_params"]} if item.get("kv_transfer_params") else None
        return SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, extra_args=extra)

    def record(output, seconds):
        return {"token_ids": list(output.outputs[0].token_ids), "num_cached_tokens": output.num_cached_tokens,
                "kv_transfer_params": output.kv_transfer_params, "seconds": seconds}

    phases = []
    for phase in spec["phases"]:
        if spec.get("timed"):
            results = []
            for item in phase:
                start = time.perf_counter()
                output = llm.generate({"prompt_token_ids": item["prompt_token_ids"]}, params(item), use_tqdm=False)[0]
                results.append(record(output, time.perf_counter() - start))
            phases.append(results)
        else:
            outputs = llm.generate([{"prompt_token_ids": item["prompt_token_ids"]} for item in phase],
                                   [params(item) for item in phase], use_tqdm=False)
            phases.append([record(output, None) for output in outputs])
    with open(out_path, "w") as f:
        json.dump({"phases": phases, "block_size": llm.llm_engine.vllm_config.cache_config.block_size}, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from re-running this
    main(sys.argv[1], sys.argv[2])
