"""The hf backend trains like one process (per-step loss and grad norm within 1e-4, fp32): a tiny
Gemma 3 built by transformers from its config.json (GeGLU, per-head q/k norms, scaled embeddings)
under FSDP 2, TP 2 (transformers' own plan), FSDP 2 x TP 2, FSDP 2 with full activation
checkpointing, CP 2 (alltoall) on packed documents (block_causal), PP 2 (1F1B), LoRA (adapters on
column-wise, row-wise and the replicated lm_head) under FSDP 2, TP 2 and FSDP 2 x TP 2, QLoRA
(NF4 base) under FSDP 2, and a tiny Mixtral under FSDP 2, PP 2, FSDP 2 x TP 2 (experts
replicated), TP 2, CP 2, EP 2 and PP 2 x EP 2 (transformers' router and experts, the experts
split over the ep ranks), a tiny DeepSeek-V3 (multi-head latent attention) and a tiny Granite
SWA (attention sinks, split by heads) under TP 2.
Hugging Face weights load through the hardened loader and export back bit for bit, in
a folder transformers loads; a checkpoint saved under FSDP 2 resumes under TP 2; Llama 3 trains
alike natively and through the backend (1e-5)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from scripts.hf_compat import TOKENIZER, write_folder
from tests.launcher import read_metrics, run_torchrun
from tests.parity import assert_loss_falls, assert_parity, ci_subset, train, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

DENSE, MOE, MLA, SINKS = "gemma3_text", "mixtral", "deepseek_v3", "granite_swa"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
PP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
]
PACKED = ["--model.attn_type", "flex", "--model.attn_mask_type", "block_causal"]

LORA = [
    *("--model.converters", "lora", "--lora.target_modules", "q_proj,v_proj,down_proj,lm_head"),
    *("--optimizer.lr", "3e-2"),  # only the adapters train: a higher rate for a clear fall
]

# reference: (model type, its 1-process overrides)
REFERENCES = {
    "dense": (DENSE, []),
    "packed": (DENSE, PACKED),
    "lora": (DENSE, LORA),
    "moe": (MOE, []),
    "mla": (MLA, []),
    "sinks": (SINKS, []),
}
# name: (reference, processes, data-parallel degree, overrides beside the reference's)
CASES = {
    "fsdp2": ("dense", 2, 2, []),
    "tp2": ("dense", 2, 1, TP2),
    "fsdp2_tp2": ("dense", 4, 2, TP2),
    "fsdp2_full_ac": ("dense", 2, 2, ["--activation_checkpoint.mode", "full"]),
    "pp2": ("dense", 2, 1, PP2),
    "cp2_alltoall_block_causal": (
        "packed",
        2,
        1,
        CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall"],
    ),
    "lora_fsdp2": ("lora", 2, 2, []),
    "lora_tp2": ("lora", 2, 1, TP2),
    "lora_fsdp2_tp2": ("lora", 4, 2, TP2),
    "moe_fsdp2": ("moe", 2, 2, []),
    "moe_tp2": ("moe", 2, 1, TP2),
    "moe_cp2": ("moe", 2, 1, CP2),
    "moe_pp2": ("moe", 2, 1, PP2),
    "moe_fsdp2_tp2": ("moe", 4, 2, TP2),
    "moe_ep2": ("moe", 2, 2, EP2),
    "moe_pp2_ep2": ("moe", 4, 2, PP2 + EP2),
    # the shared rotary key's gradient is summed over the tp ranks (transformers' mla_kv_a_proj)
    "mla_tp2": ("mla", 2, 1, TP2),
    # the sinks split by heads, seen as local pieces in the attention's forward (local_params)
    "sinks_tp2": ("sinks", 2, 1, TP2),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Per model type, a folder with its tiny config.json (MoE: 4 experts, top 2) and the
    test tokenizer."""
    root = tmp_path_factory.mktemp("hf_models")
    return {
        # untied (pipeline stages cannot share the embedding), and layers of both kinds, whose
        # RoPE differs: a pipeline stage must give each of its layers its own
        DENSE: write_folder(
            root,
            DENSE,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention"],
        ),
        MOE: write_folder(root, MOE),
        MLA: write_folder(root, MLA),
        SINKS: write_folder(root, SINKS),
    }


def hf_model(folder: Path) -> list[str]:
    return ["--model.name", "hf", "--model.flavor", "full", "--model.hf_assets_path", str(folder)]


@pytest.fixture(scope="module")
def references(folders, tmp_path_factory):
    runs = {}

    def get(name: str) -> list[dict]:
        if name not in runs:
            model_type, overrides = REFERENCES[name]
            folder = tmp_path_factory.mktemp(f"hf_{name}")
            runs[name] = train(1, folder, hf_model(folders[model_type]) + overrides)
            assert_loss_falls(runs[name])
        return runs[name]

    return get


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "fsdp2": "fsdp2_tp2",
    "tp2": "fsdp2_tp2",
    "lora_fsdp2": "lora_fsdp2_tp2",
    "lora_tp2": "lora_fsdp2_tp2",
    "moe_fsdp2": "moe_fsdp2_tp2",
    "moe_tp2": "moe_fsdp2_tp2",
    "moe_pp2": "moe_pp2_ep2",
    "moe_ep2": "moe_pp2_ep2",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_parity_with_one_process(case, folders, references, tmp_path):
    reference, nproc, dp, overrides = CASES[case]
    model_type, reference_overrides = REFERENCES[reference]
    run = train(
        nproc, tmp_path, hf_model(folders[model_type]) + reference_overrides + overrides, dp=dp
    )
    assert_parity(references(reference), run)


def test_qlora_under_fsdp2_trains_like_one_process(tmp_path):
    """QLoRA on a Gemma 3 wide enough for whole NF4 groups (256): the adapted linears' base
    is NF4 and FSDP 2 (NF4 rows split over the ranks) gives the 1-process losses and grad
    norms."""
    folder = write_folder(tmp_path, DENSE, hidden_size=256, intermediate_size=512, head_dim=64)
    qlora = hf_model(folder) + [
        *("--model.converters", "lora", "--lora.target_modules", "q_proj,v_proj,down_proj"),
        *("--lora.base_quantization", "nf4", "--optimizer.lr", "1e-2"),
    ]
    runs = {}
    for nproc in (1, 2):
        dump = tmp_path / f"nproc{nproc}"
        out = run_torchrun(nproc, train_args(nproc, dump, qlora)).stdout
        assert "adapted linears are NF4 now" in out, out[-3000:]
        runs[nproc] = read_metrics(dump)
    assert runs[1][-1]["loss"] < runs[1][0]["loss"] - 0.3, "QLoRA did not learn"
    assert_parity(runs[1], runs[2])


def test_hf_weights_load_and_export_bit_for_bit(folders, tmp_path):
    """A folder saved by transformers is the initial weights (through the hardened loader);
    with a learning rate of 1e-30 (no fp32 weight moves) the run's Hugging Face export holds
    exactly those weights, and transformers loads it."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    published = tmp_path / "published"
    config = AutoConfig.from_pretrained(folders[DENSE])
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # no weight at zero, where a step of 1e-30 would still show
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.02)
    model.save_pretrained(published)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, published / name)
    dump = tmp_path / "run"
    train(
        2,
        dump,
        hf_model(published)
        + [
            *("--checkpoint.enable", "--checkpoint.initial_load_in_hf"),
            *("--checkpoint.last_save_in_hf", "--checkpoint.interval", "2"),
            *("--training.steps", "2", "--optimizer.lr", "1e-30", "--optimizer.weight_decay", "0"),
        ],
        dp=2,
    )
    exported = dump / "checkpoint" / "step-2-hf"
    original = load_file(published / "model.safetensors")
    written = {}
    for shard in exported.glob("*.safetensors"):
        written.update(load_file(shard))
    assert written.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(written[key], tensor), key
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    assert torch.equal(
        reloaded.model.layers[1].mlp.down_proj.weight,
        original["model.layers.1.mlp.down_proj.weight"],
    )


def test_a_checkpoint_resumes_under_another_layout(folders, tmp_path):
    """Saved at step 2 under FSDP 2, resumed under TP 2: steps 3 and 4 give the uninterrupted
    run's loss and grad norm (1e-4: TP sums in another order)."""
    checkpointing = [
        *("--checkpoint.enable", "--checkpoint.interval", "2"),
        *("--checkpoint.no_last_save_model_only", "--training.steps", "4"),
    ]
    model = hf_model(folders[DENSE])
    whole = train(2, tmp_path, model + checkpointing, dp=2)
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    (tmp_path / "metrics.jsonl").unlink()
    resumed = train(2, tmp_path, model + checkpointing + TP2, dp=1)
    assert [r["step"] for r in resumed] == [3, 4]
    assert_parity(whole[2:], resumed)


def llama3_folder(root: Path, tokenizer_flag: list[str]) -> Path:
    """Llama 3's ``debugmodel_tiny`` as a Hugging Face folder: the config.json its state-dict
    adapter writes, seeded random weights saved by transformers, the test tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.parity import DEBUG_TOML
    from torchtitan.config import ConfigManager
    from torchtitan.data.tokenizers import build_tokenizer
    from torchtitan.protocols.train_spec import get_train_spec

    flags = ["--job.config_file", DEBUG_TOML, "--model.flavor", "debugmodel_tiny"]
    config = ConfigManager().parse_args(flags + tokenizer_flag)
    spec = get_train_spec("llama3")
    args = spec.flavor_args("debugmodel_tiny")
    args.update_from_config(config.model, max_seq_len=2048, tokenizer=build_tokenizer(config.model))
    hf_config = spec.hf_adapter(args).hf_config()
    torch.manual_seed(0)
    model_config = AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    folder = root / "llama3"
    AutoModelForCausalLM.from_config(model_config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


def test_llama3_trains_alike_natively_and_through_the_backend(tmp_path):
    """The same weights (a Hugging Face folder, through the hardened loader), data and
    optimizer: 10 steps of the native Llama 3 and of transformers' Llama give the same loss
    and grad norm (1e-5; parameter groups included: the embedding trains without weight
    decay under either name)."""
    tokenizer_flag = ["--model.tokenizer_path", str(TOKENIZER)]
    folder = llama3_folder(tmp_path, tokenizer_flag)
    load = ["--checkpoint.enable", "--checkpoint.initial_load_in_hf"]
    native = train(
        1,
        tmp_path / "native",
        tokenizer_flag + load + ["--checkpoint.initial_load_path", str(folder)],
    )
    through_the_backend = train(1, tmp_path / "hf", hf_model(folder) + load)
    assert_loss_falls(native)
    assert_parity(native, through_the_backend, rtol=1e-5)
