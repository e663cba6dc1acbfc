"""A conversation with one model: prefill, decode, sampling, stop rules, streaming, stats.

The session keeps the tokens whose latent KV sits in the cache, so a chat turn only prefills what is new
(the longest common prefix with the previous turn is reused).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsfp4.device import resolve_device
from dsfp4.errors import ConfigError
from dsfp4.kernels.expert import warm_up
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.routing_trace import write_trace
from dsfp4.runtime.model import Transformer, load_model, plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.planner import Plan
from dsfp4.runtime.routing import RoutingRecorder
from dsfp4.runtime.sampling import SamplingParams, sample
from dsfp4.runtime.stats import GenerationStats, peak_memory
from dsfp4.runtime.store_stats import counters_since
from dsfp4.runtime.tokenizer import ChatTokenizer


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: GenerationStats = field(default_factory=GenerationStats)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many trailing characters may still become a stop string or an unfinished UTF-8 character."""
    partial = len(text) - len(text.rstrip("\ufffd"))
    prefix = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    body = text[: len(text) - partial]  # a stop string may also end just before the unfinished character
    before = max((k for s in stop for k in range(1, len(s) + 1) if body.endswith(s[:k])), default=0)
    return max(prefix, partial + before)


class Session:
    def __init__(self, model: Transformer, tokenizer: ChatTokenizer, max_context: int, prefill_chunk: int = 512):
        self.model, self.tokenizer, self.max_context = model, tokenizer, max_context
        self.prefill_chunk = prefill_chunk
        self.cached: list[int] = []
        self.device = model.freqs_cis.device
        self.notes: list[str] = list(model.experts.notes)
        self.recorder: RoutingRecorder | None = None  # set to record the routing of every token computed
        self.trace_path: Path | None = None

    @property
    def plan(self) -> Plan:
        return self.model.experts.plan

    def reset(self) -> None:
        self.cached = []

    def close(self) -> None:
        """Release the expert store, after writing the routing trace if one is being recorded."""
        try:
            if self.recorder is not None and self.trace_path is not None and self.recorder.tokens:
                write_trace(self.trace_path, self.recorder.routing_trace())
        finally:
            if self.recorder is not None:
                self.recorder.detach()
            self.model.experts.close()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ConfigError("the prompt is empty")
        if n >= self.max_context:
            raise ConfigError(
                f"the prompt is {n} tokens; the context holds {self.max_context} "
                f"(raise --max-context, up to the model's {self.model.args.max_seq_len})"
            )

    def _forward(self, ids: list[int], start_pos: int) -> torch.Tensor:
        """Feed ids at start_pos in chunks of prefill_chunk tokens -> logits after the last one [V]."""
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i : i + self.prefill_chunk]
            try:
                logits = self.model(torch.tensor([chunk], device=self.device), start_pos=start_pos + i, last_only=True)
            except BaseException:
                if self.recorder is not None:
                    self.recorder.discard()  # an interrupted pass leaves nothing half-recorded
                raise
            if self.recorder is not None:
                self.recorder.commit(chunk)
        return logits[0][0, -1]

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: tuple[str, ...] = (),
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Generate after prompt_ids; on_text receives the text as it is produced."""
        self.check_prompt(prompt_ids)
        n = len(prompt_ids)
        budget = min(max_tokens, self.max_context - n + 1)  # the last token is never fed back
        store = self.model.experts
        before = store.counters.snapshot()
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        start = time.perf_counter()
        reuse = min(_common_prefix(self.cached, prompt_ids), n - 1)
        self.cached = self.cached[:reuse]  # what stays valid if the prefill below is interrupted
        logits = self._forward(prompt_ids[reuse:], reuse)
        self.cached = list(prompt_ids)
        stats = GenerationStats(prompt_tokens=n, cached_tokens=reuse)
        tokens: list[int] = []
        text, emitted, finish = "", 0, "length"
        while stats.generated_tokens < budget:
            token = sample(logits, sampling, gen)
            stats.generated_tokens += 1
            if stats.generated_tokens == 1:
                stats.ttft_s = stats.prefill_s = time.perf_counter() - start
            if token in self.tokenizer.eos_ids:
                finish = "stop"
                break
            tokens.append(token)
            text = self.tokenizer.decode(tokens)
            if hits := [i for s in stop if (i := text.find(s)) >= 0]:
                text, finish = text[: min(hits)], "stop"
                break
            if on_text and (end := len(text) - _held_back(text, stop)) > emitted:
                on_text(text[emitted:end])
                emitted = end
            if stats.generated_tokens < budget:
                logits = self._forward([token], len(self.cached))
                self.cached.append(token)
        if on_text and len(text) > emitted:
            on_text(text[emitted:])
        stats.decode_s = time.perf_counter() - start - stats.prefill_s
        stats.store = counters_since(store.counters.snapshot(), before)
        stats.peak_gpu, stats.peak_rss = peak_memory(self.device)
        return Generation(list(prompt_ids), tokens, text, finish, stats)


def run_target(model_dir: Path, options: RunOptions) -> tuple[torch.device, Manifest, int, torch.dtype]:
    """Device, manifest, context (capped at the model's) and compute dtype of a run."""
    device = resolve_device(options.device)
    manifest = Manifest.read(model_dir)
    return device, manifest, min(options.max_context, manifest.args.max_seq_len), options.torch_dtype(device)


def plan_session(model_dir: Path, options: RunOptions) -> Plan:
    """The memory plan `open_session` would follow, without loading anything."""
    device, manifest, max_context, dtype = run_target(model_dir, options)
    return plan_run(manifest, device, dtype, max_context, options, with_mtp=False)


def open_session(model_dir: Path, options: RunOptions) -> Session:
    """Load a converted model and its tokenizer for generation (the context is capped at the model's),
    warm-starting the expert tiers from hot.json when the folder has one for this conversion."""
    device, manifest, max_context, dtype = run_target(model_dir, options)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = load_model(model_dir, device, dtype, max_len=max_context, manifest=manifest, options=options)
    session = Session(model, ChatTokenizer(model_dir, manifest.args.eos_token_ids), max_context, options.prefill_chunk)
    if options.record_trace is not None:
        session.recorder, session.trace_path = RoutingRecorder(model, trace=True), options.record_trace
    try:
        hot = Path(model_dir) / HOT_NAME
        if hot.is_file():
            model.experts.warm_start(HotProfile.read(hot).check(manifest, hot))
        if device.type == "cuda":
            warm_up(model.experts.layout, dtype, device)  # Triton compiles here, not in the first TTFT
    except BaseException:
        session.close()
        raise
    return session
