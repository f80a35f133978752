"""What the closed form takes besides the model's geometry: the parallel layout and the run
(batch, dtypes, optimizer, loss, pipeline schedule, adapters)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ac: str = "none"  # "none" | "full" | "selective:N" | "selective:op"
    ep: int = 1  # expert parallel (borrows ranks of dp_shard x cp)
    etp: int = 1  # expert tensor parallel (1 or tp)

    @property
    def fsdp(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def describe(self) -> str:
        parts = [
            f"{n}={v}"
            for n, v in (
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("cp", self.cp),
                ("tp", self.tp),
                ("pp", self.pp),
                ("ep", self.ep),
                ("etp", self.etp),
            )
            if v > 1
        ]
        return " ".join(parts or ["single device"]) + f", AC {self.ac}"


@dataclass(frozen=True)
class LoRA:
    """Rank-``rank`` adapters on the linears named in ``adapted`` (leaf names, the same in
    every block, and "output") of a frozen base: only adapters get gradients and optimizer
    states, a frozen linear keeps no input for backward, an adapter keeps its [tokens, rank]
    middle (dropout 0). Dense decoders only (no MoE, no latent attention). ``nf4``: the
    adapted linears' base weights are stored as NF4 (QLoRA)."""

    rank: int
    adapted: frozenset[str]
    nf4: bool = False

    def keeps_input(self, names: tuple[str, ...]) -> bool:
        return bool(self.adapted.intersection(names))


@dataclass(frozen=True)
class Run:
    seq_len: int
    local_batch: int
    grad_accum: int = 1
    param_bytes: int = 2  # FSDP compute dtype (or autocast dtype without FSDP)
    foreach_optimizer: bool = False
    loss_parallel: bool = True
    target: str = "cuda"
    pp_microbatch: int = 1
    pp_all_in_flight: bool = (
        False  # GPipe, LoopedBFS: every micro-batch's forward before any backward
    )
    cp_rotate: str = "allgather"  # ParallelDims.cp_rotate_method
    cp_headtail: bool = True  # ParallelDims.cp_load_balancer == "headtail"
    ac_keeps_attention: bool = False  # distributed.activation_checkpoint.keeps_attention_output
    lora: LoRA | None = None  # adapters on a frozen base (converter lora)
    loss_chunk: int = 0  # training.loss_chunk_size as it applies (0: full logits; -1: auto)
    muon_ns_bytes: int = 0  # Muon: bytes per value of its Newton-Schulz iteration (0: AdamW)
    state_bytes: int = 4  # bytes per value of Adam's moments (optimizer.state_dtype)
    float8: bool = False  # float8 linears (converter float8): not modelled, traced only

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per local batch."""
        return max(1, self.local_batch // self.pp_microbatch)
