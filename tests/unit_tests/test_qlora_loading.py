"""QLoRA's base made NF4 from what the start loads: a DCP ``checkpoint.initial_load_path`` or a
Hugging Face folder fills the base weights left on meta a block at a time, so every NF4 weight
is the quantization of the loaded value (not of the seeded initialisation), and everything
else loads as without QLoRA. One process, a 1-rank gloo group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchao.quantization import NF4Tensor, to_nf4

from tests.layouts import single_process_dims
from torchtitan.components.adapters.lora import LoRAConverter
from torchtitan.components.adapters.qlora import PendingBase
from torchtitan.components.checkpointing.huggingface import save_hf_weights
from torchtitan.components.checkpointing.manager import CheckpointManager
from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.config import ConfigManager, LoRAConfig
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

DEBUG = llama3_flavors["debugmodel"]
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("single_rank_gloo")


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> tuple[dict[str, torch.Tensor], Path, Path]:
    """A 'released' base (seed 7) as a plain DCP folder and as a Hugging Face folder."""
    with torch.device("meta"):
        model = Transformer(DEBUG)
    model.to_empty(device=CPU)
    model.init_weights(seed=7)
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    root = tmp_path_factory.mktemp("released")
    dcp.save(model.state_dict(), checkpoint_id=str(root / "dcp"))
    save_hf_weights([model], root / "hf", Llama3StateDictAdapter(DEBUG), torch.float32, None)
    return values, root / "dcp", root / "hf"


def qlora_start(folder: Path, *args: str) -> Transformer:
    """What the trainer does at a QLoRA start (seed 0), up to the end of the checkpoint load."""
    config = ConfigManager().parse_args(
        ["--job.dump_folder", str(folder / "run"), "--checkpoint.enable", *args]
    )
    with torch.device("meta"):
        model = Transformer(DEBUG)
    LoRAConverter(LoRAConfig(rank=4, target_modules=["attention", "mlp"]), None).convert(model)
    pending = PendingBase([model], CPU, seed=0)
    pending.materialize_except(model)
    model.init_weights(seed=0)
    dims = single_process_dims()
    manager = CheckpointManager(
        config.checkpoint,
        dump_folder=config.job.dump_folder,
        dataloader=None,
        model_parts=[model],
        optimizers=build_optimizers([model], config.optimizer, dims),
        lr_schedulers=None,
        states={},
        parallel_dims=dims,
        state_dict_adapter=Llama3StateDictAdapter(DEBUG),
        lora=LoRAConfig(rank=4, target_modules=["attention", "mlp"], base_quantization="nf4"),
        pending_base=pending,
    )
    assert manager.load()
    assert not pending.fqns
    return model


@pytest.mark.parametrize("form", ["dcp", "hf"])
def test_the_nf4_base_is_the_quantized_loaded_base(form, released, tmp_path):
    values, dcp_folder, hf_folder = released
    args = ["--checkpoint.initial_load_path", str(dcp_folder)]
    if form == "hf":
        args = ["--checkpoint.initial_load_path", str(hf_folder), "--checkpoint.initial_load_in_hf"]
    model = qlora_start(tmp_path, *args)
    quantized = 0
    for name, param in model.named_parameters():
        if isinstance(param, NF4Tensor):
            expected = to_nf4(values[name], 64, 256)
            assert torch.equal(param.quantized_data, expected.quantized_data), name
            assert torch.equal(param.quantized_scalers, expected.quantized_scalers), name
            quantized += 1
        elif name.endswith("lora_b"):
            assert not param.any(), name  # adapters keep their initialisation
        elif not name.endswith("lora_a"):
            assert torch.equal(param, values[name]), name
    assert quantized == DEBUG.n_layers * 7
