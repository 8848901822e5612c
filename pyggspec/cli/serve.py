"""``pyggspec serve``: the command (thin: flags -> Engine -> ``create_app`` -> uvicorn).

llama-server's flag names and meanings where they exist, ``pyggspec run``'s defaults for
everything the two share (sampling, speculation, memory). ``-c`` is the context of each
slot (pyggspec's engine holds ``-np`` sequences of ``-c`` tokens each).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from pyggspec.cli.common import (
    CHECKPOINT_MIN_STEP,
    CONTEXT_SETTINGS,
    CPU_MOE,
    CTX_CHECKPOINTS,
    DEVICE,
    MODEL,
    N_BATCH,
    N_CTX,
    N_PARALLEL,
    N_THREADS,
    N_UBATCH,
    NGL,
    NO_MMAP,
    NO_REPACK,
    OVERRIDES,
    RPC,
    TYPE_K,
    TYPE_V,
    add_rpc_servers,
    engine_config,
    engine_from_config,
    sampling_options,
    spec_options,
)
from pyggspec.config import EngineConfig


@click.command(context_settings=CONTEXT_SETTINGS)
@MODEL(help="GGUF model. Without it, --spec-type draft-mtp serves the built-in synthetic demo "
            "model.")
@click.option("-a", "--alias", "alias", default=None,
              help="Model name in /v1/models and responses (default: the file name).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--api-key", "api_key", default=None, envvar="PYGGSPEC_API_KEY",
              help="Require this key (Authorization: Bearer KEY) on every endpoint but /health.")
@N_PARALLEL(default=4, help="Sequence slots generating at once.")
@click.option("--max-queue", "max_queue", type=click.IntRange(min=0), default=64,
              show_default=True, help="Requests waiting for a slot before HTTP 503.")
@N_CTX(help="Context (prompt + output) of each slot.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=-1), default=-1,
              show_default=True, help="Default output limit per request (-1: until end of "
                                      "generation or the context is full).")
@N_BATCH(help="Logical batch (prompt chunk per sequence).")
@N_UBATCH(help="Physical batch (capped at -b).")
@N_THREADS()
@NGL()
@DEVICE()
@OVERRIDES()
@CPU_MOE()
@TYPE_K()
@TYPE_V()
@RPC(help="Add remote ggml RPC servers as devices.")
@NO_MMAP()
@NO_REPACK(help="Keep CPU weights as stored.")
@spec_options
@CTX_CHECKPOINTS()
@CHECKPOINT_MIN_STEP("-cms", help="Prompt tokens between two checkpoints.")
@click.option("--jinja/--no-jinja", "jinja", default=True, show_default=True,
              help="Render the GGUF's chat template with Jinja (--no-jinja: llama.cpp's "
                   "built-in template matcher).")
@click.option("--chat-template-file", "chat_template_file",
              type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Use this Jinja chat template instead of the file's.")
@click.option("--log-level", "log_level", type=click.Choice(["debug", "info", "warning",
              "error"]), default="info", show_default=True)
@sampling_options
@engine_config
def serve(model: Path | None, config: EngineConfig, alias: str | None, host: str, port: int,
          api_key: str | None, max_queue: int, n_predict: int, rpc: str | None, jinja: bool,
          chat_template_file: Path | None, log_level: str) -> None:
    """Serve MODEL over HTTP: OpenAI-compatible and llama-server endpoints, continuous
    batching over -np slots, MTP speculation per request.

    Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /completion, /tokenize,
    /detokenize, /apply-template, /health, /slots, /props, /metrics.
    """
    from pyggspec.serving.server import ServerConfig, create_app
    from pyggspec.serving.server import serve as run_server
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    template = chat_template_file.read_text() if chat_template_file is not None else None
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
    add_rpc_servers(rpc)
    engine = engine_from_config(model, config)
    with engine:
        name = alias or (f"{model.name} (synthetic demo)" if synthetic else model.name)
        server_config = ServerConfig(model_id=name, model_path=str(model), api_key=api_key,
                                     sampling=config.sampling,
                                     n_predict=None if n_predict < 0 else n_predict,
                                     synthetic=synthetic, jinja=jinja, chat_template=template)
        try:
            app = create_app(engine, server_config, max_queue=max_queue)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        cfg = config.spec
        spec_desc = (f"draft-mtp n_max {cfg.n_max}" + (" adaptive" if cfg.adaptive else " fixed")
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
