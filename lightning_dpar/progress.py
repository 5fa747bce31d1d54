"""The main job's progress bar with `rich` installed: Lightning's `RichProgressBar`, reading right when training is
bounded by `max_steps` rather than `max_epochs`.

Lightning's rich bar titles the training bar `Epoch {epoch}/{max_epochs - 1}`, which reads `Epoch 0/-2` when
`max_epochs` is -1 (what `max_steps` alone sets), and formats every metric as a float, the logger's integer version
included (`v_num: 0.000`). Here the bar reads `Epoch 0` (as the tqdm bar does) and `v_num: 0`.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["DparRichProgressBar"]


class DparRichProgressBar(RichProgressBar):
    """`RichProgressBar` whose training description has no epoch bound when there is none (`max_epochs=-1`), and
    whose logger version shows as the integer it is."""

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if trainer.max_epochs == -1 and self.progress is not None and self.train_progress_bar_id is not None:
            description = f"Epoch {trainer.current_epoch}"
            # The same padding as Lightning's: the bar keeps its width when a validation bar's longer title shows.
            description = f"{description:{len(self.validation_description)}}"
            self.progress.update(self.train_progress_bar_id, description=description)

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if isinstance(metrics.get("v_num"), int):
            metrics["v_num"] = str(metrics["v_num"])  # rich formats numbers with `metrics_format` (".3f")
        return metrics
