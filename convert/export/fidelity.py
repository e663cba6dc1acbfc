"""What an export passes on is what the conversion wrote, or it says so: damage and cold records.

Damage: every record an export reads is checked against its sha256 in the manifest as `run` checks it on its first
read (layout/record.py's record_sha256), and the backbone's files as `run` hashes them while they load, so a flipped
byte stops the export with the file named instead of going into another engine's checkpoint.

Cold records (profile-hot --repack --cold-bits or --cold-recipe, narrowed in place to 2- or 3-bit codes): an export
widens them back to the model's format, which carries their narrowing loss under a format name that promises the
conversion's exact FP4.
Refused unless asked for with ACCEPT_COLD, and then labelled: COLD_KEY in config.json, or in the GGUF's metadata.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dsfp4.errors import ChecksumError, FormatError
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import record_sha256
from dsfp4.layout.safetensors_file import file_sha256

ACCEPT_COLD = "--accept-cold-loss"
# the label of an export that holds widened cold records
COLD_KEY = "dsfp4_cold_records"
# cold experts named in the refusal, in its first cold layer
NAMED_EXPERTS = 8
# backbone files hashed at once (as verify's readers)
HASH_WORKERS = 4


def cold_experts(manifest: Manifest) -> dict[int, tuple[int, ...]]:
    """Each layer with cold records -> its cold experts."""
    return {layer: ef.cold for layer, ef in sorted(manifest.experts.items()) if ef.cold}


def cold_label(manifest: Manifest, accept: bool, model_dir: Path) -> dict | None:
    """The label an export of a cold-repacked model carries (None: no record is cold); a FormatError naming the cold
    records and the fix unless `accept`."""
    cold = cold_experts(manifest)
    if not cold:
        return None
    n = sum(len(es) for es in cold.values())
    total = sum(len(ef.offsets) for ef in manifest.experts.values())
    recipe = manifest.cold_recipe()
    uniform = not recipe.layers and len(set(recipe.bits)) == 1
    bits = f"{recipe.bits[0]}-bit codes" if uniform else f"codes of the cold recipe {recipe}"
    if not accept:
        first, es = next(iter(cold.items()))
        named = ", ".join(map(str, es[:NAMED_EXPERTS])) + (", ..." if len(es) > NAMED_EXPERTS else "")
        others = len(cold) - 1
        more = f"; and {others} more layer{'s' * (others > 1)}" if others else ""
        raise FormatError(
            f"{model_dir}: {n} of {total} expert records are cold, narrowed to {bits} by profile-hot "
            f"--repack (layer {first}: experts {named}{more}); an export would pass that loss on as the "
            f"conversion's FP4: convert again and export before a --cold-bits or --cold-recipe repack, or add "
            f"{ACCEPT_COLD} to export them widened and labelled as such"
        )
    return {
        "note": f"{n} of {total} routed expert records were narrowed to {bits} (dsfp4 profile-hot --repack) and are "
        f"exported widened to {manifest.record.format}: they carry that loss",
        # one width (what earlier labels said), else the recipe and each layer's (gate, up, down)
        **({"code_bits": recipe.bits[0]} if uniform else {"recipe": str(recipe)}),
        "code_bits_by_layer": {str(b): list(c.code_bits) for b, c in manifest.cold_layouts().items()},
        "stored_bits_per_routed_weight": round(manifest.routed_bits(), 3),
        "records": n,
        "of": total,
        "experts": {str(layer): list(es) for layer, es in cold.items()},
    }


def check_record(raw: torch.Tensor, manifest: Manifest, model_dir: Path, layer: int, e: int) -> torch.Tensor:
    """`raw` (uint8), the stored record of expert e of `layer`, if it matches its sha256 in the manifest; else
    ChecksumError."""
    ef = manifest.experts[layer]
    if record_sha256(memoryview(raw.numpy())) != ef.sha256[e]:
        raise ChecksumError(
            f"{model_dir / ef.file}: the record of expert {e} (layer {layer}) fails its sha256 check; nothing damaged "
            f"is exported: convert again (`dsfp4 verify` checks the whole model)"
        )
    return raw


def check_backbone(model_dir: Path, manifest: Manifest) -> None:
    """Every backbone file at the sha256 the manifest records (the files `run` hashes as it loads); ChecksumError
    naming the first that is not."""
    files = manifest.backbone_files()
    with ThreadPoolExecutor(HASH_WORKERS) as pool:
        digests = pool.map(lambda rel: file_sha256(Path(model_dir) / rel), files)
        for rel, digest in zip(files, digests, strict=True):
            if digest != manifest.files[rel].sha256:
                raise ChecksumError(
                    f"{Path(model_dir) / rel}: sha256 mismatch, the file is damaged; nothing damaged is exported: "
                    f"convert again (`dsfp4 verify` checks the whole model)"
                )
