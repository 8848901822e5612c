"""What a chat request asks beyond sampling: tools, ``tool_choice``, reasoning, and the
prompt and answer syntax that follow from them (llama-server's ``oaicompat_chat_params_parse``).

Server defaults come from the command line as llama-server's do: ``--reasoning-format``
(``auto``: split reasoning out, which for Qwen's ``<think>`` is ``deepseek``), ``--reasoning
on|off|auto`` (the template's ``enable_thinking``; ``auto``: on when the template thinks),
``--reasoning-budget`` / ``--reasoning-budget-message``, ``--chat-template-kwargs`` and
``--skip-chat-parsing``. A request overrides them with ``reasoning_format``,
``chat_template_kwargs`` (``enable_thinking`` must be a boolean there), ``reasoning_effort``
(``"none"`` turns thinking off), ``reasoning_budget_tokens`` / ``thinking_budget_tokens`` and
``reasoning_budget_message``.

Tools are OpenAI's ``tools[]`` (``{"type": "function", "function": {"name", "description",
"parameters"}}``), rendered by the template; ``tool_choice`` is ``auto``, ``none`` (tools are
still shown to the model, its answer is not parsed for calls, as llama-server), ``required``,
or ``{"type": "function", "function": {"name": ...}}``. ``required`` and a named function
start the answer's tool call for the model -- the prompt ends with ``<tool_call>\\n`` (and
``<function=NAME>\\n``) after the thinking block, which :mod:`.chat_run` lets the model
finish first -- and a grammar (:mod:`.tool_grammar`) holds the rest to a call of the
declared tools, as llama-server's does. With ``auto`` the answer is free until the model
writes ``<tool_call>`` (after its thinking), and the same grammar holds the call from there
(llama-server's lazy grammar), unless the request brings a grammar of its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyggspec.sampling.grammar import GrammarSpec
from pyggspec.serving.http.chat import ChatTemplate, parse_template_kwargs
from pyggspec.serving.http.chat_parse import (
    CALL_OPEN,
    FUNC_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    ChatSyntax,
    ToolSpec,
)
from pyggspec.serving.http.protocol import (
    _kind,
    get_bool,
    get_int,
    get_str,
    invalid,
    object_array,
)
from pyggspec.serving.http.tool_grammar import auto_tool_grammar, tool_call_grammar

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.serving.http.state import ServerConfig

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
TOOL_CHOICES = ("auto", "none", "required")


# ---------------------------------------------------------------------------- request
@dataclass
class ChatRequest:
    """A chat request's messages and what shapes its prompt and the reading of its answer."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]  # OpenAI tools[], [] for none
    tool_choice: str  # auto | none | required
    tool_name: str | None  # a named tool_choice (then tool_choice is "required")
    parallel_tool_calls: bool
    reasoning_format: str
    kwargs: dict[str, Any]  # template variables: enable_thinking, the kwargs of both sides
    reasoning_budget: int  # -1: no budget
    reasoning_budget_message: str
    add_generation_prompt: bool = True
    # continue the last (assistant) message instead of starting a new one: llama-server's
    # continue_final_message, and its prefill when the conversation ends with an assistant
    continue_final: str = ""  # "" (a new message), "content" or "reasoning_content"
    continue_content: str = ""  # that message's text (content parts joined by a blank line)


def parse_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``tools``: OpenAI function tools, checked field by field (400 naming the field)."""
    out, names = [], set()
    for i, t in enumerate(object_array(body.get("tools"), "tools", "tools")):
        w = f"tools[{i}]"
        if t.get("type") != "function":
            raise invalid(f"'{w}.type' must be \"function\", got {t.get('type')!r}",
                          f"{w}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"'{w}.function' must be an object, got {_kind(fn)}", f"{w}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise invalid(f"'{w}.function.name' must be a non-empty string", f"{w}.function.name")
        if any(c in name for c in "<>\n"):
            raise invalid(f"'{w}.function.name' cannot hold '<', '>' or a newline, got {name!r}",
                          f"{w}.function.name")
        if name in names:
            raise invalid(f"'{w}.function.name' {name!r} is declared twice", f"{w}.function.name")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid(f"'{w}.function.description' must be a string",
                          f"{w}.function.description")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"'{w}.function.parameters' must be a JSON schema object, got "
                          f"{_kind(params)}", f"{w}.function.parameters")
        out.append(t)
    return out


def parse_tool_choice(body: Mapping[str, Any], tools: Sequence[Mapping[str, Any]]
                      ) -> tuple[str, str | None]:
    """``tool_choice`` -> (auto | none | required, the named function or None)."""
    v = body.get("tool_choice")
    if v is None:
        return "auto", None
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise invalid(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a "
                          f"function, got {v!r}", "tool_choice")
        if v == "required" and not tools:
            raise invalid("'tool_choice' is \"required\" but no 'tools' are given",
                          "tool_choice")
        return v, None
    fn = v.get("function") if isinstance(v, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(name, str):
        raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": NAME}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"'tool_choice' names function {name!r}, which is not in 'tools'",
                      "tool_choice")
    return "required", name


def parse_chat_request(body: Mapping[str, Any], messages: list[dict[str, Any]],
                       config: ServerConfig, template: ChatTemplate) -> ChatRequest:
    """The request's tools and reasoning settings over the server's (HTTP 400 for anything
    wrong)."""
    tools = parse_tools(body)
    if not template.jinja:
        if tools:
            raise invalid("'tools' needs the Jinja renderer (the server runs with --no-jinja)",
                          "tools")
        if body.get("tool_choice") not in (None, "auto"):
            raise invalid("'tool_choice' needs the Jinja renderer (the server runs with "
                          "--no-jinja)", "tool_choice")
    choice, name = parse_tool_choice(body, tools)
    parallel = get_bool(body, "parallel_tool_calls",
                        template.caps()["supports_parallel_tool_calls"] if tools else True)

    fmt = get_str(body, "reasoning_format", config.reasoning_format)
    if fmt not in REASONING_FORMATS:
        raise invalid(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, got "
                      f"{fmt!r}", "reasoning_format")

    # template variables: the thinking default, the server's kwargs, then the request's
    kwargs: dict[str, Any] = {"enable_thinking": config.reasoning != "off"
                              and (template.thinks or template.supports_thinking)}
    if config.reasoning in ("on", "off"):
        kwargs["enable_thinking"] = config.reasoning == "on"
    kwargs.update(config.chat_template_kwargs)
    kwargs.update(parse_template_kwargs(body))
    if not isinstance(kwargs["enable_thinking"], bool):
        raise invalid(f"'chat_template_kwargs.enable_thinking' must be a boolean, got "
                      f"{_kind(kwargs['enable_thinking'])}", "chat_template_kwargs")
    effort = get_str(body, "reasoning_effort", None)
    if effort == "none":
        kwargs["enable_thinking"] = False
        kwargs.pop("reasoning_effort", None)
    elif effort:
        kwargs["reasoning_effort"] = effort
    if not template.jinja:  # llama.cpp's built-in matcher takes no variables
        kwargs = parse_template_kwargs(body)

    budget = get_int(body, "reasoning_budget_tokens", None, lo=-1)
    if budget is None:
        budget = get_int(body, "thinking_budget_tokens", None, lo=-1)
    if budget is None or budget == -1:
        budget = config.reasoning_budget
    message = get_str(body, "reasoning_budget_message", config.reasoning_budget_message) or ""
    if messages and messages[-1].get("tool_calls"):
        template_messages(messages, template)  # bad arguments are reported first, as there
    add_gen, cont = _continuation(body, messages, config.prefill_assistant)
    return ChatRequest(messages=messages, tools=tools, tool_choice=choice, tool_name=name,
                       parallel_tool_calls=parallel, reasoning_format=fmt, kwargs=kwargs,
                       reasoning_budget=budget, reasoning_budget_message=message,
                       add_generation_prompt=add_gen, continue_final=cont,
                       continue_content=_final_content(body, messages) if cont else "")


def _continuation(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
                  prefill_assistant: bool) -> tuple[bool, str]:
    """(add_generation_prompt, continue the final message), as llama-server's
    ``oaicompat_chat_params_parse``: ``continue_final_message`` (true, "content" or
    "reasoning_content") or, with ``--prefill-assistant`` (its default), a conversation that
    ends with an assistant message continues that message; both with
    ``add_generation_prompt`` is a 400, as are two assistant messages at the end. The
    second value is "" (no continuation), "content" or "reasoning_content" (true resolves
    to the latter when the message has reasoning and no content)."""
    add_gen = get_bool(body, "add_generation_prompt", True)
    v = body.get("continue_final_message")
    cont = v is True or v in ("content", "reasoning_content")
    if not cont and prefill_assistant and messages and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise invalid("Cannot have 2 or more assistant messages at the end of the list.",
                          "messages")
        cont, add_gen = True, False
    if cont and add_gen:
        raise invalid("Cannot set both add_generation_prompt and continue_final_message to "
                      "true.", "continue_final_message")
    if cont and messages and messages[-1]["role"] == "assistant" \
            and messages[-1].get("tool_calls"):
        raise invalid("Cannot continue an assistant message that contains tool calls.",
                      "continue_final_message")
    if not cont:
        return add_gen, ""
    if isinstance(v, str):
        return add_gen, v
    last = messages[-1] if messages else {}
    only_reasoning = bool(last.get("reasoning_content")) and not last.get("content")
    return add_gen, "reasoning_content" if only_reasoning else "content"


def _final_content(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]) -> str:
    """The continued message's text: its content parts joined by a blank line (llama.cpp's
    ``render_content``; parts of earlier messages reach the template joined by a newline)."""
    raw = body.get("messages")
    last = raw[-1] if isinstance(raw, list) and raw else None
    parts = last.get("content") if isinstance(last, dict) else None
    if isinstance(parts, list):
        return "\n\n".join(p["text"] for p in parts if isinstance(p, dict)
                            and isinstance(p.get("text"), str))
    return str(messages[-1].get("content") or "") if messages else ""


# ---------------------------------------------------------------------------- prompt
@dataclass
class ChatPrompt:
    """The rendered prompt and how the answer to it is generated and read.

    ``thinking_open``: the prompt leaves a ``<think>`` block open (Qwen3.5's default), so a
    reasoning budget and a forced tool call wait for the thinking to end. ``tool_prefix``:
    the start of a tool call the answer is made to begin with after thinking (``required`` /
    a named ``tool_choice``), "" when the model decides.
    """

    text: str
    syntax: ChatSyntax
    thinking_open: bool
    tool_prefix: str
    # a forced call's grammar: holds the text after the call's start (the prompt's end, or
    # ``tool_prefix`` once inserted) to a call of the declared tools (:mod:`.tool_grammar`)
    tool_grammar: GrammarSpec | None = None
    # ``tool_choice: auto``'s lazy grammar: free text, then from ``<tool_call>`` (after the
    # thinking) a call of the declared tools; used when the request has no grammar of its own
    auto_grammar: GrammarSpec | None = None


def template_messages(messages: Sequence[Mapping[str, Any]],
                      template: ChatTemplate) -> list[dict[str, Any]]:
    """Messages as the template wants them: tool-call ``arguments`` as objects when the
    template prints them as such (Qwen3.5 iterates ``arguments|items``), as llama.cpp's
    ``func_args_not_string``; invalid JSON there is the client's 400."""
    if not any("tool_calls" in m for m in messages) or not template.jinja:
        return [dict(m) for m in messages]
    as_objects = template.caps()["supports_object_arguments"]
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if "tool_calls" in m:
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                fn = dict(tc["function"])
                args = fn["arguments"]
                if as_objects and isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError as e:
                        w = f"messages[{i}].tool_calls[{j}].function.arguments"
                        raise invalid(f"'{w}' is not valid JSON: {e}", w) from None
                elif not as_objects and isinstance(args, dict):
                    fn["arguments"] = json.dumps(args, ensure_ascii=False)
                calls.append({**tc, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _continued(template: ChatTemplate, req: ChatRequest, msgs: list[dict[str, Any]]
               ) -> tuple[str, str]:
    """The prompt that continues the final message, and the generation prompt the answer
    continues (llama.cpp's ``continue_final_message``): the conversation before it without a
    generation prompt, then the template's generation prompt, then the message's reasoning
    (in a thinking template's block, closed when the content is continued) and its
    content."""
    head, last = msgs[:-1], msgs[-1] if msgs else {}
    bare = template.render(head, False, req.kwargs, req.tools) if head else ""
    full = template.render(head, True, req.kwargs, req.tools)
    gen = full[len(bare):] if full.startswith(bare) else \
        template.generation_prompt(head, full, req.kwargs, req.tools)
    content = req.continue_content if req.continue_final == "content" else ""
    reasoning = str(last.get("reasoning_content") or "")
    at = gen.rfind(THINK_OPEN)
    if template.thinks and at >= 0:
        gen = gen[:at] + THINK_OPEN + "\n" + reasoning
        if req.continue_final == "content":
            gen += "\n" + THINK_CLOSE + "\n\n"
    return bare + gen + content, gen + content


def render_chat(template: ChatTemplate, req: ChatRequest,
                skip_chat_parsing: bool = False) -> ChatPrompt:
    """Render the prompt (with the request's tools and variables) and work out the
    answer's syntax: the generation prompt the answer continues, whether reasoning is split
    out, which tools are parsed."""
    msgs = template_messages(req.messages, template)
    if req.continue_final:
        text, gen_prompt = _continued(template, req, msgs)
    elif not req.add_generation_prompt:
        text, gen_prompt = template.render(msgs, False, req.kwargs, req.tools), ""
    else:
        text = template.render(msgs, True, req.kwargs, req.tools)
        gen_prompt = template.generation_prompt(msgs, text, req.kwargs, req.tools)
    thinking_open = (template.thinks
                     and gen_prompt.rfind(THINK_OPEN) > gen_prompt.rfind(THINK_CLOSE))
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    syntax = ChatSyntax(
        generation_prompt=gen_prompt,
        reasoning=template.thinks and req.reasoning_format != "none",
        tools={t["function"]["name"]: ToolSpec.from_openai(t) for t in req.tools}
        if parse_tools else None,
        parallel_tool_calls=req.parallel_tool_calls,
        pure_content=skip_chat_parsing)
    prefix, grammar, auto = "", None, None
    if parse_tools and req.tool_choice == "auto":  # read from the open thinking block on
        lead = gen_prompt[gen_prompt.rfind(THINK_OPEN) + len(THINK_OPEN):] if thinking_open \
            else gen_prompt
        auto = auto_tool_grammar(req.tools, req.parallel_tool_calls, thinking_open, lead)
    if parse_tools and req.tool_choice == "required":
        prefix = CALL_OPEN + "\n" + (f"{FUNC_OPEN}{req.tool_name}>\n" if req.tool_name else "")
        grammar = tool_call_grammar(req.tools, req.tool_name, req.parallel_tool_calls)
        if not thinking_open:  # no thinking first: the prompt starts the call
            text += prefix
            syntax = dataclasses.replace(syntax, generation_prompt=gen_prompt + prefix)
            prefix = ""
    return ChatPrompt(text=text, syntax=syntax, thinking_open=thinking_open, tool_prefix=prefix,
                      tool_grammar=grammar, auto_grammar=auto)

