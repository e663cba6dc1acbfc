"""DeepSeek checkpoints written in the layout of the official Hugging Face releases, at tiny dims.

Used by `dsfp4 demo` (random weights, names from the converter's name map) and by the tests' builder
(tests/fixtures/tiny_checkpoint.py: weights and names from transformers). Layout: sharded safetensors and
model.safetensors.index.json; variant "fp8" stores exactly the tensors DeepSeek quantizes as e4m3 with
fp32 weight_scale_inv (one scale in another shard than its weight), "bf16" stores everything unquantized,
"nvfp4" follows NVIDIA's ModelOpt exports; the MTP layer is model.layers.{n}; a small byte-level BPE
tokenizer and a DeepSeek-style chat template come with it.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from dsfp4.convert.names.family import plain_checkpoint_names
from dsfp4.convert.source.hf_config import from_hf_config
from dsfp4.layout.formats import FORMATS, component_shapes
from dsfp4.layout.fp4 import nvfp4_quantize
from dsfp4.layout.fp8 import fp8_block_quantize
from dsfp4.layout.safetensors_file import SafetensorsWriter
from dsfp4.runtime.generate.answer import tool_markup as mk
from dsfp4.runtime.models.families import model_family
from dsfp4.synthetic.shapes import GENERATION_CONFIG, v3_config

# The tensors DeepSeek's FP8 release quantizes: every attention and MLP projection, MTP block included.
FP8_TENSORS = re.compile(
    r".*\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)
# NVIDIA's R1-FP4-v2 export: MLP projections and o_proj of the main layers; attention and MTP stay BF16.
NVFP4_TENSORS = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.o_proj"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)
NORMS = re.compile(r".*(layernorm|norm)\.weight")
SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>"]
# R1's thinking tags are added tokens but not special ones: decoding keeps them, so the thinking can be split
THINK_TOKENS = ["<think>", "</think>"]
# each family's tool tokens, added after them (the old ids stay): V3's release, V4's DSML token; not special either
TOOL_TOKENS = {"deepseek_v3": list(mk.V3_TOKENS), "deepseek_v4": list(mk.V4_TOKENS)}
# A template of our own in V3-0324 / R1's tool format (tool_markup.py): the tools described after the system
# prompt (describe_v3's text), an assistant's calls as fenced JSON, the results in one outputs block that the next
# turn closes; a prompt that ends with results hands over without <｜Assistant｜>, as R1's does.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', tool=false) -%}"
    "{%- for m in messages if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system ~ ('\\n\\n' if ns.system else '') ~ m['content'] -%}{%- endfor -%}"
    "{%- if tools -%}"
    f"{{%- set ns.system = ns.system ~ '\\n\\n' ~ {json.dumps(mk.TOOLS_HEAD, ensure_ascii=False)} -%}}"
    "{%- for t in tools -%}{%- set f = t['function'] -%}"
    "{%- set ns.system = ns.system ~ '\\n### ' ~ f['name'] ~ '\\nDescription: ' ~ f['description'] | default('')"
    " ~ '\\n\\nParameters: ' ~ (f['parameters'] | default({}) | tojson) ~ '\\n' -%}{%- endfor -%}"
    f"{{%- set ns.system = ns.system ~ {json.dumps(mk.V3_RULES, ensure_ascii=False)} -%}}"
    "{%- endif -%}"
    "{{- bos_token ~ ns.system -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    f"{{{{- ('{mk.OUTPUTS_END}' if ns.tool else '') ~ '<｜User｜>' ~ m['content'] -}}}}{{%- set ns.tool = false -%}}"
    "{%- elif m['role'] == 'assistant' -%}"
    f"{{{{- '{mk.OUTPUTS_END}' if ns.tool else '<｜Assistant｜>' -}}}}{{%- set ns.tool = false -%}}"
    "{{- m['content'] or '' -}}"
    f"{{%- if m['tool_calls'] -%}}{{{{- '{mk.CALLS_BEGIN}' -}}}}"
    "{%- for c in m['tool_calls'] -%}"
    f"{{{{- ('\\n' if not loop.first else '') ~ '{mk.CALL_BEGIN}{mk.CALL_TYPE}{mk.SEP}' ~ c['function']['name']"
    f" ~ '\\n```json\\n' ~ c['function']['arguments'] ~ '\\n```{mk.CALL_END}' -}}}}{{%- endfor -%}}"
    f"{{{{- '{mk.CALLS_END}' -}}}}{{%- endif -%}}"
    "{{- eos_token -}}"
    "{%- elif m['role'] == 'tool' -%}"
    f"{{{{- ('\\n' if ns.tool else '{mk.OUTPUTS_BEGIN}') ~ '{mk.OUTPUT_BEGIN}' ~ m['content'] ~ '{mk.OUTPUT_END}' -}}}}"
    "{%- set ns.tool = true -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    f"{{%- if ns.tool -%}}{{{{- '{mk.OUTPUTS_END}' -}}}}"
    "{%- elif add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)


def stored_tensors(name: str, shape: tuple[int, ...], variant: str, n_layers: int) -> list[tuple]:
    """[(stored name, dtype, shape, format or None)] for one source tensor in this variant."""
    base = name[: -len(".weight")]
    if variant == "fp8" and FP8_TENSORS.fullmatch(name):
        return [
            (name, "F8_E4M3", shape, "fp8"),
            (base + ".weight_scale_inv", "F32", component_shapes(FORMATS["fp8_e4m3_b128"], shape)[1], None),
        ]
    m = NVFP4_TENSORS.fullmatch(name)
    if variant == "nvfp4" and m and int(m.group(1)) < n_layers:
        packed, scale, _ = component_shapes(FORMATS["nvfp4"], shape)
        return [
            (name, "U8", packed, "nvfp4"),
            (base + ".weight_scale", "F8_E4M3", scale, None),
            (base + ".weight_scale_2", "F32", (), None),
            (base + ".input_scale", "F32", (), None),
        ]
    dtype = "F32" if name.endswith(("e_score_correction_bias", "k_scale", "v_scale")) else "BF16"
    return [(name, dtype, shape, None)]


def _encode(name: str, w: torch.Tensor, fmt: str | None, dtype: str, amax: torch.Tensor | None) -> list:
    if fmt == "fp8":
        return list(fp8_block_quantize(w, name))
    if fmt == "nvfp4":
        packed, scale, g = nvfp4_quantize(w, name, amax)
        # input_scale: a stand-in calibration value
        return [packed, scale, g, torch.tensor(0.05)]
    return [w.to(torch.float32 if dtype == "F32" else torch.bfloat16)]


def word_corpus(vocab_size: int, seed: int = 0) -> list[str]:
    """Lines of random lowercase words, enough for a byte-level BPE to learn `vocab_size` tokens: a random model's
    every output id then decodes to text (a full-width bench model's answers carry text for a client to time)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 10, (2 * vocab_size,), generator=g).tolist()
    letters = torch.randint(0, 26, (sum(lengths),), generator=g).tolist()
    words, at = [], 0
    for n in lengths:
        words.append("".join(chr(97 + c) for c in letters[at : at + n]))
        at += n
    return [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]


def write_tokenizer(
    out: Path, vocab_size: int, model_type: str = "deepseek_v3", corpus: Iterable[str] | None = None
) -> None:
    """Train a byte-level BPE of `vocab_size` tokens on `corpus` (default: a few sentences, for tiny models; specials
    first: bos = 0, eos = 1) and write it with its tokenizer_config.json, as the family's release has them: V3's
    template and BOS-adding post-processor; V4-Flash's neither (its prompts are built in code, which writes the BOS
    itself, and add_bos_token is false)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if corpus is None:
        sentences = (
            "the model reads expert weights from disk and computes tokens on one graphics card while",
            "memory holds the hottest experts . def forward ( x ) : return x * 2 + 1 # python code",
            "hello world ! how are you ? 你好 世界 bonjour le monde 12345 67890 { } [ ] < > = - _",
        )
        words = [w for s in sentences for w in s.split()]
        g = torch.Generator().manual_seed(0)
        picks = [torch.randint(0, len(words), (24,), generator=g).tolist() for _ in range(400)]
        corpus = [" ".join(words[j] for j in row) for row in picks]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 40,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS.get(model_type, [])])
    # a release that builds its prompts in code (V4-Flash's) writes the BOS there and ships no template
    bos, in_code = SPECIAL_TOKENS[0], model_family(model_type).prompt_format is not None
    # V4-Flash's tokenizer.json: a plain byte-level post-processor
    if in_code:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        # as DeepSeek-V3's tokenizer.json, whose post-processor puts the BOS first
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
        )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "add_bos_token": not in_code,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[1],
        "model_max_length": 2048,
        "tokenizer_class": "LlamaTokenizerFast",
        "legacy": True,
        "clean_up_tokenization_spaces": False,
        # V4-Flash's release ships no template
        **({} if in_code else {"chat_template": CHAT_TEMPLATE}),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def shard_files(n_shards: int) -> list[str]:
    """The releases' shard names: model-00001-of-000163.safetensors ..."""
    return [f"model-{k + 1:05d}-of-{n_shards:06d}.safetensors" for k in range(n_shards)]


def write_checkpoint_files(
    out: Path, cfg: dict, weight_map: dict[str, str], total_size: int, tokenizer: bool = True
) -> None:
    """What a release holds beside its shards: the index (tensor name -> shard), config.json,
    generation_config.json (the releases' sampling defaults) and a tokenizer (unless the caller wrote its own)."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    if tokenizer:
        write_tokenizer(out, cfg["vocab_size"], cfg["model_type"])


def name_generator(name: str, seed: int) -> torch.Generator:
    """A generator seeded by the tensor's name: its values do not depend on which tensors come before it."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def write_checkpoint(
    out: Path,
    cfg: dict,
    shapes: dict[str, tuple[int, ...]],
    value: Callable[[str], torch.Tensor],
    variant: str = "fp8",
    n_shards: int = 3,
    tokenizer: bool = True,
) -> Path:
    """Write `shapes` (names in the release's naming) with their values in the variant's storage, sharded
    with an index, plus config.json, generation_config.json and a tokenizer (unless `tokenizer` is False: the
    caller wrote its own); returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = cfg["num_hidden_layers"]
    planned = [s for name, shape in shapes.items() for s in stored_tensors(name, shape, variant, n)]
    # Shard by running size, then move the first weight_scale_inv to the last shard so that at least one
    # scale lives apart from its weight, as in the official release.
    sizes = [math.prod(s[2]) for s in planned]
    total, acc, shard_of = sum(sizes), 0, {}
    for (name, *_), size in zip(planned, sizes, strict=True):
        shard_of[name] = min(n_shards - 1, acc * n_shards // total)
        acc += size
    if scales := [p[0] for p in planned if p[0].endswith("weight_scale_inv")]:
        shard_of[scales[0]] = n_shards - 1
    files = shard_files(n_shards)
    writers = [
        SafetensorsWriter(out / f, [(p[0], p[1], p[2]) for p in planned if shard_of[p[0]] == k])
        for k, f in enumerate(files)
    ]
    pair_amax: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        entries = stored_tensors(name, shape, variant, n)
        w = value(name)
        amax = None
        if entries[0][3] == "nvfp4" and (m := re.fullmatch(r"(.*)\.(gate|up)_proj\.weight", name)):
            other = value(f"{m.group(1)}.{'up' if m.group(2) == 'gate' else 'gate'}_proj.weight")
            amax = pair_amax.setdefault(m.group(1), torch.maximum(w.abs().max(), other.abs().max()))
        for (sname, _dtype, _, _), t in zip(entries, _encode(name, w, entries[0][3], entries[0][1], amax), strict=True):
            writers[shard_of[sname]].write(sname, t)
    for w in writers:
        w.close()
    weight_map = {p[0]: files[shard_of[p[0]]] for p in planned}
    write_checkpoint_files(out, cfg, weight_map, sum(w.nbytes - w.data_start for w in writers), tokenizer)
    if variant == "nvfp4":
        excluded = sorted(
            {
                p[0].rsplit(".", 1)[0]
                for p in planned
                if p[1] == "BF16" and ".layers." in p[0] and FP8_TENSORS.fullmatch(p[0])
            }
        )
        (out / "hf_quant_config.json").write_text(
            json.dumps(
                {
                    "producer": {"name": "modelopt", "version": "0.37.0"},
                    "quantization": {
                        "quant_algo": "NVFP4",
                        "kv_cache_quant_algo": "FP8",
                        "group_size": 16,
                        "exclude_modules": ["lm_head", *excluded],
                    },
                },
                indent=2,
            )
        )
    return out


def nvfp4_extras(cfg: dict) -> dict[str, tuple[int, ...]]:
    """NVIDIA's NVFP4 exports carry FP8 KV-cache scales for k_proj/v_proj, modules MLA does not have."""
    return {
        f"model.layers.{b}.self_attn.{p}_proj.{p}_scale": ()
        for b in range(cfg["num_hidden_layers"])
        for p in ("k", "v")
    }


def random_values(shapes: dict[str, tuple[int, ...]], seed: int) -> Callable[[str], torch.Tensor]:
    """Seeded values per name: weights N(0, 0.02), norms near 1 (not exactly, so a skipped norm shows),
    a small router bias, stand-in KV-cache scales."""

    def value(name: str) -> torch.Tensor:
        g = name_generator(name, seed)
        if NORMS.fullmatch(name):
            return 1.0 + 0.05 * torch.randn(shapes[name], generator=g)
        if name.endswith(("k_scale", "v_scale")):
            return torch.tensor(0.02)
        scale = 1e-3 if name.endswith("e_score_correction_bias") else 0.02
        return scale * torch.randn(shapes[name], generator=g)

    return value


def build_synthetic_checkpoint(
    out: Path, dims: dict | None = None, variant: str = "fp8", seed: int = 0, n_shards: int = 3
) -> Path:
    """A checkpoint of random weights with the names the converter expects (no transformers needed)."""
    cfg = v3_config(dims or {}, variant)
    shapes = plain_checkpoint_names(from_hf_config(cfg))
    if variant == "nvfp4":
        shapes.update(nvfp4_extras(cfg))
    return write_checkpoint(out, cfg, shapes, random_values(shapes, seed), variant, n_shards)
