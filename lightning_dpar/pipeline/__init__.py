"""Pipeline parallelism: the options (`config`), the split into stages (`split`), the schedules and their bubble
(`schedule`), the stages as modules (`stage`), what crosses a boundary (`values`), the runtime that drives
Lightning's steps through them (`runtime`), forward-only passes that relay a stage's error to every rank
(`forward_relay`), and what the steps log, relayed from the last stage (`log_relay`). See `docs/pipeline.md`.

`estimate` and `report`: what it does to memory in the `plan` dry run and its section of the report; `cost`: what
it offers and costs a layout in the layout search.
"""

from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.schedule import SCHEDULES
from lightning_dpar.pipeline.split import PipelineSplit

__all__ = ["SCHEDULES", "PipelineConfig", "PipelineSplit"]
