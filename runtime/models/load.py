"""A converted model loaded for a run: its device, manifest, context and dtype; the memory plan of its budgets; the
weights, the expert store and the family's model built from the manifest (the manifest names the family)."""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dsfp4.device import resolve_device
from dsfp4.errors import ChecksumError, ConfigError
from dsfp4.kernels.kernel_paths import kernel_paths
from dsfp4.kernels.mla.prefill import fp8_kernel_runs
from dsfp4.layout.formats import FORMATS
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.safetensors_file import file_sha256
from dsfp4.runtime.models.card_map import CardMap
from dsfp4.runtime.models.families import model_family
from dsfp4.runtime.models.host_memory import ALIGN, HostArena
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.weights import Weights
from dsfp4.runtime.modes import MODE_BATCH
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.device_split import make_split_plan
from dsfp4.runtime.plan.devices import card_budgets, resolve_cards
from dsfp4.runtime.plan.host_backbone import HostBackbone, tensor_bytes
from dsfp4.runtime.plan.planner import Plan, auto_batch, cache_slots, make_plan, union_batch
from dsfp4.runtime.plan.probes import host_share
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.split_store import SplitStore
from dsfp4.units import format_bytes

# stage lines of an engine's start: the CLI shows them on a terminal (dsfp4/cli/progress.py)
log = logging.getLogger("dsfp4")


def run_target(model_dir: Path, options: RunOptions) -> tuple[torch.device, Manifest, int, torch.dtype]:
    """Device (a split run's first card: run_cards), manifest, context (capped at the model's) and compute dtype of a
    run."""
    cards = run_cards(options)
    device = cards[0] if cards else resolve_device(options.device)
    # a card no torch kernel runs on is refused before anything is read
    for card in cards or [device]:
        kernel_paths(card).check()
    manifest = with_experts_per_token(Manifest.open(model_dir), options.experts_per_token, model_dir)
    if options.fp8_attention:
        check_fp8_attention(manifest.args, cards or [device], model_dir)
    return device, manifest, min(options.max_context, manifest.args.max_seq_len), options.torch_dtype(device)


def run_cards(options: RunOptions) -> list[torch.device]:
    """The cards of a run split across them (--devices), checked against this machine; [] for one device."""
    return resolve_cards(options.devices) if options.devices else []


def with_experts_per_token(manifest: Manifest, k: int, model_dir: Path) -> Manifest:
    """The manifest a run sees under --experts-per-token k: its shape routing each token to its router's best k, so
    that the router, the kernels, the planner and the decode graphs all take k (0: the model's own)."""
    a = manifest.args
    if not k or k == a.n_activated_experts:
        return manifest
    if k > a.n_activated_experts:
        raise ConfigError(
            f"--experts-per-token {k}: {model_dir} routes each token to {a.n_activated_experts} experts; give 1 to "
            f"{a.n_activated_experts} (0: all {a.n_activated_experts})"
        )
    if a.n_hash_layers:
        raise ConfigError(
            f"--experts-per-token: {a.family_spec.title}'s first {a.n_hash_layers} layers route by a table of "
            f"{a.n_activated_experts} experts per token; run {model_dir} without it"
        )
    return dataclasses.replace(manifest, args=dataclasses.replace(a, n_activated_experts=k))


def check_fp8_attention(a: ModelArgs, cards: list[torch.device], model_dir: Path) -> None:
    """--fp8-attention needs a family with the FP8 prefill attention and FP8 tensor cores on every card (the CPU
    runs its torch formula), refused before anything loads."""
    if not a.family_spec.fp8_attention:
        raise ConfigError(
            f"--fp8-attention: {model_dir} is {a.family_spec.title}, whose attention has no FP8 variant; run it "
            "without --fp8-attention"
        )
    for card in cards:
        if card.type == "cuda" and not fp8_kernel_runs(card):
            # ROCm's torch names its cards "cuda" too; dsfp4's Triton kernels run on NVIDIA's alone
            why = (
                "is a ROCm card, where dsfp4's Triton kernels do not run"
                if torch.version.hip is not None
                else f"(sm_{''.join(map(str, kernel_paths(card).capability or ()))}) has no FP8 tensor cores (they "
                "start at sm_89: RTX 4090, H100)"
            )
            raise ConfigError(f"--fp8-attention: {card} {why}; run without --fp8-attention")


def plan_engine(model_dir: str | os.PathLike, options: RunOptions) -> Plan:
    """The memory plan an Engine with these options would follow, without loading anything."""
    device, manifest, max_context, dtype = run_target(Path(model_dir), options)
    return plan_run(manifest, device, dtype, max_context, options, with_mtp=options.mtp)


def load_model(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    with_mtp: bool = False,
    manifest: Manifest | None = None,
    options: RunOptions | None = None,
    plan: Plan | None = None,
) -> Model:
    """Build the model from a converted folder: weights on `device`, routed experts in an expert store
    sized by the planner from the budgets in `options` (default: this machine's free memory), or by
    `plan` when given (tests and benchmarks set slot counts directly)."""
    manifest = manifest or Manifest.open(model_dir)
    options = options or RunOptions()
    # fails fast on a small budget
    plan = plan or plan_run(manifest, device, dtype, max_len, options, with_mtp)
    # the caches in RAM beside the backbone there: MLA's latent and RoPE caches a layer, each aligned
    caches = plan.host_kv + 2 * ALIGN * len(plan.on_host.caches)
    arena_bytes = host_arena_bytes(manifest, plan.on_host, dtype) + caches
    arena = HostArena(arena_bytes, device) if plan.host_backbone or plan.host_kv else None
    log.info(
        "loading the backbone: %s on %s%s",
        format_bytes(plan.backbone),
        device,
        f", {format_bytes(plan.host_backbone + plan.host_kv)} in pinned RAM" if arena is not None else "",
    )
    cards = CardMap.of_plan(plan)
    w = Weights(model_dir, manifest, device, dtype, plan.on_host, arena, cards)
    # the RAM cache comes after the backbone: the backbone's files are mapped while they load, never beside it
    log.info("allocating the expert tiers: %d device and %d RAM slots", plan.gpu_slots, plan.ram_slots)
    experts = _expert_store(model_dir, manifest, device, plan, options, cards)
    hashing = ThreadPoolExecutor(options.io_threads, thread_name_prefix="dsfp4-hash")
    try:
        # the backbone's files are hashed while they load (--verify), as each record is on its first read
        files = manifest.backbone_files() if options.verify else []
        hashes = [(rel, hashing.submit(file_sha256, Path(model_dir) / rel)) for rel in files]
        # the manifest names the family
        family = model_family(manifest.args).model()
        slots = cache_slots(plan.max_batch)
        model = family(manifest.args, w, experts, slots, max_len, with_mtp, options.prefetch, options.fp8_attention)
        a = manifest.args
        w.check_all_used(() if with_mtp else a.mtp_prefixes)
        w.close()
        for rel, digest in hashes:
            if digest.result() != manifest.files[rel].sha256:
                raise ChecksumError(
                    f"{Path(model_dir) / rel}: sha256 mismatch, the file is damaged; convert again (`dsfp4 verify` "
                    f"checks the whole model)"
                )
        experts.open_host()
    except BaseException:
        experts.close()
        raise
    finally:
        w.close()
        hashing.shutdown(cancel_futures=True)
    return model.eval()


def _expert_store(
    model_dir: Path, manifest: Manifest, device: torch.device, plan: Plan, options: RunOptions, cards: CardMap | None
) -> ExpertStore | SplitStore:
    """The run's expert store: one, or a split run's, one a card over the shared RAM tier (store/split_store.py)."""
    o, lane = options, host_share(options.cpu_experts, manifest.record, device)

    def make(on: torch.device, mine: Plan, shares: ExpertStore | None = None) -> ExpertStore:
        return ExpertStore(
            model_dir,
            manifest,
            on,
            mine,
            o.policy,
            o.io_threads,
            o.verify,
            host=False,
            prefetch_reads=o.prefetch_reads,
            levers=o.levers(),
            lane=lane,
            shares=shares,
        )

    return make(device, plan) if cards is None else SplitStore(manifest, list(cards.cards), plan, make, lane)


def _check_split(a: ModelArgs, cards: list[torch.device]) -> None:
    """A split needs a family whose model splits, and a head of its own (a tied one is the first card's embedding)."""
    if cards and not model_family(a).split:
        raise ConfigError(
            f"--devices: {a.family_spec.title}'s model does not split across cards yet; give one --device"
        )
    if cards and a.tie_word_embeddings:
        raise ConfigError(
            "--devices: this model's head is its embedding (tied), which a split keeps on both ends; give one --device"
        )


def plan_run(
    manifest: Manifest,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    options: RunOptions,
    with_mtp: bool,
    host_extra: int = 0,
) -> Plan:
    # the flags' sizes, parsed by RunOptions; a split's cards each their own
    cards = run_cards(options)
    _check_split(manifest.args, cards)
    budgets = card_budgets(options.budgets, cards) if cards else options.budgets.resolve(device)
    chunk, threads, a = options.prefill_chunk, options.io_threads, manifest.args
    batch, alone = options.max_batch, _decodes_alone(a, options, with_mtp)
    if batch > 1 and alone:
        raise ConfigError(alone)
    if batch == 0:
        elt = torch.empty((), dtype=dtype).element_size()
        # a split's KV caches share out over the cards: their sum
        batch = 1 if alone else auto_batch(a, budgets.gpu, max_len, elt, MODE_BATCH[options.mode])

    def planned(max_batch: int) -> Plan:
        run = (dtype, budgets, max_len, chunk, threads, with_mtp, host_extra)
        how = dict(max_batch=max_batch, fp8_attention=options.fp8_attention)
        if cards:
            return make_split_plan(manifest, cards, *run, **how)
        return make_plan(manifest, device, *run, **how)

    plan = planned(batch)
    # the batch's experts fit the tiers
    if options.max_batch == 0 and (fit := union_batch(a, plan, batch)) < batch:
        plan = planned(fit)
    return plan


def _decodes_alone(a: ModelArgs, options: RunOptions, with_mtp: bool) -> str | None:
    """Why a run decodes one sequence at a time whatever --max-batch says (None: it may batch)."""
    if not model_family(a).batch:
        return (
            f"--max-batch {options.max_batch}: {a.family_spec.title}'s caches hold a running state, not rows by "
            "position, so it decodes one sequence at a time; give --max-batch 1"
        )
    flag = "--mtp" if with_mtp else "--record-trace" if options.record_trace is not None else None
    return None if flag is None else f"--max-batch with {flag}: {flag} follows one sequence; give --max-batch 1"


def host_arena_bytes(manifest: Manifest, on_host: HostBackbone, dtype: torch.dtype) -> int:
    """Bytes the arena needs for the plan's host backbone (its caches beside them: Plan.host_kv): each tensor as
    loaded, each stored part aligned."""
    elt = torch.empty((), dtype=dtype).element_size()
    held = [(n, t) for n, t in manifest.tensors.items() if on_host.holds(n)]
    return sum(tensor_bytes(n, t, elt) + ALIGN * len(FORMATS[t.format].components) for n, t in held)
