"""Compare the layout (and optionally the values) of two GGUF files.

Why: "our fixtures look exactly like the converter's output" must be checked field by field:
metadata keys with their GGUF value types and values, tensor names, their order, ``ne`` (with
the number of dimensions, which GGUF stores), ggml types, and tensor data. Naming and
provenance fields (``general.name``, ``general.size_label``, ...) differ legitimately and are
ignored by default.

``python -m pyggspec.testing.layout A.gguf B.gguf [--values]`` prints the differences.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ConverterCase",
    "Difference",
    "GGUFLayout",
    "KVEntry",
    "TensorLayout",
    "compare_layouts",
    "compare_values",
    "converter_vs_writer",
    "format_differences",
    "read_layout",
]

# general.* keys that carry meaning for loading; every other general.* key is provenance.
MEANINGFUL_GENERAL = frozenset(
    {"general.architecture", "general.type", "general.file_type", "general.alignment",
     "general.quantization_version"}
)
# Reader pseudo-fields: kv_count differs whenever provenance keys do.
IGNORED_PSEUDO = frozenset({"GGUF.kv_count"})


@dataclass(frozen=True)
class KVEntry:
    """One metadata entry: GGUF value type (``ARRAY[INT32]`` for arrays) and value."""

    key: str
    vtype: str
    value: Any


@dataclass(frozen=True)
class TensorLayout:
    """One tensor's header: name, ggml ``ne`` (length = stored n_dims), ggml type name."""

    name: str
    ne: tuple[int, ...]
    ggml_type: str


@dataclass
class GGUFLayout:
    """Everything about a GGUF file except the tensor data, in file order."""

    path: str
    kv: dict[str, KVEntry] = field(default_factory=dict)
    tensors: list[TensorLayout] = field(default_factory=list)

    def tensor_map(self) -> dict[str, TensorLayout]:
        return {t.name: t for t in self.tensors}


@dataclass(frozen=True)
class Difference:
    """One layout difference; ``kind`` names the category, ``a``/``b`` the two sides."""

    kind: str
    name: str
    a: Any = None
    b: Any = None
    detail: str = ""

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.kind}: {self.name}: {_short(self.a)} != {_short(self.b)}{extra}"


def _short(v: Any, n: int = 120) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _vtype(types: list[Any]) -> str:
    names = [t.name for t in types]
    if names and names[0] == "ARRAY":
        return f"ARRAY[{names[1] if len(names) > 1 else '?'}]"
    return names[0] if names else "?"


def _norm_value(vtype: str, v: Any) -> Any:
    """Hashable, exactly comparable values (floats rounded to their f32/f64 storage)."""
    if vtype.startswith("ARRAY"):
        inner = vtype[6:-1]
        return tuple(_norm_value(inner, x) for x in v)
    if vtype == "FLOAT32":
        return float(np.float32(v))
    return v


def read_layout(path: str | os.PathLike[str]) -> GGUFLayout:
    """Read metadata and tensor headers of a GGUF file (data stays mapped, unread)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    out = GGUFLayout(path=str(path))
    for key, f in r.fields.items():
        vt = _vtype(f.types)
        out.kv[key] = KVEntry(key, vt, _norm_value(vt, f.contents()))
    for t in r.tensors:
        out.tensors.append(
            TensorLayout(t.name, tuple(int(x) for x in t.shape), t.tensor_type.name))
    return out


def _ignored(key: str, ignore: Iterable[str]) -> bool:
    if key in IGNORED_PSEUDO or key in ignore:
        return True
    return key.startswith("general.") and key not in MEANINGFUL_GENERAL


def compare_layouts(
    ref: GGUFLayout,
    other: GGUFLayout,
    *,
    ignore_keys: Iterable[str] = (),
    check_tensor_order: bool = True,
    check_kv_order: bool = False,
) -> list[Difference]:
    """Differences of ``other`` against ``ref`` (a = ref, b = other)."""
    ignore = set(ignore_keys)
    diffs: list[Difference] = []
    rk = {k: v for k, v in ref.kv.items() if not _ignored(k, ignore)}
    ok = {k: v for k, v in other.kv.items() if not _ignored(k, ignore)}
    for k, e in rk.items():
        if k not in ok:
            diffs.append(Difference("kv_missing", k, e.value, None, e.vtype))
            continue
        o = ok[k]
        if o.vtype != e.vtype:
            diffs.append(Difference("kv_type", k, e.vtype, o.vtype))
        elif o.value != e.value:
            diffs.append(Difference("kv_value", k, e.value, o.value, _first_mismatch(e, o)))
    for k, o in ok.items():
        if k not in rk:
            diffs.append(Difference("kv_extra", k, None, o.value, o.vtype))
    if check_kv_order:
        common = [k for k in rk if k in ok]
        oorder = [k for k in ok if k in rk]
        if common != oorder:
            diffs.append(Difference("kv_order", "<metadata>", common, oorder))

    rt, ot = ref.tensor_map(), other.tensor_map()
    for name, t in rt.items():
        if name not in ot:
            diffs.append(Difference("tensor_missing", name, (t.ne, t.ggml_type), None))
            continue
        o = ot[name]
        if o.ne != t.ne:
            diffs.append(Difference("tensor_shape", name, t.ne, o.ne, "ggml ne incl. n_dims"))
        if o.ggml_type != t.ggml_type:
            diffs.append(Difference("tensor_type", name, t.ggml_type, o.ggml_type))
    for name, o in ot.items():
        if name not in rt:
            diffs.append(Difference("tensor_extra", name, None, (o.ne, o.ggml_type)))
    if check_tensor_order:
        a = [t.name for t in ref.tensors if t.name in ot]
        b = [t.name for t in other.tensors if t.name in rt]
        if a != b:
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            diffs.append(Difference("tensor_order", f"first mismatch at #{i}", a[i], b[i],
                                    f"ref order {a[max(i - 1, 0):i + 3]} vs {b[max(i - 1, 0):i + 3]}"))
    return diffs


def _first_mismatch(a: KVEntry, b: KVEntry) -> str:
    if isinstance(a.value, tuple) and isinstance(b.value, tuple):
        if len(a.value) != len(b.value):
            return f"lengths {len(a.value)} vs {len(b.value)}"
        i = next(i for i, (x, y) in enumerate(zip(a.value, b.value)) if x != y)
        return f"first mismatch at [{i}]: {a.value[i]!r} vs {b.value[i]!r}"
    return ""


def _as_f32(t: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(-1)
    return quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)


def compare_values(
    ref_path: str | os.PathLike[str],
    other_path: str | os.PathLike[str],
    *,
    rtol: float = 1e-5,
) -> list[Difference]:
    """Tensor data of tensors present in both with the same ``ne``.

    Equal bytes pass; otherwise both are dequantized to f32 and the largest absolute error,
    relative to the largest magnitude in ``ref``, must stay within ``rtol``.
    """
    from gguf import GGUFReader

    ra, rb = GGUFReader(str(ref_path)), GGUFReader(str(other_path))
    tb = {t.name: t for t in rb.tensors}
    diffs: list[Difference] = []
    for t in ra.tensors:
        o = tb.get(t.name)
        if o is None or tuple(o.shape) != tuple(t.shape):
            continue
        if o.tensor_type == t.tensor_type and np.array_equal(
                np.asarray(t.data).view(np.uint8), np.asarray(o.data).view(np.uint8)):
            continue
        a, b = _as_f32(t), _as_f32(o)
        scale = float(np.max(np.abs(a))) or 1.0
        err = float(np.max(np.abs(a - b))) / scale
        if not err <= rtol:
            diffs.append(Difference("tensor_value", t.name, t.tensor_type.name,
                                    o.tensor_type.name, f"max rel err {err:.3g} > {rtol:g}"))
    return diffs


@dataclass
class ConverterCase:
    """One comparison: our writer's file vs llama.cpp's converter on the same weights."""

    label: str  # e.g. "qwen35 grafted q8_0"
    ours: Path
    theirs: Path
    diffs: list[Difference]


def converter_vs_writer(
    spec: Any,
    workdir: str | os.PathLike[str],
    *,
    src: str | os.PathLike[str] | None = None,
    outtypes: Iterable[str] = ("f32", "f16", "q8_0"),
    modes: Iterable[str] = ("grafted", "no-mtp", "mtp"),
    values: bool = True,
    rtol: float = 1e-5,
) -> list[ConverterCase]:
    """Write ``spec`` with ``pyggspec.testing``, rebuild its HF checkpoint, convert it with
    llama.cpp's converter (each outtype x MTP mode) and diff every pair.

    The HF checkpoint is rebuilt from our f32 grafted file (``hf_from_gguf``), so both sides
    hold the same weights: tensor data is compared too (``values``).
    """
    from pyggspec.testing import write_model, write_split
    from pyggspec.testing.hf_checkpoint import ConvertJob, hf_from_gguf, run_llamacpp_converter_jobs

    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    base = spec.replace(dtype="f32", mtp="grafted")
    hf = hf_from_gguf(write_model(wd / "ours-src-f32.gguf", base), wd / "hf")
    pairs: list[tuple[str, Path, ConvertJob]] = []
    for outtype in outtypes:
        s = base.replace(dtype=outtype)
        ours = {"grafted": write_model(wd / f"ours-grafted-{outtype}.gguf", s)}
        ours["no-mtp"], ours["mtp"] = write_split(wd / f"ours-split-{outtype}", s)
        for mode in modes:
            job = ConvertJob(hf, wd / f"llamacpp-{mode}-{outtype}.gguf", outtype, mode)
            pairs.append((f"{spec.arch} {mode} {outtype}", ours[mode], job))
    run_llamacpp_converter_jobs([j for _, _, j in pairs], src)
    cases = []
    for label, ours_path, job in pairs:
        diffs = compare_layouts(read_layout(job.outfile), read_layout(ours_path),
                                check_kv_order=True)
        if values:
            diffs += compare_values(job.outfile, ours_path, rtol=rtol)
        cases.append(ConverterCase(label, ours_path, job.outfile, diffs))
    return cases


def format_differences(diffs: list[Difference]) -> str:
    """One line per difference, or a short all-clear."""
    if not diffs:
        return "layouts identical"
    return "\n".join(str(d) for d in diffs)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the differences of B against A; exit 1 if any."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref")
    ap.add_argument("other")
    ap.add_argument("--values", action="store_true", help="compare tensor data too")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--no-order", action="store_true", help="ignore tensor order")
    ap.add_argument("--kv-order", action="store_true", help="check metadata order too")
    args = ap.parse_args(argv)
    diffs = compare_layouts(read_layout(args.ref), read_layout(args.other),
                            check_tensor_order=not args.no_order,
                            check_kv_order=args.kv_order)
    if args.values:
        diffs += compare_values(args.ref, args.other, rtol=args.rtol)
    print(format_differences(diffs))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
