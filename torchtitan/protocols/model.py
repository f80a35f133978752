"""What the trainer expects of a model and of its arguments."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from torchtitan.layers.attention import MaskSpec

if TYPE_CHECKING:
    from torchtitan.config import ModelConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.geometry import Geometry
    from torchtitan.protocols.tokenizer import BaseTokenizer


@dataclass
class BaseModelArgs(ABC):
    """Arguments of one model flavor. Subclasses are plain dataclasses.

    The attention fields come from the job config (``model.attn_type``, ``attn_mask_type``,
    ``sliding_window``); models build their kernels from them with
    ``torchtitan.layers.attention.build_attention(args.attn_type, args.mask_spec)``.
    """

    attn_type: str = "sdpa"
    attn_mask_type: str = "causal"
    sliding_window: int | None = None

    @property
    def mask_spec(self) -> MaskSpec:
        return MaskSpec.from_config(self.attn_mask_type, self.sliding_window)

    def update_from_config(
        self,
        model: ModelConfig,
        *,
        max_seq_len: int,
        tokenizer: BaseTokenizer | None = None,
        moe_force_load_balance: bool = False,
    ) -> None:
        """Adopt run-dependent values: the tokenizer's vocabulary size (when one is given),
        the attention kernel and mask (``model.attn_type``, ``attn_mask_type``,
        ``sliding_window``) and ``max_seq_len`` (the longest sequence of training and
        validation). MoE models also adopt ``moe_force_load_balance``
        (``debug.moe_force_load_balance``) into a fresh ``moe`` (a flavor's own MoEArgs is
        shared by every copy of the flavor). Subclasses without ``vocab_size``/``max_seq_len``
        fields, or with more to adopt, override it."""
        if tokenizer is not None:
            self.vocab_size = tokenizer.vocab_size
        self.attn_type = model.attn_type
        self.attn_mask_type = model.attn_mask_type
        self.sliding_window = model.sliding_window
        self.max_seq_len = max_seq_len
        moe = getattr(self, "moe", None)
        if moe is not None:
            self.moe = replace(moe, force_load_balance=moe_force_load_balance)

    @abstractmethod
    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Return (number of parameters, training FLOPs per token) for MFU."""

    def check_parallelism(self, parallel_dims: ParallelDims) -> None:  # noqa: B027 (optional hook)
        """Raise ConfigError when this model cannot run under ``parallel_dims`` (e.g. heads
        not divisible by the tensor-parallel degree). Called before any process group."""

    def geometry(self) -> Geometry | None:
        """What the blocks hold, for the memory estimator's closed form
        (``protocols/geometry.py``); None: not a decoder the closed form knows (the estimator
        then traces it only)."""
        return None


class ModelProtocol(Protocol):
    """A model built on the meta device from its args, then materialised with
    ``to_empty(device=...)`` and ``init_weights(...)``."""

    def __init__(self, model_args: BaseModelArgs) -> None: ...

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter from a generator seeded by (seed, FQN), so that
        any parallel layout starts from exactly the single-process weights."""

    def init_parameters(self, seed: int, fqns: Collection[str] | None = None) -> None:
        """Initialise only the parameters named by ``fqns`` (all: None), as ``init_weights``
        does; parameters still on meta are skipped."""
