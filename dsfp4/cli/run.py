"""The commands that generate: `dsfp4 run MODEL` (one --prompt, --chat, or --serve the OpenAI API) and
`dsfp4 chat --url URL` (the chat loop on a server). Thin shells over Engine, the server and the chat loop."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dsfp4.cli.options import (
    CUDA_GRAPH,
    EXISTING_DIR,
    EXISTING_FILE,
    PATH,
    RUN_DEFAULTS,
    ZERO_COPY,
    answer_options,
    budget_options,
    context_options,
    given_flags,
    given_params,
    only_with,
    routing_options,
    sampling_options,
    store_options,
)
from dsfp4.cli.progress import PrefillProgress
from dsfp4.errors import ConfigError
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.runtime.options import RunOptions, SamplingOptions
from dsfp4.runtime.plan.budget import parse_size
from dsfp4.server.client_limits import READ_TIMEOUT_S

if TYPE_CHECKING:
    import socket

    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.generate.generation import Generation
    from dsfp4.runtime.generate.prompt import PromptRules
    from dsfp4.server.app import Served

SERVE_FLAGS = ("host", "port", "api_key", "max_queue", "max_body", "read_timeout")
# --serve or --batch
BATCH_FLAGS = ("max_batch",)
# --chat has /stats; a server answers with stats; a grammar constrains the one answer
PROMPT_FLAGS = ("raw", "show_stats", "json_schema", "grammar")


def _answer(engine: Engine, ids: list[int], as_json: bool, show_stats: bool, quiet: bool) -> Generation:
    stream = engine.stream(ids)
    for delta in stream:
        if not as_json:
            click.echo(delta.text, nl=False)
    g = stream.generation
    if as_json:
        click.echo(json.dumps(g.to_dict(), ensure_ascii=False))
    else:
        click.echo()
        if not quiet:
            click.echo(f"[{g.finish_reason}] {g.stats.line()}", err=True)
    if show_stats:
        click.echo(g.stats.table(), err=True)
    # the prompt's entry is written in the background: a failed write (a full disk) is known once it ends
    if engine.prompt_cache is not None and (note := engine.prompt_cache.settle()) and not quiet:
        click.echo(f"note: {note}", err=True)
    return g


@click.command()
@click.argument("model", type=EXISTING_DIR)
@click.option("--prompt", help="Text to answer (rendered with the model's chat template unless --raw).")
@click.option("--chat", is_flag=True, help="Interactive chat (/help inside lists the commands).")
@click.option("--serve", is_flag=True, help="Serve the OpenAI API: /v1/chat/completions, /v1/completions, ...")
@click.option(
    "--batch",
    type=EXISTING_FILE,
    help='Answer every line of this JSONL file ({"prompt": ...} or {"messages": [...]}, with optional '
    "max_tokens, temperature, top_p, top_k, seed, stop, raw) into --output; a rerun answers only what is missing.",
)
@click.option("--output", type=PATH, help="With --batch: the JSONL file of results, one per input line, in order.")
@click.option("--system", help="System message for the chat template.")
@click.option("--raw", is_flag=True, help="Feed --prompt as plain text, without the chat template.")
@sampling_options
@answer_options
@store_options
@CUDA_GRAPH
@ZERO_COPY
@click.option(
    "--mtp",
    is_flag=True,
    help="Speculative decoding with the checkpoint's MTP module: it drafts a token, one forward checks it "
    "(stops drafting when that does not pay).",
)
@budget_options
@context_options(
    RUN_DEFAULTS.max_context,
    "Tokens the KV cache holds (prompt + answer), at most the model's own limit.",
    RUN_DEFAULTS.prefill_chunk,
)
@routing_options
@click.option(
    "--record-trace",
    type=PATH,
    help="Write the routing of every token computed to this .npy (ids) or .npz (ids, weights, tokens) at exit.",
)
@click.option(
    "--prompt-cache",
    type=click.Path(path_type=Path, file_okay=False),
    help="Save each prompt's KV cache in this folder (compressed) and restore the longest saved prefix of a later "
    "prompt instead of prefilling it; for a long system prompt that many runs or requests share.",
)
@click.option(
    "--prompt-cache-size",
    default=RUN_DEFAULTS.prompt_cache_size,
    show_default=True,
    help="With --prompt-cache: the folder's bound; the least recently used entries go first.",
)
@click.option(
    "--max-batch",
    type=click.IntRange(0, DECODE_TOKENS),
    help="With --serve or --batch: sequences decoded together in one step, each with a KV cache of --max-context "
    "(0, the default there: the mode's, as far as an eighth of the device budget holds their caches and the VRAM and "
    "RAM slots the experts a step is expected to need).",
)
@click.option(
    "--prefill-yield-ms",
    type=click.IntRange(min=0),
    default=RUN_DEFAULTS.prefill_yield_ms,
    show_default=True,
    help="With --serve or --batch: a prompt joining running sequences pauses its prefill for a step of theirs "
    "whenever this long has passed since their last token, so a long prompt does not stall their streams "
    "(0: prefill it whole while they wait).",
)
@click.option("--plan", "show_plan", is_flag=True, help="Print the memory plan and exit.")
@click.option("--stats", "show_stats", is_flag=True, help="Print the full statistics table after the answer.")
@click.option("-q", "--quiet", is_flag=True, help="Print the answer only: no plan, notes or stats line on stderr.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object on stdout: prompt and generated token ids, text, finish reason, stats "
    "(with --plan: the plan).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="With --serve: the address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="With --serve.")
@click.option(
    "--api-key", envvar="DSFP4_API_KEY", help="With --serve: require 'Authorization: Bearer KEY' (or DSFP4_API_KEY)."
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="With --serve: requests that may wait while one generates; more are answered 503.",
)
@click.option(
    "--max-body",
    help="With --serve: a request body's size at most, such as 8M; larger ones are answered 413. "
    "[default: sized from --max-context, docs/server.md]",
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=READ_TIMEOUT_S,
    show_default=True,
    help="With --serve: seconds a request's head may take to come, and then its body; slower clients are cut.",
)
def run(
    model: Path,
    prompt: str | None,
    chat: bool,
    serve: bool,
    batch: Path | None,
    output: Path | None,
    system: str | None,
    raw: bool,
    show_plan: bool,
    show_stats: bool,
    quiet: bool,
    as_json: bool,
    host: str,
    port: int,
    api_key: str | None,
    max_queue: int,
    max_body: str | None,
    read_timeout: float,
    **knobs,
) -> None:
    """Generate with a converted MODEL: one --prompt (the answer, then a stats line on stderr), --chat, or
    --serve the OpenAI API (the sampling flags are then each request's defaults).

    \b
    Examples:
      dsfp4 run model/ --prompt "Why is the sky blue?"
      dsfp4 run model/ --prompt "2+2?" --temperature 0 --json
      dsfp4 run model/ --chat --temperature 0.6
      dsfp4 run model/ --serve --port 8000
      dsfp4 run model/ --batch prompts.jsonl --output results.jsonl
      dsfp4 run model/ --serve --prompt-cache ~/.cache/dsfp4/prompts
      dsfp4 run model/ --preset 24g --plan
    """
    from dsfp4.cli.batch import run_batch
    from dsfp4.cli.repl import LocalChat, chat_repl
    from dsfp4.layout.atomic import require_folder
    from dsfp4.runtime.engine import Engine, prompt_rules
    from dsfp4.runtime.generate.answer.grammar_matcher import GrammarCompiler
    from dsfp4.tools.batch_file import answered, read_batch

    ctx = click.get_current_context()
    # serving and batch files batch by default; one answer decodes alone
    if knobs["max_batch"] is None:
        knobs["max_batch"] = 0 if serve or batch is not None else 1
    schema = knobs.pop("json_schema")
    if schema is not None and knobs["grammar"] is not None:
        raise click.UsageError("give one of --json-schema FILE and --grammar FILE")
    knobs["grammar"] = schema or knobs["grammar"]
    options = RunOptions(**knobs)
    said = _kernel_note(options, quiet or as_json)
    if show_plan:
        _print_plan(ctx, model, options, as_json)
        return
    _check_one_command(prompt, chat, serve, batch, output)
    # every line checked before the model loads
    items = None if batch is None else read_batch(batch, options)
    done = None if output is None else answered(require_folder(output, "--output"), items)
    _check_flags(ctx, options, prompt, serve, batch, as_json, raw, system)
    body_limit = None if max_body is None else parse_size(max_body, "--max-body")
    if body_limit is not None and body_limit < 1:
        raise ConfigError(f"--max-body {max_body}: give a size of at least one byte, such as 8M")
    # before the model loads, so bad input stays a one-line error and reads nothing
    rules = prompt_rules(model, options)
    ids = _prompt_ids(rules, prompt, system, raw)
    if options.grammar is not None:
        vocab, eos = rules.spec.vocab_size, rules.tokenizer.eos_ids
        GrammarCompiler(Path(model) / "tokenizer.json", vocab, eos).compile(options.grammar)
    sock = _listen(host, port) if serve else None
    with Engine(model, options) as engine:
        _note_context(ctx, engine.max_context, options)
        _show_load(engine, as_json, quiet, said)
        if (chat or prompt is not None) and not (quiet or as_json) and sys.stderr.isatty():
            engine.decoder.progress = PrefillProgress(sys.stderr)
        if chat:
            chat_repl(LocalChat(engine), system)
        elif batch is not None:
            run_batch(engine, batch, items, done, output, system, quiet)
        elif serve:
            from dsfp4.server.app import Served

            max_tokens = options.max_tokens if given_params(ctx, ("max_tokens",)) else None
            served = Served(Path(model).resolve().name, api_key, max_queue, max_tokens, body_limit, read_timeout)
            _serve(engine, sock, served, f"http://{host}:{port}/v1")
        else:
            _answer(engine, ids, as_json, show_stats, quiet)
    if engine.recorder is not None and engine.recorder.tokens:
        click.echo(f"routing trace of {engine.recorder.tokens} tokens: {options.record_trace}", err=True)


def _print_plan(ctx: click.Context, model: Path, options: RunOptions, as_json: bool) -> None:
    """--plan: the memory plan, the expected floor of a token, the levers and the CPU lane; as JSON with --json (and
    the context it plans for)."""
    from dsfp4.device import resolve_device
    from dsfp4.kernels.kernel_paths import kernel_paths
    from dsfp4.runtime.models.load import plan_engine, run_target
    from dsfp4.runtime.plan.probes import host_share
    from dsfp4.tools.doctor import expected_floor

    plan = plan_engine(model, options)
    paths = kernel_paths(resolve_device(options.device))
    # the shape the run sees (--experts-per-token)
    manifest = run_target(Path(model), options)[1]
    floor, line = expected_floor(plan, manifest)
    levers = {"mode": options.mode, **dataclasses.asdict(options.levers())}
    levers["experts_per_token"] = manifest.args.n_activated_experts
    lane = host_share(options.cpu_experts, manifest.record, resolve_device(options.device))
    context = min(options.max_context, manifest.args.max_seq_len)
    _note_context(ctx, context, options)
    if as_json:
        out = {**dataclasses.asdict(plan), "max_context": context, "floor_s_per_token": floor, "levers": levers}
        click.echo(json.dumps({**out, "cpu_lane": dataclasses.asdict(lane), "kernels": paths.to_dict()}))
        return
    click.echo(plan.table())
    click.echo(line)
    k = manifest.args.n_activated_experts
    click.echo(f"mode {options.mode}: {options.levers().describe()}; {k} routed experts per token")
    click.echo(f"CPU lane: {lane.describe()}")
    click.echo(f"kernels on {paths.device}:")
    for line in paths.lines():
        click.echo(line)


def _kernel_note(options: RunOptions, quiet: bool) -> str:
    """Before anything loads: a card nothing runs on is refused; one where the kernels do not run gets a note of
    what runs instead and what it costs (returned: the engine's notes repeat it)."""
    from dsfp4.device import resolve_device
    from dsfp4.kernels.kernel_paths import kernel_paths

    paths = kernel_paths(resolve_device(options.device))
    paths.check()
    if paths.word and not quiet:
        click.echo(f"note: {paths.word}", err=True)
    return paths.word


def _check_one_command(prompt: str | None, chat: bool, serve: bool, batch: Path | None, output: Path | None) -> None:
    """One of --prompt, --chat, --serve and --batch; --batch with its --output."""
    if sum((prompt is not None, chat, serve, batch is not None)) != 1:
        raise click.UsageError("give one of --prompt TEXT, --chat, --serve or --batch FILE")
    if (batch is None) != (output is None):
        raise click.UsageError("--batch FILE and --output FILE go together")


def _check_flags(
    ctx: click.Context,
    options: RunOptions,
    prompt: str | None,
    serve: bool,
    batch: Path | None,
    as_json: bool,
    raw: bool,
    system: str | None,
) -> None:
    """The flags that apply to one command only are given with it; --raw skips the prompt format's flags."""
    if as_json and prompt is None:
        raise click.UsageError("--json applies to --prompt (or --plan)")
    if options.logprobs is not None and not as_json:
        raise click.UsageError("--logprobs go into --json's output: give --prompt TEXT --json")
    if not serve and (flags := given_flags(ctx, SERVE_FLAGS)):
        raise click.UsageError(only_with(flags, "--serve"))
    if not (serve or batch is not None) and (flags := given_flags(ctx, BATCH_FLAGS)):
        raise click.UsageError(only_with(flags, "--serve or --batch"))
    if prompt is None and (flags := given_flags(ctx, PROMPT_FLAGS)):
        raise click.UsageError(only_with(flags, "--prompt"))
    if options.prompt_cache is None and (flags := given_flags(ctx, ("prompt_cache_size",))):
        raise click.UsageError(only_with(flags, "--prompt-cache"))
    if raw and system is not None:
        raise click.UsageError("--system goes through the chat template, which --raw skips; give one of them")
    if raw and options.thinking is not None:
        raise click.UsageError("--thinking/--no-thinking switch the prompt format, which --raw skips; give one of them")


def _listen(host: str, port: int) -> socket.socket:
    """--serve, before the model loads: a missing server library or a port in use fails in a second, not after
    minutes."""
    try:
        import uvicorn  # noqa: F401  (the HTTP process's)

        import dsfp4.server.app  # noqa: F401  (_serve's, with its libraries)
        from dsfp4.server.serve import listen
    except ImportError as e:
        raise ConfigError(f"--serve needs {e.name}: reinstall dsfp4 (pip install -e .) to get it") from e
    return listen(host, port)


def _note_context(ctx: click.Context, used: int, options: RunOptions) -> None:
    """A --max-context given above the model's own limit: the run takes the model's, `used`."""
    asked = bool(given_params(ctx, ("max_context",)))
    if asked and used < options.max_context:
        click.echo(f"note: --max-context {options.max_context} is above the model's limit; using {used}", err=True)


def _prompt_ids(rules: PromptRules, prompt: str | None, system: str | None, raw: bool) -> list[int]:
    """--prompt's token ids, checked ([] without --prompt)."""
    ids = [] if prompt is None else rules.encode(prompt, system, raw)
    if prompt is not None:
        rules.check(ids)
    return ids


def _show_load(engine: Engine, as_json: bool, quiet: bool, said: str) -> None:
    """The plan table (not with --json or --quiet) and the engine's notes (not with --quiet; not `said` again), on
    stderr."""
    if not (as_json or quiet):
        click.echo(engine.plan.table(), err=True)
    for note in engine.notes if not quiet else ():
        if note != said:
            click.echo(f"note: {note}", err=True)


def _serve(engine: Engine, sock: socket.socket, served: Served, where: str) -> None:
    """--serve: the OpenAI API on the socket until Ctrl-C (`served.max_tokens`: --max-tokens when given, else each
    request's own)."""
    from dsfp4.server.serve import serve as run_server

    click.echo(f"serving {served.model_id} at {where} (Ctrl-C stops)", err=True)
    run_server(engine, served, sock)


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The server (`dsfp4 run --serve`).")
@click.option("--api-key", envvar="DSFP4_API_KEY", help="Sent as 'Authorization: Bearer KEY' (or DSFP4_API_KEY).")
@click.option("--model", help="Model id to ask for (default: the first the server lists).")
@click.option("--system", help="System message.")
@sampling_options
def chat(url: str, api_key: str | None, model: str | None, system: str | None, **sampling) -> None:
    """Chat with a model served by `dsfp4 run MODEL --serve` (or another OpenAI-compatible server): the
    answer streams in; /stats, /think, /reset and /quit work as in `dsfp4 run --chat`.

    \b
    Examples:
      dsfp4 chat
      dsfp4 chat --url http://gpu-box:8000 --api-key "$KEY" --temperature 0.6
    """
    from dsfp4.cli.chat_client import RemoteChat
    from dsfp4.cli.repl import chat_repl

    # checked as `run` checks them
    SamplingOptions(**sampling)
    # the server's defaults hold otherwise
    given = given_params(click.get_current_context(), tuple(sampling))
    request = {name: sampling[name] for name in given}
    if "stop" in request:
        request["stop"] = list(request["stop"])
    backend = RemoteChat(url, api_key, request, model)
    try:
        click.echo(f"chatting with {backend.model} at {backend.base}", err=True)
        chat_repl(backend, system)
    finally:
        backend.close()
