"""The ``dilocox`` command: train | data | bench | plan | launch.

    dilocox train CONFIG [--nproc N] [--section.key=value ...]
    dilocox data prepare CONFIG [--section.key=value ...]
    dilocox bench kernels|compression|wan [...]
    dilocox plan --model configs/model/X.yaml --replicas R --bandwidth 1gbit
    dilocox launch --replicas R --nproc-per-replica N --bandwidth 100mbit CONFIG [...]
"""

from __future__ import annotations

import os
import sys

USAGE = __doc__


def _train(argv: list[str]) -> int:
    from dilocox.config import ConfigError, load_config

    if not argv or argv[0].startswith("-"):
        print("usage: dilocox train CONFIG [--nproc N] [--section.key=value ...]", file=sys.stderr)
        return 2
    path, rest = argv[0], argv[1:]
    nproc = None
    overrides = []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--nproc":
            nproc = int(rest[i + 1])
            i += 2
            continue
        if a.startswith("--nproc="):
            nproc = int(a.split("=", 1)[1])
        else:
            overrides.append(a)
        i += 1
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    world = cfg.parallel.world_size
    if nproc is not None and "RANK" not in os.environ:
        if nproc != world:
            print(f"config error: --nproc {nproc} does not match the parallel layout "
                  f"replicas*data*pipeline*tensor = {world}", file=sys.stderr)
            return 2
        if nproc > 1:
            return _launch_local(nproc, ["train", path, *overrides])
    from dilocox.train import train

    try:
        train(cfg)
    except ConfigError as e:  # found at start-up: e.g. the layout needs more ranks than were launched
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


def _launch_local(nproc: int, args: list[str]) -> int:
    """Re-run this command on nproc local ranks through torch's own launcher (torchrun)."""
    import subprocess

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "dilocox.cli", *args]
    return subprocess.call(cmd, env=env)


def _data(argv: list[str]) -> int:
    if not argv or argv[0] != "prepare":
        print("usage: dilocox data prepare CONFIG [--section.key=value ...]", file=sys.stderr)
        return 2
    from dilocox.data import prepare_main

    return prepare_main(argv[1:]) or 0


def _bench(argv: list[str]) -> int:
    kinds = {"kernels": "dilocox.bench.kernels", "compression": "dilocox.bench.compression", "wan": "dilocox.bench.wan",
             "train": "dilocox.bench.train", "methods": "dilocox.bench.methods"}
    if not argv or argv[0] not in kinds:
        print(f"usage: dilocox bench {{{'|'.join(kinds)}}} [...]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(kinds[argv[0]]).main(argv[1:]) or 0


def _plan(argv: list[str]) -> int:
    from dilocox.plan import main

    return main(argv) or 0


def _launch(argv: list[str]) -> int:
    from dilocox.launch.emulate import launch_main

    return launch_main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"train": _train, "data": _data, "bench": _bench, "plan": _plan, "launch": _launch}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in cmds:
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
