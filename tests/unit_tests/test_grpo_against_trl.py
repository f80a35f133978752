"""GRPO's loss judged by TRL: for a fixed batch of rollouts (prompts, sampled completions of
different lengths), advantages, old and reference log-probs, TRL's GRPOTrainer (its
``_compute_loss`` on the transformers model) and ours (components/policy_loss.py on the hf
backend's model holding the same weights) give the same loss (1e-6) and the same gradient of
every parameter, for every loss type, with asymmetric clipping and the KL term; and the
group-relative advantages follow TRL's formula."""

from __future__ import annotations

import pytest
import torch

from scripts.hf_compat import build_model, transformers_model, write_folder
from torchtitan.components.policy_loss import (
    GRPOSettings,
    PolicyLoss,
    group_advantages,
    per_token_loss,
    reduced_loss,
    varied_groups,
)
from torchtitan.layers.loss import IGNORE_INDEX, token_logps

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE, PROMPT, COMPLETION = 2, 4, 6, 8
SETTINGS = [
    GRPOSettings(loss_type="grpo", beta=0.04, max_completion_length=COMPLETION),
    GRPOSettings(loss_type="bnpo", max_completion_length=COMPLETION),
    GRPOSettings(
        loss_type="dr_grpo",
        beta=0.04,
        use_bias_correction_kl=False,
        max_completion_length=COMPLETION,
    ),
    GRPOSettings(loss_type="dapo", epsilon_high=0.28, beta=0.04, max_completion_length=COMPLETION),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("grpo"), "llama")


def rollouts() -> dict[str, torch.Tensor]:
    """Fixed rollouts: every completion has its own length (right padding), old log-probs
    off the current ones by up to ±0.5 so that both clip bounds bind, rewards per group."""
    g = torch.Generator().manual_seed(0)
    n = GROUPS * GROUP_SIZE
    prompts = torch.randint(3, 300, (GROUPS, PROMPT), generator=g).repeat_interleave(GROUP_SIZE, 0)
    completions = torch.randint(3, 300, (n, COMPLETION), generator=g)
    lengths = torch.tensor([8, 3, 5, 8, 1, 6, 7, 2])
    mask = (torch.arange(COMPLETION) < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0])
    return {
        "prompt_ids": prompts,
        "completion_ids": completions,
        "completion_mask": mask,
        "advantages": group_advantages(rewards, GROUP_SIZE, "group"),
        "old_shift": (torch.rand(n, COMPLETION, generator=g) - 0.5),
        "ref_shift": (torch.rand(n, COMPLETION, generator=g) - 0.5) * 0.2,
    }


def completion_logps(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p of each completion token ``[n, COMPLETION]`` from logits over prompt + completion."""
    tokens = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    labels = tokens[:, 1:].clone()
    labels[:, : PROMPT - 1] = IGNORE_INDEX
    return token_logps(logits[:, :-1], labels)[:, PROMPT - 1 :]


def trl_loss_and_grads(
    folder, model, batch, settings: GRPOSettings, tmp_path, temperature=1.0, old=True
):
    """TRL's loss on ``batch`` (``old``: with the shifted old log-probs, else TRL takes the
    current ones detached, as one update per batch of rollouts does)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=settings.beta,
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        loss_type=settings.loss_type,
        max_completion_length=settings.max_completion_length,
        use_bias_correction_kl=settings.use_bias_correction_kl,
        num_generations=GROUP_SIZE,
        per_device_train_batch_size=GROUPS * GROUP_SIZE,
        temperature=temperature,
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; the comparison is in fp32
    )
    # With beta != 0 TRL loads a reference from the model's folder (unused here: the batch
    # carries the reference's log-probs).
    model.save_pretrained(tmp_path / "policy")
    model.config._name_or_path = str(tmp_path / "policy")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * GROUP_SIZE),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop: one step
    with torch.no_grad():
        tokens = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        current = completion_logps(model(tokens).logits / temperature, batch)
    inputs = {
        "prompt_ids": batch["prompt_ids"],
        "prompt_mask": torch.ones_like(batch["prompt_ids"]),
        "completion_ids": batch["completion_ids"],
        "completion_mask": batch["completion_mask"],
        "advantages": batch["advantages"],
        "ref_per_token_logps": current + batch["ref_shift"],
        "num_items_in_batch": batch["completion_mask"].sum(),
    }
    if old:
        inputs["old_per_token_logps"] = current + batch["old_shift"]
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def our_loss_and_grads(model, batch, settings: GRPOSettings):
    tokens = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    logps = completion_logps(model(tokens), batch)
    current = logps.detach()
    token_loss = per_token_loss(
        logps,
        current + batch["old_shift"],
        batch["advantages"],
        settings,
        ref_logps=current + batch["ref_shift"],
    )
    mask = batch["completion_mask"]
    loss = reduced_loss(token_loss, mask, settings, mask.sum(), mask.shape[0])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("settings", SETTINGS, ids=[s.loss_type for s in SETTINGS])
def test_loss_and_gradients_equal_trls(folder, settings, tmp_path):
    ours_model = build_model(folder).train()
    theirs_model = transformers_model(folder, ours_model).train()
    batch = rollouts()
    theirs, their_grads = trl_loss_and_grads(folder, theirs_model, batch, settings, tmp_path)
    ours, our_grads = our_loss_and_grads(ours_model, batch, settings)
    # advantages sum to 0 in a group, so the loss (~0.03) is a difference of token terms of
    # size ~0.1-1: 1e-6 relative, or 1e-7 absolute (1e-6 of those terms)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("settings", SETTINGS, ids=[s.loss_type for s in SETTINGS])
def test_the_training_loss_on_rollout_rows_equals_trls(folder, settings, tmp_path):
    """``PolicyLoss`` as a step uses it: rows of prompt + completion with labels on the
    completion, the old log-probs the current ones, logits at the sampling temperature."""
    ours_model = build_model(folder).train()
    theirs_model = transformers_model(folder, ours_model).train()
    batch = rollouts()
    theirs, their_grads = trl_loss_and_grads(
        folder, theirs_model, batch, settings, tmp_path, temperature=0.7, old=False
    )
    tokens = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    labels = tokens[:, 1:].clone()
    labels[:, : PROMPT - 1] = IGNORE_INDEX
    labels[:, PROMPT - 1 :][batch["completion_mask"] == 0] = IGNORE_INDEX
    policy = PolicyLoss(settings, temperature=0.7)
    policy.set_global_counts((labels != IGNORE_INDEX).sum(), torch.tensor(len(labels)), 1)
    logits = ours_model(tokens)[:, :-1]
    with torch.no_grad():
        ref = policy.logps(logits, labels)
    ref[:, PROMPT - 1 :] += batch["ref_shift"] * batch["completion_mask"]
    ours = policy(logits, labels, batch["advantages"], ref)
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs, rtol=1e-6, atol=1e-7)
    for name, param in ours_model.named_parameters():
        torch.testing.assert_close(param.grad, their_grads[name], rtol=1e-4, atol=1e-6)


def test_a_clip_on_the_wrong_side_fails_the_comparison(folder, tmp_path):
    """Planted error: ε_high applied below and ε_low above moves the DAPO loss off TRL's."""
    settings = SETTINGS[-1]
    swapped = GRPOSettings(
        loss_type="dapo",
        epsilon=settings.clip_high,
        epsilon_high=settings.epsilon,
        beta=settings.beta,
        max_completion_length=COMPLETION,
    )
    ours_model = build_model(folder).train()
    theirs_model = transformers_model(folder, ours_model).train()
    batch = rollouts()
    theirs, _ = trl_loss_and_grads(folder, theirs_model, batch, settings, tmp_path)
    ours, _ = our_loss_and_grads(ours_model, batch, swapped)
    assert not torch.isclose(ours, theirs, rtol=1e-4)


def test_group_advantages_are_centred_and_scaled_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    advantages = group_advantages(rewards, 4, "group")
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as TRL's nanstd
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    torch.testing.assert_close(advantages[:4], expected)
    assert advantages[4:].tolist() == [0.0] * 4
    assert varied_groups(rewards, 4).tolist() == [True, False]
    torch.testing.assert_close(
        group_advantages(rewards, 4, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    )
