"""The CUDA allocator setting the device budget relies on: expandable segments, on in the CLI and the Python API
alike, unless the user's allocator settings decide."""

from __future__ import annotations

import pytest
import torch

from dsfp4 import allocator


@pytest.mark.parametrize(
    ("given", "after", "told"),
    [
        ({}, "expandable_segments:True", True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, "max_split_size_mb:64,expandable_segments:True", True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "expandable_segments:False", False),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, None, False),
    ],
)
def test_expandable_segments_unless_the_user_says(monkeypatch, given, after, told):
    for var in allocator.ALLOC_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in given.items():
        monkeypatch.setenv(var, value)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a library user's process, CUDA in use
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    assert allocator.use_expandable_segments() is told
    assert allocator.os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == after
    assert calls == (["expandable_segments:True"] if told else [])


@pytest.mark.gpu
def test_a_library_users_engine_on_cuda_turns_them_on(converted):
    import os
    import subprocess
    import sys

    code = (
        "import os, torch, dsfp4; torch.zeros(1, device='cuda');"  # CUDA in use before the engine, as in a notebook
        f"e = dsfp4.Engine({str(converted)!r}, device='cuda', max_context=64);"
        "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF')); e.close()"
    )
    env = {k: v for k, v in os.environ.items() if k not in allocator.ALLOC_VARS}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "expandable_segments:True", r.stderr
