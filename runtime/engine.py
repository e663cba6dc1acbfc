"""The public face of the runtime: `Engine` loads a converted model under the run's budgets and generates.

The CLI (`dsfp4 run`, its chat loop, `--json`) and the server are thin shells over it. One generation runs
at a time. The engine keeps the tokens whose latent KV sits in the cache, so a chat turn only prefills what
is new (the longest common prefix with the previous call is reused).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from numbers import Integral
from pathlib import Path
from typing import Any

import torch

from dsfp4.device import resolve_device
from dsfp4.errors import ConfigError, ContextLengthError, DsfpError
from dsfp4.kernels.linear import linear
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.routing_trace import write_trace
from dsfp4.runtime.generate.decode_graph import DecodeGraphs
from dsfp4.runtime.generate.generation import Delta, Generation, Stream
from dsfp4.runtime.generate.reasoning import opens_thinking, partial_suffix
from dsfp4.runtime.generate.sampling import SamplingParams, choose, sample
from dsfp4.runtime.generate.speculative import Speculator
from dsfp4.runtime.generate.stats import GenerationStats, peak_memory
from dsfp4.runtime.generate.tokenizer import ChatTokenizer, TextStream
from dsfp4.runtime.models.v3.model import Transformer, load_model, plan_run
from dsfp4.runtime.models.v4.model import TransformerV4
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.planner import LOGIT_ROWS, Plan, hottest_first
from dsfp4.runtime.profile.recorder import RoutingRecorder
from dsfp4.runtime.store.counters import counters_since

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]  # text, chat messages or token ids
THINK_TAIL = 8  # prompt tokens decoded to see whether the prompt opens a <think> block


class _Cancelled(Exception):
    """The caller's cancel event was set: the generation ends at the next chunk or token."""


def _token_ids(items: list) -> list[int] | None:
    """items as token ids (plain ints; bools are not), or None when they are something else."""
    if all(isinstance(t, Integral) and not isinstance(t, bool) for t in items):
        return [int(t) for t in items]
    return None


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
    prefix = max((partial_suffix(text, s) for s in stop), default=0)
    body = text[: len(text) - partial]  # a stop string may also end just before the unfinished character
    before = max((partial_suffix(body, s, whole=True) for s in stop), default=0)
    return max(prefix, partial + before)


def run_target(model_dir: Path, options: RunOptions) -> tuple[torch.device, Manifest, int, torch.dtype]:
    """Device, manifest, context (capped at the model's) and compute dtype of a run."""
    device = resolve_device(options.device)
    manifest = Manifest.read(model_dir)
    return device, manifest, min(options.max_context, manifest.args.max_seq_len), options.torch_dtype(device)


def plan_engine(model_dir: str | os.PathLike, options: RunOptions) -> Plan:
    """The memory plan an Engine with these options would follow, without loading anything."""
    device, manifest, max_context, dtype = run_target(Path(model_dir), options)
    return plan_run(manifest, device, dtype, max_context, options, with_mtp=options.mtp)


def with_knobs(options: RunOptions, knobs: Mapping[str, Any]) -> RunOptions:
    """options with the given fields replaced (and checked); an unknown name is a one-line error."""
    names = {f.name for f in dataclasses.fields(RunOptions)}
    if unknown := sorted(set(knobs) - names):
        raise ConfigError(f"unknown option {', '.join(unknown)}; RunOptions has {', '.join(sorted(names))}")
    return dataclasses.replace(options, **knobs)


class Engine:
    """A converted model loaded for generation.

    >>> with Engine("model/", device="cpu", max_context=512) as engine:
    ...     print(engine.generate("Why is the sky blue?", max_tokens=32, temperature=0).text)

    `options` (or keyword knobs, the fields of RunOptions, named like `dsfp4 run`'s flags) set the device,
    budgets (`gpu_mem`, `cpu_mem`, `preset`), context and the default sampling of every call. `plan`
    replaces the planner's memory plan (tests and benchmarks set slot counts with it). The expert tiers
    warm-start from the folder's hot.json when it belongs to this conversion.
    """

    def __init__(
        self, model_dir: str | os.PathLike, options: RunOptions | None = None, *, plan: Plan | None = None, **knobs
    ):
        self.options = with_knobs(options or RunOptions(), knobs)
        self.model_dir = Path(model_dir)
        device, manifest, self.max_context, dtype = run_target(self.model_dir, self.options)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.tokenizer = ChatTokenizer(self.model_dir, manifest.args.eos_token_ids)
        if self.options.mtp and not manifest.args.n_mtp_layers:
            raise ConfigError(f"--mtp: {self.model_dir} has no MTP layer (converted with --no-mtp?)")
        if self.options.mtp and manifest.args.is_v4:
            raise ConfigError(
                f"--mtp: speculative decoding drives V3's MTP layer, not DeepSeek-V4's; run {self.model_dir} "
                "without --mtp"
            )
        self.model: Transformer | TransformerV4 | None = load_model(
            self.model_dir,
            device,
            dtype,
            self.max_context,
            with_mtp=self.options.mtp,
            manifest=manifest,
            options=self.options,
            plan=plan,
        )
        self.device = device
        self.notes: list[str] = list(self.model.experts.notes)
        self.cached: list[int] = []  # the tokens whose latent KV sits in the cache
        self.stats: GenerationStats | None = None  # of the last generation
        self._stream: Stream | None = None  # the generation in progress
        self._busy = threading.Lock()  # one call at a time: two threads would corrupt the cache
        self.recorder = RoutingRecorder(self.model, trace=True) if self.options.record_trace else None
        self.speculator = Speculator(self) if self.options.mtp else None
        self.graphs: DecodeGraphs | None = None
        try:
            store, hot = self.model.experts, self.model_dir / HOT_NAME
            profile = HotProfile.read(hot).check(manifest, hot) if hot.is_file() else None
            p = store.plan
            if device.type == "cuda" and p.gpu_slots >= p.total_records > 0:
                store.fill()  # every expert fits: all on the device, and decode steps can be captured
            elif self._zero_copy(device) and p.gpu_slots + p.ram_slots >= p.total_records > 0:
                store.map_all(hottest_first(manifest, p, profile))  # the rest read from RAM in place: graphs too
            elif profile is not None:
                store.warm_start(profile)
            if self.model.moe_kernel is not None:  # Triton compiles here, not in the first TTFT
                tokens = min(self.options.prefill_chunk, self.max_context)
                self.model.moe_kernel.warm_up(dtype, store.gpu, manifest.args.n_routed_experts, tokens)
            recording = self.recorder is not None
            if self.options.cuda_graph:
                self.graphs = DecodeGraphs(self.model, self.max_context, device, recording)
                self.graphs.capture_all()  # now, not in the first answer's decode
        except BaseException:
            self.close()
            raise

    def _zero_copy(self, device: torch.device) -> bool:
        """Kernels may read records from pinned RAM in place: CUDA (one address space), Triton, not refused."""
        kernel = self._model().moe_kernel
        return device.type == "cuda" and self.options.zero_copy and kernel is not None and kernel.triton

    @property
    def plan(self) -> Plan:
        return self._model().experts.plan

    @property
    def decode_mode(self) -> str:
        """How decode steps run: "CUDA graph", or "eager" and why."""
        if self.graphs is None:
            return "eager: --no-cuda-graph"
        if not self.graphs.ready:
            return f"eager: {self.graphs.why_eager}"
        mode = "CUDA graph (plain steps; MTP verify steps eagerly)" if self.speculator else "CUDA graph"
        if self.graphs.streamed:
            return f"{mode} in {self.graphs.pieces} pieces, streamed experts loaded between them"
        if not self._model().experts.mapped:
            return mode
        p = self.plan
        return f"{mode}, zero-copy: {p.total_records - p.gpu_slots} of {p.total_records} records read from RAM in place"

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Write the routing trace if one is recorded, then free the device memory and the pinned RAM cache.
        Safe to call twice; the engine cannot generate afterwards."""
        if self.model is None:
            return
        with self._claim():
            self._end_stream()
        try:
            if self.recorder is not None and self.recorder.tokens:
                write_trace(self.options.record_trace, self.recorder.routing_trace())
        finally:
            if self.recorder is not None:
                self.recorder.detach()
            self.model.experts.close()
            self.model, self.graphs = None, None  # the graphs' memory pool goes with them
            gc.collect()  # the modules hold each other (MoE layers and the store): free them now
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def reset(self) -> None:
        """Forget the cached conversation: the next call prefills its whole prompt."""
        with self._claim():
            self._end_stream()
            self._truncate(0)

    def encode(self, prompt: Prompt, system: str | None = None, raw: bool = False) -> list[int]:
        """Token ids of a prompt: text (through the chat template, with an optional system message, unless
        `raw`), chat messages ([{"role": ..., "content": ...}], through the template) or token ids as given."""
        if isinstance(prompt, str):
            if raw and system is not None:
                raise ConfigError("a system message goes through the chat template, which raw skips; give one of them")
            return self.tokenizer.encode_prompt(prompt, system, raw)
        items = list(prompt)
        if items and (ids := _token_ids(items)) is not None:
            if system is not None or raw:
                raise ConfigError("system and raw apply to text prompts, not to token ids")
            return ids
        if items and all(isinstance(m, Mapping) for m in items):
            bad = [i for i, m in enumerate(items) if not (isinstance(m.get("role"), str) and "content" in m)]
            if bad or not all(isinstance(m["content"], str) for m in items):
                raise ConfigError(f"message {bad[0] if bad else ''}: each needs a string role and string content")
            if raw:
                raise ConfigError("raw applies to text prompts; chat messages always go through the template")
            head = [{"role": "system", "content": system}] if system is not None else []
            return self.tokenizer.encode_chat([*head, *({"role": m["role"], "content": m["content"]} for m in items)])
        raise ConfigError("the prompt must be text, a non-empty list of chat messages or a non-empty list of token ids")

    def opens_thinking(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves the model inside an R1-style <think> block (R1's chat templates do)."""
        return opens_thinking(self.tokenizer.decode(prompt_ids[-THINK_TAIL:], keep_special=True))

    def check_prompt(self, prompt_ids: list[int], room: int = 1) -> None:
        """A prompt must leave `room` positions of the context free and name tokens of the vocabulary."""
        n, vocab = len(prompt_ids), self._model().args.vocab_size
        if n == 0:
            raise ConfigError("the prompt is empty")
        if n + room > self.max_context:
            raise ContextLengthError(
                f"the prompt is {n} tokens; the context holds {self.max_context} "
                f"(raise --max-context, up to the model's {self._model().args.max_seq_len})",
                n,
                self.max_context,
            )
        if bad := [t for t in prompt_ids if not 0 <= t < vocab]:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})")

    def room(self, prompt_tokens: int) -> int:
        """Tokens a generation after a prompt of this length may produce (the last is never fed back)."""
        return self.max_context - prompt_tokens + 1

    def generate(self, prompt: Prompt, **kwargs: Any) -> Generation:
        """Generate to the end; the arguments are stream()'s."""
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.generation

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        system: str | None = None,
        raw: bool = False,
        cancel: threading.Event | None = None,
    ) -> Stream:
        """Generate after `prompt` (see encode), yielding a Delta per token. Sampling arguments left at None
        take the engine's options: temperature 0 is greedy; `seed` makes sampling reproducible; generation
        ends at an EOS token, at a `stop` string (not part of the text) or after `max_tokens` tokens. Setting
        `cancel` (from any thread) ends it at the next prefill chunk or token, with finish reason "cancelled"."""
        given = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        options = with_knobs(self.options, {k: v for k, v in given.items() if v is not None})
        ids = self.encode(prompt, system, raw)
        self.check_prompt(ids)
        with self._claim():
            self._end_stream()
            self._stream = Stream(self._steps(ids, options, cancel), self._claim)
        return self._stream

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits after each of `token_ids` -> [T, V] fp32 on the CPU, computed from position 0 in the
        chunks of ordinary prefill (the cache then holds these tokens, so a generation after them reuses it)."""
        items = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
        ids = None if isinstance(items, str) else _token_ids(list(items))
        if ids is None:
            raise ConfigError("logits takes token ids; encode text or chat messages with engine.encode first")
        self.check_prompt(ids, room=0)
        with self._claim():
            self._end_stream()
            head, rows = self._model().head, []
            self._truncate(0)
            done = 0
            for _, h in self._feed(ids):  # h: [t, D]
                if self.speculator is not None:  # its entries follow, so a generation after this reuses it
                    self.speculator.entries(h, ids, 0, done)
                # the head runs on LOGIT_ROWS positions at a time, as the planner's workspace allows
                rows += [linear(h[j : j + LOGIT_ROWS], head).float().cpu() for j in range(0, len(h), LOGIT_ROWS)]
                done += len(h)
        return torch.cat(rows)  # [T, V]

    # -- internals ------------------------------------------------------------------------------------

    def _model(self) -> Transformer | TransformerV4:
        if self.model is None:
            raise DsfpError("this engine is closed; create a new one")
        return self.model

    @contextmanager
    def _claim(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise DsfpError("this engine is busy in another thread: it runs one call at a time (serialize the "
                            "calls, or use an engine per thread)")  # fmt: skip
        try:
            yield
        finally:
            self._busy.release()

    def _truncate(self, n: int) -> None:
        """Keep the first n cached positions (main and MTP caches): later ones belong to other tokens."""
        self.cached = self.cached[:n]
        if self.speculator is not None:
            self.speculator.upto = min(self.speculator.upto, n)

    def _end_stream(self) -> None:
        if self._stream is not None:
            if self._stream.generation is None:
                self._stream.superseded = True
            self._stream.close()  # a generation left unfinished ends here, with the cache consistent
            self._stream = None

    def _pass(
        self, piece: list[int], cancel: threading.Event | None = None, every: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of piece after the cached tokens -> (logits after its last token [V], or after every
        token [t, V] when `every`; final hidden states [t, D]). The cached tokens grow by the piece."""
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        try:
            if len(piece) == 1 and not every and self.graphs is not None and self.graphs.ready:
                logits, h = self.graphs.step(piece[0], len(self.cached))
            else:
                tokens = torch.tensor([piece], device=self.device)
                logits, h = self._model()(tokens, len(self.cached), last_only=not every)
        except BaseException:
            if self.recorder is not None:
                self.recorder.discard()  # an interrupted pass leaves nothing half-recorded
            raise
        if self.recorder is not None:
            self.recorder.commit(piece)
        self.cached += piece
        return (logits[0] if every else logits[0, -1]), h[0]

    def _feed(
        self, ids: list[int], cancel: threading.Event | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Feed ids after the cached tokens in chunks of prefill_chunk tokens: yields each chunk's _pass."""
        chunk = self.options.prefill_chunk
        for i in range(0, len(ids), chunk):
            yield self._pass(ids[i : i + chunk], cancel)

    def _decode(
        self,
        ids: list[int],
        sampling: SamplingParams,
        gen: torch.Generator | None,
        cancel: threading.Event | None,
        budget: int,
    ) -> Iterator[int]:
        """Plain decoding: prefill ids after the cached tokens, then yield tokens. Replayed steps run one ahead
        of the host (DecodeGraphs.tokens, sampling on the device); eager ones feed a token to the model only
        when the next one is asked for (so the last one never is)."""
        logits = deque(self._feed(ids, cancel), maxlen=1)[0][0]  # each chunk's tensors go as the next one comes
        if self.graphs is not None and self.graphs.ready:
            on_device = None if sampling.seed is None else torch.Generator(self.device).manual_seed(sampling.seed)
            yield from self.graphs.tokens(
                logits, len(self.cached), lambda x: choose(x, sampling, on_device), budget,
                lambda t: self._keep(t, cancel),
            )  # fmt: skip
            return
        while True:
            token = sample(logits, sampling, gen)
            yield token
            logits, _ = self._pass([token], cancel)

    def _keep(self, token: int, cancel: threading.Event | None) -> None:
        """A replayed step of `token` is kept: the caller asked for the token after it (unless cancelled)."""
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        self.cached.append(token)

    @torch.inference_mode()
    def _steps(
        self, prompt_ids: list[int], options: RunOptions, cancel: threading.Event | None
    ) -> Generator[Delta, None, Generation]:
        """The generation loop: tokens from plain or speculative decoding; detokenize, stop rules, deltas."""
        n, stop = len(prompt_ids), options.stop
        budget = min(options.max_tokens, self.room(n))
        store = self._model().experts
        before = store.counters.snapshot()
        sampling = options.sampling()
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        start = time.perf_counter()
        common = _common_prefix(self.cached, prompt_ids)
        reuse = min(common, n - 1, self.speculator.reusable(common) if self.speculator else n)
        reuse = self._model().reusable(reuse)  # V4's caches hold their last position only
        stats = GenerationStats(prompt_tokens=n, cached_tokens=reuse)
        tokens: list[int] = []
        text, emitted, finish, detok = "", 0, "length", TextStream(self.tokenizer)
        self._truncate(reuse)  # the cache grows chunk by chunk from here: valid should the prefill be interrupted
        if self.speculator is not None and budget > 1:
            source = self.speculator.tokens(prompt_ids[reuse:], sampling, gen, cancel, stats, budget)
        else:
            source = self._decode(prompt_ids[reuse:], sampling, gen, cancel, budget)
        try:
            for token in source:
                stats.generated_tokens += 1
                if stats.generated_tokens == 1:
                    stats.ttft_s = stats.prefill_s = time.perf_counter() - start
                if token in self.tokenizer.eos_ids:
                    finish = "stop"
                    break
                tokens.append(token)
                text = detok.add(token)
                # text[:emitted] is final and held no stop string: a new one ends after it
                if hits := [i for s in stop if (i := text.find(s, max(emitted - len(s) + 1, 0))) >= 0]:
                    text, finish = text[: min(hits)], "stop"
                    break
                end = max(len(text) - _held_back(text, stop), emitted)
                yield Delta(token, text[emitted:end])  # the cache is consistent here, should the caller stop
                emitted = end
                if stats.generated_tokens >= budget:
                    break
        except _Cancelled:
            finish = "cancelled"
        finally:
            source.close()
        if len(text) > emitted:
            yield Delta(None, text[emitted:])
        stats.decode_s = time.perf_counter() - start - stats.prefill_s
        stats.store = counters_since(store.counters.snapshot(), before)
        stats.decode_mode = self.decode_mode
        stats.peak_gpu, stats.peak_rss = peak_memory(self.device)
        self.stats, self._stream = stats, None
        return Generation(list(prompt_ids), tokens, text, finish, stats)
