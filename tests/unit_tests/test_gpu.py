"""Single-process CUDA checks (run by scripts/gpu_check.sh on a GPU machine; skipped elsewhere)."""

import pytest
import torch

from tests.launcher import read_metrics, run_torchrun
from tests.parity import BASE_OVERRIDES
from torchtitan.protocols import get_train_spec

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def test_forward_on_cuda_matches_cpu():
    spec = get_train_spec("llama3")
    args = spec.flavor_args("debugmodel_tiny")
    cpu = spec.model_cls(args)
    cpu.init_weights(seed=0)
    gpu = spec.model_cls(args).cuda()
    gpu.load_state_dict(cpu.state_dict())
    gpu.init_weights(seed=0, buffer_device=torch.device("cuda"))
    gpu.load_state_dict(cpu.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.testing.assert_close(gpu(tokens.cuda()).cpu(), cpu(tokens), rtol=1e-4, atol=1e-4)


def test_trainer_on_one_gpu_learns_in_bf16(tmp_path):
    run_torchrun(
        1,
        [
            *BASE_OVERRIDES,
            "--training.local_batch_size",
            "8",
            "--training.mixed_precision_param",
            "bfloat16",
            "--job.dump_folder",
            str(tmp_path),
        ],
        env={"TORCHTITAN_DEVICE_TYPE": "cuda"},
        timeout=300,
    )
    records = read_metrics(tmp_path)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[-1]["memory_gib"] > 0 and records[-1]["mfu"] > 0


def test_fused_adamw_is_used_on_cuda():
    from torchtitan.components.optimizers.builder import build_optimizers
    from torchtitan.config import ConfigManager

    model = torch.nn.Linear(4, 4).cuda()
    optimizers = build_optimizers([model], ConfigManager().parse_args([]).optimizer, None)
    assert optimizers.optimizers[0].defaults["fused"] is True


def test_flex_block_causal_forward_and_backward_on_cuda_match_a_dense_mask():
    """The compiled FlexAttention kernel (with its backward) under documents and a window."""
    from torchtitan.layers.attention import FlexAttention, MaskSpec
    from torchtitan.layers.blockwise_attention import visible

    docs = torch.tensor([[0] * 40 + [1] * 70 + [2] * 146, [0] * 256]).cuda()
    kernel = FlexAttention(MaskSpec(block_causal=True, sliding_window=96))
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    out = kernel(q, k, v, mask=kernel.prepare(docs, q.device))
    assert kernel.prepare(docs, q.device).block_mask is not None, "CUDA must use compiled flex"
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    pos = torch.arange(256, device="cuda")
    dense = visible(pos[:, None], pos[None, :], docs[:, :, None], docs[:, None, :], 96).unsqueeze(1)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=dense)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=2e-3, atol=2e-3)


def test_flex_with_sinks_on_cuda_matches_the_dense_definition():
    """Attention sinks through the compiled FlexAttention kernel's log-sum-exp, with its
    backward (the sinks' gradient included), under documents and a window."""
    from tests.unit_tests.test_attention_sinks import dense_with_sinks
    from torchtitan.layers.attention import FlexAttention, MaskSpec

    docs = torch.tensor([[0] * 40 + [1] * 70 + [2] * 146, [0] * 256]).cuda()
    kernel = FlexAttention(MaskSpec(block_causal=True, sliding_window=96))
    q, k, v = (torch.randn(2, 3, 256, 8, device="cuda", requires_grad=True) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0, 2.0], device="cuda", requires_grad=True)
    mask = kernel.prepare(docs, q.device)
    assert mask.block_mask is not None, "CUDA must use compiled flex"
    out = kernel(q, k, v, mask=mask, scale=8**-0.5, sinks=sinks)
    ref = dense_with_sinks(q, k, v, sinks, docs, 96)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=2e-3, atol=2e-3)


def _loss_and_grads(kernel: str | None, h, weight, labels, dtype=torch.float32):
    """Summed loss and the (h, weight) gradients: full logits (kernel None) or chunked."""
    from torchtitan.layers.loss import LinearCrossEntropy, cross_entropy_sum

    output = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda")
    output.weight = torch.nn.Parameter(weight.detach().clone())
    h = h.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        if kernel is None:
            loss = cross_entropy_sum(output(h).float(), labels)
        else:
            chunked = LinearCrossEntropy(100, kernel)
            chunked.bind(output)
            loss = chunked(h, labels)
    loss.backward()
    return loss.detach(), h.grad, output.weight.grad


def _loss_inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(2, 150, 64, device="cuda", generator=g)
    weight = torch.randn(1000, 64, device="cuda", generator=g) / 8
    labels = torch.randint(0, 1000, (2, 150), device="cuda", generator=g)
    labels[0, :20] = -100
    return h, weight, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_on_cuda_matches_the_full_logits(dtype):
    """fp32: to rounding; bf16 autocast: both paths multiply in bf16 and score in fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    reference = _loss_and_grads(None, *_loss_inputs(), dtype=dtype)
    chunked = _loss_and_grads("native", *_loss_inputs(), dtype=dtype)
    for got, want in zip(chunked, reference):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_liger_fused_loss_matches_ours():
    pytest.importorskip("liger_kernel")
    torch.backends.cuda.matmul.allow_tf32 = False
    ours = _loss_and_grads("native", *_loss_inputs())
    liger = _loss_and_grads("liger", *_loss_inputs())
    for got, want in zip(liger, ours):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
