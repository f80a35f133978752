"""DPO judged by TRL: the same tiny model, preference rows and settings through TRL's
DPOTrainer (its tokenization, collator and loss) and through ours (rows packed two documents
per pair under document masking, the hf backend's model, components/preference_loss.py) give
the same tokens, the same loss (1e-6) and the same gradient of every parameter (fp32).

beta stays 0.1: the loss moves with beta times the log-probs, so the attention kernels'
rounding (flex over packed rows here, eager over padded rows in TRL; logits within 3e-7)
reaches 2.5e-6 of the loss at beta 0.5, and flex attention has no float64 on CPU to go
below it."""

from __future__ import annotations

import pytest
import torch

from scripts.hf_compat import build_model, transformers_model, write_folder
from torchtitan.components.preference_loss import (
    DPOSettings,
    pair_logps,
    preference_sums,
)
from torchtitan.data.packing import Window
from torchtitan.data.preference import (
    PreferenceEncoder,
    PreferencePair,
    preference_row,
    tokenize_pair,
)
from torchtitan.data.tokenizers import HuggingFaceTokenizer
from torchtitan.layers.attention import document_positions
from torchtitan.layers.loss import token_logps

pytestmark = pytest.mark.slow

ROWS = [
    {"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " 6, I think"},
    {"prompt": "Name a colour.", "chosen": " Blue is one.", "rejected": " Seven"},
    {"prompt": "Say hi", "chosen": " hi", "rejected": " no"},
]
CHAT_ROWS = [
    {
        "prompt": [{"role": "user", "content": row["prompt"]}],
        "chosen": [{"role": "assistant", "content": row["chosen"].strip()}],
        "rejected": [{"role": "assistant", "content": row["rejected"].strip()}],
    }
    for row in ROWS
]
CHAT_ROWS[0]["prompt"].insert(0, {"role": "system", "content": "Answer briefly."})
# Llama 3's layout of turns, in this tokenizer's special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + ']\n' + m['content'] }}"
    "{{ eos_token if m['role'] == 'assistant' else '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant]\n' }}{% endif %}"
)
BLOCK_CAUSAL = ("--model.attn_type", "flex", "--model.attn_mask_type", "block_causal")
SETTINGS = [
    DPOSettings(beta=0.1, loss_type="sigmoid"),
    DPOSettings(beta=0.1, loss_type="robust", label_smoothing=0.2),
    DPOSettings(beta=0.1, loss_type="ipo"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama whose tokenizer puts BOS first as Llama 3's does (a template after the
    byte-level post-processor), so that transformers' tokenizer and ours frame alike."""
    from tokenizers import Tokenizer, processors

    folder = write_folder(tmp_path_factory.mktemp("dpo"), "llama")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = "<|begin_of_text|>"
    tokenizer.post_processor = processors.Sequence(
        [
            tokenizer.post_processor,
            processors.TemplateProcessing(
                single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
            ),
        ]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def trl_loss_and_grads(folder, policy, reference, settings: DPOSettings, tmp_path, rows=ROWS):
    """TRL's DPO loss on ``rows`` and the policy's gradients; also the pairs TRL tokenized."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=settings.beta,
        loss_type=[settings.loss_type],
        label_smoothing=settings.label_smoothing,
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; the comparison is in fp32
        max_length=None,
        dataset_num_proc=None,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    pairs = [PreferencePair(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples]
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return loss.detach(), grads, pairs


def packed_rows(tokenizer: HuggingFaceTokenizer, rows=ROWS, seq_len: int = 128):
    """``rows`` packed into one sequence as the loader packs them: (inputs, labels, documents)."""
    encode = PreferenceEncoder(tokenizer, seq_len + 1)
    window = Window()
    for i, row in enumerate(rows):
        unit = encode(preference_row(row, f"row {i}"))
        window.add(unit.tokens, unit.targets, unit.inner_starts)
    room = seq_len + 1 - len(window.tokens)
    window.add([tokenizer.eos_id] * room, [False] * room)
    return tuple(t.unsqueeze(0) for t in window.sample())


def our_loss_and_grads(policy, reference, tokenizer, settings: DPOSettings, rows=ROWS):
    inputs, labels, documents = packed_rows(tokenizer, rows)
    positions = document_positions(documents)
    logits = policy(inputs, positions, documents)
    ours = pair_logps(token_logps(logits, labels), labels, documents)
    with torch.no_grad():
        ref_logits = reference(inputs, positions, documents)
        ref = pair_logps(token_logps(ref_logits, labels), labels, documents)
    sums = preference_sums(ours, ref, settings)
    loss = sums.loss / sums.pairs
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}, sums


@pytest.mark.parametrize("settings", SETTINGS, ids=[s.loss_type for s in SETTINGS])
def test_loss_and_gradients_equal_trls(folder, settings, tmp_path):
    policy = build_model(folder, *BLOCK_CAUSAL)
    reference = build_model(folder, *BLOCK_CAUSAL, seed=1)
    their_policy = transformers_model(folder, policy)
    their_reference = transformers_model(folder, reference)
    theirs, their_grads, their_pairs = trl_loss_and_grads(
        folder, their_policy, their_reference, settings, tmp_path
    )

    tokenizer = HuggingFaceTokenizer(str(folder))
    rows = [preference_row(r, f"row {i}") for i, r in enumerate(ROWS)]
    assert [tokenize_pair(r, tokenizer) for r in rows] == their_pairs

    ours, our_grads, sums = our_loss_and_grads(policy, reference, tokenizer, settings)
    assert sums.pairs.item() == len(ROWS)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chat_rows_tokenize_and_score_as_trls(folder, tmp_path):
    """TRL's conversational rows: the chat template renders the prompt (with the generation
    prompt) and each completion; the same tokens and loss (sigmoid)."""
    settings = SETTINGS[0]
    policy = build_model(folder, *BLOCK_CAUSAL)
    reference = build_model(folder, *BLOCK_CAUSAL, seed=1)
    theirs, _, their_pairs = trl_loss_and_grads(
        folder,
        transformers_model(folder, policy),
        transformers_model(folder, reference),
        settings,
        tmp_path,
        CHAT_ROWS,
    )
    tokenizer = HuggingFaceTokenizer(str(folder))
    rows = [preference_row(r, f"row {i}") for i, r in enumerate(CHAT_ROWS)]
    assert [tokenize_pair(r, tokenizer) for r in rows] == their_pairs
    ours, _, _ = our_loss_and_grads(policy, reference, tokenizer, settings, CHAT_ROWS)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_a_pair_that_sees_its_neighbour_fails_the_comparison(folder, tmp_path):
    """Planted error: plain causal attention over the packed row (the rejected completion
    attends to the chosen one) moves the loss away from TRL's."""
    settings = SETTINGS[0]
    policy = build_model(folder)
    reference = build_model(folder, seed=1)
    theirs, _, _ = trl_loss_and_grads(
        folder,
        transformers_model(folder, policy),
        transformers_model(folder, reference),
        settings,
        tmp_path,
    )
    tokenizer = HuggingFaceTokenizer(str(folder))
    ours, _, _ = our_loss_and_grads(policy, reference, tokenizer, settings)
    assert not torch.isclose(ours, theirs, rtol=1e-4)
