"""What a sequence does to its logits, as pure functions: the penalties as OpenAI and CTRL define them, min-p,
log-probabilities and their alternatives (a generation's and a prompt's), the options' ranges."""

from __future__ import annotations

import math

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.logits_rules import TokenRules, penalize, rules_for
from dsfp4.runtime.generate.logprobs import prompt_logprobs, token_logprob
from dsfp4.runtime.generate.sampling import distribution, sample
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.options import RunOptions

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])


def _state(generated: list[int], prompt: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=5).float()
    seen = counts > 0
    seen[list(prompt)] = True
    return counts, seen


def test_presence_and_frequency_penalties_subtract_once_and_per_count_over_generated_tokens():
    counts, seen = _state([0, 0, 3], prompt=[1])
    got = penalize(LOGITS, counts, seen, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    # token 0 twice, token 3 once; token 1 only in the prompt is not penalized
    assert got.tolist() == pytest.approx([2.0 - 0.5 - 0.5, -1.0, 0.5, 3.0 - 0.5 - 0.25, -2.0])
    negative = penalize(LOGITS, counts, seen, SamplingParams(presence_penalty=-1.0))
    assert negative[0] == pytest.approx(3.0) and negative[1] == -1.0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_generated_tokens():
    counts, seen = _state([3], prompt=[1, 2])
    got = penalize(LOGITS, counts, seen, SamplingParams(repetition_penalty=2.0))
    assert got.tolist() == pytest.approx([2.0, -2.0, 0.25, 1.5, -2.0])
    # below 1 it favours them
    assert penalize(LOGITS, counts, seen, SamplingParams(repetition_penalty=0.5))[3] == pytest.approx(6.0)


def test_neutral_penalties_leave_the_logits_and_make_no_rules():
    counts, seen = _state([0, 3], prompt=[1])
    assert torch.equal(penalize(LOGITS, counts, seen, SamplingParams()), LOGITS)
    assert not SamplingParams().penalized
    assert rules_for(RunOptions(), [1, 2], None) is None


def test_min_p_leaves_out_tokens_below_its_share_of_the_top_probability_after_temperature():
    p = SamplingParams(temperature=1.0, top_p=1.0, min_p=0.3)
    probs = distribution(LOGITS, p)
    full = LOGITS.softmax(-1)
    kept = full >= 0.3 * full.max()
    assert torch.equal(probs > 0, kept)
    assert torch.allclose(probs[kept], full[kept] / full[kept].sum())
    # a higher temperature flattens the distribution: more tokens pass the same share
    hot = distribution(LOGITS, SamplingParams(temperature=3.0, top_p=1.0, min_p=0.3))
    assert (hot > 0).sum() > kept.sum()
    assert torch.equal(distribution(LOGITS, SamplingParams(1.0, top_p=1.0, min_p=0.0)), full)
    assert int(sample(LOGITS, SamplingParams(1.0, min_p=1.0), torch.Generator().manual_seed(0))) == 3


def test_token_logprob_is_the_log_softmax_with_sorted_alternatives():
    entry = token_logprob(LOGITS, 2, top=3)
    logp = LOGITS.log_softmax(-1)
    assert entry.token == 2 and entry.logprob == pytest.approx(float(logp[2]))
    assert [t for t, _ in entry.top] == [3, 0, 2]
    values = [v for _, v in entry.top]
    assert values == sorted(values, reverse=True) and values[0] == pytest.approx(float(logp[3]))
    assert token_logprob(LOGITS, 2, top=0).top == ()
    # a refused token (-inf) is no alternative: JSON cannot carry it
    masked = LOGITS.masked_fill(torch.tensor([False, True, True, False, True]), float("-inf"))
    assert [t for t, _ in token_logprob(masked, 3, top=5).top] == [3, 0]


def test_rules_report_logprobs_under_the_penalized_logits_and_count_what_they_accept():
    sampling = SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=2)
    rules = TokenRules(sampling, prompt_ids=[4])
    picked = [rules.pick(LOGITS, None) for _ in range(3)]
    # the penalty moves greedy decoding off a token once it repeats: 3, then 0 (3 at 1.0 < 2.0), then 3 again
    assert picked == [3, 0, 3]
    second = LOGITS - 2.0 * torch.tensor([0.0, 0, 0, 1, 0])
    assert rules.logprobs[1].logprob == pytest.approx(float(second.log_softmax(-1)[0]))
    assert [t for t, _ in rules.logprobs[1].top] == [0, 3]
    assert rules.counts.tolist() == [1, 0, 0, 2, 0]


def test_prompt_logprobs_score_each_token_under_the_logits_before_it():
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    ids = [1, 4, 0, 2]
    got = prompt_logprobs(logits, ids, top=2)
    assert got[0] is None and len(got) == 4
    logp = logits.log_softmax(-1)
    for i in range(1, 4):
        assert got[i].token == ids[i] and got[i].logprob == pytest.approx(float(logp[i - 1, ids[i]]))
        assert [t for t, _ in got[i].top] == logp[i - 1].topk(2).indices.tolist()


def test_openai_logprob_entries_carry_text_bytes_and_alternatives():
    entry = token_logprob(LOGITS, 3, top=2)
    out = entry.to_openai(lambda t: "é" if t == 3 else f"t{t}")
    assert out["token"] == "é" and out["bytes"] == [0xC3, 0xA9] and math.isclose(out["logprob"], entry.logprob)
    assert [a["token"] for a in out["top_logprobs"]] == ["é", "t0"]


@pytest.mark.parametrize(
    ("knobs", "needle"),
    [
        ({"presence_penalty": 2.5}, "--presence-penalty 2.5: give a penalty from -2 to 2"),
        ({"frequency_penalty": -3}, "--frequency-penalty -3"),
        ({"repetition_penalty": 0.0}, "--repetition-penalty 0.0: give more than 0"),
        ({"min_p": 1.5}, "--min-p 1.5: give a share from 0"),
        ({"logprobs": 21}, "--logprobs 21: give 0 to 20"),
        ({"grammar": {"type": "json_object"}}, "option grammar: expected a Grammar"),
    ],
)
def test_bad_sampling_values_name_the_field_and_its_range(knobs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        RunOptions(**knobs)
