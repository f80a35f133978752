import json
import logging
import random

import pytest
import torch

from torchtitan.data import (
    DatasetConfig,
    corpus_fingerprint,
    get_dataset_config,
    load_documents,
    register_dataset,
    registered_datasets,
    stdlib,
)
from torchtitan.data.loader import build_dataloader, build_text_dataloader
from torchtitan.data.shards import StreamedDocuments
from torchtitan.data.tokenizers import ByteTokenizer

TINY_DOCS = [
    "alpha beta",
    "",
    "gamma",
    "delta epsilon zeta",
    "eta",
    "theta iota kappa lambda",
    "mu",
    "nu xi",
]


class _Stream:
    """A re-iterable that is not indexable: the loader has to treat it as a stream."""

    def __init__(self, documents):
        self._documents = documents

    def __iter__(self):
        return iter(self._documents)


def _random_docs(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(0, 60))) for _ in range(count)
    ]


register_dataset("test_tiny", DatasetConfig("test_tiny", lambda path: TINY_DOCS))
register_dataset("test_random", DatasetConfig("test_random", lambda path: _random_docs(40)))
register_dataset(
    "test_random_stream",
    DatasetConfig("test_random_stream", lambda path: _Stream(_random_docs(40))),
)


def _loader(dataset="test_tiny", **overrides):
    kwargs = dict(
        dataset=dataset,
        dataset_path=None,
        tokenizer=ByteTokenizer(),
        seq_len=8,
        local_batch_size=2,
        dp_rank=0,
        dp_degree=1,
        data_shards=2,
    )
    return build_text_dataloader(**{**kwargs, **overrides})


def _windows(loader, batches: int) -> list[list[int]]:
    out, it = [], iter(loader)
    for _ in range(batches):
        inputs, labels = next(it)
        out += [[*x, y[-1]] for x, y in zip(inputs["input"].tolist(), labels.tolist(), strict=True)]
    return out


# ---- embedded corpus


def test_stdlib_corpus_excludes_tests_and_splits_disjointly():
    train, validation = stdlib.split_files("train"), stdlib.split_files("validation")
    everything = sorted(train + validation)
    assert list(validation) == everything[:: stdlib.VALIDATION_EVERY] and len(validation) > 20
    assert list(stdlib._all_files()) == everything and len(set(everything)) == len(everything)
    for relative in everything:
        *dirs, name = relative.split("/")
        assert name.endswith(".py") and not name.startswith("test_")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(dirs)
    assert "argparse.py" in everything


def test_stdlib_walk_prunes_exactly_what_the_definition_excludes(tmp_path, monkeypatch):
    """The pruning walk lists what a full ``rglob("*.py")`` filtered by the rules lists (on a
    made-up tree: walking the real one cold costs minutes on a slow disk)."""
    for relative in [
        "a.py", "b.txt", "test_a.py", "pkg/x.py", "pkg/tests/y.py", "pkg/sub/z.py",
        "site-packages/big/m.py", "test/t.py", "idlelib/idle_test/i.py", "dir.py/inner.py",
    ]:  # fmt: skip
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("x = 1\n")
    (tmp_path / "linked.py").symlink_to(tmp_path / "a.py")
    monkeypatch.setattr(stdlib, "stdlib_root", lambda: tmp_path)
    stdlib._all_files.cache_clear()
    try:
        listed = stdlib._all_files()
    finally:
        stdlib._all_files.cache_clear()
    every_py = (p.relative_to(tmp_path) for p in tmp_path.rglob("*.py") if p.is_file())
    assert list(listed) == sorted(r.as_posix() for r in every_py if stdlib._is_corpus_file(r))
    assert listed == ("a.py", "dir.py/inner.py", "linked.py", "pkg/sub/z.py", "pkg/x.py")


def test_stdlib_documents_and_fingerprint(caplog):
    stdlib._log_corpus.cache_clear()
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        _, documents = load_documents("python_stdlib", None)
    assert f"corpus fingerprint {corpus_fingerprint('train')}" in caplog.text
    assert len(documents) == len(stdlib.split_files("train"))
    assert isinstance(documents[0], str) and documents[0] == documents[0]
    fingerprint = corpus_fingerprint("validation")
    assert len(fingerprint) == 12 and fingerprint != corpus_fingerprint("train")
    int(fingerprint, 16)


# ---- registry


def test_unknown_dataset_lists_registered_names():
    with pytest.raises(
        ValueError, match=r"training.dataset: unknown dataset 'nope'.*python_stdlib.*test_tiny"
    ):
        get_dataset_config("nope")
    with pytest.raises(ValueError, match=r"validation.dataset: unknown dataset 'nope'"):
        _loader(dataset="nope", section="validation")
    assert {
        "c4",
        "c4_validation",
        "json",
        "jsonl",
        "parquet",
        "txt",
        "python_stdlib_validation",
    } <= set(registered_datasets())


def test_dataset_path_rules(tmp_path):
    with pytest.raises(
        ValueError, match=r"training.dataset_path: dataset 'python_stdlib' does not read a path"
    ):
        load_documents("python_stdlib", str(tmp_path))
    with pytest.raises(
        ValueError, match=r"training.dataset_path: dataset 'jsonl' reads local files"
    ):
        load_documents("jsonl", None)
    with pytest.raises(FileNotFoundError, match=r"training.dataset_path: .*does not exist"):
        load_documents("jsonl", str(tmp_path / "missing.jsonl"))
    with pytest.raises(
        FileNotFoundError, match=r"validation.dataset_path: .*contains no files ending in .parquet"
    ):
        load_documents("parquet", str(tmp_path), section="validation")


# ---- local files (HuggingFace datasets)


def test_jsonl_directory(tmp_path):
    for name, texts in (("b.jsonl", ["third", "fourth"]), ("a.jsonl", ["first", "second"])):
        (tmp_path / name).write_text(
            "".join(json.dumps({"text": t, "id": 1}) + "\n" for t in texts)
        )
    (tmp_path / "ignored.csv").write_text("x\n")
    config, documents = load_documents("jsonl", str(tmp_path))
    texts = [config.text_processor(documents[i]) for i in range(len(documents))]
    assert texts == ["first", "second", "third", "fourth"]


def test_hf_streaming_dataset_matches_local_files(tmp_path):
    """The path c4 takes (a streaming HuggingFace IterableDataset) gives the same sequences."""
    import datasets

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _random_docs(24, seed=3)))

    def streaming(_):
        return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)

    text_processor = get_dataset_config("json").text_processor
    register_dataset("test_hf_stream", DatasetConfig("test_hf_stream", streaming, text_processor))
    kwargs = dict(seq_len=16, local_batch_size=2, data_shards=4, dp_degree=2, dp_rank=0)
    expected = _windows(_loader("jsonl", dataset_path=str(path), **kwargs), 12)
    assert _windows(_loader("test_hf_stream", **kwargs), 12) == expected


def test_parquet_and_missing_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["x", "yy", "zzz"]}), tmp_path / "data.parquet")
    config, documents = load_documents("parquet", str(tmp_path / "data.parquet"))
    assert [config.text_processor(d) for d in documents] == ["x", "yy", "zzz"]
    (tmp_path / "bad.json").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(
        ValueError, match=r"training.dataset_path: .*has no 'text' column \(columns: content\)"
    ):
        load_documents("json", str(tmp_path / "bad.json"))
    (tmp_path / "broken.jsonl").write_text('{"text": "a"\n')
    with pytest.raises(
        ValueError, match=r"training.dataset_path: cannot read json files .*JSON parse error"
    ):
        load_documents("jsonl", str(tmp_path / "broken.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"training.dataset_path: dataset has no documents"):
        load_documents("jsonl", str(tmp_path / "empty.jsonl"))


def test_txt_file_per_line_and_directory_per_file(tmp_path):
    (tmp_path / "lines.txt").write_text("one\n\ntwo words\n   \nthree\n")
    config, documents = load_documents("txt", str(tmp_path / "lines.txt"))
    assert [config.text_processor(d) for d in documents] == ["one", "two words", "three"]
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second\nfile\n")
    (folder / "sub" / "a.txt").write_text("")
    (folder / "a.txt").write_text("first file\n")
    config, documents = load_documents("txt", str(folder))
    assert [config.text_processor(d) for d in documents] == ["first file\n", "second\nfile\n", ""]


def test_c4_without_network_is_one_clear_error(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ConnectionError, match=r"^training.dataset: cannot reach dataset 'c4'.*python_stdlib"
    ) as info:
        load_documents("c4", None)
    assert info.value.__cause__ is None and info.value.__suppress_context__


# ---- packing


def test_packing_matches_manual_concatenation():
    loader = _loader(data_shards=1)
    stream = [t for doc in TINY_DOCS for t in ByteTokenizer().encode(doc)]
    windows = _windows(loader, 3)
    assert windows == [stream[i * 9 : (i + 1) * 9] for i in range(6)]


def test_batches_are_shifted_long_tensors():
    inputs, labels = next(
        iter(_loader(dataset="python_stdlib", seq_len=32, local_batch_size=3, data_shards=4))
    )
    assert set(inputs) == {"input", "document_ids"}
    assert inputs["input"].shape == labels.shape == inputs["document_ids"].shape == (3, 32)
    assert inputs["input"].dtype == labels.dtype == torch.long
    assert inputs["document_ids"].dtype == torch.int32
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])


def _expected_document_ids(documents: list[str], seq_len: int, windows: int) -> list[list[int]]:
    """Per packed window: the input positions' documents, renumbered from 0 within the window."""
    owners = [d for d, doc in enumerate(documents) for _ in ByteTokenizer().encode(doc)]
    out = []
    for w in range(windows):
        owned = owners[w * (seq_len + 1) : w * (seq_len + 1) + seq_len]
        out.append([sorted(set(owned)).index(owner) for owner in owned])
    return out


def _document_ids(loader, batches: int) -> list[list[int]]:
    it = iter(loader)
    return [row for _ in range(batches) for row in next(it)[0]["document_ids"].tolist()]


def test_document_ids_follow_the_packed_documents():
    """Windows 1 and 2 start inside a document (split across windows); window 0 holds three."""
    expected = _expected_document_ids(TINY_DOCS, seq_len=8, windows=6)
    assert expected[0] == [0, 0, 0, 0, 0, 0, 0, 0] and expected[1] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert _document_ids(_loader(data_shards=1), 3) == expected


class _PipeIsEos(ByteTokenizer):
    """Encodes "|" as EOS, so a text can hold the EOS token."""

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [self.eos_id if t == ord("|") else t for t in super().encode(text, add_bos, add_eos)]


def test_document_ids_do_not_come_from_eos_tokens():
    """An EOS token inside a text is not a boundary; only the packer's documents are."""
    register_dataset("test_eos_text", DatasetConfig("test_eos_text", lambda path: ["a|b", "cd"]))
    loader = _loader(
        "test_eos_text", data_shards=1, seq_len=8, local_batch_size=1, tokenizer=_PipeIsEos()
    )
    inputs, _ = next(iter(loader))
    assert inputs["input"][0, 2] == ByteTokenizer().eos_id
    assert inputs["document_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]


def test_document_ids_resume_mid_document():
    expected = _document_ids(_loader(data_shards=1, local_batch_size=1), 6)
    first = _loader(data_shards=1, local_batch_size=1)
    assert _document_ids(first, 2) == expected[:2]
    state = first.state_dict()
    assert state["shards"]["0"][2] > 0  # the next window starts inside a document
    resumed = _loader(data_shards=1, local_batch_size=1)
    resumed.load_state_dict(state)
    assert _document_ids(resumed, 4) == expected[2:]


def test_streamed_dataset_matches_indexed_across_epochs_and_resume():
    kwargs = dict(seq_len=16, local_batch_size=3, data_shards=4, dp_degree=2, dp_rank=1)
    indexed = _windows(_loader("test_random", **kwargs), 40)
    streamed = _loader("test_random_stream", **kwargs)
    assert _windows(streamed, 25) == indexed[: 25 * 3]
    state = streamed.state_dict()
    assert max(cursor[0] for cursor in state["shards"].values()) >= 1  # crossed an epoch
    resumed = _loader("test_random_stream", **kwargs)
    resumed.load_state_dict(state)
    assert _windows(resumed, 15) == indexed[25 * 3 :]


def test_streamed_finite_matches_indexed():
    kwargs = dict(seq_len=16, local_batch_size=4, data_shards=4, infinite=False)
    assert list(map(tuple, _windows_all(_loader("test_random_stream", **kwargs)))) == list(
        map(tuple, _windows_all(_loader("test_random", **kwargs)))
    )


def _windows_all(loader) -> list[list[int]]:
    return [
        [*x, y[-1]]
        for inputs, labels in loader
        for x, y in zip(inputs["input"].tolist(), labels.tolist(), strict=True)
    ]


def test_stream_cache_only_holds_documents_still_needed():
    source = StreamedDocuments(_Stream(list(range(100))), num_shards=4, shards=[0, 2])
    assert source.get(2, 0, 5) == 22
    assert sorted(source._passes[0].cache) == [
        0,
        4,
        8,
        12,
        16,
        20,
    ]  # shard 0 still needs them; shard 2's are read
    assert [source.get(0, 0, j) for j in range(3)] == [0, 4, 8]
    assert source.get(2, 0, 6) == 26 and source.get(2, 0, 25) is None and source.get(2, 1, 0) == 2


def test_finite_loader_with_too_many_shards_for_its_data():
    with pytest.raises(
        ValueError,
        match=r"validation.dataset 'test_tiny': .*data shards hold less than one sequence",
    ):
        list(_loader(seq_len=64, infinite=False, section="validation"))
    with pytest.raises(
        ValueError, match=r"training.data_shards \(16\) exceeds the number of documents \(8\)"
    ):
        _loader(data_shards=16)
    register_dataset(
        "test_tiny_stream", DatasetConfig("test_tiny_stream", lambda path: _Stream(TINY_DOCS))
    )
    message = (
        r"^training.data_shards \(16\) with dataset 'test_tiny_stream': "
        r"data shard 8 yields no tokens"
    )
    for workers in (0, 2):  # the same one-line error from a worker process
        with pytest.raises(ValueError, match=message + r"[^\n]*$"):
            next(
                iter(
                    _loader(
                        "test_tiny_stream", data_shards=16, local_batch_size=16, num_workers=workers
                    )
                )
            )


def test_bad_loader_arguments():
    with pytest.raises(ValueError, match=r"training.seq_len must be a positive integer, got 0"):
        _loader(seq_len=0)
    with pytest.raises(
        ValueError,
        match=r"training.dataloader.num_workers \(3\) must divide the data shards of each",
    ):
        _loader(num_workers=3)
    with pytest.raises(
        ValueError,
        match=r"validation.dataloader.num_workers: the finite validation loader reads in",
    ):
        _loader(num_workers=2, infinite=False, section="validation")


@pytest.mark.parametrize(
    "option",
    [
        ["--training.dataloader.persistent_workers"],
        ["--validation.dataloader.prefetch_factor", "4"],
    ],
)
def test_worker_options_without_workers_are_refused(option):
    from torchtitan.config import ConfigError, ConfigManager

    section = option[0][2:].split(".")[0]
    with pytest.raises(
        ConfigError, match=rf"^{option[0][2:]}: needs {section}.dataloader.num_workers > 0$"
    ):
        ConfigManager().parse_args(option)
    with pytest.raises(
        ConfigError, match=r"^validation.dataloader.num_workers: the finite validation loader reads"
    ):
        ConfigManager().parse_args(["--validation.dataloader.num_workers", "2"])


def test_build_dataloader_from_job_config():
    from types import SimpleNamespace

    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(
        [
            "--training.dataset",
            "test_random",
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--training.data_shards",
            "4",
            "--validation.dataset",
            "test_random",
            "--validation.seq_len",
            "16",
            "--validation.local_batch_size",
            "4",
        ]
    )
    train = build_dataloader(job.training, None, ByteTokenizer())
    assert next(iter(train))[0]["input"].shape == (2, 16)
    val = build_dataloader(
        job.validation, SimpleNamespace(dp_enabled=False), ByteTokenizer(), split="validation"
    )
    assert val.dataset.state_dict()["data_shards"] == 8
    assert len(list(val)) > 0
    with pytest.raises(ValueError, match="unknown data split 'test'"):
        build_dataloader(job.training, None, ByteTokenizer(), split="test")


@pytest.mark.skipif(
    torch.accelerator.is_available(), reason="pinning works where there is an accelerator"
)
def test_pin_memory_without_accelerator_warns_naming_the_section(caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        _loader(section="validation", pin_memory=True)
    assert "validation.dataloader.pin_memory: no accelerator" in caplog.text
    assert "training.dataloader" not in caplog.text
