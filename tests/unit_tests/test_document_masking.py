"""Document-masked (block-causal) and windowed attention: the block-by-block kernel against a
dense reference, and the model-level reference check (a packed batch of documents gives the
logits and parameter gradients of running each document alone)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.launcher import run_command
from tests.layouts import single_process_dims
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.data.micro_batch import MicroBatch, model_inputs
from torchtitan.layers.attention import FlexAttention, MaskSpec, document_positions, prepare_mask
from torchtitan.layers.blockwise_attention import blockwise_attention, build_block_plan, visible
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer

DOC_LENGTHS = [[5, 17, 3, 7], [32]]  # two samples of 32 tokens: four documents, then one


def _document_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.cat([torch.full((n,), i) for i, n in enumerate(sample)]) for sample in lengths]
    )


def dense_mask(q, document_ids, window) -> torch.Tensor:
    """The ``[batch or 1, 1, seq, seq]`` bool mask of :func:`visible` for ``q``'s sequence."""
    pos = torch.arange(q.shape[2], device=q.device)
    docs = document_ids
    mask = visible(
        pos[:, None],
        pos[None, :],
        None if docs is None else docs[:, :, None],
        None if docs is None else docs[:, None, :],
        window,
    )
    return mask.unsqueeze(1) if mask.dim() == 3 else mask


def _dense_reference(q, k, v, document_ids, window):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(q, document_ids, window))


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-6)]
)  # math / fused blocks
@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block", [4, 8, 32])
def test_blockwise_attention_matches_a_dense_mask(documents, window, block, dtype, tol):
    torch.manual_seed(0)
    document_ids = _document_ids(DOC_LENGTHS) if documents else None
    q, k, v = (torch.randn(2, 3, 32, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    chunks = list(range(32 // block))
    plan = build_block_plan(chunks, chunks, block, document_ids, window)
    out = blockwise_attention(q, k, v, plan, chunks, chunks, 8**-0.5)
    grads = torch.autograd.grad((out * out.detach().sin()).sum(), (q, k, v))
    ref = _dense_reference(q, k, v, document_ids, window)
    ref_grads = torch.autograd.grad((ref * ref.detach().sin()).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


def test_block_plan_skips_blocks_with_nothing_visible():
    document_ids = _document_ids([[8, 8, 8, 8]])
    chunks = [0, 1, 2, 3]
    plan = build_block_plan(chunks, chunks, 8, document_ids, None)
    assert set(plan.blocks) == {(0, 0), (1, 1), (2, 2), (3, 3)}  # one document per chunk
    windowed = build_block_plan(chunks, chunks, 8, None, 8)
    assert set(windowed.blocks) == {(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3)}
    full = build_block_plan(chunks, chunks, 8, None, None)
    assert full.blocks[(3, 0)] is None and full.blocks[(1, 1)] is not None


def test_document_positions_restart_at_every_document():
    ids = _document_ids([[2, 3, 1]])
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0]]


def _tiny_model(mask_type: str, window: int | None = None) -> Transformer:
    args = replace(
        llama3_flavors["debugmodel_tiny"],
        attn_type="flex",
        attn_mask_type=mask_type,
        sliding_window=window,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=3)
    return model.double()


def _packed_vs_alone(document_ids: torch.Tensor, plant_error: bool = False):
    """(logits and grads of the packed batch, the same for every document alone)."""
    model = _tiny_model("block_causal")
    tokens = torch.randint(0, model.model_args.vocab_size, document_ids.shape)
    weight = torch.randn(*document_ids.shape, model.model_args.vocab_size, dtype=torch.float64)
    mask_ids = document_ids
    if plant_error:  # every boundary one token late
        mask_ids = torch.cat([document_ids[:, :1], document_ids[:, :-1]], dim=1)
    packed = model(tokens, document_ids=mask_ids)
    (packed * weight).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = torch.empty_like(packed)
    for b in range(document_ids.shape[0]):
        for doc in document_ids[b].unique():
            span = (document_ids[b] == doc).nonzero().flatten()
            logits = model(tokens[b : b + 1, span])  # causal: one document, no document ids
            (logits * weight[b : b + 1, span]).sum().backward()
            alone[b, span] = logits[0].detach()
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return packed.detach(), packed_grads, alone, alone_grads


def test_packed_documents_give_the_logits_and_gradients_of_each_document_alone():
    packed, packed_grads, alone, alone_grads = _packed_vs_alone(_document_ids(DOC_LENGTHS))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_reference_check_fails_when_the_mask_is_off_by_one_token():
    packed, _, alone, _ = _packed_vs_alone(_document_ids(DOC_LENGTHS), plant_error=True)
    assert not torch.allclose(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_flex_kernel_matches_the_block_kernel_without_grad():
    """The compiled FlexAttention kernel (inference on CPU) and the block kernel agree."""
    model = _tiny_model("block_causal").float()
    document_ids = _document_ids(DOC_LENGTHS)
    tokens = torch.randint(0, model.model_args.vocab_size, document_ids.shape)
    with torch.no_grad():
        mask = prepare_mask(model.layers, document_ids, tokens.device)
        assert mask.block_mask is not None
        flex = model(tokens, document_ids=document_ids)
    blockwise = model(tokens, document_ids=document_ids)
    torch.testing.assert_close(flex, blockwise.detach(), rtol=1e-4, atol=1e-4)


def test_sliding_window_kernel_masks_keys_beyond_the_window():
    kernel = FlexAttention(MaskSpec(sliding_window=4))
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    out = kernel(q, k, v)
    torch.testing.assert_close(out, _dense_reference(q, k, v, None, 4))


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ["--model.attn_mask_type", "block_causal"],
            "model.attn_mask_type 'block_causal' needs model.attn_type 'flex'",
        ),
        (["--model.sliding_window", "64"], "model.sliding_window needs model.attn_type 'flex'"),
        (
            [
                "--model.attn_type",
                "flex",
                "--model.sliding_window",
                "4096",
                "--training.seq_len",
                "2048",
            ],
            r"model.sliding_window: must be between 1 and training.seq_len \(2048\), got 4096",
        ),
        (
            ["--training.reset_position_ids_per_document"],
            "needs model.attn_mask_type 'block_causal'",
        ),
    ],
)
def test_attention_config_errors_are_one_line(args, match):
    with pytest.raises(ConfigError, match=match) as info:
        ConfigManager().parse_args(args)
    assert "\n" not in str(info.value)


def test_model_inputs_carry_document_ids_and_per_document_positions():
    ids = _document_ids([[2, 3, 3]])
    batch = MicroBatch(
        torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long), ids
    )
    dims = single_process_dims()
    _, _, kwargs = model_inputs(batch, dims, reset_positions=True)
    assert kwargs["document_ids"] is ids and kwargs["positions"].tolist() == [
        [0, 1, 0, 1, 2, 0, 1, 2]
    ]
    _, _, plain = model_inputs(batch, dims)
    assert "positions" not in plain


@pytest.mark.multiprocess
def test_block_causal_with_sdpa_stops_run_train_with_one_line():
    result = run_command(
        ["./run_train.sh", "--model.attn_mask_type", "block_causal", "--training.steps", "1"],
        env={"NGPU": "1"},
        timeout=120,
    )
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--model.attn_type flex" in errors[0], result.stdout
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("block_causal", [True, False])
def test_layers_with_different_windows_each_get_their_own_mask(block_causal):
    """gpt-oss alternates a sliding window with full attention: one forward prepares one
    mask per spec, and each layer's kernel attends under its own (its neighbour's mask would
    give other outputs)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        FlexAttention(MaskSpec(block_causal=block_causal, sliding_window=w)) for w in (6, None)
    )
    document_ids = _document_ids(DOC_LENGTHS)
    q, k, v = (torch.randn(2, 3, 32, 8) for _ in range(3))
    mask = prepare_mask(layers, document_ids, q.device)
    docs = document_ids if block_causal else None
    outs = [kernel(q, k, v, mask=mask) for kernel in layers]
    refs = [_dense_reference(q, k, v, docs, window) for window in (6, None)]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    assert (refs[0] - refs[1]).abs().max() > 1e-2  # the windows do differ here


@pytest.mark.parametrize("seq_len", [24, 40])
def test_flex_kernel_without_grad_is_right_on_lengths_that_end_in_a_partial_block(seq_len):
    """The CPU's compiled FlexAttention gives wrong rows or NaN for such lengths (torch 2.13),
    so the kernel takes the block-by-block path there: every seed matches the dense mask."""
    kernel = FlexAttention(MaskSpec(block_causal=True))
    document_ids = _document_ids([[seq_len // 2, seq_len - seq_len // 2]])
    for seed in range(4):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(1, 4, seq_len, 16) for _ in range(3))
        with torch.no_grad():
            out = kernel(q, k, v, mask=kernel.prepare(document_ids, q.device))
        torch.testing.assert_close(
            out, _dense_reference(q, k, v, document_ids, None), rtol=2e-6, atol=2e-6
        )
