"""``dilocox bench checkpoint``: what a checkpoint costs on dilocox's format (torch.distributed.checkpoint) next to
what a user would write by hand (a ``torch.save`` of each rank's state dict).

For a model (default: GPT-2 small, 163M parameters untied) on a few layouts, every rank builds the Trainer and takes
one training step (so AdamW holds its two moments), then, ``--repeats`` times each:

* **dilocox save**: ``Trainer.save`` (DCP's ``save`` of the state by global names, every file hashed, COMPLETE.json
  and ``latest`` moved by rank 0);
* **torch.save (reference)**: ``torch.save`` of the rank's ``Trainer.state_dict()`` to its own file, fsynced (the
  hand-written per-rank checkpoint, and dilocox's earlier format without its hashes);
* **dilocox load**: ``Trainer._maybe_resume`` on the same layout (hashes checked, DCP read, state restored);

and one process resumes the last checkpoint onto ONE rank (DCP reshards: the layout change a user makes when they
move a run to other hardware). Times are wall seconds on rank 0 between barriers, the median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from dilocox.bench.runner import machine_line, out_dir

LAYOUTS = {"one": (1, []), "tp2": (2, ["--parallel.tensor=2"]), "pp2": (2, ["--parallel.pipeline=2"])}


def _cfg(model: str, run_dir: str, layout: list[str], ckpt_dir: str | None = None):
    from dilocox.config import load_config

    return load_config(
        model,
        [
            "--data.source=stdlib",
            "--data.max_bytes=300000",
            f"--data.cache_dir={os.path.join(os.path.dirname(run_dir), 'cache')}",
            f"--log.run_dir={run_dir}",
            "--train.steps=1000",
            "--train.batch_size=2",
            "--train.seq_len=64",
            "--train.eval_every=0",
            "--log.tensorboard=false",
            "--log.progress=false",
            "--checkpoint.every=0",
            "--checkpoint.keep=1",
            "--parallel.microbatches=2",
            *([f"--checkpoint.dir={ckpt_dir}"] if ckpt_dir else []),
            *layout,
        ],
    )


def _timed(fn, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, store: str, model: str, root: str, layout: list[str], repeats: int, q) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    # LOCAL_RANK: the GPU of this rank (pick_device); without it every rank takes cuda:0 and NCCL refuses the group
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if world > 1:  # the ranks meet through a file (no port to race another process for); the Trainer reuses the group
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
        )
    from dilocox.train import Trainer

    t = Trainer(_cfg(model, os.path.join(root, "run"), layout))
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    t.train_step()
    out: dict = {"params": sum(p.numel() for p in t.model.parameters())}
    ref = os.path.join(root, "ref")
    os.makedirs(ref, exist_ok=True)

    def ref_save() -> None:  # a new file per save, the previous one removed after it (as checkpoint.keep=1)
        path = os.path.join(ref, f"step_{t.step:08d}_rank_{rank:05d}.pt")
        with open(path, "wb") as f:
            torch.save(t.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        for old in os.listdir(ref):
            if old.endswith(f"_rank_{rank:05d}.pt") and os.path.join(ref, old) != path:
                os.remove(os.path.join(ref, old))

    for _ in range(repeats):
        t.step += 1
        out.setdefault("save", []).append(_timed(lambda: t.save(record=False), barrier))
        out.setdefault("ref_save", []).append(_timed(ref_save, barrier))
        out.setdefault("load", []).append(_timed(t._maybe_resume, barrier))
    step_dir = os.path.join(t.ckpt_dir, f"step_{t.step:08d}")
    out["bytes"] = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(step_dir) for n in names)
    out["ref_bytes"] = sum(os.path.getsize(os.path.join(ref, n)) for n in os.listdir(ref))
    out["ckpt_dir"] = t.ckpt_dir
    if rank == 0:
        q.put(out)
    barrier()


def _reshard_worker(rank: int, world: int, store: str, model: str, root: str, ckpt_dir: str, repeats: int, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dilocox.train import Trainer

    t = Trainer(_cfg(model, os.path.join(root, "one"), [], ckpt_dir=os.path.join(root, "none")))
    t.ckpt_dir = ckpt_dir
    q.put([_timed(t._maybe_resume, lambda: None) for _ in range(repeats)])


def _spawn(fn, world: int, *args, timeout_s: float = 3600.0):
    """``fn`` on ``world`` spawned ranks; rank 0's result. A rank that exits with an error ends the wait at once."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store_dir = tempfile.mkdtemp(prefix="dilocox-bench-ckpt-rdzv-")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, world, os.path.join(store_dir, "store"), *args, q)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                out = q.get(timeout=1.0)
                break
            except queue.Empty:
                if any(p.exitcode for p in procs) or time.monotonic() > deadline:
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(f"bench checkpoint: no result (rank exit codes {codes}, None: still running)")
        for p in procs:
            p.join(600)
            if p.exitcode:
                raise RuntimeError(f"bench checkpoint: a rank exited with {p.exitcode}")
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        shutil.rmtree(store_dir, ignore_errors=True)


def run(model: str, layouts: list[str], repeats: int, root: str) -> list[dict]:
    rows = []
    for name in layouts:
        world, extra = LAYOUTS[name]
        d = os.path.join(root, name)
        shutil.rmtree(d, ignore_errors=True)
        got = _spawn(_worker, world, model, d, extra, repeats)
        got["reshard"] = _spawn(_reshard_worker, 1, model, d, got["ckpt_dir"], repeats) if name != "one" else None
        rows.append({"layout": name, "ranks": world, **got})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return rows


def markdown(rows: list[dict], model: str, repeats: int, layouts: str | None = None) -> str:
    med = statistics.median
    lay = f" --layouts {layouts}" if layouts else ""
    lines = [
        f"`dilocox bench checkpoint --model {model}{lay} --repeats {repeats}` — {machine_line()}, "
        f"{time.strftime('%Y-%m-%d')}; {rows[0]['params'] / 1e6:.0f}M parameters + AdamW, median of {repeats}",
        "",
        "| layout | ranks | dilocox checkpoint | dilocox save (s) | torch.save per rank (s) | save vs torch.save "
        "| dilocox load, same layout (s) | load onto 1 rank (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        save, ref = med(r["save"]), med(r["ref_save"])
        reshard = f"{med(r['reshard']):.2f}" if r["reshard"] else "(same)"
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {r['bytes'] / 1e6:,.0f} MB (torch.save {r['ref_bytes'] / 1e6:,.0f} MB) "
            f"| {save:.2f} | {ref:.2f} | {save / ref:.2f}x | {med(r['load']):.2f} | {reshard} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dilocox bench checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="configs/model/gpt2-small.yaml", help="a model config (configs/model/*.yaml)")
    ap.add_argument("--layouts", default="one,tp2,pp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--repeats", type=int, default=3, help="saves and loads per layout (the median is reported)")
    ap.add_argument("--out", type=out_dir, default="docs/bench/checkpoint", help="where results.md / results.json go")
    ap.add_argument(
        "--workdir", type=out_dir, default=None, help="scratch directory for the checkpoints (default: a temp dir)"
    )
    a = ap.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        ap.error(f"--layouts: {bad} not among {list(LAYOUTS)}")
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: must be >= 1 (the median of that many saves and loads)")
    if not os.path.isfile(a.model):
        ap.error(f"--model {a.model!r}: no such file; give a model config's path (configs/model/*.yaml)")
    root = a.workdir or tempfile.mkdtemp(prefix="dilocox-bench-ckpt-")
    rows = run(a.model, layouts, a.repeats, root)
    md = markdown(rows, a.model, a.repeats, ",".join(layouts))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
