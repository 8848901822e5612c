"""llama-server's ``POST /slots/{id_slot}?action=save|restore|erase`` (``--slot-save-path``).

``save`` writes the slot's whole state to ``DIR/filename`` (body ``{"filename": ...}``):
its tokens, KV rows, recurrent state, prompt checkpoints and, when the server speculates,
the MTP head's cache and carry-over (format: :mod:`pyggspec.memory.slotfile`). ``restore``
loads such a file into a slot, whose tokens a later request with the same prefix reuses
(prompt reuse picks the slot with the longest common prefix). ``erase`` empties a slot.
An action on a busy slot waits until its request ends, as llama-server defers it.

Answers and errors follow llama-server b11549 (``server-context.cpp``): no
``--slot-save-path`` 501; a slot id that is not a number or not a slot, an unknown action,
an invalid file name (a path, ``..``, reserved characters: llama.cpp's
``fs_validate_filename``) 400; a file that is missing, damaged or saved from another model
or cache setup 400 "Unable to restore slot: ..."; a file that cannot be written 500.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pyggspec.errors import PyggspecError
from pyggspec.serving.http.protocol import ApiError, invalid, read_body, valid_filename
from pyggspec.serving.http.state import ServerState
from pyggspec.serving.request import SchedulerClosed

# codepoints fs_validate_filename refuses besides the C0/C1 controls and surrogates
NO_SAVE_PATH = ("This server does not support slots action. Start it with "
                "`--slot-save-path`")


def install(app: FastAPI, state: ServerState) -> None:
    """Add ``POST /slots/{id_slot}`` to ``app`` (501 unless ``slot_save_path`` is set)."""
    save_dir = state.config.slot_save_path

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: str, request: Request) -> JSONResponse:
        if not save_dir:
            raise ApiError(501, NO_SAVE_PATH)
        try:
            slot = int(id_slot)
        except ValueError:
            raise invalid("Invalid slot ID") from None
        action = request.query_params.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise invalid("Invalid action", "action")
        filename = path = None
        if action != "erase":
            body = await read_body(request)
            filename = body.get("filename")
            if not isinstance(filename, str):
                raise invalid("'filename' (a string) is required", "filename")
            if not valid_filename(filename):
                raise invalid("Invalid filename", "filename")
            path = os.path.join(save_dir, filename)
        if not 0 <= slot < state.n_parallel:
            raise invalid("Invalid slot ID")
        try:
            fut = state.engine.slot_action(action, slot, path)
            res = await asyncio.wrap_future(fut)
        except SchedulerClosed as e:
            raise ApiError(503, f"server is shutting down: {e.message}") from None
        except PyggspecError as e:  # SlotFileError: missing, damaged, another model
            raise invalid(f"Unable to restore slot: {e.message}") from None
        except OSError as e:
            raise ApiError(500, f"Unable to save slot: {e.strerror or e}") from None
        out: dict[str, Any]
        if action == "save":
            out = {"id_slot": slot, "filename": filename, "n_saved": res.n_tokens,
                   "n_written": res.n_bytes, "timings": {"save_ms": res.ms}}
        elif action == "restore":
            out = {"id_slot": slot, "filename": filename, "n_restored": res.n_tokens,
                   "n_read": res.n_bytes, "timings": {"restore_ms": res.ms}}
        else:
            out = {"id_slot": slot, "n_erased": res.n_tokens}
        return JSONResponse(out)
