"""The Trainer's state (:class:`TrainerState`, a mixin of :class:`dilocox.train.Trainer`): its state dict, checkpoint
saves, the resume from the latest complete checkpoint (same layout, or resharded from another), the checks before a
fresh start or a resume (dilocox/rundir.py) and the run dir's records at the start of a run.

It reads the Trainer's attributes (cfg, topo, model, optimizer, sampler, outer, logger, ckpt_dir, step, ...) and
calls its ``_flush_logs`` before a save (nothing non-finite is saved).
"""

from __future__ import annotations

import os

from dilocox import checkpoint as ckpt
from dilocox import rundir
from dilocox.config import ConfigError, to_yaml
from dilocox.reshard import resharded_state, restart_notes


class TrainerState:
    """State dict, checkpoints, resume and run-dir checks of :class:`dilocox.train.Trainer`."""

    def _check_checkpoint_space(self) -> None:
        space = ckpt.preflight(
            self.ckpt_dir,
            ckpt.estimate_bytes(self.state_dict(), self.optimizer),
            self.topo.world_size,
            self.cfg.checkpoint.keep,
            self.topo.rank,
            ckpt.all_ranks_agree,
            self.cfg.checkpoint.check_space,
        )
        if space:  # checkpoint dir writable, room for one checkpoint (else raised), but not for keep+1
            self.logger.info(space)

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
        if path is None:
            self._check_fresh_start()
            return
        meta = ckpt.read_meta(path)
        self._check_resume_config(path, meta)
        saved = meta.get("layout", self._layout()["layout"])
        if saved != self._layout()["layout"]:  # saved on another R x D x P x T: reshard by global names
            sd = resharded_state(path, self.cfg, self.topo, self.model, self.optimizer, outer=self.outer)
            self.logger.info(f"resharding {path} from layout {saved} to {self._layout()['layout']}")
            for what in restart_notes(self.cfg) if sd.get("outer") else []:
                self.logger.info(f"warning: resharding restarts {what}")
        elif r == "auto":  # verifies each shard's hash; on a damaged one falls back (all ranks alike) or stops
            path, sd = ckpt.load_latest(
                self.ckpt_dir,
                self.topo.rank,
                self.topo.world_size,
                expect=self._layout(),
                fallback=self.cfg.checkpoint.fallback,
            )
        else:
            sd = ckpt.load_checkpoint(path, self.topo.rank, self.topo.world_size, expect=self._layout())
        self.load_state_dict(sd)
        self.resumed_from = path
        self.logger.info(f"resumed from {path} at step {self.step}")

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
            self.state_dict(),
            meta={**self._layout(), "config": self.cfg.to_dict()},
            agree=ckpt.all_ranks_agree,
            keep=self.cfg.checkpoint.keep,
        )
        if record:  # metrics.jsonl names it: a rerun that finds no checkpoint knows one existed (rundir)
            self.logger.write({"event": "checkpoint", "at_step": self.step, "path": path})
        return path

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
        if self.topo.rank == 0:
            hist = rundir.write_config_history(cfg.log.run_dir, to_yaml(cfg), self.step)
            self.logger.info(f"config saved to {hist} and config.yaml")
            if getattr(self, "_fresh_note", None):  # an earlier run's records, set aside: each step logged once
                rundir.set_aside_metrics(cfg.log.run_dir)
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
