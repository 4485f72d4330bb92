"""`import torch_dad` needs only torch and numpy and initialises no CUDA context."""

import subprocess
import sys


def test_import_pulls_no_optional_library():
    code = (
        "import sys, torch_dad\n"
        "heavy = [m for m in ('transformers', 'triton', 'matplotlib', 'peft', 'trl', 'tqdm', 'zarr') if m in sys.modules]\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
