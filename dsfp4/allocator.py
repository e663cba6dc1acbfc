"""The CUDA allocator's setting the device budget relies on, made before torch is imported where it can be (the CLI
imports torch only when a command needs it)."""

from __future__ import annotations

import os
import sys

ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def use_expandable_segments() -> bool:
    """Expandable segments keep torch's reserved device memory close to what is allocated, so a --gpu-mem budget
    holds: on, unless the user's allocator settings say otherwise -> whether this call turned it on. Before CUDA's
    first allocation the environment is enough; after it (a library user's process) the allocator is told."""
    if any("expandable_segments" in os.environ.get(v, "") for v in ALLOC_VARS):
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
        filter(None, (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), EXPANDABLE))
    )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    return True
