"""What `dilocox import/export/eval/generate/report` write and read at their edges (a black-box review): an existing
--out or OUT is never replaced silently, a typo in a local path is no hub download, --device is checked, and a
metrics.jsonl line that is not UTF-8 is named like one that is not JSON."""

from __future__ import annotations

import json
import os

import pytest

from dilocox import hf
from dilocox.cli import main as cli_main
from dilocox.config import ModelConfig
from tests.small_run import small_cfg
from tests.test_resume_edges import _run


@pytest.fixture
def hf_dir(tmp_path):
    """An HF directory with just the config.json `dilocox import` reads."""
    d = tmp_path / "hfsrc"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf.hf_config(ModelConfig(n_layers=2, d_model=64))))
    return str(d)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 1-step run with a final checkpoint (shared: export only reads it)."""
    run = str(tmp_path_factory.mktemp("run") / "run")
    _run(small_cfg(run, steps=1))
    return run


def test_import_refuses_an_existing_out_unless_force(tmp_path, hf_dir, capsys):
    """`dilocox import HF --out FILE` replaced an existing FILE (a training config) without a word."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  steps: 7\n")
    assert cli_main(["import", hf_dir, "--out", str(mine)]) == 2
    assert f"--out {mine} exists; choose another path or pass --force to replace it" in capsys.readouterr().err
    assert mine.read_text() == "train:\n  steps: 7\n"
    assert cli_main(["import", hf_dir, "--out", str(mine), "--force"]) == 0
    assert mine.read_text().startswith("# imported from") and "init_from:" in mine.read_text()


def test_import_out_is_written_atomically(tmp_path, hf_dir, monkeypatch):
    """A failure while --out is written leaves no file (or the old one, whole) and no temporary file beside it."""
    from dilocox import fsutil

    def crash(src, dst):
        raise OSError(5, "Input/output error", dst)

    monkeypatch.setattr(fsutil, "replace_durably", crash)
    assert cli_main(["import", hf_dir, "--out", str(tmp_path / "new.yaml")]) == 2
    assert os.listdir(tmp_path) == ["hfsrc"]
    (tmp_path / "mine.yaml").write_text("old\n")
    assert cli_main(["import", hf_dir, "--out", str(tmp_path / "mine.yaml"), "--force"]) == 2
    assert (tmp_path / "mine.yaml").read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["hfsrc", "mine.yaml"]


def test_import_out_that_is_a_directory_names_the_flag(tmp_path, hf_dir, capsys):
    """Was `dilocox import: Is a directory: data`."""
    (tmp_path / "data").mkdir()
    assert cli_main(["import", hf_dir, "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'data'} is a directory; give a file path" in err and err.count("\n") == 1, err


def test_export_refuses_a_non_empty_out_unless_force(tmp_path, run_dir, capsys):
    """`dilocox export RUN --to hf OUT` wrote into an OUT holding an earlier export or other files, replacing its
    model.safetensors silently (checkpoints rotate: that export may be the only copy of a model)."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli_main(["export", run_dir, "--to", "hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"OUT {out} exists and is not empty (notes.txt); choose another directory or pass --force" in err, err
    assert os.listdir(out) == ["notes.txt"]
    assert cli_main(["export", run_dir, "--to", "hf", str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").exists()
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert cli_main(["export", run_dir, "--to", "hf", str(out)]) == 2  # an earlier export: refused too
    assert "pass --force" in capsys.readouterr().err and (out / "model.safetensors").stat().st_mtime_ns == before


def test_export_force_refuses_other_weights_in_out(tmp_path, run_dir, capsys):
    """--force replaces the export's files only; other *.safetensors would be loaded with them: refused."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert cli_main(["export", run_dir, "--to", "hf", str(out), "--force"]) == 2
    assert "holds other weights (model-00001-of-00002.safetensors)" in capsys.readouterr().err
    assert not (out / "model.safetensors").exists()


def test_export_to_a_file_names_out_and_the_fix(tmp_path, run_dir, capsys):
    """Was `dilocox export: File exists: afile`."""
    (tmp_path / "afile").write_text("x")
    assert cli_main(["export", run_dir, "--to", "hf", str(tmp_path / "afile")]) == 2
    assert f"OUT {tmp_path / 'afile'} is a file; give a new (or empty) directory" in capsys.readouterr().err


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub.snapshot_download recorded: offline (raises), or a name -> directory answer."""
    import huggingface_hub

    calls, answers = [], {}

    def fake(name, **k):
        calls.append(name)
        if name in answers:
            return answers[name]
        raise OSError("LocalEntryNotFoundError: offline\nmore lines")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return calls, answers


TYPO = [["eval", "runs/typo_dir"], ["import", "runs/typo_dir"], ["generate", "runs/typo_dir", "--prompt", "a"]]


@pytest.mark.parametrize("argv", TYPO)
def test_a_typo_in_a_local_path_is_no_hub_download(tmp_path, monkeypatch, hub, capsys, argv):
    """`dilocox eval runs/typo_dir` (runs/ exists here) said "... could not be fetched from the hub"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert f"no such directory: runs/typo_dir (resolved to {tmp_path}/runs/typo_dir)" in err, err
    assert "hub" not in err and hub[0] == []


def test_local_paths_and_hub_ids_are_told_apart(tmp_path, monkeypatch, hub):
    from dilocox.hf import ExportError, resolve_hf_dir

    calls, answers = hub
    monkeypatch.chdir(tmp_path)
    for path in ("./nope", "../nope", "~/nope", "/abs/nope", "a/b/c", "with space", ".hidden"):
        with pytest.raises(ExportError, match="no such directory: .* does not exist"):
            resolve_hf_dir(path)
    assert calls == []
    answers.update({"gpt2": "/cache/gpt2", "Qwen/Qwen2-0.5B": "/cache/qwen"})
    assert resolve_hf_dir("gpt2") == "/cache/gpt2" and resolve_hf_dir("Qwen/Qwen2-0.5B") == "/cache/qwen"
    with pytest.raises(ExportError) as e:  # a bare name may be either: the hub is asked, both are named
        resolve_hf_dir("nonexist_local_dir")
    msg = str(e.value)
    assert f"no such directory: nonexist_local_dir (resolved to {tmp_path}/nonexist_local_dir)" in msg, msg
    assert "could not be fetched from the hub" in msg and "\n" not in msg
    assert calls == ["gpt2", "Qwen/Qwen2-0.5B", "nonexist_local_dir"]


@pytest.mark.parametrize("cmd", [["eval", "--text", "TEXT"], ["generate", "--prompt", "a"]])
@pytest.mark.parametrize("device", ["gpu", "cuda:x", "mps"])
def test_device_is_checked_before_torch_sees_it(tmp_path, capsys, cmd, device):
    """`dilocox eval RUN --device gpu` printed torch's "Expected one of cpu, cuda, ipu, ..."."""
    from dilocox.data.tokenizer import ByteTokenizer
    from dilocox.model.transformer import build_model

    m = ModelConfig(n_layers=1, d_model=32, max_seq_len=32)
    hf.save_hf_dir(str(tmp_path / "hf"), m, build_model(m).gather_full_state_dict(), ByteTokenizer())
    (tmp_path / "t.txt").write_text("some text to score " * 4)
    args = [str(tmp_path / "t.txt") if x == "TEXT" else x for x in cmd[1:]]
    assert cli_main([cmd[0], str(tmp_path / "hf"), *args, "--device", device]) == 2
    err = capsys.readouterr().err
    assert f"--device {device!r} is not a device here; use --device cpu, cuda or cuda:N" in err, err
    assert "Expected one of" not in err and err.count("\n") == 1


def _metrics(d, *lines: bytes):
    d.mkdir()
    (d / "metrics.jsonl").write_bytes(b"".join(lines))


def test_a_metrics_line_that_is_not_utf8_is_named(tmp_path, capsys):
    """A metrics.jsonl line with bytes that are not UTF-8 gave a UnicodeDecodeError traceback; it is now refused with
    its file and line, as a line that is not JSON is (and ignored with a note when it is the cut-off last line)."""
    from dilocox.runplots import ReportError, load_metrics

    rec = [json.dumps({"step": s, "time": 0.1 * s, "loss": 5.0}).encode() + b"\n" for s in (1, 2, 3)]
    _metrics(tmp_path / "bad", rec[0], b'{"step": 2, "note": "\xff\xfe"}\n', rec[2])
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not UTF-8 text \(byte 0xff at column 22\); fix or del"):
        load_metrics(str(tmp_path / "bad"))
    assert cli_main(["report", str(tmp_path / "bad"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:2: not UTF-8 text" in err and "Traceback" not in err
    _metrics(tmp_path / "cut", rec[0], rec[1], b'{"step": 3, "note": "\xe2\x9c')  # a killed run, mid-character
    assert [r["step"] for r in load_metrics(str(tmp_path / "cut"))] == [1, 2]
    assert "ignoring the incomplete last line" in capsys.readouterr().err
