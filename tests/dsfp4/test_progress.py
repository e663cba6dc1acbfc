"""A prefill's progress: the decoder reports (tokens done, of how many) as it feeds a prompt, in either order, and the
CLI's display shows it once the prefill has taken longer than a second, then clears it."""

from __future__ import annotations

import io

from dsfp4.cli.progress import PrefillProgress
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.store.placement import fill
from tests.runtime.test_expert_store import _engine

PROMPT = "Explain the tiers of the expert store, layer by layer"


def _reports(engine: Engine) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    engine.decoder.progress = lambda done, total: seen.append((done, total))
    ids = engine.encode(PROMPT)
    engine.generate(ids, max_tokens=1, temperature=0)
    return seen


def test_the_decoder_reports_a_prefill_from_0_to_its_length_in_either_order(converted):
    with Engine(converted, device="cpu", max_context=64, prefill_chunk=4) as resident:
        fill(resident.model.experts)
        chunked = _reports(resident)  # every record reached in place: chunk after chunk through all blocks
    with _engine(converted, 3, 5, prefill_chunk=4) as streamed:
        streamed.decoder.attention_group = 4  # attention a chunk at a time, not the plan's whole prompt at once
        by_layer = _reports(streamed)  # layer by layer: a token is done once every block has taken it
    for seen in (chunked, by_layer):
        n = seen[0][1]
        assert seen[0] == (0, n) and seen[-1] == (n, n) and n > 12
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(by_layer) > len(chunked)  # one report a (block, attention chunk) and a (block, feed-forward group)


def test_the_display_waits_a_second_then_counts_down_and_clears():
    now = [0.0]
    out = io.StringIO()
    show = PrefillProgress(out, clock=lambda: now[0])
    show(0, 1000)
    now[0] = 0.5
    show(100, 1000)
    assert out.getvalue() == ""  # under a second: nothing
    now[0] = 2.0
    show(500, 1000)
    assert out.getvalue() == "\rprefill 500/1,000 tokens, 2 s left"
    now[0] = 3.0
    show(1000, 1000)
    assert out.getvalue().endswith("\r" + " " * len("prefill 500/1,000 tokens, 2 s left") + "\r")
    out.truncate(0)
    out.seek(0)
    show(0, 10)
    show(10, 10)  # a short prefill shows nothing, not even a clear
    assert out.getvalue() == ""


def test_an_engines_start_shows_its_stages_on_a_terminal_only(converted):
    """The library logs its start's stages; the CLI shows them where stderr is a terminal, a line each."""
    import logging

    from dsfp4.cli.progress import show_stages

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert show_stages(io.StringIO()) is None  # a pipe: nothing installed
    out = Terminal()
    handler = show_stages(out)
    try:
        with Engine(converted, device="cpu", max_context=64):
            pass
    finally:
        logging.getLogger("dsfp4").removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("... loading the backbone: ") and all(line.startswith("... ") for line in lines)
    assert any("expert tiers" in line for line in lines) and any("warm start" in line for line in lines)
