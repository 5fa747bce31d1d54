"""`PerformanceMonitor` (`lightning_dpar.performance_monitor`) through real one-process Trainers: what it logs, how it
counts samples and tokens, its summary. The counts over data-parallel ranks (2 gloo ranks) are in
`tests/launched/test_callbacks.py` (cases in `tests/workers/callbacks.py`)."""

from __future__ import annotations

import csv
import resource

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpar.performance_monitor import PerformanceMonitor
from tests.support.models import ParityModule, RegressionData, loader

SEQ, VOCAB, BATCH = 8, 32, 4


class TinyLanguageModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ImageModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(3 * 4 * 4, 1)

    def training_step(self, batch, batch_idx):
        (images,) = batch
        return self.model(images.flatten(1).float()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, module, data, monitor, steps=6):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, data)
    with open(trainer.logger.experiment.metrics_file_path) as f:
        rows = [row for row in csv.DictReader(f) if row.get("perf/step_time_s")]  # not the module's own logs
    return trainer, rows


def test_logs_tokens_samples_step_time_and_memory_for_token_batches(tmp_path, capsys):
    tokens = torch.randint(0, VOCAB, (64, SEQ))
    monitor = PerformanceMonitor()  # no-arg construction, as in the examples' YAML
    trainer, rows = _fit(tmp_path, TinyLanguageModel(), DataLoader(TensorDataset(tokens), batch_size=BATCH), monitor)
    assert len(rows) == 6 and len(monitor.records) == 6
    for row, record in zip(rows, monitor.records):
        step_time = float(row["perf/step_time_s"])
        assert step_time == pytest.approx(record["step_time_s"]) and step_time > 0
        assert float(row["perf/samples_per_s"]) == pytest.approx(BATCH / step_time)
        assert float(row["perf/tokens_per_s"]) == pytest.approx(BATCH * SEQ / step_time)
        peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1024**3
        assert 0.05 < float(row["perf/peak_memory_gb"]) <= peak_rss_gib
        assert "perf/mfu" not in row  # MFU only on GPU
    summary = capsys.readouterr().out
    assert "PerformanceMonitor summary" in summary and "4 (after 2 warm-up)" in summary
    assert "tokens/s (global)" in summary and "rank 0 peak RSS" in summary
    metrics = monitor.summary_metrics(trainer)
    times = sorted(r["step_time_s"] for r in list(monitor.records)[2:])
    assert metrics["perf/step_time_s"] == pytest.approx((times[1] + times[2]) / 2)


def test_float_features_count_samples_not_tokens_unless_told(tmp_path):
    _, rows = _fit(tmp_path / "a", ParityModule(), loader(RegressionData(), BATCH), PerformanceMonitor(), steps=2)
    assert "perf/tokens_per_s" not in rows[0] and float(rows[0]["perf/samples_per_s"]) > 0
    monitor = PerformanceMonitor(tokens_per_sample=10, log_every_n_steps=2)
    _, rows = _fit(tmp_path / "b", ParityModule(), loader(RegressionData(), BATCH), monitor, steps=4)
    assert len(rows) == 2  # logged every 2 batches
    assert float(rows[0]["perf/tokens_per_s"]) == pytest.approx(10 * float(rows[0]["perf/samples_per_s"]))


def test_integer_images_are_not_token_ids_and_warmup_is_reported_as_used(tmp_path, capsys):
    images = torch.randint(0, 255, (16, 3, 4, 4), dtype=torch.uint8)
    module = ImageModule()
    monitor = PerformanceMonitor(warmup_steps=2)
    _, rows = _fit(tmp_path, module, DataLoader(TensorDataset(images), batch_size=BATCH), monitor, steps=2)
    assert "perf/tokens_per_s" not in rows[0]
    # Two batches and warmup_steps=2: no batch is left after warm-up, so the medians use both, and say so.
    assert "2 (after 0 warm-up)" in capsys.readouterr().out


def test_invalid_warmup_is_refused():
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        PerformanceMonitor(warmup_steps=-1)
