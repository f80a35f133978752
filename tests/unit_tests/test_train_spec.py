import pytest

from tests.launcher import read_metrics, run_torchrun
from tests.parity import DEBUG_TOML
from torchtitan.config import ConfigManager
from torchtitan.protocols import apply_to_train_specs, get_train_spec, register_train_spec
from torchtitan.protocols.model_converter import ModelConvertersContainer, register_model_converter


def test_unknown_model_lists_registered():
    with pytest.raises(
        ValueError, match=r"model.name: unknown model 'llama4'.*registered: .*llama3"
    ):
        get_train_spec("llama4")


def test_unknown_flavor_lists_flavors():
    with pytest.raises(ValueError, match=r"model.flavor: unknown flavor '9B'.*debugmodel"):
        get_train_spec("llama3").flavor_args("9B")


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_train_spec(get_train_spec("llama3"))


def test_flavor_args_are_copies():
    spec = get_train_spec("llama3")
    args = spec.flavor_args("debugmodel")
    args.vocab_size = 7
    assert spec.model_args["debugmodel"].vocab_size != 7


def test_apply_to_train_specs_rewrites_builders():
    spec = get_train_spec("llama3")
    original = spec.build_optimizers_fn
    calls = []

    def wrap(s):
        def build(*a, **k):
            calls.append(1)
            return original(*a, **k)

        s.build_optimizers_fn = build
        return s

    try:
        apply_to_train_specs(wrap)
        get_train_spec("llama3").build_optimizers_fn(
            [__import__("torch").nn.Linear(1, 1)], ConfigManager().parse_args([]).optimizer, None
        )
        assert calls == [1]
    finally:
        spec.build_optimizers_fn = original


class _Recorder:
    seen = []

    def __init__(self, settings, parallel_dims):
        pass

    def convert(self, model):
        _Recorder.seen.append(type(model).__name__)

    def post_optimizer_hook(self, model_parts):
        pass


def test_model_converters_apply_in_order_and_reject_unknown():
    register_model_converter(_Recorder, "recorder_for_test")
    config = ConfigManager().parse_args(["--model.converters", "recorder_for_test"])
    ModelConvertersContainer(config, None).convert(__import__("torch").nn.Linear(1, 1))
    assert _Recorder.seen == ["Linear"]
    bad = ConfigManager().parse_args(["--model.converters", "float9"])
    with pytest.raises(ValueError, match="model.converters: unknown converter"):
        ModelConvertersContainer(bad, None)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_custom_import_registers_and_trains_a_user_model(tmp_path):
    run_torchrun(
        1,
        [
            "--job.config_file",
            DEBUG_TOML,
            "--experimental.custom_import",
            "tests.unit_tests.custom_model_example",
            "--model.name",
            "my_llama",
            "--model.flavor",
            "micro",
            "--training.steps",
            "2",
            "--metrics.log_freq",
            "1",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ],
        timeout=110,
    )
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
