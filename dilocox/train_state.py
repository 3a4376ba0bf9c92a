"""The Trainer's state (:class:`TrainerState`, a mixin of :class:`dilocox.train.Trainer`): its state dict, checkpoint
saves, the resume from the latest complete checkpoint (same layout, or resharded from another), the checks before a
fresh start or a resume (dilocox/rundir.py) and the run dir's records at the start of a run.

It reads the Trainer's attributes (cfg, topo, model, optimizer, sampler, outer, logger, ckpt_dir, step, ...) and
calls its ``_flush_logs`` before a save (nothing non-finite is saved).
"""

from __future__ import annotations

import os
import time
import uuid

import torch

from dilocox import checkpoint as ckpt
from dilocox import rundir
from dilocox.checkpoint import names
from dilocox.checkpoint.layout import _STEP_RE
from dilocox.checkpoint.legacy import parse_layout
from dilocox.checkpoint.save import checkpoint_bytes
from dilocox.config import Config, ConfigError, to_yaml

CONTINUE_DIR = ckpt.CONTINUE_DIR  # <checkpoint dir>/continue/step_N: a finished run's state before outer.finish


def _load_continuation(cont: str, tr: TrainerState, reader, expect: dict) -> dict:
    try:
        return ckpt.load_step(cont, tr.topo.rank, tr.topo.world_size, reader, expect)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(
            f"{e}; --checkpoint.continuation=false goes on from the final checkpoint's θ instead"
        ) from None


class _Reader:
    """The Trainer's ``ckpt.Reader``: its DCP targets on its own layout, and its state from them. On the saved
    layout each rank reads its own rank's rest; on another one the replica's first rank's (``names``)."""

    def __init__(self, tr: TrainerState):
        self.tr = tr
        self.part = tr._dcp_part()

    def prepare(self, step_dir: str, meta: dict) -> dict:
        from dilocox.checkpoint.reader import reader

        tr, topo = self.tr, self.tr.topo
        saved, mine = meta.get("layout", tr._layout()["layout"]), tr._layout()["layout"]
        R, D, P, T = parse_layout(saved)
        if R != topo.R:
            raise ckpt.CheckpointError(
                f"checkpoint {step_dir} has parallel.replicas={R}, this run {topo.R}: the data sampler and outer "
                "state are per replica; resume with the same parallel.replicas"
            )
        self.same = saved == mine
        if not self.same and tr.outer is not None and tr._outer_layout() is None:
            raise ckpt.CheckpointError(
                f"checkpoint {step_dir}: outer.method={tr.cfg.outer.method}'s state (its error feedback) is per rank; "
                f"resume it on its saved layout {saved} (parallel.data/pipeline/tensor as saved)"
            )
        self.src = topo.rank if self.same else ((topo.replica * D) * P) * T
        md = reader(os.path.join(step_dir, self.part[0])).read_metadata().state_dict_metadata
        outer_names = tr._outer_layout()[0] if tr._outer_layout() else None
        return names.wanted(
            md, topo.replica, self.src, list(tr.model.state_dict()), tr._opt_names(), outer_names, tr._dcp_target
        )

    def finish(self, step_dir: str, meta: dict, targets: dict) -> dict:
        tr = self.tr
        outer = tr.outer if tr._outer_layout() else None
        sd = names.unflatten(
            targets,
            tr.topo.replica,
            self.src,
            list(tr.model.state_dict()),
            tr._opt_names(),
            outer,
            self.same,
            tr.optimizer.state_dict()["param_groups"],
            step_dir,
        )
        tr.load_state_dict(sd)  # (here: a refusal on one rank is agreed by load_step, every rank raises)
        return sd


def restart_notes(cfg: Config) -> list[str]:
    """What a resume on another layout re-initialises instead of resharding (logged as warnings)."""
    from dilocox.outer.diloco import METHODS as FAMILY

    if cfg.outer.method not in FAMILY:
        return []
    c, notes = cfg.compress, []
    if c.lowrank.enabled:
        notes.append(
            "the low-rank compressor's warm-start Q (redrawn from the seed at the saved rank) and its "
            "tail-energy estimate"
        )
    if c.adaptive.enabled:
        notes.append("the adaptive controller's rank history and measured comm/step times (H and the rank carry over)")
    if c.sparse.enabled and c.collective == "reduce_scatter":
        notes.append("the sparse reduce-scatter's owner residuals (each owner's rows depend on the layout)")
    return notes


def _resume_path_problem(r: str) -> str | None:
    """Why ``checkpoint.resume=r`` (not auto/none) names no step directory, with the fix; None when it does."""
    step_dir = os.path.exists(os.path.join(r, "COMPLETE.json")) or os.path.basename(r).startswith("step_")
    if os.path.isdir(r) and step_dir:
        return None  # (a step directory without COMPLETE.json: read_meta says it was interrupted while saving)
    what = f"checkpoint.resume={r!r} is not auto, none or a checkpoint's step directory"
    if os.path.isdir(r) and (steps := ckpt.complete_steps(r)):
        return f"{what}: it holds step directories; resume from one, e.g. --checkpoint.resume={steps[-1]}"
    gone = "" if os.path.exists(r) else " (it does not exist)"
    return f"{what}{gone}; give RUN_DIR/checkpoints/step_XXXXXXXX or auto"


def _readable_meta(ckpt_dir: str, newest: str) -> str:
    """The newest complete step directory at or before ``newest`` whose COMPLETE.json reads (``newest`` itself when
    none does: reading it then raises the error naming the file)."""
    cands = [d for d in ckpt.complete_steps(ckpt_dir) if os.path.basename(d) <= os.path.basename(newest)]
    for d in reversed(cands):
        try:
            ckpt.read_meta(d)
            return d
        except ckpt.CorruptCheckpointError:
            continue
    return newest


class TrainerState:
    """State dict, checkpoints, resume and run-dir checks of :class:`dilocox.train.Trainer`."""

    def _check_checkpoint_space(self) -> None:
        space = ckpt.preflight(
            self.ckpt_dir,
            self._checkpoint_share(),
            self.topo.world_size,
            self.cfg.checkpoint.keep,
            self.topo.rank,
            ckpt.all_ranks_agree,
            self.cfg.checkpoint.check_space,
            continuation=self._saves_continuation(),
        )
        if space:  # checkpoint dir writable, room for one checkpoint (else raised), but not for keep+1
            self.logger.info(space)

    def _checkpoint_share(self, planned: bool = True) -> int:
        """This rank's share of one checkpoint's bytes (``estimate_bytes``): the model, inner optimizer and a DiLoCo
        outer state are alike on the replica's D data-parallel ranks (DCP writes them once); the rest is this rank's
        own, and so is the outer state with ``outer.shard_over_data`` (each DP rank holds 1/D of the tensors) or of a
        per-step method (kept in the rank's rest). ``planned`` (start-up): with the moments an optimizer that has not
        stepped yet will hold; False (a save): what the state holds now, what is written."""
        sd, layout, own = self.state_dict(), self._outer_layout(), ["step", "tokens_seen", "sampler", "rng"]
        if layout is not None and sd["outer"] and "state" in sd["outer"]:  # per parameter, as DCP writes it (views)
            sd["outer"] = names.outer_by_name(sd["outer"], *layout)
        if layout is None or getattr(self.outer, "dp_shard", None) is not None:
            own.append("outer")
        return ckpt.estimate_bytes(sd, self.optimizer if planned else None, self.topo.D, own)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "outer": self.outer.state_dict() if self.outer is not None else {},
            "rng": ckpt.rng_state(),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.sampler.load_state_dict(sd["sampler"])
        if self.outer is not None:
            self.outer.load_state_dict(sd["outer"])
        ckpt.set_rng_state(sd["rng"])

    # ------------------------------------------------------------------ the state by global names (DCP)
    def _opt_names(self) -> list[str]:
        return names.opt_param_names(self.model, self.cfg.optim.name)

    def _outer_layout(self) -> tuple | None:
        return names.outer_layout(self.outer)

    def _tp(self) -> tuple[dict, object]:
        """``(name -> partition_dim of every TP-sharded model tensor, the TP group's DeviceMesh or None)``."""
        if getattr(self, "_tp_cache", None) is None:
            from dilocox.model.parallel_layers import is_tensor_parallel

            dims = {
                n: t.partition_dim for n, t in self.model.state_dict(keep_vars=True).items() if is_tensor_parallel(t)
            }
            mesh = None
            if self.topo.T > 1:
                from torch.distributed.device_mesh import DeviceMesh

                mesh = DeviceMesh.from_group(self.topo.group("tp"), "cpu")
            self._tp_cache = (dims, mesh)
        return self._tp_cache

    def _dcp_wrap(self, name: str, t: torch.Tensor):
        """A TP slice of ``name`` as a DTensor sharded over the TP group (DCP records its global offset)."""
        dims, mesh = self._tp()
        dim = dims.get(name)
        if mesh is None or dim is None or t.dim() <= dim:
            return t
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)

    def _dcp_target(self, name: str | None, md) -> torch.Tensor:
        """An empty load target for a saved key of global size ``md.size`` (this rank's slice for a TP tensor)."""
        dims, mesh = self._tp()
        size, dtype, dim = list(md.size), md.properties.dtype, dims.get(name) if name else None
        if mesh is None or dim is None or len(size) <= dim or size[dim] % self.topo.T:
            return torch.empty(size, dtype=dtype)
        size[dim] //= self.topo.T
        return self._dcp_wrap(name, torch.empty(size, dtype=dtype))

    def _dcp_part(self) -> tuple[str, object, int]:
        """This rank's DCP checkpoint: its replica's own directory, saved and read by the replica's ranks alone (DCP's
        plan exchange never crosses the slow link between replicas)."""
        t = self.topo
        return f"replica{t.replica}", t.group("replica"), t.D * t.P * t.T

    def _dcp_state(self) -> dict:
        return names.flatten(
            self.state_dict(),
            self.topo.replica,
            self.topo.rank,
            self._opt_names(),
            self._outer_layout(),
            self._dcp_wrap,
        )

    def _layout(self) -> dict:
        p = self.cfg.parallel
        return {
            "layout": f"R{p.replicas}xD{p.data}xP{p.pipeline}xT{p.tensor}",
            "method": self.cfg.outer.method,
            "arch": self.cfg.model.arch,
        }

    def _maybe_resume(self) -> None:
        r = self.cfg.checkpoint.resume
        if r == "none":
            old = ckpt.find_latest(self.ckpt_dir)
            if not ckpt.all_ranks_agree(old is None):  # the same decision on every rank
                raise ConfigError(
                    f"checkpoint.resume=none, but {self.ckpt_dir} already holds checkpoints of an earlier run "
                    f"(latest: {os.path.basename(old) if old else 'seen by another rank'}); a fresh run would leave "
                    f"them as they are and skip its own saves at the same steps. Use checkpoint.resume=auto to "
                    f"continue that run, or give log.run_dir (or checkpoint.dir) a new directory, or delete the old "
                    f"checkpoints"
                )
            self._check_fresh_start()
            return
        path = ckpt.find_latest(self.ckpt_dir) if r == "auto" else r
        if r != "auto":  # every rank alike: a path that is not a step directory is an input error, named
            bad = _resume_path_problem(r)
            if not ckpt.all_ranks_agree(bad is None):
                raise ConfigError(bad or f"checkpoint.resume={r!r}: another rank cannot read it (see rank 0)")
        if not ckpt.all_ranks_agree(path is not None) and not ckpt.all_ranks_agree(path is None):
            raise ckpt.CheckpointError(
                f"checkpoint.dir {self.ckpt_dir}: some ranks find a checkpoint there and others none; every rank "
                "must see the same directory (a shared file system), or move the checkpoints away to start fresh"
            )
        if path is None:
            self._check_fresh_start()
            return
        # (auto with fallback: a damaged COMPLETE.json is load_latest's to pass over, like a damaged shard; the config
        # is compared with the newest readable one's)
        checked = _readable_meta(self.ckpt_dir, path) if r == "auto" and self.cfg.checkpoint.fallback else path
        self._check_resume_config(checked, ckpt.read_meta(checked))
        expect = {k: v for k, v in self._layout().items() if k != "layout"}  # another layout: DCP reshards
        reader = _Reader(self)
        self._continued = cont = self._continuation_of(path)
        if cont:  # (its own hashes verified; a damaged one stops, naming the way on from θ)
            sd = _load_continuation(cont, self, reader, expect)
        elif r == "auto":  # verifies the files' hashes; on a damaged one falls back (all ranks alike) or stops
            path, sd = ckpt.load_latest(
                self.ckpt_dir, self.topo.rank, self.topo.world_size, reader, expect, self.cfg.checkpoint.fallback
            )
        else:
            sd = ckpt.load_step(path, self.topo.rank, self.topo.world_size, reader, expect)
        # a rewind (an explicit step, or a `latest` edited back by hand): the later checkpoints of this dir would
        # block its own saves (a save at a complete step is skipped; so was the final one, and latest stayed behind)
        err = None
        try:
            if self.topo.rank == 0:
                ckpt.set_aside_later(self.ckpt_dir, path, self.logger.info)
        except Exception as e:  # noqa: BLE001 - (a read-only checkpoint.dir, a COMPLETE.json changed meanwhile: every
            # rank stops, none waits for rank 0)
            err = ckpt.CheckpointError(f"cannot set aside the checkpoints after {path} in {self.ckpt_dir}: {e}")
        if not ckpt.all_ranks_agree(err is None):  # no rank saves before they are set aside
            raise err or ckpt.CheckpointError(f"rank 0 could not set aside the checkpoints after {path} (see its log)")
        if cont:
            self.logger.info(f"continuing from {cont} (the state saved before the run's end at step {self.step} set "
                             f"the params to θ): training goes on as one run of train.steps would")  # fmt: skip
        saved = ckpt.read_meta(path).get("layout", self._layout()["layout"])
        if saved != self._layout()["layout"]:
            self.logger.info(f"resharded {path} from layout {saved} to {self._layout()['layout']}")
            for what in restart_notes(self.cfg) if sd.get("outer") else []:
                self.logger.info(f"warning: resharding restarts {what}")
        self.resumed_from = path
        self.logger.info(f"resumed from {path} at step {self.step}")

    def _continuation_of(self, path: str) -> str | None:
        """The continuation saved beside ``path`` (``_finish_outer``) when this run goes past its step: ``path`` is a
        finished run's final checkpoint whose COMPLETE.json names it (a token; a continuation of another trajectory,
        left by a rewind, names another), and checkpoint.continuation is on. Every rank alike."""
        found, path = None, os.path.normpath(path)
        try:  # (a damaged COMPLETE.json: load_latest's to pass over or name, below)
            meta = ckpt.read_meta(path) if self.cfg.checkpoint.continuation and os.path.isdir(path) else {}
        except ckpt.CheckpointError:
            meta = {}
        token, step = meta.get("continuation"), meta.get("step")
        cand = os.path.join(os.path.dirname(path), CONTINUE_DIR, os.path.basename(path))
        if token and isinstance(step, int) and self.cfg.train.steps > step:
            try:
                if (
                    os.path.exists(os.path.join(cand, "COMPLETE.json"))
                    and ckpt.read_meta(cand)["continuation"] == token
                ):
                    found = cand
            except (ckpt.CheckpointError, KeyError):  # (a damaged one: from θ, as without one)
                pass
            if found is None:  # (a later run's end replaced it: only the newest end keeps one)
                self.logger.info(f"warning: the continuation {path} was saved with is gone ({cand}: a later end of the "
                                 f"run replaced it); training goes on from its θ")  # fmt: skip
        return found if ckpt.all_ranks_agree(found is not None) else None

    def _finish_outer(self) -> float:
        """``outer.finish()`` at the end of the run; before it (DiLoCo family, checkpoint.continuation), the state as a
        mid-run checkpoint holds it, into <checkpoint dir>/continue/step_N (the last one only): finish() sets every
        parameter to θ, so the final checkpoint alone cannot go on as one longer run would. Best effort: a continuation
        that cannot be saved (no room for it and the final checkpoint both, say) is a warning, and the final save
        follows as ever. Returns the seconds its write took (not the loop's: the run's wall time leaves them out)."""
        self._continuation, took = None, 0.0
        if self.outer is None:
            return took
        if self._saves_continuation():
            try:
                took = self._save_continuation()
            except ckpt.CheckpointError as e:  # (agreed: every rank is here)
                self.logger.info(f"warning: no continuation saved ({e}); a resume with more train.steps goes on from θ")
        self.outer.finish()
        return took

    def _saves_continuation(self) -> bool:
        return bool(self.cfg.checkpoint.continuation and getattr(self.outer, "params_to_theta_at_finish", False))

    def _save_continuation(self) -> float:
        cdir, err = os.path.join(self.ckpt_dir, CONTINUE_DIR), None
        same = os.path.join(cdir, ckpt.step_dir_name(self.step))  # (an earlier end's at this step: replaced)
        if self.topo.rank == 0:  # only the one this run went on from stays until the final checkpoint is complete
            self._drop_continuations(but=getattr(self, "_continued", None))  # (the others: no final one names them)
            if os.path.exists(same):
                err = f"cannot remove the earlier continuation {same}"
        self._flush_logs()
        state = self._dcp_state()  # (waits for the in-flight averages: outer.finish's drain, counted as its own)
        t0, share = time.perf_counter(), self._checkpoint_share(planned=False)
        need = 2 * checkpoint_bytes(share, self.topo.world_size)  # (this one and the final one after it)
        try:
            if not err and ckpt.disk_free(self.ckpt_dir) < need:
                err = f"{need / 2**20:.1f} MB free needed in {self.ckpt_dir} for it and the final checkpoint"
        except OSError as e:
            err = f"checkpoint.dir {self.ckpt_dir}: {e}"
        if not ckpt.all_ranks_agree(not err):
            raise ckpt.CheckpointError(err or "another rank cannot save it (see its log)")
        token = uuid.uuid4().hex  # (rank 0's is the one written, in both COMPLETE.json)
        ckpt.save_checkpoint(
            cdir, self.step, self.topo.rank, self.topo.world_size, state,
            meta={**self._layout(), "config": self.cfg.to_dict(), "continuation": token},
            agree=ckpt.all_ranks_agree, keep=0, part=self._dcp_part(), share=share,
        )  # fmt: skip
        self._continuation = token
        return time.perf_counter() - t0

    def _check_fresh_start(self) -> None:
        """No checkpoint to resume: refuse (every rank alike) a start at step 0 on an earlier run's metrics.jsonl
        (rundir.check_fresh_start); _begin_run sets its records aside when allowed. Not for elastic replicas (an
        incarnation without a checkpoint continues its replica's records at the live step)."""
        self._fresh_note, err = None, None
        if self.topo.rank == 0 and not self.cfg.outer.elastic.enabled:
            try:
                self._fresh_note = rundir.check_fresh_start(self.cfg.log.run_dir, self.ckpt_dir, self.cfg)
            except rundir.RunDirError as e:
                err = e
        if not ckpt.all_ranks_agree(err is None):
            raise err or rundir.RunDirError(f"log.run_dir={self.cfg.log.run_dir}: rank 0 refused a fresh start here")

    def _check_resume_config(self, path: str, meta: dict) -> None:
        """Refuse (on every rank alike) a resume whose config changes the math; warn about schedule changes."""
        saved, source = rundir.saved_config(path, meta, self.cfg.log.run_dir)
        err = None
        try:
            for w in rundir.check_resume_config(saved, source, self.cfg):
                self.logger.info(w)
        except rundir.RunDirError as e:
            err = e
        if not ckpt.all_ranks_agree(err is None):
            raise err or rundir.RunDirError(f"resuming {path}: another rank found the config incompatible (see rank 0)")

    def save(self, record: bool = True) -> str:
        self._flush_logs()  # nothing non-finite is saved: the pending losses are checked (and logged) first
        # the config goes into COMPLETE.json: a resume compares its own config with the one these weights came from
        path = ckpt.save_checkpoint(
            self.ckpt_dir,
            self.step,
            self.topo.rank,
            self.topo.world_size,
            self._dcp_state(),
            meta={**self._layout(), "config": self.cfg.to_dict(), **self._final_meta(record)},
            agree=ckpt.all_ranks_agree,
            keep=self.cfg.checkpoint.keep,
            part=self._dcp_part(),
            share=self._checkpoint_share(planned=False),  # (the free-space check: as preflight's, with the D copies)
        )
        if record:  # metrics.jsonl names it: a rerun that finds no checkpoint knows one existed (rundir)
            self.logger.write({"event": "checkpoint", "at_step": self.step, "path": path})
        elif self._saves_continuation() and self.topo.rank == 0:  # (the final one is complete: only now do the
            mine = getattr(self, "_continuation", None)  # earlier ends' continuations go, all but the one it names)
            self._drop_continuations(but=os.path.join(self.ckpt_dir, CONTINUE_DIR, ckpt.step_dir_name(self.step))
                                     if mine else None)  # fmt: skip
        return path

    def _drop_continuations(self, but: str | None) -> None:
        cdir = os.path.join(self.ckpt_dir, CONTINUE_DIR)
        for name in os.listdir(cdir) if os.path.isdir(cdir) else []:
            path = os.path.join(cdir, name)
            if _STEP_RE.match(name) and not (but and os.path.abspath(path) == os.path.abspath(but)):  # (a rewind's
                # continue/step_N.superseded stays with its checkpoint)
                ckpt.remove_step_dir(path)

    def _final_meta(self, record: bool) -> dict:
        """The final save (``record`` False) names the continuation saved before outer.finish, if any."""
        token = getattr(self, "_continuation", None)
        return {"continuation": token} if token and not record else {}

    def _begin_run(self) -> dict | None:
        """Before the first step: the finished-run guard, then (rank 0) config history and metrics.jsonl
        cut back to the resumed step. Returns a summary when there is nothing to do (resume_finished=skip)."""
        cfg = self.cfg
        if self.resumed_from is not None:
            skip = cfg.checkpoint.resume_finished == "skip"
            msg = rundir.finished_message(self.step, self.tokens_seen, cfg, self.resumed_from, skip=skip)
            if msg and skip:
                self.logger.info(msg)
                return {"steps": self.step, "skipped": True}
            if msg:
                raise rundir.RunDirError(msg)
            if (
                self.topo.rank == 0
                and getattr(self.outer, "params_to_theta_at_finish", False)
                and not getattr(self, "_continued", None)
            ):
                info = rundir.earlier_records(cfg.log.run_dir)  # (before truncate_metrics below: its summary)
                if info and info["ended_at"] == self.step:
                    self.logger.info(rundir.extended_note(self.step, cfg.outer.method))
        if self.topo.rank == 0:
            hist = rundir.write_config_history(cfg.log.run_dir, to_yaml(cfg), self.step)
            self.logger.info(f"config saved to {hist} and config.yaml")
            rundir.keep_tokenizer(cfg.log.run_dir, self.prepared)  # export/generate read the BPE the model learned
            if getattr(self, "_fresh_note", None):  # an earlier run's records, set aside: each step logged once
                rundir.set_aside_metrics(cfg.log.run_dir)
                self.logger.resume_at(0)  # TensorBoard hides the set-aside run's events too (steps from 1 on)
                self.logger.info(self._fresh_note)
            if self.resumed_from is not None:
                dropped = rundir.truncate_metrics(cfg.log.run_dir, self.step)
                self.logger.resume_at(self.step)
                self.logger.write(
                    {
                        "event": "resume",
                        "resumed_at": self.step,
                        "checkpoint": self.resumed_from,
                        "records_dropped": dropped,
                    }
                )
                if dropped:
                    self.logger.info(
                        f"metrics.jsonl: {dropped} records logged after step {self.step} by the earlier "
                        f"run moved to {rundir.DISCARDED_NAME}"
                    )
        return None
