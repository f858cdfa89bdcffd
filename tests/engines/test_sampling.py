"""The sampler: distribution, truncation, greedy and seeds (the parts the server tests cannot pin down)."""

from __future__ import annotations

import collections
import math

import pydantic
import pytest
import torch
import transformers

from miles_core.builtin.local_engine.batch_generation import generate_batch
from miles_core.builtin.local_engine.sampling import (
    MIN_TEMPERATURE,
    GenerationRequest,
    Sampler,
    SamplingParams,
    choose_tokens,
)
from miles_core.testkit.tiny_models import tiny_llama_config

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def draw(params: SamplingParams, count: int) -> collections.Counter:
    samplers = [Sampler(GenerationRequest([1], params), set(), seed) for seed in range(count)]
    tokens, _ = choose_tokens(samplers, list(range(count)), LOGITS.expand(count, -1))
    return collections.Counter(tokens)


def test_samples_follow_the_distribution() -> None:
    counts = draw(SamplingParams(), 8000)
    for token, probability in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(counts[token] / 8000 - probability) < 0.02, counts


def test_top_k_and_top_p_truncate() -> None:
    assert set(draw(SamplingParams(top_k=2), 2000)) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.7), 2000)) == {0, 1}  # 0.5 + 0.3 crosses 0.7
    assert set(draw(SamplingParams(top_p=0.4), 2000)) == {0}


def test_greedy_and_logprobs_and_seeds() -> None:
    greedy = [Sampler(GenerationRequest([1], SamplingParams(temperature=0)), set(), 0)]
    tokens, logprobs = choose_tokens(greedy, [0], LOGITS)
    assert tokens == [0] and abs(logprobs[0] - float(torch.log(torch.tensor(0.5)))) < 1e-6
    seeded = SamplingParams(sampling_seed=3)
    runs = [choose_tokens([Sampler(GenerationRequest([1], seeded), set(), 0)], [0], LOGITS)[0] for _ in range(5)]
    assert all(run == runs[0] for run in runs)


def test_a_temperature_below_the_minimum_is_greedy_with_finite_logprobs() -> None:
    """Dividing logits by 1e-30 overflows float32 (NaN logprobs); such temperatures sample greedily instead."""
    logits = torch.tensor([[40.0, 39.0, -30.0, 10.0]])
    for temperature in (1e-45, 1e-30, 1e-12, MIN_TEMPERATURE / 2):
        sampler = Sampler(GenerationRequest([1], SamplingParams(temperature=temperature)), set(), 0)
        tokens, logprobs = choose_tokens([sampler], [0], logits)
        assert tokens == [0] and math.isfinite(logprobs[0]) and logprobs[0] <= 0, (temperature, logprobs)
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": math.inf},
        {"temperature": math.nan},
        {"top_p": math.nan},
        {"temperature": "0.5"},
        {"temperature": True},
        {"max_new_tokens": 2.0},
        {"sampling_seed": -1},
        {"sampling_seed": 2**63},
        {"stop_token_ids": [1] * 2000},
    ],
)
def test_sampling_params_refuse_non_finite_and_out_of_range_values(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        SamplingParams.model_validate(bad)


def test_a_cancelled_request_leaves_its_batch_and_the_others_run_on() -> None:
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    keep, drop = GenerationRequest([3, 4], params), GenerationRequest([5], params)
    drop.cancel.set()
    kept, dropped = generate_batch(model, [keep, drop])
    assert len(kept.output_ids) == 5 and kept.finish_reason == {"type": "length", "length": 5}
    assert dropped.output_ids == [] and dropped.finish_reason["type"] == "abort"


def greedy_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).eval()


def letters(ids: list[int]) -> str:
    """A decoder for the tests: token t is the letter ``t % 26``."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_every_token_is_reported_as_it_is_sampled_with_its_alternatives() -> None:
    seen: list[tuple[int, float, list]] = []
    request = GenerationRequest(
        [3, 4],
        SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
        top_logprobs_num=3,
        on_token=lambda t, lp, top: seen.append((t, lp, top)),
    )
    (result,) = generate_batch(greedy_model(), [request])
    assert [t for t, _, _ in seen] == result.output_ids and [lp for _, lp, _ in seen] == result.logprobs
    assert [top for _, _, top in seen] == result.top_logprobs and len(result.top_logprobs) == 6
    for token, logprob, top in zip(result.output_ids, result.logprobs, result.top_logprobs, strict=True):
        assert len(top) == 3 and [lp for lp, _ in top] == sorted((lp for lp, _ in top), reverse=True)
        assert top[0] == (logprob, token)  # greedy: the chosen token is the most likely one


def test_the_alternatives_are_the_distributions_top_k() -> None:
    sampler = Sampler(GenerationRequest([1], SamplingParams(temperature=0.5), top_logprobs_num=2), set(), 0)
    choose_tokens([sampler], [0], LOGITS)
    expected = torch.log_softmax(LOGITS[0] / 0.5, dim=-1)
    assert sampler.top_logprobs == [[(pytest.approx(expected[0].item()), 0), (pytest.approx(expected[1].item()), 1)]]


def test_a_stop_string_ends_the_request_at_the_token_that_completes_it() -> None:
    model = greedy_model()
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    (free,) = generate_batch(model, [GenerationRequest([5, 6], params)], decode=letters)
    text = letters(free.output_ids)
    stop = text[4:6]
    first = text.index(stop)
    stopped_params = params.model_copy(update={"stop": [stop, "zzzzzzzz"]})
    (stopped,) = generate_batch(model, [GenerationRequest([5, 6], stopped_params)], decode=letters)
    assert stopped.output_ids == free.output_ids[: first + len(stop)]
    assert stopped.finish_reason == {"type": "stop", "matched": stop}


def test_stop_strings_need_a_decoder() -> None:
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate_batch(greedy_model(), [GenerationRequest([5], SamplingParams(stop="x"))])


@pytest.mark.parametrize("stop", [[""], ["x"] * 17, [5], "y" * 257])
def test_bad_stop_strings_are_refused(stop: object) -> None:
    with pytest.raises(pydantic.ValidationError):
        SamplingParams.model_validate({"stop": stop})


def test_a_single_stop_string_is_a_list_of_one() -> None:
    assert SamplingParams.model_validate({"stop": "end"}).stop == ["end"]
