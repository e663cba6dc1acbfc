"""The planner: budgets in, placement out. It decides what lives on the device (backbone, KV cache,
workspace, expert slots) and in RAM (the record cache and its staging), refuses budgets that cannot
hold one token's working set, and prints the plan as a table (`dsfp4 run --plan`).

Every number comes from the manifest (stored sizes, record size) and the run options; the workspace
is an upper estimate of transient tensors (dequantized backbone matrices, prefill activations),
checked against measured peaks on the GPU machine (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.kernel_paths import kernel_paths
from dsfp4.layout.formats import FORMATS, stored_nbytes
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.plan.budget import Budgets, process_rss
from dsfp4.runtime.plan.cards import CardShare, card_rows
from dsfp4.runtime.plan.host_backbone import (
    ROUTER_SUFFIXES,
    HostBackbone,
    caches_on_host,
    place_on_host,
    tensor_bytes,
)
from dsfp4.runtime.plan.limits import BATCH_KV_SHARE, PLANNED_WAVES
from dsfp4.runtime.plan.workspace import attention_group, forward_tokens, prefill_group, workspace_bytes
from dsfp4.units import format_bytes

FP32 = 4
# an entry of the RoPE tables
COMPLEX64 = 8
# host memory the CUDA context, its libraries and Triton take after the plan, measured on the H200 machine
# (scripts/bench_host_memory.py, docs/BENCHMARKS.md), and a margin for kernels a longer run compiles
# 3.25 GiB
CUDA_HOST_RESERVE = 13 << 28
# tables a decode token reads one row of
ONE_ROW = ("embed.weight", "ffn.gate.tid2eid")


@dataclass(frozen=True)
class Plan:
    device: str
    budgets: Budgets
    # bytes of backbone weights on the device
    backbone: int
    kv_cache: int
    workspace: int
    # bytes per expert record (one slot)
    record: int
    gpu_slots: int
    ram_slots: int
    # RAM slots that reads in flight may hold at once (part of ram_slots)
    staging: int
    # process memory beside the RAM cache (interpreter, libraries; on the CPU, loading too)
    host_base: int
    total_records: int
    # MoE layers whose records the run uses
    expert_layers: tuple[int, ...] = ()
    host_backbone: int = (
        # bytes of backbone in pinned RAM, read by the device in place (runtime/plan/host_backbone.py)
        0
    )
    on_host: HostBackbone = HostBackbone()
    # sequences decoded together (cache_slots: the KV cache holds theirs)
    max_batch: int = 1
    # of ram_slots, those sized for a cold record (narrow_slots); the rest hold a record each
    cold_slots: int = 0
    # bytes of a cold record (one narrow slot)
    cold_record: int = 0
    # tokens a layer-wise pass's feed-forward takes at once (prefill_group; 0: a chunk's)
    prefill_group: int = 0
    # bytes of KV cache in pinned RAM, read by the device in place (on_host.caches; kv_cache is the device's part)
    host_kv: int = 0
    # tokens of one sequence a layer-wise pass's attention takes at once (attention_group; 0: a chunk's)
    attention_group: int = 0
    # a run split across cards (--devices): what each holds (runtime/plan/device_split.py); backbone, kv_cache and
    # gpu_slots above are their sums, workspace each card's; () on one device
    cards: tuple[CardShare, ...] = ()

    @property
    def record_cache(self) -> int:
        """Bytes of the RAM cache's slots: record-sized ones and the narrow ones."""
        return (self.ram_slots - self.cold_slots) * self.record + self.cold_slots * self.cold_record

    @property
    def held_share(self) -> float:
        """The share of the run's expert records the device and RAM slots hold at once (1 or more: all of them)."""
        return (self.gpu_slots + self.ram_slots) / self.total_records if self.total_records else 1.0

    def table(self) -> str:
        r, n = self.record, self.total_records
        # both tiers are host memory: the process is counted on the device side
        on_cpu = self.device.startswith("cpu")
        process = ("  process", format_bytes(self.host_base), "interpreter, libraries" + ", loading" * on_cpu)
        rows = [
            ("budgets", self.budgets.source, ""),
            *(card_rows(self.cards, r, process if on_cpu else None) if self.cards else self._device_rows(process)),
            ("RAM budget", format_bytes(self.budgets.cpu), ""),
            *([] if on_cpu else [process]),
            *(
                [("  backbone", format_bytes(self.host_backbone), self.on_host.describe())]
                if self.host_backbone
                else []
            ),
            *([("  KV cache", format_bytes(self.host_kv), self.on_host.describe_caches())] if self.host_kv else []),
            ("  record cache", format_bytes(self.record_cache), self._cache_slots()),
            ("experts", f"{n} records", f"{self.gpu_slots / n:.0%} on {self.device}, {self.ram_slots / n:.0%} in RAM"),
        ]
        w = max(len(a) for a, _, _ in rows)
        return "\n".join(f"{a:<{w}}  {b:>12}  {c}".rstrip() for a, b, c in rows)

    def _device_rows(self, process: tuple[str, str, str]) -> list[tuple[str, str, str]]:
        """The table's rows of the one device: its budget and what it holds."""
        r = self.record
        return [
            (f"device budget ({self.device})", format_bytes(self.budgets.gpu), ""),
            *([process] if self.device == "cpu" else []),
            ("  backbone", format_bytes(self.backbone), "weights in their stored formats"),
            (
                "  KV cache",
                format_bytes(self.kv_cache),
                "caches, their state and RoPE tables for --max-context"
                + (f", {self.max_batch} batched sequences and the prefill's" if self.max_batch > 1 else ""),
            ),
            (
                "  workspace",
                format_bytes(self.workspace),
                "transient tensors (estimate)"
                + (
                    f"; a long prompt's feed-forward takes {self.prefill_group} tokens at once"
                    * bool(self.prefill_group)
                )
                + (f", its attention {self.attention_group}" * bool(self.attention_group)),
            ),
            ("  expert slots", format_bytes(self.gpu_slots * r), f"{self.gpu_slots} x {format_bytes(r)}"),
        ]

    def _cache_slots(self) -> str:
        wide = f"{self.ram_slots - self.cold_slots} slots"
        if self.cold_slots:
            wide += f" and {self.cold_slots} of {format_bytes(self.cold_record)} for cold records"
        return f"{wide}, {self.staging} for reads"


def narrow_slots(
    room: int, record: int, cold: int, n_cold: int, total: int, least: int, beside: int
) -> tuple[int, int] | None:
    """(RAM slots, how many of them narrow) for a record cache of `room` bytes when `n_cold` of the run's `total`
    records are cold ones of `cold` bytes (layout/cold.py): a record-sized slot for every record of the model's format
    (the profile's hottest), and the rest of the room in narrow slots, so that RAM holds record / cold times as many
    cold records as it would wide. None (record-sized slots alone, shared by both kinds) when they hold every record
    beside the `beside` device slots (a mapped run reads them in place, widened), or when the room cannot hold every
    record of the model's format beside `least` narrow slots (the reads in flight, and one token's experts of a
    layer): the hot set would lose slots to narrow ones that cold records could share (docs/BENCHMARKS.md: RAM holds
    cold records in slots of their size)."""
    wide = max(total - n_cold, least)
    if not (cold and n_cold) or beside + room // record >= total or room < wide * record + least * cold:
        return None
    narrow = min((room - wide * record) // cold, n_cold)
    return wide + narrow, narrow


def with_narrow_slots(plan: Plan, cold: int, n_cold: int, top_k: int) -> Plan:
    """`plan` with the bytes of its record cache split for `n_cold` cold records of `cold` bytes as make_plan splits a
    RAM budget (narrow_slots), or as it is where that gives no split: for plans whose slots were set by hand (a share
    of a whole model's, in benchmarks and projections)."""
    least = max(plan.staging, top_k)
    split = narrow_slots(plan.record_cache, plan.record, cold, n_cold, plan.total_records, least, plan.gpu_slots)
    if split is None:
        return plan
    return dataclasses.replace(plan, ram_slots=split[0], cold_slots=split[1], cold_record=cold)


def narrowed(plan: Plan, manifest: Manifest) -> Plan:
    """with_narrow_slots for the manifest's cold records."""
    cold, n_cold = cold_records(manifest, plan.expert_layers)
    return with_narrow_slots(plan, cold, n_cold, manifest.args.n_activated_experts)


def _used_layers(manifest: Manifest, with_mtp: bool) -> range:
    a = manifest.args
    return range(a.n_blocks if with_mtp else a.n_layers)


def expert_layers(manifest: Manifest, with_mtp: bool = False) -> tuple[int, ...]:
    """The MoE layers with expert records that a run uses (the MTP layer's only `with_mtp`)."""
    return tuple(i for i in _used_layers(manifest, with_mtp) if i in manifest.experts)


def cold_records(manifest: Manifest, layers: Iterable[int]) -> tuple[int, int]:
    """(bytes of the largest cold record of these MoE layers, which a narrow slot holds: a recipe's may differ by
    layer; how many of their records are stored in cold codes); (0, 0) without."""
    layers = tuple(layers)
    return manifest.cold_nbytes(layers), sum(len(manifest.experts[layer].cold) for layer in layers)


def backbone_bytes(manifest: Manifest, dtype: torch.dtype, with_mtp: bool = False) -> int:
    """Bytes of the backbone as loaded: quantized matrices as stored, plain tensors cast to the runtime dtype (the
    router to fp32)."""
    a, elt = manifest.args, torch.empty((), dtype=dtype).element_size()
    names = (n for n in manifest.tensors if with_mtp or not n.startswith(a.mtp_prefixes))
    return sum(tensor_bytes(n, manifest.tensors[n], elt) for n in names)


def token_bytes(manifest: Manifest) -> tuple[int, int]:
    """(backbone bytes a decode token of the main model reads: every matrix as stored, one embedding row,
    routers in fp32 as the runtime holds them, the MTP layers left out; bytes the kernels read of one expert
    record: codes and scales, no padding)."""
    a, total = manifest.args, 0
    for name, t in manifest.tensors.items():
        if name.startswith(a.mtp_prefixes):
            continue
        n = stored_nbytes(FORMATS[t.format], tuple(t.shape))
        # one row (V4's hash layers: the token's experts); a tied embedding is the head too
        if name.endswith(ONE_ROW):
            n = n // t.shape[0] + (n if name == "embed.weight" and a.tie_word_embeddings else 0)
        elif name.endswith(ROUTER_SUFFIXES):
            n = n * 32 // FORMATS[t.format].bits
        total += n
    record = sum(p.nbytes for p in manifest.record.parts) if manifest.record else 0
    return total, record


def layer_cache_bytes(a: ModelArgs, layer: int, max_context: int, elt: int) -> tuple[int, int]:
    """(bytes that grow with the context, fixed bytes) of one layer's caches for one sequence of `max_context`
    tokens, as the model allocates them: the family's rule (layout/family.py; V3: the latent cache and its RoPE part,
    V4: the sliding window, the compressed entries and the compressors' state)."""
    return a.family_spec.layer_cache(a, layer, max_context, elt)


def cache_bytes(a: ModelArgs, layers: range, max_context: int, elt: int, sequences: int = 1) -> int:
    """Every buffer the model allocates for `sequences` cache slots of `max_context`: the layers' caches and state,
    and the RoPE tables ([max_context, rope_dim / 2] complex64, once; V4 one per base, plain and compress)."""
    rope = a.family_spec.rope_tables * max_context * (a.qk_rope_head_dim // 2) * COMPLEX64
    return rope + sequences * sequence_cache_bytes(a, layers, max_context, elt)


def sequence_cache_bytes(a: ModelArgs, layers: range, max_context: int, elt: int) -> int:
    """One cache slot's bytes: every layer's caches and state for a sequence of `max_context`."""
    return sum(sum(layer_cache_bytes(a, i, max_context, elt)) for i in layers)


def auto_batch(a: ModelArgs, gpu_budget: int, max_context: int, elt: int, want: int) -> int:
    """--max-batch 0: `want` sequences (the mode's), as many as fit BATCH_KV_SHARE of the device budget with caches of
    `max_context` (at least 1). The plan then caps it (union_batch)."""
    if want <= 1:
        return 1
    # a batch runs without the MTP layer
    per = sequence_cache_bytes(a, range(a.n_layers), max_context, elt)
    return max(1, min(want, int(gpu_budget * BATCH_KV_SHARE) // max(per, 1)))


def expected_union(n: int, k: int, b: int) -> float:
    """Distinct experts b tokens choose in one MoE layer when each picks k of n independently and uniformly: an upper
    estimate (real routing is skewed: docs/BENCHMARKS.md, batched decode)."""
    return n * (1 - (1 - k / n) ** b)


def union_batch(a: ModelArgs, plan: Plan, want: int) -> int:
    """The largest batch up to `want` whose expected union of experts per MoE layer fits that layer's share of the
    device and RAM slots; beyond it a step's experts evict each other from RAM (docs/BENCHMARKS.md, batched decode:
    16 sequences at V3's 16g share). When the tiers hold every record: want."""
    layers, held = len(plan.expert_layers), plan.gpu_slots + plan.ram_slots
    if not layers or held >= plan.total_records:
        return want
    b = want
    while b > 1 and expected_union(a.n_routed_experts, a.n_activated_experts, b) > held / layers:
        b -= 1
    return b


def cache_slots(max_batch: int) -> int:
    """Cache slots a run allocates: one sequence's, and with a batch (max_batch > 1) one per batched sequence beside
    it (the single slot prefills a request's prompt, which then moves to its batch slot: runtime/generate/batch.py)."""
    return 1 + max_batch if max_batch > 1 else 1


@dataclass(frozen=True)
class RunNeeds:
    """What a run holds whatever its budgets, in bytes: make_plan's first step, which its two tiers then place."""

    # one expert record (0: no routed experts)
    record: int
    total_records: int
    # expert slots one token needs (0 without records)
    top_k: int
    backbone: int
    kv: int
    workspace: int
    # the process beside the caches; on the CPU, the mapped backbone file too
    host_base: int
    # the backbone file mapped while it loads
    largest_file: int


@dataclass(frozen=True)
class DeviceTier:
    """What the device holds once the backbone, caches and workspace are placed: what of them stays in pinned RAM
    (and its bytes: backbone, caches) and the expert slots left."""

    on_host: HostBackbone
    backbone_moved: int
    caches_moved: int
    gpu_slots: int


def _device_tier(
    manifest: Manifest,
    device: torch.device,
    elt: int,
    budgets: Budgets,
    n: RunNeeds,
    max_context: int,
    max_batch: int,
    used: range,
) -> DeviceTier:
    """The device tier; on CUDA what does not fit stays in pinned RAM (host_backbone.py: layers' caches first, where
    the family's model can, then backbone), with room for PLANNED_WAVES of expert slots."""
    a, on_host, moved, cached = manifest.args, HostBackbone(), 0, 0
    if device.type == "cuda":
        keep = min(PLANNED_WAVES * n.top_k, n.total_records)
        short = n.backbone + n.kv + n.workspace + keep * n.record - budgets.gpu
        caches = ()
        if short > 0 and a.family_spec.caches_in_ram:
            slots = cache_slots(max_batch)
            sizes = {i: slots * sum(layer_cache_bytes(a, i, max_context, elt)) for i in used}
            caches, cached = caches_on_host(sizes, short)
        on_host, moved = place_on_host(manifest, elt, range(a.n_layers), short - cached)
        on_host = dataclasses.replace(on_host, caches=caches)
    backbone, kv = n.backbone - moved, n.kv - cached
    # on the CPU the 'device' tier is host memory too: the process and the mapping are counted there
    fixed = backbone + kv + n.workspace + (n.host_base if device.type == "cpu" else 0)
    min_gpu = fixed + n.top_k * n.record
    if budgets.gpu < min_gpu:
        in_ram = f" with {format_bytes(cached)} in RAM" if cached else ""
        raise ConfigError(
            f"--gpu-mem {format_bytes(budgets.gpu)} is too small: this model needs at least "
            f"{format_bytes(min_gpu)} on {device} (backbone {format_bytes(backbone)}"
            f"{f' with {format_bytes(moved)} of it in RAM' if moved else ''}, KV cache for "
            f"--max-context {max_context} {format_bytes(kv)}{in_ram}, "
            f"workspace {format_bytes(n.workspace)}, {n.top_k} expert slots {format_bytes(n.top_k * n.record)}); "
            f"lower --max-context{', --max-batch' * (max_batch > 1)} or --prefill-chunk, or convert with --backbone fp4"
        )
    gpu_slots = min((budgets.gpu - fixed) // n.record, n.total_records) if n.record else 0
    return DeviceTier(on_host, moved, cached, gpu_slots)


def ram_tier(
    manifest: Manifest,
    device: torch.device,
    budgets: Budgets,
    n: RunNeeds,
    used: tuple[int, ...],
    tier: DeviceTier,
    io_threads: int,
    max_context: int,
) -> tuple[int, int, int, int]:
    """(staging slots, RAM slots, how many of them narrow, bytes of a cold record): the RAM budget past the process
    and what the device tier left in RAM (backbone, caches), which must map the largest backbone file (on CUDA) and
    read io_threads records at once, split for cold records as narrow_slots says."""
    record, total, moved = n.record, n.total_records, tier.backbone_moved + tier.caches_moved
    staging = min(io_threads, total) if record else 0
    host_cpu = 0 if device.type == "cpu" else n.host_base + moved
    loading = 0 if device.type == "cpu" else n.largest_file
    min_cpu = host_cpu + max(staging * record, loading)
    if budgets.cpu < min_cpu:
        held = f" and {format_bytes(moved)} of backbone and KV cache" if moved else ""
        # the caches in RAM grow with the context: the longest whose caches the budget holds
        spare = budgets.cpu - (min_cpu - tier.caches_moved)
        fit = max_context * spare // tier.caches_moved if tier.caches_moved and spare > 0 else 0
        shorter = f"; or --max-context {fit} at most, whose KV cache in RAM fits" if fit else ""
        raise ConfigError(
            f"--cpu-mem {format_bytes(budgets.cpu)} is too small: the process holds {format_bytes(host_cpu - moved)}"
            f"{held} and needs {format_bytes(max(staging * record, loading))} more to map its largest backbone file "
            f"({format_bytes(loading)}) and to read {staging} records at once; give at least "
            f"{format_bytes(min_cpu)} (or fewer --io-threads{shorter})"
        )
    cold, n_cold = cold_records(manifest, used)
    room = budgets.cpu - host_cpu
    ram_slots = max(min(room // record, total), staging) if record else 0
    split = narrow_slots(room, record, cold, n_cold, total, max(staging, n.top_k), tier.gpu_slots) if record else None
    ram_slots, cold_slots = split or (ram_slots, 0)
    return staging, ram_slots, cold_slots, cold


def make_plan(
    manifest: Manifest,
    device: torch.device,
    dtype: torch.dtype,
    budgets: Budgets,
    max_context: int,
    prefill_chunk: int,
    io_threads: int,
    with_mtp: bool = False,
    host_extra: int = 0,
    process: int | None = None,
    fp8_kernels: bool | None = None,
    kernels: bool | None = None,
    max_batch: int = 1,
    fp8_attention: bool = False,
) -> Plan:
    """What the run needs (RunNeeds), placed on the device tier, then in RAM. `host_extra`: host memory the caller will
    hold besides the model (profile-hot's hidden states); `process`: the process's own before the model loads
    (default: this process's RSS now; a projection gives a user's); `fp8_kernels`: whether the FP8 kernels run on the
    device, natively or by bits, else the reference's dense copy is reserved, and `kernels`: whether the Triton kernels
    run (both by default the device's kernel_paths: a CUDA device where this machine has none is a projection's user
    card, which runs them); `max_batch`: sequences decoded together, each with caches of its own (cache_slots);
    `fp8_attention`: the prefill attention's FP8 variant (run --fp8-attention), whose e4m3 copies the workspace and
    the attention group count."""
    a, elt = manifest.args, torch.empty((), dtype=dtype).element_size()
    used = expert_layers(manifest, with_mtp)
    # the device's kernel paths (a CUDA device on a machine without CUDA: a projection's user card, which runs them)
    paths = kernel_paths(device)
    kernels = paths.kernels if kernels is None else kernels
    fp8_kernels = paths.fp8_kernels if fp8_kernels is None else fp8_kernels
    n = run_needs(
        manifest,
        device,
        dtype,
        max_context,
        prefill_chunk,
        with_mtp,
        host_extra,
        process,
        kernels,
        fp8_kernels,
        max_batch,
        fp8_attention,
    )
    tier = _device_tier(manifest, device, elt, budgets, n, max_context, max_batch, _used_layers(manifest, with_mtp))
    gpu_slots = tier.gpu_slots
    staging, ram_slots, cold_slots, cold = ram_tier(manifest, device, budgets, n, used, tier, io_threads, max_context)
    return Plan(
        str(device),
        budgets,
        n.backbone - tier.backbone_moved,
        n.kv - tier.caches_moved,
        n.workspace,
        n.record,
        gpu_slots,
        ram_slots,
        staging,
        n.host_base,
        n.total_records,
        used,
        tier.backbone_moved,
        tier.on_host,
        max_batch,
        cold_slots,
        cold,
        prefill_group(a, prefill_chunk, max_context, elt),
        tier.caches_moved,
        attention_group(a, prefill_chunk, max_context, elt, kernels, fp8_attention),
    )


def run_needs(
    manifest: Manifest,
    device: torch.device,
    dtype: torch.dtype,
    max_context: int,
    prefill_chunk: int,
    with_mtp: bool,
    host_extra: int,
    process: int | None,
    kernels: bool,
    fp8_kernels: bool,
    max_batch: int,
    fp8_attention: bool = False,
) -> RunNeeds:
    """What a run holds whatever its budgets: make_plan's first step, and a split's (device_split.py)."""
    a, elt = manifest.args, torch.empty((), dtype=dtype).element_size()
    total_records = len(expert_layers(manifest, with_mtp)) * a.n_routed_experts
    t = forward_tokens(prefill_chunk, max_context, with_mtp)
    # the largest backbone file is mapped while its tensors are read: on CUDA before the RAM cache is allocated
    # (load_model), so it shares the RAM budget with the process, not with the cache
    largest_file = max((manifest.files[rel].nbytes for rel in manifest.backbone_files()), default=0)
    process = process_rss() if process is None else process
    host_base = process + (CUDA_HOST_RESERVE if device.type == "cuda" else 0) + host_extra
    return RunNeeds(
        manifest.record.nbytes if manifest.record else 0,
        total_records,
        a.n_activated_experts if total_records else 0,
        backbone_bytes(manifest, dtype, with_mtp),
        cache_bytes(a, _used_layers(manifest, with_mtp), max_context, elt, cache_slots(max_batch)),
        workspace_bytes(manifest, device, dtype, t, max_context, kernels, fp8_kernels, fp8_attention),
        host_base + (largest_file if device.type == "cpu" else 0),
        largest_file,
    )
