"""Config input at its edges: bad values get one line naming the field and the fix (ConfigError, exit 2).

Each case raised a traceback or was silently accepted (or changed) before its fix: a broken list
override (yaml ParserError), a key under a value (TypeError), a malformed ``include:`` (TypeError),
repeated YAML keys (last one won, a whole section replaced), NaN and out-of-range numbers (NaN loss,
clipping silently off), string overrides re-typed by YAML (``2024_01_05`` -> ``'20240105'``), a choice
error with the tokenizer's hint and no suggestion, unknown keys printed as ``train.'stepz'``.
"""

from __future__ import annotations

import glob
import os

import pytest

from dilocox import cli
from dilocox.config import ConfigError, load_config, to_yaml
from dilocox.config.loading import _read_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _one_line_exit_2(capsys, argv: list[str], *needles: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("config error: "), err
    for n in needles:
        assert n in err, (n, err)
    return err


# --------------------------------------------------------------------------- A: tracebacks


def test_broken_list_override_is_one_line(capsys):
    _one_line_exit_2(capsys, ["train", TINY, "--optim.betas=[0.9"], "optim.betas", "[0.9, 0.95]")
    with pytest.raises(ConfigError, match=r"optim\.betas.*\[0\.9, 0\.95\]"):
        load_config(None, ["--optim.betas=[0.9, 0.95, 0.99]"])  # the wrong length names the example too
    assert load_config(None, ["--optim.betas=[0.8, 0.9]"]).optim.betas == (0.8, 0.9)


def test_key_under_a_value_is_one_line(capsys):
    _one_line_exit_2(capsys, ["train", TINY, "--train.steps=3", "--train.steps.x=1"], "train.steps is a value")
    with pytest.raises(ConfigError, match=r"train\.steps is a value, not a section"):
        load_config(None, ["--train.steps.x=1"])
    with pytest.raises(ConfigError, match=r"an earlier override set train to 3"):
        load_config(None, ["--train=3", "--train.steps=1"])


@pytest.mark.parametrize("include", ["5", "[{a: 1}]", "{a: b}", "[model/gpt2-tiny.yaml, 7]"])
def test_malformed_include_names_the_file(tmp_path, capsys, include):
    p = tmp_path / "bad.yaml"
    p.write_text(f"include: {include}\ntrain:\n  steps: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: include must be a file name or a list of file names"):
        load_config(str(p))
    _one_line_exit_2(capsys, ["train", str(p)], "bad.yaml", "include must be")


# --------------------------------------------------------------------------- B1: repeated YAML keys


def test_repeated_yaml_key_names_file_key_and_lines(tmp_path, capsys):
    p = tmp_path / "dup.yaml"
    p.write_text("train:\n  steps: 5\n  batch_size: 4\noptim:\n  lr: 0.001\ntrain:\n  seq_len: 64\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml.*'train'.*lines 1 and 6"):
        load_config(str(p))
    _one_line_exit_2(capsys, ["train", str(p)], "dup.yaml", "'train'", "lines 1 and 6")
    p.write_text("train:\n  steps: 5\n  steps: 6\n")  # inside a section too
    with pytest.raises(ConfigError, match=r"'steps'.*lines 2 and 3"):
        load_config(str(p))
    inc = tmp_path / "inc.yaml"  # in an included file: that file is named
    inc.write_text("model:\n  d_model: 64\n  d_model: 32\n")
    p.write_text("include: inc.yaml\n")
    with pytest.raises(ConfigError, match=r"inc\.yaml.*'d_model'.*lines 2 and 3"):
        load_config(str(p))
    # the same key at different levels, in different files, and YAML merge keys are not repeats
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 7\n")
    p.write_text("include: base.yaml\ntrain:\n  steps: 9\n  batch_size: 4\noptim: {<<: {lr: 0.5}, lr: 0.25}\n")
    cfg = load_config(str(p))
    assert (cfg.train.steps, cfg.train.batch_size, cfg.optim.lr) == (9, 4, 0.25)
    # every shipped config, and the config.yaml a run writes, are free of repeats
    for f in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)):
        _read_yaml(f)
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(load_config(TINY, ["--log.wandb_project=2024_01_05"])))
    assert load_config(str(saved)).log.wandb_project == "2024_01_05"


# --------------------------------------------------------------------------- B2: non-finite and out of range


@pytest.mark.parametrize(
    "override, needles",
    [
        ("--model.dropout=nan", ["model.dropout", "finite"]),
        ("--model.dropout=.inf", ["model.dropout", "finite"]),
        ("--model.init_std=nan", ["model.init_std", "finite"]),
        ("--optim.weight_decay=nan", ["optim.weight_decay", "finite"]),
        ("--optim.grad_clip=nan", ["optim.grad_clip", "finite"]),
        ("--optim.grad_clip=inf", ["optim.grad_clip", "finite"]),
        ("--parallel.timeout_s=nan", ["parallel.timeout_s", "finite"]),
        ("--optim.betas=[nan, 0.9]", ["optim.betas[0]", "finite"]),
        ("--model.dropout=1.5", ["model.dropout=1.5", "[0, 1)"]),
        ("--model.dropout=-0.1", ["model.dropout=-0.1", "[0, 1)"]),
        ("--model.init_std=0", ["model.init_std=0.0", "> 0"]),
        ("--model.norm_eps=0", ["model.norm_eps=0.0", "> 0"]),
        ("--optim.betas=[1.5,0.9]", ["optim.betas=(1.5, 0.9)", "[0, 1)"]),
        ("--optim.betas=[0.9,1.0]", ["optim.betas=(0.9, 1.0)", "[0, 1)"]),
        ("--optim.eps=-1", ["optim.eps=-1.0", "> 0"]),
        ("--optim.weight_decay=-0.1", ["optim.weight_decay=-0.1", ">= 0"]),
        ("--optim.grad_clip=-1", ["optim.grad_clip=-1.0", ">= 0"]),
    ],
)
def test_non_finite_and_out_of_range_numbers_fail_at_load(override, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_nan_in_a_yaml_file_and_positive_checks(tmp_path, capsys):
    p = tmp_path / "nan.yaml"
    p.write_text("optim:\n  weight_decay: .nan\n")
    _one_line_exit_2(capsys, ["train", str(p)], "optim.weight_decay", "finite")
    from dilocox.config import Config
    from dilocox.config.sections import ParallelConfig

    with pytest.raises(ConfigError, match=r"parallel\.timeout_s=nan must be > 0"):  # a config built in code
        Config(parallel=ParallelConfig(timeout_s=float("nan")))
    # the edges that stay allowed
    cfg = load_config(
        None, ["--model.dropout=0", "--optim.grad_clip=0", "--optim.weight_decay=0", "--optim.betas=[0, 0.999]"]
    )
    assert (cfg.model.dropout, cfg.optim.grad_clip, cfg.optim.betas) == (0.0, 0.0, (0.0, 0.999))
    assert load_config(None, ["--model.dropout=0.999"]).model.dropout == 0.999


# --------------------------------------------------------------------------- B3: string overrides kept as typed


@pytest.mark.parametrize("text", ["2024_01_05", "0755", "1:30", "0x1F", "1.5e+3", "true", "007"])
def test_string_override_is_taken_as_typed(text):
    assert load_config(None, [f"--log.wandb_project={text}"]).log.wandb_project == text
    assert load_config(None, [f"--log.run_dir=runs/{text}"]).log.run_dir == f"runs/{text}"
    assert load_config(None, ["--data.hf_config", text]).data.hf_config == text  # str | None, the spaced form


def test_string_override_null_and_other_types_unchanged():
    assert load_config(None, ["--log.wandb_project=0755"]).log.wandb_project == "0755"  # (fails before the fix)
    assert load_config(None, ["--data.hf_config=null"]).data.hf_config is None
    assert load_config(None, ["--model.init_from=None"]).model.init_from is None
    assert load_config(None, ["--checkpoint.resume=none"]).checkpoint.resume == "none"
    cfg = load_config(None, ["--train.steps=0x1F", "--optim.lr=1e-3", "--log.jsonl=false"])  # not strings: YAML
    assert (cfg.train.steps, cfg.optim.lr, cfg.log.jsonl) == (31, 1e-3, False)


# --------------------------------------------------------------------------- C1: messages


def test_choice_error_suggests_and_hints_only_where_it_applies(capsys):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--outer.method=dilco"])
    assert str(e.value).endswith("did you mean 'diloco'?") and "hf:PATH" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.arch=llama"])
    assert "hf:PATH" not in str(e.value) and "'gpt2', 'opt', 'qwen'" in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"hf:PATH.*did you mean 'byte'\?"):
        load_config(None, ["--data.tokenizer=bytes"])
    err = _one_line_exit_2(capsys, ["train", TINY, "--train.stepz=3"], "unknown config key train.stepz ")
    assert "'stepz'" not in err and err.endswith("did you mean train.steps?"), err


@pytest.mark.parametrize(
    "override, field",
    [
        (["--outer.method=allreduce", "--compress.adaptive.enabled=true"], "compress.adaptive.enabled"),
        (["--outer.method=cocktailsgd", "--compress.lowrank.enabled=true"], "compress.lowrank.enabled"),
        (["--outer.method=cocktailsgd", "--compress.adaptive.enabled=true"], "compress.adaptive.enabled"),
        (["--outer.method=cocktailsgd", "--compress.collective=reduce_scatter"], "compress.collective"),
        (["--outer.method=allreduce", "--outer.overlap=delayed"], "outer.overlap"),
        (["--outer.method=cocktailsgd", "--outer.overlap=eager"], "outer.overlap"),
        (["--outer.method=allreduce", "--outer.streaming.fragments=2", "--outer.sync_every=4"], "outer.streaming.frag"),
    ],
)
def test_an_option_the_method_ignores_is_refused(override, field):
    """These loaded and did nothing (a review measured the same loss and rank, and allreduce with adaptive sent the
    unused tail sketch every step): each is now refused, naming the field and the method."""
    with pytest.raises(ConfigError, match=f"{field}.*no effect with outer.method"):
        load_config(TINY, override)
    load_config(TINY, override[:1])  # the method alone loads


def test_an_empty_section_header_overrides_nothing(tmp_path):
    """Bug (found by review): a section header whose keys are all commented out (YAML: ``train: null``) replaced the
    included file's whole section with the code defaults: the tiny config then trained 200 steps at lr 4e-4 instead
    of 300 at 3e-3, with no word said. An empty section now overrides nothing."""
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(f"include: {TINY}\ntrain:\n#  steps: 50\noptim:\ndata: null\n")
    c, tiny = load_config(str(cfg)), load_config(TINY)
    assert (c.train, c.optim, c.data) == (tiny.train, tiny.optim, tiny.data)
    cfg.write_text(f"include: {TINY}\ntrain:\n  steps: 50\n")  # (a key below it still overrides)
    assert load_config(str(cfg)).train.steps == 50 and load_config(str(cfg)).optim == tiny.optim
