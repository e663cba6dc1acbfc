"""The original model's log-probabilities over a text, in `dsfp4 eval --save-logits`'s format: transformers'
DeepseekV3ForCausalLM (or V2) in float32 on a release folder's weights (FP8 blocks dequantized), over the same
windows `dsfp4 eval` scores, so `dsfp4 eval MODEL --reference OUT` measures what a conversion costs.

    python scripts/reference_logits.py SRC --text FILE --out REF.lp [--context 512] [--stride S] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from dsfp4.convert.family import source_family
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.synthetic.hf_state import read_release, transformers_keys, transformers_state
from dsfp4.tools import logprobs_file
from dsfp4.tools.eval_defaults import DEFAULT_CONTEXT, DEFAULT_TOP_K
from dsfp4.tools.evaluate import evaluate, header, windows


def original_model(src: Path, device: torch.device):
    """The release at `src` as transformers' model in float32 (its MTP layer left out, as transformers has none)."""
    import transformers

    cfg = json.loads((src / "config.json").read_text())
    family = source_family(cfg["model_type"]).transformers
    model = getattr(transformers, family + "ForCausalLM")(
        getattr(transformers, family + "Config")(**transformers_keys(cfg))
    )
    model.float().eval().load_state_dict(transformers_state(read_release(src), cfg), strict=True)
    return model.to(device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="a release folder (FP8 or BF16)")
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT)
    p.add_argument("--stride", type=int)
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    tok = ChatTokenizer(a.src)
    bos = tok.add_bos and tok.bos_id is not None
    ids = tok.encode(a.text.read_text(encoding="utf-8"), special=False)
    wins = windows(len(ids), a.context, a.stride, bos)
    stride = a.stride or a.context - 1
    model = original_model(a.src, device)

    @torch.no_grad()
    def logits_of(tokens: list[int]) -> torch.Tensor:
        return model(torch.tensor([tokens], device=device)).logits[0].float().cpu()  # [T, V]

    with tqdm(total=len(wins), unit="window", file=sys.stderr) as bar:
        r = evaluate(
            logits_of,
            ids,
            wins,
            tok.bos_id if bos else None,
            a.context,
            stride,
            a.top_k,
            None,
            lambda done, _: bar.update(done - bar.n),
        )
    vocab = json.loads((a.src / "config.json").read_text())["vocab_size"]
    logprobs_file.write(a.out, header(vocab, a.context, stride, bos, f"transformers fp32: {a.src}"), r.logprobs)
    print(json.dumps({**r.to_dict(), "out": str(a.out)}))


if __name__ == "__main__":
    main()
