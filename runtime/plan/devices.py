"""A run split across the cards of one box (--devices cuda:0,cuda:1): the names as the flag gives them, the cards
they stand for on this machine, and each card's device budget.

The same card may be named twice (`cuda:0,cuda:0`, `cpu,cpu`): the run takes the whole split path on one device
(tests and one-GPU checks), each name with a budget of its own, which must fit that device together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsfp4.errors import ConfigError
from dsfp4.runtime.plan.budget import Budgets, GiB, default_gpu_budget, default_host_budget, default_sizes
from dsfp4.units import format_bytes

if TYPE_CHECKING:
    import torch

# the fewest cards a split names: one card runs with --device
MIN_CARDS = 2


def parse_devices(names: tuple[str, ...], device: str) -> tuple[str, ...]:
    """--devices as given (one string with commas, or its parts) -> the card names, checked as text: two or more,
    none empty, all CUDA or all the CPU, and not beside --device (`device`, whose default is auto)."""
    if not names:
        return ()
    cards = tuple(n.strip() for part in names for n in part.split(","))
    if any(not n for n in cards):
        raise ConfigError(f"--devices {','.join(names)!r}: an empty name; give cards such as cuda:0,cuda:1")
    if device != "auto":
        raise ConfigError(f"--devices with --device {device}: give the cards with --devices alone")
    if len(cards) < MIN_CARDS:
        raise ConfigError(f"--devices {cards[0]}: a split takes {MIN_CARDS} or more cards; give one with --device")
    kinds = {n.split(":")[0] for n in cards}
    if len(kinds) > 1 or not kinds <= {"cuda", "cpu"}:
        raise ConfigError(f"--devices {','.join(cards)}: give CUDA cards only (cuda:N), or cpu,cpu for tests")
    return cards


def resolve_cards(cards: tuple[str, ...]) -> list[torch.device]:
    """The cards on this machine: a name it lacks is refused in one line."""
    # torch imported here: the command line's help reads this module (through the options)
    from dsfp4.device import resolve_device

    out = []
    for name in cards:
        if name == "cuda":
            raise ConfigError(f"--devices {','.join(cards)}: name each card with its index (cuda:0, cuda:1)")
        try:
            out.append(resolve_device(name))
        except ConfigError as e:
            raise ConfigError(f"--devices {','.join(cards)}: {str(e).removeprefix('--device ')}") from None
    return out


def card_budgets(budgets: Budgets, cards: list[torch.device]) -> Budgets:
    """The split run's budgets resolved: each card's not given shares that device's free memory with the other names
    of it (CUDA: free VRAM less the margin; the CPU: the third of the host a CPU run gives its 'device'); a device named
    more than once must hold its names' budgets together. `gpu` is their sum; `cpu` as one device resolves it."""
    given = budgets.cards or (None,) * len(cards)
    names: dict[str, list[int]] = {}
    for i, card in enumerate(cards):
        names.setdefault(str(card), []).append(i)
    free = {d: _free(cards[idx[0]]) for d, idx in names.items()}
    sizes = list(given)
    for d, idx in names.items():
        open_ = [i for i in idx if sizes[i] is None]
        left = free[d] - sum(sizes[i] for i in idx if sizes[i] is not None)
        for i in open_:
            sizes[i] = max(left // len(open_), 0)
        if len(idx) > 1 and sum(sizes[i] for i in idx) > free[d]:
            asked = " + ".join(format_bytes(sizes[i]) for i in idx)
            raise ConfigError(
                f"--devices names {d} {len(idx)} times: its budgets {asked} do not fit its {format_bytes(free[d])} "
                f"free; give smaller --gpu-mem sizes (one per card, e.g. --gpu-mem {_even(free[d], len(idx))})"
            )
    total = sum(sizes)
    _, cpu = default_sizes(total, budgets.cpu, cards[0]) if cards[0].type == "cpu" else (0, budgets.cpu)
    cpu = default_host_budget() if cpu is None else cpu
    return Budgets(total, cpu, budgets.source, tuple(sizes))


def _free(device: torch.device) -> int:
    """What one device gives a run: CUDA's free VRAM less the margin; the CPU the third of the host its run gives the
    device tier (budget.default_sizes)."""
    return default_gpu_budget(device) if device.type == "cuda" else default_host_budget() // 3


def _even(free: int, n: int) -> str:
    """An even split of `free` for the message, in whole GiB, each size repeated per name."""
    each = max(free // n // GiB, 1)
    return ",".join([f"{each}G"] * n)
