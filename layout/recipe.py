"""Cold recipes: the bits each matrix of a cold record keeps (gate w1, up w3, down w2), optionally other bits for
some MoE layers. 4 bits keeps a matrix's e2m1 codes and scales as they are; 2 and 3 narrow it (layout/cold.py).

Text form (`dsfp4 profile-hot --repack --cold-recipe`): `gate=2,up=2,down=3`, then any number of `;LAYERS:SPEC`
overrides, LAYERS a MoE block or a range `A-B` as the manifest numbers them, SPEC naming the matrices it changes
(`all=B` names the three): `gate=2,up=2,down=3;1-2:down=4` keeps down exact in blocks 1 and 2. `--cold-bits N` is
the uniform recipe `all=N`. A layer whose three matrices are all 4 bits is not narrowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsfp4.errors import ConfigError

# a record's matrices, in the order `Bits` lists them
MATRICES = ("w1", "w3", "w2")
# the recipe's names for them
NAMES = {"gate": (0,), "up": (1,), "down": (2,), "all": (0, 1, 2)}
# the bits a matrix of a cold record may keep: 4 is its e2m1 codes unchanged
RECIPE_BITS = (2, 3, 4)
EXACT_BITS = 4
# (gate, up, down)
Bits = tuple[int, int, int]
EXACT: Bits = (EXACT_BITS,) * 3
EXAMPLE = "gate=2,up=2,down=3;1-2:down=4"


def _spec(text: str, base: Bits | None) -> Bits:
    """`gate=2,up=2` -> bits, the matrices it does not name taken from `base` (None: it must name all three)."""
    bits: list[int | None] = list(base) if base else [None] * 3
    for item in text.split(","):
        name, eq, value = item.strip().partition("=")
        if not eq or name not in NAMES:
            raise ConfigError(f"{item.strip()!r} is not MATRIX=BITS (MATRIX one of {', '.join(NAMES)})")
        if value not in tuple(map(str, RECIPE_BITS)):
            raise ConfigError(f"{name} takes 2, 3 or 4 bits (4 keeps it exact), not {value!r}")
        for i in NAMES[name]:
            bits[i] = int(value)
    if None in bits:
        missing = [n for n, (i,) in list(NAMES.items())[:3] if bits[i] is None]
        raise ConfigError(f"the recipe names no bits for {' and '.join(missing)}")
    return tuple(bits)  # type: ignore[return-value]


def _layers(text: str) -> range:
    first, dash, last = text.strip().partition("-")
    if not first.isdigit() or (dash and not last.isdigit()):
        raise ConfigError(f"{text.strip()!r} is not a MoE block N or a range A-B")
    lo, hi = int(first), int(last) if dash else int(first)
    if hi < lo:
        raise ConfigError(f"the range {text.strip()} ends before it starts")
    return range(lo, hi + 1)


@dataclass(frozen=True)
class ColdRecipe:
    """bits: (gate, up, down) of every cold record; layers: (block, bits) where a layer differs, by block."""

    bits: Bits
    layers: tuple[tuple[int, Bits], ...] = ()

    def __post_init__(self) -> None:
        for b in (self.bits, *(bits for _, bits in self.layers)):
            if len(b) != 3 or any(x not in RECIPE_BITS for x in b):
                raise ConfigError(f"a cold recipe keeps 2, 3 or 4 bits for each of gate, up and down, not {b}")
        if not self.narrows:
            raise ConfigError("this cold recipe keeps every matrix at 4 bits: it narrows nothing")

    @classmethod
    def uniform(cls, bits: int) -> ColdRecipe:
        """`--cold-bits N`: every matrix of every cold record at N bits."""
        return cls((bits, bits, bits))

    @classmethod
    def parse(cls, text: str) -> ColdRecipe:
        """The text form (module docstring) -> the recipe; ConfigError says what is wrong in one line."""
        default, *overrides = text.split(";")
        base = _spec(default, None)
        layers: dict[int, Bits] = {}
        for item in overrides:
            where, colon, spec = item.partition(":")
            if not colon:
                raise ConfigError(f"the override {item.strip()!r} is not LAYERS:SPEC")
            for layer in _layers(where):
                if layer in layers:
                    raise ConfigError(f"block {layer} is named by two overrides")
                layers[layer] = _spec(spec, base)
        return cls(base, tuple(sorted((k, v) for k, v in layers.items() if v != base)))

    def of(self, layer: int) -> Bits:
        """The bits of block `layer`'s cold records."""
        return dict(self.layers).get(layer, self.bits)

    @property
    def narrows(self) -> bool:
        """Some layer's cold records are narrower than exact."""
        return any(b != EXACT for b in (self.bits, *(bits for _, bits in self.layers)))

    def check_layers(self, moe: set[int]) -> None:
        """Every override names a block of `moe` (the layers a repack narrows)."""
        if wrong := sorted({layer for layer, _ in self.layers} - moe):
            raise ConfigError(
                f"--cold-recipe overrides block {wrong[0]}, which is not a profiled MoE layer of this model; name "
                f"only {', '.join(map(str, sorted(moe)))}"
            )

    def __str__(self) -> str:
        """The text form, overrides by runs of blocks, each naming only the matrices it changes: parse() reads it."""
        runs: list[list] = []
        for layer, b in self.layers:
            if runs and runs[-1][1] == layer - 1 and runs[-1][2] == b:
                runs[-1][1] = layer
            else:
                runs.append([layer, layer, b])
        out = [_text(self.bits, None)]
        out += [f"{lo}-{hi}:{_text(b, self.bits)}" if hi > lo else f"{lo}:{_text(b, self.bits)}" for lo, hi, b in runs]
        return ";".join(out)


def _text(bits: Bits, base: Bits | None) -> str:
    """`all=B` for three equal widths, else MATRIX=BITS for each that differs from `base` (None: each)."""
    if len(set(bits)) == 1:
        return f"all={bits[0]}"
    names = ("gate", "up", "down")
    return ",".join(f"{n}={b}" for i, (n, b) in enumerate(zip(names, bits, strict=True)) if not base or base[i] != b)


def describe_bits(bits: Bits) -> str:
    """For messages: `2-bit` when the three share a width, else `gate 2, up 2, down 3 bits`."""
    if len(set(bits)) == 1:
        return f"{bits[0]}-bit"
    return ", ".join(f"{n} {b}" for n, b in zip(("gate", "up", "down"), bits, strict=True)) + " bits"


def recipe_of(layers: dict[int, Bits]) -> ColdRecipe:
    """The recipe that gives these layers' cold bits: the most common one (on a tie, the first layer's), and the others
    as overrides."""
    counts: dict[Bits, int] = {}
    for _, bits in sorted(layers.items()):
        counts[bits] = counts.get(bits, 0) + 1
    # max keeps the first of equals: the lowest block's
    base = max(counts, key=counts.__getitem__)
    return ColdRecipe(base, tuple(sorted((k, v) for k, v in layers.items() if v != base)))


def parse_recipe(text: str, flag: str = "--cold-recipe") -> ColdRecipe:
    """ColdRecipe.parse, its error naming `flag` and an example."""
    try:
        return ColdRecipe.parse(text)
    except ConfigError as e:
        raise ConfigError(f"{flag} {text!r}: {e}; e.g. {flag} {EXAMPLE}") from None
