"""Commands of the user guides (docs/ELASTIC.md, SWARM.md, RELIABILITY.md, SECURITY.md) run as written, with the
outcome the guide states."""

import os
import subprocess
import sys

import pytest

from dilocox.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _secret(path, mode: int, text: str = "ab" * 32) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("kind", ["open", "short", "directory"])
def test_swarm_refuses_a_bad_secret_file_with_one_line_exit_2(tmp_path, capsys, kind):
    # docs/SECURITY.md: a secret file others may read, or one shorter than 32 bytes, "is refused with one line
    # naming the file and the fix", as is one that is not a regular file (dilocox swarm printed a traceback and
    # exited 1: a SecretError, and an IsADirectoryError for a directory)
    fix = {"open": "chmod 600", "short": "dilocox secret", "directory": "not a regular file"}[kind]
    if kind == "directory":
        path = str(tmp_path)
    else:
        path = _secret(tmp_path / "secret", 0o644) if kind == "open" else _secret(tmp_path / "secret", 0o600, "x")
    cfg = os.path.join(ROOT, "configs", "tiny.yaml")
    rc = cli_main(["swarm", cfg, "--peers", "1,1", "--steps", "1", "--out", str(tmp_path / "out"),
                   f"--security.secret_file={path}"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("config error: ") and path in err and fix in err, err


def test_a_hand_started_elastic_replica_with_a_bad_secret_is_one_line_exit_2(tmp_path):
    # the replica recipe of docs/ELASTIC.md with a group-readable secret file: one line, exit 2 (was a traceback, 1)
    path = _secret(tmp_path / "secret", 0o640)
    cmd = [
        sys.executable, "-m", "dilocox.cli", "train", os.path.join(ROOT, "configs", "tiny.yaml"), "--train.steps=2",
        "--outer.method=diloco", "--outer.elastic.enabled=true", "--outer.elastic.lighthouse=http://127.0.0.1:9",
        "--outer.elastic.replica_rank=0", f"--security.secret_file={path}", f"--log.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"config error: security.secret_file='{path}' has mode 640" in p.stderr, p.stderr[-2000:]
    assert "chmod 600" in p.stderr
