"""dilocox.engine: pipeline schedules (torch.distributed.pipelining GPipe/1F1B + a hand-written
reference GPipe used as the oracle) and the per-replica training engine built on them."""

from dilocox.engine.pipeline import PipelineEngine, StageRunner
from dilocox.engine.schedules import SCHEDULES, StageLinks, TorchPipelineSchedule, reference_gpipe

__all__ = ["PipelineEngine", "StageRunner", "SCHEDULES", "StageLinks", "TorchPipelineSchedule", "reference_gpipe"]
