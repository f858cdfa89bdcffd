"""The sampler: distribution, truncation, greedy and seeds (the parts the server tests cannot pin down)."""

from __future__ import annotations

import collections

import torch

from miles_core.engines.sampling import GenerationRequest, SamplingParams, _choose, _Sampler

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def draw(params: SamplingParams, count: int) -> collections.Counter:
    samplers = [_Sampler(GenerationRequest([1], params), set(), seed)
                for seed in range(count)]  # fmt: skip
    tokens, _ = _choose(samplers, list(range(count)), LOGITS.expand(count, -1))
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
    greedy = [_Sampler(GenerationRequest([1], SamplingParams(temperature=0)), set(), 0)]
    tokens, logprobs = _choose(greedy, [0], LOGITS)
    assert tokens == [0] and abs(logprobs[0] - float(torch.log(torch.tensor(0.5)))) < 1e-6
    seeded = SamplingParams(sampling_seed=3)
    runs = [_choose([_Sampler(GenerationRequest([1], seeded), set(), 0)], [0], LOGITS)[0] for _ in range(5)]
    assert all(run == runs[0] for run in runs)
