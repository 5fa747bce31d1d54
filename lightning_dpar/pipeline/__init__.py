"""Pipeline parallelism: the split into stages (`split`), the schedules (`schedule`), the stages as modules
(`stage`), what crosses a boundary (`values`) and the runtime that drives Lightning's steps through them
(`runtime`). See `docs/pipeline.md`."""

from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.schedule import SCHEDULES
from lightning_dpar.pipeline.split import PipelineSplit

__all__ = ["SCHEDULES", "PipelineConfig", "PipelineSplit"]
