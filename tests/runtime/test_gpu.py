"""On a CUDA device the formats and the converter give the same bytes as on the CPU (run with -m gpu)."""

from __future__ import annotations

import json

import pytest
import torch

from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.layout.quant import dequantize, quantize
from tests.fixtures.files import tree_bytes

pytestmark = pytest.mark.gpu


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_e4m3_b128"])
def test_formats_are_bitwise_identical_on_cuda_and_cpu(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(640, 1024, generator=g) * torch.logspace(-6, 2, 1024)[None, :]  # many scale regimes
    w[5, :64] = 0.0
    w[7, 3] = 1e4
    cpu = quantize(fmt, w, "w")
    gpu = quantize(fmt, w.cuda(), "w")
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(_bytes(a), _bytes(b))
    assert torch.equal(dequantize(fmt, cpu), dequantize(fmt, gpu).cpu())


def test_conversion_on_cuda_equals_conversion_on_cpu(checkpoints, tmp_path):
    for device in ("cpu", "cuda"):
        convert(checkpoints["fp8"], tmp_path / device, ConvertOptions(device=device), progress=False)
    cpu, gpu = tree_bytes(tmp_path / "cpu"), tree_bytes(tmp_path / "cuda")
    manifests = [json.loads(t.pop("manifest.json")) for t in (cpu, gpu)]
    assert cpu == gpu  # every backbone file, expert file and copied file
    for key in ("tensors", "files", "experts"):  # quant_error may differ in summation order only
        assert manifests[0][key] == manifests[1][key]


def test_runtime_on_cuda_matches_the_cpu(converted):
    from dsfp4.runtime.models.load import load_model

    tokens = torch.tensor([[0, 5, 9, 11, 40, 7, 3, 100]])
    with torch.no_grad():
        cpu = load_model(converted, torch.device("cpu"), torch.float32, max_len=32)(tokens)[0]
        gpu32 = load_model(converted, torch.device("cuda"), torch.float32, max_len=32)(tokens.cuda())[0].cpu()
        gpu16 = load_model(converted, torch.device("cuda"), torch.bfloat16, max_len=32)(tokens.cuda())[0].cpu()
    span = (cpu.max() - cpu.min()).item()
    assert (gpu32 - cpu).abs().max().item() / span < 1e-4  # Triton FP4 experts vs the torch reference
    assert (gpu16 - cpu).abs().max().item() / span < 5e-2  # bf16 compute


def test_demo_on_cuda(tmp_path):
    from click.testing import CliRunner

    from dsfp4.cli.main import cli

    r = CliRunner().invoke(cli, ["demo", "--dir", str(tmp_path), "--device", "cuda", "--max-tokens", "8"])
    assert r.exit_code == 0, r.output


def test_an_fp4_backbone_decodes_by_cuda_graphs_with_the_tokens_of_eager_steps(checkpoints, tmp_path):
    """NVFP4 attention weights are dequantized inside the captured decode step: nothing may come from the host."""
    from dsfp4.runtime.engine import Engine

    model = tmp_path / "bb4"
    convert(checkpoints["fp8"], model, ConvertOptions(backbone="fp4"), progress=False)
    tokens = []
    for graphs in (True, False):
        with Engine(model, device="cuda", cuda_graph=graphs) as engine:
            tokens.append(engine.generate([0, 5, 9, 11], max_tokens=12, temperature=0).token_ids)
    assert tokens[0] == tokens[1]


def test_an_fp8_head_runs_the_fp8_kernels_with_the_logits_of_the_cpu_reference(checkpoints, tmp_path):
    """--head fp8: the head's logits on CUDA (the FP8 GEMV) stay close to the CPU's dequantized reference; graph
    replay and eager steps give the same tokens."""
    from dsfp4.runtime.engine import Engine

    model = tmp_path / "head8"
    convert(checkpoints["fp8"], model, ConvertOptions(head="fp8"), progress=False)
    ids = list(range(3, 40))
    logits = {}
    for device in ("cpu", "cuda"):
        with Engine(model, device=device, dtype="fp32", max_context=64) as engine:
            logits[device] = engine.logits(ids).float().cpu()  # [T, V]
    assert torch.allclose(logits["cuda"], logits["cpu"], atol=2e-2, rtol=2e-2)
    with Engine(model, device="cuda", max_context=64) as engine:
        graph = engine.generate(ids[:5], max_tokens=8, temperature=0)
    with Engine(model, device="cuda", max_context=64, cuda_graph=False) as engine:
        assert engine.generate(ids[:5], max_tokens=8, temperature=0).token_ids == graph.token_ids
