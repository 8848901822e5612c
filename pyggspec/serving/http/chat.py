"""Chat messages -> prompt text, with the GGUF's own chat template, as llama-server does.

Decision: llama-server renders ``tokenizer.chat_template`` with its Jinja engine by default
(``--jinja`` is on), and real Qwen3.5/3.6 templates need that (``enable_thinking``, tool and
reasoning branches, ``messages[::-1]`` loops) — llama.cpp's built-in matcher would see
``<|im_start|>`` and render plain ChatML, dropping the ``<think>`` handling. So the default
here is a Jinja2 rendering of the file's template in a sandbox configured like Hugging Face's
(``trim_blocks``, ``lstrip_blocks``, ``tojson``, ``raise_exception``, ``strftime_now``),
compiled once. ``jinja=False`` (``serve --no-jinja``) uses llama.cpp's built-in template
matcher instead (:meth:`Tokenizer.apply_chat_template`). A file without a template gets
ChatML, llama-server's fallback. Per-request ``chat_template_kwargs`` (e.g.
``{"enable_thinking": false}``) reach the template as variables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyggspec.serving.http.protocol import ApiError
from pyggspec.serving.http.template_caps import probe_caps

# llama-server's fallback when a model has no template
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ChatTemplate:
    """The chat template of one model, ready to render request after request."""

    def __init__(self, tokenizer: Any, template: str | None = None, jinja: bool = True) -> None:
        self.tokenizer = tokenizer
        # --no-jinja --chat-template NAME: one of llama.cpp's built-in templates by name
        self.builtin: str | None = None
        if template is not None and not jinja:
            names = tokenizer.builtin_chat_templates()
            if template not in names:
                raise ValueError("a chat template of your own needs --jinja (with --no-jinja "
                                 "only llama.cpp's built-in templates, by name: "
                                 f"{', '.join(names)})")
            self.builtin = template
        self.source = template or getattr(tokenizer, "chat_template", None) or CHATML
        self.from_file = template is None and getattr(tokenizer, "chat_template", None) is not None
        self.jinja = jinja
        self._compiled: Any = None
        self._caps: dict[str, bool] | None = None
        self._thinking: bool | None = None
        self._specials = self._special_pieces()
        if jinja:
            self._compiled = self._compile(self.source)

    @property
    def name(self) -> str:
        """What /props reports: where the template came from and how it is rendered."""
        where = "gguf" if self.from_file else ("chatml fallback" if self.source == CHATML
                                               else f"built-in {self.builtin}" if self.builtin
                                               else "override")
        return f"{where} ({'jinja' if self.jinja else 'llama.cpp built-in'})"

    @property
    def bos_token(self) -> str:
        """The BOS token's text ("" without one), as templates and /props see it."""
        return self._specials["bos_token"]

    @property
    def eos_token(self) -> str:
        return self._specials["eos_token"]

    def caps(self) -> dict[str, bool]:
        """llama-server's ``chat_template_caps`` for this template (probed once; with
        ``--no-jinja`` the source is still compiled for the probes, as llama-server parses
        it with Jinja either way)."""
        if self._caps is None:
            try:
                compiled = self._compiled or self._compile(self.source)
            except ValueError:
                compiled = None

            def render(variables: Mapping[str, Any]) -> str:
                if compiled is None:
                    raise ValueError("the template does not compile")
                return compiled.render(**{**self._specials, **variables})

            self._caps = probe_caps(render)
        return dict(self._caps)

    def _special_pieces(self) -> dict[str, str]:
        tok = self.tokenizer
        out = {"bos_token": "", "eos_token": ""}
        for key, attr in (("bos_token", "bos"), ("eos_token", "eos")):
            tid = getattr(tok, attr, None)
            if tid is not None:
                out[key] = tok.token_to_piece(tid).decode("utf-8", "replace")
        return out

    @staticmethod
    def _compile(source: str) -> Any:
        import jinja2

        from pyggspec.tokenizer import compile_chat_template

        try:
            return compile_chat_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e}") from None

    @property
    def thinks(self) -> bool:
        """Whether the template has a thinking block (llama.cpp's test for Qwen-style
        templates: ``<think>`` in the source, rendered with Jinja)."""
        return self.jinja and "<think>" in self.source

    @property
    def supports_thinking(self) -> bool:
        """Whether ``enable_thinking`` changes what the template renders (llama-server's
        ``common_chat_templates_support_enable_thinking``, which finds any template's
        thinking markers: Qwen's ``<think>``, Cohere's ``<|START_THINKING|>``, ...). With
        ``--reasoning auto`` such a template is rendered with thinking on. Probed once."""
        if self._thinking is None:
            self._thinking = False
            if self.jinja:
                msgs = [{"role": "user", "content": "test"}]
                try:
                    on, off = (self._compiled.render(**{
                        **self._specials, "messages": msgs, "add_generation_prompt": True,
                        "enable_thinking": v}) for v in (True, False))
                    self._thinking = on != off
                except Exception:  # noqa: BLE001 - a template refusing the probe: no
                    self._thinking = False
        return self._thinking

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               kwargs: Mapping[str, Any] | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text; a template that rejects the conversation (``raise_exception``,
        a wrong role order) is the client's error: HTTP 400 with the template's message.
        ``tools`` (OpenAI's ``tools[]``) reach the template as ``tools`` when there are any,
        as llama-server passes them."""
        if not self.jinja:
            if kwargs:
                raise ApiError(400, "'chat_template_kwargs' needs the Jinja renderer (the "
                               "server runs with --no-jinja)", param="chat_template_kwargs")
            if tools:
                raise ApiError(400, "'tools' needs the Jinja renderer (the server runs with "
                               "--no-jinja)", param="tools")
            try:
                return self.tokenizer.apply_chat_template(
                    [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                    builtin=self.builtin)
            except Exception as e:  # noqa: BLE001 - llama.cpp or jinja, both the input's fault
                raise ApiError(400, f"chat template failed: {getattr(e, 'message', e)}",
                               param="messages") from None
        import jinja2

        variables = {**self._specials, **date_variables()}
        if tools:
            variables["tools"] = [dict(t) for t in tools]
        variables.update(kwargs or {})
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled.render(**variables)
        except jinja2.TemplateError as e:
            raise ApiError(400, f"chat template failed: {e}", param="messages") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ApiError(400, f"chat template failed on these messages: "
                           f"{type(e).__name__}: {e}", param="messages") from None


    def generation_prompt(self, messages: Sequence[Mapping[str, Any]], prompt: str,
                          kwargs: Mapping[str, Any] | None = None,
                          tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """What the template appends to ``messages`` for the answer (``prompt`` rendered
        with the generation prompt, minus the same conversation rendered without it), e.g.
        Qwen3.5's ``<|im_start|>assistant\\n<think>\\n``: llama.cpp parses the answer with this
        in front, so the answer starts inside an open thinking block. "" with --no-jinja or
        when the template refuses the conversation without a generation prompt."""
        if not self.jinja:
            return ""
        try:
            bare = self.render(messages, False, kwargs, tools)
        except ApiError:
            return ""
        if prompt.startswith(bare):  # the usual case: the answer's header is appended
            return prompt[len(bare):]
        lo, hi = 0, min(len(bare), len(prompt))  # longest common prefix, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prompt[:mid] == bare[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return prompt[lo:]


def date_variables() -> dict[str, str]:
    """llama.cpp's extra template context (``common_chat_extra_context``): today's date as
    ``date_string`` ("24 Nov 2026", Llama 3.x) and ``datetime`` ("Nov 24 2026",
    firefunction); a request's ``chat_template_kwargs`` override them."""
    from datetime import datetime

    now = datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def parse_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``: an object of extra template variables."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object",
                       param="chat_template_kwargs")
    reserved = {"messages", "add_generation_prompt"} & set(v)
    if reserved:
        raise ApiError(400, f"'chat_template_kwargs' cannot set {', '.join(sorted(reserved))}",
                       param="chat_template_kwargs")
    return dict(v)
