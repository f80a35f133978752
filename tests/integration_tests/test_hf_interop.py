"""Hugging Face interop: a transformers LlamaForCausalLM's safetensors load into any layout
with identical logits, and our export loads back into transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.launcher import REPO_ROOT, run_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
PROBE = str(REPO_ROOT / "tests" / "integration_tests" / "scripts" / "hf_probe.py")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random LlamaForCausalLM saved with save_pretrained, plus its logits."""
    folder = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokens = torch.randint(0, 128, (2, 16))
    torch.save(tokens, folder / "tokens.pt")
    with torch.no_grad():
        logits = model(tokens).logits
    return folder, tokens, logits


def probe(nproc, hf_dir, out_dir, overrides=(), save_dir=None):
    env = {"HF_DIR": str(hf_dir), "OUT_DIR": str(out_dir)}
    if save_dir is not None:
        env["SAVE_DIR"] = str(save_dir)
    run_torchrun(nproc, list(overrides), script=PROBE, env=env, timeout=280)
    return torch.load(out_dir / "logits.pt")


@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (1, []),
        (2, []),  # FSDP 2
        (2, ["--parallelism.tensor_parallel_degree", "2"]),
    ],
)
def test_initial_load_matches_transformers_logits(hf_model, tmp_path, nproc, overrides):
    folder, _, expected = hf_model
    logits = probe(nproc, folder, tmp_path, overrides)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_export_round_trip_is_exact_and_loads_in_transformers(hf_model, tmp_path):
    folder, tokens, expected = hf_model
    export = tmp_path / "export"
    probe(2, folder, tmp_path, save_dir=export)
    original, exported = (
        load_file(folder / "model.safetensors"),
        load_file(export / "model.safetensors"),
    )
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=0, atol=1e-5)


def test_mismatched_config_names_the_field(hf_model, tmp_path):
    folder, _, _ = hf_model
    from torchtitan.components.checkpointing.huggingface import HFCheckpointError, load_hf_weights
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.protocols import get_train_spec

    spec = get_train_spec("llama3")
    args = spec.flavor_args("debugmodel_tiny")
    model = spec.model_cls(args)
    with pytest.raises(
        HFCheckpointError, match="config.json has n_layers = 2 but model.flavor gives 4"
    ):
        load_hf_weights([model], folder, Llama3StateDictAdapter(args))
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(
        HFCheckpointError, match="checkpoint.initial_load_path: .*bad: no \\*.safetensors"
    ):
        load_hf_weights([model], bad, Llama3StateDictAdapter(args))


CONVERT = REPO_ROOT / "scripts" / "checkpoint_conversion"


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
    """A short training run that exports Hugging Face weights at its last step, and also
    keeps a full DCP checkpoint of the same step."""
    from tests.parity import train

    folder = tmp_path_factory.mktemp("hf_export_run")
    train(
        1,
        folder,
        [
            "--training.steps",
            "3",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "3",
            "--checkpoint.last_save_in_hf",
            "--debug.stop_after_step",
            "2",
        ],
    )
    train(
        1, folder, ["--training.steps", "3", "--checkpoint.enable", "--checkpoint.last_save_in_hf"]
    )
    return folder / "checkpoint"


def test_training_export_loads_in_transformers_with_our_logits(trained_export):
    from torchtitan.components.checkpointing.huggingface import load_hf_weights
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.protocols import get_train_spec

    export = trained_export / "step-3-hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    spec = get_train_spec("llama3")
    args = spec.flavor_args("debugmodel_tiny")
    args.vocab_size = 264
    ours = spec.model_cls(args)
    ours.init_weights(seed=0)
    load_hf_weights([ours], export, Llama3StateDictAdapter(args))
    tokens = torch.randint(0, 264, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)


def test_dcp_to_hf_to_dcp_round_trip_is_bit_exact(trained_export, tmp_path):
    import subprocess
    import sys

    from torchtitan.components.checkpointing.safe_loading import load_dcp, read_dcp_metadata

    config = [
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / "debug_model.toml"),
        "--model.flavor",
        "debugmodel_tiny",
    ]
    source = trained_export / "step-2"  # the full checkpoint the stopped run saved
    for script, args in (
        ("convert_to_hf.py", [str(source), str(tmp_path / "hf")]),
        ("convert_from_hf.py", [str(tmp_path / "hf"), str(tmp_path / "dcp")]),
    ):
        subprocess.run(
            [sys.executable, str(CONVERT / script), *args, *config],
            check=True,
            cwd=REPO_ROOT,
            timeout=120,
        )
    keys = list(read_dcp_metadata(tmp_path / "dcp").state_dict_metadata)
    meta = read_dcp_metadata(source).state_dict_metadata
    original = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    again = {k: torch.empty_like(v) for k, v in original.items()}
    load_dcp(original, source)
    load_dcp(again, tmp_path / "dcp")
    assert "layers.0.attention.wq.weight" in keys
    for key in keys:
        assert torch.equal(original[key], again[key]), key


def test_initial_load_in_hf_gives_every_layout_the_same_start(trained_export, tmp_path):
    from tests.parity import train

    start = [
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--training.steps",
        "1",
        "--checkpoint.initial_load_path",
        str(trained_export / "step-3-hf"),
    ]
    one = train(1, tmp_path / "one", start)
    fsdp = train(2, tmp_path / "fsdp", start)
    scratch = train(1, tmp_path / "scratch", ["--training.steps", "1"])
    assert one[0]["loss"] == pytest.approx(fsdp[0]["loss"], rel=1e-5)
    assert one[0]["loss"] < scratch[0]["loss"] - 0.1  # the trained weights were loaded
