"""``pyggspec models`` (the model list, ``models.toml``) and ``pyggspec devices`` (the ggml
devices of the installed libraries)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from pyggspec.cli.common import CONTEXT_SETTINGS, fmt_bytes
from pyggspec.errors import PyggspecError


def models_toml_path() -> Path:
    """The model list: ``models.toml`` at the repository root (source / editable installs),
    else a copy shipped as package data at ``pyggspec/data/models.toml``."""
    package = Path(__file__).resolve().parent.parent
    for p in (package.parent / "models.toml", package / "data" / "models.toml"):
        if p.is_file():
            return p
    raise PyggspecError("models.toml", "not found next to the package (reinstall pyggspec)")


def load_models(path: Path | None = None) -> list[dict[str, Any]]:
    """Entries of models.toml as dicts (``[[model]]`` tables)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    path = path or models_toml_path()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise PyggspecError(path, f"cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise PyggspecError(path, f"invalid TOML: {e}") from None
    models = data.get("model", [])
    if not isinstance(models, list):
        raise PyggspecError(path, "expected [[model]] tables")
    return models


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def models(as_json: bool) -> None:
    """List the Qwen3.5/3.6 models pyggspec targets (from models.toml)."""
    entries = load_models()
    if as_json:
        click.echo(json.dumps(entries))
        return
    cols = ("id", "arch", "n_layer", "hf_repo", "gguf_repo", "quant", "mtp")
    table = [[str(e.get(c, "") or "-") for c in cols] for e in entries]
    for e, row in zip(entries, table):
        if e.get("mtp_file"):
            row[-1] += f" ({e['mtp_file']})"
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(cols)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(cols, widths)).rstrip())
    for row in table:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def devices(as_json: bool) -> None:
    """List the ggml devices the installed llama-cpp-python libraries provide."""
    from pyggspec.ggml import quirks
    from pyggspec.ggml.device import backends_available, list_devices

    infos = list(list_devices())
    notes = [line for d in infos for line in quirks.lines(d.name)]
    if "Vulkan" in backends_available() and not any(d.backend == "Vulkan" for d in infos):
        notes.append("Vulkan backend built, no device listed: ggml hides CPU-type Vulkan "
                     "devices (Mesa's lavapipe); GGML_VK_VISIBLE_DEVICES=0 shows one")
    fields = ("name", "type", "backend", "memory_free", "memory_total", "description")
    if as_json:
        out = [{f: getattr(d, f) for f in fields} | {"notes": quirks.lines(d.name)}
               for d in infos]
        click.echo(json.dumps(out))
        return
    rows = [[d.name, str(d.type), d.backend,
             f"{fmt_bytes(d.memory_free)} / {fmt_bytes(d.memory_total)}", d.description]
            for d in infos]
    head = ["NAME", "TYPE", "BACKEND", "FREE / TOTAL", "DESCRIPTION"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    for line in notes:
        click.echo(f"note: {line}")
