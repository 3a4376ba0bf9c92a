"""Issue 42 item 1: the elastic lighthouse is authenticated by default.

``outer.elastic.lighthouse_auth`` follows ``security.authenticate`` (null by default); ``dilocox lighthouse`` refuses a
bind other hosts can reach without ``--secret-file`` unless ``--insecure`` (one line, exit 2); a replica that
authenticates refuses a plain lighthouse (and a guard of another run) in one line instead of retrying into its quorum
timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dilocox.net.secure import create_secret, load_secret

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELASTIC = ["--outer.method=diloco", "--outer.elastic.enabled=true", "--outer.elastic.lighthouse=http://127.0.0.1:1"]


def test_lighthouse_auth_follows_security_authenticate_by_default():
    from dilocox.config import ConfigError, load_config

    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    assert load_config(tiny, ELASTIC).outer.elastic.lighthouse_auth is True  # secure by default
    assert load_config(tiny, [*ELASTIC, "--security.authenticate=false"]).outer.elastic.lighthouse_auth is False
    assert load_config(tiny, [*ELASTIC, "--outer.elastic.lighthouse_auth=false"]).outer.elastic.lighthouse_auth is False
    with pytest.raises(ConfigError, match="outer.elastic.lighthouse_auth.*needs security.authenticate=true"):
        load_config(tiny, [*ELASTIC, "--outer.elastic.lighthouse_auth=true", "--security.authenticate=false"])
    from dilocox.elastic import ElasticConfig

    with_secret = ElasticConfig("http://127.0.0.1:1", 0, secret=b"s" * 32)
    with_secret.validate()
    plain = ElasticConfig("http://127.0.0.1:1", 0)
    plain.validate()
    assert with_secret.lighthouse_auth is True and plain.lighthouse_auth is False


def _lighthouse(*args: str, wait: float = 90.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox.cli", "lighthouse", "--min-replicas", "1", *args],
        capture_output=True,
        text=True,
        timeout=wait,
        cwd=ROOT,
    )


@pytest.mark.parametrize("bind", ["0.0.0.0:0", "[::]:0"])
def test_dilocox_lighthouse_refuses_a_reachable_bind_without_a_secret(bind):
    p = _lighthouse("--bind", bind)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip()
    assert err.count("\n") == 0 and bind in err and "--secret-file" in err and "--insecure" in err, err
    p = _lighthouse()  # the default bind (0.0.0.0:0) too
    assert p.returncode == 2 and "--secret-file" in p.stderr


def test_dilocox_lighthouse_insecure_or_loopback_or_with_a_secret_starts(tmp_path):
    secret = str(tmp_path / "secret")
    create_secret(secret)
    for args in (["--bind", "0.0.0.0:0", "--insecure"], ["--bind", "127.0.0.1:0"], ["--secret-file", secret]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "dilocox.cli", "lighthouse", "--min-replicas", "1", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            import select

            ready, _, _ = select.select([proc.stdout], [], [], 90)
            assert ready, f"{args}: no address line within 90 s"
            line = proc.stdout.readline()
            assert line.startswith("dilocox lighthouse: http://"), (args, line, proc.poll())
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_a_replica_that_authenticates_refuses_a_plain_lighthouse_in_one_line(tmp_path):
    from dilocox.elastic import ElasticConfig, ElasticOuterGroup, start_lighthouse
    from dilocox.elastic.group import ElasticError

    path = str(tmp_path / "secret")
    create_secret(path)
    secret = load_secret(path)
    plain = start_lighthouse(1, bind="127.0.0.1:0")
    other = start_lighthouse(1, bind="127.0.0.1:0", secret=b"o" * 32)  # a guard of another run
    try:
        for lh, why in ((plain, "a plain lighthouse"), (other, "refused this replica's proof")):
            cfg = ElasticConfig(lh.address(), 0, timeout_s=5, quorum_timeout_s=10, secret=secret)  # lighthouse_auth:
            t0 = time.monotonic()  # null, so on with the secret
            with pytest.raises(ElasticError, match=why) as e:
                ElasticOuterGroup(cfg)
            assert time.monotonic() - t0 < 8.0  # not the quorum timeout: refused at once (a 3 s probe at most)
            msg = str(e.value)
            assert "\n" not in msg and "dilocox lighthouse --secret-file" in msg and "lighthouse_auth=false" in msg
    finally:
        plain.shutdown()
        other.shutdown()


def test_the_documented_recipes_start_authenticated_lighthouses():
    """Every `dilocox lighthouse` command in the docs that binds an address other hosts can reach names the run
    secret (or says --insecure), and every hand-started replica recipe passes the secret file."""
    import re

    from dilocox.elastic.stores import _is_loopback

    seen = 0
    for doc in ("ELASTIC.md", "SECURITY.md"):
        with open(os.path.join(ROOT, "docs", doc)) as f:
            text = f.read()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            cmds = block.replace("\\\n", " ").splitlines()
            for cmd in cmds:
                cmd = cmd.split("#", 1)[0]
                if "dilocox lighthouse" in cmd:
                    bind = re.search(r"--bind\s+(\S+)", cmd)
                    host = (bind.group(1) if bind else "0.0.0.0:0").rpartition(":")[0].strip("[]")
                    if not _is_loopback(host):
                        seen += 1
                        assert "--secret-file" in cmd or "--insecure" in cmd, f"docs/{doc}: {cmd.strip()}"
                if "dilocox train" in cmd and "outer.elastic.enabled=true" in cmd:
                    assert "--security.secret_file=" in cmd, f"docs/{doc}: {cmd.strip()}"
    assert seen >= 2  # (the recipes were found)


def test_dilocox_swarm_store_refuses_a_reachable_bind_without_a_secret():
    p = subprocess.run(
        [sys.executable, "-m", "dilocox.cli", "swarm", "store", "--port", "29999"],  # --bind 0.0.0.0 by default
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert p.returncode == 2, (p.returncode, p.stderr)
    err = p.stderr.strip()
    assert err.count("\n") == 0 and "--secret-file" in err and "--insecure" in err, err


@pytest.mark.parametrize("answer,plain", [(b"DXB1", False), (b"", True)], ids=["busy-guard", "silent"])
def test_unguarded_reads_busy_as_a_guard_and_silence_as_plain(answer, plain):
    """A guard whose handshake slots are full answers BUSY: still a guard (a flood must not make a replica refuse its
    own lighthouse); a server that accepts and says nothing is a plain lighthouse; a port that does not accept is no
    verdict (the relay retries)."""
    import socket
    import threading

    from dilocox.net.relay import unguarded
    from dilocox.net.secure import BUSY

    assert answer in (BUSY, b"")
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    held = []

    def serve():
        c, _ = srv.accept()
        held.append(c)
        if answer:
            c.sendall(answer)
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        why = unguarded([("127.0.0.1", port)], b"s" * 32, wait_s=1.0)
        assert (why is not None and "plain lighthouse" in why) if plain else why is None, why
    finally:
        t.join(5)
        for c in held:
            c.close()
        srv.close()
    with socket.socket() as free:  # bound, not listening, held: refused, and no other process can take it meanwhile
        free.bind(("127.0.0.1", 0))
        assert unguarded([("127.0.0.1", free.getsockname()[1])], b"s" * 32, wait_s=1.0) is None
