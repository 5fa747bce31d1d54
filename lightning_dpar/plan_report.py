"""The dry run's documented import path before it became a package: `from lightning_dpar.plan_report import plan`
keeps working. The code lives in `lightning_dpar.dry_run`."""

from lightning_dpar.dry_run import ROOT, ParamRow, PipelineReport, PlanReport, StageRow, main, plan

__all__ = ["ROOT", "ParamRow", "PipelineReport", "PlanReport", "StageRow", "main", "plan"]
