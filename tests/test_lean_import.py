"""`import torch_dad` needs only torch and numpy and initialises no CUDA context."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_import_pulls_no_optional_library():
    # compared with what `import torch` alone loads (some torch builds import tqdm themselves)
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import torch_dad\n"
        "new = set(sys.modules) - before\n"
        "optional = ('transformers', 'triton', 'matplotlib', 'peft', 'trl', 'tqdm', 'zarr')\n"
        "heavy = [m for m in optional if m in new]\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.slow
def test_data_and_integrations_are_attributes_imported_on_first_use():
    code = (
        "import sys\n"
        "import torch_dad as td\n"
        "lazy = ('torch_dad.data', 'torch_dad.integrations')\n"
        "assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]\n"
        "assert 'data' in dir(td) and 'integrations' in dir(td)\n"
        "(x, y), _ = td.data.synthetic(num_train=8, num_test=4, num_features=3, num_classes=2)\n"
        "assert tuple(x.shape) == (8, 3) and td.integrations.__name__ == 'torch_dad.integrations'\n"
        "assert td.training.DADTrainer is td.DADTrainer and td.schedules.warmup_cosine\n"
        "try:\n"
        "    td.no_such_name\n"
        "except AttributeError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'torch_dad' has no attribute 'no_such_name'"
