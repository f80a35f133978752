"""Any Hugging Face dataset as a source (``dataset = "hf"``): the same documents give the same
token stream from parquet, a ``save_to_disk`` folder and jsonl; a rank reads only its data
shards; streaming resumes exactly under another dp degree and worker count; bad input is one
line."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchtitan.config import ConfigError, HFDatasetConfig
from torchtitan.data import hf_source, merge_data_states
from torchtitan.data.loader import build_text_dataloader
from torchtitan.data.tokenizers import ByteTokenizer

DOCUMENTS = [f"document {i}: " + "lorem ipsum " * (i % 11 + 1) for i in range(240)]
SEQ_LEN, GLOBAL_BATCH = 32, 8


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    """Map-style loads write Arrow caches: into the test's folder, not ~/.cache/huggingface."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The same documents as 3 parquet files, one jsonl file, 8 parquet files and a
    save_to_disk folder."""
    root = tmp_path_factory.mktemp("hf")
    (root / "jsonl").mkdir()
    with open(root / "jsonl" / "data.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(DOCUMENTS))
    for name, files in (("parquet", 3), ("parquet8", 8)):
        (root / name).mkdir()
        size = len(DOCUMENTS) // files
        for k in range(files):
            part = DOCUMENTS[k * size : (k + 1) * size]
            pq.write_table(pa.table({"text": part}), root / name / f"part-{k:02d}.parquet")
    datasets.Dataset.from_dict({"text": DOCUMENTS}).save_to_disk(str(root / "saved"))
    return {name: root / name for name in ("jsonl", "parquet", "parquet8", "saved")}


def loader(path: Path, dp: int = 1, rank: int = 0, shards: int = 8, **options):
    workers = options.pop("num_workers", 0)
    return build_text_dataloader(
        dataset="hf",
        dataset_path=str(path),
        tokenizer=ByteTokenizer(),
        seq_len=SEQ_LEN,
        local_batch_size=GLOBAL_BATCH // dp,
        dp_rank=rank,
        dp_degree=dp,
        data_shards=shards,
        num_workers=workers,
        hf=HFDatasetConfig(**options),
    )


def global_batches(loaders, steps: int) -> list[list[tuple[int, ...]]]:
    iterators = [iter(each) for each in loaders]
    batches = []
    for _ in range(steps):
        batches.append([tuple(row) for it in iterators for row in next(it)[0]["input"].tolist()])
    return batches


def stream_hash(batches) -> str:
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()


def test_parquet_save_to_disk_and_jsonl_give_the_same_token_stream(folders):
    reference = stream_hash(global_batches([loader(folders["jsonl"])], 20))
    for name in ("parquet", "saved"):
        assert stream_hash(global_batches([loader(folders[name])], 20)) == reference, name
    streamed = global_batches([loader(folders["saved"], streaming=True)], 20)
    assert stream_hash(streamed) == reference  # a saved folder streams in its map-style order
    planted = DOCUMENTS[:5] + ["a changed document"] + DOCUMENTS[6:]
    with open(folders["jsonl"].parent / "changed.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in planted)
    changed = global_batches([loader(folders["jsonl"].parent / "changed.jsonl")], 20)
    assert stream_hash(changed) != reference


def test_global_batches_do_not_depend_on_dp(folders):
    for streaming, name in ((False, "parquet"), (True, "parquet8")):
        reference = global_batches([loader(folders[name], streaming=streaming)], 6)
        for dp in (2, 4):
            ranks = [loader(folders[name], dp, r, streaming=streaming) for r in range(dp)]
            assert as_sets(global_batches(ranks, 6)) == as_sets(reference)


def test_a_rank_reads_only_its_data_shards(folders, monkeypatch):
    rows: list[int] = []
    original = hf_source.HFDocuments.row
    monkeypatch.setattr(
        hf_source.HFDocuments, "row", lambda self, i: rows.append(i) or original(self, i)
    )
    global_batches([loader(folders["parquet"], dp=4, rank=1)], 10)
    mine = {row for s in (1, 5) for row in hf_source.contiguous_range(len(DOCUMENTS), 8, s)}
    assert rows and set(rows) <= mine
    opened: list[int] = []
    original_rows = hf_source.HFDocuments.rows
    monkeypatch.setattr(
        hf_source.HFDocuments,
        "rows",
        lambda self, stream, n, shard, skip=0: (
            opened.append(shard) or original_rows(self, stream, n, shard, skip)
        ),
    )
    global_batches([loader(folders["parquet8"], dp=4, rank=1, streaming=True)], 10)
    assert set(opened) == {1, 5}  # the files of data shards 1 and 5 only


def as_sets(batches) -> list[list[tuple[int, ...]]]:
    """Each global batch as the sorted samples it holds (the set a step trains on)."""
    return [sorted(batch) for batch in batches]


def test_streaming_resume_is_exact_under_another_dp_and_worker_count(folders):
    path = folders["parquet8"]
    uninterrupted = global_batches([loader(path, 2, r, streaming=True) for r in range(2)], 16)
    one_process = global_batches([loader(path, streaming=True)], 16)
    assert as_sets(uninterrupted) == as_sets(one_process)
    first = [loader(path, 2, r, streaming=True) for r in range(2)]
    global_batches(first, 10)
    states = [each.state_dict() for each in first]
    resumed = [loader(path, 2, r, streaming=True) for r in range(2)]
    for each, state in zip(resumed, states, strict=True):
        each.load_state_dict(state)
    assert global_batches(resumed, 6) == uninterrupted[10:]  # bitwise: same ranks, same order
    merged = merge_data_states(states)
    wider = [loader(path, 4, r, streaming=True) for r in range(4)]
    for each in wider:
        each.load_state_dict(merged)
    assert as_sets(global_batches(wider, 6)) == as_sets(uninterrupted[10:])
    with_workers = [loader(path, 2, r, streaming=True, num_workers=2) for r in range(2)]
    for each in with_workers:
        each.load_state_dict(merged)
    assert global_batches(with_workers, 6) == uninterrupted[10:]
    for each in with_workers:
        each.close()


def test_a_messages_column_trains_like_the_sft_dataset(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{i}+{i}?"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(40)
    ]
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    common = dict(
        tokenizer=ByteTokenizer(), seq_len=SEQ_LEN, local_batch_size=4, dp_rank=0, dp_degree=1
    )
    sft = next(
        iter(
            build_text_dataloader(
                dataset="sft", dataset_path=str(tmp_path / "chat.jsonl"), data_shards=1, **common
            )
        )
    )
    hf = next(
        iter(
            build_text_dataloader(
                dataset="hf",
                dataset_path=str(tmp_path / "chat.parquet"),
                data_shards=1,
                hf=HFDatasetConfig(messages_column="messages"),
                **common,
            )
        )
    )
    assert (sft[1] == hf[1]).all() and (sft[0]["input"] == hf[0]["input"]).all()
    assert (hf[1] == -100).any()  # the prompts are not trained


def _error(path, **options) -> str:
    shards = options.pop("shards", 8)
    with pytest.raises(ConfigError) as error:
        build_text_dataloader_with_config_errors(path, shards, **options)
    message = str(error.value)
    assert "\n" not in message
    return message


def build_text_dataloader_with_config_errors(path, shards, **options):
    """The loader as the trainer builds it: data errors become one ConfigError line."""
    from torchtitan.config import ConfigManager
    from torchtitan.data.loader import build_dataloader

    args = ["--training.dataset", "hf", "--training.dataset_path", str(path)]
    args += ["--training.data_shards", str(shards), "--training.seq_len", str(SEQ_LEN)]
    for key, value in options.items():
        args += (
            [f"--training.hf.{key}", str(value)] if value is not True else [f"--training.hf.{key}"]
        )
    config = ConfigManager().parse_args(args)
    return next(iter(build_dataloader(config.training, None, ByteTokenizer())))


def test_bad_input_is_one_line(folders, tmp_path, monkeypatch):
    assert _error(folders["parquet"], text_column="body").startswith(
        "training.hf.text_column: dataset "
    )
    assert "no column 'body' (columns: text)" in _error(folders["parquet"], text_column="body")
    assert _error(folders["parquet"], split="validation").startswith("training.hf.split: ")
    assert _error(folders["parquet"], name="sample-10BT").startswith("training.hf.name: ")
    assert _error(folders["parquet"], streaming=True, shards=8).startswith(
        "training.data_shards (8) exceeds the 3 file shards"
    )
    assert re.match(
        r"training.hf.messages_column: '.*parquet' row 0: 'messages' must be a non-empty list",
        _error(folders["parquet"], messages_column="text"),
    )
    assert re.match(r"training.dataset_path: '.*/gone' does not exist$", _error(tmp_path / "gone"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "part-0.parquet").write_text("this is not parquet")
    assert "is not a readable parquet file" in _error(broken)
    monkeypatch.setattr(hf_source, "_hub_reachable", lambda: False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    message = _error("nobody/not-a-cached-dataset")
    assert message.startswith(
        "training.dataset_path: 'nobody/not-a-cached-dataset' is neither a local folder nor in"
    )
    assert "offline" in message


@pytest.mark.parametrize("streaming", [False, True])
def test_prepare_writes_the_same_store_from_the_hf_source(folders, tmp_path, streaming):
    from argparse import Namespace

    from torchtitan.data.prepare import DEFAULT_SHARD_TOKENS, prepare

    def store(name: str, **source) -> list[str]:
        args = Namespace(
            **{"dataset": None, "input": None, "dataset_path": None, **source},
            text_field="text",
            tokenizer="byte",
            out=str(tmp_path / name),
            workers=1,
            shard_tokens=DEFAULT_SHARD_TOKENS,
            streaming=streaming,
        )
        return [shard["sha256"] for shard in prepare(args, ByteTokenizer).shards]

    from_jsonl = store("jsonl", input=[str(folders["jsonl"] / "data.jsonl")])
    from_hf = store("hf", dataset="hf", dataset_path=str(folders["parquet"]))
    assert from_hf == from_jsonl


def test_an_hf_source_in_a_mixture_with_workers_resumes_exactly(folders, tmp_path):
    from argparse import Namespace

    from torchtitan.config import ConfigManager
    from torchtitan.data.loader import build_dataloader
    from torchtitan.data.prepare import DEFAULT_SHARD_TOKENS, prepare

    store = tmp_path / "store"
    args = Namespace(
        dataset=None,
        input=[str(folders["jsonl"] / "data.jsonl")],
        dataset_path=None,
        text_field="text",
        tokenizer="byte",
        out=str(store),
        workers=1,
        shard_tokens=DEFAULT_SHARD_TOKENS,
    )
    prepare(args, ByteTokenizer)
    mixture = (
        f"dataset=tokens,dataset_path={store},weight=0.6;"
        f"dataset=hf,dataset_path={folders['parquet8']},hf.streaming=true,weight=0.4"
    )

    def loaders(dp: int, workers: int):
        config = ConfigManager().parse_args(
            [
                *("--training.mixture", mixture, "--training.data_shards", "8"),
                *("--training.seq_len", str(SEQ_LEN), "--training.global_batch_size", "8"),
                *("--training.local_batch_size", str(GLOBAL_BATCH // dp)),
                *("--training.dataloader.num_workers", str(workers)),
            ]
        )
        return [
            build_dataloader(config.training, _Layout(r, dp), ByteTokenizer()) for r in range(dp)
        ]

    reference = as_sets(global_batches(loaders(1, 0), 10))
    first = loaders(2, 2)
    assert as_sets(global_batches(first, 6)) == reference[:6]
    state = merge_data_states([each.state_dict() for each in first])
    resumed = loaders(4, 2)
    for each in resumed:
        each.load_state_dict(state)
    assert as_sets(global_batches(resumed, 4)) == reference[6:]
    for each in [*first, *resumed]:
        each.close()


class _Layout:
    def __init__(self, rank: int, degree: int) -> None:
        self.rank, self.degree = rank, degree

    def data_layout(self) -> tuple[int, int]:
        return self.rank, self.degree
