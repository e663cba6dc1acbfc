"""The planner's sizes: the KV cache it plans is what the model allocates (V3's latent cache, V4's windows,
compressed entries and compressor state), at full width the spec's numbers, and token_bytes reads one row of
V4's hash tables."""

from __future__ import annotations

import pytest
import torch

from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.models.load import load_model
from dsfp4.runtime.plan.limits import SCORE_ELEMENTS
from dsfp4.runtime.plan.planner import cache_bytes, expert_layers, layer_cache_bytes, token_bytes
from dsfp4.runtime.plan.workspace import activation_bytes, attention_group, group_token_bytes, prefill_group
from dsfp4.synthetic.bench_model import model_args


@pytest.mark.parametrize(
    ("model", "with_mtp", "dtype"),
    [("converted", False, torch.float32), ("converted", True, torch.bfloat16), ("v4_converted", False, torch.bfloat16)],
)
def test_planned_kv_cache_is_what_the_model_allocates(model, with_mtp, dtype, request):
    path = request.getfixturevalue(model)
    m = load_model(path, torch.device("cpu"), dtype, max_len=300, with_mtp=with_mtp)  # 300: not a multiple of m
    try:
        allocated = {b.data_ptr(): b.nbytes for b in m.buffers()}  # caches, compressor state, RoPE tables
        assert m.experts.plan.kv_cache == sum(allocated.values())
    finally:
        m.experts.close()


def test_full_width_cache_sizes_match_the_spec():
    """v4-flash-spec e.2: 6,880 B per token of context in BF16 (CSA 320, HCA 8, sliding 0), rings of 128 keys,
    compressor state of 48 + 12 KiB per CSA layer and 512 KiB per HCA layer; V3's MLA 70,272 B per token."""
    _, a = model_args(43, 0, family="v4")
    sizes = [layer_cache_bytes(a, i, 1 << 20, 2) for i in range(a.n_layers)]
    assert sum(grows for grows, _ in sizes) == 6880 << 20
    assert [sizes[i][0] >> 20 for i in (0, 1, 2, 3, 42)] == [0, 0, 320, 8, 320]
    window = 128 * 512 * 2
    assert [sizes[i][1] - window for i in (0, 2, 3)] == [0, 60 << 10, 512 << 10]
    assert cache_bytes(a, range(a.n_layers), 1 << 20, 2) == (6880 + 2 * 32 * 8) * (1 << 20) + sum(f for _, f in sizes)
    _, v3 = model_args(61, 3)
    assert 61 * layer_cache_bytes(v3, 0, 1, 2)[0] == 70_272 and layer_cache_bytes(v3, 0, 1, 2)[1] == 0


def test_token_bytes_reads_one_row_of_the_hash_tables(v4_converted):
    m = Manifest.read(v4_converted)
    a = m.args
    tables = {n for n in m.tensors if n.endswith("tid2eid") and not n.startswith(a.mtp_prefixes)}
    assert len(tables) == a.n_hash_layers == 2
    plain = Manifest(
        m.args,
        m.source,
        m.options,
        {n: t for n, t in m.tensors.items() if n not in tables},
        m.files,
        m.record,
        m.experts,
    )
    (backbone, record), (without, _) = token_bytes(m), token_bytes(plain)
    assert backbone - without == a.n_hash_layers * a.n_activated_experts * 8  # the token's k expert ids (int64)
    assert record == sum(p.nbytes for p in m.record.parts)
    assert expert_layers(m) == tuple(range(a.n_layers))  # every V4 layer reads top-k records, hash layers too


def test_on_cuda_the_largest_backbone_file_shares_the_ram_budget_with_the_process_not_the_cache():
    """load_model maps the backbone's files before it allocates the RAM cache, so on CUDA the cache takes all the RAM
    budget past the process, and the budget need only cover the process plus the larger of the largest file and a
    read's staging; on the CPU the mapping counts on the device side as before."""
    from dsfp4.errors import ConfigError
    from dsfp4.projection.planned import planned_manifest
    from dsfp4.runtime.plan.budget import Budgets, GiB
    from dsfp4.runtime.plan.planner import CUDA_HOST_RESERVE, make_plan

    _, args = model_args(5, 1)
    m = planned_manifest(args, "fp8_e4m3_b128", "nvfp4")
    largest = max(m.files[rel].nbytes for rel in m.backbone_files())
    assert largest > 1 << 30  # the embedding's and head's file
    record, process = m.record.nbytes, 1 << 30

    def plan(cpu: int, device: str = "cuda"):
        return make_plan(
            m, torch.device(device), torch.bfloat16, Budgets(40 * GiB, cpu, "t"), 4096, 512, 4, process=process
        )

    p = plan(20 * GiB)
    assert p.host_base == process + CUDA_HOST_RESERVE
    assert p.ram_slots == (20 * GiB - process - CUDA_HOST_RESERVE) // record
    with pytest.raises(ConfigError, match="largest backbone file"):
        plan(process + CUDA_HOST_RESERVE + largest - 1)
    assert plan(40 * GiB, "cpu").host_base == process + largest


def test_load_model_allocates_the_ram_cache_after_the_backbone_is_read(converted, monkeypatch):
    from dsfp4.runtime.models.weights import Weights
    from dsfp4.runtime.store.expert_store import ExpertStore

    events = []
    monkeypatch.setattr(Weights, "close", lambda self, close=Weights.close: (events.append("weights"), close(self)))
    monkeypatch.setattr(
        ExpertStore, "open_host", lambda self, op=ExpertStore.open_host: (events.append("cache"), op(self))
    )
    m = load_model(converted, torch.device("cpu"), torch.float32, max_len=64)
    try:
        assert events[:2] == ["weights", "cache"] and m.experts.io is not None
    finally:
        m.experts.close()


@pytest.mark.parametrize(("gpu_mem", "cpu_mem"), [(None, None), ("2G", None), (None, "3G")])
def test_on_a_cpu_device_the_default_budgets_share_the_hosts_memory(monkeypatch, gpu_mem, cpu_mem):
    """Both tiers are host memory there: together the defaults stay within what the machine has (the process plus 80%
    of the available RAM), and a budget given takes its size from the other's share."""
    from dsfp4.runtime.plan import budget

    monkeypatch.setattr(budget, "available_ram", lambda: 22 * budget.GiB)
    monkeypatch.setattr(budget, "process_rss", lambda: budget.GiB // 2)
    b = budget.resolve_budgets(gpu_mem, cpu_mem, None, torch.device("cpu"))
    host = budget.GiB // 2 + 22 * budget.GiB * 4 // 5
    assert b.gpu + b.cpu == host and min(b.gpu, b.cpu) > 0
    if gpu_mem is None and cpu_mem is None:
        assert b.gpu == host // 3
    given = {"2G": 2 * budget.GiB, "3G": 3 * budget.GiB}
    assert b.gpu == given.get(gpu_mem, b.gpu) and b.cpu == given.get(cpu_mem, b.cpu)


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_a_long_prompts_feed_forward_group_is_whole_chunks_within_a_chunks_activations(family):
    """layer_pass.py's group: at least a chunk, a whole number of them, at most the context, and (a chunk's share
    beside it) within the activations of a chunk's forward, which its feed-forward half reuses."""
    _, a = model_args(61 if family == "v3" else 43, 3 if family == "v3" else 0, family=family)
    for chunk, context in [(512, 4096), (512, 32768), (256, 163840), (512, 300), (4096, 2048)]:
        group = prefill_group(a, chunk, context, 2)
        t = min(chunk, context)
        assert t <= group <= context and group % t == 0 or group == context
        assert group == t or (group + t) * group_token_bytes(a, 2) <= activation_bytes(a, t, context, 2)
    assert prefill_group(a, 512, 32768, 2) > 4 * 512  # the full width's: several chunks a group


@pytest.mark.parametrize("kernels", [True, False])
def test_a_long_prompts_attention_takes_whole_chunks_within_a_chunks_activations(kernels):
    """V3's attention half takes as many chunks of a sequence at once as a chunk's forward holds of its fixed bytes and
    its bytes a token (the torch formula's score blocks among the fixed); V4 attends a chunk at a time."""
    _, a = model_args(61, 3, family="v3")
    spec = a.family_spec
    for chunk, context in [(512, 4096), (512, 32768), (256, 163840), (512, 300), (4096, 2048)]:
        attend, t = attention_group(a, chunk, context, 2, kernels), min(chunk, context)
        assert t <= attend <= context and attend % t == 0 or attend == context
        fixed, token = spec.attention_bytes(a, context, 2, SCORE_ELEMENTS, kernels)
        assert attend == t or fixed + attend * token <= activation_bytes(a, t, context, 2)
    # the full width's on the device: several chunks a call, fewer for the torch formula's scores
    assert attention_group(a, 512, 32768, 2, True) > attention_group(a, 512, 32768, 2, False) >= 512
    _, v4 = model_args(43, 0, family="v4")
    assert attention_group(v4, 512, 32768, 2, True) == 512


def test_the_fp8_attentions_e4m3_copies_are_planned():
    """--fp8-attention's roundings beside the bf16 tensors (kernels/mla/prefill.py): a chunk's q_nope in e4m3 with a
    scale a token and head, and a key block's k_nope and v with theirs, in the workspace; the attention group, whose
    tokens each hold an e4m3 query more, is no larger."""
    _, a = model_args(61, 3, family="v3")
    h, n, v = a.n_heads, a.qk_nope_head_dim, a.v_head_dim
    for chunk, context in [(512, 4096), (512, 32768), (256, 163840)]:
        rows = min(context, SCORE_ELEMENTS // (h * (n + v)))
        extra = chunk * h * (n + 4) + rows * h * (n + v + 4) + h * v * 4
        assert activation_bytes(a, chunk, context, 2, True) - activation_bytes(a, chunk, context, 2) == extra
        assert attention_group(a, chunk, context, 2, True, True) <= attention_group(a, chunk, context, 2, True)
        fixed, token = a.family_spec.attention_bytes(a, context, 2, SCORE_ELEMENTS, True, True)
        attend = attention_group(a, chunk, context, 2, True, True)
        assert attend == chunk or fixed + attend * token <= activation_bytes(a, chunk, context, 2, True)
