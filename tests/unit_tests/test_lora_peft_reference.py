"""Our LoRA against Hugging Face PEFT on random tiny Llama 3 and Qwen3 models: a PEFT adapter
loaded into our model gives PEFT's logits (fp32, 1e-5) and PEFT's adapter gradients; the
adapters we export load in PEFT with our logits; a scaling error fails the comparison; and
an adapter that does not fit this run is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.unit_tests import test_llama3_hf_reference as llama_ref  # noqa: E402
from tests.unit_tests import test_qwen3_hf_reference as qwen_ref  # noqa: E402
from torchtitan.components.adapters.lora import LoRAConverter  # noqa: E402
from torchtitan.components.adapters.lora_linear import adapted_linears  # noqa: E402
from torchtitan.components.checkpointing.huggingface import load_hf_weights, save_hf_weights  # noqa: E402
from torchtitan.components.checkpointing.peft import (  # noqa: E402
    ADAPTER_CONFIG,
    load_peft_adapter,
    peft_tensors,
    save_peft_adapter,
)
from torchtitan.config import ConfigError, LoRAConfig  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import (  # noqa: E402
    Llama3StateDictAdapter,
)
from torchtitan.models.llama3.state_dict_adapter import (  # noqa: E402
    from_hf_config as llama_args_from_hf,
)
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402

RANK, ALPHA, TOLERANCE, GRAD_TOLERANCE = 4, 8.0, 1e-5, 1e-5
HF_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
]
LORA = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=["attention", "mlp", "output"])


def hf_base(family: str):
    if family == "llama3":
        hf = llama_ref.hf_model(llama_ref.PLAIN_ROPE)
        args = llama_args_from_hf(hf.config.to_dict())
        return hf, args, Llama3StateDictAdapter(args), Transformer
    hf = qwen_ref.hf_model(qwen_ref.DENSE)
    return hf, qwen_ref.DENSE, Qwen3StateDictAdapter(qwen_ref.DENSE), Qwen3Model


def our_lora_model(family: str, lora: LoRAConfig = LORA):
    hf, args, adapter, model_cls = hf_base(family)
    with torch.device("meta"):
        model = model_cls(args)
    LoRAConverter(lora, None).convert(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    base = adapter.from_hf(hf.state_dict())
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not unexpected and all(k.endswith(("lora_a", "lora_b")) for k in missing)
    return model, adapter


def peft_model(family: str):
    """PEFT on the same base, with random (non-zero) A and B."""
    hf, *_ = hf_base(family)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def tokens() -> torch.Tensor:
    vocab = 128
    return torch.randint(0, vocab // 2, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(params=["llama3", "qwen3"], scope="module")
def pair(request, tmp_path_factory):
    family = request.param
    reference = peft_model(family)
    folder = tmp_path_factory.mktemp(f"peft_{family}")
    reference.save_pretrained(folder)
    ours, adapter = our_lora_model(family)
    load_peft_adapter([ours], folder, adapter, LORA)
    return family, ours.eval(), reference, adapter


def test_peft_adapter_gives_the_same_logits(pair):
    _, ours, reference, _ = pair
    batch = tokens()
    with torch.no_grad():
        error = (ours(batch) - reference(batch).logits).abs().max().item()
    assert error < TOLERANCE


def test_same_adapter_gradients_as_peft(pair):
    _, ours, reference, adapter = pair
    batch = tokens()
    weights = torch.randn(
        2, 24, ours.model_args.vocab_size, generator=torch.Generator().manual_seed(2)
    )
    (ours(batch) * weights).sum().backward()
    (reference(batch).logits * weights).sum().backward()
    theirs = {
        name.replace(".default.weight", ".weight"): p.grad
        for name, p in reference.named_parameters()
        if "lora_" in name
    }
    linears = adapted_linears([ours])
    grads = {fqn: _GradView(linear) for fqn, linear in linears.items()}
    mine = peft_tensors(grads, adapter)
    assert set(mine) == set(theirs)
    for key, grad in mine.items():  # fp32 sums over ~6,000 logits: compare whole tensors
        error = (grad - theirs[key]).norm() / theirs[key].norm()
        assert error < GRAD_TOLERANCE, f"{key}: relative error {error:.1e}"
    ours.zero_grad(), reference.zero_grad()


class _GradView:
    """A linear's adapter gradients in the shape of its adapters (for ``peft_tensors``)."""

    def __init__(self, linear: torch.nn.Module) -> None:
        self.lora_a, self.lora_b = linear.lora_a.grad, linear.lora_b.grad


def test_exported_adapter_loads_in_peft_with_our_logits(pair, tmp_path):
    family, ours, _, adapter = pair
    save_peft_adapter([ours], tmp_path, adapter, LORA)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["r"] == RANK and sorted(config["target_modules"]) == sorted(HF_TARGETS)
    hf, *_ = hf_base(family)
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    batch = tokens()
    with torch.no_grad():
        error = (ours(batch) - loaded(batch).logits).abs().max().item()
    assert error < TOLERANCE


def test_merged_hf_export_computes_the_adapted_model(pair, tmp_path):
    family, ours, _, adapter = pair
    save_hf_weights([ours], tmp_path, adapter, torch.float32, None)
    _, args, _, model_cls = hf_base(family)
    with torch.device("meta"):
        plain = model_cls(args)
    plain.to_empty(device="cpu")
    plain.init_weights(seed=1)  # the RoPE table; every weight comes from the export
    load_hf_weights([plain], tmp_path, adapter)
    batch = tokens()
    with torch.no_grad():
        error = (ours(batch) - plain.eval()(batch)).abs().max().item()
        with pair[2].disable_adapter():  # PEFT's base model alone
            unmerged = (ours(batch) - pair[2](batch).logits).abs().max().item()
    assert error < 1e-4  # W + s B A summed once in fp32: other rounding than the two paths
    assert unmerged > 100 * error  # the adapters matter: an export without them would fail


def test_planted_scaling_error_fails_the_comparison(pair):
    _, ours, reference, _ = pair
    linears = adapted_linears([ours])
    for linear in linears.values():
        linear.lora_scaling *= 2  # alpha / rank off by a factor of two
    try:
        with torch.no_grad():
            error = (ours(tokens()) - reference(tokens()).logits).abs().max().item()
    finally:
        for linear in linears.values():
            linear.lora_scaling /= 2
    assert error > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rank": 8}, "r=4, this run lora.rank=8"),
        ({"alpha": 16.0}, "lora_alpha=8.0, this run lora.alpha=16.0"),
        ({"target_modules": ["attention"]}, "lora.target_modules does not select"),
    ],
)
def test_mismatched_adapter_is_refused_in_one_line(change, message, tmp_path):
    peft_model("llama3").save_pretrained(tmp_path)
    lora = LoRAConfig(**{**vars(LORA), **change})
    ours, adapter = our_lora_model("llama3", lora)
    with pytest.raises(ConfigError, match=message) as error:
        load_peft_adapter([ours], tmp_path, adapter, lora)
    assert "\n" not in str(error.value)


def test_adapter_of_another_base_is_refused(tmp_path):
    peft_model("qwen3").save_pretrained(tmp_path)
    ours, adapter = our_lora_model("llama3")
    with pytest.raises(ConfigError, match="lora.peft_adapter_path"):
        load_peft_adapter([ours], tmp_path, adapter, LORA)
