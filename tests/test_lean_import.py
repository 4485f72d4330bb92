"""`import torch_dad` needs only torch and numpy and initialises no CUDA context."""

import subprocess
import sys


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
