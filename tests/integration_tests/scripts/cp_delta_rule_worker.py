"""Run by test_context_parallel_delta_rule under torchrun with 4 processes: the context-parallel
Gated DeltaNet kernel (``ContextParallelDeltaRule``: convolution and delta rule) against
``DeltaRule`` on the whole sequence, forward and every input/weight gradient, for cp 2 (two
cp groups of non-adjacent global ranks) and cp 4, load balancers headtail and none, with and
without document ids, and a sequence whose chunks (2 tokens) are shorter than the
convolution's reach and the rule's chunks; then two planted errors (the received state
dropped, the convolution tails dropped) that the same check must catch. Writes
``OUT_DIR/rank{r}.json``: per case, per compared tensor, whether it is within tolerance and
the largest difference."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import torchtitan.distributed.context_parallel.delta_rule as cpl
from torchtitan.distributed.context_parallel.layout import cp_shard
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together
from torchtitan.layers.gated_deltanet import DeltaRule, RecurrentSpec, l2_normalize

BATCH, HEADS, K_DIM, V_DIM, CHANNELS, KERNEL, RULE_CHUNK = 2, 4, 8, 6, 12, 4, 8
RTOL = ATOL = 1e-5
# document lengths: row 0 crosses chunk and rank boundaries; row 1 starts documents exactly
# at chunk starts (16, 32, 56), where the received state and the conv tail must be cut
DOCUMENTS = [[5, 30, 1, 28], [16, 16, 24, 8]]
# a short sequence: cp 4 headtail chunks of 2 tokens, shorter than the conv's reach (3) and
# than the rule's chunks (8, padded)
SHORT_DOCUMENTS = [[3, 2, 11], [4, 1, 2, 9]]


def inputs(seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return {
        "x": randn(BATCH, seq, CHANNELS),
        "weight": randn(CHANNELS, KERNEL) * 0.5,
        "q": l2_normalize(randn(BATCH, HEADS, seq, K_DIM)) * K_DIM**-0.5,
        "k": l2_normalize(randn(BATCH, HEADS, seq, K_DIM)),
        "v": randn(BATCH, HEADS, seq, V_DIM),
        "g": -torch.nn.functional.softplus(randn(BATCH, HEADS, seq)) * 0.3,
        "beta": torch.sigmoid(randn(BATCH, HEADS, seq)),
        # the loss' weights
        "w_conv": randn(BATCH, seq, CHANNELS),
        "w_rule": randn(BATCH, HEADS, seq, V_DIM),
    }


def document_ids(documents: list[list[int]]) -> torch.Tensor:
    rows = [
        torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) for lengths in documents
    ]
    return torch.stack(rows)


SEQ_DIMS = {"x": 1, "q": 2, "k": 2, "v": 2, "g": 2, "beta": 2, "w_conv": 1, "w_rule": 2}
LEAVES = ("x", "weight", "q", "k", "v", "g", "beta")


def run(rule: DeltaRule, data: dict[str, torch.Tensor], docs: torch.Tensor | None):
    """(conv output, rule output, gradients of the leaves) of a weighted-sum loss."""
    leaves = {name: data[name].detach().clone().requires_grad_() for name in LEAVES}
    mask = rule.prepare(docs, torch.device("cpu"))
    conv = rule.conv(leaves["x"], leaves["weight"], mask)
    out = rule(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), mask=mask)
    loss = (conv * data["w_conv"]).sum() + (out * data["w_rule"]).sum()
    loss.backward()
    return conv.detach(), out.detach(), {n: t.grad for n, t in leaves.items()}


def compare(cp_mesh, balancer: str, with_docs: bool, documents=DOCUMENTS) -> dict:
    data = inputs(sum(documents[0]))
    docs = document_ids(documents) if with_docs else None
    spec = RecurrentSpec(block_causal=with_docs)
    ref_conv, ref_out, ref_grads = run(DeltaRule(RULE_CHUNK, spec), data, docs)

    shard = {
        n: cp_shard(t, SEQ_DIMS[n], cp_mesh, balancer) if n in SEQ_DIMS else t
        for n, t in data.items()
    }
    rule = cpl.ContextParallelDeltaRule(cp_mesh, balancer, RULE_CHUNK, spec)
    conv, out, grads = run(rule, shard, docs)
    # every rank holds a partial gradient of the shared conv weight
    dist.all_reduce(grads["weight"], group=cp_mesh.get_group())

    pairs = {
        "conv": (conv, cp_shard(ref_conv, 1, cp_mesh, balancer)),
        "out": (out, cp_shard(ref_out, 2, cp_mesh, balancer)),
        **{
            f"grad_{n}": (
                grads[n],
                cp_shard(ref_grads[n], SEQ_DIMS[n], cp_mesh, balancer)
                if n in SEQ_DIMS
                else ref_grads[n],
            )
            for n in LEAVES
        },
    }
    result = {}
    for name, (got, expected) in pairs.items():
        close = torch.allclose(got, expected, rtol=RTOL, atol=ATOL)
        result[name] = {"close": close, "max_diff": (got - expected).abs().max().item()}
    return result


def main() -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 4
    # cp 2 along the first dim: cp groups {0, 2} and {1, 3}, global != cp ranks
    cp2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp"))["cp"]
    cp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    results = {}
    for cp, mesh in ((2, cp2), (4, cp4)):
        for balancer in ("headtail", "none"):
            for with_docs in (False, True):
                case = f"cp{cp}_{balancer}_{'docs' if with_docs else 'nodocs'}"
                results[case] = compare(mesh, balancer, with_docs)
    results["cp4_headtail_docs_short"] = compare(cp4, "headtail", True, SHORT_DOCUMENTS)

    # planted errors: each must make the comparison fail
    recv = cpl._Chain.recv
    # received, then dropped (an unmatched send could block)
    cpl._Chain.recv = lambda self, like, chunk: recv(self, like, chunk) * 0
    results["planted_dropped_state"] = compare(cp4, "headtail", True)
    cpl._Chain.recv = recv
    contexts = cpl._conv_contexts

    def no_tails(x, kernel, chain):
        return {c: torch.zeros_like(t) for c, t in contexts(x, kernel, chain).items()}

    cpl._conv_contexts = no_tails
    results["planted_dropped_conv_tail"] = compare(cp4, "headtail", True)
    cpl._conv_contexts = contexts

    Path(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    leave_together()


if __name__ == "__main__":
    main()
    exit_skipping_static_destructors(0)
