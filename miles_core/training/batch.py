"""``TrainBatch``: what a rollout hands the trainer (token ids in, token ids and logprobs out, no retokenising)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    reward: float


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    samples: list[TrainSample]

    def __len__(self) -> int:
        return len(self.samples)

    def micro_batches(self, size: int) -> list[TrainBatch]:
        return [TrainBatch(self.samples[i : i + size]) for i in range(0, len(self.samples), size)]

    def tensors(self, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids [B, L]`` and, aligned with the next-token targets ``input_ids[:, 1:]``:
        ``response_mask``, ``rollout_logprobs`` (both ``[B, L-1]``), plus ``advantages [B]``."""
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in self.samples)
        batch = len(self.samples)
        input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, length - 1))
        old = torch.zeros((batch, length - 1))
        for row, sample in enumerate(self.samples):
            sequence = sample.prompt_ids + sample.response_ids
            input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
            start = len(sample.prompt_ids) - 1  # target position of the first response token
            mask[row, start : start + len(sample.response_ids)] = 1
            old[row, start : start + len(sample.response_ids)] = torch.tensor(sample.rollout_logprobs)
        advantages = torch.tensor([s.advantage for s in self.samples], dtype=torch.float32)
        return {"input_ids": input_ids, "response_mask": mask, "rollout_logprobs": old, "advantages": advantages}
