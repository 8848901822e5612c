"""Does speculation pay on this machine, with this file, and at which draft length?

:func:`run_bench` (``pyggspec bench``) answers it on the user's own model and device:
plain decoding against speculation with the default draft-length rule and with each fixed
draft length, **paired request by request** inside one process. Why paired: on shared
machines the speed of one engine drifts 10-25% between minutes, so a ratio is taken only
between runs made next to each other (each repetition runs every setting once, the order
reversed every other repetition), and the ratio reported is the median of the
per-repetition ratios with their range.

It uses the engine exactly as ``pyggspec run`` does (:class:`~pyggspec.engine.Engine`,
greedy requests through its scheduler), three engines at once: plain (``--spec-type
none``), the default (the given speculation settings: the draft-length rule up to
``n_max``) and fixed lengths (``--spec-draft-fixed`` with the cap at the longest length
asked; each fixed length n is a request capped at n drafts, ``Request.n_draft_max``).
Loading three engines holds the weights three times where they are copied (repacked CPU
weights, device memory): the report says what each engine allocated.

Nothing here is a verdict written in advance: ``pays`` is read from the measured ratios.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyggspec.config import EngineConfig
from pyggspec.errors import PyggspecError

# what counts as a gain or a loss rather than noise: the median ratio beyond +-2%
# (two engines identical in all but name read 0.98-1.02 apart taking turns like this)
NOISE = 0.02

DEFAULT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a hash table handles collisions.",
    "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    "List five facts about the Moon, one per line.",
)

Progress = Callable[[int, int, str], None]  # (done, total, what runs now)


@dataclass
class SettingResult:
    """One setting's measurements: per repetition decode and prefill tokens/s, and
    (speculative settings) the speculation counts summed over its requests."""

    name: str  # "plain", "default", "n=1" ...
    n_max: int | None  # the draft cap (None: plain); for "default" the rule's cap
    decode_tps: list[float] = field(default_factory=list)
    prefill_tps: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)  # decode tokens/s / plain's, per rep
    spec: dict[str, Any] | None = None  # SpecStats.to_dict() summed over the reps
    tokens: list[list[int]] | None = None  # the last repetition's outputs

    def summary(self) -> dict[str, Any]:
        """Medians with (min, max) spreads; the speculation counts."""
        d: dict[str, Any] = {"name": self.name, "n_max": self.n_max,
                             "decode_tps": _med(self.decode_tps),
                             "decode_tps_range": _rng(self.decode_tps),
                             "prefill_tps": _med(self.prefill_tps),
                             "prefill_tps_range": _rng(self.prefill_tps)}
        if self.ratio:
            d["vs_plain"] = _med(self.ratio, 4)
            d["vs_plain_range"] = _rng(self.ratio, 4)
        if self.spec is not None:
            d["acceptance"] = round(self.spec["acceptance"], 4)
            d["per_position"] = [round(x, 4) for x in self.spec["per_position"]]
            d["mean_accepted_length"] = round(self.spec["mean_accepted_length"], 3)
            d["draft_lengths"] = self.spec["draft_lengths"]
        return d


@dataclass
class BenchReport:
    """What :func:`run_bench` measured. ``settings``: plain first, then the default, then
    each fixed length; ``to_dict()`` is ``pyggspec bench --json``."""

    model: str
    device: str
    n_parallel: int
    n_predict: int
    n_prompt: list[int]
    reps: int
    settings: list[SettingResult]
    memory: dict[str, dict[str, int]]  # engine -> component (and total) -> bytes
    default_rule: dict[str, Any] | None  # DraftLengths.to_dict() of the default engine
    identical: bool  # every speculative setting emitted plain decoding's tokens
    seconds: float

    def setting(self, name: str) -> SettingResult:
        """The setting called ``name`` (``plain``, ``default``, ``n=1`` ...)."""
        return next(s for s in self.settings if s.name == name)

    @property
    def best(self) -> SettingResult:
        """The setting with the highest median paired ratio to plain decoding (plain: 1).
        Paired ratios, not median tokens/s: the machine's drift between repetitions
        cancels in them."""
        return max(self.settings, key=lambda s: _med(s.ratio, 4) if s.ratio else 1.0)

    @property
    def default_choice(self) -> dict[int, int]:
        """How often the default drafted each length (verify steps by length; 0: declined)."""
        spec = self.setting("default").spec or {}
        return {k: n for k, n in enumerate(spec.get("draft_lengths", [])) if n}

    @property
    def verdict(self) -> str:
        """``pays`` / ``does not pay`` / ``breaks even``, from the default's median ratio
        against plain decoding (beyond :data:`NOISE`), the default being what
        ``--spec-type`` gives without further flags."""
        r = _med(self.setting("default").ratio, 4)
        if r >= 1 + NOISE:
            return "pays"
        if r <= 1 - NOISE:
            return "does not pay"
        return "breaks even"

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"model": self.model, "device": self.device, "n_parallel": self.n_parallel,
                "n_predict": self.n_predict, "n_prompt": self.n_prompt, "reps": self.reps,
                "settings": [s.summary() for s in self.settings],
                "best": best.name, "default_choice": self.default_choice,
                "default_rule": self.default_rule, "verdict": self.verdict,
                "identical_outputs": self.identical, "memory": self.memory,
                "seconds": round(self.seconds, 1)}

    def json(self) -> str:
        """:meth:`to_dict` as one line of JSON."""
        return json.dumps(self.to_dict())

    def lines(self) -> list[str]:
        """The table and verdict ``pyggspec bench`` prints (:func:`render`)."""
        return render(self)


def _med(xs: Sequence[float], nd: int = 2) -> float:
    return round(statistics.median(xs), nd) if xs else 0.0


def _rng(xs: Sequence[float], nd: int = 2) -> list[float]:
    return [round(min(xs), nd), round(max(xs), nd)] if xs else []


def bench_prompts(engine: Any, n_parallel: int, prompts: Sequence[str] | None,
                  n_prompt: int) -> list[list[int]]:
    """One prompt per sequence as token ids: ``prompts`` (or the built-in ones) tokenized
    and cut to ``n_prompt`` tokens; without a tokenizer, seeded ids from the lower part of
    the vocabulary (as the project's benchmark scripts use)."""
    texts = list(prompts) if prompts else list(DEFAULT_PROMPTS)
    if engine.tokenizer is not None:
        out = [engine.tokenize(texts[i % len(texts)])[:n_prompt] for i in range(n_parallel)]
        if all(len(p) >= 2 for p in out):
            return out
    import numpy as np

    hi = max(32, min(5000, engine.n_vocab))
    return [[int(t) for t in np.random.default_rng(i).integers(hi // 16, hi, size=n_prompt)]
            for i in range(n_parallel)]


def timed_run(engine: Any, prompts: list[list[int]], n_predict: int,
             n_draft_max: int | None, speculative: bool) -> tuple[float, float, Any, list]:
    """The prompts as greedy requests (one per slot, no prompt reuse so every run
    evaluates its prompt), run to the end: decode tokens/s, prefill tokens/s, the summed
    speculation counts (or None) and the outputs."""
    from pyggspec.serving.request import Request
    from pyggspec.speculative.stats import SpecStats

    t0 = time.perf_counter()
    handles = [engine.submit(Request(list(p), max_tokens=n_predict, ignore_eos=True,
                                     cache_prompt=False, slot=i, n_draft_max=n_draft_max,
                                     speculative=None if speculative else False))
               for i, p in enumerate(prompts)]
    results = [h.result() for h in handles]
    wall_ms = (time.perf_counter() - t0) * 1000
    prompt_ms = max(r.timings.prompt_ms for r in results)
    n_prompt = sum(r.timings.prompt_n for r in results)
    n_out = sum(r.timings.predicted_n for r in results)
    decode_ms = max(wall_ms - prompt_ms, 1e-6)  # as Engine.generate_batch times a batch
    stats = None
    for r in results:
        if r.spec is not None:
            stats = stats or SpecStats()
            stats.merge(r.spec)
    return (n_out * 1000 / decode_ms, n_prompt * 1000 / max(prompt_ms, 1e-6), stats,
            [r.tokens for r in results])


def _components(mem: dict[str, Any]) -> dict[str, int]:
    """``Engine.memory()`` summed over devices per component, plus ``total``."""
    out = {comp: sum(v.values()) for comp, v in mem.items()
           if isinstance(v, dict) and comp != "by_device"}
    out["total"] = int(mem.get("total_bytes", sum(out.values())))
    return out


def _total(mem: dict[str, int]) -> int:
    return mem["total"]


def run_bench(model: str | Path, config: EngineConfig | None = None, *,
              reps: int = 5, n_predict: int = 128, n_prompt: int = 64,
              fixed: Sequence[int] = (1, 2, 3, 4), prompts: Sequence[str] | None = None,
              progress: Progress | None = None,
              log: Callable[[str], None] | None = None) -> BenchReport:
    """Measure plain decoding against speculation on ``model`` (see the module docstring).

    ``config``: the engine settings (device placement, threads, ``n_parallel``, the
    drafter kinds in ``spec_type`` -- ``draft-mtp`` when unset -- and ``spec``: the
    default's cap and options). ``reps`` repetitions, each running every setting once on
    ``n_parallel`` greedy requests of ``n_predict`` tokens after prompts of at most
    ``n_prompt`` tokens (``prompts``: texts, cycled over the sequences; default: four
    built-in ones). ``fixed``: the fixed draft lengths to try. ``progress(done, total,
    label)`` is called around each run; ``log(line)`` gets what the bench does before the
    runs (loading, warming up, its time estimate).
    """
    from pyggspec.engine import Engine

    if reps < 1 or n_predict < 2 or n_prompt < 1:
        raise PyggspecError(None, "need reps >= 1, n_predict >= 2 and n_prompt >= 1")
    fixed = sorted({int(n) for n in fixed})
    if fixed and fixed[0] < 1:
        raise PyggspecError("--fixed", "draft lengths must be >= 1")
    cfg = config if config is not None else EngineConfig()
    if not cfg.speculative:
        cfg = cfg.replace(spec_type="draft-mtp")
    say = log or (lambda line: None)
    t_start = time.perf_counter()
    spec = cfg.spec
    configs: dict[str, EngineConfig] = {
        "plain": cfg.replace(spec_type=None),
        "default": cfg.replace(spec=dataclasses.replace(spec, adaptive=None)),
    }
    if fixed:
        configs["fixed"] = cfg.replace(spec=dataclasses.replace(spec, adaptive=False,
                                                                n_max=max(fixed)))
    engines: dict[str, Any] = {}
    try:
        for name, c in configs.items():
            say(f"loading the {name} engine")
            engines[name] = Engine(model, config=c)
        plain = engines["plain"]
        ps = bench_prompts(plain, cfg.n_parallel, prompts, n_prompt)
        # every setting: (label, engine, n_draft_max, speculative)
        runs: list[tuple[str, Any, int | None, bool]] = [
            ("plain", plain, None, False), ("default", engines["default"], None, True)]
        runs += [(f"n={n}", engines["fixed"], n, True) for n in fixed]
        say(f"warming up: every setting once, untimed ({len(runs)} runs; graphs are built "
            "before anything is timed)")
        t0 = time.perf_counter()
        for _, e, nd, sp in runs:
            timed_run(e, ps, n_predict, nd, sp)
        est = (time.perf_counter() - t0) * reps
        say(f"{len(runs)} settings x {reps} repetitions x {cfg.n_parallel} sequence(s) x "
            f"{n_predict} tokens: about {_minutes(est)} more (the warm-up pass took "
            f"{_minutes(est / reps)})")
        busy = _busy()
        if busy:
            say(busy)
        results = {label: SettingResult(label, None if label == "plain" else
                                        (nd if nd is not None else spec.n_max))
                   for label, _, nd, _ in runs}
        sums: dict[str, Any] = {}
        total, done = reps * len(runs), 0
        for rep in range(reps):
            order = runs if rep % 2 == 0 else runs[::-1]
            got: dict[str, float] = {}
            for label, e, nd, sp in order:
                if progress is not None:
                    progress(done, total, f"rep {rep + 1}/{reps} {label}")
                dec, pre, stats, toks = timed_run(e, ps, n_predict, nd, sp)
                res = results[label]
                res.decode_tps.append(dec)
                res.prefill_tps.append(pre)
                res.tokens = toks
                got[label] = dec
                if stats is not None:
                    if label in sums:
                        sums[label].merge(stats)
                    else:
                        sums[label] = stats
                done += 1
            for label, tps in got.items():
                if label != "plain":
                    results[label].ratio.append(tps / got["plain"])
        if progress is not None:
            progress(total, total, "done")
        for label, st in sums.items():
            results[label].spec = st.to_dict()
        settings = list(results.values())
        ref = results["plain"].tokens
        identical = all(s.tokens == ref for s in settings)
        memory = {name: e.memory() for name, e in engines.items()}
        rule = engines["default"].draft_lengths
        device = _device_name(plain)
        return BenchReport(str(model), device, cfg.n_parallel, n_predict,
                           [len(p) for p in ps], reps, settings,
                           {name: _components(m) for name, m in memory.items()},
                           rule.to_dict() if rule is not None else None, identical,
                           time.perf_counter() - t_start)
    finally:
        for e in engines.values():
            e.close()


def _busy() -> str | None:
    """A warning when other work already keeps the CPUs busy (the 1-minute load average
    above the core count): the paired ratios hold up better than absolute speeds, but
    their ranges widen."""
    import os

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None
    cores = os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"the machine is busy (load {load:.1f} on {cores} cores): expect wide ranges; "
            "run again on a quieter machine for a firm verdict")


def _device_name(engine: Any) -> str:
    """The devices holding the weights, e.g. ``CPU`` or ``CUDA0``."""
    try:
        names = sorted(engine.weights.bytes_by_device())
    except (AttributeError, TypeError):  # a report detail: never fail a measurement
        return "?"
    return ", ".join(names) or "?"


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    return f"{seconds / 60:.0f} min"


def render(report: BenchReport) -> list[str]:
    """The report as the lines ``pyggspec bench`` prints: one row per setting, then the
    verdict."""
    lines = [(f"model {Path(report.model).name} on {report.device}, {report.n_parallel} "
              f"sequence(s), {report.n_predict} tokens per request, {report.reps} paired "
              f"repetitions ({report.seconds:.0f} s)"),
             "",
             (f"{'setting':9s} {'decode t/s':>11s} {'(range)':>15s} {'vs plain':>9s} "
              f"{'(range)':>13s} {'prefill t/s':>11s}  acceptance per position")]
    for s in report.settings:
        d = s.summary()
        rng = "{:.1f}-{:.1f}".format(*d["decode_tps_range"])
        vs = f"{d['vs_plain']:.3f}" if "vs_plain" in d else "1"
        vr = "{:.3f}-{:.3f}".format(*d["vs_plain_range"]) if "vs_plain_range" in d else ""
        acc = ("[" + ", ".join(f"{x:.2f}" for x in d["per_position"]) + "]"
               if "per_position" in d else "")
        lines.append(f"{s.name:9s} {d['decode_tps']:11.2f} {rng:>15s} {vs:>9s} {vr:>13s} "
                     f"{d['prefill_tps']:11.1f}  {acc}")
    best = report.best
    choice = report.default_choice
    n_steps = sum(choice.values()) or 1
    chosen = ", ".join(f"{k}: {100 * n / n_steps:.0f}%" for k, n in sorted(choice.items()))
    dflt = report.setting("default")
    r = _med(dflt.ratio, 3)
    lines += ["",
              f"best setting: {best.name} ({_med(best.decode_tps):.2f} tokens/s"
              + (f", {_med(best.ratio, 3):.3f}x plain" if best.ratio else "") + ")",
              (f"the default (draft-length rule, cap {dflt.n_max}) drafted {{{chosen}}} "
               "(draft length: share of steps; 0 = declined)")]
    verdict = report.verdict
    if verdict == "pays":
        lines.append(f"verdict: speculation PAYS here: the default runs {r:.3f}x plain "
                     f"decoding's tokens/s (range {_rng(dflt.ratio, 3)})")
    elif verdict == "does not pay":
        lines.append(f"verdict: speculation does NOT pay here: the default runs {r:.3f}x "
                     f"plain decoding's tokens/s (range {_rng(dflt.ratio, 3)}); decode "
                     "plainly (--spec-type none)")
    else:
        lines.append(f"verdict: speculation breaks even here ({r:.3f}x plain, range "
                     f"{_rng(dflt.ratio, 3)}): within +-{NOISE:.0%}, the noise of this "
                     "measurement")
    mem = report.memory
    if "plain" in mem and "default" in mem:
        extra = _total(mem["default"]) - _total(mem["plain"])
        lines.append(f"memory: plain {_gib(_total(mem['plain']))}, with speculation "
                     f"{_gib(_total(mem['default']))} (+{_gib(extra)}: MTP head cache, "
                     "graphs, rollback state)")
    if not report.identical:
        lines.append("WARNING: a speculative setting emitted other tokens than plain "
                     "decoding (please report it)")
    return lines


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def plot(report: BenchReport, path: str | Path) -> None:
    """Decode tokens/s against draft length (0: plain decoding), with each setting's
    range, the default drawn as a line: matplotlib (``pip install pyggspec[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PyggspecError("--plot", "needs matplotlib (pip install 'pyggspec[plot]' or "
                            "pip install matplotlib)") from None
    pts = [(0 if s.name == "plain" else int(s.name[2:]), s) for s in report.settings
           if s.name != "default"]
    xs = [x for x, _ in pts]
    ys = [_med(s.decode_tps) for _, s in pts]
    lo = [y - min(s.decode_tps) for y, (_, s) in zip(ys, pts)]
    hi = [max(s.decode_tps) - y for y, (_, s) in zip(ys, pts)]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=4, label="fixed draft length")
    ax.plot([0], [ys[0]], "s", color="black", markersize=9, label="plain decoding")
    d = report.setting("default")
    ax.axhline(_med(d.decode_tps), color="tab:green", linestyle="--",
               label=f"default (rule, cap {d.n_max})")
    ax.set_xticks(xs)
    ax.set_xlabel("draft length per step (0 = plain decoding)")
    ax.set_ylabel("decode tokens/s (median, range)")
    ax.set_title(f"{Path(report.model).name}: {report.verdict}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["NOISE", "BenchReport", "SettingResult", "plot", "render", "run_bench", "timed_run"]
