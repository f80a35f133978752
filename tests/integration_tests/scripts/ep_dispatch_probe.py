"""Run under torchrun (gloo): expert-parallel dispatch and combine with uneven routing (some
experts get no tokens from anyone, some from only a few ranks). Checks that dispatch
delivers exactly the expected rows in local-expert order, that combine returns every token
to its source slot bit-exactly, and that gradients flow back through both all-to-alls.
Writes {OUT_DIR}/rank{r}.txt with "ok" or the first failure."""

import os

import torch
import torch.distributed as dist

from torchtitan.distributed.expert_parallel import combine, dispatch
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together

EXPERTS, DIM = 8, 3


def routing(rank: int) -> torch.Tensor:
    """Tokens per global expert sent by ``rank``: expert 2 gets none from anyone, expert 5
    only from rank 0, the rest vary by rank (including zeros)."""
    counts = torch.tensor([(rank + e) % 3 for e in range(EXPERTS)])
    counts[2] = 0
    counts[5] = 4 if rank == 0 else 0
    return counts


def tokens_of(rank: int) -> torch.Tensor:
    """Rows identifiable by (source rank, row): value rank * 1000 + row in every column."""
    n = int(routing(rank).sum())
    return (rank * 1000 + torch.arange(n, dtype=torch.float32)).unsqueeze(1).repeat(1, DIM)


def expected_local(rank: int, world: int) -> tuple[torch.Tensor, list[int]]:
    local = EXPERTS // world
    rows, counts = [], []
    for e in range(rank * local, (rank + 1) * local):
        n = 0
        for src in range(world):
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), routing(src).cumsum(0)])
            rows.append(tokens_of(src)[offsets[e] : offsets[e + 1]])
            n += int(routing(src)[e])
        counts.append(n)
    return torch.cat(rows), counts


def check() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    x = tokens_of(rank).requires_grad_()
    local, local_counts, route = dispatch(x, routing(rank), group)
    want_rows, want_counts = expected_local(rank, world)
    if local_counts.tolist() != want_counts:
        return f"local counts {local_counts.tolist()} != {want_counts}"
    if not torch.equal(local.detach(), want_rows):
        return "dispatched rows differ from the expected local-expert order"
    # Scale every row by its local expert's index + 1, send back, check values and grads.
    scale = torch.repeat_interleave(
        torch.arange(1.0, len(want_counts) + 1), local_counts
    ).unsqueeze(1)
    back = combine(local * scale, route, group)
    expert_of_row = torch.repeat_interleave(torch.arange(EXPERTS), routing(rank))
    row_scale = (expert_of_row % (EXPERTS // world) + 1).float().unsqueeze(1)
    if not torch.equal(back.detach(), x.detach() * row_scale):
        return "combine did not return each token to its slot"
    back.sum().backward()
    if not torch.equal(x.grad, row_scale.expand_as(x)):
        return "gradients through dispatch/combine are wrong"
    return "ok"


def main() -> None:
    dist.init_process_group("gloo")
    result = check()
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(result)
    leave_together()


if __name__ == "__main__":
    main()
    exit_skipping_static_destructors(0)
