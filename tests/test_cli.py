"""The `dilocox` command line: one-line errors (exit 2, no traceback), --help texts, the Makefile's stamp."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from dilocox import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def _run(args: list[str], cwd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m dilocox.cli ARGS` in its own session; its process group is killed on a timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    p = subprocess.Popen(
        [sys.executable, "-m", "dilocox.cli", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate(timeout=30)
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert re.search(n, err), (n, err)
    return err


# --------------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc"], r"--nproc needs the number of local ranks, e\.g\. --nproc 4"),
        (["--nproc", "x"], r"--nproc 'x' is not a whole number"),
        (["--nproc=four"], r"--nproc 'four' is not a whole number"),
        (["--nproc", "--train.steps=1"], r"--nproc needs the number"),
        (["--nproc=0"], r"--nproc 0 must be at least 1"),
    ],
)
def test_nproc_value_errors_in_process(args, needle, capsys):
    assert cli.main(["train", TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(needle, err), err


def test_nproc_and_config_errors_are_one_line_without_traceback(tmp_path):
    _one_line_error(_run(["train", TINY, "--nproc"], str(tmp_path)), r"^dilocox train: --nproc needs")
    configs = os.path.join(REPO, "configs")
    _one_line_error(
        _run(["train", configs], str(tmp_path)),
        r"^config error: config '.*configs' is a directory; give a YAML file, e\.g\. .*configs/\S+\.yaml",
    )


def test_directory_and_empty_config(tmp_path, capsys):
    assert cli.main(["data", "prepare", str(tmp_path)]) == 2
    assert "is a directory; give a YAML file" in capsys.readouterr().err
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    from dilocox.config import load_config

    cfg = load_config(str(empty))
    err = capsys.readouterr().err
    assert f"config file {empty} is empty; using the defaults" in err and cfg.train.steps > 0


def test_data_errors_one_line_before_torchrun(tmp_path, capsys):
    """A corpus shorter than a sequence: one line, exit 2, found in the parent (torchrun never starts)."""
    short = tmp_path / "short.txt"
    short.write_text("hello world\n")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    common = [f"--data.cache_dir={tmp_path / 'cache'}", f"--log.run_dir={tmp_path / 'run'}", "--data.source=text"]
    r = _run(["train", TINY, *common, f"--data.path={short}", "--nproc", "2", "--parallel.data=2"], str(tmp_path))
    _one_line_error(
        r,
        r"^data error: .*short\.txt' gives \d+ training tokens, fewer than one sequence "
        r"\(train\.seq_len=128 needs 130\)",
    )
    assert "torch.distributed" not in r.stderr + r.stdout and not (tmp_path / "run").exists()
    for path, needle in (
        (binary, r"^data error: data\.path='.*weights\.bin' has NUL bytes"),
        (tmp_path / "nope", r"^data error: data\.path='.*nope' does not exist"),
    ):
        assert cli.main(["train", TINY, *common, f"--data.path={path}"]) == 2  # in process: an exception fails it
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(needle, err), err


# --------------------------------------------------------------------------- help


def test_help_texts(capsys):
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    for kind in cli.BENCHES:  # the one bench registry
        assert re.search(rf"^\s+{kind}\s+\S", top, re.MULTILINE), kind
    assert "docs/CONFIG.md" in top
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--nproc N" in out and "docs/CONFIG.md" in out
    for key in ("--model.", "vocab_size", "--outer.streaming.", "fragments", "--checkpoint.", "--train.", "seq_len"):
        assert key in out, key
    assert cli.main(["train", TINY, "-h"]) == 0 and "usage: dilocox train" in capsys.readouterr().out
    assert cli.main(["data", "--help"]) == 0 and "docs/CONFIG.md" in capsys.readouterr().out
    assert cli.main(["data", "prepare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--data.tokenizer=byte|bpe" in out and "docs/CONFIG.md" in out
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in cli.BENCHES)
    assert cli.main(["bench", "nope"]) == 2 and "choose one of kernels" in capsys.readouterr().err
    for cmd in ("plan", "launch"):
        with pytest.raises(SystemExit) if cmd == "plan" else _nothing():
            cli.main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "usage: dilocox " + cmd in out and "docs/CONFIG.md" in out, out
    assert cli.main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- Makefile


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_install_stamp_belongs_to_its_interpreter(tmp_path):
    """A stamp made by one interpreter does not make `make install` skip for another (a second venv)."""
    for f in ("Makefile", "requirements.txt", "setup.py"):
        shutil.copy(os.path.join(REPO, f), tmp_path / f)
    py1, py2 = tmp_path / "venv1" / "python3", tmp_path / "venv2" / "python3"
    for p in (py1, py2):  # two interpreters with their own sys.executable, as two venvs have
        p.parent.mkdir()
        p.symlink_to(sys.executable)

    def dry(py) -> str:
        r = subprocess.run(
            ["make", "-n", "install", f"PYTHON={py}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    first = dry(py1)
    assert f"{py1} -m pip install" in first
    stamp = re.search(r"> (\.install-\w+\.stamp)", first).group(1)
    (tmp_path / stamp).write_text(f"{py1}\n")  # what the recipe writes, newer than its prerequisites
    assert "pip install" not in dry(py1)  # same interpreter: up to date
    second = dry(py2)
    assert f"{py2} -m pip install" in second and stamp not in second  # another one: installs into itself


# ------------------------------------------------------------ issue 44 item 5: --version, help, suggestions


def test_version_secret_help_and_no_double_usage(capsys):
    from dilocox import __version__

    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"dilocox {__version__}"
    assert cli.main(["-V"]) == 0 and __version__ in capsys.readouterr().out
    assert cli.main(["secret", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dilocox secret PATH") and "--security.secret_file=PATH" in out, out
    assert cli.main(["secret"]) == 2 and "usage: dilocox secret PATH" in capsys.readouterr().err
    for cmd in ("export", "import", "generate", "report"):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith(f"usage: dilocox {cmd}") and "usage: usage:" not in out, out


class _Parser(Exception):
    pass


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "RUN", "--to", "hf", "OUT"],
        ["import", "HF"],
        ["generate", "RUN", "--prompt", "a"],
        ["report", "RUN"],
        ["plan", "--model", "M"],
        ["plan", "--swarm"],
        ["lighthouse"],
        ["swarm", "CONFIG"],
        ["launch", "--elastic", "2", "CONFIG"],
        ["launch", "--swarm", "CONFIG"],
    ],
)
def test_every_option_of_a_command_has_help(argv, monkeypatch):
    """Each command's argparse parser is caught at parse time (nothing runs) and every argument has a help text."""
    import argparse

    def caught(self, args=None, namespace=None):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    with pytest.raises(_Parser) as e:
        cli.main(argv)
    parser = e.value.args[0]
    bare = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
    assert not bare, (argv, bare)


def test_suggestions_by_edit_distance(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian' (did you mean 'train'?)" in err and len(err.strip().splitlines()) == 1, err
    assert cli.main(["bench", "kernel"]) == 2 and "did you mean 'kernels'?" in capsys.readouterr().err
    from dilocox.config import ConfigError, load_config

    for override, hint in (
        ("--train.seqlen=3", "did you mean train.seq_len?"),  # a typo in the section
        ("--checkpoint.evry=3", "did you mean checkpoint.every?"),
        ("--train.lr=3", "did you mean optim.lr?"),  # the key of another section
        ("--seq_len=3", "did you mean train.seq_len?"),  # the section left out
    ):
        with pytest.raises(ConfigError) as e:
            load_config(TINY, [override])
        assert str(e.value).endswith(hint), (override, str(e.value))
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["--train.zzzzqqq=1"])
    assert "did you mean" not in str(e.value)


def test_tensorboard_absent_is_said_in_one_line(tmp_path, monkeypatch, capsys):
    from dilocox.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    log = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, tensorboard=True, progress=False)
    log.write({"step": 1, "loss": 1.0})
    log.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "tensorboard" in ln.lower()]
    assert len(lines) == 1 and "pip install tensorboard" in lines[0], lines
