"""``/props`` ``chat_template_caps``: what a chat template can render, found by trying it.

llama-server reports the capabilities its Jinja engine infers for the model's template
(``common/jinja/caps.cpp``): tools, tool calls, parallel and object-argument tool calls,
system role, string / typed content, preserved reasoning, reasoning effort. Clients (the
web UI, agents) read them to decide what to send. llama.cpp's engine records which template
variables were touched; Jinja2 cannot, so each capability here is decided by rendering the
same probe conversations with unique marker strings and looking for the markers in the
output (a value the template never prints is a value it does not support). Same keys and
defaults as llama-server; a probe the template rejects counts as unsupported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Render = Callable[[Mapping[str, Any]], str]  # template variables -> text; may raise

_CONTENT = "CAPS_STRING_MARKER"
_SYSTEM = "CAPS_SYSTEM_MARKER"
_TOOL_DEF = "caps_tool_def_marker"
_TOOL_CALL = "caps_tool_call_marker"
_TOOL_CALL_2 = "caps_tool_call_two_marker"
_ARG = "CAPS_ARG_MARKER"
_REASONING = "CAPS_REASONING_MARKER"


def _try(render: Render, variables: Mapping[str, Any]) -> str | None:
    try:
        return render({"add_generation_prompt": True, **variables})
    except Exception:  # noqa: BLE001 - a template refusing a probe means "unsupported"
        return None


def _tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": _TOOL_DEF, "description": "Tool description",
        "parameters": {"type": "object", "properties": {
            "arg": {"type": "string", "description": "Arg description"}},
            "required": ["arg"]}}}]


def _tool_conversation(calls: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call0000{i + 1}", "type": "function",
             "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(calls)]},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


def probe_caps(render: Render) -> dict[str, bool]:
    """llama-server's ``chat_template_caps`` for the template behind ``render``."""
    caps = {"supports_tools": True, "supports_tool_calls": True, "supports_system_role": True,
            "supports_parallel_tool_calls": True, "supports_preserve_reasoning": False,
            "supports_reasoning_effort": False, "supports_string_content": True,
            "supports_typed_content": False, "supports_object_arguments": False}

    out = _try(render, {"messages": [{"role": "user", "content": _CONTENT}]})
    caps["supports_string_content"] = out is not None and _CONTENT in out
    out = _try(render, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": _CONTENT}]}]})
    # a template printing the list as-is shows the marker inside its repr: not typed support
    caps["supports_typed_content"] = (out is not None and _CONTENT in out
                                      and "'type'" not in out and '"type"' not in out)

    out = _try(render, {"messages": [{"role": "system", "content": _SYSTEM},
                                     {"role": "user", "content": "User message"}]})
    caps["supports_system_role"] = out is not None and _SYSTEM in out

    # tools with one call whose arguments are an object, then (if not printed) a JSON string
    out = _try(render, {"messages": _tool_conversation([(_TOOL_CALL, {"arg": _ARG})]),
                        "tools": _tools()})
    if out is not None:
        caps["supports_tools"] = _TOOL_DEF in out
        caps["supports_tool_calls"] = _TOOL_CALL in out
        caps["supports_object_arguments"] = (caps["supports_tool_calls"] and _ARG in out
                                             and "{'arg'" not in out)
    if not caps["supports_object_arguments"]:
        out = _try(render, {"messages": _tool_conversation(
            [(_TOOL_CALL, '{"arg": "' + _ARG + '"}')]), "tools": _tools()})
        if out is None:
            caps["supports_tools"] = caps["supports_tool_calls"] = False
        else:
            caps["supports_tools"] = _TOOL_DEF in out
            caps["supports_tool_calls"] = _TOOL_CALL in out
    args: Any = {"arg": "value"} if caps["supports_object_arguments"] else '{"arg": "value"}'
    out = _try(render, {"messages": _tool_conversation([(_TOOL_CALL, args),
                                                        (_TOOL_CALL_2, args)]),
                        "tools": _tools()})
    caps["supports_parallel_tool_calls"] = out is not None and _TOOL_CALL_2 in out

    out = _try(render, {"enable_thinking": True, "messages": [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "Assistant message", "reasoning_content": _REASONING},
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "Assistant message",
         "reasoning_content": "Reasoning content"},
        {"role": "user", "content": "User message"}]})
    caps["supports_preserve_reasoning"] = out is not None and _REASONING in out

    msgs = [{"role": "user", "content": "User message"}]
    low = _try(render, {"enable_thinking": True, "reasoning_effort": "low", "messages": msgs})
    high = _try(render, {"enable_thinking": True, "reasoning_effort": "high", "messages": msgs})
    caps["supports_reasoning_effort"] = low is not None and high is not None and low != high
    return dict(sorted(caps.items()))  # llama-server's std::map order
