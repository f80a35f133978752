"""GRPO's reward functions and prompts: the built-in rewards, the registry's one-line error
for an unknown name, prompt rows checked with their source, and the prompts of a step the
same whatever the data-parallel layout."""

from __future__ import annotations

import json

import pytest
import torch

from tests.layouts import single_process_dims
from torchtitan.components.rewards import exact_match, get_reward, number_format
from torchtitan.config import GRPOConfig
from torchtitan.data.prompts import load_prompt_files, step_prompts
from torchtitan.data.tokenizers import ByteTokenizer
from torchtitan.generation.rollouts import Rollouts


def test_exact_match_and_format_score_each_completion():
    row = {"prompt": "2+9=", "answer": "11"}
    assert exact_match(["11", " 11\n", "12", "11 apples"], row) == [1.0, 1.0, 0.0, 0.0]
    assert number_format(["11", " -3 ", "1.5", "eleven", "1 1"], row) == [1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        exact_match(["1"], {"prompt": "x"})


def test_an_unknown_reward_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"^grpo.reward_funcs: unknown reward function 'x'; "):
        get_reward("x")
    assert get_reward("format") is number_format


def test_prompt_rows_are_checked_with_their_source(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    (row,) = load_prompt_files(str(good))
    assert row.prompt == "1+1=" and row.row["answer"] == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl line 1: a prompt row needs a 'prompt'"):
        load_prompt_files(str(bad))


def test_a_chat_prompt_is_rendered_with_the_generation_prompt(tmp_path):
    """TRL's conversational prompts: the chat template renders the turns and the generation
    prompt (the byte tokenizer's template: BOS, '<|user|>\n' + content + '\n',
    '<|assistant|>\n'); a bad message names the row and the field."""
    file = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    file.write_text(json.dumps({"prompt": messages, "answer": "2"}) + "\n")
    rows = load_prompt_files(str(file))
    tokenizer = ByteTokenizer()
    rollouts = Rollouts(
        GRPOConfig(num_generations=2, max_completion_length=4),
        rows,
        tokenizer,
        64,
        2,
        2,
        single_process_dims(),
        torch.device("cpu"),
        0,
        tmp_path,
    )
    text = "<|system|>\nAdd.\n<|user|>\n1+1=\n<|assistant|>\n"
    assert rollouts._encode(rows[0]) == [tokenizer.bos_id, *text.encode()]
    file.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match=r"chat.jsonl line 1: prompt\[0\] must be"):
        load_prompt_files(str(file))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_a_steps_prompts_do_not_depend_on_the_layout(dp):
    rows = list(range(10))
    union = [p for r in range(dp) for p in step_prompts(rows, 3, 4, r, dp)]
    assert union == [(i, rows[i % 10]) for i in range(8, 12)]
