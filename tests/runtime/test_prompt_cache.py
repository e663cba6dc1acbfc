"""The persistent prompt cache (runtime/generate/prompt_cache.py): its entry format round-trips, a later engine restores
a saved prefix and generates what it would have without it, damaged and foreign entries are skipped, the folder
stays within its bound, a folder that cannot be written serves read-only and a full disk leaves nothing behind; both
say so where the user sees it."""

from __future__ import annotations

import builtins
import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.prompt_cache import SUFFIX, PromptCache, decode_entry, encode_entry
from dsfp4.runtime.options import RunOptions
from tests.fixtures.cli import run_cli

PROMPT = list(range(2, 80))  # 78 token ids: enough new tokens to be saved
OTHER = PROMPT[:50] + list(range(300, 330))  # shares 50 tokens with PROMPT
# a prompt for `dsfp4 run`: more new tokens than an entry needs
WORDS = " ".join(f"w{i}" for i in range(20))
RUN = ("--device", "cpu", "--max-context", "256", "--max-tokens", "4", "--temperature", "0")


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float16, np.uint8, np.int64])
@pytest.mark.parametrize("shape", [(0, 4), (1, 1), (7, 3), (5, 2, 3)])
def test_entries_round_trip_every_dtype_and_shape(dtype, shape):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 1000).astype(dtype)
    header, arrays = decode_entry(encode_entry({"tokens": [1, 2]}, {"a": a, "b": a[:1]}))
    assert header["tokens"] == [1, 2] and list(arrays) == ["a", "b"]
    assert arrays["a"].dtype == a.dtype and np.array_equal(arrays["a"], a) and np.array_equal(arrays["b"], a[:1])


def test_damaged_entries_are_named():
    data = encode_entry({}, {"a": np.arange(100, dtype=np.float32)})
    with pytest.raises(ValueError, match="not a dsfp4 prompt cache entry"):
        decode_entry(b"x" + data)
    with pytest.raises(ValueError, match="damaged data"):
        decode_entry(data[:-10])
    with pytest.raises(ValueError, match="no arrays"):
        decode_entry(data.replace(b'"arrays"', b'"arraxs"'))


def _engine(model, folder, **knobs) -> Engine:
    return Engine(model, RunOptions(device="cpu", max_context=128, prompt_cache=folder, **knobs))


def _tokens(engine: Engine, prompt: list[int]):
    g = engine.generate(prompt, max_tokens=8, temperature=0)
    return g.token_ids, g.stats


def test_a_saved_prompt_is_restored_by_a_later_engine_and_changes_no_token(converted, tmp_path):
    with Engine(converted, RunOptions(device="cpu", max_context=128)) as plain:
        want, _ = _tokens(plain, PROMPT)
        want_other, _ = _tokens(plain, OTHER)
    folder = tmp_path / "pc"
    with _engine(converted, folder) as first:
        got, stats = _tokens(first, PROMPT)
        assert got == want and stats.restored_tokens == 0
    (entry,) = folder.glob(f"*{SUFFIX}")
    assert not [p for p in folder.iterdir() if p.suffix != SUFFIX]  # written whole, no temporary file left
    with _engine(converted, folder) as second:
        got, stats = _tokens(second, PROMPT)
        assert got == want and stats.restored_tokens == len(PROMPT) - 1 == stats.cached_tokens
        assert "from the prompt cache" in stats.line()
        got, stats = _tokens(second, OTHER)  # the memory cache keeps the same 50 tokens: nothing to restore
        assert got == want_other and stats.cached_tokens == 50 and stats.restored_tokens == 0
    with _engine(converted, folder) as third:
        got, stats = _tokens(third, OTHER)  # a prefix of a saved prompt serves another prompt
        assert got == want_other and stats.restored_tokens == 50
    assert list(folder.glob(f"*{SUFFIX}")) == [entry]  # OTHER prefilled 30 new tokens: fewer than a file is worth


def test_short_prompts_are_not_saved_and_mtp_entries_come_back_too(converted, tmp_path):
    folder = tmp_path / "pc"
    with _engine(converted, folder) as e:
        _tokens(e, PROMPT[:20])
    assert not list(folder.glob(f"*{SUFFIX}"))  # fewer new tokens than a file is worth
    with Engine(converted, RunOptions(device="cpu", max_context=128, mtp=True)) as plain:
        want, _ = _tokens(plain, PROMPT)
    with _engine(converted, folder, mtp=True) as e:
        _tokens(e, PROMPT)
    with _engine(converted, folder, mtp=True) as e:
        got, stats = _tokens(e, PROMPT)
        assert got == want and stats.restored_tokens == len(PROMPT) - 2  # the last MTP entry needs the next token
    with _engine(converted, folder) as e:  # without MTP the caches differ: the MTP run's entry is not this run's
        assert _tokens(e, PROMPT)[1].restored_tokens == 0


def test_a_cancelled_prompt_saves_nothing_it_did_not_prefill(converted, tmp_path):
    folder, cancel = tmp_path / "pc", threading.Event()
    cancel.set()
    with _engine(converted, folder) as e:
        assert e.generate(PROMPT, max_tokens=8, temperature=0, cancel=cancel).finish_reason == "cancelled"
    assert not list(folder.glob(f"*{SUFFIX}"))  # its rows past the prefill hold another prompt's


def test_damaged_and_foreign_entries_are_skipped(converted, tmp_path):
    folder = tmp_path / "pc"
    folder.mkdir()
    (folder / f"bad{SUFFIX}").write_bytes(b"garbage")
    foreign = {"conversion": "another", "rows": {}}
    (folder / f"foreign{SUFFIX}").write_bytes(encode_entry({**foreign, "tokens": PROMPT}, {}))
    with _engine(converted, folder) as e:  # an entry of this model whose array specs are damaged
        identity = e.prompt_cache.identity
    bad = encode_entry({**identity, "tokens": PROMPT}, {"a": np.zeros(3, np.float32)})
    (folder / f"specs{SUFFIX}").write_bytes(bad.replace(b'"<f4"', b'"<zz"'))
    with _engine(converted, folder) as e:
        got, stats = _tokens(e, PROMPT)
        assert stats.restored_tokens == 0 and "bad.dsfp4kv skipped (not a dsfp4 prompt cache entry)" in (
            stats.prompt_cache_note
        )
        assert "foreign" not in stats.prompt_cache_note  # another model's entry is simply not this run's
        assert "specs.dsfp4kv skipped (damaged header (arrays" in stats.prompt_cache_note


def test_the_folder_is_held_to_its_bound_least_recently_used_first(tmp_path):
    cache = PromptCache(tmp_path, max_bytes=1, identity={"conversion": "c", "rows": {}})
    rows = {"a": torch.randn(64, 8)}
    cache.save(list(range(64)), rows, 0)
    cache.wait()
    assert cache.compressed_bytes > 0 and cache.raw_bytes == 64 * 8 * 4
    assert not list(tmp_path.glob(f"*{SUFFIX}"))  # one entry is already over a 1-byte bound
    cache.max_bytes = 10**9
    cache.save(list(range(64)), rows, 0)
    cache.save(list(range(1, 65)), rows, 0)
    cache.wait()
    first, second = sorted(tmp_path.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
    hit = cache.find(list(range(64)) + [5], 0)
    assert hit is not None and hit.common == 64 and cache.load(hit) is not None  # a use makes it the newest
    cache.max_bytes = first.stat().st_size + 1
    cache.evict()
    (left,) = tmp_path.glob(f"*{SUFFIX}")
    assert left == hit.path


def test_the_flags_are_checked(converted, tmp_path):
    r = run_cli("run", converted, "--prompt", "hi", "--prompt-cache-size", "1G")
    assert r.exit_code == 2 and "--prompt-cache-size only applies with --prompt-cache" in r.output
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="a file, not a folder"):
        RunOptions(prompt_cache=tmp_path / "f")
    with pytest.raises(ConfigError, match="--prompt-cache-size"):
        RunOptions(prompt_cache_size="lots")


def test_a_v4_model_refuses_the_prompt_cache(v4_converted, tmp_path):
    with pytest.raises(ConfigError, match="--prompt-cache: .* not saved by position"):
        _engine(v4_converted, tmp_path / "pc")


@pytest.mark.gpu
def test_on_cuda_bf16_caches_are_saved_and_restored_bit_for_bit(converted, tmp_path):
    """Restored rows equal the saved ones, and the token after them comes out as from the same rows kept in memory
    (against a full prefill, bf16's rounding differs between a 78-token pass and a 1-token one)."""
    knobs = dict(device="cuda", max_context=128, prompt_cache=tmp_path / "pc")
    with Engine(converted, RunOptions(**knobs)) as first:
        _tokens(first, PROMPT)
        saved = {n: t[: len(PROMPT)].clone() for n, t in first.model.positional_caches().items()}
        want, stats = _tokens(first, PROMPT)  # the memory cache keeps all but the last prompt token
        assert stats.cached_tokens == len(PROMPT) - 1 and stats.restored_tokens == 0
    with Engine(converted, RunOptions(**knobs)) as second:
        got, stats = _tokens(second, PROMPT)
        caches = second.model.positional_caches()
        n = stats.restored_tokens
        assert got == want and n == len(PROMPT) - 1
        assert all(torch.equal(caches[k][:n], v[:n]) and v.dtype == torch.bfloat16 for k, v in saved.items())


def test_a_later_turn_replaces_the_entry_it_extends(converted, tmp_path):
    """A chat's next turn saves its whole prefix again: the earlier turn's entry, now a prefix of it, goes."""
    folder = tmp_path / "pc"
    with _engine(converted, folder) as e:
        first, _ = _tokens(e, PROMPT)
        turn2 = PROMPT + first + list(range(40, 80))  # the answer, then 40 new tokens of the user's
        _tokens(e, turn2)
        e.prompt_cache.wait()
    (entry,) = folder.glob(f"*{SUFFIX}")
    header = decode_entry(entry.read_bytes())[0]
    assert header["tokens"][: len(PROMPT)] == PROMPT and len(header["tokens"]) > len(PROMPT)


def _read_only(monkeypatch, folder: Path) -> None:
    """Every write under `folder` fails as on a read-only mount (the tests run as root, whom chmod does not stop)."""
    inside = str(folder)

    def refusing(real, writes=lambda *args, **kwargs: True):
        def call(path, *args, **kwargs):
            where = os.path.abspath(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else ""
            if (where == inside or where.startswith(inside + os.sep)) and writes(*args, **kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), where)
            return real(path, *args, **kwargs)

        return call

    flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    monkeypatch.setattr(os, "open", refusing(os.open, lambda f, *args, **kwargs: f & flags))
    monkeypatch.setattr(builtins, "open", refusing(builtins.open, lambda mode="r", *a, **k: set(mode) & set("wax+")))
    for name in ("utime", "unlink", "replace", "rename", "mkdir", "rmdir"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))


def _notes(stderr: str, needle: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("note: ") and needle in line]


def test_a_folder_that_cannot_be_written_serves_its_entries_read_only_with_one_note(converted, tmp_path, monkeypatch):
    folder = tmp_path / "pc"
    with _engine(converted, folder) as e:
        want, _ = _tokens(e, PROMPT)
    r = run_cli("run", converted, "--prompt-cache", folder, "--prompt", WORDS, *RUN)
    assert r.exit_code == 0, r.output
    entries = sorted(folder.iterdir())
    _read_only(monkeypatch, folder)
    with _engine(converted, folder) as e:
        (note,) = e.notes
        assert f"prompt cache: {folder} cannot be written (Read-only file system)" in note and "read-only" in note
        got, stats = _tokens(e, PROMPT)
        assert got == want and stats.restored_tokens == len(PROMPT) - 1  # a hit still serves
        assert _tokens(e, OTHER)[1].prompt_cache_note == ""  # new tokens, nothing saved, nothing said again
        assert _tokens(e, list(range(400, 460)))[1].prompt_cache_note == ""
    assert sorted(folder.iterdir()) == entries
    r = run_cli("run", converted, "--prompt-cache", folder, "--prompt", WORDS, *RUN)
    assert r.exit_code == 0, r.output
    assert len(_notes(r.stderr, "cannot be written")) == 1 and str(folder) in r.stderr
    assert "from the prompt cache" in r.stderr.splitlines()[-1]
    with pytest.raises(ConfigError, match=f"--prompt-cache {folder / 'new'}: the folder cannot be made"):
        _engine(converted, folder / "new")


def test_a_full_disk_leaves_no_temporary_file_and_the_run_says_so(converted, tmp_path, monkeypatch):
    folder = tmp_path / "pc"
    real = os.fsync

    def full(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", full)  # the entry's bytes are written, then the disk says it is full
    r = run_cli("run", converted, "--prompt-cache", folder, "--prompt", WORDS, *RUN)
    assert r.exit_code == 0, r.output
    (note,) = _notes(r.stderr, "prompt cache:")
    assert f"not written in {folder} (No space left on device); free some space there" in note
    assert not list(folder.iterdir())  # no entry, and no temporary file
