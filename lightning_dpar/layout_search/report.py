"""The layout search rendered: the ranked table, the layouts that do not fit and by how much, the rejected ones
with the reason, and the choice with its two runners-up and why (what `plan --auto` and `AutoParallelStrategy`
print)."""

from __future__ import annotations

from lightning_dpar.helpers import format_bytes
from lightning_dpar.layout_search.candidates import checkpointing_name
from lightning_dpar.layout_search.cost import Estimate
from lightning_dpar.layout_search.search import SearchResult

__all__ = ["render_choice", "render_search"]

_HEADER = (
    "#",
    "mesh",
    "pipeline",
    "AC",
    "params",
    "grads",
    "optim",
    "activ*",
    "buffers",
    "runtime",
    "peak/rank",
    "compute",
    "exposed comm",
    "bubble",
    "overhead",
    "step",
    "samples/s",
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _header(loss_parallel: bool) -> tuple[str, ...]:
    """The table's columns; `LP` (loss parallel) only when the search was allowed it."""
    return (*_HEADER[:4], "LP", *_HEADER[4:]) if loss_parallel else _HEADER


def _row(index: int | str, e: Estimate, loss_parallel: bool = False) -> tuple[str, ...]:
    m, t = e.memory, e.time
    lp = ("yes" if e.layout.loss_parallel else "-",) if loss_parallel else ()
    return (
        str(index),
        e.layout.mesh(),
        e.layout.pipeline(),
        checkpointing_name(e.layout.activation_checkpointing),
        *lp,
        format_bytes(m.parameters),
        format_bytes(m.gradients),
        format_bytes(m.optimizer),
        format_bytes(m.activations),
        format_bytes(m.buffers),
        format_bytes(m.runtime),
        format_bytes(m.total),
        _ms(t.compute),
        _ms(t.exposed_communication),
        _ms(t.bubble),
        _ms(t.overhead),
        _ms(t.total),
        f"{e.samples_per_step / t.total:.1f}",
    )


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def why(best: Estimate, other: Estimate) -> str:
    """Why `best` beats `other`: the largest of the step-time differences per sample, in words."""
    b, o = best.time, other.time
    per_b, per_o = best.samples_per_step, other.samples_per_step
    parts = {
        "compute": o.compute / per_o - b.compute / per_b,
        "exposed communication": o.exposed_communication / per_o - b.exposed_communication / per_b,
        "pipeline bubble": o.bubble / per_o - b.bubble / per_b,
    }
    term, gap = max(parts.items(), key=lambda item: item[1])
    slower = other.seconds_per_sample / best.seconds_per_sample - 1
    return f"{slower:.0%} slower per sample, mostly {term} (+{gap * 1e3:.3f} ms per sample)"


def render_choice(result: SearchResult) -> str:
    """The chosen layout, and the two runners-up with why each loses (or why nothing was chosen)."""
    if result.best is None:
        return f"No layout of {result.world_size} ranks fits {format_bytes(result.profile.device_memory)} per device."
    best = result.best
    lines = [
        f"Chosen layout for {result.world_size} ranks (profile {result.profile.name}): {best.layout.describe()}:"
        f" step {_ms(best.time.total)}, {best.samples_per_step / best.time.total:.1f} samples/s,"
        f" peak {format_bytes(best.memory.total)} per rank of {format_bytes(result.profile.device_memory)}"
    ]
    for index, other in enumerate(result.ranked[1:3], start=2):
        lines.append(f"  runner-up {index}: {other.layout.describe()}: {why(best, other)}")
    return "\n".join(lines)


def _activations_note(estimates: list[Estimate]) -> str:
    traced = sum(e.memory.activations_traced for e in estimates)
    if traced == len(estimates):
        return (
            "  * activations: one training step traced on fake tensors per layout, its tensor-parallel styles,"
            " stages, schedule and checkpointing applied (lightning_dpar.estimates.activations)"
        )
    return (
        f"  * activations: a formula (lightning_dpar.estimates.activation_formula) for {len(estimates) - traced} of"
        f" {len(estimates)} layouts, whose training step could not be traced on fake tensors (the dry run's"
        " `--batch-size`/`--seq-len` report says why)"
    )


def _batch(result: SearchResult) -> str:
    f = result.facts
    if result.batch is None:
        return f"{f.batch_size} sequences of {f.seq_len} tokens per data-parallel rank"
    return f"{result.batch.describe()}, of {f.seq_len} tokens each"


def _features(result: SearchResult) -> list[str]:
    """What the search was told to price beyond the layouts: loss parallel, float8."""
    f, p = result.facts, result.profile
    lines = []
    if result.loss_parallel:
        lines.append(
            "Loss parallel: on every layout with tensor parallelism and without pipeline or context parallelism"
            " (LP): the logits, their log-probabilities and gradients counted as each rank's vocabulary shard"
        )
    if result.float8 is not None and p.float8_matmul_flops is not None:
        share = f.float8_flops_per_token() / f.flops_per_token() if f.flops_per_token() else 0.0
        lines.append(
            f"float8 ({result.float8}): {f.float8_params:,} weights' matmuls ({share:.0%} of the step's matmul FLOPs)"
            f" at {p.float8_matmul_flops / 1e12:.3g} TFLOP/s, the rest at {p.matmul_flops / 1e12:.3g}; the matmuls"
            " alone (torchao measures +25% tensorwise, +10% rowwise end-to-end on H100)"
        )
    return lines


def render_search(result: SearchResult, top: int | None = None) -> str:
    """The whole search as text: choice, ranked table (the first `top` rows), what does not fit, what was rejected."""
    f, p = result.facts, result.profile
    moe = f", {f.experts} experts (top {f.experts_per_token})" if f.experts else ""
    lines = [
        f"Layout search: {f.params:,} parameters ({f.active_params:,} active per token){moe}, {f.layers} layers,"
        f" width {f.hidden}; {_batch(result)}",
        f"World: {result.world_size} ranks on {result.num_nodes} node(s); profile {p.name}:"
        f" {p.matmul_flops / 1e12:.3g} TFLOP/s sustained, {format_bytes(p.device_memory)} per device,"
        f" {p.intra_node.bandwidth / 1e9:.3g} GB/s within a node, {p.inter_node.bandwidth / 1e9:.3g} GB/s across",
        *_features(result),
        "",
        render_choice(result),
        "",
    ]
    shown = result.ranked if top is None else result.ranked[:top]
    if shown:
        lines.append(f"Layouts that fit, fastest per sample first ({len(result.ranked)}):")
        lp = result.loss_parallel
        lines += _table([_header(lp), *(_row(i, e, lp) for i, e in enumerate(shown, start=1))])
        if len(shown) < len(result.ranked):
            lines.append(f"  ... {len(result.ranked) - len(shown)} more (--top to show them)")
        lines.append(_activations_note(result.ranked))
        lines.append("")
    if result.too_big:
        lines.append(f"Layouts that do not fit {format_bytes(p.device_memory)} per device ({len(result.too_big)}):")
        for e in result.too_big[: top or None]:
            lines.append(
                f"  {e.layout.describe()}: does not fit by {format_bytes(result.over_by(e))}"
                f" (peak {format_bytes(e.memory.total)})"
            )
        lines.append("")
    if result.rejected:
        lines.append(f"Rejected ({len(result.rejected)}):")
        lines += [f"  {r.what}: {r.reason}" for r in result.rejected]
        lines.append("")
    if result.best is None and result.suggestion is not None:
        lines.append(f"Nothing fits. {result.suggestion.describe()}.")
    return "\n".join(lines).rstrip() + "\n"
