"""A Hugging Face folder as users bring one (``tests/assets/hf_debug``: config.json, bf16
safetensors and tokenizer files, written by transformers' ``save_pretrained``) fine-tunes
with LoRA through ``CONFIG_FILE=train_configs/hf_debug.toml ./run_train.sh``, and what the run
hands back loads where users take it: ``step-N-hf`` in transformers and ``step-N-peft`` in
PEFT onto the folder's own model, with the same logits (1e-5)."""

from __future__ import annotations

import filecmp

import pytest
import torch

from scripts.hf_debug_folder import write_debug_folder
from tests.launcher import REPO_ROOT, read_metrics, run_command

FOLDER = REPO_ROOT / "tests" / "assets" / "hf_debug"
STEPS = 8


def test_the_debug_folder_is_what_its_script_writes(tmp_path):
    written = write_debug_folder(tmp_path / "hf_debug")
    names = sorted(p.name for p in FOLDER.iterdir())
    assert names == sorted(p.name for p in written.iterdir())
    _, mismatched, errors = filecmp.cmpfiles(FOLDER, written, names, shallow=False)
    assert not mismatched and not errors


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_folder_fine_tunes_with_lora_into_folders_transformers_and_peft_load(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = ["--model.converters", "lora", "--lora.target_modules", "q_proj,v_proj,down_proj"]
    result = run_command(
        [
            "./run_train.sh",
            *lora,
            *("--optimizer.lr", "2e-2", "--training.steps", str(STEPS)),
            *("--training.seq_len", "128", "--metrics.log_freq", "1"),
            *("--job.dump_folder", str(tmp_path)),
        ],
        timeout=220,
        env={"NGPU": "1", "CONFIG_FILE": "train_configs/hf_debug.toml"},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1, losses

    checkpoint = tmp_path / "checkpoint"
    merged = AutoModelForCausalLM.from_pretrained(checkpoint / f"step-{STEPS}-hf").eval()
    base = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    tokens = torch.randint(0, 1998, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, checkpoint / f"step-{STEPS}-peft").eval()
        torch.testing.assert_close(merged(tokens).logits, adapted(tokens).logits, rtol=0, atol=1e-5)
        assert (merged(tokens).logits - before).abs().max() > 1e-3  # the adapters trained
