"""The training loop: ``dilocox train CONFIG``.

Per rank, top to bottom:
1. process groups of the rank grid (replicas x inner-DP x stages x TP),
2. data (tokenized once by rank 0, memory-mapped by all), the replica's sampler,
3. this rank's shard of the model, the pipeline engine, inner AdamW,
4. the outer loop of the chosen method (DiLoCo family; absent for a single replica),
5. resume from the latest complete checkpoint, if any (state, checkpoints, resume: dilocox/train_state.py),
6. per step: forward/backward over the pipeline, outer hook on the gradients (per-step methods), global-norm
   clipping, inner step, outer bookkeeping (pseudo-gradients, overlapped all-reduce, outer Nesterov), logs,
   validation, checkpoints, a profile of a few steps (``log.profile_start``).
"""

from __future__ import annotations

import math
import os
import resource
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dilocox import checkpoint as ckpt
from dilocox import rundir
from dilocox.config import Config, ConfigError
from dilocox.data import TokenSampler, prepare
from dilocox.distributed import signals
from dilocox.distributed.comm import emulated_bandwidth_bytes
from dilocox.distributed.topology import all_gather_text, broadcast_text, build_topology, group_ranks, init_distributed
from dilocox.elastic.group import ElasticError
from dilocox.elastic.standby import ACTIVATE_NAME, StandbyNotNeeded, await_activation
from dilocox.engine import PipelineEngine
from dilocox.hf import ExportError, load_hf_full_state_dict, resolve_hf_dir
from dilocox.inner_step import InnerStep
from dilocox.metrics import MetricsLogger, peak_flops, process_age_s
from dilocox.model.parallel_layers import global_grad_norm
from dilocox.model.transformer import build_stage_model, model_flops_per_token
from dilocox.optim import build_inner_optimizer, lr_at  # (re-exported: ``from dilocox.train import lr_at`` works)
from dilocox.outer import build_outer
from dilocox.outer.fragments import tail_warning
from dilocox.profiling import StepProfiler
from dilocox.train_state import TrainerState


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    want = ("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' but no CUDA device is available; set --train.device=cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer(TrainerState):
    """Everything one rank holds during training. ``run()`` trains; attributes are for tests. Its state, checkpoints,
    resume and the run dir's start-of-run checks: :class:`dilocox.train_state.TrainerState`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.t_created = time.time()
        self.standby: dict | None = None  # a warm standby's activation (``_become_replica``)
        # where the start-up's seconds go (issue 45: a restarted replica's rejoin), logged as the run's first record
        self.startup, clock = {"process_s": process_age_s()}, [time.monotonic()]

        def took(phase: str) -> None:
            now = time.monotonic()
            self.startup[f"{phase}_s"] = self.startup.get(f"{phase}_s", 0.0) + now - clock[0]
            clock[0] = now

        self._init_distributed()  # process groups, topology, the stop flag, device, the run-dir lock
        took("distributed")
        self._init_data()  # corpus, this replica's sampler, validation batches
        took("data")
        self._init_model()  # the stage model (+ Hugging Face init, compile), pipeline engine, inner optimizer
        took("model")
        if cfg.outer.elastic.enabled and cfg.outer.elastic.standby:
            self._become_replica()  # a warm standby: wait (bounded) to take a dead replica's place
            took("standby_wait")
        self._init_outer()  # the elastic group and the outer method (DiLoCo family), its bounded waits
        self._init_logging()  # counters, metrics logger, MFU inputs
        took("outer")
        self._maybe_resume()
        took("resume")
        if self.elastic is not None:
            self._elastic_join()
            took("join")
        self._check_checkpoint_space()

    def _init_distributed(self) -> None:
        cfg = self.cfg
        # gloo for train.device=cpu even where CUDA exists (NCCL cannot move CPU tensors)
        # the default group spans the replicas when R > 1: bounded like the outer waits (issue 9)
        world_timeout = cfg.outer.timeout_s if cfg.parallel.replicas > 1 else cfg.parallel.timeout_s
        rank, world, local = init_distributed("gloo" if cfg.train.device == "cpu" else None, timeout_s=world_timeout)
        self.topo = build_topology(cfg.parallel, rank, world, outer_timeout_s=cfg.outer.timeout_s)
        # SIGINT/SIGTERM: stop at a step boundary agreed by all ranks, save, exit 128+signal (distributed/signals.py);
        # agreed inside each replica every step, across replicas only at outer syncs
        self.stop = signals.StopFlag()  # handlers: installed by train() (not by Trainers built inside tests)
        pc = cfg.parallel
        self.stop.attach(
            rank,
            group_ranks("replica", pc.replicas, pc.data, pc.pipeline, pc.tensor),
            group_ranks("outer", pc.replicas, pc.data, pc.pipeline, pc.tensor) if pc.replicas > 1 else None,
            cfg.parallel.timeout_s,
            cfg.outer.timeout_s,
            cfg.outer.warn_after_s,
            signals.replica_peers(self.topo),
        )
        self.device = pick_device(cfg, local)
        # One run per run dir: rank 0 holds the lock until the run ends or dies; every rank learns the outcome.
        self.run_lock = rundir.lock_run_dir(cfg.log.run_dir, rank == 0, ckpt.all_ranks_agree)
        # the global generator draws dropout masks only: each stage its own stream (Megatron: + 100 x pp rank)
        torch.manual_seed(cfg.train.seed + 100 * self.topo.stage)

    def _init_data(self) -> None:
        cfg = self.cfg
        # Every rank of a replica draws the replica's full batch (a pure function of seed,
        # replica and step); the pipeline engine takes this rank's inner-DP rows.
        self.prepared = prepare(cfg.data)  # race-free: one rank builds, the others reuse
        if self.prepared.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({self.prepared.vocab_size}); set --model.vocab_size to at least {self.prepared.vocab_size} "
                "(a multiple of parallel.tensor)"
            )
        tr = cfg.train
        el = cfg.outer.elastic
        # elastic: the sampler's replica is its stable identity (replica_rank of max_replicas), so a replica that comes
        # back continues its own windows at the live step (data.sampler=epoch: none another replica reads in an epoch)
        self._new_sampler(*((el.replica_rank, el.max_replicas) if el.enabled else (self.topo.replica, self.topo.R)))
        self.val_batches = (
            self.prepared.val_batches(tr.eval_batches, tr.batch_size, tr.seq_len) if tr.eval_batches else []
        )

    def _new_sampler(self, replica: int, n_replicas: int) -> None:
        t = self.cfg.train
        tokens, mode, ids = self.prepared.train_tokens(), self.cfg.data.sampler, self.prepared.sampler_args()
        self.sampler = TokenSampler(tokens, t.seq_len, t.batch_size, t.seed, replica, n_replicas, mode=mode, **ids)

    def _init_model(self) -> None:
        cfg, t = self.cfg, self.topo
        self.model = build_stage_model(
            cfg.model, t.stage, t.P, t.tp_rank, t.T, t.group("tp"), seed=cfg.train.seed, device=self.device
        )
        if cfg.model.init_from:  # continued pre-training from a Hugging Face checkpoint (a resume overrides it)
            try:
                hf_dir = resolve_hf_dir(cfg.model.init_from)
            except ExportError as e:  # an input error of this run's config: named as one
                raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {e}") from None
            hf_sd = load_hf_full_state_dict(hf_dir, cfg.model, self.model.gather_full_state_dict)
            self.model.load_full_state_dict(hf_sd)
        self.model.recompute = cfg.train.recompute
        whole = t.P == 1 and t.T == 1  # one stage, no TP: forward + loss compile as one graph (engine.compile_whole)
        if cfg.train.compile and not whole:  # per block, in place (torchtitan's way): names, checkpoints, layout kept
            for block in self.model.layers.values():
                block.compile()
        autocast = None
        if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and self.device.type == "cuda"):
            autocast = torch.bfloat16
        self.engine = PipelineEngine(
            self.model, t, cfg.parallel, cfg.model, cfg.train.seq_len, self.device, autocast_dtype=autocast
        )
        if cfg.train.compile and whole:
            self.engine.compile_whole()
        # the inner optimizer (``self.optimizer``) inside the step after the backward pass: lr, clipping, step
        self.inner = InnerStep(build_inner_optimizer(cfg, self.model, self.device), cfg)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (held by ``self.inner``)."""
        return self.inner.optimizer

    def _init_outer(self) -> None:
        cfg, t = self.cfg, self.topo
        self.elastic = build_elastic_group(cfg, t) if cfg.outer.elastic.enabled else None
        self.outer = build_outer(  # None for outer.method=none
            list(self.model.named_parameters()),
            t,
            cfg.outer,
            cfg.compress,
            seed=cfg.train.seed,
            layer_of=self.model.param_layer_id,
            n_layers_total=cfg.model.n_layers,
            comm_bandwidth=emulated_bandwidth_bytes(),
            group=self.elastic,
        )
        if cfg.outer.lr_schedule == "inner" and self.outer is not None:  # the outer lr follows the inner schedule
            self.outer.lr_factor = lambda step: lr_at(step, cfg) / cfg.optim.lr
        if self.outer is not None:  # every wait on the outer all-reduce: warned about, then bounded
            self.outer.bound_waits(
                cfg.outer.timeout_s,
                cfg.outer.warn_after_s,
                peers=signals.replica_peers(t),
                log=lambda m, r=t.rank: print(f"[rank {r}] {m}", flush=True),
            )

    def _init_logging(self) -> None:
        cfg, lg = self.cfg, self.cfg.log
        self.step = 0
        self.tokens_seen = 0
        self.ckpt_dir = cfg.checkpoint.dir or os.path.join(lg.run_dir, "checkpoints")
        self.logger = MetricsLogger(
            lg.run_dir,
            enabled=self.topo.rank == 0,
            total_steps=cfg.train.last_step,  # (train.max_tokens may end it first)
            jsonl=lg.jsonl,
            tensorboard=lg.tensorboard,
            progress=lg.progress,
            wandb_project=lg.wandb_project if lg.wandb else None,
            config=cfg.to_dict(),
        )
        self.profiler = StepProfiler(lg.profile_start, lg.profile_steps, lg.run_dir, self.topo.rank, self.device)
        self.peak = peak_flops(self.device)
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.train.seq_len)
        self.history: list[dict] = []
        # global norm before clipping (optim.grad_clip > 0), logged per step (a device tensor until the next log step)
        self.grad_norm: float | torch.Tensor | None = None
        self.resumed_from: str | None = None
        # run() sets it: the step's loss and grad norm stay device tensors, read (one host sync) and checked for
        # finiteness at the printed log steps, before a save and before an outer step's communication; no host sync
        # in between (tests/test_hot_path.py). Off, train_step() returns a float and checks it at once.
        self.defer_sync = False
        self._unlogged: list[tuple[dict, bool]] = []  # records since the last printed one, tensors not yet read

    # ------------------------------------------------------------------ elastic
    def _become_replica(self) -> None:
        """A warm standby (``outer.elastic.standby``, dilocox/elastic/standby.py): everything but the elastic group is
        built; wait (bounded) for the launcher's activation naming a dead replica's ``replica_rank``, then take its
        identity (its data shard). ``self.standby`` keeps the times the join's log line reports."""
        cfg, el = self.cfg, self.cfg.outer.elastic
        if self.topo.rank == 0:
            print(f"elastic: standby warm after {time.time() - self.t_created:.1f}s; waiting for {ACTIVATE_NAME} in "
                  f"{cfg.log.run_dir} (at most {el.standby_timeout_s:g}s)", flush=True)  # fmt: skip
        act = await_activation(cfg.log.run_dir, el.max_replicas, el.standby_timeout_s, since=self.t_created)
        el.replica_rank = act["replica_rank"]
        self._new_sampler(el.replica_rank, el.max_replicas)
        self.standby = {"activated_wall": act["wall"], "warm_s": act["wall"] - self.t_created}

    def _elastic_join(self) -> None:
        """Join the live replicas (docs/ELASTIC.md): when they are ahead, take their outer state and step."""
        t0 = time.time()
        n = self.outer.join()
        if n is None:
            pg = getattr(getattr(getattr(self.outer, "group", None), "elastic", None), "_pg", None)
            via = f" (outer collectives: {pg.getBackendName()})" if pg is not None else ""
            self.logger.info(f"elastic: replica {self.cfg.outer.elastic.replica_rank} starts at step {self.step}{via}")
            return
        self.outer.membership.pop_jump()
        warm = ""
        if self.standby is not None:  # (where a standby's rejoin went: issue 45's breakdown)
            warm = f"; a standby: {t0 - self.standby['activated_wall']:.1f}s from its activation to the join"
        self._continue_at(n, f"joined the live run at step {n} (state received in {time.time() - t0:.1f}s{warm})")

    def _continue_at(self, n: int, why: str) -> None:
        """Elastic: continue at the live replicas' inner step ``n`` from θ (this replica's params are θ now)."""
        skipped = n - self.step
        self.step = n
        self.sampler.step = n  # this replica's own windows, at the live step (the steps skipped are not trained)
        self.tokens_seen = n * self.cfg.train.batch_size * self.cfg.train.seq_len
        self.inner.optimizer = build_inner_optimizer(self.cfg, self.model, self.device)  # from θ, a fresh AdamW
        self.logger.info(
            f"elastic: replica {self.cfg.outer.elastic.replica_rank} {why}; continues at step {n} "
            f"(outer step {self.outer.outer_step}, {skipped} steps skipped)"
        )

    # ------------------------------------------------------------------ loop
    @torch.no_grad()
    def validate(self) -> float:
        """Mean validation loss of this replica's current params; NaN without val batches."""
        if not self.val_batches:  # train.eval_batches=0: no validation (not a loss of 0)
            return float("nan")
        self.model.eval()
        losses = [self.engine.evaluate(x.to(self.device), y.to(self.device)) for x, y in self.val_batches]
        self.model.train()
        return float(sum(losses) / max(1, len(losses)))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned + non_blocking: a copy from pageable memory would block the host
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _nonfinite_error(self, loss: float, step: int, now: int | None = None) -> FloatingPointError:
        where = "before the bad update" if now is None else f"at step {now} (losses are read at the log steps)"
        lr, outer = self.cfg.optim.lr, ""
        if getattr(self.outer, "schedule", None) is not None:  # (the DiLoCo family: an outer step over the replicas)
            outer = f", or outer.lr (now {self.cfg.outer.lr}: the outer step moves every replica)"
        c = self.cfg.optim.grad_clip
        clip = f"a lower optim.grad_clip (now {c:g})" if c else "optim.grad_clip (now off; e.g. 1.0)"
        return FloatingPointError(
            f"loss is {loss} at step {step} (replica {self.topo.replica}); stopped {where}. "
            f"Lower optim.lr (now {lr}){outer}, or set {clip}, and resume from the last good checkpoint "
            f"({ckpt.find_latest(self.ckpt_dir) or f'none in {self.ckpt_dir} yet'}; non-finite states are never saved)"
        )

    def _outer_communicates(self, step: int) -> bool:
        """Does the outer method send to other replicas after inner step ``step``? (per-step methods: every step; the
        DiLoCo family: when a fragment's all-reduce is launched or applied; never with one fixed replica)."""
        if self.outer is None or (self.topo.R == 1 and self.elastic is None):
            return False
        sched = getattr(self.outer, "schedule", None)
        if sched is None:
            return True
        return bool(sched.syncs_at(step + 1) or sched.launches_at(step + 1))

    def train_step(self) -> float | torch.Tensor:
        """One inner step; returns its loss (a 0-dim device tensor under ``defer_sync``, else a float)."""
        cfg, step = self.cfg, self.step
        x, y = self.sampler.next_batch()
        loss = self.engine.forward_backward_async(self._to_device(x), self._to_device(y))
        if not self.defer_sync or self._outer_communicates(step):
            value = float(loss.item())  # checked now: before an outer step's communication, nothing bad leaves
            if not math.isfinite(value):
                self._flush_logs()
                raise self._nonfinite_error(value, step + 1)  # (records count from 1)
            if not self.defer_sync:
                loss = value
        if self.outer is not None:
            self.outer.on_gradients(step)
        # lr, optim.grad_clip by the global norm over the model-parallel group (each parameter once), step, zero_grad
        done = self.inner.apply(
            step, lambda: global_grad_norm(list(self.model.parameters()), self.topo.tp_rank, self.topo.group("mp"))
        )
        if "grad_norm" in done:  # a device tensor until the next log step reads it (defer_sync)
            self.grad_norm = done["grad_norm"] if self.defer_sync else float(done["grad_norm"])
        if self.outer is not None:
            self.outer.after_inner_step(step)
        self.step += 1
        self.tokens_seen += cfg.train.batch_size * cfg.train.seq_len
        if (
            self.elastic is not None and (n := self.outer.membership.pop_jump()) is not None
        ):  # healed mid-run (docs/ELASTIC.md)
            self._continue_at(n, "was behind; took the live state")
        return loss

    def _end_of_run(self, start_step: int, wall: float) -> dict:
        """Final validation, per-rank summary file and the summary record/line."""
        cfg = self.cfg
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * self.topo.R
        final_val = self.validate() if self.val_batches else None  # eval_batches=0: null in JSON, not a bare NaN
        summary = {
            "steps": self.step,
            "final_val_loss": final_val,
            "final_val_ppl": None if final_val is None else math.exp(min(final_val, 50)),
            "wall_s": wall,  # the loop's, mid-run validation included (eval_s of it)
            "eval_s": self.eval_s,
            "tokens_per_s": tokens_per_step * (self.step - start_step) / max(wall - self.eval_s, 1e-9),
            "tokens_per_replica": self.tokens_seen,
        }
        if self.outer is not None:
            summary.update({f"outer_{k}": v for k, v in self.outer.stats.items()})
        summary["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        rundir.write_rank_summary(cfg.log.run_dir, self.topo.rank, self.topo.describe(), summary)
        self.logger.write({"summary": summary})
        self.logger.info(
            f"done: {self.step} steps, "
            + (
                "no validation (train.eval_batches=0)"
                if final_val is None
                else f"final val loss {final_val:.4f} (ppl {summary['final_val_ppl']:.2f}"
                + (", of the outer params θ: what export writes)" if cfg.outer.method == "diloco" else ")")
            )
            + f", {summary['tokens_per_s']:,.0f} tok/s, wall {wall:.1f}s"
        )
        return summary

    def run(self) -> dict:
        """The training loop: a step, its record, then the stop and checkpoint decisions at the step boundary."""
        cfg = self.cfg
        skipped = self._begin_run()
        if skipped is not None:
            return skipped
        self._announce()
        if self.topo.rank == 0:  # (after _begin_run: a fresh start's set-aside records never take it along)
            took = {k: round(v, 3) for k, v in self.startup.items() if v is not None}
            self.logger.write({"event": "startup", "wall": time.time(), **took})
            self.logger.info("start-up (s): " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in took.items()))
        start_step, t_start = self.step, time.time()
        self.start_clock(t_start)
        ckpt_due = False  # checkpoint.every came up; saved at the next boundary that crosses the replicas anyway
        self.defer_sync = True
        while self.step < cfg.train.steps:
            if cfg.train.max_tokens and self.tokens_seen >= cfg.train.max_tokens:
                break
            ckpt_due = self.loop_step(start_step, t_start, ckpt_due)
        self.profiler.finish(self.step)  # (a run that ended inside the window)
        self._flush_logs()
        saving = self._finish_outer()  # (and the state before it: checkpoint.continuation; its write not in wall_s)
        summary = self._end_of_run(start_step, time.time() - t_start - saving)
        self.save(record=False)  # (the summary record above marks the run finished)
        self.logger.close()
        return summary

    def _announce(self) -> None:
        cfg, o = self.cfg, self.cfg.outer
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * self.topo.R
        self.logger.info(
            f"dilocox: {self.topo.describe()} | device {self.device} | method {o.method} | "
            f"{cfg.model.arch} {cfg.model.num_params() / 1e6:.2f}M params | {tokens_per_step} tokens/step"
        )
        if o.method == "diloco" and not cfg.compress.adaptive.enabled:  # (the adaptive H moves the sync points)
            warning = tail_warning(cfg.train.steps, o.sync_every, o.streaming.fragments, o.streaming.tau)
            if warning:
                self.logger.info(warning)

    def start_clock(self, t_start: float) -> None:
        """tokens/s since the last printed record; validation (``eval_s``) out of it, in ``wall_s`` and the ETA."""
        self.eval_s, self._rate_mark = 0.0, (t_start, self.step, 0.0)  # (time, step, eval_s) at that record

    def loop_step(self, start_step: int, t_start: float, ckpt_due: bool) -> bool:
        """The body of :meth:`run`'s loop (also what ``dilocox bench train --reference`` times): a step, its record,
        then the stop and checkpoint decisions at the step boundary. Returns ``ckpt_due``."""
        with self.profiler.around(self.step + 1):  # (log.profile_start: a trace of a few steps)
            loss = self.train_step()
        self._log_step(loss, start_step, t_start)
        return self._at_boundary(ckpt_due)

    def _flush_logs(self) -> None:
        """Read the pending records' device tensors (loss, grad norm) in one host sync, check the losses, log them."""
        recs, self._unlogged = self._unlogged, []
        if not recs:
            return
        slots = [(r, k) for r, _ in recs for k in ("loss", "grad_norm") if isinstance(r.get(k), torch.Tensor)]
        if slots:
            values = torch.stack([r[k].detach().reshape(()).double() for r, k in slots]).tolist()
            for (r, k), v in zip(slots, values):
                r[k] = v
        for r, printed in recs:
            if not math.isfinite(r["loss"]):
                raise self._nonfinite_error(r["loss"], r["step"], self.step)
            self.logger.log(r, printed=printed)

    def _log_step(self, loss: float | torch.Tensor, start_step: int, t_start: float) -> None:
        """The step's record (loss, lr, val loss when due, tokens/s, ETA, MFU, the outer method's stats)."""
        cfg = self.cfg
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * self.topo.R
        rec: dict[str, Any] = {"step": self.step, "loss": loss, "lr": lr_at(self.step - 1, cfg)}
        if self.grad_norm is not None:
            rec["grad_norm"] = self.grad_norm
        do_eval = bool(cfg.train.eval_every and self.val_batches and self.step % cfg.train.eval_every == 0)
        if do_eval:
            t_eval, rec["val_loss"] = time.time(), self.validate()
            self.eval_s += time.time() - t_eval
        now = time.time()
        t_last, step_last, eval_last = self._rate_mark
        rate = (self.step - start_step) / max(1e-9, now - t_start)
        train_s = now - t_last - (self.eval_s - eval_last)
        rec["tokens_per_s"] = tokens_per_step * (self.step - step_last) / max(1e-9, train_s)
        rec["eta_s"] = (cfg.train.last_step - self.step) / max(rate, 1e-9)
        if self.peak:
            rec["mfu"] = rec["tokens_per_s"] * self.flops_per_token / (self.peak * self.topo.world_size)
        if self.outer is not None:
            rec.update(self.outer.stats)
        rec["time"], rec["wall"] = round(now - self.logger.t0, 3), round(now, 3)  # the step ran (written in batches)
        printed = self.step % cfg.log.every == 0 or do_eval or self.step == cfg.train.last_step
        self.history.append(rec)
        self._unlogged.append((rec, printed))
        if printed:
            self._flush_logs()
            self._rate_mark = (now, self.step, self.eval_s)

    def _last_step(self) -> bool:
        """The loop ends after this step: a stop asked for here ends the run as a finished one (outer.finish, the
        final save), not with a mid-run checkpoint at train.steps that a rerun would take for the final model."""
        tr = self.cfg.train
        return self.step >= tr.steps or bool(tr.max_tokens and self.tokens_seen >= tr.max_tokens)

    def _at_boundary(self, ckpt_due: bool) -> bool:
        """Stop (a signal some rank got) or save (checkpoint.every) at this step boundary; returns ckpt_due."""
        cfg = self.cfg
        # some rank got SIGINT/SIGTERM: all stop at one step, save, exit 128+signal; the replicas tell each other
        # only at an outer sync (crossed_replicas), never between two (distributed/signals.py)
        if self.stop.should_stop(self.outer is None or self.outer.crossed_replicas):
            if self._last_step():
                self.logger.info(f"stop asked at the last step ({self.step}): finishing the run as it ends anyway")
                return ckpt_due
            path = self.save()
            ckpt.all_ranks_agree(True)  # nobody exits before rank 0 wrote COMPLETE.json (srun --kill-on-bad-exit)
            raise signals.Interrupted(self.stop.agreed_signum, self.step, path)
        if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
            ckpt_due = True
        # the save agrees over every rank of every replica: with several replicas it waits for a boundary where
        # an outer sync used the slow links anyway (the first at or after the due step), never between two
        crossed = self.outer is None or self.topo.R == 1 or self.outer.crossed_replicas
        if ckpt_due and crossed and not self._last_step():  # (the last step: the final save, after outer.finish)
            ckpt_due = False
            self.save()
        return ckpt_due


def build_elastic_group(cfg: Config, topo):
    """This rank's outer group of an elastic run: a ``QuorumGroup`` over an ``ElasticOuterGroup`` (one torchft quorum
    per replica job; rank 0 hosts the store its ranks meet on). The address advertised to the other replicas:
    DILOCOX_ELASTIC_HOST, else MASTER_ADDR, else loopback."""
    from dilocox.elastic import ElasticConfig, ElasticOuterGroup  # torchft is imported only in elastic runs
    from dilocox.elastic.quorum import QuorumGroup
    from dilocox.elastic.stores import multi_rank_replica_store, store_addrs, store_addrs_text
    from dilocox.net.secure import secret_for

    e = cfg.outer.elastic
    host = os.environ.get("DILOCOX_ELASTIC_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    ecfg = ElasticConfig(
        lighthouse_addr=e.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"],
        replica_rank=e.replica_rank,
        min_replicas=e.min_replicas,
        initial_replicas=e.initial_replicas,
        max_replicas=e.max_replicas,
        timeout_s=e.timeout_s,
        quorum_timeout_s=e.quorum_timeout_s,
        max_attempts=e.max_attempts,
        heartbeat_ms=e.heartbeat_ms,
        lighthouse_auth=e.lighthouse_auth,
        host=host,
        secret=secret_for(cfg.security, "`dilocox launch --elastic` and elastic.sbatch write one into the run dir"),
        encrypt=cfg.security.encrypt,
        collectives=e.collectives,
    )
    if topo.world_size == 1:
        return QuorumGroup(ElasticOuterGroup(ecfg), cfg.outer.norm_check)
    store, guard, addr = None, None, None
    hosts = all_gather_text(socket.gethostname())  # all ranks of the replica on one host: a loopback store
    if topo.rank == 0:  # the replica's store; guarded: the quorum reaches it through a guard (elastic/stores.py)
        one_host = len(set(hosts)) == 1
        secret = ecfg.secret if ecfg.lighthouse_auth else None
        store, local, public, guard = multi_rank_replica_store(host, secret, one_host, timedelta(seconds=e.timeout_s))
        addr = store_addrs_text(local, public)
    local, public = store_addrs(broadcast_text(addr))
    try:
        group = ElasticOuterGroup(ecfg, group_rank=topo.rank, group_world=topo.world_size, store=local,
                                  advertise=public)  # fmt: skip
    except BaseException:
        if guard is not None:
            guard.close()
        raise
    group.replica_store, group.store_guard = store, guard  # rank 0 keeps them as long as the group (closed with it)
    return QuorumGroup(group, cfg.outer.norm_check)


def train(cfg: Config) -> dict:
    """Train ``cfg`` on this rank (config history and the run-dir lock: :mod:`dilocox.rundir`)."""
    try:
        trainer = Trainer(cfg)
    except StandbyNotNeeded as e:  # a warm standby the run did not need: a clean end, one line
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(e), flush=True)
        raise SystemExit(0) from None
    trainer.stop.install()
    # logs while the main thread sits in a collective longer than outer.warn_after_s (bounded by the group timeouts).
    # Not on one process: there is no collective to wait on (with it, the 1-rank tiny run measured 5-10 % fewer
    # tokens/s on 2 CPU cores; without it, equal to the code before the monitor existed)
    stall = signals.StallMonitor(cfg.outer.warn_after_s, signals.replica_peers(trainer.topo))
    if trainer.topo.world_size > 1:
        stall.start()
    ok = False
    try:
        out = trainer.run()
        ok = True
        return out
    except signals.Interrupted as e:  # saved; exit 128+signal with one clear line (rank 0)
        trainer.logger.info(str(e))
        trainer.logger.close()
        raise SystemExit(e.exit_code) from None
    except ElasticError:  # its message names the setting and the fix (cli prints it on one line)
        raise
    except RuntimeError as e:  # a peer/replica is gone: say which wait failed; a stuck clean-up cannot outlive 15 s
        o, r = cfg.outer, cfg.parallel.replicas > 1
        msg = signals.comm_failure_message(
            e,
            signals.replica_peers(trainer.topo),
            "outer.timeout_s" if r else "parallel.timeout_s",
            o.timeout_s if r else cfg.parallel.timeout_s,
        )
        if not msg:
            raise
        signals.exit_watchdog(signals.CommTimeoutError(msg))  # its one line (no traceback); bounds the clean-up
        raise signals.ReportedCommError(msg) from None
    finally:
        stall.stop()
        if not ok and trainer.device.type == "cpu":  # the records since the last log step (on a GPU, reading them
            try:  # after a failed collective could wait on the queued work forever: they are dropped there)
                trainer._flush_logs()
            except Exception:  # noqa: BLE001 - a non-finite loss among them, or a broken logger: the error raised stands
                pass
        trainer.stop.close(drain=ok)
        if trainer.outer is not None:
            # After an exception the comm thread is still alive (run() stops it through outer.finish() only on
            # success); left running, the rank was seen to die with SIGABRT at exit. Bounded: a dead peer may hang it
            trainer.outer.close(timeout=30.0)
        if trainer.elastic is not None:  # torchft manager: heartbeats stop, the lighthouse drops this replica
            trainer.elastic.close()
        if trainer.run_lock is not None:
            trainer.run_lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
