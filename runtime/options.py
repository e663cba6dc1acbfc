"""Runtime knobs; each field is the `dsfp4 run` flag of the same name.

Three kinds, each a frozen dataclass with its own checks: `EngineOptions` (where the model runs, its budgets, context
and decode machinery), `StoreOptions` (how the routed experts are held, read, traded and routed) and `SamplingOptions`
(how a generation samples and ends). `RunOptions` is all three at once, the flat face that the CLI, the Python API and
the server build; a consumer that needs one kind may take it alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsfp4.errors import ConfigError
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.trace_path import check_trace_path
from dsfp4.runtime.generate.answer.grammar import Grammar
from dsfp4.runtime.generate.generation import MAX_TOP
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.generate.value_rules import is_finite_number, seed_problem
from dsfp4.runtime.modes import AUTO, MODES, Levers
from dsfp4.runtime.plan.budget import Budgets, parse_size
from dsfp4.runtime.plan.devices import parse_devices
from dsfp4.runtime.plan.lane_split import parse_host_share
from dsfp4.runtime.store.policy import TIER_POLICIES
from dsfp4.value_types import annotation_spec, check

if TYPE_CHECKING:
    import torch

# --dtype's names and the torch dtype each stands for (by name: torch is imported once a run starts)
SAMPLING_DEFAULTS = SamplingParams()
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# the fields a single call may set
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
SAMPLING += ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logprobs", "grammar")
# one message for both, as the flags have always been checked (the two fields are of different kinds)
AT_LEAST_ONE = "--io-threads and --prefill-chunk must be at least 1"


def _typed(options: Any) -> None:
    """The Python API passes anything: each value must have its field's type. Stop strings arrive as a string, a list
    (JSON, Click's multiple flag) or a tuple, and become a tuple; a path given as text becomes a Path. A float field's
    number is finite (NaN passes every range check below: no comparison with it holds)."""
    for f in dataclasses.fields(options):
        if not f.init:
            continue
        value = getattr(options, f.name)
        if f.type == "Grammar | None":
            if value is not None and not isinstance(value, Grammar):
                raise ConfigError(f"option grammar: expected a Grammar (generate/answer/grammar.py), not {value!r:.40}")
            continue
        if f.type == "tuple[str, ...]" and isinstance(value, (str, list)):
            value = (value,) if isinstance(value, str) else tuple(value)
        flag = f"--{f.name.replace('_', '-')}"
        if (err := check(value, annotation_spec(str(f.type)), f.name)) is not None:
            raise ConfigError(f"option {err} (the flag {flag})")
        if isinstance(value, float) and not is_finite_number(value):
            raise ConfigError(f"option {f.name}: expected a finite number, found {value} (the flag {flag})")
        if f.type == "Path | None" and isinstance(value, str):
            value = Path(value)
        object.__setattr__(options, f.name, value)


@dataclass(frozen=True)
class EngineOptions:
    """Where the model runs and under which budgets; its context, prefill chunks and decode machinery."""

    device: str = "auto"
    # the cards of a run split across them, layers by bytes (runtime/plan/device_split.py): "cuda:0,cuda:1" or its
    # names; () runs on `device`
    devices: tuple[str, ...] = ()
    # bf16 on CUDA, fp32 on the CPU
    dtype: str = "auto"
    max_context: int = 4096
    # budgets: sizes such as 14G; None: the preset, else free memory
    gpu_mem: str | None = None
    cpu_mem: str | None = None
    preset: str | None = None
    # prompt tokens per forward pass (bounds the workspace)
    prefill_chunk: int = 512
    # speculative decoding with the checkpoint's MTP module (runtime/generate/speculative.py)
    mtp: bool = False
    # replay decode steps as CUDA graphs where they can be captured (generate/decode_graph.py)
    cuda_graph: bool = True
    # a folder of saved prompt KV caches: a prompt sharing a prefix with a saved one restores it instead of
    # prefilling it (runtime/generate/prompt_cache.py), held to prompt_cache_size by evicting the least recently used
    prompt_cache: Path | None = None
    prompt_cache_size: str = "16G"
    # sequences decoded in one step (run --batch, serve, Engine.batch): 1 decodes one at a time; 0: the mode's
    # (modes.MODE_BATCH) as far as the device budget affords their KV caches and the tiers a step's experts
    # (planner.auto_batch, planner.union_batch)
    max_batch: int = 1
    # a prompt joining a running batch pauses its prefill for a step of the running sequences once this long has
    # passed since their last (runtime/generate/batch.py); 0: it prefills whole while they wait
    prefill_yield_ms: int = 2000
    # lossy, experimental: prefill attention's nope products and values on FP8 tensor cores, e4m3 with scales per
    # row (kernels/mla/prefill.py fp8); the rope products stay bf16; decode keeps the exact absorbed form
    fp8_attention: bool = False
    # gpu_mem, cpu_mem and preset parsed once, here: the sizes they give (None: this machine's free memory, which
    # Budgets.resolve takes on the run's device)
    budgets: Budgets = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _typed(self)
        self._check_engine()

    def _check_engine(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"--dtype {self.dtype}: choose auto, {', '.join(DTYPES)}")
        if self.max_context < 2:
            raise ConfigError(f"--max-context {self.max_context}: give at least 2")
        object.__setattr__(self, "devices", parse_devices(self.devices, self.device))
        cards = len(self.devices) or 1
        object.__setattr__(self, "budgets", Budgets.parse(self.gpu_mem, self.cpu_mem, self.preset, cards))
        parse_size(self.prompt_cache_size, "--prompt-cache-size")
        if self.prompt_cache is not None and Path(self.prompt_cache).exists() and not Path(self.prompt_cache).is_dir():
            raise ConfigError(f"--prompt-cache {self.prompt_cache}: a file, not a folder; give a folder for the cache")
        if not 0 <= self.max_batch <= DECODE_TOKENS:
            raise ConfigError(f"--max-batch {self.max_batch}: give 1 to {DECODE_TOKENS} sequences (0: the mode's)")
        if self.prefill_chunk < 1:
            raise ConfigError(AT_LEAST_ONE)
        if self.prefill_yield_ms < 0:
            raise ConfigError(f"--prefill-yield-ms {self.prefill_yield_ms}: give 0 (never pause) or more")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        # torch imported here: the command line's help reads this module
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, DTYPES[self.dtype])


@dataclass(frozen=True)
class StoreOptions:
    """How the routed experts are held in the tiers, read from the SSD, traded by the lossy levers and routed."""

    # eviction of the tiers (runtime/store/policy.py TIER_POLICIES; chosen on calibrated traces)
    policy: str = "hot"
    # predict the next MoE layer's experts with its router
    prefetch: bool = True
    # a guess may read its record from the SSD; False: only guesses already in RAM are copied up (a wrong guess then
    # costs PCIe time, not the SSD's: the faster store when the SSD binds, docs/BENCHMARKS.md)
    prefetch_reads: bool = False
    # the lossy levers' setting (runtime/modes.py MODES); a lever set below wins over it
    mode: str = "exact"
    # a routed expert in neither the device nor RAM whose normalized weight is below this for every token that chose
    # it is left out of the step, the token's other weights rescaled to the same sum (0: exact; None: the mode's;
    # "auto": only what the step's copies cannot hide, up to `throughput`'s threshold: runtime/modes.py AUTO)
    expert_threshold: float | str | None = None
    # a chosen expert in neither the device nor RAM is swapped for an unchosen warm one of its group that the router
    # scored within this margin of it (runtime/store/cache_aware.py; 0: exact; None: the mode's)
    cache_aware: float | None = None
    # each token's routed experts: the router's best this many, weighted as the model weights its own top-k (fewer
    # reads and products a token; 0: the model's own count). runtime/models/load.py run_target applies it
    experts_per_token: int = 0
    # a decode step's RAM hits the CPU computes from RAM while PCIe carries the rest (runtime/store/host_lane.py): off,
    # auto (the share that balances the CPU kernel against PCIe, measured at load; CUDA runs), or a share from 0 to 1.
    # Off by default: it gained where PCIe binds (every record in RAM, copied) and nothing where the SSD binds
    cpu_experts: str = "off"
    # SSD reads in flight
    io_threads: int = 4
    # sha256 of the backbone files as they load, and of each record on its first read from the SSD
    verify: bool = True
    # when the device and RAM hold every record, kernels read RAM's in place (map_all)
    zero_copy: bool = True
    # route by this trace instead of the routers (runtime/models/trace_routing.py)
    routing: Path | None = None
    # under a trace, the share of the next layer's experts its prefetch guesses right
    routing_recall: float = 0.9
    # where the engine writes its routing trace when it closes
    record_trace: Path | None = None

    def __post_init__(self) -> None:
        _typed(self)
        self._check_store()

    def _check_store(self) -> None:
        if self.policy not in TIER_POLICIES:
            raise ConfigError(f"--policy {self.policy}: choose one of {', '.join(TIER_POLICIES)}")
        if self.mode not in MODES:
            raise ConfigError(f"--mode {self.mode}: choose one of {', '.join(MODES)}")
        t = self.expert_threshold
        if t is not None and (t != "auto" if isinstance(t, str) else not 0.0 <= t < 1.0):
            raise ConfigError(f"--expert-threshold {t}: give auto, or a weight from 0 (off) to below 1")
        if self.cache_aware is not None and self.cache_aware < 0:
            raise ConfigError(f"--cache-aware {self.cache_aware}: give a score margin of 0 (off) or more")
        if self.experts_per_token < 0:
            raise ConfigError(f"--experts-per-token {self.experts_per_token}: give 1 or more (0: the model's own)")
        if self.experts_per_token and self.routing is not None:
            raise ConfigError(
                "--experts-per-token with --routing: a trace fixes each token's experts; give one of them"
            )
        parse_host_share(self.cpu_experts)
        if self.io_threads < 1:
            raise ConfigError(AT_LEAST_ONE)
        if self.record_trace is not None:
            check_trace_path(self.record_trace)
        if self.routing is not None and not Path(self.routing).is_file():
            raise ConfigError(
                f"--routing {self.routing}: no such file; record one with `dsfp4 run --record-trace` or write one "
                "with scripts/synthetic_trace.py"
            )
        if not 0.0 <= self.routing_recall <= 1.0:
            raise ConfigError(f"--routing-recall {self.routing_recall}: give a share from 0 to 1")

    def levers(self) -> Levers:
        """The lossy levers this run uses: its mode's, where it does not set one itself."""
        mode = MODES[self.mode]
        margin = mode.cache_aware if self.cache_aware is None else self.cache_aware
        if self.expert_threshold == "auto":
            return dataclasses.replace(AUTO, cache_aware=margin)
        return Levers(mode.expert_threshold if self.expert_threshold is None else self.expert_threshold, margin)


@dataclass(frozen=True)
class SamplingOptions:
    """How a generation samples and ends (SAMPLING: the fields a single call may set), and the prompt format's
    thinking switch."""

    max_tokens: int = 256
    # SamplingParams' defaults, which say what each does
    temperature: float = SAMPLING_DEFAULTS.temperature
    top_p: float = SAMPLING_DEFAULTS.top_p
    top_k: int = SAMPLING_DEFAULTS.top_k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # the prompt format's thinking switch (V4's mode, V3.1's template); None: its default
    thinking: bool | None = None
    # penalties and min-p, neutral by default
    presence_penalty: float = SAMPLING_DEFAULTS.presence_penalty
    frequency_penalty: float = SAMPLING_DEFAULTS.frequency_penalty
    repetition_penalty: float = SAMPLING_DEFAULTS.repetition_penalty
    min_p: float = SAMPLING_DEFAULTS.min_p
    # each token's log-probability and this many alternatives (runtime/generate/logprobs.py); None: none
    logprobs: int | None = None
    # what the answer must spell (runtime/generate/answer/grammar.py); --json-schema FILE and --grammar FILE set it
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        _typed(self)
        self._check_sampling()

    def _check_sampling(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens {self.max_tokens}: give at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
        if (fix := seed_problem(self.seed)) is not None:
            raise ConfigError(f"--seed {self.seed}: {fix}")
        if any(not s for s in self.stop):
            raise ConfigError("--stop: an empty stop string would end every answer at once")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: give a penalty from -2 to 2")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"--repetition-penalty {self.repetition_penalty}: give more than 0 (1: off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"--min-p {self.min_p}: give a share from 0 (off) to 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP:
            raise ConfigError(f"--logprobs {self.logprobs}: give 0 to {MAX_TOP} alternatives")

    def sampling(self) -> SamplingParams:
        names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logprobs")
        rules = {name: getattr(self, name) for name in names}
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed, **rules)


@dataclass(frozen=True)
class RunOptions(SamplingOptions, StoreOptions, EngineOptions):
    """The knobs of a run, every kind at once: the fields of `dsfp4 run`'s flags, one to one (EngineOptions,
    StoreOptions, SamplingOptions for what each means)."""

    def __post_init__(self) -> None:
        _typed(self)
        self._check_engine()
        self._check_sampling()
        self._check_store()


def with_knobs(options: RunOptions, knobs: Mapping[str, Any]) -> RunOptions:
    """options with the given fields replaced (and checked); an unknown name is a one-line error."""
    names = {f.name for f in dataclasses.fields(RunOptions) if f.init}
    if unknown := sorted(set(knobs) - names):
        raise ConfigError(f"unknown option {', '.join(unknown)}; RunOptions has {', '.join(sorted(names))}")
    return dataclasses.replace(options, **knobs)
