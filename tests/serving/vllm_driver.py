"""Runs one vLLM engine with the kvlingo connector and records what it generated (run by the serving tests with
the serving venv's python: `.venv-serve/bin/python tests/serving/vllm_driver.py SPEC.json OUT.json`).

SPEC: {"model": dir, "kv_role": ..., "extra_config": {...}, "max_tokens": int,
       "phases": [[{"prompt_token_ids": [...], "kv_transfer_params": {...} | null}, ...], ...]}
Each phase is one `LLM.generate` call, phases run in order (so a later phase sees the prefix cache the earlier
ones left). OUT: {"phases": [[{"token_ids", "num_cached_tokens", "kv_transfer_params"}, ...], ...],
"block_size": int}.
"""

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    spec = json.loads(open(spec_path).read())
    llm = LLM(
        model=spec["model"], dtype="float32", max_model_len=spec.get("max_model_len", 2048), seed=0,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvlingoConnector", kv_connector_module_path="infra.vllm_connector",
            kv_role=spec["kv_role"], kv_connector_extra_config=spec["extra_config"]),
    )
    phases = []
    for phase in spec["phases"]:
        prompts = [{"prompt_token_ids": item["prompt_token_ids"]} for item in phase]
        params = [SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                 extra_args={"kv_transfer_params": item["kv_transfer_params"]}
                                 if item.get("kv_transfer_params") else None) for item in phase]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        phases.append([{"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                        "kv_transfer_params": o.kv_transfer_params} for o in outputs])
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    with open(out_path, "w") as f:
        json.dump({"phases": phases, "block_size": block_size}, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from re-running this
    main(sys.argv[1], sys.argv[2])
