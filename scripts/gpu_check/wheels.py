#!/usr/bin/env python3
"""Fetch the cp312 manylinux wheels pyggspec needs on the device image (no registry there).

Starts from pyggspec's dependencies (and the test extras), pinned to the versions installed
in this Python where it has them (the combination this checkout is tested with), resolves them
with pip for CPython 3.12 / manylinux x86_64, keeps only what the device image lacks
(``cuda_image_packages.txt``), and checks that every kept wheel's requirements are either kept
or on the image. Used by ``scripts/gpu_check.sh prepare``.

    python3 scripts/gpu_check/wheels.py DEST_DIR
"""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# what pyggspec imports at run and test time beyond the image, plus the sdist's build backend
ROOTS = ["cffi", "gguf", "fastapi", "uvicorn", "openai", "diskcache", "scikit-build-core"]
# carried even though the image has them: llama-cpp-python's build backend, at a known version
ALWAYS = {"scikit-build-core"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]
# the device's interpreter, for environment markers
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (HERE / "cuda_image_packages.txt").read_text().splitlines()
    return {norm(s) for s in lines if s.strip() and not s.startswith("#")}


def local_pin(name: str) -> str:
    try:
        return f"{name}=={md.version(name)}"
    except md.PackageNotFoundError:
        return name


def requirements(whl: Path) -> list[str]:
    """Names this wheel needs on the device (extras and markers that do not apply dropped)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(ENV):
            continue
        out.append(norm(req.name))
    return out


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit("usage: wheels.py DEST_DIR")
    dest = Path(sys.argv[1])
    image = image_packages()
    pins = [local_pin(n) for n in ROOTS]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", tmp]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        # every other package at the version installed here too, where it is installed
        cons = Path(tmp) / "constraints.txt"
        cons.write_text("".join(f"{d.metadata['Name']}=={d.version}\n"
                                for d in md.distributions() if d.metadata["Name"]))
        print("wheels.py: resolving " + " ".join(pins), file=sys.stderr)
        if subprocess.run(cmd + ["-c", str(cons)] + pins, check=False).returncode != 0:
            print("wheels.py: not with this Python's versions; resolving afresh", file=sys.stderr)
            subprocess.run(cmd + pins, check=True)
        got = {norm(f.name.split("-")[0]): f for f in Path(tmp).glob("*.whl")}
        keep = {n: f for n, f in got.items() if n not in image or n in ALWAYS}
        missing = sorted({r for f in keep.values() for r in requirements(f)}
                         - set(keep) - image)
        if missing:
            sys.exit(f"wheels.py: kept wheels need {missing}, neither kept nor on the image")
        dest.mkdir(parents=True, exist_ok=True)
        for f in keep.values():
            shutil.copy2(f, dest / f.name)
        print("wheels.py: carrying " + ", ".join(sorted(f.name.split("-")[0] + " "
                                                        + f.name.split("-")[1]
                                                        for f in keep.values())),
              file=sys.stderr)
        skipped = sorted(set(got) - set(keep))
        print("wheels.py: on the image already: " + ", ".join(skipped), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
