"""The chunked linear cross-entropy (``layers/loss.py``): the same loss and every gradient
as the full-logits path on a tiny model (ignored tokens, a chunk size that does not divide
the tokens), a planted error that the comparison catches, which path a run takes and the
one-line refusals of its settings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.adapters.lora import LoRAConverter
from torchtitan.components.training_loss import build_loss_fn
from torchtitan.config import ConfigError, ConfigManager, LoRAConfig
from torchtitan.layers import loss as loss_module
from torchtitan.layers.loss import (
    IGNORE_INDEX,
    LinearCrossEntropy,
    auto_chunk_tokens,
    chunked_linear_cross_entropy,
    cross_entropy_sum,
)
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.protocols.train_spec import get_train_spec

TINY = llama3_flavors["debugmodel_tiny"]
RTOL = 1e-6


def tiny_model(seed: int = 3) -> Transformer:
    with torch.device("meta"):
        model = Transformer(TINY)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 37 tokens (74 in all) with a prompt and a padded tail ignored."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (2, 37), generator=g)
    labels = torch.randint(0, TINY.vocab_size, (2, 37), generator=g)
    labels[0, :9] = IGNORE_INDEX
    labels[1, -4:] = IGNORE_INDEX
    return tokens, labels


def loss_and_grads(model: Transformer, chunk: int | None) -> tuple[torch.Tensor, dict]:
    """The summed loss and every parameter's gradient: full logits (chunk None) or chunked."""
    tokens, labels = batch()
    model.zero_grad(set_to_none=True)
    model.hidden_output = chunk is not None
    if chunk is None:
        loss = cross_entropy_sum(model(tokens), labels)
    else:
        chunked = LinearCrossEntropy(chunk)
        chunked.bind(model.output)
        loss = chunked(model(tokens), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_loss_and_grads(reference, other) -> None:
    (ref_loss, ref_grads), (loss, grads) = reference, other
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
    for name, grad in ref_grads.items():
        scale = grad.abs().max()
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=RTOL * scale, msg=name)


@pytest.mark.parametrize("chunk", [1, 10, 74, 500])
def test_loss_and_every_gradient_equal_the_full_logits(chunk):
    model = tiny_model()
    assert_same_loss_and_grads(loss_and_grads(model, None), loss_and_grads(model, chunk))


def test_a_dropped_chunk_log_sum_exp_is_caught(monkeypatch):
    model = tiny_model()
    reference = loss_and_grads(model, None)
    calls = []
    logsumexp = loss_module._logsumexp_

    def drop_second_chunk(logits):
        calls.append(1)
        lse = logsumexp(logits)
        return torch.zeros_like(lse) if len(calls) == 2 else lse

    monkeypatch.setattr(loss_module, "_logsumexp_", drop_second_chunk)
    planted = loss_and_grads(model, 10)
    monkeypatch.undo()
    assert len(calls) == 8  # 74 tokens in chunks of 10
    with pytest.raises(AssertionError):
        assert_same_loss_and_grads(reference, planted)


def test_fp64_gradients_pass_gradcheck():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(23, 6, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 23, (2, 9), generator=g)
    labels[1, :3] = IGNORE_INDEX
    loss = lambda a, b: chunked_linear_cross_entropy(a, b, labels, 4)  # noqa: E731
    assert torch.autograd.gradcheck(loss, (h, w))


def test_bf16_autocast_scores_like_the_full_path():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(64, 32, generator=g)
    w = torch.randn(300, 32, generator=g) * 0.1
    labels = torch.randint(0, 300, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = F.cross_entropy((h @ w.T).float(), labels, reduction="sum")
        chunked = chunked_linear_cross_entropy(h, w, labels, 24)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=1e-3, atol=0)


def test_auto_chunk_follows_vocabulary_over_dim():
    assert auto_chunk_tokens(8192, 128256, 4096) == 1024  # 32 chunks would be 256 tokens
    assert auto_chunk_tokens(131072, 128256, 4096) == 4096  # 32 chunks, Llama 3 8B
    assert auto_chunk_tokens(4096, 128256, 256) == 1024  # 501 chunks would be 9 tokens each
    assert auto_chunk_tokens(100, 64, 256) == 100  # never more than the tokens
    assert auto_chunk_tokens(1000, 64, 256) == 1000  # vocabulary below dim: one chunk


def config(*args: str):
    return ConfigManager().parse_args(["--model.flavor", "debugmodel_tiny", *args])


def built_loss(job_config, lora: list[str] | None = None):
    with torch.device("meta"):
        model = Transformer(TINY)
    if lora is not None:
        LoRAConverter(LoRAConfig(target_modules=lora), None).convert(model)
    spec = get_train_spec("llama3")
    loss_fn = build_loss_fn(job_config.training, job_config.compile, spec, model, "cpu", 1)
    return loss_fn.loss_sum, model


def test_default_runs_chunked_and_zero_runs_the_full_logits(caplog):
    with caplog.at_level("INFO", logger="torchtitan"):
        chunked, model = built_loss(config())
    assert isinstance(chunked, LinearCrossEntropy) and model.hidden_output
    assert (
        "chunked linear cross-entropy, ceil(local vocabulary 264 / dim 64) = 5 chunks"
        in caplog.text
    )
    full, model = built_loss(config("--training.loss_chunk_size", "0"))
    assert full is cross_entropy_sum and not model.hidden_output


def test_an_adapted_output_falls_back_or_is_refused_in_one_line(caplog):
    with caplog.at_level("INFO", logger="torchtitan"):
        full, model = built_loss(config(), lora=["output"])
    assert full is cross_entropy_sum and not model.hidden_output
    assert "full logits: the output layer carries LoRA adapters" in caplog.text
    with pytest.raises(ConfigError, match=r"^training.loss_chunk_size=64: the output layer"):
        built_loss(config("--training.loss_chunk_size", "64"), lora=["output"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--training.loss_chunk_size", "-2"], "training.loss_chunk_size: must be -1 (auto)"),
        (
            ["--training.loss_kernel", "liger", "--training.loss_chunk_size", "0"],
            "training.loss_kernel='liger': is a chunked loss",
        ),
        (
            ["--training.loss_kernel", "liger", "--parallelism.tensor_parallel_degree", "2"],
            "training.loss_kernel='liger': Liger Kernel's loss knows no vocabulary shards",
        ),
    ],
)
def test_bad_settings_name_the_field(args, message):
    from torchtitan.config.checks import check_job_config

    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_job_config(config(*args))


def _weight_grad_error(chunk: int | None) -> float:
    """Largest error of the output weight's gradient under bf16 autocast against fp64."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 64, generator=g)
    weight = torch.randn(1000, 64, generator=g) / 8
    labels = torch.randint(0, 1000, (300,), generator=g)
    exact = weight.double().requires_grad_()
    F.cross_entropy(h.double() @ exact.T, labels, reduction="sum").backward()
    w = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if chunk is None:
            loss = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
        else:
            loss = chunked_linear_cross_entropy(h, w, labels, chunk)
    loss.backward()
    assert w.grad.dtype == torch.float32
    return (w.grad.double() - exact.grad).abs().max().item()


def test_bf16_weight_gradient_summed_over_chunks_is_as_exact_as_the_full_path():
    """30 chunks: the weight gradient adds up in fp32, so it is no further from fp64 than
    the full logits' one bf16 matmul (a bf16 running sum is ~3x further)."""
    assert _weight_grad_error(10) <= 1.5 * _weight_grad_error(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_output_weight_gets_no_gradient(dtype):
    """LoRA without an output adapter: the output weight is frozen, h still gets its gradient
    (fp32 and under bf16 autocast)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        chunked_linear_cross_entropy(h, weight, labels, 16).backward()
        expected = h.detach().clone().requires_grad_()
        F.cross_entropy(F.linear(expected, weight).float(), labels, reduction="sum").backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(h.grad, expected.grad, rtol=tol, atol=tol)
