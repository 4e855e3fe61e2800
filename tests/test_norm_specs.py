"""Norm specs: the same model as a name plus keywords, validated once, refused where an option does not belong, and
carried through configs and checkpoints as plain data."""

from __future__ import annotations

import dataclasses
import inspect
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import seqnorm
import seqnorm.norms as norms
from seqnorm.cli import SeqnormCLI, main
from seqnorm.lightning import LanguageModel
from seqnorm.lightning.checkpoint_io import CheckpointError, read_checkpoint
from seqnorm.norms import NORM_KEYWORDS, NORMS, NormSpec, spec_from_dict
from seqnorm.norms.specs import default_of, field_names
from tests.conftest import CELLS, LAYERS, run_path
from tests.test_cli import QUIET, WORDS

F64 = {"dtype": torch.float64}
# Two values besides the default for every spec field (`affine` apart: False forbids a gamma_init).
VALUES: dict[str, tuple[Any, Any]] = {
    "eps": (1e-3, 1e-4),
    "momentum": (0.05, 0.3),
    "max_steps": (3, 5),
    "small_batch": ("running", "running"),
    "beyond_max_steps": ("pooled", "pooled"),
    "input_stats": ("sequence", "sequence"),
    "gamma_init": (0.3, 0.7),
    "beta_init": (0.2, -0.1),
    "r_max": (2.0, 1.5),
    "d_max": (1.0, 0.5),
    "warmup": (0, 1),
    "r_max_steps": (3, 4),
    "d_max_steps": (3, 4),
    "mean_only_bn": (True, True),
    "affine": (False, False),
}


def _options(name: str, kind: str) -> dict[str, Any]:
    """A non-default value for every option of norm ``name`` that a ``kind`` cell can take."""
    options = {field: VALUES[field][0] for field in field_names(NORMS[name].spec) if field != "affine"}
    if not CELLS[kind].has_cell_state:
        options.pop("beta_init", None)  # only an LSTM's cell-state norm has a β
    return options


def _run(layer: torch.nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x, lengths = torch.randn(6, 4, 3, **F64), torch.tensor([6, 4, 6, 5])
    outputs = []
    for training in (True, True, False):  # two training batches: the renorm schedule and running stats move
        layer.train(training)
        output, state = layer(x, lengths=lengths)
        outputs += [output, *(state if isinstance(state, tuple) else (state,))]
    return outputs


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.usefixtures("one_route")  # three models' calls compared bit for bit
def test_spec_builds_the_model_of_name_and_keywords(kind: str, name: str) -> None:
    options = _options(name, kind)
    keywords = {key: value for key, value in options.items() if key in NORM_KEYWORDS}
    norm_options = {key: value for key, value in options.items() if key not in NORM_KEYWORDS}
    spec = NORMS[name].spec(**options)
    torch.manual_seed(0)
    from_keywords = LAYERS[kind](3, 5, num_layers=2, norm=name, norm_options=norm_options, **keywords, **F64)
    torch.manual_seed(0)
    from_spec = LAYERS[kind](3, 5, num_layers=2, norm=spec, **F64)
    torch.manual_seed(0)
    from_data = LAYERS[kind](3, 5, num_layers=2, norm=spec_from_dict(spec.to_dict(), "test"), **F64)
    assert from_keywords.norm_spec == from_spec.norm_spec == from_data.norm_spec == spec
    reference = from_keywords.state_dict()
    for layer in (from_spec, from_data):
        assert list(layer.state_dict()) == list(reference)
        assert all(torch.equal(value, reference[key]) for key, value in layer.state_dict().items())
    expected = _run(from_keywords)
    for layer in (from_spec, from_data):
        assert all(torch.equal(a, b) for a, b in zip(_run(layer), expected, strict=True))
        assert all(torch.equal(value, from_keywords.state_dict()[key]) for key, value in layer.state_dict().items())


@pytest.mark.parametrize("name", list(NORMS))
def test_cells_get_the_layers_spec_and_a_name_means_the_default_spec(name: str) -> None:
    layer = LAYERS["lstm"](3, 4, num_layers=2, bidirectional=True, norm=name)
    assert layer.norm_spec == NORMS[name].spec() and layer.norm == name
    assert all(cell.norm_spec is layer.norm_spec and cell.norm == name for cell in layer.cells)


@pytest.mark.parametrize("cls", [*CELLS.values(), *LAYERS.values()])
@pytest.mark.parametrize("name", list(NORMS))
def test_an_option_the_norm_lacks_is_refused_by_name(cls: type, name: str) -> None:
    lacking = sorted(NORM_KEYWORDS - set(field_names(NORMS[name].spec)) - {"max_steps"})
    for option in lacking:
        value = VALUES[option][0]
        with pytest.raises(
            ValueError,
            match=rf"^{cls.__name__}: expected norm to be one of .* for {option}={value!r}, got norm='{name}'$",
        ):
            cls(3, 4, norm=name, **{option: value})
        with pytest.raises(ValueError, match=rf"for {option}={value!r}, got norm='{name}'$"):
            cls(3, 4, norm=NORMS[name].spec(), **{option: value})
    cls(3, 4, norm=name, max_steps=7)  # the contract (docs/architecture.md): max_steps whatever the norm


def test_the_issues_example_names_each_stray_option() -> None:
    with pytest.raises(
        ValueError, match=r"^LSTM: expected norm to be one of 'batch', 'batch_renorm', 'weight' for momentum"
    ):
        seqnorm.LSTM(3, 4, norm="layer", max_steps=7, momentum=0.9, small_batch="running")
    with pytest.raises(
        ValueError, match=r"^LSTM: expected norm to be one of .* for small_batch='running', got norm='layer'$"
    ):
        seqnorm.LSTM(3, 4, norm="layer", max_steps=7, small_batch="running")
    with pytest.raises(ValueError, match=r"^GRU: expected mean_only_bn=True for momentum=0.5 with norm='weight'"):
        seqnorm.GRU(3, 4, norm="weight", momentum=0.5)


@pytest.mark.parametrize("name", list(NORMS))
def test_a_keyword_contradicting_the_spec_is_refused(name: str) -> None:
    for option in sorted(NORM_KEYWORDS & set(field_names(NORMS[name].spec)) - {"affine"}):
        first, second = VALUES[option]
        base = _options(name, "lstm")
        spec = NORMS[name].spec(**base)
        if first != second:
            with pytest.raises(
                ValueError, match=rf"^LSTM: expected {option}={first!r} as norm=.* sets it .*, got {option}={second!r}$"
            ):
                seqnorm.LSTM(3, 4, norm=spec, **{option: second})
        assert seqnorm.LSTM(3, 4, norm=spec, **{option: first}).norm_spec == spec  # the same value twice is fine
        # a keyword at its default says nothing; over a default field it sets the option
        assert seqnorm.LSTM(3, 4, norm=spec, **{option: default_of(type(spec), option)}).norm_spec == spec
        bare = NORMS[name].spec(**{k: v for k, v in base.items() if k != option})
        assert seqnorm.LSTM(3, 4, norm=bare, **{option: first}).norm_spec == spec


def test_norm_options_map_into_the_spec_and_contradict_it_like_keywords() -> None:
    layer = seqnorm.LSTM(3, 4, norm="batch_renorm", norm_options={"r_max": 2.0}, momentum=0.05)
    assert layer.norm_spec == norms.BatchRenormSpec(r_max=2.0, momentum=0.05)
    with pytest.raises(ValueError, match=r"^LSTM: expected r_max=1.5 as norm=BatchRenormSpec\(r_max=1.5\) sets it"):
        seqnorm.LSTM(3, 4, norm=norms.BatchRenormSpec(r_max=1.5), norm_options={"r_max": 2.0})
    with pytest.raises(
        ValueError, match=r"^GRUCell: expected norm_options accepted by norm='layer' \(none\), got r_max$"
    ):
        seqnorm.GRUCell(3, 4, norm=norms.LayerNormSpec(), norm_options={"r_max": 2.0})


BAD_SPECS: list[tuple[type[NormSpec], dict[str, Any], str]] = [
    (norms.BatchNormSpec, {"momentum": 1.5}, r"expected momentum to be a finite number in \[0, 1\] or None, got 1.5"),
    (norms.BatchNormSpec, {"max_steps": 0}, r"expected max_steps to be a positive int, got 0"),
    (norms.BatchNormSpec, {"small_batch": "skip"}, r"expected small_batch to be 'tail', 'error' or 'running', got"),
    (norms.BatchNormSpec, {"input_stats": "batch"}, r"expected input_stats to be one of 'timestep', 'sequence'"),
    (norms.BatchRenormSpec, {"beyond_max_steps": "first"}, r"expected beyond_max_steps to be one of 'last', 'pooled'"),
    (norms.BatchRenormSpec, {"r_max": 0.5}, r"expected r_max to be a finite number >= 1, got 0.5"),
    (norms.BatchRenormSpec, {"warmup": 1.5}, r"expected warmup to be an int >= 0, got 1.5"),
    (norms.LayerNormSpec, {"affine": "yes"}, r"expected affine to be one of True, False, got 'yes'"),
    (norms.RMSNormSpec, {"eps": -1.0}, r"expected eps to be a positive finite number, got -1.0"),
    # 0 would divide the zero recurrent term of a zero initial state by sqrt(0): NaN at the first step
    (norms.LayerNormSpec, {"eps": 0.0}, r"expected eps to be a positive finite number, got 0.0"),
    (norms.BatchNormSpec, {"eps": 0}, r"expected eps to be a positive finite number, got 0"),
    (norms.RMSNormSpec, {"affine": False, "gamma_init": 2.0}, r"expected gamma_init=None and beta_init=0 with affine"),
    (norms.LayerNormSpec, {"gamma_init": float("nan")}, r"expected gamma_init to be a finite number, got nan"),
    (norms.WeightNormSpec, {"momentum": 0.5}, r"expected mean_only_bn=True for momentum=0.5 with norm='weight'"),
    (norms.WeightNormSpec, {"mean_only_bn": 1}, r"expected mean_only_bn to be one of True, False, got 1"),
]


@pytest.mark.parametrize(("cls", "fields", "message"), BAD_SPECS)
def test_spec_checks_its_fields_when_made(cls: type[NormSpec], fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {message}"):
        cls(**fields)


def test_unknown_specs_and_options_are_refused() -> None:
    with pytest.raises(TypeError):
        norms.LayerNormSpec(momentum=0.1)  # not a field of LayerNormSpec
    with pytest.raises(TypeError):
        norms.BatchNormSpec(0.1)  # keyword-only: a positional value would be easy to misplace

    @dataclasses.dataclass(frozen=True)
    class Foreign(norms.BatchNormSpec):
        pass

    with pytest.raises(
        ValueError, match=r"^LSTM: expected a norm spec registered in seqnorm.NORMS .*, got .*Foreign\("
    ):
        seqnorm.LSTM(3, 4, norm=Foreign())
    with pytest.raises(ValueError, match=r"^ckpt: expected norm to be one of 'none', .*, got 'os.system'$"):
        spec_from_dict({"name": "os.system"}, "ckpt")
    with pytest.raises(ValueError, match=r"^ckpt: expected options of norm='layer' \(.*\), got momentum$"):
        spec_from_dict({"name": "layer", "momentum": 0.1}, "ckpt")
    with pytest.raises(ValueError, match=r"^ckpt: expected momentum to be a finite number in \[0, 1\] or None, got 7$"):
        spec_from_dict({"name": "batch", "momentum": 7}, "ckpt")


@pytest.mark.parametrize("name", list(NORMS))
def test_specs_are_frozen_values_that_name_their_norm(name: str) -> None:
    cls = NORMS[name].spec
    spec = cls(**_options(name, "lstm"))
    assert (
        cls.name == name and spec == cls(**_options(name, "lstm")) and hash(spec) == hash(cls(**_options(name, "lstm")))
    )
    assert len({spec, cls(**_options(name, "lstm")), cls()}) == (1 if spec == cls() else 2)
    assert all(spec != other.spec() for key, other in NORMS.items() if key != name)
    for field in field_names(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(spec, field, VALUES[field][1])
    assert eval(repr(spec), vars(norms)) == spec and repr(cls()) == f"{cls.__name__}()"
    data = spec.to_dict()
    assert data["name"] == name and spec_from_dict(data, "test") == spec
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # plain data: YAML and weights-only pickles hold it


@pytest.mark.parametrize("cls", [*CELLS.values(), *LAYERS.values()])
def test_keyword_defaults_are_the_specs_defaults(cls: type) -> None:
    parameters = inspect.signature(cls.__init__).parameters
    for name in NORM_KEYWORDS:
        defaults = {default_of(s.spec, name) for s in NORMS.values() if name in field_names(s.spec)}
        assert defaults == {parameters[name].default}, name


def test_model_folds_max_steps_and_small_batch_into_the_spec() -> None:
    model = LanguageModel(10, norm="batch", norm_max_steps=7, small_batch="running")
    assert model.model.rnn.norm_spec == norms.BatchNormSpec(max_steps=7, small_batch="running")
    assert model.hparams.norm == "batch"  # a name stays a name
    model = LanguageModel(10, norm=norms.BatchNormSpec(momentum=0.05), small_batch="running")
    assert model.model.rnn.norm_spec == norms.BatchNormSpec(momentum=0.05, small_batch="running")
    assert model.hparams.norm == norms.BatchNormSpec(momentum=0.05).to_dict() == model.hparams_initial.norm
    assert LanguageModel(10, norm=model.hparams.norm).model.rnn.norm_spec == norms.BatchNormSpec(momentum=0.05)
    with pytest.raises(
        ValueError, match=r"^LanguageModel: expected norm to be one of .* for small_batch='running', got"
    ):
        LanguageModel(10, norm="layer", small_batch="running")
    with pytest.raises(ValueError, match=r"^LanguageModel: expected max_steps=5 as norm=BatchNormSpec\(max_steps=5\)"):
        LanguageModel(10, norm=norms.BatchNormSpec(max_steps=5), norm_max_steps=6)


def test_a_class_path_in_norm_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "crafted.ckpt"
    hparams = {"norm": {"class_path": "foreign_module.Spec", "init_args": {}}}
    torch.save({"state_dict": {}, "hyper_parameters": hparams}, path)
    with pytest.raises(CheckpointError, match=r"hyper_parameters.norm names the class 'foreign_module.Spec'"):
        read_checkpoint(path)


# --- through the command line and YAML ---------------------------------------------------------------------------

SPEC = ["--model.norm.class_path", "seqnorm.norms.BatchRenormSpec", "--model.norm.init_args.r_max", "2.0"]
TINY = ["--model.hidden_size", "8", "--model.embedding_dim", "8", "--data.batch_size", "8", *QUIET]


@pytest.fixture
def story(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(120))
    path = tmp_path / "story.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_cli_trains_with_a_spec_and_test_rebuilds_it_from_the_checkpoint(story: Path) -> None:
    data = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(story)]
    short = ["--trainer.max_steps", "3", "--trainer.limit_val_batches", "1"]
    main(["fit", *data, *TINY, *SPEC, "--model.small_batch", "running", *short])
    last = run_path(0) / "checkpoints/last.ckpt"
    saved = torch.load(last, weights_only=True)["hyper_parameters"]
    assert saved["norm"] == norms.BatchRenormSpec(r_max=2.0).to_dict()
    config = yaml.safe_load((run_path(0) / "config.yaml").read_text())["model"]["init_args"]["norm"]
    assert config["class_path"] == "seqnorm.norms.BatchRenormSpec" and config["init_args"]["r_max"] == 2.0
    expected = norms.BatchRenormSpec(r_max=2.0, small_batch="running")
    tested = SeqnormCLI(args=["test", *data, *TINY, "--trainer.limit_test_batches", "1", "--ckpt_path", str(last)])
    assert tested.model.model.rnn.norm_spec == expected
    assert LanguageModel.load_from_checkpoint(last).model.rnn.norm_spec == expected
    # the same spec on the command line agrees with the checkpoint; another one contradicts it
    SeqnormCLI(args=["test", *data, *TINY, *SPEC, "--trainer.limit_test_batches", "1", "--ckpt_path", str(last)])
    with pytest.raises(SystemExit):
        main(["test", *data, *TINY, "--model.norm", "batch", "--ckpt_path", str(last)])


def test_yaml_config_and_print_config_with_a_spec(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    overlay = tmp_path / "spec.yaml"
    spec = {"class_path": "seqnorm.norms.BatchNormSpec", "init_args": {"momentum": 0.05, "max_steps": 50}}
    overlay.write_text(yaml.safe_dump({"model": {"init_args": {"norm": spec, "small_batch": "running"}}}))
    task = Path(__file__).resolve().parent.parent / "configs" / "embedded_lm.yaml"
    args = ["--config", str(task), "--config", str(overlay), "--trainer.logger", "false"]
    cli = SeqnormCLI(args=args, run=False)
    assert cli.model.model.rnn.norm_spec == norms.BatchNormSpec(momentum=0.05, max_steps=50, small_batch="running")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", *args, "--print_config"])
    assert stopped.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["norm"]
    assert printed["class_path"] == "seqnorm.norms.BatchNormSpec" and printed["init_args"]["momentum"] == 0.05
    with pytest.raises(SystemExit):  # jsonargparse checks the spec's fields by their types
        main(["fit", *args, "--model.norm.init_args.small_batch", "skip", "--print_config"])
