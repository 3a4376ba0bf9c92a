"""Config loading: every bad-input case fails at load with the field, value and constraint."""

import pytest

from dilocox.config import Config, ConfigError, load_config, parse_overrides, to_yaml


def _err(overrides, tmp_path=None, text=None):
    path = None
    if text is not None:
        path = tmp_path / "c.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(str(path) if path else None, overrides)
    return str(ei.value)


def test_defaults_and_overrides():
    cfg = load_config(
        None, ["--train.steps=7", "--optim.betas=[0.8, 0.9]", "--model.arch", "opt", "--outer.streaming.alpha=0.25"]
    )
    assert isinstance(cfg, Config)
    assert cfg.train.steps == 7 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.model.arch == "opt" and cfg.outer.streaming.alpha == 0.25


def test_yaml_include_and_roundtrip(tmp_path):
    (tmp_path / "m.yaml").write_text("model:\n  n_layers: 6\n  n_heads: 2\n")
    (tmp_path / "run.yaml").write_text("include: m.yaml\nmodel:\n  d_model: 64\ntrain:\n  steps: 3\n")
    cfg = load_config(str(tmp_path / "run.yaml"))
    assert (cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_model, cfg.train.steps) == (6, 2, 64, 3)
    (tmp_path / "back.yaml").write_text(to_yaml(cfg))
    assert load_config(str(tmp_path / "back.yaml")).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["--model.n_heads=6", "--model.d_model=96", "--parallel.tensor=4"], ["model.n_heads=6", "parallel.tensor=4"]),
        (["--model.vocab_size=257", "--parallel.tensor=2"], ["model.vocab_size=257", "parallel.tensor=2"]),
        (
            ["--model.n_layers=5", "--parallel.pipeline=2", "--parallel.microbatches=2"],
            ["model.n_layers=5", "parallel.pipeline=2"],
        ),
        (["--parallel.pipeline=4", "--parallel.microbatches=2"], ["parallel.microbatches=2", "parallel.pipeline=4"]),
        (["--model.n_kv_heads=3"], ["model.n_kv_heads=3"]),
        (["--model.arch=bert"], ["model.arch='bert'", "gpt2"]),
        (["--train.steps=abc"], ["train.steps='abc'", "integer"]),
        (["--train.steps=true"], ["train.steps=True", "integer"]),
        (["--model.bias=maybe"], ["model.bias='maybe'", "boolean"]),
        (["--model.nope=1"], ["model.nope", "unknown"]),
        (["--nosection.x=1"], ["nosection", "unknown"]),
        (["--train.seq_len=1024"], ["train.seq_len=1024", "max_seq_len"]),
        (["--parallel.replicas=2"], ["outer.method='none'", "replicas=2"]),
        (["--data.source=text"], ["data.path", "data.source='text'"]),
        (["--outer.streaming.fragments=3", "--outer.sync_every=10"], ["outer.streaming.fragments=3", "sync_every=10"]),
        (["--train.batch_size=6", "--parallel.microbatches=4"], ["train.batch_size=6", "microbatches"]),
        (["--optim.lr=-1"], ["optim.lr=-1"]),
    ],
)
def test_bad_values_name_field_value_and_rule(overrides, needles):
    msg = _err(overrides)
    for n in needles:
        assert n in msg, (n, msg)


def test_malformed_yaml_names_file(tmp_path):
    msg = _err([], tmp_path, "model:\n  n_layers: [1, 2\n")
    assert "malformed YAML" in msg and "c.yaml" in msg


def test_yaml_top_level_must_be_mapping(tmp_path):
    assert "mapping" in _err([], tmp_path, "- 1\n- 2\n")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/dilocox.yaml")


def test_override_syntax():
    assert parse_overrides(["--a.b=3", "--c", "x"]) == {"a": {"b": 3}, "c": "x"}
    with pytest.raises(ConfigError, match="--section.key=value"):
        parse_overrides(["a.b=3"])


@pytest.mark.parametrize("spelling", ["[3, 1, 2]", 5])
def test_validation_never_changes_the_config(tmp_path, spelling):
    """Issue 25 item 6: a section normalises its own fields where it is built (SwarmConfig.peers_per_stage), and
    validate() only checks: running it again on a built config leaves every field as it was."""
    import copy

    from dilocox.config.root import validate

    cfg = load_config(None, [f"--swarm.peers_per_stage={spelling}", "--swarm.microbatch_size=2"])
    assert cfg.swarm.peers_per_stage == ((3, 1, 2) if isinstance(spelling, str) else (5,))
    before = copy.deepcopy(cfg.to_dict())
    validate(cfg)
    assert cfg.to_dict() == before
    cfg.swarm.peers_per_stage = "[2, x"  # set by hand after construction: named, not repaired
    with pytest.raises(ConfigError, match="swarm.peers_per_stage"):
        validate(cfg)
