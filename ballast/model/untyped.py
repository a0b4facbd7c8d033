"""Where strict typing gives up: the libraries whose own types do not hold for how the
engines call them, each typed ``Any`` here, in one function, and nowhere else.

* :func:`transformers`: its model, config and tokenizer constructors are unannotated
  (``LlamaForCausalLM(config)``, ``GenerationConfig(...)``), ``from_pretrained(...,
  output_loading_info=True)`` is declared to return a model where it returns a pair, its
  cache's layers are a union of kinds one model never mixes, and some of its tables are
  not exported;
* :func:`torch_jit`: ``torch.jit.load`` is unannotated (the rest of torch is typed and
  checked);
* :func:`ray_serve`: Serve's ``RequestRouterConfig`` declares every keyword argument as a
  dict, and its request router's base ``__init__`` is unannotated;
* :data:`VLLMObject`: what the vLLM engine holds of vLLM (its ``AsyncLLM``, the prompts,
  sampling parameters and LoRA requests handed to it). vLLM is imported inside the
  functions that use it (it is heavy, and absent from a replica of another engine), and
  what Ballast reads of those objects is checked where it is read, at start.

Each function imports its module when called: a process that never builds such a model
never pays for the import (transformers takes seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["VLLMObject", "ray_serve", "torch_jit", "transformers"]

#: An object of vLLM's, held as ``Any`` (see the module docstring).
VLLMObject = Any


def transformers(module: str = "") -> Any:
    """``transformers``, or its submodule ``module`` (``"models.auto.configuration_auto"``)."""
    return importlib.import_module(f"transformers.{module}" if module else "transformers")


def torch_jit() -> Any:
    """``torch.jit``."""
    return importlib.import_module("torch.jit")


def ray_serve(module: str) -> Any:
    """``ray.serve``'s submodule ``module`` (``"config"``)."""
    return importlib.import_module(f"ray.serve.{module}")
