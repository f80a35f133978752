"""Weighted mixtures of sources and shuffled token stores: exact proportions at every step,
the same global batches under every dp degree, exact resume (also resharded), and one clear
line for bad settings."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.data import merge_data_states
from torchtitan.data.blend import Blend
from torchtitan.data.loader import build_dataloader
from torchtitan.data.prepare import DEFAULT_SHARD_TOKENS, prepare
from torchtitan.data.shuffle import BlockShuffle
from torchtitan.data.tokenizers import ByteTokenizer

WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
GLOBAL_BATCH, SEQ_LEN = 8, 16


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    """Three small stores whose tokens tell them apart (each its own alphabet)."""
    root = tmp_path_factory.mktemp("mixture")
    folders = {}
    for name, letter in zip(WEIGHTS, "wcm"):
        source = root / f"{name}.jsonl"
        source.write_text(
            "".join(json.dumps({"text": letter * (20 + i % 13)}) + "\n" for i in range(60))
        )
        args = Namespace(
            dataset=None,
            input=[str(source)],
            dataset_path=None,
            text_field="text",
            tokenizer="byte",
            out=str(root / name),
            workers=1,
            shard_tokens=DEFAULT_SHARD_TOKENS,
        )
        prepare(args, ByteTokenizer)
        folders[name] = root / name
    return folders


def write_config(
    tmp_path: Path, stores: dict[str, Path], extra: str = "", shuffle: str = ""
) -> str:
    tables = "".join(
        f'[[training.dataset_mixture]]\ndataset = "tokens"\ndataset_path = "{stores[n]}"\n'
        f"weight = {w}\n{extra}\n"
        for n, w in WEIGHTS.items()
    )
    path = tmp_path / "mixture.toml"
    path.write_text(f'[training]\ndataset = "mixture"\ndata_shards = 2\n{shuffle}\n{tables}')
    return str(path)


class Layout:
    def __init__(self, rank: int, degree: int) -> None:
        self.rank, self.degree = rank, degree

    def data_layout(self) -> tuple[int, int]:
        return self.rank, self.degree


def loaders(config_file: str | None, dp: int, *flags: str):
    config = ConfigManager().parse_args(
        [
            *(["--job.config_file", config_file] if config_file else []),
            *flags,
            "--training.seq_len",
            str(SEQ_LEN),
            "--training.local_batch_size",
            str(GLOBAL_BATCH // dp),
            "--training.global_batch_size",
            str(GLOBAL_BATCH),
        ]
    )
    return [build_dataloader(config.training, Layout(r, dp), ByteTokenizer()) for r in range(dp)]


def global_batches(rank_loaders, steps: int) -> list[list[tuple]]:
    """Each step's global batch as a sorted list of samples (the set the step trains on)."""
    iterators = [iter(loader) for loader in rank_loaders]
    batches = []
    for _ in range(steps):
        samples = [tuple(row) for it in iterators for row in next(it)[0]["input"].tolist()]
        batches.append(sorted(samples))
    return batches


def source_of(sample: tuple) -> str:
    letter = next(chr(t) for t in sample if t < 256 and chr(t) in "wcm")
    return {"w": "web", "c": "code", "m": "math"}[letter]


def test_every_step_takes_each_source_within_one_sample_of_its_weight():
    blend = Blend(list(WEIGHTS.values()), GLOBAL_BATCH, [None] * 3)
    for step in range(1, 1001):
        counts = blend.counts_before(step)
        for count, weight in zip(counts, WEIGHTS.values()):
            assert abs(count - weight * GLOBAL_BATCH * step) < 1, (step, counts)


def test_the_global_batches_are_the_same_under_every_dp_degree(stores, tmp_path):
    config = write_config(tmp_path, stores)
    reference = global_batches(loaders(config, 1), 40)
    for dp in (2, 4):
        assert global_batches(loaders(config, dp), 40) == reference
    counts = {name: 0 for name in WEIGHTS}
    for step, batch in enumerate(reference, 1):
        for sample in batch:
            counts[source_of(sample)] += 1
        for name, weight in WEIGHTS.items():
            assert abs(counts[name] - weight * GLOBAL_BATCH * step) < 1


def test_resume_at_step_500_under_another_dp_degree_is_exact(stores, tmp_path):
    config = write_config(tmp_path, stores)
    reference = global_batches(loaders(config, 1), 510)[500:]
    first = loaders(config, 2)
    global_batches(first, 500)
    state = merge_data_states([loader.state_dict() for loader in first])
    resumed = loaders(config, 4)
    for loader in resumed:
        loader.load_state_dict(state)
    assert global_batches(resumed, 10) == reference
    assert first[0].metrics() == {
        f"tokens/{name}": round(weight * GLOBAL_BATCH * 500) * SEQ_LEN
        for name, weight in WEIGHTS.items()
    }


def test_a_shuffled_store_is_a_permutation_the_same_on_every_layout(stores, tmp_path):
    """80 steps take 320 / 192 / 128 samples: whole blocks of 16 of each source, so the
    shuffled run trains on exactly the unshuffled run's samples, in another order."""
    config = write_config(tmp_path, stores, shuffle="shuffle_seed = 7\nshuffle_window = 16")
    plain = global_batches(loaders(write_config(tmp_path / "..", stores), 1), 80)
    shuffled = global_batches(loaders(config, 1), 80)
    assert shuffled != plain
    assert sorted(s for b in shuffled for s in b) == sorted(s for b in plain for s in b)
    assert global_batches(loaders(config, 2), 80) == shuffled
    halfway = loaders(config, 2)
    global_batches(halfway, 20)
    state = merge_data_states([loader.state_dict() for loader in halfway])
    resumed = loaders(config, 4)
    for loader in resumed:
        loader.load_state_dict(state)
    assert global_batches(resumed, 60) == shuffled[20:]


def test_two_workers_give_the_same_batches_and_resume_exactly(stores, tmp_path):
    """Stores, a mixture of them, and a mixture with a text source: 2 loader workers per rank
    give the batches of 0 workers, and their state (what was taken, not what the workers
    prefetched) resumes exactly under another dp degree and worker count."""
    text_source = (
        "dataset=tokens,dataset_path={web},weight=0.5;dataset=python_stdlib,weight=0.5"
    ).format(**stores)
    configs = {
        "store": [
            *("--training.dataset", "tokens", "--training.dataset_path", str(stores["web"])),
            *("--training.data_shards", "2"),
        ],
        "mixture": ["--job.config_file", write_config(tmp_path, stores)],
        "text source": ["--training.mixture", text_source, "--training.data_shards", "8"],
    }
    workers = ["--training.dataloader.num_workers", "2"]
    for name, flags in configs.items():
        reference = global_batches(loaders(None, 1, *flags), 12)
        first = loaders(None, 2, *flags, *workers)
        assert global_batches(first, 7) == reference[:7], name
        state = merge_data_states([loader.state_dict() for loader in first])
        assert state["next_position"] == 7 * GLOBAL_BATCH, name
        for dp, more in ((4, workers), (1, [])):
            resumed = loaders(None, dp, *flags, *more)
            for loader in resumed:
                loader.load_state_dict(state)
            assert global_batches(resumed, 5) == reference[7:], (name, dp)
            for loader in resumed:
                loader.close()
        for loader in first:
            loader.close()


def test_a_mixture_on_the_command_line_equals_the_same_mixture_in_toml(stores, tmp_path):
    flag = ";".join(
        f"dataset=tokens,dataset_path={stores[name]},weight={weight}"
        for name, weight in WEIGHTS.items()
    )
    from_toml = loaders(write_config(tmp_path, stores), 2)
    from_flag = loaders(None, 2, "--training.mixture", flag, "--training.data_shards", "2")
    toml_iterators = [iter(loader) for loader in from_toml]
    flag_iterators = [iter(loader) for loader in from_flag]
    for _ in range(25):
        for toml_it, flag_it in zip(toml_iterators, flag_iterators, strict=True):
            assert (next(toml_it)[0]["input"] == next(flag_it)[0]["input"]).all()
        assert from_toml[0].metrics() == from_flag[0].metrics()  # per-source counts, every step
    assert sum(from_flag[0].metrics().values()) == 25 * GLOBAL_BATCH * SEQ_LEN


@pytest.mark.parametrize(
    "flag, message",
    [
        ("dataset=tokens,weigth=1", r"^training.mixture: source 0 .*: unknown key 'weigth'"),
        ("dataset tokens", r"^training.mixture: source 0 .*: 'dataset tokens' is not key=value"),
        ("dataset=tokens,weight=heavy", r"^training.mixture: source 0 .*: weight must be a number"),
        (" ; ", r"^training.mixture: no sources"),
        ("dataset=tokens,weight=0", r"^training.dataset_mixture\[0\]\.weight: must be > 0"),
    ],
)
def test_a_malformed_mixture_flag_is_one_line(flag, message):
    with pytest.raises(ConfigError, match=message) as error:
        ConfigManager().parse_args(["--training.mixture", flag])
    assert "\n" not in str(error.value)


def test_block_shuffle_is_a_bijection_per_block():
    for window in (1, 5, 16, 1000):
        shuffle = BlockShuffle(3, window)
        for block in range(3):
            span = range(block * window, (block + 1) * window)
            assert sorted(shuffle(p) for p in span) == list(span)
    assert [BlockShuffle(3, 1000)(p) for p in range(5)] != [
        BlockShuffle(4, 1000)(p) for p in range(5)
    ]


def test_an_exhausted_source_hands_its_share_to_the_others(stores, tmp_path):
    config = write_config(tmp_path, stores)
    path = Path(config)
    path.write_text(path.read_text().replace("weight = 0.2\n", "weight = 0.2\nmax_epochs = 0.05\n"))
    batches = global_batches(loaders(config, 1), 60)
    math_per_step = [sum(source_of(s) == "math" for s in batch) for batch in batches]
    assert math_per_step[0] == 2 and math_per_step[-1] == 0 and sum(math_per_step) > 0


def test_a_text_dataset_can_be_a_source(stores, tmp_path):
    path = tmp_path / "text.toml"
    path.write_text(
        '[training]\ndataset = "mixture"\ndata_shards = 2\n'
        '[[training.dataset_mixture]]\ndataset = "tokens"\n'
        f'dataset_path = "{stores["web"]}"\nweight = 0.5\n'
        '[[training.dataset_mixture]]\ndataset = "python_stdlib"\nweight = 0.5\n'
    )
    reference = global_batches(loaders(str(path), 1), 6)
    assert global_batches(loaders(str(path), 2), 6) == reference
    only_w = {ord("w"), 256, 257}  # the web store's letter, BOS, EOS
    assert [sum(set(sample) <= only_w for sample in batch) for batch in reference] == [4] * 6


def test_a_text_source_is_read_in_each_rank_s_own_data_shards_alone(stores, tmp_path):
    """An hf source of 4 data shards (contiguous rows: shard s is written in the letter
    'abcd'[s]) beside a store: under dp 2, rank r's text samples come from its shards r and
    r + 2 alone, its state holds their cursors alone, and the global batches are one
    process's."""
    folder = tmp_path / "letters"
    folder.mkdir()
    (folder / "train.jsonl").write_text(
        "".join(json.dumps({"text": "abcd"[i // 10] * (12 + i % 7)}) + "\n" for i in range(40))
    )
    mixture = (
        f"dataset=tokens,dataset_path={stores['web']},weight=0.5;"
        f"dataset=hf,dataset_path={folder},weight=0.5"
    )
    flags = ["--training.mixture", mixture, "--training.data_shards", "4"]
    reference = global_batches(loaders(None, 1, *flags), 6)
    ranks = loaders(None, 2, *flags)
    letters_read = []
    for loader in ranks:
        rows = [row for _, batch in zip(range(6), loader) for row in batch[0]["input"].tolist()]
        letters_read.append({chr(t) for row in rows for t in row if chr(t) in "abcd"})
    assert letters_read == [{"a", "c"}, {"b", "d"}]
    assert [sorted(loader.state_dict()["sources"]["letters"]["shards"]) for loader in ranks] == [
        ["0", "2"],
        ["1", "3"],
    ]
    assert global_batches(loaders(None, 2, *flags), 6) == reference
    with pytest.raises(
        ConfigError,
        match=r"^training.data_shards \(4\) must be divisible by the data-parallel degree \(8\) "
        "for the text source 'letters'",
    ):
        loaders(None, 8, *flags)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.replace("weight = 0.5", "weight = 0"),
            r"dataset_mixture\[0\]\.weight: must be > 0",
        ),
        (
            lambda t: t.replace("weight = 0.5", "weight = -1"),
            r"dataset_mixture\[0\]\.weight: must be > 0",
        ),
        (lambda t: t.replace('dataset = "mixture"', 'dataset = "tokens"'), "set both or neither"),
        (lambda t: t.replace("code", "web"), "two sources are named 'web'"),
    ],
)
def test_bad_mixture_settings_are_one_line(stores, tmp_path, edit, message):
    path = Path(write_config(tmp_path, stores))
    path.write_text(edit(path.read_text()))
    with pytest.raises(ConfigError, match=message) as error:
        ConfigManager().parse_args(["--job.config_file", str(path)])
    assert "\n" not in str(error.value)


def test_a_missing_source_is_refused_before_launch(stores, tmp_path):
    from torchtitan.preflight import check_inputs

    path = Path(write_config(tmp_path, stores))
    path.write_text(path.read_text().replace(str(stores["code"]), str(tmp_path / "gone")))
    config = ConfigManager().parse_args(["--job.config_file", str(path)])
    with pytest.raises(
        ConfigError, match=r"^training.dataset_mixture\[1\]\.dataset_path: .*does not exist"
    ):
        check_inputs(config, "cpu")


def test_shuffling_a_text_dataset_is_refused():
    with pytest.raises(
        ConfigError, match=r"^training.shuffle_seed: shuffling reads sequences out of order"
    ):
        ConfigManager().parse_args(["--training.shuffle_seed", "3"])


def test_a_resume_with_other_data_shards_is_refused(stores, tmp_path):
    config = write_config(tmp_path, stores)
    first = loaders(config, 1)
    global_batches(first, 3)
    state = first[0].state_dict()
    Path(config).write_text(Path(config).read_text().replace("data_shards = 2", "data_shards = 4"))
    with pytest.raises(
        ValueError,
        match=r"^data state: source 'web' was saved with data_shards 2; "
        r"this run has data_shards 4",
    ):
        loaders(config, 1)[0].load_state_dict(state)
