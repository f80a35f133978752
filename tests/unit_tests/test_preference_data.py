"""Preference pairs as the loader reads and packs them: rows checked with one line naming the
row and the field, each pair one packing unit of two documents (chosen even, rejected odd)
with labels on the completions only, long pairs cut half a sequence per side, pairs with
nothing left to train skipped; and the DPO losses' pair bookkeeping on packed rows."""

from __future__ import annotations

import json

import pytest
import torch

from torchtitan.components.adapters.lora_linear import adapters_off, add_lora
from torchtitan.components.preference_loss import count_pairs, pair_logps
from torchtitan.data.packing import ShardedTextDataset, Window
from torchtitan.data.preference import (
    PreferenceEncoder,
    load_preference_files,
    preference_row,
    tokenize_pair,
)
from torchtitan.data.tokenizers import ByteTokenizer
from torchtitan.layers.loss import IGNORE_INDEX

ROW = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
USER = {"role": "user", "content": "1+2="}
ANSWER = {"role": "assistant", "content": "3"}
CHAT_ROW = {"prompt": [USER], "chosen": [ANSWER], "rejected": [{**ANSWER, "content": "4"}]}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "a", "chosen": "b"}, "no 'rejected' field (keys: 'prompt', 'chosen')"),
        ({"prompt": "a", "chosen": 1, "rejected": "c"}, "'chosen' must be a string as 'prompt'"),
        (
            {"prompt": [USER], "chosen": "b", "rejected": [ANSWER]},
            "'chosen' must be a non-empty list of",
        ),
        (
            {"prompt": [USER], "chosen": [USER], "rejected": [ANSWER]},
            "'chosen' has no assistant message",
        ),
        (
            {"prompt": [{"role": "robot", "content": "x"}], "chosen": [ANSWER], "rejected": []},
            'prompt[0] must be {"role": one of system, user, assistant',
        ),
        ({"prompt": "a", "chosen": " ", "rejected": "c"}, "empty 'chosen'"),
        (["a", "b"], "expected a JSON object with prompt, chosen, rejected, got list"),
    ],
)
def test_a_bad_row_is_one_line_naming_it_and_the_field(row, message):
    with pytest.raises(ValueError, match="^pairs.jsonl line 3: ") as info:
        preference_row(row, "pairs.jsonl line 3")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_files_are_read_whole_and_a_bad_line_stops_the_load(tmp_path):
    good = tmp_path / "pairs.jsonl"
    good.write_text(json.dumps(ROW) + "\n\n" + json.dumps(ROW) + "\n")
    assert len(load_preference_files(str(good))) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROW) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: invalid JSON"):
        load_preference_files(str(bad))


def test_a_pair_packs_as_two_documents_with_only_the_completions_trained():
    tokenizer = ByteTokenizer()
    row = preference_row(ROW, "row")
    unit = PreferenceEncoder(tokenizer, window=33)(row)
    window = Window()
    window.add(unit.tokens, unit.targets, unit.inner_starts)
    window.add(unit.tokens, unit.targets, unit.inner_starts)
    room = 33 - len(window.tokens)
    window.add([0] * room, [False] * room)
    inputs, labels, documents = window.sample()
    # BOS + "1+2=" + "3" + EOS, then BOS + "1+2=" + "4" + EOS, twice, then padding
    assert documents.tolist() == [0] * 7 + [1] * 7 + [2] * 7 + [3] * 7 + [4] * 4
    trained = labels[labels != IGNORE_INDEX].tolist()
    assert trained == [ord("3"), tokenizer.eos_id, ord("4"), tokenizer.eos_id] * 2
    slots = pair_logps(torch.ones(1, 32), labels[None], documents[None])
    assert slots.present[0, :3].tolist() == [True, True, False]
    assert slots.chosen_tokens[0, :2].tolist() == [2.0, 2.0]
    assert count_pairs(labels[None], documents[None]).item() == 2


def test_a_chat_row_renders_through_the_template_the_end_of_turn_ending_each_completion():
    """The byte tokenizer's template: BOS, '<|user|>\n' + content + '\n', the generation
    prompt '<|assistant|>\n', an assistant turn ending in EOS (TRL adds none to chat rows)."""
    tokenizer = ByteTokenizer()
    pair = tokenize_pair(preference_row(CHAT_ROW, "row"), tokenizer)
    assert pair.prompt_ids == [tokenizer.bos_id, *b"<|user|>\n1+2=\n<|assistant|>\n"]
    assert pair.chosen_ids == [ord("3"), tokenizer.eos_id]
    assert pair.rejected_ids == [ord("4"), tokenizer.eos_id]
    unit = PreferenceEncoder(tokenizer, window=64)(preference_row(CHAT_ROW, "row"))
    assert unit.inner_starts == (len(pair.prompt_ids) + 2,)


def test_tokens_follow_trls_rules_eos_after_each_completion_and_the_prompt_shared():
    tokenizer = ByteTokenizer()
    pair = tokenize_pair(preference_row(ROW, "row"), tokenizer)
    assert pair.prompt_ids == [tokenizer.bos_id, *b"1+2="]
    assert pair.chosen_ids == [ord("3"), tokenizer.eos_id]
    assert pair.rejected_ids == [ord("4"), tokenizer.eos_id]


def test_a_long_pair_keeps_half_a_sequence_per_side_and_an_untrainable_one_is_skipped():
    tokenizer = ByteTokenizer()
    encode = PreferenceEncoder(tokenizer, window=20)
    long = encode(preference_row({"prompt": "p", "chosen": "c" * 30, "rejected": "r"}, "row"))
    assert long.inner_starts == (10,) and len(long.tokens) == 14
    assert long.tokens[:3] == [tokenizer.bos_id, ord("p"), ord("c")]
    assert long.tokens[10:] == [tokenizer.bos_id, ord("p"), ord("r"), tokenizer.eos_id]
    skipped = encode(preference_row({"prompt": "p" * 12, "chosen": "c", "rejected": "r"}, "r"))
    assert skipped.tokens == [] and encode.skipped == 1


def test_the_loader_never_splits_a_pair_across_sequences():
    """Whole packing: a unit that does not fit the rest of a sequence starts the next one,
    so every sequence holds complete pairs (odd documents all have a trained label)."""
    tokenizer = ByteTokenizer()
    rows = [
        preference_row({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": "x" * i}, "r")
        for i in range(1, 9)
    ]
    dataset = ShardedTextDataset(
        name="preference",
        documents=rows,
        encode=PreferenceEncoder(tokenizer, 33),
        seq_len=32,
        dp_rank=0,
        dp_degree=1,
        data_shards=1,
        infinite=True,
        pad_id=0,
    )
    pairs = 0
    for _, (_, labels, documents) in zip(range(6), dataset):
        slots = pair_logps(torch.ones(1, 32), labels[None], documents[None].long())
        last = int(documents.max())
        complete = last // 2 if last % 2 == 0 else (last + 1) // 2
        assert slots.present[0].sum().item() == complete
        pairs += complete
    assert pairs >= len(rows)  # a whole epoch went through


def test_adapters_off_computes_the_base_linear_exactly():
    """DPO's reference under LoRA: inside ``adapters_off`` an adapted linear returns the
    base output bit for bit; outside it the adapters add their (here non-zero) update."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8, bias=False)
    base = torch.nn.Linear(8, 8, bias=False)
    base.weight.data.copy_(linear.weight.data)
    add_lora(linear, rank=2, alpha=4.0, dropout=0.0)
    torch.nn.init.normal_(linear.lora_a)
    torch.nn.init.normal_(linear.lora_b)
    x = torch.randn(3, 8)
    with adapters_off([linear]):
        assert torch.equal(linear(x), base(x))
    assert not torch.allclose(linear(x), base(x))
