"""``--fit``: the placement and context that fit each offload device's free memory.

A pure function of what each movable part of an engine costs (:class:`FitNeeds`, built from
the memory plan by :mod:`pyggspec.memory.autofit`: :func:`pyggspec.memory.plan.layer_states`
per block, :func:`pyggspec.weights.placement.layer_weights` per block, compute buffers as
ggml sizes them) and of each device's free memory less its margin (``-fitt``). Only what the
user left unset changes, in llama.cpp's order (``common/fit.cpp``):

1. everything on the devices at the asked context, if that fits;
2. an unset context (``-c 0``: the training context) cut to the largest multiple of 256
   that fits, never below ``-fitc`` (a smaller context costs no speed; moved weights do);
3. MoE expert weights moved to the CPU block by block from the first (``-ncmoe N``);
4. whole layers moved to the CPU from the first (``-ngl``): the output layer and the MTP
   block, which llama.cpp's ``-ngl`` counts last, stay on their device longest; at each
   layer count as few experts as then fit stay on the CPU.

Layers are split over several offload devices as the placement splits them (equal shares).
Host memory is taken as unlimited (as llama.cpp does). A device that ends up holding nothing
needs nothing, so ``-ngl 0`` always fits unless the user pinned tensors to a device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pyggspec.errors import PyggspecError
from pyggspec.weights.placement import CPU, layer_devices

MiB = 1 << 20
CTX_ALIGN = 256  # llama.cpp rounds a cut context down to this


class FitError(PyggspecError):
    """Nothing the fit may change makes the engine fit: one line naming the device."""


@dataclass(frozen=True)
class FitNeeds:
    """Bytes of an engine's parts at one context, by what a fit can move."""

    dense: tuple[int, ...]  # per block (MTP blocks included): weights that move with it
    experts: tuple[int, ...]  # per block: MoE expert weights (-ncmoe moves them)
    states: tuple[int, ...]  # per block: its caches and states (the MTP block: the head's KV)
    output: int  # the output layer's weights (on the output device)
    pinned: Mapping[str, int] = field(default_factory=dict)  # device -> -ot pinned weights
    compute: Mapping[str, int] = field(default_factory=dict)  # device -> compute buffers


@dataclass(frozen=True)
class FitDevice:
    """An offload device: free bytes as it reports them, and the margin to leave."""

    name: str
    free: int
    margin: int

    @property
    def budget(self) -> int:
        return self.free - self.margin


@dataclass(frozen=True)
class FitRequest:
    """What the user set (fixed) and left to the fit (None / ``ctx_free``)."""

    n_ctx: int  # the context asked; with ctx_free the most (the training context)
    ctx_free: bool = False  # -c 0: cut to what fits, down to fit_ctx
    fit_ctx: int = 4096
    n_gpu_layers: int | None = None  # None: the fit chooses; else the effective count
    n_cpu_moe: int | None = None  # None: the fit chooses; an int: fixed
    n_moe_blocks: int = 0  # blocks whose experts may move (the trunk's, not the MTP head's)


@dataclass(frozen=True)
class FitResult:
    """The chosen settings, where they put the layers, and the predicted use per device."""

    n_gpu_layers: int
    n_cpu_moe: int
    n_ctx: int
    layer_devices: tuple[str, ...]
    output_device: str
    used: Mapping[str, int]  # predicted bytes per offload device
    devices: tuple[FitDevice, ...]
    changed: tuple[str, ...] = ()  # the flags the fit set: "-c", "-ncmoe", "-ngl"

    @property
    def fits(self) -> bool:
        return all(not self.used.get(d.name) or self.used[d.name] <= d.budget
                   for d in self.devices)


def device_use(needs: FitNeeds, offload: Sequence[str], n_gpu_layers: int,
               n_cpu_moe: int) -> tuple[dict[str, int], tuple[str, ...], str]:
    """Bytes on each offload device with ``-ngl n_gpu_layers -ncmoe n_cpu_moe`` (the
    placement's layer rule), the device of each block and of the output layer."""
    n = len(needs.dense)
    blocks, out_dev, _ = layer_devices(n, min(n_gpu_layers, n + 1), offload)
    used = {d: 0 for d in offload}
    for il, dev in enumerate(blocks):
        if dev != CPU:
            experts = 0 if il < n_cpu_moe else needs.experts[il]
            used[dev] += needs.dense[il] + experts + needs.states[il]
    if out_dev != CPU:
        used[out_dev] += needs.output
    for dev, nbytes in needs.pinned.items():
        if dev in used:
            used[dev] += nbytes
    for dev in offload:
        if used[dev]:
            used[dev] += needs.compute.get(dev, 0)
    return used, blocks, out_dev


def place(needs: FitNeeds, devices: Sequence[FitDevice], n_gpu_layers: int, n_cpu_moe: int,
          n_ctx: int, changed: tuple[str, ...] = ()) -> FitResult:
    """The :class:`FitResult` of one candidate (``needs`` priced at ``n_ctx``)."""
    used, blocks, out_dev = device_use(needs, [d.name for d in devices], n_gpu_layers,
                                       n_cpu_moe)
    return FitResult(n_gpu_layers, n_cpu_moe, n_ctx, blocks, out_dev, used, tuple(devices),
                     changed)


def fit(needs_at: Callable[[int], FitNeeds], devices: Sequence[FitDevice],
        req: FitRequest) -> FitResult:
    """The settings that fit (see the module docstring); ``needs_at(n_ctx)`` prices the parts
    at a context. A :class:`FitError` when nothing left to the fit makes it fit."""
    offload = [d.name for d in devices]
    budget = {d.name: d.budget for d in devices}
    n_all = len(needs_at(req.n_ctx).dense)
    ngl = n_all + 1 if req.n_gpu_layers is None else min(req.n_gpu_layers, n_all + 1)
    moe_free = req.n_cpu_moe is None and req.n_moe_blocks > 0
    moe = req.n_cpu_moe or 0
    changed: list[str] = []
    cache: dict[int, FitNeeds] = {}

    def needs(c: int) -> FitNeeds:
        if c not in cache:
            cache[c] = needs_at(c)
        return cache[c]

    def over(n_ctx: int, n_gpu: int, n_moe: int) -> tuple[str, int] | None:
        used, _, _ = device_use(needs(n_ctx), offload, n_gpu, n_moe)
        worst = [(d, used[d] - budget[d]) for d in offload if used[d] and used[d] > budget[d]]
        return max(worst, key=lambda w: w[1]) if worst else None

    def done(n_ctx: int, n_gpu: int, n_moe: int) -> FitResult:
        return place(needs(n_ctx), devices, n_gpu, n_moe, n_ctx, tuple(changed))

    def least_moe(n_ctx: int, n_gpu: int) -> int | None:
        """The fewest blocks' experts on the CPU that fit (monotone: binary search)."""
        lo = max(0, min(n_all + 1 - n_gpu, req.n_moe_blocks))  # below: on the CPU anyway
        hi = req.n_moe_blocks
        if over(n_ctx, n_gpu, hi) is not None:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if over(n_ctx, n_gpu, mid) is None:
                hi = mid
            else:
                lo = mid + 1
        return lo if lo > n_all + 1 - n_gpu else 0  # no pattern needed for CPU blocks

    n_ctx = req.n_ctx
    if over(n_ctx, ngl, moe) is None:
        return done(n_ctx, ngl, moe)
    # 2. the context, when left to the fit
    low = min(req.fit_ctx, req.n_ctx)
    if req.ctx_free and req.n_ctx > low:
        changed.append("-c")
        if over(low, ngl, moe) is None:
            steps = [c for c in range(CTX_ALIGN, req.n_ctx, CTX_ALIGN) if c > low]
            lo, hi = 0, len(steps)  # steps[:lo] fit
            while lo < hi:
                mid = (lo + hi) // 2
                if over(steps[mid], ngl, moe) is None:
                    lo = mid + 1
                else:
                    hi = mid
            return done(steps[lo - 1] if lo else low, ngl, moe)
        n_ctx = low
    # 3. MoE experts, block by block
    if moe_free:
        least = least_moe(n_ctx, ngl)
        if least is not None:
            changed.append("-ncmoe")
            return done(n_ctx, ngl, least)
    # 4. whole layers, the first ones first (the output layer and the MTP block last)
    if req.n_gpu_layers is None:
        for n_gpu in range(ngl - 1, -1, -1):
            if moe_free:
                least = least_moe(n_ctx, n_gpu)
                if least is None:
                    continue
                changed.extend(["-ngl"] + (["-ncmoe"] if least else []))
                return done(n_ctx, n_gpu, least)
            if over(n_ctx, n_gpu, moe) is None:
                changed.append("-ngl")
                return done(n_ctx, n_gpu, moe)
    # nothing left to change: say what was fixed and by how much the worst device misses
    last_ngl = 0 if req.n_gpu_layers is None else ngl
    last_moe = req.n_moe_blocks if moe_free else moe
    worst = over(n_ctx, last_ngl, last_moe) or over(req.n_ctx, ngl, moe)
    assert worst is not None
    dev, short = worst
    fixed = []
    if req.n_gpu_layers is not None:
        fixed.append(f"-ngl {req.n_gpu_layers}")
    if not moe_free and req.n_moe_blocks:
        fixed.append("-ot/-cmoe/-ncmoe")
    if not req.ctx_free:
        fixed.append(f"-c {req.n_ctx} (only -c 0 is cut)")
    d = next(x for x in devices if x.name == dev)
    raise FitError("--fit", f"{dev} lacks {_mib(short)} MiB ({_mib(d.free)} MiB free, "
                   f"-fitt keeps {_mib(d.margin)} MiB) with {', '.join(fixed)}; lower those "
                   "or -fitt, or --fit off")


def parse_fit_target(value: str | Sequence[int] | int) -> tuple[int, ...]:
    """``-fitt MiB[,MiB...]`` (llama.cpp also splits on '/'): one value for every device, or
    one per offload device in order (those not named keep the 1024 MiB default)."""
    if isinstance(value, int):
        return (value,)
    if not isinstance(value, str):
        return tuple(int(v) for v in value)
    parts = [p.strip() for p in value.replace("/", ",").split(",") if p.strip()]
    try:
        out = tuple(int(p) for p in parts)
    except ValueError:
        raise PyggspecError("-fitt", f"expected MiB[,MiB...], got {value!r}") from None
    if not out or min(out) < 0:
        raise PyggspecError("-fitt", f"expected MiB values >= 0, got {value!r}")
    return out


def margins(fit_target: Sequence[int], n_devices: int) -> list[int]:
    """Bytes to leave free per device: one value broadcast, or one per device (the rest
    1024 MiB, llama.cpp's default)."""
    if len(fit_target) == 1:
        return [fit_target[0] * MiB] * n_devices
    if len(fit_target) > n_devices:
        raise PyggspecError("-fitt", f"{len(fit_target)} values for {n_devices} offload "
                            "device(s)")
    return [t * MiB for t in fit_target] + [1024 * MiB] * (n_devices - len(fit_target))


def block_ranges(blocks: Sequence[str], device: str, n_trunk: int) -> str:
    """The blocks on ``device`` as ranges ("0-11, mtp"), for the table."""
    out, start = [], None
    for il in range(n_trunk + 1):
        on = il < n_trunk and blocks[il] == device
        if on and start is None:
            start = il
        elif not on and start is not None:
            out.append(f"{start}" if start == il - 1 else f"{start}-{il - 1}")
            start = None
    if any(d == device for d in blocks[n_trunk:]):
        out.append("mtp")
    return ", ".join(out)


def format_table(rows: Sequence[Mapping[str, object]], header: str) -> str:
    """One short table: ``header``, then per device its layers, experts on the CPU and
    predicted / free / target MiB (``rows`` as :func:`pyggspec.memory.autofit.fit_rows`
    makes them)."""
    cols = ("device", "layers", "output", "predicted MiB", "free MiB", "target MiB")
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    w = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(w[i]) if i < 3 else v.rjust(w[i])
                         for i, v in enumerate(vals)).rstrip()

    return "\n".join([header, line(cols), *(line(r) for r in cells)])


def _mib(n: int) -> str:
    return f"{n / MiB:.0f}" if abs(n) >= 10 * MiB else f"{n / MiB:.1f}"


__all__ = ["CTX_ALIGN", "FitDevice", "FitError", "FitNeeds", "FitRequest", "FitResult",
           "block_ranges", "device_use", "fit", "format_table", "margins", "parse_fit_target",
           "place"]
