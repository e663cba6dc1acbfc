"""Click option blocks shared by commands: where a model runs and under which memory budgets (`run`,
`profile-hot`), how it samples (`run`, `chat`), which hub revision (`download`, `convert`). Each run flag
sets the RunOptions field of the same name."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import click
from click.core import ParameterSource

from dsfp4.kernels.token_bounds import DECOMPRESS_TOKENS
from dsfp4.runtime.generate.answer.grammar import Grammar
from dsfp4.runtime.generate.generation import MAX_TOP
from dsfp4.runtime.generate.value_rules import SEED_LIMIT
from dsfp4.runtime.modes import MODES
from dsfp4.runtime.options import DTYPES, RunOptions
from dsfp4.runtime.plan.budget import PRESETS
from dsfp4.runtime.store.policy import TIER_POLICIES

PATH = click.Path(path_type=Path)
EXISTING_DIR = click.Path(path_type=Path, exists=True, file_okay=False)
EXISTING_FILE = click.Path(path_type=Path, exists=True, dir_okay=False)
RUN_DEFAULTS = RunOptions()
ZERO_COPY = click.option(
    "--no-zero-copy",
    "zero_copy",
    is_flag=True,
    flag_value=False,
    default=True,
    help="Stream experts through the device slots even when the device and RAM hold them all (by default "
    "kernels then read RAM's records in place over PCIe, and a decode step replays as one CUDA graph).",
)
CUDA_GRAPH = click.option(
    "--no-cuda-graph",
    "cuda_graph",
    is_flag=True,
    flag_value=False,
    default=True,
    help="Launch every decode step's kernels one by one instead of replaying captured CUDA graphs.",
)
quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress bar.")


class FiniteRange(click.FloatRange):
    """click.FloatRange that refuses NaN and infinities, which pass its bounds: no comparison with NaN holds."""

    def convert(self, value, param, ctx):  # noqa: ANN001 (click's signature)
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)


def _stack(*decorators: Callable) -> Callable:
    def apply(f: Callable) -> Callable:
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


def prefill_chunk_option(default: int) -> Callable:
    """--prefill-chunk, with the command's own default."""
    return click.option(
        "--prefill-chunk",
        type=click.IntRange(min=1),
        default=default,
        show_default=True,
        help="Prompt tokens per forward pass: larger loads each expert fewer times, smaller needs less workspace.",
    )


def context_options(max_context: int, context_help: str, prefill_chunk: int) -> Callable:
    """--max-context and --prefill-chunk, with the command's own defaults."""
    return _stack(
        click.option(
            "--max-context", type=click.IntRange(min=2), default=max_context, show_default=True, help=context_help
        ),
        prefill_chunk_option(prefill_chunk),
    )


budget_options = _stack(
    click.option("--device", default=RUN_DEFAULTS.device, show_default=True, help="auto, cpu, cuda or cuda:N."),
    click.option(
        "--devices",
        callback=lambda ctx, param, value: () if value is None else (value,),
        help="Split the layers across the cards of this box, e.g. cuda:0,cuda:1 (instead of --device): each card "
        "its share of the backbone, KV cache and expert slots, one budget per card (--gpu-mem 22G,22G or --preset "
        "2x24g); the same card named twice takes the split path on one device.",
    ),
    click.option(
        "--dtype",
        type=click.Choice(["auto", *DTYPES]),
        default=RUN_DEFAULTS.dtype,
        show_default=True,
        help="Compute dtype; auto is bf16 on CUDA, fp32 on the CPU.",
    ),
    click.option(
        "--gpu-mem",
        help="Device memory budget, e.g. 14G; with --devices one size per card, e.g. 22G,22G (default: the preset, "
        "else free VRAM less a margin).",
    ),
    click.option("--cpu-mem", help="RAM budget of the process, e.g. 64G (default: the preset, else 80% of available)."),
    click.option("--preset", type=click.Choice(list(PRESETS)), help="Budgets of a hardware class (see run --plan)."),
    click.option(
        "--io-threads",
        type=click.IntRange(min=1),
        default=RUN_DEFAULTS.io_threads,
        show_default=True,
        help="SSD reads in flight.",
    ),
    click.option(
        "--no-verify",
        "verify",
        is_flag=True,
        flag_value=False,
        default=True,
        help="Skip the sha256 checks: of the backbone's files as they load and of each record's first read.",
    ),
)


routing_options = _stack(
    click.option(
        "--routing",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Route every MoE layer by this trace (.npy ids, .npz ids and weights: --record-trace's, or "
        "scripts/synthetic_trace.py's) instead of its router, so the store runs under that routing on any model.",
    ),
    click.option(
        "--routing-recall",
        type=FiniteRange(0, 1),
        default=RUN_DEFAULTS.routing_recall,
        show_default=True,
        help="With --routing: the share of the next MoE layer's experts its prefetch guesses right (the rest "
        "wrong), for the routers cannot predict a trace.",
    ),
)


class ThresholdType(click.ParamType):
    """--expert-threshold: auto, or a weight from 0 to below 1."""

    name = "auto|WEIGHT"

    # click passes (param) or (param, ctx) by version
    def get_metavar(self, *args, **kwargs) -> str:
        return self.name

    def convert(self, value, param, ctx):  # noqa: ANN001 (click's signature)
        if value == "auto" or isinstance(value, float):
            return value
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not 0.0 <= weight < 1.0:
            self.fail(f"{value!r}: give auto, or a weight from 0 (off) to below 1", param, ctx)
        return weight


# how the expert store runs and the lossy levers: `run`, `eval`, `bench`
store_options = _stack(
    click.option(
        "--policy",
        type=click.Choice(list(TIER_POLICIES)),
        default=RUN_DEFAULTS.policy,
        show_default=True,
        help="Expert eviction: lru (recency), lfu (frequency with decay), mix (lfu on the device, lru in RAM), hot "
        "(mix, with 3/4 of RAM held for hot.json's hottest records; mix without a profile).",
    ),
    click.option(
        "--no-prefetch",
        "prefetch",
        is_flag=True,
        flag_value=False,
        default=True,
        help="Do not predict the next layer's experts.",
    ),
    click.option(
        "--mode",
        type=click.Choice(list(MODES)),
        default=RUN_DEFAULTS.mode,
        show_default=True,
        help="The lossy levers' setting: "
        + "; ".join(f"{n}: threshold {m.expert_threshold:g}, cache-aware {m.cache_aware:g}" for n, m in MODES.items())
        + ". Each mode's measured speed and quality cost: README. A lever flag wins over the mode's.",
    ),
    click.option(
        "--expert-threshold",
        type=ThresholdType(),
        help="Lossy: leave out a routed expert that is in neither VRAM nor RAM when every token that chose it gives "
        "it less than this share of its routing weight (the others rescaled); 0 is exact; auto leaves out only what "
        "a step's reads cannot hide behind its copies, up to throughput's threshold. Default: the mode's.",
    ),
    click.option(
        "--cache-aware",
        type=FiniteRange(0),
        help="Lossy: swap a chosen expert that would come from the SSD for an unchosen one of its group already in "
        "VRAM or RAM that the router scored within this margin of it; 0 is exact. Default: the mode's.",
    ),
    click.option(
        "--experts-per-token",
        type=click.IntRange(0),
        default=RUN_DEFAULTS.experts_per_token,
        help="Lossy: each token takes the router's best K routed experts instead of the model's own count "
        "(DeepSeek-V3: 8), weighted as the model weights its own; fewer reads and products per token. 0: the "
        "model's own.",
    ),
    click.option(
        "--fp8-attention",
        is_flag=True,
        help=f"Lossy, experimental: a long prompt's attention (chunks above {DECOMPRESS_TOKENS} tokens) takes its "
        "128-wide key products and its values in FP8 (e4m3, a scale per row) on FP8 tensor cores; the rope products "
        "stay bf16, decode stays exact. Slower than the bf16 kernel today (its roundings run as torch passes: 1.9x "
        "the time at 32k tokens on an H200); README. Needs FP8 tensor cores (sm_89 on) or the CPU; DeepSeek-V3, V2.",
    ),
    click.option(
        "--cpu-experts",
        default=RUN_DEFAULTS.cpu_experts,
        show_default=True,
        help="Compute some of a decode step's RAM hits on the CPU cores, from their records in RAM, while PCIe carries "
        "the rest: auto takes the share that balances the two, both measured at load (CUDA runs); or a share 0-1 of "
        "the step's experts not on the GPU. It gains where PCIe binds (records in RAM, copied up), not where the SSD "
        "does (README).",
    ),
    click.option(
        "--prefetch-reads",
        is_flag=True,
        help="Let a prefetch read its guesses from the SSD (default: only copy up guesses already in RAM, faster while "
        "the SSD binds and a guess can be wrong).",
    ),
)


sampling_options = _stack(
    click.option("--max-tokens", type=click.IntRange(min=1), default=RUN_DEFAULTS.max_tokens, show_default=True),
    click.option(
        "--temperature",
        type=FiniteRange(min=0),
        default=RUN_DEFAULTS.temperature,
        show_default=True,
        help="0 means greedy.",
    ),
    click.option("--top-p", type=FiniteRange(0, 1, min_open=True), default=RUN_DEFAULTS.top_p, show_default=True),
    click.option(
        "--top-k", type=click.IntRange(min=0), default=RUN_DEFAULTS.top_k, show_default=True, help="0 means off."
    ),
    click.option("--seed", type=click.IntRange(0, SEED_LIMIT - 1), help="Makes sampling reproducible."),
    click.option("--stop", multiple=True, help="Stop when this text appears (repeatable)."),
    click.option(
        "--presence-penalty",
        type=FiniteRange(-2, 2),
        default=RUN_DEFAULTS.presence_penalty,
        show_default=True,
        help="Subtracted from the logit of every token already generated (OpenAI's).",
    ),
    click.option(
        "--frequency-penalty",
        type=FiniteRange(-2, 2),
        default=RUN_DEFAULTS.frequency_penalty,
        show_default=True,
        help="Subtracted from a token's logit per time it was generated (OpenAI's).",
    ),
    click.option(
        "--repetition-penalty",
        type=FiniteRange(0, min_open=True),
        default=RUN_DEFAULTS.repetition_penalty,
        show_default=True,
        help="Divides the positive logits (multiplies the negative) of tokens in the prompt or generated; 1 is off.",
    ),
    click.option(
        "--min-p",
        type=FiniteRange(0, 1),
        default=RUN_DEFAULTS.min_p,
        show_default=True,
        help="Leave out tokens less probable than this share of the most probable one (after temperature); 0 is off.",
    ),
    click.option(
        "--thinking/--no-thinking",
        default=None,
        help="Turn the model's thinking on or off where its prompt format has that switch (DeepSeek-V4's thinking "
        "mode, V3.1's template); default: the format's own (off). /think switches it in a chat.",
    ),
)


def _grammar_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Grammar | None:
    """--json-schema FILE and --grammar FILE: the file's grammar, checked as text here (compiled once the model's
    tokenizer is known)."""
    if value is None:
        return None
    origin = f"{param.opts[0]} {value}"
    try:
        text = value.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read it ({e})", ctx, param) from e
    return Grammar.json_schema(text, origin) if param.name == "json_schema" else Grammar.lark(text, origin)


# what `run --prompt` constrains its answer to, and reports of it
answer_options = _stack(
    click.option(
        "--json-schema",
        type=EXISTING_FILE,
        callback=_grammar_file,
        help="With --prompt: the answer is JSON that fits this JSON schema (constrained decoding, compact JSON).",
    ),
    click.option(
        "--grammar",
        type=EXISTING_FILE,
        callback=_grammar_file,
        help="With --prompt: the answer follows this Lark grammar (llguidance's dialect; `start` is the answer).",
    ),
    click.option(
        "--logprobs",
        type=click.IntRange(0, MAX_TOP),
        help=f"With --prompt --json: each token's log-probability and this many alternatives (0-{MAX_TOP}), under the "
        "logits after penalties and grammar, before temperature.",
    ),
)


def hub_options(prefix: str = "") -> Callable:
    """--revision and --token of the commands that read from the Hugging Face hub."""
    return _stack(
        click.option("--revision", default="main", show_default=True, help=f"{prefix}Branch, tag or commit to fetch."),
        click.option(
            "--token", help=f"{prefix}Hub token for gated or private repos (default: HF_TOKEN or the saved login)."
        ),
    )


def given_params(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """The parameters among `names` that the user gave on the command line."""
    return [n for n in names if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]


def only_with(flags: list[str], what: str) -> str:
    """'--port only applies with --serve', '--host, --port only apply with --serve'."""
    return f"{', '.join(flags)} only appl{'y' if len(flags) > 1 else 'ies'} with {what}"


def given_flags(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """The flags among `names` (parameter names) that the user typed, as they are spelled."""
    spelled = {p.name: p.opts[0] for p in ctx.command.params}
    return [spelled[n] for n in given_params(ctx, names)]
