"""GRPO's rollouts: each step, the completions of this rank's prompts sampled from the model
being trained (its current weights: under FSDP the same sharded parameters the step then
updates, never a stale copy), scored by the reward functions, turned into group-relative
advantages and laid out as training rows.

A group (the ``num_generations`` completions of one prompt) is sampled as one batch with a
KV cache, from a generator seeded by the run's seed and the prompt's global index, so the
tokens depend neither on the layout nor on where a run resumed. A completion ends after its
first EOS (included, as TRL trains it) or at ``max_completion_length``. A training row is the
prompt then the completion, right-padded to ``training.seq_len`` (one sequence per row, so
plain causal attention is exact), labels on the completion tokens only. Every data-parallel
rank appends its rollouts (step, prompt index, completion, reward) to
``{dump_folder}/rollouts/dp_rank{r}.jsonl``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.components.policy_loss import group_advantages, varied_groups
from torchtitan.components.rewards import get_reward
from torchtitan.config import ConfigError, GRPOConfig
from torchtitan.data.chat_template import ChatRendering
from torchtitan.data.micro_batch import MicroBatch
from torchtitan.data.prompts import PromptRow, step_prompts
from torchtitan.distributed import ParallelDims
from torchtitan.generation.generate import generate
from torchtitan.layers.loss import IGNORE_INDEX
from torchtitan.protocols.tokenizer import BaseTokenizer

_SEED_STRIDE = 1_000_003
"""Group seed = run seed x this + the prompt's global index (distinct for every prompt)."""


@dataclass
class RolloutStats:
    """This rank's sums over a step's rollouts (reduced over the data ranks at logging)."""

    rewards: float = 0.0
    squared_rewards: float = 0.0
    completions: int = 0
    completion_tokens: int = 0
    kept_groups: int = 0
    groups: int = 0
    seconds: float = 0.0

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        values = [
            self.rewards,
            self.squared_rewards,
            self.completions,
            self.completion_tokens,
            self.kept_groups,
            self.groups,
            self.seconds,
        ]
        return torch.tensor(values, dtype=torch.float64, device=device)


def rollout_metrics(sums: torch.Tensor, ranks: int) -> dict[str, float]:
    """The global batch's rollout metrics from ``RolloutStats`` tensors summed over ranks."""
    rewards, squares, completions, tokens, kept, groups, seconds = sums.tolist()
    mean = rewards / max(completions, 1)
    return {
        "reward": mean,
        "reward_std": max(squares / max(completions, 1) - mean * mean, 0.0) ** 0.5,
        "completion_length": tokens / max(completions, 1),
        "kept_groups": kept / max(groups, 1),
        "rollout_tps": tokens / max(seconds / ranks, 1e-9),
    }


class Rollouts:
    """Samples, scores and lays out one step's rollouts of this data-parallel rank."""

    def __init__(
        self,
        config: GRPOConfig,
        prompts: list[PromptRow],
        tokenizer: BaseTokenizer,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        parallel_dims: ParallelDims,
        device: torch.device,
        seed: int,
        log_folder: Path,
    ) -> None:
        self.config = config
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.prompts_per_step = global_batch_size // config.num_generations
        self.dp_rank, self.dp_degree = _dp_coordinates(parallel_dims)
        self.lockstep = parallel_dims.world_size > 1
        # Sequence parallel cannot split a one-token decoding step: under TP every step
        # re-runs the padded sequence instead of reading a KV cache.
        self.length_multiple = parallel_dims.seq_len_divisor if parallel_dims.tp_enabled else 1
        self.device = device
        self.seed = seed
        self.rewards = [get_reward(name) for name in config.reward_funcs]
        self.weights = config.reward_weights or [1.0] * len(self.rewards)
        self.stop_ids = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
        self.stats = RolloutStats()
        # The tensor-parallel ranks of a data-parallel rank sample the same rollouts: one logs.
        writes = (
            not parallel_dims.tp_enabled or parallel_dims.world_mesh["tp"].get_local_rank() == 0
        )
        self.log_file = log_folder / f"dp_rank{self.dp_rank}.jsonl" if writes else None
        self._records: list[dict[str, Any]] = []
        self._chat: ChatRendering | None = None  # made at the first conversational prompt
        self._check_prompt_lengths()

    def _check_prompt_lengths(self) -> None:
        room = self.seq_len + 1 - self.config.max_completion_length
        for row in self.prompts:
            length = len(self._encode(row))
            if length > room:
                raise ConfigError(
                    f"training.dataset_path: {row.source}: the prompt is {length} tokens; with "
                    f"grpo.max_completion_length={self.config.max_completion_length} a row "
                    f"takes {length + self.config.max_completion_length - 1} positions, more "
                    f"than training.seq_len={self.seq_len}: raise seq_len or shorten the prompt"
                )

    def _encode(self, row: PromptRow) -> list[int]:
        if not row.conversational:
            return self.tokenizer.encode(row.prompt, add_bos=True, add_eos=False)
        if self._chat is None:
            self._chat = ChatRendering(self.tokenizer)
        return self._chat.ids(row.prompt, True, row.source)

    @torch.no_grad()
    def step_batches(self, model: nn.Module, step: int) -> list[MicroBatch]:
        """Step ``step``'s micro-batches of rollout rows (``local_batch_size`` rows each)."""
        start = time.perf_counter()
        self.stats = RolloutStats()
        rows = []
        for index, prompt in step_prompts(
            self.prompts, step, self.prompts_per_step, self.dp_rank, self.dp_degree
        ):
            rows += self._group_rows(model, index, prompt)
        self.stats.seconds = time.perf_counter() - start
        self._write_log(step)
        return [
            _micro_batch(rows[i : i + self.local_batch_size], self.device, self.length_multiple)
            for i in range(0, len(rows), self.local_batch_size)
        ]

    def _group_rows(
        self, model: nn.Module, index: int, prompt: PromptRow
    ) -> list[tuple[list[int], list[int], float]]:
        config = self.config
        prompt_ids = self._encode(prompt)
        batch = torch.tensor([prompt_ids] * config.num_generations, device=self.device)
        tokens = generate(
            model,
            batch,
            max_new_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            seed=self.seed * _SEED_STRIDE + index,
            stop_ids=self.stop_ids,
            stop_early=not self.lockstep,
            use_kv_cache=self.length_multiple == 1,
            length_multiple=self.length_multiple,
        )
        completions = [self._completion(row[len(prompt_ids) :].tolist()) for row in tokens]
        rewards = self._rewards(completions, prompt)
        self._records += [
            {"prompt_index": index, "completion": ids, "reward": float(reward)}
            for ids, reward in zip(completions, rewards)
        ]
        advantages = group_advantages(rewards, config.num_generations, config.scale_rewards)
        kept = bool(varied_groups(rewards, config.num_generations)[0])
        self._count(rewards, completions, kept)
        train = kept or not config.drop_uniform_groups
        return [
            (prompt_ids, completion, float(advantage) if train else None)
            for completion, advantage in zip(completions, advantages)
        ]

    def _write_log(self, step: int) -> None:
        records, self._records = self._records, []
        if self.log_file is None:
            return
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("a") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}) + "\n")

    def _completion(self, ids: list[int]) -> list[int]:
        """The generated ids up to and including the first stop id."""
        for k, token in enumerate(ids):
            if token in self.stop_ids:
                return ids[: k + 1]
        return ids

    def _rewards(self, completions: list[list[int]], prompt: PromptRow) -> torch.Tensor:
        texts = [self.tokenizer.decode(ids) for ids in completions]
        total = torch.zeros(len(texts), dtype=torch.float32)
        for fn, weight in zip(self.rewards, self.weights):
            total += weight * torch.tensor(fn(texts, prompt.row), dtype=torch.float32)
        return total

    def _count(self, rewards: torch.Tensor, completions: list[list[int]], kept: bool) -> None:
        stats = self.stats
        stats.rewards += float(rewards.sum())
        stats.squared_rewards += float((rewards * rewards).sum())
        stats.completions += len(completions)
        stats.completion_tokens += sum(len(ids) for ids in completions)
        stats.kept_groups += int(kept)
        stats.groups += 1


def _dp_coordinates(parallel_dims: ParallelDims) -> tuple[int, int]:
    if not parallel_dims.dp_enabled:
        return 0, 1
    mesh = parallel_dims.world_mesh["dp"]
    return mesh.get_local_rank(), mesh.size()


def _micro_batch(
    rows: list[tuple[list[int], list[int], float | None]],
    device: torch.device,
    length_multiple: int,
) -> MicroBatch:
    """Rows of prompt + completion, right-padded (to a multiple of ``length_multiple``); a
    row without an advantage (a dropped group's) has no labels."""
    longest = max(len(p) + len(c) - 1 for p, c, _ in rows)
    length = longest + -longest % length_multiple
    inputs = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    advantages = torch.zeros(len(rows), dtype=torch.float32)
    for r, (prompt, completion, advantage) in enumerate(rows):
        sequence = prompt + completion
        inputs[r, : len(sequence) - 1] = torch.tensor(sequence[:-1])
        if advantage is not None:
            labels[r, len(prompt) - 1 : len(sequence) - 1] = torch.tensor(completion)
            advantages[r] = advantage
    return MicroBatch(inputs.to(device), labels.to(device), advantages=advantages.to(device))


def reduced_rollout_metrics(
    stats: RolloutStats, parallel_dims: ParallelDims, device: torch.device
) -> dict[str, float]:
    """``rollout_metrics`` over the global batch (one all-reduce, at logging steps)."""
    sums = stats.as_tensor(device)
    ranks = 1
    if parallel_dims.dp_enabled:
        group = parallel_dims.world_mesh["dp"].get_group()
        dist.all_reduce(sums, group=group)
        ranks = dist.get_world_size(group)
    return rollout_metrics(sums, ranks)
