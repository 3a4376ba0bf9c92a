"""The ``dilocox`` command: train | data | bench | plan | launch | lighthouse | swarm | export | import | generate |
eval | report | secret | checkpoint.

    dilocox train CONFIG [--nproc N] [--section.key=value ...]
    dilocox data prepare CONFIG [--section.key=value ...]
    dilocox bench KIND [...]                  (KIND: see "bench kinds" below)
    dilocox plan --model configs/model/X.yaml --replicas R --bandwidth 1gbit
    dilocox plan configs/RUN.yaml --bandwidth 1gbit    (a run config: its layout, batch and method)
    dilocox plan --swarm [--model gpt2-small ...] [--stages 2 --peers 4 --act int8 --H 50]
    dilocox launch --replicas R --nproc-per-replica N --bandwidth 100mbit CONFIG [...]
    dilocox launch --elastic N CONFIG [--kill R@S] [--restart R@S] [--bandwidth 100mbit] [...]
    dilocox lighthouse --min-replicas M [--bind HOST:PORT]   (torchft lighthouse for elastic replicas)
    dilocox swarm CONFIG [--peers 2,2] [--steps N] [...]   (SWARM: several peers per stage; also launch --swarm)
    dilocox export RUN_DIR --to hf OUT [--force] | dilocox import HF_DIR [--out model.yaml] [--force]
    dilocox generate RUN_DIR|HF_DIR --prompt TEXT [--temperature T] [--top-k K] [--seed S] [--no-stop]
    dilocox eval RUN_DIR|HF_DIR [--text PATH] [--seq-len S]   (held-out loss, perplexity, bits per byte)
    dilocox report RUN_DIR [RUN_DIR ...] [--out DIR]     (PNG plots from metrics.jsonl)
    dilocox secret PATH                       (a new run secret, mode 0600: --security.secret_file=PATH)
    dilocox checkpoint convert CKPT_DIR       (checkpoints of the earlier format onto torch.distributed.checkpoint)
    dilocox --version

`dilocox COMMAND --help` prints a command's options; every config key is in docs/CONFIG.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import textwrap
import time
import typing

CONFIG_DOC = "docs/CONFIG.md"

# The one list of benchmarks: `dilocox bench KIND` runs BENCHES[KIND][0].main(argv).
BENCHES = {
    "kernels": ("dilocox.bench.kernels", "int4/int8 compression kernels: GB/s next to a plain copy"),
    "compression": ("dilocox.bench.compression", "compression ratio and reconstruction error per compressor"),
    "train": ("dilocox.bench.train", "tiny GPT-2: 1 CPU rank vs 4 ranks (PP=2 x TP=2); --reference: vs a plain loop"),
    "methods": ("dilocox.bench.methods", "every method preset at equal tokens, 2 replicas x PP=2"),
    "frontier": ("dilocox.bench.frontier", "val loss vs bytes sent: every method family swept, two corpora, the front"),
    "scale": ("dilocox.bench.scale", "the gap to allreduce by model width x replicas (R x PP=1) at equal tokens"),
    "lengths": ("dilocox.bench.lengths", "the gap to allreduce by run length, from frontier results (no training)"),
    "wan": ("dilocox.bench.wan", "the method presets over capped inter-cluster links, measured vs planned"),
    "elastic": ("dilocox.bench.elastic", "3 elastic replicas x PP=2, one killed at 1/3 and restarted at 2/3"),
    "churn": ("dilocox.bench.churn", "R elastic replicas, one killed every T s and restarted D s later: goodput"),
    "swarm": (
        "dilocox.bench.swarm",
        "SWARM vs DiLoCo-SWARM; IWRR on slow peers; peer killed; H sweep; (e) activation codecs",
    ),
    "switch": ("dilocox.bench.switch", "the delay switch's ceiling (TCP Gbit/s, 1500-B frames/s) next to the bridge"),
    "rpc": ("dilocox.bench.rpc", "what authentication and encryption add to a SWARM RPC call and hop"),
    "memory": ("dilocox.bench.memory", "activation memory and step time of train.recompute none | full | selective"),
    "checkpoint": ("dilocox.bench.checkpoint", "save / load / reshard seconds on DCP next to a per-rank torch.save"),
}


def _bench_list() -> str:
    return "\n".join(f"    {k:<12} {desc}" for k, (_, desc) in BENCHES.items())


USAGE = f"{__doc__.rstrip()}\n\nbench kinds (dilocox bench KIND --help for options):\n{_bench_list()}\n"


class UsageError(Exception):
    """A malformed command line: printed as one line, exit status 2."""


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """``" (did you mean 'train'?)"`` for the closest of ``choices`` by edit distance (difflib), else ``""``."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]!r}?)" if close else ""


def _config_keys() -> str:
    """Every config key, grouped by section, for `dilocox train --help` (defaults: docs/CONFIG.md)."""
    from dilocox.config import Config

    lines: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        plain = [f.name for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
        if plain:
            lines.extend(
                textwrap.wrap(" ".join(plain), 100, initial_indent=f"  {prefix:<20} ", subsequent_indent=" " * 23)
            )
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        walk(hints[f.name], f"--{f.name}.")
    return "\n".join(lines)


def _train_help() -> str:
    return f"""usage: dilocox train CONFIG [--nproc N] [--section.key=value ...]

Train the model the YAML file CONFIG describes (e.g. configs/tiny.yaml). Results go to
log.run_dir (default runs/default; configs/tiny.yaml: runs/tiny): config.yaml, metrics.jsonl,
rank_*.json and checkpoints/ (see README "Where results go").

options:
  -h, --help        this message
  --nproc N         run N local ranks through torchrun (N = replicas*data*pipeline*tensor);
                    without it the ranks come from the environment (torchrun, srun) or it is 1
  --section.key=V   set any config key (also --section.key V); values are parsed as YAML, but a
                    text key (a path, a name) keeps V as typed

config keys (meaning and default of each: {CONFIG_DOC}):
{_config_keys()}"""


def _parse_nproc(value: str | None) -> int:
    if value is None or value == "" or (value.startswith("-") and not value.lstrip("-").isdigit()):
        raise UsageError("--nproc needs the number of local ranks, e.g. --nproc 4")
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"--nproc {value!r} is not a whole number; e.g. --nproc 4") from None
    if n < 1:
        raise UsageError(f"--nproc {n} must be at least 1")
    return n


def _split_train_args(rest: list[str]) -> tuple[int | None, list[str]]:
    """``[--nproc N] [--section.key=value ...]`` -> (nproc, overrides)."""
    nproc, overrides, i = None, [], 0
    while i < len(rest):
        a = rest[i]
        if a == "--nproc":
            nproc = _parse_nproc(rest[i + 1] if i + 1 < len(rest) else None)
            i += 2
            continue
        if a.startswith("--nproc="):
            nproc = _parse_nproc(a.split("=", 1)[1])
        else:
            overrides.append(a)
        i += 1
    return nproc, overrides


def _train(argv: list[str]) -> int:
    from dilocox.config import load_config

    if any(a in ("-h", "--help") for a in argv):
        print(_train_help())
        return 0
    if not argv or argv[0].startswith("-"):
        raise UsageError(
            "dilocox train needs a CONFIG file first: dilocox train CONFIG [--nproc N] "
            "[--section.key=value ...] (see dilocox train --help)"
        )
    path, rest = argv[0], argv[1:]
    nproc, overrides = _split_train_args(rest)
    cfg = load_config(path, overrides)
    _check_fits(cfg)
    world = cfg.parallel.world_size
    if nproc is not None and "RANK" in os.environ and os.environ.get("WORLD_SIZE") != str(nproc):
        raise UsageError(
            f"--nproc {nproc}, but RANK={os.environ['RANK']} WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')} are "
            f"set: this process would run as one rank of a torchrun/SLURM launch, which starts the ranks itself. "
            f"Under a launcher drop --nproc; for a leftover in this shell unset RANK and WORLD_SIZE to launch {nproc} "
            "ranks here"
        )
    if nproc is not None and "RANK" not in os.environ:
        if nproc != world:
            p = cfg.parallel
            print(
                f"config error: --nproc {nproc} does not match the parallel layout replicas*data*pipeline*tensor = "
                f"{p.replicas}*{p.data}*{p.pipeline}*{p.tensor} = {world}; run it with --nproc {world}, or set the "
                f"layout to {nproc} ranks (e.g. --parallel.replicas, --parallel.data, --parallel.pipeline)",
                file=sys.stderr,
            )
            return 2
        if nproc > 1:
            _check_data(cfg, note=False)  # here, once: a bad corpus is one line, not N tracebacks in torchrun's report
            return _launch_local(nproc, ["train", path, *overrides])
    _check_data(cfg)
    from dilocox.train import train

    train(cfg)  # a ConfigError found at start-up (e.g. the layout needs more ranks than launched): main() prints it
    return 0


def _check_fits(cfg) -> None:
    """A model that cannot fit the machine at all (``--model.vocab_size=1e10``): one line before anything is built."""
    import torch

    from dilocox.fits import check_model_fits

    device = cfg.train.device
    check_model_fits(cfg, on_cpu=device == "cpu" or device == "auto" and not torch.cuda.is_available())


def _check_data(cfg, note: bool = True) -> None:
    from dilocox.data import check_data
    from dilocox.data.sources import cap_note, skipped_note

    p = check_data(cfg)
    # an opt-in data.max_bytes that cut the corpus, and the files left out as not UTF-8, are said once per run
    # (rank 0; not by a launching parent)
    if note and os.environ.get("RANK", "0") == "0":
        for line in (cap_note(p.meta.get("cut")), skipped_note(p.meta.get("skipped"), p.meta.get("skipped_count"))):
            if line:
                print(line, flush=True)


def _launch_local(nproc: int, args: list[str]) -> int:
    """Re-run this command on nproc local ranks through torch's own launcher (torchrun), its stores and (unless the
    run is an elastic replica, whose quorum group must reach other hosts) its gloo/NCCL pairs on loopback only
    (dilocox/launch/local_run.py)."""
    # torchrun in its own session; SIGINT/SIGTERM are forwarded to it (it forwards them to the ranks, which
    # save and exit); returns only after the children exited, killing them after train.stop_timeout_s
    from dilocox.config import load_config
    from dilocox.distributed.signals import supervise
    from dilocox.launch.local_run import local_run_argv, loopback_env
    from dilocox.metrics import STARTED_AT_ENV, process_age_s

    cfg = load_config(args[1], args[2:]) if args[:1] == ["train"] else None
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env[STARTED_AT_ENV] = repr(time.time() - (process_age_s() or 0.0))  # the ranks' start-up counts from here
    loopback = cfg is None or not cfg.outer.elastic.enabled  # (an elastic replica is reached from other hosts)
    if loopback:
        env = loopback_env(env)
    stop_timeout_s = cfg.train.stop_timeout_s if cfg is not None else 60.0
    return supervise(local_run_argv(nproc, ["-m", "dilocox.cli", *args], loopback), env, stop_timeout_s)


def _data(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: dilocox data prepare [CONFIG] [--out DIR] [--section.key=value ...]\n"
            "(dilocox data prepare --help for its options; data keys: " + CONFIG_DOC + ")"
        )
        return 0
    if not argv or argv[0] != "prepare":
        raise UsageError("usage: dilocox data prepare [CONFIG] [--out DIR] [--section.key=value ...]")
    from dilocox.data import prepare_main

    return prepare_main(argv[1:]) or 0


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(
            f"usage: dilocox bench KIND [options]   (dilocox bench KIND --help for its options)\n\nkinds:\n"
            f"{_bench_list()}",
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else 2
    if argv[0] not in BENCHES:
        hint = did_you_mean(argv[0], BENCHES)
        raise UsageError(f"unknown bench {argv[0]!r}{hint}; choose one of {', '.join(BENCHES)}")
    import importlib

    module = BENCHES[argv[0]][0]
    if argv[0] == "swarm" and _option(argv, "--parts") in ("e", "e,"):  # part (e): its own driver and options
        module = "dilocox.bench.swarm_act"
    return importlib.import_module(module).main(argv[1:]) or 0


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``name VALUE`` or ``name=VALUE`` in ``argv`` (the last one), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _plan(argv: list[str]) -> int:
    if "--swarm" in argv:  # SWARM / DiLoCo-SWARM: pipeline bytes vs stage-sync bytes (dilocox/swarm/plan.py)
        from dilocox.swarm.plan import main as swarm_main

        return swarm_main([a for a in argv if a != "--swarm"]) or 0
    from dilocox.plan import main

    return main(argv) or 0


def _swarm(argv: list[str], launcher: bool = False) -> int:
    from dilocox.swarm.cli import SwarmUsageError, launch_main, main

    try:
        return (launch_main if launcher else main)(argv) or 0
    except SwarmUsageError as e:
        raise UsageError(str(e)) from None


def _launch(argv: list[str]) -> int:
    if "--swarm" in argv:  # SWARM peers on this host (dilocox/swarm/cli.py)
        return _swarm(argv, launcher=True)
    if any(a == "--elastic" or a.startswith("--elastic=") for a in argv):
        from dilocox.elastic.launch import launch_main as elastic_main

        return elastic_main(argv) or 0
    from dilocox.launch.emulate import launch_main

    return launch_main(argv) or 0


def _lighthouse(argv: list[str]) -> int:
    from dilocox.elastic.launch import lighthouse_main

    return lighthouse_main(argv) or 0


SECRET_USAGE = "dilocox secret PATH"
SECRET_HELP = """Write a new run secret to PATH: 32 random bytes as hex, file mode 0600; an existing file is never
overwritten (remove it first to rotate). Give every host of a run the same file: --security.secret_file=PATH
(docs/SECURITY.md).

positional arguments:
  PATH        the file to create

options:
  -h, --help  this message"""


def _secret(argv: list[str]) -> int:
    """``dilocox secret PATH``: write a new run secret (32 random bytes, hex, mode 0600); never overwrites."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {SECRET_USAGE}\n\n{SECRET_HELP}")
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        raise UsageError(f"usage: {SECRET_USAGE}  (writes a new run secret, mode 0600; docs/SECURITY.md)")
    from dilocox.net.secure import create_secret

    try:
        create_secret(argv[0])
    except FileExistsError:
        raise UsageError(f"{argv[0]} exists: a secret is never overwritten (remove it first to rotate)") from None
    except OSError as e:
        raise UsageError(f"cannot write {argv[0]}: {e.strerror}") from None
    print(f"wrote the run secret {argv[0]} (mode 0600): pass it as --security.secret_file={argv[0]}")
    return 0


def _checkpoint(argv: list[str]) -> int:
    """``dilocox checkpoint convert CKPT_DIR|STEP_DIR``: earlier-format checkpoints onto DCP, in place."""
    import argparse

    ap = argparse.ArgumentParser(prog="dilocox checkpoint", description=_checkpoint.__doc__)
    sub = ap.add_subparsers(dest="action", required=True)
    conv = sub.add_parser("convert", help="convert checkpoints of the earlier format (one torch.save file per rank)")
    conv.add_argument("path", help="a checkpoint directory (log.run_dir/checkpoints) or one step_XXXXXXXX directory")
    args = ap.parse_args(argv)
    from dilocox.checkpoint.legacy import convert

    done = convert(args.path)
    for d in done:
        print(f"converted {d} (the earlier files kept in {d}.pre-dcp: delete them once a resume works)")
    if not done:
        print(f"{args.path}: every checkpoint is already in the torch.distributed.checkpoint format")
    return 0


def _export(argv: list[str]) -> int:
    from dilocox.export import export_main

    return export_main(argv) or 0


def _import(argv: list[str]) -> int:
    from dilocox.export import import_main

    return import_main(argv) or 0


def _generate(argv: list[str]) -> int:
    from dilocox.generate import main

    return main(argv) or 0


def _eval(argv: list[str]) -> int:
    from dilocox.evaluate import main

    return main(argv) or 0


def _report(argv: list[str]) -> int:
    from dilocox.runplots import main

    return main(argv) or 0


def _error_kind(e: BaseException) -> tuple[str, int] | None:
    """(label, exit code) for the errors a user can act on from the message alone, else None (a traceback).

    Input errors (config, data, export) exit 2; a checkpoint that cannot be saved or loaded (corrupt,
    non-finite state, full disk) and a NaN loss exit 1: the run failed; the message names the file or
    the last good checkpoint and the fix."""
    from dilocox.checkpoint import CheckpointError  # imported only on failure: keeps `dilocox --help` light
    from dilocox.config import ConfigError
    from dilocox.data.sources import DataError
    from dilocox.elastic.group import ElasticError  # torchft itself is imported lazily, not here
    from dilocox.hf import ExportError
    from dilocox.net.secure import SecretError  # a secret file too open, too short, another user's: one line

    for cls, label, code in (
        (ConfigError, "config error", 2),
        (SecretError, "config error", 2),
        (DataError, "data error", 2),
        (ExportError, "export error", 2),
        (CheckpointError, "checkpoint error", 1),
        (FloatingPointError, "training stopped", 1),
        (ElasticError, "elastic run stopped", 1),
    ):
        if isinstance(e, cls):
            return label, code
    return None


# commands whose OSError on a path (an --out that is a file, a directory that cannot be made) is the user's input
FILE_COMMANDS = ("export", "import", "report", "plan", "generate", "eval", "checkpoint")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {
        "train": _train,
        "data": _data,
        "bench": _bench,
        "plan": _plan,
        "launch": _launch,
        "lighthouse": _lighthouse,
        "swarm": _swarm,
        "export": _export,
        "import": _import,
        "generate": _generate,
        "eval": _eval,
        "report": _report,
        "secret": _secret,
        "checkpoint": _checkpoint,
    }
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from dilocox import __version__

        print(f"dilocox {__version__}")
        return 0
    if argv[0] not in cmds:
        print(f"dilocox: unknown command {argv[0]!r}{did_you_mean(argv[0], cmds)}; choose one of {', '.join(cmds)} "
              "(dilocox --help)", file=sys.stderr)  # fmt: skip
        return 2
    wants_help = any(a in ("-h", "--help") for a in argv[1:])
    where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    try:
        return cmds[argv[0]](argv[1:])
    except UsageError as e:
        print(f"dilocox {argv[0]}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command's own handlers were set (start-up): a stop, not a traceback
        print(f"dilocox {argv[0]}{where}: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except OSError as e:
        if not (e.filename and argv[0] in FILE_COMMANDS):  # a path the user gave that cannot be written or read
            raise
        print(f"dilocox {argv[0]}: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    except Exception as e:
        if type(e).__name__ == "ReportedCommError":  # (a failed collective: its one line is logged already)
            return 1
        if (kind := _error_kind(e)) is None:
            raise
        print(f"{kind[0]}{where}: {e}", file=sys.stderr)
        return kind[1]
    finally:
        if wants_help and argv[0] in ("plan", "launch", "bench"):  # their own parsers print the options
            how = {"launch": "--section.key=value", "plan": "read from the run config, not from flags"}.get(
                argv[0], "--set --section.key=value, where a bench has --set"
            )
            print(f"\nconfig keys ({how}): {CONFIG_DOC}")


if __name__ == "__main__":
    sys.exit(main())
