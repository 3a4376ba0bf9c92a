"""The run dir (issue 9, items 6-7): one run at a time, resume guard, config history, metrics once per step.

The end-to-end tests drive ``dilocox train`` in subprocesses (each bounded by a timeout, its process
group killed on failure) on copies of one 6-step tiny run with checkpoints at steps 2, 4, 6.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from dilocox import checkpoint as ckpt
from dilocox import rundir
from dilocox.config import load_config
from tests.spawn import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _args(run_dir, cache, *extra):
    return [
        f"--log.run_dir={run_dir}",
        f"--data.cache_dir={cache}",
        "--data.max_bytes=400000",
        "--train.batch_size=4",
        "--train.seq_len=64",
        "--train.eval_every=0",
        "--train.eval_batches=2",
        "--log.tensorboard=false",
        "--log.progress=false",
        "--optim.warmup_steps=2",
        "--checkpoint.every=2",
        "--log.every=1",
        *extra,
    ]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _popen(run_dir, cache, *extra):
    cmd = [sys.executable, "-m", "dilocox.cli", "train", TINY, *_args(run_dir, cache, *extra)]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _kill(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(timeout=30)


def _train(run_dir, cache, *extra, timeout=240):
    p = _popen(run_dir, cache, *extra)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        _kill(p)
    return p.returncode, out, err


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "step" in r]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny run trained to step 6 (checkpoints 2, 4, 6); tests work on copies of it."""
    base = tmp_path_factory.mktemp("base")
    rc, _, err = _train(str(base / "run"), str(base / "cache"), "--train.steps=6", "--checkpoint.keep=3")
    assert rc == 0, err[-3000:]
    return base


@pytest.fixture
def run(finished_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(finished_run / "run", dst)
    return str(dst), str(finished_run / "cache")


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_fresh_run_writes_config_history_and_logs_grad_norm(run):
    run_dir, _ = run
    assert _read(os.path.join(run_dir, "config.0.yaml")) == _read(os.path.join(run_dir, "config.yaml"))
    assert _steps(run_dir) == [1, 2, 3, 4, 5, 6]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if "step" in r]
    assert all(r["grad_norm"] > 0 for r in recs)  # optim.grad_clip=1.0 in the tiny config computes it


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_resume_past_train_steps_is_refused_and_writes_nothing(run):
    run_dir, cache = run
    before = {n: _read(os.path.join(run_dir, n)) for n in ("metrics.jsonl", "config.yaml")}
    rc, out, err = _train(run_dir, cache, "--train.steps=4", "--checkpoint.resume_finished=error")
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert "already at step 6, at or past train.steps=4" in err and "nothing was trained" in err, err[-2000:]
    assert "Traceback" not in err
    assert {n: _read(os.path.join(run_dir, n)) for n in before} == before  # no summary appended, config kept
    assert not os.path.exists(os.path.join(run_dir, "config.6.yaml"))
    assert ckpt.find_latest(os.path.join(run_dir, "checkpoints")).endswith("step_00000006")


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_rerun_of_a_finished_run_says_already_finished_exits_0_and_writes_nothing(run):
    """`make train` twice (issue 40 item 4): the same command again, default settings: one line, exit 0."""
    run_dir, cache = run
    before = {n: _read(os.path.join(run_dir, n)) for n in ("metrics.jsonl", "config.yaml")}
    rc, out, err = _train(run_dir, cache, "--train.steps=6")
    assert rc == 0, err[-2000:]
    assert f"already finished: see {run_dir}" in out and f"`dilocox report {run_dir}`" in out, out[-2000:]
    assert "already at step 6" in out and "Traceback" not in err, out[-2000:]
    assert {n: _read(os.path.join(run_dir, n)) for n in before} == before
    assert not os.path.exists(os.path.join(run_dir, "config.6.yaml"))
    assert ckpt.find_latest(os.path.join(run_dir, "checkpoints")).endswith("step_00000006")


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_resume_with_a_changed_model_is_refused_listing_the_keys(run):
    run_dir, cache = run
    before = _read(os.path.join(run_dir, "metrics.jsonl"))
    rc, out, err = _train(run_dir, cache, "--train.steps=8", "--model.n_layers=3", "--train.seed=7", "--optim.lr=1e-3")
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert "model.n_layers: 4 -> 3" in err and "train.seed: 1234 -> 7" in err, err[-2000:]
    assert "optim.lr" not in err  # a schedule key is not a reason to refuse
    assert "Traceback" not in err
    assert _read(os.path.join(run_dir, "metrics.jsonl")) == before
    assert not os.path.exists(os.path.join(run_dir, "config.6.yaml"))


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_resumed_run_logs_each_step_once_and_keeps_config_history(run):
    run_dir, cache = run
    step4 = os.path.join(run_dir, "checkpoints", "step_00000004")
    rc, out, err = _train(run_dir, cache, "--train.steps=8", "--optim.lr=1e-3", f"--checkpoint.resume={step4}")
    assert rc == 0, err[-3000:]
    assert "warning: resuming with changed settings" in out and "optim.lr: 0.003 -> 0.001" in out, out[-2000:]
    assert _steps(run_dir) == [1, 2, 3, 4, 5, 6, 7, 8]  # steps 5, 6 of the first run dropped, not duplicated
    with open(os.path.join(run_dir, "metrics.discarded.jsonl")) as f:
        assert [r["step"] for r in map(json.loads, f) if "step" in r] == [5, 6]
    c0 = yaml.safe_load(_read(os.path.join(run_dir, "config.0.yaml")))
    c4 = yaml.safe_load(_read(os.path.join(run_dir, "config.4.yaml")))
    assert (c0["optim"]["lr"], c0["train"]["steps"]) == (0.003, 6)
    assert (c4["optim"]["lr"], c4["train"]["steps"]) == (0.001, 8)
    assert _read(os.path.join(run_dir, "config.yaml")) == _read(os.path.join(run_dir, "config.4.yaml"))


def _wait_for_step_past(run_dir, step, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if max(_steps(run_dir), default=0) > step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the holder did not train past step {step} within {timeout} s")


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_second_run_on_a_busy_run_dir_names_the_holder(run):
    run_dir, cache = run
    holder = _popen(run_dir, cache, "--train.steps=100000", "--checkpoint.every=0")
    try:
        _wait_for_step_past(run_dir, 6, holder, timeout=180)
        t0 = time.time()
        rc, out, err = _train(run_dir, cache, "--train.steps=8", timeout=120)
        assert rc == 2, (rc, out[-2000:], err[-2000:])
        assert f"pid {holder.pid} on host {socket.gethostname()}" in err, err[-2000:]
        assert "is in use by another run" in err
        assert time.time() - t0 < 120
        assert holder.poll() is None  # the holder was not disturbed
    finally:
        _kill(holder)
    lock = rundir.RunDirLock(run_dir)  # released by the holder's death (SIGKILL: no clean-up ran)
    lock.release()


HOLD = textwrap.dedent("""
    import sys, time
    from dilocox.rundir import RunDirLock
    RunDirLock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(120)
""")


def _trainer_on(rank, world, run_dir, cache):
    from dilocox.train import Trainer

    cfg = load_config(TINY, _args(run_dir, cache, "--train.steps=2", "--parallel.data=2"))
    try:
        Trainer(cfg)
    except rundir.RunDirError as e:
        return str(e)
    return "no error"


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_every_rank_stops_when_rank_0_cannot_lock(tmp_path):
    run_dir = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, run_dir],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.time()
        msgs = run_ranks(2, _trainer_on, run_dir, str(tmp_path / "cache"), timeout=120)
        assert time.time() - t0 < 120
    finally:
        _kill(holder)
    assert f"pid {holder.pid}" in msgs[0], msgs
    assert "could not be locked by rank 0" in msgs[1], msgs


# --------------------------------------------------------------------------- units


def test_config_changes_split_math_from_schedule():
    base = load_config(TINY, []).to_dict()
    new = load_config(
        TINY,
        [
            "--train.steps=999",
            "--optim.lr=1e-2",
            "--log.every=3",
            "--checkpoint.every=7",
            "--parallel.tensor=2",
            "--outer.method=diloco",
            "--compress.quant=int8",
            "--data.max_bytes=1000",
        ],
    ).to_dict()
    math_, sched = rundir.config_changes(base, new)
    assert {k for k, _, _ in math_} == {"outer.method", "compress.quant", "data.max_bytes"}
    assert {k for k, _, _ in sched} == {"train.steps", "optim.lr", "log.every", "checkpoint.every", "parallel.tensor"}
    old = load_config(TINY, ["--outer.elastic.lighthouse_auth=false", "--outer.elastic.min_replicas=3"]).to_dict()
    assert rundir.config_changes(old, base) == ([], [])  # outer.elastic.* is not read by a run without elastic
    el = ["--outer.method=diloco", "--outer.elastic.enabled=true", "--outer.elastic.lighthouse=http://h:1"]
    old, new = (load_config(TINY, [*el, f"--outer.elastic.max_replicas={n}"]).to_dict() for n in (2, 3))
    assert [k for k, _, _ in rundir.config_changes(old, new)[0]] == ["outer.elastic.max_replicas"]  # (its data shard)
    old = load_config(TINY, [*el, "--outer.elastic.lighthouse_auth=false"]).to_dict()
    assert [k for k, _, _ in rundir.config_changes(old, load_config(TINY, el).to_dict())[1]] == [
        "outer.elastic.lighthouse_auth"
    ]  # who may join: a schedule key
    del base["train"]["seed"]  # a key unknown to an older version counts as its default
    assert rundir.config_changes(base, load_config(TINY, []).to_dict()) == ([], [])
    assert [k for k, _, _ in rundir.config_changes(base, load_config(TINY, ["--train.seed=5"]).to_dict())[0]] == [
        "train.seed"
    ]


def test_truncate_metrics_keeps_records_up_to_the_step(tmp_path):
    lines = [
        {"step": 1},
        {"step": 2},
        {"summary": {"steps": 2}},
        {"event": "resume"},
        {"step": 3},
        {"step": 4},
        {"summary": {"steps": 4}},
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "lo'  # a line cut by a crash
    (tmp_path / "metrics.jsonl").write_text(text)
    assert rundir.truncate_metrics(str(tmp_path), 2) == 4
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:4]
    assert rundir.truncate_metrics(str(tmp_path), 2) == 0


def test_config_history_never_replaces_a_different_file(tmp_path):
    d = str(tmp_path)
    assert rundir.write_config_history(d, "a: 1\n", 0).endswith("config.0.yaml")
    assert rundir.write_config_history(d, "a: 1\n", 0).endswith("config.0.yaml")  # same content: reused
    assert rundir.write_config_history(d, "a: 2\n", 0).endswith("config.0.1.yaml")
    assert (tmp_path / "config.0.yaml").read_text() == "a: 1\n"
    assert (tmp_path / "config.yaml").read_text() == "a: 2\n"


def test_lock_is_exclusive_across_processes_and_reentrant_within_one(tmp_path):
    d = str(tmp_path / "run")
    a = rundir.RunDirLock(d)
    b = rundir.RunDirLock(d)  # same process: shared
    probe = (
        "import sys\nfrom dilocox.rundir import RunDirLock, RunDirError\ntry:\n    RunDirLock(sys.argv[1])\n"
        "except RunDirError as e:\n    print(e)\n    sys.exit(3)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, d], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 3 and f"pid {os.getpid()}" in r.stdout, r
    a.release()
    r = subprocess.run(
        [sys.executable, "-c", probe, d], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 3, r  # b still holds it
    b.release()
    r = subprocess.run(
        [sys.executable, "-c", probe, d], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r


# --------------------------------------------------------------------------- restart safety (issue 44 item 3)


def _steps_unique_and_continuous(run_dir, last):
    steps = _steps(run_dir)
    assert steps == list(range(1, last + 1)), steps  # each step once, none missing


@pytest.mark.slow  # subprocess runs of dilocox train: 15-40 s each on 2 loaded cores
def test_moved_checkpoint_dir_refuses_a_silent_restart_then_resume_none_starts_over(run, tmp_path):
    """The disk-full advice (move checkpoint.dir) on a finished run: no checkpoint there, so a start at step 0 would
    append steps 1-6 again; refused in one line naming --checkpoint.resume=none and a new run dir."""
    run_dir, cache = run
    before = _read(os.path.join(run_dir, "metrics.jsonl"))
    elsewhere = str(tmp_path / "elsewhere")
    rc, out, err = _train(run_dir, cache, "--train.steps=6", f"--checkpoint.dir={elsewhere}")
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    line = err.strip().splitlines()[-1]
    assert "--checkpoint.resume=none" in line and "--log.run_dir" in line and "step 6" in line, err[-2000:]
    assert "Traceback" not in err
    assert _read(os.path.join(run_dir, "metrics.jsonl")) == before  # nothing written
    rc, out, err = _train(
        run_dir, cache, "--train.steps=4", f"--checkpoint.dir={elsewhere}", "--checkpoint.resume=none"
    )
    assert rc == 0, err[-3000:]
    _steps_unique_and_continuous(run_dir, 4)  # the new run's steps only
    with open(os.path.join(run_dir, "metrics.discarded.jsonl")) as f:
        assert [r["step"] for r in map(json.loads, f) if "step" in r] == [1, 2, 3, 4, 5, 6]


def _wait_for_step(run_dir, step, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended (rc {proc.returncode}) before step {step}: {proc.stderr.read()[-3000:]}"
            )
        try:
            if max(_steps(run_dir), default=0) >= step:
                return
        except (OSError, ValueError):  # a line being written
            pass
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step} within {timeout} s")


@pytest.mark.slow  # four subprocess runs of dilocox train: 30-80 s on 2 loaded cores
def test_kill_9_then_a_plain_rerun_resumes_with_each_step_logged_once(tmp_path):
    """Default checkpoint settings (checkpoint.every=100): kill -9 before the first checkpoint (step 30: the rerun
    starts over, nothing was saved), then that rerun killed after it (step 130: the next rerun resumes from step 100);
    the finished metrics.jsonl holds steps 1..160 once each (neither the first run's steps 1-30 nor the second's
    101-130 twice), and one more run of the same command says 'already finished'. (One sequence, not one run per
    kill: the start-over rerun is the run killed at 130.)"""
    run_dir, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    args = [
        f"--log.run_dir={run_dir}",
        f"--data.cache_dir={cache}",
        "--data.max_bytes=400000",
        "--train.batch_size=2",
        "--train.seq_len=32",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--log.tensorboard=false",
        "--log.progress=false",
        "--train.steps=160",
        "--log.every=1",  # each step's record written at its step (the kill is timed by them)
    ]  # no checkpoint.* key: the defaults are under test
    cmd = [sys.executable, "-m", "dilocox.cli", "train", TINY, *args]

    def popen():
        return subprocess.Popen(
            cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

    ckdir = os.path.join(run_dir, "checkpoints")
    for kill_at in (30, 130):
        victim = popen()
        try:
            _wait_for_step(run_dir, kill_at, victim, timeout=240)
        finally:
            _kill(victim)  # SIGKILL to the process group: no handler runs
        assert victim.returncode == -signal.SIGKILL
        saved = ckpt.find_latest(ckdir)
        assert (saved is None) if kill_at < 100 else saved.endswith("step_00000100"), (kill_at, saved)
    for attempt in ("rerun", "third"):
        p = popen()
        try:
            out, err = p.communicate(timeout=240)
        finally:
            _kill(p)
        assert p.returncode == 0, (attempt, out[-2000:], err[-3000:])
        _steps_unique_and_continuous(run_dir, 160)
    assert f"already finished: see {run_dir}" in out, out[-2000:]  # the third run: nothing trained, exit 0
    kept = [os.path.basename(p) for p in ckpt.complete_steps(ckdir)]
    assert kept == ["step_00000100", "step_00000160"], kept  # checkpoint.keep=2 by default


def _metrics(run_dir, *recs):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def test_fresh_start_on_earlier_records_is_allowed_only_when_nothing_is_lost(tmp_path):
    from dilocox.config import to_yaml

    d = str(tmp_path / "run")
    cfg = load_config(TINY, [f"--log.run_dir={d}"])
    ck = os.path.join(d, "checkpoints")
    assert rundir.check_fresh_start(d, ck, cfg) is None  # no run dir yet
    _metrics(d, {"step": 1}, {"step": 2}, {"step": 3, "loss": 1.0})
    rundir.write_config_history(d, to_yaml(cfg), 0)
    note = rundir.check_fresh_start(d, ck, cfg)  # same config, never checkpointed: starting over loses nothing
    assert "stopped at step 3 before its first checkpoint" in note
    other = load_config(TINY, [f"--log.run_dir={d}", "--train.seed=5"])
    with pytest.raises(rundir.RunDirError, match=r"another config .*--checkpoint.resume=none.*--log.run_dir"):
        rundir.check_fresh_start(d, ck, other)
    for extra, what in (
        ({"event": "checkpoint", "at_step": 2, "path": "/x/step_00000002"}, "/x/step_00000002"),
        ({"summary": {"steps": 3}}, "a finished run up to step 3"),
        ({"event": "resume", "resumed_at": 2}, "an earlier run up to step 3"),
    ):
        _metrics(d, {"step": 1}, {"step": 2}, extra, {"step": 3})
        with pytest.raises(rundir.RunDirError, match="--checkpoint.resume=none") as e:
            rundir.check_fresh_start(d, ck, cfg)
        assert what in str(e.value) and "\n" not in str(e.value)
    # a finished run's final save is not recorded (it comes after the summary): the message named the last mid-run
    # checkpoint as the run's last (found by review); it names the final one, at the last step
    _metrics(d, {"step": 2}, {"event": "checkpoint", "at_step": 2, "path": "/x/step_00000002"}, {"step": 3},
             {"summary": {"steps": 3}})  # fmt: skip
    with pytest.raises(rundir.RunDirError) as e:
        rundir.check_fresh_start(d, ck, cfg)
    assert f"its final checkpoint: {os.path.join(ck, 'step_00000003')}" in str(e.value), str(e.value)
    fresh = load_config(TINY, [f"--log.run_dir={d}", "--checkpoint.resume=none"])
    assert "checkpoint.resume=none: starting over" in rundir.check_fresh_start(d, ck, fresh)
    with open(os.path.join(d, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "lo')  # a line cut by a kill
    assert rundir.set_aside_metrics(d) == 5
    assert open(os.path.join(d, "metrics.jsonl")).read() == ""
    moved = open(os.path.join(d, rundir.DISCARDED_NAME)).read().splitlines()
    assert json.loads(moved[0])["discarded_after_step"] == 0 and len(moved) == 6 and moved[-1] == '{"step": 4, "lo'
    assert rundir.check_fresh_start(d, ck, cfg) is None  # nothing left to protect


class _Died(BaseException):
    """The process died here (a BaseException: no ``except OSError`` / ``except Exception`` of the code catches it)."""


_FS_CALLS = ("replace", "rename", "remove", "unlink", "open", "fsync", "link")


def _dying_after(monkeypatch, k: int, fn):
    """``fn()`` with the process "dying" (``_Died``) at its (k+1)-th file-system call of ``_FS_CALLS``: (result, False)
    when it ran through, (None, True) when it died."""
    calls, real = [0], {n: getattr(os, n) for n in _FS_CALLS}

    def dying(name):
        def call(*a, **kw):
            calls[0] += 1
            if calls[0] > k:
                raise _Died(f"os.{name}")
            return real[name](*a, **kw)

        return call

    with monkeypatch.context() as m:
        for n in _FS_CALLS:
            m.setattr(os, n, dying(n))
        try:
            return fn(), False
        except _Died:
            return None, True


def _records_where(d):
    """Every record line of the run dir, by where it is: metrics.jsonl, the discarded file (without its markers), and
    a pending set-aside whose marker is not in the discarded file yet (one that is counts nowhere: it is done)."""

    def lines(name):
        p = os.path.join(d, name)
        return open(p).read().splitlines() if os.path.exists(p) else []

    discarded = lines(rundir.DISCARDED_NAME)
    pending = []
    for name in os.listdir(d):
        if name.startswith(rundir.SET_ASIDE_PREFIX):
            token = name[len(rundir.SET_ASIDE_PREFIX) : -len(".jsonl")]
            if not any(f'"set_aside": "{token}"' in ln for ln in discarded):
                pending += lines(name)
    return lines("metrics.jsonl"), [ln for ln in discarded if "discarded_after_step" not in ln], pending


def test_set_aside_metrics_loses_and_duplicates_no_record_wherever_the_process_dies(tmp_path, monkeypatch):
    """The process dies at its k-th file-system call inside ``set_aside_metrics`` (every k until one runs through:
    each rename, removal, open and fsync): right after, every record is in exactly one place (metrics.jsonl, the
    discarded file, or a pending set-aside not yet in it); the next start (``check_fresh_start``, then the set-aside
    again) moves each to the discarded file exactly once. Before, a death between the append and the rewrite of
    metrics.jsonl left every record in both files."""
    records = [json.dumps({"step": i, "loss": 1.0 / i}) for i in range(1, 6)] + ['{"step": 6, "lo']  # (a cut line)
    older = [json.dumps({"discarded_after_step": 3, "time": 1.0}), json.dumps({"step": 4})]
    cfg = load_config(TINY, ["--checkpoint.resume=none"])
    k = 0
    while True:
        d = str(tmp_path / f"run{k}")
        os.makedirs(d)
        with open(os.path.join(d, "metrics.jsonl"), "w") as f:
            f.write("\n".join(records))  # (the last line without its newline: cut by a kill)
        with open(os.path.join(d, rundir.DISCARDED_NAME), "w") as f:
            f.write("\n".join(older) + "\n")
        moved, died = _dying_after(monkeypatch, k, lambda: rundir.set_aside_metrics(d))
        live, discarded, pending = _records_where(d)
        everywhere = live + discarded + pending
        assert sorted(everywhere) == sorted(records + older[1:]), (k, live, discarded, pending)  # once each
        # the next start: the check finishes a cut-short set-aside, and the set-aside runs again
        rundir.check_fresh_start(d, os.path.join(d, "checkpoints"), cfg)
        again = rundir.set_aside_metrics(d)
        live, discarded, pending = _records_where(d)
        assert live == [] and pending == [] and discarded == older[1:] + records, (k, live, discarded)
        assert not [n for n in os.listdir(d) if n.startswith(rundir.SET_ASIDE_PREFIX)]
        if not died:
            assert open(os.path.join(d, "metrics.jsonl")).read() == ""
            assert moved == len(records) and again == 0
            break
        k += 1
    assert k >= 8, k  # (the set-aside's steps: rename, write, fsyncs, replace, remove, the empty file)


def _moved_where(d):
    """Every record line of metrics.jsonl, the discarded file (without markers) and a pending move's file."""

    def lines(p):
        return open(p).read().splitlines() if os.path.exists(p) else []

    path, disc = os.path.join(d, "metrics.jsonl"), os.path.join(d, rundir.DISCARDED_NAME)
    pending = [os.path.join(d, n) for n in os.listdir(d) if rundir.MOVING_INFIX in n]
    return lines(path), [ln for ln in lines(disc) if "discarded_after_step" not in ln], pending


@pytest.mark.parametrize("mark", [True, False])
def test_move_records_after_loses_and_duplicates_no_record_wherever_the_process_dies(tmp_path, monkeypatch, mark):
    """``truncate_metrics`` / SWARM's ``discard_records`` (``move_records_after``) die at their k-th file-system call
    (every k until one runs through): right after, each record is in metrics.jsonl, the discarded file or the pending
    move's file, and never in both of the first two unless the pending file holds it; the next call finishes the
    move, and every record then sits in exactly one of the two files. Before, a death between the append to the
    discarded file and the rewrite of the records' file left the moved records in both, and the next truncate
    appended them again."""
    records = [json.dumps({"step": i, "loss": 1.0 / i}) for i in range(1, 7)] + ['{"step": 7, "lo']  # (a cut line)
    older = [json.dumps({"step": 9, "loss": 0.5})]
    k = 0
    while True:
        d = str(tmp_path / f"run{k}")
        os.makedirs(d)
        path, disc = os.path.join(d, "metrics.jsonl"), os.path.join(d, rundir.DISCARDED_NAME)
        with open(path, "w") as f:
            f.write("\n".join(records))
        with open(disc, "w") as f:
            f.write("\n".join(older) + "\n")
        moved, died = _dying_after(monkeypatch, k, lambda: rundir.move_records_after(path, disc, 3, mark=mark))
        live, discarded, pending = _moved_where(d)
        in_pending = [ln for p in pending for ln in open(p).read().splitlines()]
        assert set(live + discarded + in_pending) == set(records + older), k
        assert not (set(live) & set(discarded) - set(in_pending)), (k, live, discarded)
        again = rundir.move_records_after(path, disc, 3, mark=mark)  # the next start
        live, discarded, pending = _moved_where(d)
        assert pending == [] and live == records[:3], (k, live)
        assert discarded == older + records[3:], (k, discarded)  # each moved record once, in order
        if not died:
            assert moved == 4 and again == 0
            break
        k += 1
    assert k >= 6, k  # (the move's steps: rename, the discarded file's write and replace, the records' file, remove)


def test_a_cut_short_move_keeps_what_a_later_writer_appended(tmp_path):
    """A move cut short after the rename (the records' file gone), then a new writer made the file anew: finishing
    the move puts the kept records first and keeps the new ones."""
    d = str(tmp_path)
    path, disc = os.path.join(d, "metrics.jsonl"), os.path.join(d, rundir.DISCARDED_NAME)
    lines = [json.dumps({"step": i}) + "\n" for i in range(1, 5)]
    with open(f"{path}{rundir.MOVING_INFIX}2.abcd", "w") as f:
        f.writelines(lines)
    with open(path, "w") as f:
        f.write(json.dumps({"step": 3, "new": True}) + "\n")
    assert rundir.finish_moves(path, disc) == 2
    assert open(path).read().splitlines() == [lines[0].strip(), lines[1].strip(), json.dumps({"step": 3, "new": True})]
    assert [json.loads(x)["step"] for x in open(disc).read().splitlines()[1:]] == [3, 4]


def test_a_run_dir_that_is_empty_or_a_file_is_named_as_such(tmp_path):
    """Found by review: ``--log.run_dir=`` said "cannot lock log.run_dir=: [Errno 2] No such file or directory: ''",
    and a file "[Errno 17] File exists"."""
    f = tmp_path / "notes.txt"
    f.write_text("x")
    for d, needle in (("", "log.run_dir is empty"), (str(f), "is a file, not a directory")):
        with pytest.raises(rundir.RunDirError, match=needle):
            rundir.lock_run_dir(d, True, lambda ok: ok)
    lock = rundir.lock_run_dir(str(tmp_path / "new"), True, lambda ok: ok)  # (a new directory: taken)
    assert lock is not None and lock.held
    lock.release()
