"""The grammar that holds a tool call to Qwen3.5/3.6's XML form, as llguidance Lark: a forced
one (``tool_choice`` ``required`` or a named function), and with ``auto`` a call the model
starts itself.

llama-server builds the same constraint from the tools' schemas (``common/parsers/
qwen3-coder.cpp``); this follows its shape so the answers parse the same way:

* a call is ``<tool_call>\\n<function=NAME>\\n`` + arguments + ``</function>\\n</tool_call>``;
* an argument is ``<parameter=P>\\n`` + value + ``\\n</parameter>\\n``: a ``string`` parameter's
  value is any text up to that end (a string ``enum``: one of its values), a parameter that
  admits no string is a JSON value of its schema, and one that admits strings and other types
  (or says nothing) is raw text, as llama.cpp keeps it;
* required arguments come first, in any order (Qwen does not always keep the schema's;
  beyond :data:`MAX_PERMUTED` of them, in the schema's order: the alternatives grow as n!),
  then optional ones, each any number of times;
* with ``parallel_tool_calls`` more calls may follow, separated by whitespace; nothing follows
  the last one (the output ends where the grammar allows only the end of generation).

A forced call's grammar describes the text *after* the call's start, which the prompt (or the
text inserted when the thinking block ends) already holds: after ``<tool_call>\\n`` any
declared function, after ``<tool_call>\\n<function=NAME>\\n`` that function's arguments.

``tool_choice: auto`` gets llama-server's lazy grammar (:func:`auto_tool_grammar`, a
:mod:`~pyggspec.sampling.lazy_grammar`): the answer is free text -- content, and a thinking
block the prompt left open, in which ``<tool_call>`` does not count (llama.cpp's Qwen parser
takes calls after the reasoning) -- and may end anywhere; from ``<tool_call>`` on, the rest is
``\\n`` and exactly a forced call's text (more calls with ``parallel_tool_calls``), nothing
after the last. The free part costs no mask (see that module for what one llguidance grammar
with a negated free part cost per step). A request with its own ``grammar`` /
``json_schema`` / ``response_format`` keeps it, and its calls are not held (llama-server
refuses a ``grammar`` beside tools; pyggspec answers it, as before).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pyggspec.sampling.grammar import JSON_WHITESPACE, GrammarSpec
from pyggspec.serving.http.chat_parse import (
    CALL_CLOSE,
    CALL_OPEN,
    FUNC_CLOSE,
    FUNC_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_CLOSE,
    schema_types,
)

MAX_PERMUTED = 3  # required arguments accepted in any order up to this many
VALUE_END = "\n" + PARAM_CLOSE + "\n"


def _lit(s: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(s, ensure_ascii=False)


def _value(rule: str, schema: Any) -> list[str]:
    """Rules for one argument's value and its end, named ``rule``."""
    types = schema_types(schema)
    if isinstance(schema, dict) and types == {"string"}:
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return [f"{rule}: ({' | '.join(_lit(v) for v in enum)}) {_lit(VALUE_END)}"]
    if types and "string" not in types and isinstance(schema, dict):
        js = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        return [f"{rule}: {rule}_json {_lit(VALUE_END)}",
                f"{rule}_json: %json {json.dumps(js, ensure_ascii=False)}"]
    return [f"{rule}[suffix={_lit(VALUE_END)}]: /(?s:.*)/"]


def _arguments(rule: str, fn: Mapping[str, Any]) -> tuple[list[str], str]:
    """Rules for one function's arguments, and how a call refers to them: ``rule``, or
    ``rule?`` when every argument is optional, or "" when it takes none."""
    schema = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    req = schema.get("required") if isinstance(schema.get("required"), list) else []
    required = [p for p in props if p in req]
    optional = [p for p in props if p not in req]
    if not props:
        return [], ""
    lines, names = [], {}
    for i, p in enumerate(props):
        names[p] = arg = f"{rule}_a{i}"
        lines.append(f"{arg}: {_lit(f'{PARAM_OPEN}{p}>' + chr(10))} {arg}_v")
        lines += _value(f"{arg}_v", props[p])
    any_optional = "(" + " | ".join(names[p] for p in optional) + ")"
    if not required:
        return [f"{rule}: {any_optional}+", *lines], f"{rule}?"
    perms = (itertools.permutations(required) if len(required) <= MAX_PERMUTED
             else [required])
    seq = "(" + " | ".join(" ".join(names[p] for p in o) for o in perms) + ")"
    if optional:
        seq += f" {any_optional}*"
    return [f"{rule}: {seq}", *lines], rule


def _calls(tools: Sequence[Mapping[str, Any]], name: str | None,
           parallel: bool) -> tuple[str, list[str]]:
    """The first call's rule (its text after ``<tool_call>\\n``, or after the named
    function's opening line) with the further calls ``parallel`` allows, and the rules it
    uses."""
    fns = [t["function"] for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
    lines: list[str] = []
    alts = []
    refs = []
    for i, fn in enumerate(fns):
        rules, ref = _arguments(f"args{i}", fn)
        lines += rules
        refs.append(ref)
        head = _lit(f"{FUNC_OPEN}{fn['name']}>\n")
        lines.append(f"fn{i}: {head} {ref} {_lit(FUNC_CLOSE + chr(10))}")
        alts.append(f"fn{i}")
    lines.append("fn: " + " | ".join(alts))
    more = (f' (/[ \\t\\n]{{0,2}}/ {_lit(CALL_OPEN + chr(10))} fn {_lit(CALL_CLOSE)})*'
            if parallel else "")
    if name is not None:  # the prompt holds the function's opening line already
        first = f"{refs[0]} {_lit(FUNC_CLOSE + chr(10) + CALL_CLOSE)}"
    else:
        first = f"fn {_lit(CALL_CLOSE)}"
    return first + more, lines


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None,
                      parallel: bool) -> GrammarSpec:
    """The grammar of a forced call's text after its start (see the module docstring):
    ``tools`` OpenAI ``tools[]`` (validated), ``name`` the named ``tool_choice`` or None."""
    start, lines = _calls(tools, name, parallel)
    text = "%llguidance {}\n" + f"start: {start}\n" + "\n".join(lines) + "\n"
    return GrammarSpec("lark", text, "tool_choice")


def auto_tool_grammar(tools: Sequence[Mapping[str, Any]], parallel: bool,
                      thinking: bool, lead: str = "") -> GrammarSpec:
    """``tool_choice: auto``'s lazy grammar (see the module docstring): free text until
    ``<tool_call>`` -- after ``</think>`` when the prompt opened a thinking block
    (``thinking``) -- then ``\\n`` and exactly a forced call's text of any declared tool.
    ``lead``: the text in front of the answer (a prefilled start may hold the trigger)."""
    start, lines = _calls(tools, None, parallel)
    text = ("%llguidance {}\n" + f"start: {_lit(chr(10))} {start}\n" + "\n".join(lines)
            + "\n")
    return GrammarSpec("lark", text, "tool_choice", after=THINK_CLOSE if thinking else "",
                       trigger=CALL_OPEN, lead=lead)
