"""``pyggspec serve``'s HTTP front end (OpenAI + llama-server shapes) over the scheduler.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(OpenAI, streamed as SSE ``data: {...}`` chunks ending with ``data: [DONE]``); llama-server's
``POST /completion`` (and ``/completions``, its alias there: OpenAI's shape is under ``/v1``
only), ``/infill``, ``/tokenize``, ``/detokenize``, ``/apply-template``, ``GET /health``,
``/slots`` (and ``POST /slots/{id}?action=save|restore|erase`` with ``--slot-save-path``),
``/props``, ``/metrics`` (Prometheus: llama-server's ``llamacpp:`` series, then pyggspec's
``pyggspec:`` ones). Field names and shapes follow llama.cpp's ``tools/server``. Any model
name is accepted (one model per server, as llama-server does without a router).

One module per responsibility, each importing only from below it:

- ``app``: :func:`~.app.create_app`, the error answers, the gate (API key, request counts)
- ``routes``: endpoints that generate nothing (health, models, props, slots, metrics, tokens)
- ``completions``: the generating endpoints (chat, completions, ``/completion``)
- ``infill``: ``/infill`` (fill-in-the-middle prompts built as llama.cpp builds them)
- ``slot_actions``: saving, restoring and erasing a slot's state (``--slot-save-path``)
- ``streaming``: waiting for a request whole or as SSE; a client that leaves cancels it
- ``state``: :class:`~.state.ServerConfig` and what the handlers share
- ``protocol``: request bodies -> validated parameters, error bodies
- ``openai_api``: response bodies (OpenAI and llama-server shapes)
- ``chat`` (+ ``template_caps``): chat messages -> prompt with the model's template
- ``model_info``: what the model file says about itself, in llama-server's terms
- ``metrics``: counters and the Prometheus text of ``/metrics``
- ``run``: :func:`~.run.serve` under uvicorn, :func:`~.run.url_of`

Nothing is imported here: ``from pyggspec.serving.http.app import create_app``.
"""
