"""Optional integrations with other libraries, each imported only when first used.

``torch_dad.integrations.transformers`` needs ``pip install torch-dad[hf]``, ``trl`` needs
``torch-dad[trl]``; ``causal_lm`` and ``unsloth`` need transformers. Importing ``torch_dad`` or this
package imports none of those libraries.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_SUBMODULES = ("transformers", "causal_lm", "trl", "unsloth")


def __getattr__(name: str) -> ModuleType:
    # `torch_dad.integrations.<name>` resolves on first attribute access, so the optional
    # library is only imported by users who ask for it
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
