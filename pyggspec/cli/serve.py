"""``pyggspec serve``: the command (thin: flags -> Engine -> ``create_app`` -> uvicorn).

llama-server's flag names and meanings where they exist, ``pyggspec run``'s defaults for
everything the two share (sampling, speculation, memory). ``-c`` is llama-server's: the
context of all slots together, each of the ``-np`` slots getting ``-c / -np`` tokens; with
``-kvu`` (and with ``-np`` left at auto, as llama-server does) every slot may use all
``-c`` tokens. pyggspec's engine gives each slot its own cache, so there the memory is
``-np`` times ``-c`` tokens (llama.cpp shares one pool).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from pyggspec.cli.common import (
    CHECKPOINT_MIN_STEP,
    CONTEXT_SETTINGS,
    CTX_CHECKPOINTS,
    IMAGE_MAX_TOKENS,
    IMAGE_MIN_TOKENS,
    MODEL,
    N_BATCH,
    N_CTX,
    N_PARALLEL,
    N_UBATCH,
    add_rpc_servers,
    engine_config,
    engine_from_config,
    placement_options,
    print_fit,
    sampling_options,
    spec_options,
    with_projector,
)
from pyggspec.cli.llama_flags import FlagRefused, LlamaCommand, llama_flags
from pyggspec.config import EngineConfig
from pyggspec.errors import PyggspecError
from pyggspec.memory import host_heap

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.serving.http.vertex import VertexAI


def _chat_template(name: str | None, path: Path | None, jinja: bool = True) -> str | None:
    """``--chat-template`` (Jinja text, the built-in name ``chatml``, or with --no-jinja any
    of llama.cpp's built-in names) or ``--chat-template-file``: the template source, or
    None for the file's own."""
    if path is not None:
        if name is not None:
            raise click.UsageError("give --chat-template or --chat-template-file, not both")
        return path.read_text()
    if name is None:
        return None
    if name == "chatml" and jinja:
        from pyggspec.serving.http.chat import CHATML

        return CHATML
    if "{{" in name or "{%" in name or not jinja:
        return name  # with --no-jinja a built-in name (llama3, ...): checked by the server
    raise FlagRefused(f"--chat-template {name}: not supported by pyggspec serve with --jinja "
                      "(of llama.cpp's built-in template names only 'chatml'; give Jinja text, "
                      "--chat-template-file, or the name with --no-jinja)")


def _tristate(value: str) -> str:
    """llama.cpp's on|off|auto values (and their spellings: enabled/true/1, disabled/
    false/0, -1) -> on, off or auto."""
    v = value.lower()
    for canon, spellings in (("on", ("on", "enabled", "true", "1")),
                             ("off", ("off", "disabled", "false", "0")),
                             ("auto", ("auto", "-1"))):
        if v in spellings:
            return canon
    raise click.BadParameter(f"{value!r} is not one of on, off, auto")


def _template_kwargs(text: str | None, effort: str) -> dict:
    """``--chat-template-kwargs`` (a JSON object) and ``--reasoning-effort`` (given to the
    template unless 'default'), as llama-server merges them into every request's."""
    out: dict = {}
    if text is not None:
        try:
            out = json.loads(text)
        except ValueError as e:
            raise click.BadParameter(f"not JSON: {e}", param_hint="--chat-template-kwargs")
        if not isinstance(out, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--chat-template-kwargs")
        if "enable_thinking" in out and not isinstance(out["enable_thinking"], bool):
            raise click.BadParameter("enable_thinking must be true or false",
                                     param_hint="--chat-template-kwargs")
    if effort != "default":
        out["reasoning_effort"] = effort
    return out


def _api_key(key: str | None, key_file: Path | None) -> str | None:
    """``--api-key`` or the one key of ``--api-key-file`` (llama.cpp: one per line, '#'
    comments)."""
    if key_file is None:
        return key
    keys = [ln for ln in key_file.read_text().splitlines() if ln and not ln.startswith("#")]
    if key is not None:
        keys.insert(0, key)
    if len(keys) != 1:
        raise FlagRefused(f"--api-key-file: not supported by pyggspec serve with {len(keys)} "
                          "keys (one key only, counting --api-key)")
    return keys[0]


def _vertex(port: int) -> VertexAI | None:
    """Vertex AI prediction mode from ``AIP_*`` (as llama-server: its port wins over
    ``--port``, with a warning when they differ)."""
    from pyggspec.serving.http.vertex import VertexAI

    try:
        vertex = VertexAI.from_env(os.environ)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if vertex is not None:
        if vertex.port != port:
            click.echo(f"pyggspec serve: Vertex AI prediction mode: AIP_HTTP_PORT "
                       f"{vertex.port} replaces port {port}", err=True)
        click.echo(f"pyggspec serve: Vertex AI prediction mode: POST {vertex.predict_route}"
                   + (f", GET {vertex.health_route}" if vertex.health_route else ""), err=True)
    return vertex


def _add_cors(app, origins: str | None, methods: str | None, headers: str | None,
              credentials: bool | None) -> None:
    """llama-server's CORS, on by default as there (any origin, echoed, with credentials);
    the --cors-* flags change it ('localhost': only a localhost Origin is reflected)."""
    from pyggspec.serving.http.cors import METHODS, Cors

    app.add_middleware(Cors, origins=origins or "*", methods=methods or METHODS,
                       headers=headers or "*",
                       credentials=True if credentials is None else credentials)


def _names(value: str | None) -> tuple[str, ...]:
    """llama-server's comma-separated -a / --tags values: stripped, empty ones dropped,
    sorted and unique (its std::set)."""
    return tuple(sorted({v.strip() for v in (value or "").split(",") if v.strip()}))


def _training_ctx(model: Path) -> int:
    """The GGUF's training context (``-c 0``), from its header; 0 when it has none."""
    from pyggspec.modelfile.gguf import GGUFFile

    f = GGUFFile(model)
    arch = f.get("general.architecture")
    return int(f.get(f"{arch}.context_length") or 0)


def _slot_ctx(n_ctx: int, n_parallel: int, unified: bool, model: Path | None) -> int:
    """llama-server's context of one slot: ``-c`` (``0``: the training context) split over
    the ``-np`` slots, or all of it with a unified KV cache. 0 stays 0 (the engine's
    training context) where the file cannot be read here."""
    if n_ctx == 0 and model is not None and not unified:
        try:
            n_ctx = _training_ctx(model)
        except (OSError, PyggspecError):  # the engine reports a bad file in its own words
            return 0
    if unified or n_ctx == 0:
        return n_ctx
    if n_ctx < n_parallel:
        raise click.BadParameter(f"{n_ctx} tokens cannot be split over {n_parallel} slots "
                                 "(-c is the context of all slots together)",
                                 param_hint="-c/--ctx-size")
    return n_ctx // n_parallel


@click.command(cls=LlamaCommand, context_settings=CONTEXT_SETTINGS)
@MODEL(help="GGUF model. Without it, --spec-type draft-mtp serves the built-in synthetic demo "
            "model.")
@click.option("-a", "--alias", "alias", default=None, metavar="NAME[,NAME...]",
              help="Model name(s) in /v1/models (comma-separated; the first in sorted order "
                   "names the model in responses; default: the file name).")
@click.option("--tags", "tags", default=None, metavar="TAG[,TAG...]",
              help="Model tags listed in /v1/models (informational).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address(es) to listen on, comma-separated.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--api-key", "api_key", default=None, envvar="PYGGSPEC_API_KEY",
              help="Require this key (Authorization: Bearer KEY) on every endpoint but /health.")
@click.option("--api-key-file", "api_key_file", default=None,
              type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Read the API key from this file (llama.cpp's format; one key).")
@click.option("--cors-origins", "cors_origins", default=None, metavar="ORIGINS",
              help="CORS allowed origins, comma-separated ('localhost': a localhost Origin "
                   "only). Default: any, the request's Origin echoed (llama-server's).")
@click.option("--cors-methods", "cors_methods", default=None, metavar="METHODS",
              help="CORS allowed methods (default: GET, POST, DELETE, OPTIONS).")
@click.option("--cors-headers", "cors_headers", default=None, metavar="HEADERS",
              help="CORS allowed headers (default: *).")
@click.option("--cors-credentials/--no-cors-credentials", "cors_credentials", default=None,
              help="CORS: allow credentials (default: allowed).")
@N_PARALLEL(default=4, help="Sequence slots generating at once (-1: auto, 4 as llama-server).")
@click.option("--max-queue", "max_queue", type=click.IntRange(min=0), default=64,
              show_default=True, help="Requests waiting for a slot before HTTP 503.")
@N_CTX(help="Context (prompt + output) of all slots together, as llama-server: each slot "
            "gets -c/-np tokens, all -c with -kvu or -np auto (0: the model's training "
            "context).")
@click.option("-kvu/-no-kvu", "--kv-unified/--no-kv-unified", "kv_unified", default=None,
              help="Every slot may use all -c tokens (llama-server's unified KV cache; "
                   "pyggspec gives each slot its own -c tokens of memory). Default: on when "
                   "-np is auto, as llama-server.")
@click.option("-n", "--predict", "--n-predict", "n_predict", type=click.IntRange(min=-2),
              default=-1, show_default=True, help="Default output limit per request (-1 or "
              "-2: until end of generation or the context is full).")
@N_BATCH(help="Logical batch (prompt chunk per sequence).")
@N_UBATCH(help="Physical batch (capped at -b).")
@placement_options(rpc={"help": "Add remote ggml RPC servers as devices."},
                   no_repack={"help": "Keep CPU weights as stored."})
@spec_options
@CTX_CHECKPOINTS()
@CHECKPOINT_MIN_STEP("-cms", help="Prompt tokens between two checkpoints.")
@click.option("--jinja/--no-jinja", "jinja", default=True, show_default=True,
              help="Render the GGUF's chat template with Jinja (--no-jinja: llama.cpp's "
                   "built-in template matcher).")
@click.option("--chat-template-file", "chat_template_file",
              type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Use this Jinja chat template instead of the file's.")
@click.option("--chat-template", "chat_template", default=None, metavar="JINJA|chatml",
              help="Use this Jinja template text (or the built-in 'chatml') instead of the "
                   "file's.")
@click.option("--metrics", "endpoint_metrics", is_flag=True, default=False,
              help="Serve GET /metrics (Prometheus text; without it 501, as llama-server).")
@click.option("--prefill-assistant/--no-prefill-assistant", "prefill_assistant",
              default=True, show_default=True,
              help="A chat ending with an assistant message continues that message "
                   "(--no-prefill-assistant: the template renders it as a finished turn).")
@click.option("-v", "--verbose", "--log-verbose", "verbose", is_flag=True, default=False,
              help="Responses carry llama-server's __verbose debug object (a request's "
                   "\"verbose\": false turns it off).")
@click.option("--slots/--no-slots", "endpoint_slots", default=True, show_default=True,
              help="Serve GET /slots (--no-slots: 501, as llama-server).")
@click.option("--slot-save-path", "slot_save_path", default=None, metavar="DIR",
              type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="Directory for POST /slots/{id}?action=save|restore (a slot's tokens, "
                   "KV cache, recurrent state and MTP cache). Default: slot actions off.")
@click.option("--spm-infill", "spm_infill", is_flag=True, default=False,
              help="/infill: suffix before prefix (Suffix/Prefix/Middle), for models that "
                   "need it.")
@click.option("--log-level", "log_level", type=click.Choice(["debug", "info", "warning",
              "error"]), default="info", show_default=True)
@click.option("--reasoning-format", "reasoning_format", default="auto", show_default=True,
              type=click.Choice(["none", "auto", "deepseek", "deepseek-legacy"]),
              help="Chat answers: 'none' leaves <think>...</think> in the content; 'auto' / "
                   "'deepseek' put it in reasoning_content (a request's reasoning_format "
                   "overrides).")
@click.option("-rea", "--reasoning", "reasoning", default="auto", show_default=True,
              metavar="on|off|auto", callback=lambda c, p, v: _tristate(v),
              help="Thinking in chat answers (the template's enable_thinking; auto: on when "
                   "the template thinks).")
@click.option("--reasoning-effort", "reasoning_effort", default="default", show_default=True,
              metavar="LEVEL", help="reasoning_effort given to the chat template ('default': "
              "not given).")
@click.option("--reasoning-budget", "reasoning_budget", type=click.IntRange(min=-1),
              default=-1, show_default=True,
              help="Thinking tokens before </think> is forced (-1: no limit, 0: no thinking).")
@click.option("--reasoning-budget-message", "reasoning_budget_message", default="",
              metavar="TEXT", help="Text inserted before the forced </think>.")
@click.option("--chat-template-kwargs", "chat_template_kwargs", default=None, metavar="JSON",
              help="Extra chat template variables for every request, a JSON object (a "
                   "request's chat_template_kwargs override).")
@click.option("--skip-chat-parsing/--no-skip-chat-parsing", "skip_chat_parsing",
              default=False, help="Leave chat answers unparsed: reasoning and tool calls "
              "stay in the content.")
@click.option("-mm", "--mmproj", "mmproj_path", type=click.Path(path_type=Path), default=None,
              help="Vision projector GGUF (convert_hf_to_gguf.py --mmproj): requests may "
              "send images (image_url parts, Anthropic image blocks, input_image).")
@click.option("--no-mmproj-offload", "no_mmproj_offload", is_flag=True,
              help="Encode images on the CPU (default: the projector's GPU device, if any).")
@click.option("--media-path", "media_path", default=None, metavar="DIR",
              type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="Directory for image_url file://NAME (default: file:// URLs refused).")
@IMAGE_MAX_TOKENS()
@IMAGE_MIN_TOKENS()
@sampling_options
@llama_flags("serve")
@engine_config
def serve(model: Path | None, config: EngineConfig, alias: str | None, host: str, port: int,
          api_key: str | None, max_queue: int, n_predict: int, rpc: str | None, jinja: bool,
          chat_template_file: Path | None, log_level: str, api_key_file: Path | None = None,
          cors_origins: str | None = None, cors_methods: str | None = None,
          cors_headers: str | None = None, cors_credentials: bool | None = None,
          chat_template: str | None = None, slot_save_path: Path | None = None,
          spm_infill: bool = False, reasoning_format: str = "auto",
          reasoning: str = "auto", reasoning_effort: str = "default",
          reasoning_budget: int = -1, reasoning_budget_message: str = "",
          chat_template_kwargs: str | None = None, skip_chat_parsing: bool = False,
          tags: str | None = None, kv_unified: bool | None = None,
          endpoint_slots: bool = True, endpoint_metrics: bool = False,
          prefill_assistant: bool = True, verbose: bool = False,
          fit_print: bool = False, mmproj_path: Path | None = None,
          no_mmproj_offload: bool = False, media_path: Path | None = None) -> None:
    """Serve MODEL over HTTP: OpenAI-compatible and llama-server endpoints, continuous
    batching over -np slots, MTP speculation per request.

    Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /completion, /infill,
    /tokenize, /detokenize, /apply-template, /health, /slots (POST /slots/{id}?action=
    with --slot-save-path), /props, /metrics.
    """
    from pyggspec.serving.server import ServerConfig, create_app
    from pyggspec.serving.server import serve as run_server
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # a long-running server: glibc's heaps would keep the memory of freed large blocks
    # (RSS growing without end under load); fixed once, before anything is allocated
    logging.getLogger("pyggspec.serve").info("%s", host_heap.tune())
    template = _chat_template(chat_template, chat_template_file, jinja)
    template_kwargs = _template_kwargs(chat_template_kwargs, reasoning_effort)
    api_key = _api_key(api_key, api_key_file)
    synthetic = False
    if model is None:
        if not config.speculative:
            raise click.UsageError("missing -m/--model (only --spec-type draft-mtp has a "
                                   "built-in demo model)")
        from pyggspec.demo import demo_model

        model = demo_model()
        synthetic = True
        click.echo("pyggspec serve: serving the built-in SYNTHETIC demo model (random "
                   "weights, constructed MTP agreement ~95%): its text is meaningless, the "
                   "speed-up is real.", err=True)
    ctx = click.get_current_context()
    if kv_unified is None:  # llama-server: unified when -np is auto (given as -1 or not given)
        kv_unified = (ctx.meta.get("pyggspec.n_parallel_auto", False)
                      or ctx.get_parameter_source("n_parallel") == ParameterSource.DEFAULT)
    config = replace(config, n_ctx=_slot_ctx(config.n_ctx, config.n_parallel, kv_unified,
                                             None if synthetic else model))
    config = with_projector(config, mmproj_path, not no_mmproj_offload)
    aliases = _names(alias)
    vertex = _vertex(port)
    if vertex is not None:
        port = vertex.port
    add_rpc_servers(rpc)
    if fit_print:  # -fitp: the fit's table for the slots' context, then exit
        print_fit(model, config)
        return
    engine = engine_from_config(model, config)
    with engine:
        name = (aliases[0] if aliases else
                f"{model.name} (synthetic demo)" if synthetic else model.name)
        server_config = ServerConfig(model_id=name, model_path=str(model), api_key=api_key,
                                     aliases=aliases, tags=_names(tags),
                                     endpoint_slots=endpoint_slots,
                                     endpoint_metrics=endpoint_metrics,
                                     prefill_assistant=prefill_assistant, verbose=verbose,
                                     sampling=config.sampling,
                                     n_predict=None if n_predict < 0 else n_predict,
                                     synthetic=synthetic, jinja=jinja, chat_template=template,
                                     slot_save_path=(str(slot_save_path)
                                                     if slot_save_path is not None else None),
                                     spm_infill=spm_infill,
                                     reasoning_format=reasoning_format, reasoning=reasoning,
                                     reasoning_budget=reasoning_budget,
                                     reasoning_budget_message=reasoning_budget_message,
                                     chat_template_kwargs=template_kwargs,
                                     skip_chat_parsing=skip_chat_parsing, vertex=vertex,
                                     media_path=(str(media_path)
                                                 if media_path is not None else None))
        try:
            app = create_app(engine, server_config, max_queue=max_queue)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        _add_cors(app, cors_origins, cors_methods, cors_headers, cors_credentials)
        cfg = config.spec
        spec_desc = (f"{engine.spec_type} n_max {cfg.n_max}"
                     + (" rule-chosen lengths" if cfg.calibrated else " fixed")
                     + (f" p_min {cfg.p_min}" if cfg.p_min else "")
                     + f", rollback {engine.rollback}" if engine.spec_type else "none")

        def on_listen(url: str) -> None:
            click.echo(f"pyggspec serve: listening on {url} | model {name}"
                       + (" [SYNTHETIC]" if synthetic else "")
                       + f" | speculation {spec_desc} | {config.n_parallel} slots x ctx "
                       f"{engine.n_ctx} | max queue {max_queue}"
                       + (" | API key required" if api_key else ""), err=True)
            sys.stderr.flush()

        run_server(app, host, port, log_level=log_level, on_listen=on_listen)
