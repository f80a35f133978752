"""Hugging Face interop for DeepSeek-V3: a transformers DeepseekV3ForCausalLM's safetensors
(one tensor per expert, sigmoid routing with a nonzero score-correction bias) load into one
process (also from a folder shaped like the official release, auto_map and modelling code
included, which never runs), into a pipeline stage, and into expert parallel + FSDP with
transformers' logits; the expert-parallel export round-trips bit-exactly and loads back into
transformers."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.launcher import REPO_ROOT, run_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300)]
PROBE = str(REPO_ROOT / "tests" / "integration_tests" / "scripts" / "hf_probe.py")
VOCAB, TOLERANCE = 96, 1e-5


def tiny_args():
    from torchtitan.layers.moe import MoEArgs
    from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs

    # 1 dense + 2 MoE blocks, 8 experts in 4 groups (2 kept), low-rank queries, YaRN.
    return DeepSeekV3ModelArgs(
        vocab_size=VOCAB,
        dim=48,
        inter_dim=80,
        moe_inter_dim=24,
        n_layers=3,
        n_dense_layers=1,
        n_heads=4,
        q_latent_rank=24,
        kv_latent_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_seq_len=64,
        rope_factor=4.0,
        rope_original_seq_len=16,
        rope_mscale=0.707,
        moe=MoEArgs(
            num_experts=8,
            num_shared_experts=1,
            top_k=3,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=4,
            num_limited_groups=2,
        ),
    )


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random DeepseekV3ForCausalLM saved with save_pretrained, its tokens and logits."""
    from tests.unit_tests.test_deepseek_v3_hf_reference import hf_model as random_hf_model

    folder = tmp_path_factory.mktemp("hf_deepseek_v3")
    model = random_hf_model(tiny_args())
    model.save_pretrained(folder)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, folder / "tokens.pt")
    with torch.no_grad():
        logits = model(tokens).logits
    return folder, tokens, logits


def our_model(layers=None, first=True, last=True):
    from torchtitan.distributed.pipeline import build_stage_module
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    model = DeepSeekV3Model(tiny_args())
    if layers is not None:
        model = build_stage_module(model, layers, first, last)
    model.init_weights(seed=0)
    return model.eval()


def load(model, folder):
    from torchtitan.components.checkpointing.huggingface import load_hf_weights
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    load_hf_weights([model], folder, DeepSeekV3StateDictAdapter(tiny_args()))


def test_one_process_load_matches_transformers_logits(hf_model):
    folder, tokens, expected = hf_model
    model = our_model()
    load(model, folder)
    bias = load_file(folder / "model.safetensors")[
        "model.layers.2.mlp.gate.e_score_correction_bias"
    ]
    assert bias.abs().min() > 0 and torch.equal(model.layers["2"].moe.expert_bias, bias)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=TOLERANCE)


def test_a_folder_shaped_like_the_official_release_loads_without_running_its_code(
    hf_model, tmp_path
):
    """The official DeepSeek-V3 folder carries auto_map and its modelling code: the weights
    load with transformers' logits and the code is never imported."""
    from tests.crafted_checkpoints import add_remote_code

    folder, tokens, expected = hf_model
    release = tmp_path / "release"
    shutil.copytree(folder, release)
    marker = tmp_path / "code-ran"
    add_remote_code(release, marker)
    model = our_model()
    load(model, release)
    assert not marker.exists()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=TOLERANCE)


def test_pipeline_stage_loads_only_its_layers(hf_model):
    folder, _, _ = hf_model
    full = our_model()
    load(full, folder)
    stage = our_model(layers=[1, 2], first=False, last=False)  # other stages' keys are fine
    load(stage, folder)
    assert stage.tok_embeddings is None and list(stage.layers) == ["1", "2"]
    reference = full.state_dict()
    for key, value in stage.state_dict().items():
        assert torch.equal(value, reference[key]), key


@pytest.mark.multiprocess
def test_expert_parallel_load_and_export_round_trip(hf_model, tmp_path):
    """EP 2 x FSDP 2 (experts sharded over EP, the rest over FSDP): transformers' logits,
    and an export with the same keys and tensors that transformers loads."""
    folder, tokens, expected = hf_model
    export = tmp_path / "export"
    run_torchrun(
        2,
        ["--parallelism.expert_parallel_degree", "2"],
        script=PROBE,
        timeout=280,
        env={
            "MODEL": "deepseek_v3",
            "HF_DIR": str(folder),
            "OUT_DIR": str(tmp_path),
            "SAVE_DIR": str(export),
        },
    )
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=TOLERANCE)
    original, exported = (
        load_file(folder / "model.safetensors"),
        load_file(export / "model.safetensors"),
    )
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    assert json.loads((export / "config.json").read_text())["architectures"] == [
        "DeepseekV3ForCausalLM"
    ]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        export, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=0, atol=TOLERANCE)


def _copy_with(folder, target, config_edit=None, drop=()):
    target.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config.update(config_edit or {})
    (target / "config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if k not in drop}
    save_file(tensors, target / "model.safetensors")
    return target


def test_bad_checkpoints_give_one_line_naming_the_problem(hf_model, tmp_path):
    from torchtitan.components.checkpointing.huggingface import HFCheckpointError

    folder, _, _ = hf_model
    model = our_model()
    cases = {
        "layers": (
            {"num_hidden_layers": 2},
            (),
            "config.json has n_layers = 2 but model.flavor gives 3; choose the flavor",
        ),
        "experts": (
            {"n_routed_experts": 16},
            (),
            "config.json has moe.num_experts = 16 but model.flavor gives 8;",
        ),
        "missing_expert": (
            {},
            ("model.layers.1.mlp.experts.5.up_proj.weight",),
            "layer 1: expected experts 0..7 for moe.experts.w3, got",
        ),
    }
    for name, (edit, drop, message) in cases.items():
        bad = _copy_with(folder, tmp_path / name, edit, drop)
        with pytest.raises(HFCheckpointError, match=message) as error:
            load(model, bad)
        assert "\n" not in str(error.value)
        assert str(error.value).startswith("checkpoint.initial_load_path: ")


@pytest.mark.multiprocess
def test_trainer_exports_under_expert_parallel_and_loads_the_export(tmp_path):
    """--checkpoint.last_save_in_hf from an EP 2 run gives a folder transformers reads as we do
    (expert biases included); --checkpoint.initial_load_in_hf starts a run from it."""
    from tests.parity import train
    from torchtitan.components.checkpointing.huggingface import load_hf_weights
    from torchtitan.protocols import get_train_spec

    deepseek = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
    trained = train(
        2,
        tmp_path / "ep",
        deepseek
        + [
            "--parallelism.expert_parallel_degree",
            "2",
            "--training.steps",
            "3",
            "--checkpoint.enable",
            "--checkpoint.last_save_in_hf",
        ],
    )
    export = tmp_path / "ep" / "checkpoint" / "step-3-hf"
    spec = get_train_spec("deepseek_v3")
    args = spec.flavor_args("debugmodel")
    args.vocab_size, args.max_seq_len = 264, 64  # the byte tokenizer, the run's seq_len
    ours = spec.model_cls(args)
    ours.init_weights(seed=0)
    load_hf_weights([ours], export, spec.state_dict_adapter(args, None))
    assert ours.layers["1"].moe.expert_bias.abs().max() > 0  # moved by load balancing
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    tokens = torch.randint(0, 264, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.eval()(tokens), hf.eval()(tokens).logits, rtol=0, atol=TOLERANCE
        )
    loaded = train(
        1,
        tmp_path / "loaded",
        deepseek
        + [
            "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf",
            "--training.steps",
            "1",
            "--checkpoint.initial_load_path",
            str(export),
        ],
    )
    assert loaded[0]["loss"] < trained[0]["loss"] - 0.1  # same first batch, trained weights
