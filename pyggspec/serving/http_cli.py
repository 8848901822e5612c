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

from pyggspec.cli import CONTEXT_SETTINGS, _parse_ngl, _parse_overrides, main
from pyggspec.sampling import SamplingOptions, sampling_options
from pyggspec.speculative.options import SpecOptions, spec_options


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("-m", "--model", "model", type=click.Path(path_type=Path), default=None,
              help="GGUF model. Without it, --spec-type draft-mtp serves the built-in "
                   "synthetic demo model.")
@click.option("-a", "--alias", "alias", default=None,
              help="Model name in /v1/models and responses (default: the file name).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--api-key", "api_key", default=None, envvar="PYGGSPEC_API_KEY",
              help="Require this key (Authorization: Bearer KEY) on every endpoint but /health.")
@click.option("-np", "--parallel", "n_parallel", type=click.IntRange(min=1), default=4,
              show_default=True, help="Sequence slots generating at once.")
@click.option("--max-queue", "max_queue", type=click.IntRange(min=0), default=64,
              show_default=True, help="Requests waiting for a slot before HTTP 503.")
@click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=1), default=4096,
              show_default=True, help="Context (prompt + output) of each slot.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=-1), default=-1,
              show_default=True, help="Default output limit per request (-1: until end of "
                                      "generation or the context is full).")
@click.option("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=2048,
              show_default=True, help="Logical batch (prompt chunk per sequence).")
@click.option("-ub", "--ubatch-size", "n_ubatch", type=click.IntRange(min=1), default=512,
              show_default=True, help="Physical batch (capped at -b).")
@click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (default: cores, at most 8).")
@click.option("-ngl", "--n-gpu-layers", "ngl", metavar="N|all|auto", default=None,
              help="Layers on the offload device (default: all, when one exists).")
@click.option("-dev", "--device", "device", metavar="NAME", default=None,
              help="Offload device (see `pyggspec devices`).")
@click.option("-ot", "--override-tensor", "overrides", multiple=True, metavar="REGEX=DEVICE")
@click.option("-cmoe", "--cpu-moe", is_flag=True, help="Keep MoE expert weights on the CPU.")
@click.option("-ctk", "--cache-type-k", "type_k", default="f16", show_default=True)
@click.option("-ctv", "--cache-type-v", "type_v", default="f16", show_default=True)
@click.option("--rpc", "rpc", default=None, metavar="HOST:PORT[,...]",
              help="Add remote ggml RPC servers as devices.")
@click.option("--no-mmap", is_flag=True, help="Copy CPU weights instead of mapping the file.")
@click.option("-nr", "--no-repack", is_flag=True, help="Keep CPU weights as stored.")
@spec_options
@click.option("-ctxcp", "--ctx-checkpoints", "ctx_checkpoints", type=click.IntRange(min=0),
              default=4, show_default=True,
              help="Recurrent-state checkpoints kept per slot for prompt reuse (host memory).")
@click.option("-cms", "--checkpoint-min-step", "checkpoint_min_step",
              type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt tokens between two checkpoints.")
@click.option("--jinja/--no-jinja", "jinja", default=True, show_default=True,
              help="Render the GGUF's chat template with Jinja (--no-jinja: llama.cpp's "
                   "built-in template matcher).")
@click.option("--chat-template-file", "chat_template_file",
              type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Use this Jinja chat template instead of the file's.")
@click.option("--log-level", "log_level", type=click.Choice(["debug", "info", "warning",
              "error"]), default="info", show_default=True)
@sampling_options
def serve(model: Path | None, alias: str | None, host: str, port: int, api_key: str | None,
          n_parallel: int, max_queue: int, n_ctx: int, n_predict: int, n_batch: int,
          n_ubatch: int, n_threads: int | None, ngl: str | None, device: str | None,
          overrides: tuple[str, ...], cpu_moe: bool, type_k: str, type_v: str, rpc: str | None,
          no_mmap: bool, no_repack: bool, spec: SpecOptions, ctx_checkpoints: int, checkpoint_min_step: int,
          jinja: bool, chat_template_file: Path | None, log_level: str,
          sampling: SamplingOptions) -> None:
    """Serve MODEL over HTTP: OpenAI-compatible and llama-server endpoints, continuous
    batching over -np slots, MTP speculation per request.

    Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /completion, /tokenize,
    /detokenize, /apply-template, /health, /slots, /props, /metrics.
    """
    from pyggspec.engine import Engine
    from pyggspec.serving.server import ServerConfig, create_app
    from pyggspec.serving.server import serve as run_server
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    template = chat_template_file.read_text() if chat_template_file is not None else None
    synthetic = False
    if model is None:
        if spec.spec_type != "draft-mtp":
            raise click.UsageError("missing -m/--model (only --spec-type draft-mtp has a "
                                   "built-in demo model)")
        from pyggspec.demo import demo_model

        model = demo_model()
        synthetic = True
        click.echo("pyggspec serve: serving the built-in SYNTHETIC demo model (random "
                   "weights, constructed MTP agreement ~95%): its text is meaningless, the "
                   "speed-up is real.", err=True)
    if rpc:
        from pyggspec.ggml.device import add_rpc_server

        for ep in rpc.split(","):
            if ep:
                add_rpc_server(ep.strip())
    engine = Engine(model, n_ctx=n_ctx, n_parallel=n_parallel,
                    n_threads=n_threads, n_batch=n_batch, n_ubatch=n_ubatch,
                    n_gpu_layers=_parse_ngl(ngl), device=device,
                    override_tensor=_parse_overrides(overrides), cpu_moe=cpu_moe, type_k=type_k,
                    type_v=type_v, use_mmap=not no_mmap, repack=not no_repack,
                    **spec.engine_kwargs, draft_backend_sampling=sampling.draft_backend_sampling,
                    sampling=sampling.params, backend_sampling=sampling.backend_sampling,
                    ctx_checkpoints=ctx_checkpoints, checkpoint_min_step=checkpoint_min_step)
    with engine:
        name = alias or (f"{model.name} (synthetic demo)" if synthetic else model.name)
        config = ServerConfig(model_id=name, model_path=str(model), api_key=api_key,
                              sampling=sampling.params,
                              n_predict=None if n_predict < 0 else n_predict,
                              synthetic=synthetic, jinja=jinja, chat_template=template)
        try:
            app = create_app(engine, config, max_queue=max_queue)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        cfg = spec.config
        spec_desc = (f"draft-mtp n_max {cfg.n_max}" + (" adaptive" if cfg.adaptive else " fixed")
                     + (f" p_min {cfg.p_min}" if cfg.p_min else "")
                     + f", rollback {engine.rollback}" if engine.spec_type else "none")

        def on_listen(url: str) -> None:
            click.echo(f"pyggspec serve: listening on {url} | model {name}"
                       + (" [SYNTHETIC]" if synthetic else "")
                       + f" | speculation {spec_desc} | {n_parallel} slots x ctx "
                       f"{engine.n_ctx} | max queue {max_queue}"
                       + (" | API key required" if api_key else ""), err=True)
            sys.stderr.flush()

        run_server(app, host, port, log_level=log_level, on_listen=on_listen)
