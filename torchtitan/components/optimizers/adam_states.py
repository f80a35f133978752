"""Adam and AdamW with their moments stored in a lower precision (``optimizer.state_dtype``).

Written by hand: torch.optim keeps the moments in the parameter's dtype, and torchao's
low-precision Adam compiles every parameter's step and takes the learning rate as a tensor,
which the LR schedule does not. The update is torch.optim's (same formula, same order of
operations) computed in fp32 from the stored moments, which are rounded to the nearest
``state_dtype`` value when written back; no stochastic rounding: the parameters stay in their
own dtype (fp32 masters), and a moment is an average whose rounding does not accumulate from
step to step. Parameters are stepped one at a time, so the fp32 copies of the moments exist
for one parameter at a time (a foreach step would hold them for all at once, more than the
bf16 states save).
"""

from __future__ import annotations

import math
from typing import Any

import torch


class AdamWithStateDtype(torch.optim.Optimizer):
    """``decoupled``: AdamW's weight decay (else Adam's L2 penalty added to the gradient)."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        decoupled: bool,
        state_dtype: torch.dtype,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.decoupled = decoupled
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, group)
        return loss

    def _state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
        return state

    def _step_one(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self._state(param)
        state["step"] += 1
        step = state["step"].item()  # a CPU tensor: no device sync
        lr, weight_decay, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
        weights = param.float()  # the parameter itself when it is fp32
        grad = param.grad.float()
        if self.decoupled:
            weights.mul_(1 - lr * weight_decay)
        elif weight_decay:
            grad = grad.add(weights, alpha=weight_decay)
        # fp32 copies of bf16 moments (the moments themselves when they are fp32)
        exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        denom = exp_avg_sq.sqrt().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
        weights.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        if weights is not param:
            param.copy_(weights)
