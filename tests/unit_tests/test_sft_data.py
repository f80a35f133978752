"""Chat fine-tuning data: rendering and masking, whole-sample packing, order, resume, bad input."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.data import load_documents
from torchtitan.data.chat_template import ChatEncoder
from torchtitan.data.loader import build_dataloader, build_text_dataloader
from torchtitan.data.sft import ChatSample
from torchtitan.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer
from torchtitan.layers.loss import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
TINY_SFT = REPO / "tests" / "assets" / "sft_tiny.jsonl"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _messages(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text(
        "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    )
    return path


def _sample(*turns: tuple[str, str]) -> ChatSample:
    return ChatSample(tuple({"role": r, "content": c} for r, c in turns), "test line 1")


def _trained_text(tokenizer, sample: ChatSample) -> list[str]:
    """The trained runs of the encoded sample, decoded (byte tokenizer: EOS shown as <EOS>)."""
    encoded = ChatEncoder(tokenizer)(sample)
    runs, current = [], []
    for token, trained in zip(encoded.tokens, encoded.targets, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    eos = tokenizer.eos_id
    return ["".join("<EOS>" if t == eos else tokenizer.decode([t]) for t in run) for run in runs]


def _loader(path, tokenizer=None, **overrides):
    kwargs = dict(
        dataset="sft",
        dataset_path=str(path),
        tokenizer=tokenizer or ByteTokenizer(),
        seq_len=64,
        local_batch_size=2,
        dp_rank=0,
        dp_degree=1,
        data_shards=2,
    )
    return build_text_dataloader(**{**kwargs, **overrides})


def _batches(loader, count: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    it = iter(loader)
    return [
        (inputs["input"], labels, inputs["document_ids"])
        for inputs, labels in (next(it) for _ in range(count))
    ]


# ---- rendering and masking


def test_byte_template_trains_only_assistant_turns():
    sample = _sample(
        ("system", "Be brief."),
        ("user", "Hi?"),
        ("assistant", "Hello."),
        ("user", "2+2?"),
        ("assistant", "4"),
    )
    encoded = ChatEncoder(ByteTokenizer())(sample)
    assert encoded.tokens[0] == ByteTokenizer().bos_id
    text = ByteTokenizer().decode(encoded.tokens)
    assert text == (
        "<|system|>\nBe brief.\n<|user|>\nHi?\n<|assistant|>\nHello."
        "<|user|>\n2+2?\n<|assistant|>\n4"
    )
    assert _trained_text(ByteTokenizer(), sample) == ["Hello.<EOS>", "4<EOS>"]


def test_prompt_completion_line_is_a_user_and_an_assistant_message(tmp_path):
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Sky is", "completion": " blue."}])
    _, documents = load_documents("sft", str(path))
    assert documents[0].messages == (
        {"role": "user", "content": "Sky is"},
        {"role": "assistant", "content": " blue."},
    )
    assert documents[0].source == f"{path} line 1"
    assert _trained_text(ByteTokenizer(), documents[0]) == [" blue.<EOS>"]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer.json with ChatML special tokens and its chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(
        ["What is the answer?", "The answer is 42.", "user assistant system"] * 20, trainer
    )
    out = tmp_path_factory.mktemp("chatml")
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_hf_chat_template_masks_prompt_and_trains_end_of_turn(chatml_dir):
    tok = HuggingFaceTokenizer(chatml_dir)
    start, end = (tok._tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    sample = _sample(
        ("system", "Be exact."), ("user", "What is the answer?"), ("assistant", "The answer is 42.")
    )
    encoded = ChatEncoder(tok)(sample)
    assert (
        encoded.tokens.count(start) == 3 and encoded.tokens.count(end) == 3
    )  # special tokens, not their text
    trained = [t for t, keep in zip(encoded.tokens, encoded.targets, strict=True) if keep]
    assert trained == tok.encode_rendered("The answer is 42.<|im_end|>\n")
    assert start not in trained and trained.count(end) == 1
    assert tok._tokenizer.decode(encoded.tokens, skip_special_tokens=False) == (
        "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nWhat is the answer?<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n"
    )


def test_hf_sft_batches_pad_with_the_pad_token(chatml_dir, tmp_path):
    tok = HuggingFaceTokenizer(chatml_dir)
    path = _write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "What is the answer?", "completion": "42."}] * 2
    )
    inputs, labels, document_ids = _batches(
        _loader(path, tok, seq_len=48, data_shards=1, local_batch_size=1), 1
    )[0]
    pad = inputs[0, -1].item()
    assert pad == tok.pad_id and labels[0, -1] == IGNORE_INDEX
    assert document_ids[0].unique().tolist() == [0, 1, 2]  # two samples, then the padding


# ---- packing


def _expected_windows(
    samples: list[ChatSample], window: int, pad_id: int
) -> list[tuple[list[int], list[int]]]:
    """Greedy whole-sample packing, written out: (tokens, document id per token) per window."""
    windows, tokens, ids = [], [], []
    for sample in samples:
        encoded = ChatEncoder(ByteTokenizer())(sample).tokens[:window]
        if len(tokens) + len(encoded) > window:
            windows.append(
                (
                    tokens + [pad_id] * (window - len(tokens)),
                    ids + [ids[-1] + 1] * (window - len(tokens)),
                )
            )
            tokens, ids = [], []
        ids += [len(set(ids))] * len(encoded)
        tokens += encoded
        if len(tokens) == window:
            windows.append((tokens, ids))
            tokens, ids = [], []
    return windows


def test_samples_are_packed_whole_with_padding():
    _, samples = load_documents("sft", str(TINY_SFT))
    expected = _expected_windows(list(samples), 129, ByteTokenizer().pad_id)
    batches = _batches(
        _loader(TINY_SFT, seq_len=128, data_shards=1, local_batch_size=1), len(expected)
    )
    for (inputs, labels, document_ids), (tokens, ids) in zip(batches, expected, strict=True):
        assert inputs[0].tolist() == tokens[:-1] and document_ids[0].tolist() == ids[:-1]
        padding = inputs[0] == ByteTokenizer().pad_id
        assert (labels[0][padding] == IGNORE_INDEX).all()
    assert sum(int((inputs == ByteTokenizer().pad_id).sum()) for inputs, _, _ in batches) > 0


def test_labels_are_the_next_token_where_trained():
    _, samples = load_documents("sft", str(TINY_SFT))
    encoded = [ChatEncoder(ByteTokenizer())(s) for s in samples]
    inputs, labels, document_ids = _batches(
        _loader(TINY_SFT, seq_len=512, data_shards=1, local_batch_size=1), 1
    )[0]
    first = len(encoded[0].tokens)
    targets = encoded[0].targets
    expected = [
        tok if keep else IGNORE_INDEX
        for tok, keep in zip(encoded[0].tokens[1:], targets[1:], strict=True)
    ]
    assert labels[0, : first - 1].tolist() == expected
    assert (
        labels[0, first - 1] == IGNORE_INDEX
    )  # the last token of a sample never predicts the next sample
    assert document_ids[0, first - 1] == 0 and document_ids[0, first] == 1


def test_a_sample_longer_than_a_window_is_truncated_and_logged_once(tmp_path, caplog):
    rows = [
        {"prompt": "q" * 10, "completion": "a" * 100},
        {"prompt": "x", "completion": "y"},
        {"prompt": "p" * 90, "completion": "c"},
    ]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        batches = _batches(_loader(path, seq_len=31, data_shards=1, local_batch_size=1), 4)
    (first, _, ids0), (second, _, ids1), (third, _, _) = batches[:3]
    assert ids0[0].unique().tolist() == [0]  # the long sample alone, cut at the window
    assert first[0, 0] == ByteTokenizer().bos_id and second[0, 0] == ByteTokenizer().bos_id
    assert ids1[0].unique().tolist() == [0, 1]  # the short sample, then padding
    assert third[0, 0] == ByteTokenizer().bos_id
    warnings = [r.getMessage() for r in caplog.records if "lose their tail" in r.getMessage()]
    assert (
        len(warnings) == 1
        and "2 of the 3 samples" in warnings[0]
        and "training.seq_len" in warnings[0]
    )


# ---- order and resume


def _global_batches(dp: int, count: int, **kwargs) -> list[list[tuple]]:
    loaders = [
        _loader(
            TINY_SFT, dp_rank=r, dp_degree=dp, local_batch_size=4 // dp, data_shards=4, **kwargs
        )
        for r in range(dp)
    ]
    iterators = [iter(loader) for loader in loaders]
    out = []
    for _ in range(count):
        per_rank = [next(it) for it in iterators]
        rows = [
            (inputs["input"][i].tolist(), labels[i].tolist(), inputs["document_ids"][i].tolist())
            for inputs, labels in per_rank
            for i in range(len(labels))
        ]
        per = 4 // dp
        out.append([rows[(p % dp) * per + p // dp] for p in range(4)])  # position order
    return out


def test_global_batches_do_not_depend_on_dp():
    one = _global_batches(1, 6)
    two = _global_batches(2, 6)
    assert one == two
    assert one[0] != one[1]


def test_exact_resume_of_sft_data():
    expected = _batches(_loader(TINY_SFT, seq_len=96), 30)
    first = _loader(TINY_SFT, seq_len=96)
    assert _same(_batches(first, 11), expected[:11])
    state = first.state_dict()
    resumed = _loader(TINY_SFT, seq_len=96)
    resumed.load_state_dict(state)
    assert _same(_batches(resumed, 19), expected[11:])
    assert (
        max(cursor[0] for cursor in resumed.state_dict()["shards"].values()) >= 1
    )  # crossed an epoch


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b)
    )


def test_finite_sft_loader_ends_with_the_shortest_shard_of_whole_windows():
    _, samples = load_documents("sft", str(TINY_SFT))
    per_shard = [
        len(_expected_windows(list(samples[s::2]), 129, ByteTokenizer().pad_id)) for s in (0, 1)
    ]
    loader = _loader(TINY_SFT, seq_len=128, data_shards=2, local_batch_size=1, infinite=False)
    assert len(list(loader)) == 2 * min(per_shard) > 0
    assert len(list(loader)) == 2 * min(per_shard)  # every pass starts over


# ---- bad input


def _error(tmp_path, rows, tokenizer=None, **job_overrides) -> str:
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    args = [
        "--training.dataset",
        "sft",
        "--training.dataset_path",
        str(path),
        "--training.data_shards",
        "1",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "1",
    ]
    job = ConfigManager().parse_args(args)
    with pytest.raises(ConfigError) as info:
        next(iter(build_dataloader(job.training, None, tokenizer or ByteTokenizer())))
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None
    return message


GOOD = {"prompt": "q", "completion": "a"}


@pytest.mark.parametrize(
    "row, expected",
    [
        (
            {"text": "plain"},
            r"line 2: no 'messages' or 'prompt'/'completion' field \(keys: 'text'\)",
        ),
        (
            '{"prompt": "a", "completion": ',
            r"line 2: invalid JSON \(Expecting value at column 30\)",
        ),
        ({"prompt": "a"}, r"line 2: 'completion' must be a string"),
        ({"prompt": "a", "completion": "  "}, r"line 2: empty 'completion'"),
        (
            _messages(("user", "q"), ("assistant", "")),
            r"line 2: messages\[1\] is an assistant message with empty",
        ),
        (_messages(("user", "q")), r"line 2: 'messages' has no assistant message"),
        (
            _messages(("robot", "q"), ("assistant", "a")),
            r"line 2: messages\[0\] must be \{\"role\": one of system",
        ),
        ({"messages": []}, r"line 2: 'messages' must be a non-empty list"),
        ([1, 2], r"line 2: expected a JSON object, got list"),
    ],
)
def test_bad_lines_name_the_file_line_and_field(tmp_path, row, expected):
    message = _error(tmp_path, [GOOD, row])
    assert message.startswith(f"training.dataset_path: {tmp_path / 'bad.jsonl'} line 2: ")
    assert re.search(expected, message), message


def test_missing_dataset_path_is_a_config_error():
    job = ConfigManager().parse_args(["--training.dataset", "chat"])
    with pytest.raises(
        ConfigError, match=r"^training.dataset_path: dataset 'chat' reads local files"
    ):
        build_dataloader(job.training, None, ByteTokenizer())


def test_hf_tokenizer_without_chat_template(chatml_dir, tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((chatml_dir / "tokenizer.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    message = _error(tmp_path, [GOOD], tokenizer=HuggingFaceTokenizer(folder))
    assert (
        message.startswith("model.tokenizer_path: the tokenizer in ")
        and "has no chat template" in message
    )


def _hf_with_template(chatml_dir: Path, folder: Path, template: str) -> HuggingFaceTokenizer:
    folder.mkdir()
    (folder / "tokenizer.json").write_text((chatml_dir / "tokenizer.json").read_text())
    (folder / "chat_template.jinja").write_text(template)
    return HuggingFaceTokenizer(folder)


def test_template_that_is_not_incremental_is_refused(chatml_dir, tmp_path):
    counted = "{{ messages | length }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    message = _error(
        tmp_path, [GOOD], tokenizer=_hf_with_template(chatml_dir, tmp_path / "t", counted)
    )
    assert message.startswith("model.tokenizer_path: the chat template does not render ")
    assert "bad.jsonl line 1 turn by turn" in message


def test_template_errors_name_the_sample(chatml_dir, tmp_path):
    strict = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('needs a system message') }}{% endif %}"
    )
    message = _error(
        tmp_path, [GOOD], tokenizer=_hf_with_template(chatml_dir, tmp_path / "t", strict)
    )
    assert message.startswith(
        f"training.dataset_path: {tmp_path / 'bad.jsonl'} line 1: the chat template"
    )
    assert message.endswith("fails on this sample: needs a system message")


def test_template_runs_in_a_sandbox(chatml_dir, tmp_path):
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    message = _error(
        tmp_path, [GOOD], tokenizer=_hf_with_template(chatml_dir, tmp_path / "t", escape)
    )
    assert "fails on this sample" in message and "unsafe" in message


def test_template_that_does_not_compile(chatml_dir, tmp_path):
    message = _error(
        tmp_path, [GOOD], tokenizer=_hf_with_template(chatml_dir, tmp_path / "t", "{% for %}")
    )
    assert message.startswith("model.tokenizer_path: the chat template does not compile: ")


def test_first_token_of_a_sample_is_never_trained(chatml_dir, tmp_path):
    """Even when the template puts nothing before an assistant message, a packed sample's first
    token is not predicted from the sample or padding before it."""
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = _hf_with_template(chatml_dir, tmp_path / "t", bare)
    encoded = ChatEncoder(tok)(
        _sample(("assistant", "The answer"), ("user", "is"), ("assistant", "42"))
    )
    assert encoded.targets[0] is False and encoded.targets[1] is True
