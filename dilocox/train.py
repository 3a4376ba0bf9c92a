"""The training loop: ``dilocox train CONFIG``.

Per rank, top to bottom:

1. process groups of the rank grid (replicas x inner-DP x stages x TP),
2. data (tokenized once by rank 0, memory-mapped by all), the replica's sampler,
3. this rank's shard of the model, the pipeline engine, inner AdamW,
4. the outer loop of the chosen method (DiLoCo family; absent for a single replica),
5. resume from the latest complete checkpoint, if any,
6. per step: forward/backward over the pipeline, outer hook on the gradients (per-step
   methods), global-norm clipping, inner step, outer bookkeeping (pseudo-gradients,
   overlapped all-reduce, outer Nesterov), logs, validation, checkpoints.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from dilocox import checkpoint as ckpt
from dilocox.config import Config, ConfigError, to_yaml
from dilocox.distributed.topology import build_topology, env_rank_world, init_distributed
from dilocox.metrics import MetricsLogger, peak_flops


def lr_at(step: int, cfg: Config) -> float:
    """Inner learning rate at (0-based) step: linear warm-up, then cosine/linear/constant decay."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    span = max(1, total - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    floor = o.lr * o.min_lr_ratio
    if o.schedule == "linear":
        return floor + (o.lr - floor) * (1.0 - frac)
    return floor + 0.5 * (o.lr - floor) * (1.0 + math.cos(math.pi * frac))


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device='cuda' but no CUDA device is available; set --train.device=cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_inner_optimizer(cfg: Config, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms (Megatron/nanoGPT convention)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr)
    kw: dict[str, Any] = {"lr": cfg.optim.lr, "betas": tuple(cfg.optim.betas), "eps": cfg.optim.eps}
    if device.type == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(groups, **kw)


def emulated_bandwidth_bytes() -> float | None:
    """Token-bucket cap (bytes/s) on the outer link, set by ``dilocox launch`` when it cannot use
    network namespaces + tc (no root): DILOCOX_EMULATED_BANDWIDTH_BPS is in bits per second."""
    bps = os.environ.get("DILOCOX_EMULATED_BANDWIDTH_BPS")
    return float(bps) / 8.0 if bps else None


class Trainer:
    """Everything one rank holds during training. ``run()`` trains; attributes are for tests."""

    def __init__(self, cfg: Config):
        from dilocox.data import TokenSampler, prepare
        from dilocox.engine import PipelineEngine
        from dilocox.model.transformer import build_stage_model

        self.cfg = cfg
        # gloo for train.device=cpu even where CUDA exists (NCCL cannot move CPU tensors)
        rank, world, local = init_distributed("gloo" if cfg.train.device == "cpu" else None)
        self.topo = build_topology(cfg.parallel, rank, world)
        self.device = pick_device(cfg, local)
        torch.manual_seed(cfg.train.seed)
        # Every rank of a replica draws the replica's full batch (a pure function of seed,
        # replica and step); the pipeline engine takes this rank's inner-DP rows.
        self.prepared = prepare(cfg.data)  # race-free: one rank builds, the others reuse
        if self.prepared.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({self.prepared.vocab_size}); set --model.vocab_size to at least {self.prepared.vocab_size} (a multiple of parallel.tensor)"
            )
        tr = cfg.train
        self.sampler = TokenSampler(self.prepared.train_tokens(), tr.seq_len, tr.batch_size, tr.seed, self.topo.replica, self.topo.R)
        self.val_batches = self.prepared.val_batches(tr.eval_batches, tr.batch_size, tr.seq_len) if tr.eval_batches else []
        t = self.topo
        self.model = build_stage_model(cfg.model, t.stage, t.P, t.tp_rank, t.T, t.group("tp"), seed=cfg.train.seed, device=self.device)
        autocast = None
        if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and self.device.type == "cuda"):
            autocast = torch.bfloat16
        self.engine = PipelineEngine(self.model, t, cfg.parallel, cfg.model, cfg.train.seq_len, self.device, autocast_dtype=autocast)
        self.optimizer = build_inner_optimizer(cfg, self.model, self.device)
        self.outer = None
        if cfg.outer.method != "none":
            from dilocox.outer import OuterLoop

            self.outer = OuterLoop(
                list(self.model.named_parameters()), t, cfg.outer, cfg.compress, seed=cfg.train.seed,
                layer_of=self.model.param_layer_id, n_layers_total=cfg.model.n_layers, inner_optimizer=self.optimizer,
                comm_bandwidth=emulated_bandwidth_bytes(),
            )
        self.step = 0
        self.tokens_seen = 0
        self.ckpt_dir = cfg.checkpoint.dir or os.path.join(cfg.log.run_dir, "checkpoints")
        if cfg.checkpoint.resume == "none":
            old = ckpt.find_latest(self.ckpt_dir)
            if not ckpt.all_ranks_agree(old is None):  # the same decision on every rank
                raise ConfigError(
                    f"checkpoint.resume=none, but {self.ckpt_dir} already holds checkpoints of an earlier run "
                    f"(latest: {os.path.basename(old) if old else 'seen by another rank'}); a fresh run would leave them as they are "
                    f"and skip its own saves at the same steps. Use checkpoint.resume=auto to continue that run, or give "
                    f"log.run_dir (or checkpoint.dir) a new directory, or delete the old checkpoints"
                )
        self.logger = MetricsLogger(cfg.log.run_dir, enabled=rank == 0, total_steps=cfg.train.steps, jsonl=cfg.log.jsonl, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress)
        self.peak = peak_flops(self.device)
        from dilocox.model.transformer import model_flops_per_token

        self.flops_per_token = model_flops_per_token(cfg.model, cfg.train.seq_len)
        self.history: list[dict] = []
        self._maybe_resume()

    # ------------------------------------------------------------------ state
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
        return {"layout": f"R{p.replicas}xD{p.data}xP{p.pipeline}xT{p.tensor}", "method": self.cfg.outer.method, "arch": self.cfg.model.arch}

    def _maybe_resume(self) -> None:
        r = self.cfg.checkpoint.resume
        if r == "none":
            return
        path = ckpt.find_latest(self.ckpt_dir) if r == "auto" else r
        if path is None:
            return
        sd = ckpt.load_checkpoint(path, self.topo.rank, self.topo.world_size, expect=self._layout())
        self.load_state_dict(sd)
        self.logger.info(f"resumed from {path} at step {self.step}")

    def save(self) -> str:
        return ckpt.save_checkpoint(
            self.ckpt_dir, self.step, self.topo.rank, self.topo.world_size, self.state_dict(),
            meta=self._layout(), agree=ckpt.all_ranks_agree, keep=self.cfg.checkpoint.keep,
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

    def train_step(self) -> float:
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        x, y = self.sampler.next_batch()
        loss = self.engine.forward_backward(x.to(self.device), y.to(self.device))
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss} at step {step} (replica {self.topo.replica}); training stopped before the bad update. "
                f"Lower optim.lr (now {cfg.optim.lr}) or set optim.grad_clip, and resume from the last checkpoint in {self.ckpt_dir}"
            )
        if self.outer is not None:
            self.outer.on_gradients(step)
        if cfg.optim.grad_clip > 0:
            from dilocox.model.parallel_layers import clip_grad_norm_

            self.grad_norm = float(clip_grad_norm_(list(self.model.parameters()), cfg.optim.grad_clip, self.topo.tp_rank, self.topo.group("mp")))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.outer is not None:
            self.outer.after_inner_step(step)
        self.step += 1
        self.tokens_seen += cfg.train.batch_size * cfg.train.seq_len
        return loss

    def run(self) -> dict:
        cfg = self.cfg
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * self.topo.R
        start_step = self.step
        self.logger.info(f"dilocox: {self.topo.describe()} | device {self.device} | method {cfg.outer.method} | "
                         f"{cfg.model.arch} {cfg.model.num_params() / 1e6:.2f}M params | {tokens_per_step} tokens/step")
        o = cfg.outer
        if (o.method == "diloco" and not cfg.compress.adaptive.enabled and o.streaming.fragments == 1
                and cfg.train.steps % o.sync_every):
            self.logger.info(f"warning: train.steps={cfg.train.steps} is not a multiple of outer.sync_every={o.sync_every}: the last "
                             f"{cfg.train.steps % o.sync_every} local steps are never synchronised and the final model (the outer "
                             f"params) leaves them out; set train.steps to a multiple of {o.sync_every}")
        t_start = time.time()
        t_last, step_last = t_start, self.step
        val_loss = None
        while self.step < cfg.train.steps:
            if cfg.train.max_tokens and self.tokens_seen >= cfg.train.max_tokens:
                break
            loss = self.train_step()
            rec: dict[str, Any] = {"step": self.step, "loss": loss, "lr": lr_at(self.step - 1, cfg)}
            do_eval = bool(cfg.train.eval_every and self.val_batches and self.step % cfg.train.eval_every == 0)
            if do_eval:
                val_loss = self.validate()
                rec["val_loss"] = val_loss
            now = time.time()
            done = self.step - start_step
            rate = done / max(1e-9, now - t_start)
            rec["tokens_per_s"] = tokens_per_step * (self.step - step_last) / max(1e-9, now - t_last)
            rec["eta_s"] = (cfg.train.steps - self.step) / max(rate, 1e-9)
            if self.peak:
                rec["mfu"] = rec["tokens_per_s"] * self.flops_per_token / (self.peak * self.topo.world_size)
            if self.outer is not None:
                rec.update(self.outer.stats)
            printed = self.step % cfg.log.every == 0 or do_eval or self.step == cfg.train.steps
            self.history.append(rec)
            self.logger.log(rec, printed=printed)
            if printed:
                t_last, step_last = now, self.step
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.train.steps:
                self.save()
        if self.outer is not None:
            self.outer.finish()
        wall = time.time() - t_start
        final_val = self.validate()
        summary = {
            "steps": self.step, "final_val_loss": final_val, "final_val_ppl": math.exp(min(final_val, 50)),
            "wall_s": wall, "tokens_per_s": tokens_per_step * (self.step - start_step) / max(wall, 1e-9),
            "tokens_per_replica": self.tokens_seen,
        }
        if self.outer is not None:
            summary.update({f"outer_{k}": v for k, v in self.outer.stats.items()})
        import json
        import resource

        summary["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        with open(os.path.join(cfg.log.run_dir, f"rank_{self.topo.rank:05d}.json"), "w") as f:
            json.dump({"rank": self.topo.rank, "coord": self.topo.describe(), **summary}, f)
        self.logger.write({"summary": summary})
        self.logger.info(f"done: {self.step} steps, final val loss {final_val:.4f} (ppl {summary['final_val_ppl']:.2f}), "
                         f"{summary['tokens_per_s']:,.0f} tok/s, wall {wall:.1f}s")
        self.save()
        self.logger.close()
        return summary


def train(cfg: Config) -> dict:
    os.makedirs(cfg.log.run_dir, exist_ok=True)
    if env_rank_world()[0] == 0:  # RANK under torchrun, SLURM_PROCID under plain srun
        with open(os.path.join(cfg.log.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        comm = getattr(trainer.outer, "comm", None)
        if comm is not None:
            # After an exception the comm thread is still alive (run() stops it through
            # outer.finish() only on success); left running, the failing rank was seen to die
            # with SIGABRT at interpreter exit. Bounded: a collective whose peer died may hang.
            comm.shutdown(timeout=30.0)
        if dist.is_initialized():
            dist.destroy_process_group()
