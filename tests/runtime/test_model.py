"""The runtime model against transformers on tiny checkpoints: logits, incremental decoding, MTP, FP4 error."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.runtime.models.load import load_model
from dsfp4.runtime.options import RunOptions
from dsfp4.synthetic.hf_state import fuse_experts
from tests.fixtures.reference import dequantized_weights, hf_model
from tests.fixtures.tiny_checkpoint import build_checkpoint

CPU = torch.device("cpu")
YARN_V2 = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
CONFIGS = {
    "v3_fp8_qlora_yarn_groups": ("fp8", {}),  # q_lora, YaRN, 4 expert groups, one dense layer, MTP
    "v3_nvfp4_source": ("nvfp4", {}),
    "v3_no_qlora_no_yarn_one_group": (
        "bf16",
        {"q_lora_rank": None, "rope_scaling": None, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0},
    ),
    # V2-Lite; "greedy" routing must ignore n_group, as transformers' V2 router does
    "v2_lite": (
        "bf16",
        {
            "model_type": "deepseek_v2",
            "q_lora_rank": None,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 2,
            "rope_scaling": YARN_V2,
        },
    ),
}
PROMPTS = [[0, 5, 9, 11, 40, 7, 3, 100, 200, 300, 17], [0, 15, 19, 21, 8]]  # different lengths, right-padded


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory):
    variant, dims = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = build_checkpoint(root / "src", variant, dims)
    convert(src, root / "model", ConvertOptions(workers=1), progress=False)
    return root / "model"


def _batch(pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(map(len, PROMPTS))
    tokens = torch.tensor([p + [pad] * (n - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in PROMPTS])
    return tokens, mask


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / (want.max() - want.min())).item()


@pytest.mark.slow
def test_logits_match_transformers_for_every_position(model_dir):
    ref = hf_model(model_dir)
    model = load_model(model_dir, CPU, torch.float32, max_len=64, options=RunOptions(max_batch=2))
    tokens, mask = _batch()
    with torch.no_grad():
        want = ref(tokens, attention_mask=mask).logits
        got, _ = model(tokens)
    for b, p in enumerate(PROMPTS):
        assert _rel_err(got[b, : len(p)], want[b, : len(p)]) < 1e-3


def test_incremental_decoding_equals_a_full_forward(model_dir):
    model = load_model(model_dir, CPU, torch.float32, max_len=64)
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        full, _ = model(tokens)
        steps = [model(tokens[:, :4])[0]]
        steps += [model(tokens[:, i : i + 1], start_pos=i)[0] for i in range(4, tokens.shape[1])]
    assert _rel_err(torch.cat(steps, dim=1), full) < 1e-5


def test_steps_at_a_device_position_equal_steps_at_a_host_position(model_dir):
    """The form a captured decode step takes: the position in a device tensor, attention over a fixed span
    of the cache with the rows past the position masked. It gives the eager step's logits."""
    from dsfp4.runtime.models.position import DevicePosition

    model = load_model(model_dir, CPU, torch.float32, max_len=64)
    tokens = torch.tensor([PROMPTS[0]])
    n, pos = tokens.shape[1], torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        want = [model(tokens[:, :4])[0][:, -1:]] + [model(tokens[:, i : i + 1], i)[0] for i in range(4, n)]
        for block in model.layers:  # rows past a step's position hold stale values, as a reused cache does
            block.attn.kv_cache.normal_()
            block.attn.pe_cache.normal_()
        got = [model(tokens[:, :4])[0][:, -1:]]
        for i in range(4, n):
            pos.fill_(i)
            got.append(model(tokens[:, i : i + 1], DevicePosition(pos, 16))[0])  # rows i+1..15 are masked
    assert _rel_err(torch.cat(got, dim=1), torch.cat(want, dim=1)) < 1e-5


def test_mtp_module_matches_its_block_run_by_transformers(model_dir):
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    model = load_model(model_dir, CPU, torch.float32, max_len=64, with_mtp=True)
    a = model.args
    if not a.n_mtp_layers:
        pytest.skip("this family has no MTP layer")
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        _, h = model(tokens[:, :-1])
        mtp = model.mtp[0]
        got = mtp(h, tokens[:, 1:], 0, model.freqs_cis[: h.shape[1]], model.causal_mask(h.shape[1], 0, CPU))
    # Reference: u = eh_proj([enorm(emb(next)); hnorm(h)]), then the MTP block, its norm and head as a
    # one-layer transformers model fed u as inputs_embeds.
    w, n = dequantized_weights(model_dir), a.n_layers
    p = f"model.layers.{n}."

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a.norm_eps))

    e = F.embedding(tokens[:, 1:], w[p + "embed_tokens.weight"])
    u = torch.cat([rms(e, w[p + "enorm.weight"]), rms(h, w[p + "hnorm.weight"])], dim=-1) @ w[p + "eh_proj.weight"].T
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.quantization_config, cfg.num_hidden_layers, cfg.first_k_dense_replace = None, 1, 0
    one = DeepseekV3ForCausalLM(cfg).float().eval()
    state = {k.replace(p, "model.layers.0."): v for k, v in w.items() if k.startswith(p)}
    state["model.norm.weight"] = state.pop("model.layers.0.shared_head.norm.weight")
    state["lm_head.weight"] = state.pop("model.layers.0.shared_head.head.weight")
    for k in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight"):
        state.pop("model.layers.0." + k)
    state["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]
    fuse_experts(state, "model.layers.0.mlp.experts.", a.n_routed_experts)
    one.load_state_dict(state, strict=True)
    with torch.no_grad():
        want = one(inputs_embeds=u).logits
    assert _rel_err(got, want) < 1e-3


def test_fp4_error_against_the_unquantized_weights(tmp_path, capsys):
    """Top-1 agreement and KL(reference || dsfp4) per token on a fixed prompt set, against transformers
    holding the original BF16 weights (our runtime: NVFP4 experts, FP8 backbone)."""
    from transformers import AutoModelForCausalLM

    src = build_checkpoint(tmp_path / "src", "bf16", {"vocab_size": 640})
    convert(src, tmp_path / "model", ConvertOptions(workers=1), progress=False)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = load_model(tmp_path / "model", CPU, torch.float32, max_len=64)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 600, (8, 24), generator=g)
    agree, kl = [], []
    with torch.no_grad():
        for p in prompts:
            want = ref(p[None]).logits[0].log_softmax(-1)
            got = model(p[None])[0][0].log_softmax(-1)
            agree.append((want.argmax(-1) == got.argmax(-1)).float())
            kl.append((want.exp() * (want - got)).sum(-1))
    top1, mean_kl = torch.cat(agree).mean().item(), torch.cat(kl).mean().item()
    report = {"tokens": prompts.numel(), "top1_agreement": round(top1, 4), "mean_kl_nats": round(mean_kl, 6)}
    with capsys.disabled():
        print(f"\nFP4 error vs unquantized weights (tiny V3, NVFP4 experts + FP8 backbone): {json.dumps(report)}")
    assert top1 > 0.5 and mean_kl < 0.05, report


def test_prefill_loads_each_used_expert_once_per_layer(model_dir):
    model = load_model(model_dir, CPU, torch.float32, max_len=64, options=RunOptions(max_batch=2))
    calls, real = [], model.experts.load_waves
    model.experts.load_waves = lambda layer, experts, *rest, **named: (
        calls.append((layer, list(experts))) or real(layer, experts, *rest, **named)
    )
    tokens, _ = _batch()
    with torch.no_grad():
        model(tokens)
    layers = [layer for layer, _ in calls]
    assert layers == sorted(set(layers)) == [i for i in range(model.args.n_layers) if model.args.is_moe_layer(i)]
    assert all(len(set(ids)) == len(ids) > model.args.n_activated_experts for _, ids in calls)


def test_attention_in_query_chunks_equals_one_pass(model_dir, monkeypatch):
    import dsfp4.runtime.models.v3.attention as attention

    model = load_model(model_dir, CPU, torch.float32, max_len=64)
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        whole = model(tokens)[0]
        monkeypatch.setattr(attention, "SCORE_ELEMENTS", 3 * model.args.n_heads * tokens.shape[1])  # 3 queries
        chunked = model(tokens)[0]
    assert _rel_err(chunked, whole) < 1e-6


def test_router_bias_stays_fp32_in_a_bf16_model(model_dir):
    model = load_model(model_dir, CPU, torch.bfloat16, max_len=16)
    gates = [b.ffn.gate for b in model.layers if hasattr(b.ffn, "gate")]
    assert all(g.weight.dtype == torch.float32 for g in gates)
    assert all(g.bias is None or g.bias.dtype == torch.float32 for g in gates)
