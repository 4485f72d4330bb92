"""Optional integrations (transformers, peft, trl, unsloth); each submodule imports its library lazily.

Import them explicitly, e.g. ``from torch_dad.integrations import trl``; ``import torch_dad`` never
imports this package.
"""
