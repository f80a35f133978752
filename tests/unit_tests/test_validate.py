"""The validator in one process: token-weighted mean over the whole split, every pass from
the beginning, eval mode only while validating, validation.jsonl."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.layouts import single_process_dims
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.validate import build_validator
from torchtitan.config import ConfigManager
from torchtitan.data import DatasetConfig, register_dataset
from torchtitan.data.tokenizers import ByteTokenizer
from torchtitan.layers.loss import cross_entropy_sum
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer

SEQ_LEN = 16


def _documents() -> list[str]:
    rng = random.Random(0)
    return [
        "".join(rng.choice("abcd efg\n") for _ in range(rng.randint(30, 90))) for _ in range(12)
    ]


register_dataset(
    "test_validation_docs", DatasetConfig("test_validation_docs", lambda path: _documents())
)


def _job_config(tmp_path, steps: int = -1):
    return ConfigManager().parse_args(
        [
            "--validation.enable",
            "--validation.dataset",
            "test_validation_docs",
            "--validation.seq_len",
            str(SEQ_LEN),
            "--validation.local_batch_size",
            "3",  # the split's last batch is smaller
            "--validation.data_shards",
            "2",
            "--validation.steps",
            str(steps),
            "--validation.freq",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )


def _validator(tmp_path, steps: int = -1, metrics_processor=None):
    return build_validator(
        validation=_job_config(tmp_path, steps).validation,
        reset_positions=False,
        parallel_dims=single_process_dims(),
        tokenizer=ByteTokenizer(),
        loss_fn=cross_entropy_sum,
        train_context=contextlib.nullcontext,
        metrics_processor=metrics_processor,
    )


@pytest.fixture(scope="module")
def model() -> Transformer:
    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], max_seq_len=SEQ_LEN)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=3)
    return model


def _reference_loss(model: Transformer, validator) -> tuple[float, int]:
    """Cross-entropy over every token of the split at once."""
    (loader,) = validator.dataloaders.values()
    batches = list(loader)
    inputs = torch.cat([b[0]["input"] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    assert len(batches[-1][1]) < len(batches[0][1]), "the split should end with a smaller batch"
    with torch.no_grad():
        return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item(), labels.numel()


def test_pass_is_the_token_weighted_mean_over_the_whole_split(model, tmp_path) -> None:
    validator = _validator(tmp_path)
    expected, _ = _reference_loss(model, validator)
    record = validator.validate([model], step=2)
    assert record["validation_loss"] == pytest.approx(expected, rel=1e-6)
    assert record["validation_perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)


def test_every_pass_starts_from_the_beginning(model, tmp_path) -> None:
    full = _validator(tmp_path)
    first, second = full.validate([model], 2), full.validate([model], 4)
    assert second["validation_loss"] == first["validation_loss"]  # not empty, same data

    partial = _validator(tmp_path, steps=1)
    one_batch = partial.validate([model], 2)
    assert one_batch["validation_loss"] != first["validation_loss"]
    partial.steps = -1  # a pass cut short leaves nothing behind for the next one
    assert partial.validate([model], 4)["validation_loss"] == first["validation_loss"]


def test_model_is_back_in_train_mode(model, tmp_path) -> None:
    seen_modes = []
    hook = model.register_forward_pre_hook(lambda module, args: seen_modes.append(module.training))
    try:
        model.train()
        _validator(tmp_path, steps=1).validate([model], 2)
    finally:
        hook.remove()
    assert seen_modes == [False] and model.training


def test_writes_validation_jsonl_and_tensorboard(model, tmp_path) -> None:
    scalars = []
    config = _job_config(tmp_path, 1)
    processor = MetricsProcessor(
        config.metrics,
        dump_folder=config.job.dump_folder,
        total_steps=config.training.steps,
        parallel_dims=single_process_dims(),
        device=torch.device("cpu"),
        flops_per_token=0,
        owns_loss=True,
        compute_dtype=torch.float32,
    )
    processor.tb = SimpleNamespace(add_scalar=lambda tag, value, step: scalars.append((tag, step)))
    (tmp_path / "validation.jsonl").write_text(
        '{"step": 2, "validation_loss": 9.0}\n'
    )  # a stale run
    validator = _validator(tmp_path, steps=1, metrics_processor=processor)
    assert [validator.should_validate(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    records = [validator.validate([model], 2), validator.validate([model], 4)]
    lines = (tmp_path / "validation.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    assert set(records[0]) == {"step", "validation_loss", "validation_perplexity"}
    assert scalars == [
        ("validation/loss", 2),
        ("validation/perplexity", 2),
        ("validation/loss", 4),
        ("validation/perplexity", 4),
    ]


register_dataset(
    "test_validation_other_docs",
    DatasetConfig("test_validation_other_docs", lambda path: [d.upper() for d in _documents()]),
)


def test_a_mixture_is_validated_per_source_and_as_their_token_weighted_mean(model, tmp_path):
    config = _job_config(tmp_path).validation
    single = {}
    for dataset in ("test_validation_docs", "test_validation_other_docs"):
        config.dataset = dataset
        validator = _validator(tmp_path)
        validator.dataloaders = build_validator(
            validation=config,
            reset_positions=False,
            parallel_dims=single_process_dims(),
            tokenizer=ByteTokenizer(),
            loss_fn=cross_entropy_sum,
            train_context=contextlib.nullcontext,
        ).dataloaders
        single[dataset] = _reference_loss(model, validator)
    toml = tmp_path / "mixture.toml"
    toml.write_text(
        '[validation]\ndataset = "mixture"\n'
        '[[validation.dataset_mixture]]\ndataset = "test_validation_docs"\nname = "lower"\n'
        '[[validation.dataset_mixture]]\ndataset = "test_validation_other_docs"\nname = "upper"\n'
    )
    mixture = ConfigManager().parse_args(["--job.config_file", str(toml)]).validation
    for field in ("seq_len", "local_batch_size", "data_shards"):
        setattr(mixture, field, getattr(config, field))
    record = build_validator(
        validation=mixture,
        reset_positions=False,
        parallel_dims=single_process_dims(),
        tokenizer=ByteTokenizer(),
        loss_fn=cross_entropy_sum,
        train_context=contextlib.nullcontext,
    ).validate([model], step=2)
    (lower, lower_tokens), (upper, upper_tokens) = single.values()
    assert record["validation_loss/lower"] == pytest.approx(lower, rel=1e-6)
    assert record["validation_loss/upper"] == pytest.approx(upper, rel=1e-6)
    mean = (lower * lower_tokens + upper * upper_tokens) / (lower_tokens + upper_tokens)
    assert record["validation_loss"] == pytest.approx(mean, rel=1e-6)
