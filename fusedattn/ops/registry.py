"""Backend registry and selection: explicit, ordered, and explained."""

from __future__ import annotations

import dataclasses

from fusedattn.ops import context_parallel, masked_values
from fusedattn.ops.backends import cudnn, decode, flash, small_seq, xla
from fusedattn.ops.backends.base import Backend, CallShapes, current_platform  # noqa: F401
from fusedattn.ops.enums import BackendName
from fusedattn.ops.spec import AttentionSpec

# "auto" takes the first of these that supports the call, unless a later one that supports
# it states a rule for taking it ahead (its `auto_preference`, measured: explain prints it).
BACKENDS: dict[str, Backend] = {
    b.name: b for b in (small_seq.BACKEND, decode.BACKEND, cudnn.BACKEND, flash.BACKEND,
                        xla.BACKEND)
}


def verdict(name: str, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
    """None when backend `name` would serve the call under this config, else why not.

    Paged layouts go only to backends with a paged path (`serves_paged`, served by
    their `paged_attention(spec, paged.PagedArgs, scale)`), FP8 calls only to backends
    with an FP8 path (`serves_fp8`, served by `fp8_attention(spec, args, scale, state)`).
    """
    if spec.qkv_layout.is_paged and not getattr(BACKENDS[name], "serves_paged", False):
        return (f"{name}: no paged KV cache path (layout {str(spec.qkv_layout)!r}); use "
                "backend 'auto', 'decode' (decoding, up to 8 queries per sequence) or 'xla'")
    if spec.fp8_enabled and not getattr(BACKENDS[name], "serves_fp8", False):
        return (f"{name}: no FP8 path yet (config.fp8.enabled); backend 'xla' emulates the FP8 "
                "recipe exactly (fusedattn.ops.fp8)")
    if (name == BackendName.SMALL_SEQ and spec.backend == BackendName.AUTO
            and not spec.small_seq_enabled):
        return ("small_seq: not opted in; set config.small_seq.enabled = True (with "
                "config.sequence.max_seqlen_q = 1 and max_seqlen_kv <= 16) to use it under 'auto'")
    if spec.context_axis is not None:
        reason = context_parallel.verdict(name, spec, shapes)
        if reason is not None:
            return reason
    return BACKENDS[name].supports(spec, shapes, platform)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which backend a call gets, and every backend's verdict (None = can serve)."""

    backend: str | None
    verdicts: dict[str, str | None]
    requested: str
    # Which kernels a serving backend runs for the call, where it has several (its `kernel`).
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)
    # config.guard_masked_values for the chosen backend (masked_values.explain_line): whether
    # the guard wraps the call and its cost, or why it is not needed; None: nothing to say.
    guard: str | None = None
    # Under "auto": the rule that took the chosen backend ahead of the first one that serves
    # the call (its auto_preference); None when auto took the first.
    preference: str | None = None

    def __str__(self) -> str:
        width = max(map(len, self.verdicts))
        lines = [f"requested backend: {self.requested}; chosen: {self.backend or 'none'}"]
        for name, reason in self.verdicts.items():
            mark = "->" if name == self.backend else "  "
            text = reason if reason is not None else (
                f"ok ({self.kernels[name]})" if name in self.kernels else "ok")
            lines.append(f"{mark} {name:<{width}}  {text}")
        if self.preference is not None:
            lines.append(self.preference)
        if self.guard is not None:
            lines.append(self.guard)
        return "\n".join(lines)


def explain_spec(spec: AttentionSpec, shapes: CallShapes, platform: str) -> Explanation:
    verdicts = {name: verdict(name, spec, shapes, platform) for name in BACKENDS}
    preference = None
    if spec.backend == BackendName.AUTO:
        serving = [name for name, reason in verdicts.items() if reason is None]
        chosen = serving[0] if serving else None
        for name in serving[1:]:
            rule = getattr(BACKENDS[name], "auto_preference", None)
            preference = rule(spec, shapes, platform) if rule is not None else None
            if preference is not None:
                chosen = name
                break
    else:
        chosen = str(spec.backend) if verdicts[str(spec.backend)] is None else None
    kernels = {}
    for name, reason in verdicts.items():
        # FP8 calls: the backend's `fp8_kernel`, where it has one.
        describe = getattr(BACKENDS[name], "fp8_kernel" if spec.fp8_enabled else "kernel", None)
        text = (describe(spec, shapes, platform) if reason is None and describe is not None
                else None)
        if text is not None:
            kernels[name] = text
    guard = (None if chosen is None
             else masked_values.explain_line(spec, BACKENDS[chosen], platform))
    return Explanation(backend=chosen, verdicts=verdicts, requested=str(spec.backend),
                       kernels=kernels, guard=guard, preference=preference)


def select(spec: AttentionSpec, shapes: CallShapes, platform: str) -> Backend:
    """The backend that serves the call; ValueError with the reason when none can."""
    explanation = explain_spec(spec, shapes, platform)
    if explanation.backend is None:
        raise ValueError(
            f"config.backend={str(spec.backend)!r} cannot serve this call: "
            f"{explanation.verdicts.get(str(spec.backend)) or explanation}. "
            "Use backend='auto' (or 'xla', which serves every call), or change the call."
        )
    return BACKENDS[explanation.backend]
