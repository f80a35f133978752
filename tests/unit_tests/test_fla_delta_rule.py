"""fla's fused gated delta rule (layers/fla_delta_rule.py) against the pure PyTorch
chunk_gated_delta_rule on CUDA: the same outputs and q/k/v/g/beta gradients, fp32 and bf16
inputs, one sequence per row and packed documents that cross chunk boundaries (batch 2);
planted errors (decay sign flipped, documents ignored) fail the comparison. The CUDA tests are
gpu-marked and skip without CUDA or without fla (fla-core), the gradient ones also where fla
refuses its backward (Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 and no tilelang); on CPU,
fla is never used."""

from __future__ import annotations

import pytest
import torch

from torchtitan.layers.fla_delta_rule import fla_available, fla_gated_delta_rule
from torchtitan.layers.gated_deltanet import DeltaRule, RecurrentSpec, chunk_gated_delta_rule

BATCH, HEADS, SEQ, K_DIM, V_DIM, CHUNK = 2, 2, 200, 64, 64, 32
# document lengths per row: boundaries inside fla's 64-token chunks and on one (128), a
# one-token document, and documents longer than a chunk
DOCUMENTS = [[50, 100, 50], [128, 1, 71]]
# rms(difference) / rms(reference), outputs and gradients: fla multiplies fp32 in TF32 and bf16
# inputs in bf16 (its per-chunk states too)
TOLERANCE = {"fp32": (5e-3, 1e-2), "bf16": (2e-2, 5e-2), "mixed": (2e-2, 5e-2)}
NAMES = ("out", "q", "k", "v", "g", "beta")


def document_ids(device: torch.device | str) -> torch.Tensor:
    rows = [
        torch.cat([torch.full((n,), i + 3 * row) for i, n in enumerate(lengths)])
        for row, lengths in enumerate(DOCUMENTS)
    ]
    return torch.stack(rows).to(device)


def make_inputs(dtypes: str, device: torch.device | str, seed: int = 0) -> list[torch.Tensor]:
    """Leaves q, k, v, g, beta ``[batch, heads, seq, ...]`` as the mixer hands them over
    (q and k L2-normalised, q scaled, log-decays, beta in (0, 1)). ``dtypes``: fp32 all;
    bf16 q, k and v; mixed: bf16 v only (bf16 training: the mixer's q and k are fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (
        torch.nn.functional.normalize(torch.randn(BATCH, HEADS, SEQ, K_DIM, generator=gen), dim=-1)
        for _ in "qk"
    )
    q = q * K_DIM**-0.5
    v = torch.randn(BATCH, HEADS, SEQ, V_DIM, generator=gen)
    g = -0.2 * torch.rand(BATCH, HEADS, SEQ, generator=gen)
    beta = torch.rand(BATCH, HEADS, SEQ, generator=gen)
    half = {"fp32": (), "bf16": (0, 1, 2), "mixed": (2,)}[dtypes]
    return [
        t.to(device, torch.bfloat16 if i in half else torch.float32).requires_grad_()
        for i, t in enumerate((q, k, v, g, beta))
    ]


def run(rule, inputs: list[torch.Tensor], grads: bool) -> dict[str, torch.Tensor]:
    """``rule(q, k, v, g, beta)``'s output and (``grads``) the inputs' gradients for a fixed
    upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(grads) for t in inputs]
    with torch.set_grad_enabled(grads):
        out = rule(*leaves)
    if not grads:
        return {"out": out}
    upstream = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    (out * upstream).sum().backward()
    return dict(zip(NAMES, [out.detach()] + [t.grad for t in leaves]))


def errors(theirs: dict, ours: dict) -> dict[str, float]:
    """rms(difference) / rms(ours) of each output and gradient (inf where not finite)."""
    result = {}
    for name in theirs:
        a, b = theirs[name].float(), ours[name].float()
        error = ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item()
        result[name] = error if torch.isfinite(a).all() else float("inf")
    return result


def passes(dtypes: str, found: dict[str, float]) -> bool:
    out_tolerance, grad_tolerance = TOLERANCE[dtypes]
    return all(
        error <= (out_tolerance if name == "out" else grad_tolerance)
        for name, error in found.items()
    )


def compare(dtypes: str, packed: bool, grads: bool, planted: str | None = None) -> dict[str, float]:
    """fla against the pure PyTorch rule on the same inputs; ``planted`` plants an error on
    fla's side."""
    docs = document_ids("cuda") if packed else None
    inputs = make_inputs(dtypes, "cuda")

    def fla(q, k, v, g, beta):
        if planted == "decay sign flipped":
            g = -g
        return fla_gated_delta_rule(
            q, k, v, g, beta, None if planted == "documents ignored" else docs
        )

    def pure(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, CHUNK, document_ids=docs)[0]

    theirs, ours = run(fla, inputs, grads), run(pure, inputs, grads)
    assert theirs["out"].dtype == torch.float32 and theirs["out"].shape == ours["out"].shape
    if grads:
        for name, t in zip(NAMES[1:], inputs):
            assert theirs[name].dtype == t.dtype
    assert ours["out"].std() > 1e-3
    return errors(theirs, ours)


def needs_fla(backward: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not fla_available(torch.device("cuda"), backward=False):
        pytest.skip("fla (fla-core) is not installed")
    if backward and not fla_available(torch.device("cuda")):
        pytest.skip("fla refuses its backward here (Hopper GPU, Triton >= 3.4.0 and < 3.7.1)")


@pytest.mark.gpu
@pytest.mark.parametrize("grads", [False, True], ids=["outputs", "gradients"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("dtypes", ["fp32", "bf16", "mixed"])
def test_fla_matches_the_pure_rule(dtypes, packed, grads):
    needs_fla(backward=grads)
    found = compare(dtypes, packed, grads)
    print(f"{dtypes} {'documents' if packed else 'rows'}: {found}")
    assert passes(dtypes, found), (found, TOLERANCE[dtypes])


@pytest.mark.gpu
@pytest.mark.parametrize("grads", [False, True], ids=["outputs", "gradients"])
@pytest.mark.parametrize("planted", ["decay sign flipped", "documents ignored"])
def test_planted_errors_fail_the_comparison(planted, grads):
    needs_fla(backward=grads)
    found = compare("fp32", packed=True, grads=grads, planted=planted)
    print(f"{planted}: {found}")
    assert not passes("fp32", found)


@pytest.mark.gpu
@pytest.mark.parametrize("grads", [False, True], ids=["no_grad", "grad"])
def test_delta_rule_uses_fla_on_cuda(grads):
    """fla where it runs (its backward too when gradients are needed), else the pure rule."""
    needs_fla(backward=False)
    inputs = make_inputs("mixed", "cuda")
    docs = document_ids("cuda")
    rule = DeltaRule(CHUNK, RecurrentSpec(block_causal=True))
    out = run(lambda *x: rule(*x, mask=rule.prepare(docs, x[0].device)), inputs, grads)["out"]
    if grads and not fla_available(torch.device("cuda")):
        expected = run(
            lambda *x: chunk_gated_delta_rule(*x, CHUNK, document_ids=docs)[0], inputs, grads
        )
    else:
        expected = run(lambda *x: fla_gated_delta_rule(*x, docs), inputs, grads)
    torch.testing.assert_close(out, expected["out"], rtol=0, atol=0)


def test_cpu_uses_the_pure_rule():
    assert not fla_available(torch.device("cpu"))
    assert not fla_available(torch.device("cpu"), backward=False)
    inputs = make_inputs("fp32", "cpu")
    docs = document_ids("cpu")
    rule = DeltaRule(CHUNK, RecurrentSpec(block_causal=True))
    for grads in (False, True):
        out = run(lambda *x: rule(*x, mask=rule.prepare(docs, x[0].device)), inputs, grads)
        ref = run(lambda *x: chunk_gated_delta_rule(*x, CHUNK, document_ids=docs)[0], inputs, grads)
        for name in out:
            torch.testing.assert_close(out[name], ref[name], rtol=0, atol=0)
