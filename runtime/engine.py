"""The public face of the runtime: `Engine` loads a converted model under the run's budgets and generates.

The CLI (`dsfp4 run`, its chat loop, `--json`) and the server are thin shells over it. One generation runs
at a time. The engine keeps the tokens whose latent KV sits in the cache (its decoder's), so a chat turn only
prefills what is new (the longest common prefix with the previous call is reused, or a longer saved one restored
from the prompt cache: runtime/generate/prompt_reuse.py).
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dsfp4.allocator import use_expandable_segments
from dsfp4.errors import ConfigError, DsfpError
from dsfp4.kernels.kernel_paths import kernel_paths
from dsfp4.kernels.linear import linear
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.routing_trace import write_trace
from dsfp4.runtime.engine_setup import captured_graphs, trace_routing, warm_start, warm_up_kernels
from dsfp4.runtime.generate.answer.answer_format import AnswerFormat, no_grammar_beside
from dsfp4.runtime.generate.answer.grammar_matcher import GrammarCompiler
from dsfp4.runtime.generate.batch import STEPPED_PROMPT_TOKENS, BatchRun, Hooks
from dsfp4.runtime.generate.decoder import Decoder
from dsfp4.runtime.generate.generation import Delta, Generation, Stream
from dsfp4.runtime.generate.joint_prefill import prefill_together
from dsfp4.runtime.generate.logits_rules import rules_for
from dsfp4.runtime.generate.prompt import Prompt, PromptRules, PromptSpec, as_token_ids
from dsfp4.runtime.generate.prompt_cache import MIN_NEW_TOKENS, PromptCache
from dsfp4.runtime.generate.prompt_reuse import PromptReuse, open_prompt_cache
from dsfp4.runtime.generate.speculative import Speculator
from dsfp4.runtime.generate.stats import GenerationStats
from dsfp4.runtime.generate.steps import text_deltas
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.families import model_family
from dsfp4.runtime.models.load import load_model, run_target
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting
from dsfp4.runtime.options import SAMPLING, EngineOptions, RunOptions, SamplingOptions, with_knobs
from dsfp4.runtime.plan.budget import peak_memory
from dsfp4.runtime.plan.host_backbone import step_bytes_on_host
from dsfp4.runtime.plan.limits import LOGIT_ROWS
from dsfp4.runtime.plan.planner import Plan, layer_cache_bytes
from dsfp4.runtime.profile.recorder import RoutingRecorder
from dsfp4.runtime.store.counters import counters_since
from dsfp4.runtime.store.expert_store import ExpertStore


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
        self.options = o = _engine_options(model_dir, options, knobs)
        self.model_dir = Path(model_dir)
        device, manifest, max_context, dtype = run_target(self.model_dir, o)
        _prepare_device(device)
        a = manifest.args
        self.rules = prompt_rules(self.model_dir, o, manifest, max_context)
        self.grammars = GrammarCompiler(self.model_dir / "tokenizer.json", a.vocab_size, self.tokenizer.eos_ids)
        _check_mtp(o, manifest, self.model_dir)
        self.model: Model | None = load_model(
            self.model_dir, device, dtype, self.max_context, with_mtp=o.mtp, manifest=manifest, options=o, plan=plan
        )
        self.device = device
        plan, elt = self.model.experts.plan, torch.empty((), dtype=dtype).element_size()
        # over PCIe a decode step: bytes of host backbone, and bytes of host caches per cached position
        self.host_reads = (
            step_bytes_on_host(manifest, plan.on_host, elt),
            sum(layer_cache_bytes(a, i, 1, elt)[0] for i in plan.on_host.caches),
        )
        # what runs instead of the kernels on this card and its cost (kernels/kernel_paths.py), then the store's
        word = kernel_paths(device).word
        self.notes: list[str] = [word] * bool(word) + list(self.model.experts.notes)
        # of the last generation
        self.stats: GenerationStats | None = None
        # the generation in progress
        self._stream: Stream | None = None
        # one call at a time: two threads would corrupt the cache
        self._busy = threading.Lock()
        self.recorder = RoutingRecorder(self.model, trace=True) if o.record_trace else None
        self.routing = trace_routing(self.model, a, o, device, self.max_context) if o.routing is not None else None
        self.decoder = Decoder(
            self.model,
            None,
            self.recorder,
            o.prefill_chunk,
            self.max_context,
            self.routing,
            plan.prefill_group,
            plan.attention_group,
        )
        self.speculator = Speculator(self.decoder, self.model) if o.mtp else None
        self.prompt_cache: PromptCache | None = None
        try:
            if o.prompt_cache is not None:
                conversion = manifest.conversion_sha256()
                pc = open_prompt_cache(
                    self.model, self.model_dir, o.prompt_cache, o.prompt_cache_size, conversion, o.fp8_attention
                )
                self.prompt_cache = pc
                # a folder that cannot be written says so once, with the load's notes
                if note := pc.take_notes():
                    self.notes.append(note)
            self.reuse = PromptReuse(self.decoder, self.speculator, self.prompt_cache, self._model)
            # --experts-per-token changed the run's shape, not the conversion on disk hot.json binds to
            on_disk = manifest if not o.experts_per_token else Manifest.read(self.model_dir)
            if note := warm_start(self.model, self.model_dir, on_disk, o.zero_copy):
                self.notes.append(note)
            warm_up_kernels(self.model, dtype, manifest.args, min(o.prefill_chunk, self.max_context))
            if o.cuda_graph:
                recording = self.recorder is not None
                self.decoder.graphs = captured_graphs(self.model, self.max_context, device, recording, self.routing)
        except BaseException:
            self.close()
            raise

    @property
    def max_context(self) -> int:
        """Positions of the KV cache: the room of a prompt and its answer."""
        return self.rules.max_context

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.rules.tokenizer

    @property
    def plan(self) -> Plan:
        return self._model().experts.plan

    @property
    def cached(self) -> list[int]:
        """The tokens whose KV the caches hold."""
        return self.decoder.cached

    @property
    def decode_mode(self) -> str:
        """How decode steps run: "CUDA graph", or "eager" and why."""
        graphs = self.decoder.graphs
        if graphs is None:
            return "eager: --no-cuda-graph"
        if not graphs.ready:
            return f"eager: {graphs.why_eager}"
        mode = "CUDA graph (plain steps; MTP verify steps eagerly)" if self.speculator else "CUDA graph"
        if graphs.streamed:
            return f"{mode} in {graphs.pieces} pieces, streamed experts loaded between them"
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
        if self.prompt_cache is not None:
            # an entry being written is finished, not left behind as a temporary file
            self.prompt_cache.wait()
        try:
            if self.recorder is not None and self.recorder.tokens:
                write_trace(self.options.record_trace, self.recorder.routing_trace())
        finally:
            if self.recorder is not None:
                self.recorder.detach()
            self.model.experts.close()
            # the graphs' memory pool goes with them
            self.model = self.decoder.model = self.decoder.graphs = None
            # the modules hold each other (MoE layers and the store): free them now
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def reset(self) -> None:
        """Forget the cached conversation: the next call prefills its whole prompt."""
        with self._claim():
            self._end_stream()
            self.reuse.truncate(0)

    def encode(
        self,
        prompt: Prompt,
        system: str | None = None,
        raw: bool = False,
        thinking: bool | None = None,
        tools: object = None,
    ) -> list[int]:
        """Token ids of a prompt: text (through the prompt format, with an optional system message, unless
        `raw`), chat messages ([{"role": ..., "content": ...}], with tool calls and results, through the format) or
        token ids as given. `thinking` turns thinking on or off where the format has a switch (None: the engine's
        --thinking); `tools`: an OpenAI tools list the format describes to the model."""
        return self.rules.encode(prompt, system, raw, thinking, tools)

    def opens_thinking(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves the model inside an R1-style <think> block (R1's chat templates do)."""
        return self.rules.opens_thinking(prompt_ids)

    def check_prompt(self, prompt_ids: list[int], room: int = 1) -> None:
        """A prompt must leave `room` positions of the context free and name tokens of the vocabulary."""
        # a closed engine says so first
        self._model()
        self.rules.check(prompt_ids, room)

    def room(self, prompt_tokens: int) -> int:
        """Tokens a generation after a prompt of this length may produce (the last is never fed back)."""
        return self.rules.room(prompt_tokens)

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
        system: str | None = None,
        raw: bool = False,
        thinking: bool | None = None,
        cancel: threading.Event | None = None,
        tools: object = None,
        tool_choice: object = None,
        response_format: object = None,
        **sampling: Any,
    ) -> Stream:
        """Generate after `prompt` (see encode), yielding a Delta per token. Sampling arguments (SAMPLING's) left at
        None take the engine's options: temperature 0 is greedy; `seed` makes sampling reproducible; a `grammar` that
        does not compile is refused here; generation ends at an EOS token, a `stop` string (not part of the text) or
        after `max_tokens` tokens. `cancel` (set from any thread) ends it at the next chunk or token ("cancelled").
        `tools`, `tool_choice` and `response_format` as OpenAI's chat completions take them (answer_format.py):
        the Generation's tool_calls holds the answer's calls (a malformed one raises ToolCallError at the end)."""
        answer = AnswerFormat.of(self.tokenizer, tools, tool_choice, response_format=response_format)
        no_grammar_beside(sampling.get("grammar"), answer)
        ids = self.encode(prompt, system, raw, thinking, answer.prompt_tools)
        reasoning = self.opens_thinking(ids)
        if (grammar := answer.grammar(self.tokenizer, reasoning)) is not None:
            sampling["grammar"] = grammar
        options = self.options_for(**sampling)
        if options.grammar is not None:
            self.grammars.compile(options.grammar)
        self.check_prompt(ids)
        finish = functools.partial(answer.finish, tokenizer=self.tokenizer, reasoning=reasoning)
        with self._claim():
            self._end_stream()
            self._stream = Stream(self._steps(ids, options, cancel, finish), self._claim)
        return self._stream

    def options_for(self, **sampling: Any) -> RunOptions:
        """The engine's options with a call's sampling arguments (SAMPLING: max_tokens, temperature, top_p, top_k,
        seed, stop, the penalties, min_p, logprobs, grammar; those left at None keep the engine's)."""
        if unknown := sorted(set(sampling) - set(SAMPLING)):
            raise ConfigError(f"unknown sampling argument {', '.join(unknown)}; give {', '.join(SAMPLING)}")
        return with_knobs(self.options, {k: v for k, v in sampling.items() if v is not None})

    def batch(self) -> BatchRun:
        """Sequences decoding together, up to the plan's max_batch (runtime/generate/batch.py): add prompts between
        steps, step, take each sequence's deltas and, once it ends, its Generation. One batch at a time, in one
        thread; the engine's other calls may run between its steps (they use the single sequence's slot 0, as the
        batch's prefills do, which keep the engine's record of it up to date)."""
        model = self._model()
        if self.plan.max_batch < 2:
            raise ConfigError("Engine.batch: this engine decodes one sequence at a time; open it with max_batch >= 2")
        with self._claim():
            self._end_stream()

        def finished(stats: GenerationStats) -> None:
            _finish_stats(stats, model.experts, self.routing, self.host_reads, self.device)

        forget, rules = lambda: self.reuse.truncate(0), functools.partial(rules_for, grammars=self.grammars)
        hooks = Hooks(self._claim, self.reuse.prefill, forget, finished, self.decoder.pausing, rules)
        # prompts joining together prefill layer by layer where reading experts dominates a prefill (the tiers cannot
        # hold every record), under a trace too (each prompt through a stretch of its rows); not with a prompt cache
        # (the one-by-one prefill restores saved prompts: `run --batch` saves its lines there together first)
        p, routing = self.plan, self.routing
        joint = self.prompt_cache is None and p.gpu_slots + p.ram_slots < p.total_records
        chunk, graphs = self.options.prefill_chunk, self.decoder.graphs
        # short prompts join through the batch's captured steps where a step reads nothing (every record on the
        # device, no trace) and no prompt cache would restore them
        resident = p.gpu_slots >= p.total_records and routing is None and self.prompt_cache is None
        stepped = STEPPED_PROMPT_TOKENS if resident and graphs is not None and graphs.ready else 0
        # a recorded trace keeps one sequence's routing whole: no batch step inside its prefill
        yield_s = self.options.prefill_yield_ms / 1000 if self.recorder is None else 0.0
        return BatchRun(
            model, p.max_batch, self.max_context, chunk, self.tokenizer, hooks, routing, graphs, joint, stepped, yield_s
        )

    def generate_batch(self, requests: Sequence[tuple[list[int], RunOptions]]) -> Iterator[tuple[int, Generation]]:
        """Generate after each (prompt ids, options) in batches of up to max_batch, a new one joining as soon as a
        slot frees -> (its index, its Generation), as each ends (not in order)."""
        for ids, _ in requests:
            self.check_prompt(ids)
        run, waiting, running = self.batch(), deque(enumerate(requests)), {}
        while waiting or running:
            joining = [waiting.popleft() for _ in range(min(run.free, len(waiting)))]
            seqs = run.add_many([(ids, options, None) for _, (ids, options) in joining])
            running.update({seq: i for seq, (i, _) in zip(seqs, joining, strict=True)})
            run.step()
            for seq in [s for s in running if s.generation is not None]:
                yield running.pop(seq), seq.generation

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits after each of `token_ids` -> [T, V] fp32 on the CPU, computed from position 0 in the
        chunks of ordinary prefill (the cache then holds these tokens, so a generation after them reuses it)."""
        items = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
        ids = None if isinstance(items, str) else as_token_ids(list(items))
        if ids is None:
            raise ConfigError("logits takes token ids; encode text or chat messages with engine.encode first")
        self.check_prompt(ids, room=0)
        with self._claim():
            self._end_stream()
            head, rows = self._model().head, []
            self.reuse.truncate(0)
            done = 0
            # h: [t, D]
            for _, h in self.decoder.feed(ids):
                # its entries follow, so a generation after this reuses it
                if self.speculator is not None:
                    self.speculator.entries(h, ids, 0, done)
                # the head runs on LOGIT_ROWS positions at a time, as the planner's workspace allows
                rows += [linear(h[j : j + LOGIT_ROWS], head).float().cpu() for j in range(0, len(h), LOGIT_ROWS)]
                done += len(h)
        return torch.cat(rows)  # [T, V]

    def prefill_together(self, prompts: Sequence[Sequence[int]]) -> int:
        """--prompt-cache: prefill these prompts layer by layer together (runtime/generate/joint_prefill.py), each
        layer's records read once for all of them, and save each one's KV in the prompt cache, where generating it
        later restores it -> the tokens prefilled (0 when there is nothing to gain: no prompt long enough to save; MoE
        layers that route by a trace or record it, which this pass would not feed; --mtp, whose layer this pass does
        not fill, so that its generations could not restore what it saved)."""
        if self.prompt_cache is None:
            raise ConfigError(
                "prefill_together keeps what it prefills in the prompt cache: open the engine with --prompt-cache"
            )
        worth = [as_token_ids(list(p)) for p in prompts if len(p) - 1 >= MIN_NEW_TOKENS]
        for ids in worth:
            self.check_prompt(ids, room=1)
        if not worth or self.routing is not None or self.recorder is not None or self.speculator is not None:
            return 0
        with self._claim():
            self._end_stream()
            # the caches will hold no one prompt
            self.reuse.truncate(0)
            chunk, plan = self.options.prefill_chunk, self.plan
            return prefill_together(
                self._model(), self.prompt_cache, worth, chunk, plan.prefill_group, plan.attention_group
            )

    # -- internals ------------------------------------------------------------------------------------

    def _model(self) -> Model:
        if self.model is None:
            raise DsfpError("this engine is closed; create a new one")
        return self.model

    @contextmanager
    def _claim(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise DsfpError(
                "this engine is busy in another thread: it runs one call at a time (serialize the calls, or use an "
                "engine per thread)"
            )
        try:
            yield
        finally:
            self._busy.release()

    def _end_stream(self) -> None:
        if self._stream is not None:
            if self._stream.generation is None:
                self._stream.superseded = True
            # a generation left unfinished ends here, with the cache consistent
            self._stream.close()
            self._stream = None

    @torch.inference_mode()
    def _steps(
        self,
        prompt_ids: list[int],
        options: SamplingOptions,
        cancel: threading.Event | None,
        finish: Callable[[Generation], Generation],
    ) -> Generator[Delta, None, Generation]:
        """The generation loop: tokens from plain or speculative decoding, as deltas of text; then the stats."""
        n, store = len(prompt_ids), self._model().experts
        budget = min(options.max_tokens, self.room(n))
        before = store.counters.snapshot()
        sampling, rules = options.sampling(), rules_for(options, prompt_ids, self.grammars)
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        start = time.perf_counter()
        reuse, restored = self.reuse.keep(prompt_ids)
        stats = GenerationStats(prompt_tokens=n, cached_tokens=reuse, restored_tokens=restored)
        if self.speculator is not None and budget > 1:
            source = self.speculator.tokens(prompt_ids[reuse:], sampling, gen, cancel, stats, budget, rules)
        else:
            source = self.decoder.decode(prompt_ids[reuse:], sampling, gen, cancel, budget, rules)
        logprobs = rules.logprobs if rules is not None else None
        tokens, text, end = yield from text_deltas(source, self.tokenizer, options.stop, budget, stats, start, logprobs)
        stats.decode_s = time.perf_counter() - start - stats.prefill_s
        stats.store = counters_since(store.counters.snapshot(), before)
        stats.decode_mode = self.decode_mode
        _finish_stats(stats, store, self.routing, self.host_reads, self.device)
        self.reuse.save(prompt_ids, stats)
        self.stats, self._stream = stats, None
        kept = logprobs[: len(tokens)] if logprobs is not None else None
        return finish(Generation(list(prompt_ids), tokens, text, end, stats, kept))


def _engine_options(model_dir: object, options: object, knobs: dict[str, Any]) -> RunOptions:
    """The engine's options: `options` (default RunOptions()) with the keyword knobs replaced."""
    if not isinstance(model_dir, (str, os.PathLike)) or not isinstance(options, (RunOptions, type(None))):
        raise ConfigError(f"Engine takes a model folder and RunOptions, not {model_dir!r:.40} and {options!r:.40}")
    return with_knobs(options or RunOptions(), knobs)


def _prepare_device(device: torch.device) -> None:
    """On CUDA, as the CLI does: expandable segments (the device budget relies on them) and the peaks counted from
    here."""
    if device.type == "cuda":
        use_expandable_segments()
        torch.cuda.reset_peak_memory_stats(device)


def _check_mtp(o: EngineOptions, manifest: Manifest, model_dir: Path) -> None:
    """--mtp needs the checkpoint's MTP layer, and a family whose MTP layer speculative decoding drives."""
    if o.mtp and not manifest.args.n_mtp_layers:
        raise ConfigError(f"--mtp: {model_dir} has no MTP layer (converted with --no-mtp?)")
    if o.mtp and not model_family(manifest.args).mtp:
        raise ConfigError(
            f"--mtp: speculative decoding drives V3's MTP layer, not {manifest.args.family_spec.title}'s; run "
            f"{model_dir} without --mtp"
        )


def prompt_rules(
    model_dir: Path, options: RunOptions, manifest: Manifest | None = None, max_context: int | None = None
) -> PromptRules:
    """The prompts an engine of these options would take and refuse, known before anything loads (a too long prompt
    is refused before the backbone is read)."""
    if manifest is None or max_context is None:
        _, manifest, max_context, _ = run_target(Path(model_dir), options)
    a = manifest.args
    spec = PromptSpec(str(model_dir), a.eos_token_ids, max_context, a.max_seq_len, a.vocab_size, options.thinking)
    return PromptRules(spec)


def _finish_stats(
    stats: GenerationStats,
    store: ExpertStore,
    routing: TraceRouting | None,
    host_reads: tuple[int, int],
    device: torch.device,
) -> None:
    """What every generation's stats report of the engine: routing, the CPU lane, warm start, what a step reads of
    host memory (`host_reads`: the backbone's bytes, the caches' bytes per position), peaks."""
    stats.routing = routing.describe() if routing is not None else ""
    stats.cpu_lane = store.lane_split.describe() if store.lane is not None else ""
    stats.warm_records, stats.warm_s = store.warm_records, store.warm_s
    stats.host_backbone_step = host_reads[0]
    stats.host_cache_step = host_reads[1] * (stats.prompt_tokens + stats.generated_tokens)
    stats.peak_gpu, stats.peak_rss = peak_memory(device)
