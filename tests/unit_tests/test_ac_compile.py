import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.config import ActivationCheckpointConfig
from torchtitan.config.checks import check_ac_config
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import (
    _ATTENTION,
    apply_ac,
    keeps_attention_output,
)
from torchtitan.tools.compile import CompileError, compile_blocks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


def blocks(n=4):
    return nn.ModuleDict({str(i): Block() for i in range(n)})


def wrapped(module_dict):
    return [name for name, m in module_dict.items() if type(m).__name__ == "CheckpointWrapper"]


@pytest.mark.parametrize(
    "mode, option, expected",
    [
        ("none", "2", []),
        ("full", "2", ["0", "1", "2", "3"]),
        ("selective", "2", ["1", "3"]),
        ("selective", "3", ["2"]),
        ("selective", "op", ["0", "1", "2", "3"]),
    ],
)
def test_which_blocks_are_checkpointed(mode, option, expected):
    b = blocks()
    apply_ac(b, mode, option)
    assert wrapped(b) == expected


def test_state_dict_keys_have_no_wrapper_prefix():
    b = blocks()
    apply_ac(b, "full", "2")
    assert all("_checkpoint_wrapped_module" not in k for k in b.state_dict())


@pytest.mark.parametrize("option", ["0", "x", "-1"])
def test_bad_selective_option(option):
    assert "selective_ac_option" in check_ac_config("selective", option)


def test_op_policy_recomputes_and_matches_gradients():
    torch.manual_seed(0)
    ref = blocks(2)
    sac = blocks(2)
    sac.load_state_dict(ref.state_dict())
    apply_ac(sac, "selective", "op")
    x = torch.randn(3, 4, requires_grad=True)

    def run(m):
        h = x
        for layer in m.values():
            h = layer(h)
        h.sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    for a, b in zip(run(ref), run(sac)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).transpose(1, 3).unbind(2)
        return x + torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ).transpose(1, 2).flatten(2)


class AttentionCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ATTENTION:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("save_attention_output, attention_calls", [(False, 2), (True, 1)])
def test_saving_attention_output_skips_its_recompute_with_equal_gradients(
    save_attention_output, attention_calls
):
    torch.manual_seed(0)
    ref = nn.ModuleDict({"0": AttentionBlock()})
    ac = nn.ModuleDict({"0": AttentionBlock()})
    ac.load_state_dict(ref.state_dict())
    apply_ac(ac, "full", "2", save_attention_output=save_attention_output)
    x = torch.randn(2, 5, 8)
    ref["0"](x).square().sum().backward()
    with AttentionCounter() as counter:
        ac["0"](x).square().sum().backward()
    assert counter.calls == attention_calls  # forward (+ recompute)
    for a, b in zip(ref.parameters(), ac.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "policy, mode, option, ring, kept",
    [
        ("selective", "selective", "2", False, True),
        ("selective", "selective", "2", True, False),  # ring CP would keep every ring step's output
        ("selective", "full", "2", False, False),
        ("selective", "selective", "op", False, False),  # the op policy keeps it by itself
        ("always", "full", "2", True, True),
        ("never", "selective", "2", False, False),
    ],
)
def test_which_recomputed_blocks_keep_their_attention_output(policy, mode, option, ring, kept):
    ac = ActivationCheckpointConfig(
        mode=mode, selective_ac_option=option, save_attention_output=policy
    )
    assert keeps_attention_output(ac, ring_cp=ring) is kept


@pytest.mark.parametrize(
    "cp, rotate, ring", [(2, "alltoall", True), (2, "allgather", False), (1, "alltoall", False)]
)
def test_ring_cp_is_read_from_the_parallel_layout(cp, rotate, ring):
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=cp, tp=1, pp=1, ep=1, world_size=cp, cp_rotate_method=rotate
    )
    assert dims.ring_cp is ring


def test_compile_failure_names_the_block():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    b = blocks(2)
    compile_blocks(b, broken_backend)
    with pytest.raises(
        CompileError, match=r"torch.compile failed for layers.0 .*run without --compile.enable"
    ):
        b["0"](torch.randn(2, 4))
    assert list(b.state_dict()) == list(blocks(2).state_dict())  # FQNs unchanged
