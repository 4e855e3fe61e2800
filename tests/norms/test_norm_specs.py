"""Norm specs, the one way to configure a norm: the same model from a spec and from its plain data, validated once,
refused where an option does not belong, and carried through configs and checkpoints as plain data."""

from __future__ import annotations

import dataclasses
import inspect
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import seqnorm
import seqnorm.norms as norms
from seqnorm.checkpoint_io import CheckpointError, read_checkpoint
from seqnorm.cli import SeqnormCLI, main
from seqnorm.lightning import LanguageModel
from seqnorm.norms import NORMS, REMOVED_KEYWORDS, NormSpec, spec_from_dict
from seqnorm.norms.specs import field_names
from tests.cli.test_cli import QUIET, WORDS
from tests.conftest import CELLS, LAYERS, run_path

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
    "norm_placement": ("joint", "joint"),
    "state_norm": ("carried", "carried"),
}


def _options(name: str, kind: str) -> dict[str, Any]:
    """A non-default value for every option of norm ``name`` that a ``kind`` cell can take."""
    options = {field: VALUES[field][0] for field in field_names(NORMS[name].spec) if field != "affine"}
    if not CELLS[kind].has_cell_state:
        for field in ("beta_init", "norm_placement", "state_norm"):  # only an LSTM has a joint sum and a cell state
            options.pop(field, None)
    if options.get("norm_placement") == "joint":
        options.pop("input_stats", None)  # the joint norm sees the recurrent term, one step at a time
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
def test_spec_and_its_plain_data_build_the_same_model(kind: str, name: str) -> None:
    options = _options(name, kind)
    max_steps = options.pop("max_steps", None)
    spec = NORMS[name].spec(**options)
    torch.manual_seed(0)
    from_spec = LAYERS[kind](3, 5, num_layers=2, norm=spec, max_steps=max_steps or 100, **F64)
    with_steps = NORMS[name].spec(**options, **({"max_steps": max_steps} if max_steps else {}))
    torch.manual_seed(0)
    from_data = LAYERS[kind](3, 5, num_layers=2, norm=spec_from_dict(with_steps.to_dict(), "test"), **F64)
    assert from_spec.norm_spec == from_data.norm_spec == with_steps
    reference = from_spec.state_dict()
    assert list(from_data.state_dict()) == list(reference)
    assert all(torch.equal(value, reference[key]) for key, value in from_data.state_dict().items())
    expected = _run(from_spec)
    assert all(torch.equal(a, b) for a, b in zip(_run(from_data), expected, strict=True))
    assert all(torch.equal(value, from_spec.state_dict()[key]) for key, value in from_data.state_dict().items())


@pytest.mark.parametrize("name", list(NORMS))
def test_cells_get_the_layers_spec_and_a_name_means_the_default_spec(name: str) -> None:
    layer = LAYERS["lstm"](3, 4, num_layers=2, bidirectional=True, norm=name)
    assert layer.norm_spec == NORMS[name].spec() and layer.norm == name
    assert all(cell.norm_spec is layer.norm_spec and cell.norm == name for cell in layer.cells)


@pytest.mark.parametrize("cls", [*CELLS.values(), *LAYERS.values()])
@pytest.mark.parametrize("keyword", sorted(REMOVED_KEYWORDS))
def test_a_norm_option_as_a_keyword_is_a_type_error_naming_the_spec(cls: type, keyword: str) -> None:
    value = {"norm_options": {"r_max": 2.0}}.get(keyword, VALUES.get(keyword, (0.5,))[0])
    field = "r_max=2.0" if keyword == "norm_options" else f"{keyword}={value!r}"
    with pytest.raises(
        TypeError, match=rf"^{cls.__name__}: got an unexpected keyword '{keyword}'; pass norm=\w+Spec\("
    ):
        cls(3, 4, **{keyword: value})
    # the spec named is that of the norm given, where it has the option
    for name, scheme in NORMS.items():
        if keyword in field_names(scheme.spec) or (keyword == "norm_options" and name == "batch_renorm"):
            message = rf"^{cls.__name__}: got an unexpected keyword '{keyword}'; pass norm={scheme.spec.__name__}\("
            with pytest.raises(TypeError, match=rf"{message}{re.escape(field)}\)$"):
                cls(3, 4, norm=name, **{keyword: value})
            with pytest.raises(TypeError, match=message):
                cls(3, 4, norm=scheme.spec(), **{keyword: value})
    assert not REMOVED_KEYWORDS & set(inspect.signature(cls).parameters)


@pytest.mark.parametrize("cls", [*CELLS.values(), *LAYERS.values()])
@pytest.mark.parametrize("name", list(NORMS))
def test_max_steps_is_taken_whatever_the_norm_and_folded_into_a_spec_that_has_it(cls: type, name: str) -> None:
    module = cls(3, 4, norm=name, max_steps=7)  # the public API contract: max_steps whatever the norm
    has = "max_steps" in field_names(NORMS[name].spec)
    assert module.norm_spec == (NORMS[name].spec(max_steps=7) if has else NORMS[name].spec())
    if has:
        spec = NORMS[name].spec(max_steps=5)
        assert cls(3, 4, norm=spec, max_steps=5).norm_spec == cls(3, 4, norm=spec).norm_spec == spec
        with pytest.raises(
            ValueError, match=rf"^{cls.__name__}: expected max_steps=5 as norm=.* sets it .*, got max_steps=7$"
        ):
            cls(3, 4, norm=spec, max_steps=7)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: expected max_steps to be a positive int, got 0$"):
        cls(3, 4, norm=name, max_steps=0)


def test_the_issues_example_names_the_spec_to_use() -> None:
    with pytest.raises(TypeError, match=r"^LSTM: got an unexpected keyword 'momentum'; pass norm=BatchNormSpec\("):
        seqnorm.LSTM(3, 4, norm="layer", max_steps=7, momentum=0.9, small_batch="running")
    with pytest.raises(
        TypeError, match=r"^LSTM: got an unexpected keyword 'eps'; pass norm=LayerNormSpec\(eps=0.001\)$"
    ):
        seqnorm.LSTM(3, 4, norm="layer", eps=1e-3)
    with pytest.raises(ValueError, match=r"^WeightNormSpec: expected mean_only_bn=True for momentum=0.5"):
        seqnorm.GRU(3, 4, norm=norms.WeightNormSpec(momentum=0.5))


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
    (norms.LayerNormSpec, {"norm_placement": "jint"}, r"expected norm_placement to be one of 'separate', 'joint'"),
    (norms.BatchNormSpec, {"state_norm": "kept"}, r"expected state_norm to be one of 'output', 'carried', got"),
    (norms.WeightNormSpec, {"norm_placement": "joint"}, r"expected mean_only_bn=True for norm_placement='joint'"),
    (
        norms.BatchNormSpec,
        {"norm_placement": "joint", "input_stats": "sequence"},
        r"expected input_stats='timestep' with norm_placement='joint'",
    ),
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
    task = Path(__file__).resolve().parents[2] / "configs" / "embedded_lm.yaml"
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


def test_the_options_taken_before_specs_are_one_list_with_todays_defaults() -> None:
    """The same history was kept by hand twice (the keywords cells refuse, the rnn_options old checkpoints hold):
    one list now, owned by the norms. An old default is what a spec with that field still defaults to, so an old
    checkpoint's default option folds into the norm's name, not a spec that differs."""
    from seqnorm.lightning.old_hparams import OLD_NORM_OPTIONS, current_hparams
    from seqnorm.norms import REMOVED_OPTIONS
    from seqnorm.norms.specs import default_of

    assert OLD_NORM_OPTIONS is REMOVED_OPTIONS and set(REMOVED_OPTIONS) < REMOVED_KEYWORDS
    for option, old in REMOVED_OPTIONS.items():
        having = [scheme.spec for scheme in NORMS.values() if option in field_names(scheme.spec)]
        assert having, option
        for spec in having:
            assert default_of(spec, option) == old, (spec.__name__, option)
        saved = current_hparams({"norm": having[0].name, "rnn_options": {option: old}})
        assert saved["norm"] == having[0].name and saved["rnn_options"] is None, option
