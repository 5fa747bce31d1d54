"""Cases for `tests/launched/test_pipeline.py`: pipeline parallelism through real Trainers on 2 and 4 gloo ranks.

Parity cases train with every schedule family and compare the final parameters (gathered from all stages) with
single-process training on the same global batches. Feature cases check what surrounds the step: accumulation,
clipping by the global norm, the logged loss on every rank, the data each rank sees, evaluation, bf16, meta-device
init per stage. Checkpoint cases save under PP 2 x FSDP 2 and resume under `dpar_fsdp` and back into PP 2.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dpar import FullyShardStrategy
from lightning_dpar.pipeline.stage import RemoteUnit
from tests.support.models import (
    Net,
    ParityModule,
    RegressionData,
    global_batches,
    loader,
    make_optimizer,
    reference_train,
)
from tests.workers.cases import Case
from tests.workers.checkpoint_common import IndexedData, case_dir, max_diff, saved_by
from tests.workers.common import BATCH, STEPS, trainer_for, world_size
from tests.workers.pipeline_common import (
    PIPELINE,
    ApplicationRecorder,
    CheckpointModule,
    CountingLinear,
    HeadFirstModule,
    HeadFirstNet,
    LossRecorder,
    MetaInitModule,
    MetricModule,
    ReusedLayerModule,
    SeenModule,
    SkippingModule,
    SummedLogModule,
    data_parallel,
    expect_error,
    gather_objects,
    pipeline_strategy,
    reference_losses,
    whole_model,
    whole_optimizer,
)

#: (schedule, stages per rank, model depth): every family torch offers, each with enough blocks for its stages.
SCHEDULES = [("GPipe", 1, 2), ("1F1B", 1, 2), ("Interleaved1F1B", 2, 4), ("ZBVZeroBubble", 2, 4)]


def parity(
    schedule,
    stages_per_rank,
    depth,
    optimizer="sgd",
    tensor_parallel=1,
    accumulate=1,
    clip_norm=None,
    callbacks=(),
    **kw,
):
    """Train 3 steps; the largest parameter difference to single-process training, and the logged losses."""
    data = RegressionData()
    recorder = LossRecorder()
    extra = {"accumulate_grad_batches": accumulate} if accumulate > 1 else {}
    if clip_norm is not None:
        extra.update(gradient_clip_val=clip_norm, gradient_clip_algorithm="norm")
    strategy = pipeline_strategy(schedule, stages_per_rank, tensor_parallel, **kw)
    trainer = trainer_for(strategy, callbacks=[recorder, *callbacks], **extra)
    trainer.fit(ParityModule(optimizer=optimizer, depth=depth), loader(data, BATCH))
    got = whole_model(trainer)
    logged = gather_objects(recorder.losses)
    batches = global_batches(data, data_parallel(tensor_parallel), BATCH, STEPS, accumulate)
    want = reference_train(optimizer, batches, depth=depth, clip_norm=clip_norm)
    assert set(got) == set(want), (sorted(got), sorted(want))
    losses = reference_losses(optimizer, batches, depth, clip_norm, accumulate)
    return {
        "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        # Every rank logs the true loss of the last batch (with accumulation: of its last micro-batch).
        "logged_loss_diff": max(abs(rank_losses[-1] - losses[-1]) for rank_losses in logged),
        "logged_on_ranks": sum(len(rank_losses) == STEPS * accumulate for rank_losses in logged),
    }


def group_parity() -> Iterator[Case]:
    layouts = [("pp", 1)] if world_size() == 2 else [("pp_fsdp", 1), ("pp_tp", 2)]
    for layout, tp in layouts:
        for schedule, stages_per_rank, depth in SCHEDULES:
            for opt in ("sgd", "adamw"):
                yield Case(
                    f"{layout}_{schedule}_{opt}",
                    lambda s=schedule, spr=stages_per_rank, d=depth, o=opt, tp=tp: parity(s, spr, d, o, tp),
                )
        # 3 blocks over 2 stages: one stage gets 2 blocks.
        yield Case(f"{layout}_uneven", lambda tp=tp: parity("1F1B", 1, 3, "adamw", tp))
    if world_size() == 2:
        yield Case("pp_explicit_split", lambda: parity("GPipe", 1, 3, "sgd", pipeline_split=["model.layers.2"]))
        yield Case("pp_accumulate", lambda: parity("1F1B", 1, 2, "sgd", accumulate=2))
        yield Case("pp_clip_norm", lambda: parity("Interleaved1F1B", 2, 4, "sgd", clip_norm=0.05))
        yield Case("pp_microbatches_4", lambda: parity("GPipe", 1, 2, "adamw", pipeline_microbatches=4))
        yield Case("pp_head_registered_first", head_first_case)


def head_first_case() -> dict:
    """A model registering its head first trains at parity once `pipeline_call_order` gives the call order."""
    data = RegressionData()
    strategy = pipeline_strategy("Interleaved1F1B", 2, pipeline_call_order=["model.trunk", "model.head"])
    trainer = trainer_for(strategy)
    trainer.fit(HeadFirstModule(), loader(data, BATCH))
    got = whole_model(trainer)
    reference = HeadFirstNet()
    opt = make_optimizer("sgd", reference.parameters())
    for x, y in global_batches(data, data_parallel(), BATCH, STEPS):
        opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        opt.step()
    want = {f"model.{k}": v for k, v in reference.state_dict().items()}
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want)}


# ---------------------------------------------------------------------- around the step


def sampler_case() -> dict:
    """Pipeline (and TP) peers see the same batch; data-parallel peers see different ones."""
    module = SeenModule()
    trainer = trainer_for(pipeline_strategy())
    trainer.fit(module, DataLoader(IndexedData(), batch_size=BATCH))
    seen = gather_objects(module.seen)
    mesh = trainer.strategy.device_mesh
    coordinates = gather_objects(mesh.get_coordinate())
    return {"seen": seen, "coordinates": coordinates, "dims": list(mesh.mesh_dim_names)}


def evaluation_case() -> dict:
    """`validate`/`test`/`predict` after `fit`: forward-only through the stages, results on every rank."""
    module = SeenModule()
    trainer = trainer_for(pipeline_strategy())
    val_data = IndexedData(n=16, seed=7)
    trainer.fit(module, DataLoader(IndexedData(), batch_size=BATCH))
    params = whole_model(trainer)
    val = trainer.validate(module, DataLoader(val_data, batch_size=BATCH))
    test = trainer.test(module, DataLoader(val_data, batch_size=BATCH))
    predictions = trainer.predict(module, DataLoader(val_data, batch_size=BATCH))
    reference = Net()
    reference.load_state_dict({k.removeprefix("model."): v for k, v in params.items()})
    with torch.no_grad():
        want = reference(val_data.x)
        want_loss = F.mse_loss(want, val_data.y).item()
    got_val = gather_objects(val[0]["val_loss"])
    got_test = gather_objects(test[0]["test_loss"])
    prediction_diffs = []
    for batch in predictions:  # this rank's share of the samples, with their indices
        prediction_diffs.append((batch["prediction"] - want[batch["index"]]).abs().max().item())
    covered = gather_objects(sorted(i for batch in predictions for i in batch["index"].tolist()))
    return {
        "val_loss_diff": max(abs(v - want_loss) for v in got_val),
        "test_loss_diff": max(abs(v - want_loss) for v in got_test),
        "prediction_diff": max(gather_objects(max(prediction_diffs))),
        "predicted_samples": [len(c) for c in covered],
        "dataset": len(val_data),
    }


def bf16_case() -> dict:
    """bf16-mixed: the same run as a single process computing in bf16 with fp32 master weights (FSDP's policy:
    parameters cast to bf16 per unit, the head's output in fp32, gradients accumulated and applied in fp32)."""
    data = RegressionData()
    trainer = trainer_for(pipeline_strategy(), precision="bf16-mixed")
    trainer.fit(ParityModule(), loader(data, BATCH))
    got = whole_model(trainer)
    torch.manual_seed(0)
    master = Net()
    opt = make_optimizer("sgd", master.parameters())
    for x, y in global_batches(data, data_parallel(), BATCH, STEPS):
        opt.zero_grad()
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for xm, ym in zip(x.chunk(PIPELINE), y.chunk(PIPELINE)):  # the default microbatches: one per stage
            compute = Net()
            compute.load_state_dict(master.state_dict())
            compute.to(torch.bfloat16)
            h = F.relu(compute.inp(xm.to(torch.bfloat16)))
            for layer in compute.layers:
                h = layer(h)
            out = compute.out(h).float()
            (F.mse_loss(out, ym) / PIPELINE).backward()
            for grad, p in zip(grads, compute.parameters()):
                grad += p.grad.float()
        for p, grad in zip(master.parameters(), grads):
            p.grad = grad
        opt.step()
    want = {f"model.{k}": v for k, v in master.state_dict().items()}
    fp32 = reference_train("sgd", global_batches(data, data_parallel(), BATCH, STEPS))
    return {
        "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "diff_to_fp32": max((got[k] - fp32[k]).abs().max().item() for k in want),
        "dtypes": sorted({str(v.dtype) for v in got.values()}),
    }


def meta_init_case() -> dict:
    """No rank allocates another stage's parameters: its initialisers fill exactly its own stage's elements."""
    CountingLinear.filled = 0
    module = MetaInitModule()
    trainer = trainer_for(pipeline_strategy(), max_steps=1)
    trainer.fit(module, loader(RegressionData(), BATCH))
    stage_size = sum(p.full_tensor().numel() for p in module.parameters())  # DTensors: FSDP shards of this stage
    return {
        "filled": gather_objects(CountingLinear.filled),
        "stage_size": gather_objects(stage_size),
        "total": sum(p.numel() for p in Net(depth=4).parameters()),
        "remote_units": gather_objects([n for n, m in module.named_modules() if isinstance(m, RemoteUnit)]),
        "meta_left": gather_objects([n for n, p in module.named_parameters() if p.is_meta]),
    }


def metrics_case() -> dict:
    """Logged metric objects: every rank logs the value over the whole validation set."""
    module = MetricModule()
    trainer = trainer_for(pipeline_strategy(), max_steps=2)
    val_data = IndexedData(n=16, seed=7)
    trainer.fit(module, DataLoader(IndexedData(), batch_size=BATCH))
    params = whole_model(trainer)
    train_mse = float(trainer.callback_metrics["train_mse"])  # the last step's, logged on every rank
    result = trainer.validate(module, DataLoader(val_data, batch_size=BATCH))[0]
    reference = Net()
    reference.load_state_dict({k.removeprefix("model."): v for k, v in params.items()})
    with torch.no_grad():
        want = F.mse_loss(reference(val_data.x), val_data.y).item()
    return {
        "mse_diff": max(abs(v - want) for v in gather_objects(result["val_mse"])),
        "samples": gather_objects(result["val_samples"]),
        "train_mse": gather_objects(train_mse),
        "dataset": len(val_data),
    }


def group_metrics() -> Iterator[Case]:
    yield Case("pp_metrics", metrics_case)


def compile_and_checkpointing_case() -> dict:
    """Activation checkpointing and `torch.compile` per block, within each stage: parity, and what each rank did."""
    recorder = ApplicationRecorder()
    result = parity("1F1B", 1, 2, "sgd", activation_checkpointing=True, compile=True, callbacks=[recorder])
    return {
        **result,
        "compiled": gather_objects(recorder.compiled),
        "checkpointed": gather_objects(recorder.checkpointed),
    }


def group_features() -> Iterator[Case]:
    yield Case("pp_compile_and_checkpointing", compile_and_checkpointing_case, timeout_s=600)
    yield Case("pp_evaluation", evaluation_case)
    yield Case("pp_bf16", bf16_case)
    yield Case("pp_meta_init", meta_init_case)
    yield Case("pp_sampler", sampler_case)


# ---------------------------------------------------------------------- errors before any collective
def summed_log_case() -> list:
    module = SummedLogModule()
    trainer = trainer_for(pipeline_strategy(), max_steps=1)
    trainer.fit(module, loader(RegressionData(), BATCH))
    return gather_objects(float(trainer.callback_metrics["samples"]))


def group_errors() -> Iterator[Case]:
    world = world_size()
    yield Case("pp_step_returns_none", lambda: expect_error(pipeline_strategy, SkippingModule()))
    yield Case("pp_reused_layer", lambda: expect_error(pipeline_strategy, ReusedLayerModule()))
    yield Case("pp_summed_log", summed_log_case)
    yield Case(
        "pp_not_dividing_world", lambda: expect_error(lambda: FullyShardStrategy(pipeline_parallel_size=world + 1))
    )
    yield Case(
        "pp_too_few_microbatches",
        lambda: expect_error(lambda: FullyShardStrategy(pipeline_parallel_size=2, pipeline_microbatches=1)),
    )
    yield Case(
        "pp_split_names_no_module",
        lambda: expect_error(lambda: FullyShardStrategy(pipeline_parallel_size=2, pipeline_split=["model.layers.9"])),
    )
    yield Case(
        "pp_empty_stage",
        lambda: expect_error(
            lambda: FullyShardStrategy(
                pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=2
            )
        ),
    )
    yield Case(
        "pp_batch_not_divisible",
        lambda: expect_error(lambda: FullyShardStrategy(pipeline_parallel_size=2), batch_size=3),
    )


# ---------------------------------------------------------------------- checkpoints across PP and FSDP


def checkpoint_save_case() -> dict:
    """PP 2 x FSDP 2 (4 ranks): save after 2 steps, train on to 4; keep the full state at 4 to compare with."""
    callback = ModelCheckpoint(dirpath=case_dir("pp_save"), filename="{step}", every_n_train_steps=2, save_top_k=-1)
    module = CheckpointModule()
    trainer = trainer_for(pipeline_strategy(), max_steps=4, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, DataLoader(IndexedData(), batch_size=BATCH))
    state = {**whole_model(trainer), **whole_optimizer(trainer)}
    seen = gather_objects(module.seen)
    if trainer.global_rank == 0:
        torch.save({"state": state, "seen": seen}, case_dir("pp_save") / "step4.reference.pt")
    return {"keys": len(state)}


def resume_fsdp_case() -> dict:
    """`dpar_fsdp` on 2 ranks resumes the PP 2 x FSDP 2 checkpoint of step 2 (same data-parallel size) and trains
    to step 4: model, optimizer and the samples seen match the uninterrupted pipelined run."""
    module = CheckpointModule()
    callback = ModelCheckpoint(dirpath=case_dir("pp_resume_fsdp"), filename="{step}", save_top_k=-1)
    trainer = trainer_for(FullyShardStrategy(), max_steps=4, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, DataLoader(IndexedData(), batch_size=BATCH), ckpt_path=str(saved_by("pp_save", "step=2.ckpt")))
    state = {**whole_model(trainer), **whole_optimizer(trainer)}
    reference = torch.load(saved_by("pp_save", "step4.reference.pt"))
    seen_after = gather_objects(module.seen)
    # The pipelined run's data-parallel rank r (ranks r and r + 2 hold its two stages) saw steps 3-4 as rank r.
    want_seen = [reference["seen"][r][2:] for r in range(2)]
    return {
        "max_diff": max_diff(state, reference["state"]),
        "keys": len(state),
        "same_samples": seen_after == want_seen,
        "global_step": trainer.global_step,
    }


def back_into_pipeline_case() -> dict:
    """PP 2 on 2 ranks loads the `dpar_fsdp` checkpoint of step 4: every stage gets exactly its part of model and
    optimizer (compared with the state that run saved), and training continues."""
    module = CheckpointModule()
    trainer = trainer_for(pipeline_strategy(), max_steps=4)
    trainer.fit(
        module,
        DataLoader(IndexedData(), batch_size=BATCH),
        ckpt_path=str(saved_by("pp_resume_fsdp", "step=4.ckpt")),
    )
    state = {**whole_model(trainer), **whole_optimizer(trainer)}
    reference = torch.load(saved_by("pp_save", "step4.reference.pt"))["state"]
    continued = trainer_for(pipeline_strategy(), max_steps=6)
    continued.fit(
        CheckpointModule(),
        DataLoader(IndexedData(), batch_size=BATCH),
        ckpt_path=str(saved_by("pp_resume_fsdp", "step=4.ckpt")),
    )
    return {"max_diff": max_diff(state, reference), "keys": len(state), "continued_to": continued.global_step}


def consolidate_case() -> dict:
    """The pipelined checkpoint consolidates (one process) into the unsplit model's exact state dict."""
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    if dist.get_rank() != 0:
        return None
    out = case_dir("pp_consolidate") / "model.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    code = consolidate([str(saved_by("pp_save", "step=4.ckpt")), str(out)])
    exported = torch.load(out, weights_only=True)
    model = exported.get("state_dict", exported)
    reference = torch.load(saved_by("pp_save", "step4.reference.pt"))["state"]
    want = {k: v for k, v in reference.items() if k.startswith("model.")}
    return {"code": code, "max_diff": max_diff({k: model[k] for k in want if k in model}, want), "keys": sorted(model)}


GROUPS = {
    "pipeline_parity": group_parity,
    "pipeline_features": group_features,
    "pipeline_errors": group_errors,
    "pipeline_metrics": group_metrics,
    "pipeline_checkpoint_save": lambda: [Case("pp_save", checkpoint_save_case)],
    "pipeline_checkpoint_resume": lambda: [
        Case("pp_resume_fsdp", resume_fsdp_case),
        Case("pp_back_into_pipeline", back_into_pipeline_case),
        Case("pp_consolidate", consolidate_case),
    ],
}
