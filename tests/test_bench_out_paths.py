"""Every ``dilocox bench KIND`` checks its output paths while parsing its arguments (found by a review: a ``--json``
that named a directory, or an ``--out`` that named a file, ended in a traceback after the whole benchmark had run).

Each bench runs in process through ``dilocox.cli.main``, its work functions replaced by ones that raise: a bad path
must exit 2 with one line naming the flag, the path and the fix, before any of the work starts.
"""

from __future__ import annotations

import importlib
import os

import pytest

from dilocox import cli
from dilocox.bench import runner


class WorkStarted(BaseException):
    """The bench started its work: its output paths were not checked first (no Exception: no bench catches it)."""


# (bench argv, flag, "dir" | "file", the work functions "module.attr" that must not be called)
CASES = [
    (["kernels", "--sizes", "1K", "--repeats", "1", "--no-reference"], "--json", "file", ["kernels.run"]),
    (["compression", "--no-real", "--ranks", "1"], "--json", "file", ["compression.run"]),
    (["train", "--steps", "2"], "--out", "dir", ["train.run"]),
    (["train", "--reference", "--cases", "tiny"], "--out", "dir", ["reference.run_case", "reference.profile_case"]),
    (["train", "--reference", "--cases", "tiny"], "--md", "file", ["reference.run_case", "reference.profile_case"]),
    (["methods", "--steps", "2"], "--out", "dir", ["methods.run"]),
    (["frontier", "--quick"], "--out", "dir", ["frontier.run"]),
    (["scale"], "--out", "dir", ["scale.run"]),
    (["lengths", "."], "--out", "dir", ["lengths.collect"]),
    (["wan"], "--out", "dir", ["wan.bench"]),
    (["wan"], "--run-root", "dir", ["wan.bench"]),
    (["elastic"], "--out", "dir", ["elastic.bench"]),
    (["elastic"], "--runs", "dir", ["elastic.bench"]),
    (["churn"], "--out", "dir", ["churn.bench"]),
    (["churn"], "--runs", "dir", ["churn.bench"]),
    (["swarm"], "--out", "dir", ["swarm.part_a", "swarm.part_b", "swarm.part_c", "swarm.part_d"]),
    (["swarm"], "--runs", "dir", ["swarm.part_a", "swarm.part_b", "swarm.part_c", "swarm.part_d"]),
    (["swarm", "--parts", "e"], "--out", "dir", ["swarm_act.run_point"]),
    (["swarm", "--parts", "e"], "--runs", "dir", ["swarm_act.run_point"]),
    (["switch"], "--out", "dir", ["switch.measure"]),
    (["rpc"], "--out", "dir", ["rpc.bench"]),
    (["memory", "--cases", "tiny"], "--out", "dir", ["memory.run_case"]),
    (["checkpoint", "--layouts", "one"], "--out", "dir", ["checkpoint.run"]),
    (["checkpoint", "--layouts", "one"], "--workdir", "dir", ["checkpoint.run"]),
]


def _ids() -> list[str]:
    return [" ".join([argv[0], *(a for a in ("--reference", "e") if a in argv), flag]) for argv, flag, _, _ in CASES]


def _block_work(monkeypatch, work: list[str]) -> None:
    for name in work:
        module, attr = name.rsplit(".", 1)
        mod = importlib.import_module(f"dilocox.bench.{module}")

        def started(*args, _name=name, **kwargs):
            raise WorkStarted(f"{_name} ran before the output path was checked")

        monkeypatch.setattr(mod, attr, started)


def _bad_paths(tmp_path, kind: str) -> list[str]:
    """Paths a ``kind`` flag cannot write: the wrong kind of thing, and one under a regular file."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    adir = tmp_path / "data"
    adir.mkdir()
    if kind == "dir":
        return [str(afile), str(afile / "sub")]
    return [str(adir), str(afile / "rows.json"), str(tmp_path / "newdir") + os.sep]


def _one_line_error(err: str, flag: str, path: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    line = lines[0]
    assert flag in line and path in line and "give " in line, line
    return line


@pytest.mark.parametrize("argv,flag,kind,work", CASES, ids=_ids())
def test_a_bad_output_path_exits_2_before_the_work(argv, flag, kind, work, tmp_path, monkeypatch, capsys):
    _block_work(monkeypatch, work)
    monkeypatch.chdir(tmp_path)  # (the other output flags keep their defaults: relative, written nowhere here)
    for path in _bad_paths(tmp_path, kind):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", *argv, flag, path])
        assert e.value.code == 2, path
        _one_line_error(capsys.readouterr().err, flag, path)


def test_every_bench_is_covered():
    """A new bench (cli.BENCHES) with an output flag gets a row in CASES."""
    assert {argv[0] for argv, _, _, _ in CASES} == set(cli.BENCHES)


def test_the_messages_name_what_is_wrong_and_the_fix(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file, not a directory" in runner.out_path_problem(str(afile), directory=True)
    assert f"{afile} is a file" in runner.out_path_problem(str(afile / "a" / "b"), directory=True)
    assert "is a directory" in runner.out_path_problem(str(tmp_path), directory=False)
    assert "results.json" in runner.out_path_problem(str(tmp_path), directory=False)  # the fix: a file in it
    assert f"{afile} is a file" in runner.out_path_problem(str(afile / "x.json"), directory=False)


def test_writable_paths_pass_and_nothing_is_created(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    new = tmp_path / "a" / "b"
    assert runner.out_path_problem(str(new), directory=True) is None
    assert runner.out_path_problem(str(tmp_path), directory=True) is None
    assert runner.out_path_problem(str(new / "rows.json"), directory=False) is None
    assert runner.out_path_problem(str(afile), directory=False) is None  # (overwritten, as before)
    assert not (tmp_path / "a").exists()  # a check creates nothing: the bench makes its directories when it writes


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert "cannot write" in runner.out_path_problem(str(ro / "out"), directory=True)
        assert "cannot write" in runner.out_path_problem(str(ro / "rows.json"), directory=False)
        assert "cannot write" in runner.out_path_problem(str(ro), directory=True)
    finally:
        ro.chmod(0o700)


def test_kernels_json_into_a_new_directory_is_written(tmp_path, monkeypatch, capsys):
    """A --json whose directory does not exist yet passes the check, so the bench makes that directory (was: a
    FileNotFoundError after the run)."""
    from dilocox.bench import compression, kernels

    monkeypatch.setattr(kernels, "run", lambda *a, **k: [])
    monkeypatch.setattr(compression, "run", lambda *a, **k: [])
    monkeypatch.setattr(compression, "markdown", lambda rows: "")
    out = tmp_path / "new" / "kernels.json"
    assert cli.main(["bench", "kernels", "--sizes", "1K", "--json", str(out)]) == 0
    assert out.exists() and (out.parent / "results.md").exists()
    out = tmp_path / "new2" / "compression.json"
    assert cli.main(["bench", "compression", "--no-real", "--ranks", "1", "--json", str(out)]) == 0
    assert out.exists()


def test_the_reference_default_table_path_is_checked_and_no_write_skips_the_checks(tmp_path, monkeypatch, capsys):
    from dilocox.bench import reference

    monkeypatch.setattr(reference, "run_case", lambda *a, **k: (_ for _ in ()).throw(WorkStarted("run_case")))
    out = tmp_path / "out"
    (out / "results.md").mkdir(parents=True)  # the table's default path (OUT/results.md) is a directory
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "train", "--reference", "--cases", "tiny", "--out", str(out)])
    assert e.value.code == 2
    _one_line_error(capsys.readouterr().err, "--md", str(out / "results.md"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(WorkStarted):  # --no-write: nothing is written, so --out is not checked
        cli.main(["bench", "train", "--reference", "--cases", "tiny", "--no-write", "--out", str(afile)])
