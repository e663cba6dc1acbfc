"""dsfp4: run DeepSeek's big MoE models on one GPU with FP4 experts.

The Python API (loaded on first use, so `import dsfp4` stays light):

    import dsfp4
    with dsfp4.Engine("model/", max_context=4096) as engine:
        print(engine.generate("Why is the sky blue?", max_tokens=64).text)

Engine: a converted model loaded for generation (generate, stream, logits, tokenizer, stats, reset, close).
RunOptions: its knobs, the fields of `dsfp4 run`'s flags. Generation: one result. DsfpError: what it raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsfp4.version import __version__

__all__ = ["DsfpError", "Engine", "Generation", "RunOptions", "__version__"]

_LAZY = {
    "Engine": "dsfp4.runtime.engine",
    "Generation": "dsfp4.runtime.generate.generation",
    "RunOptions": "dsfp4.runtime.options",
    "DsfpError": "dsfp4.errors",
}

if TYPE_CHECKING:
    from dsfp4.errors import DsfpError
    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.generate.generation import Generation
    from dsfp4.runtime.options import RunOptions


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dsfp4' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
