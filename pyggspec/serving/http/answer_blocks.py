"""A streamed chat answer as a sequence of blocks: reasoning, text, tool calls.

OpenAI's chat stream sends one ``delta`` per change (:class:`~.chat_parse.ChatStream`), any
field at any time. OpenAI's Responses (output items) and Anthropic's Messages (content
blocks) send the same answer as blocks that open, grow and close one after the other, each
with an index. :class:`BlockStream` turns the chat deltas into those steps once, for both
APIs: a delta of another kind (or another tool call) closes the open block and opens the
next, so indices count up and every block is closed exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pyggspec.serving.http.chat_parse import ChatStream, parse_final

Kind = Literal["reasoning", "text", "tool"]


@dataclass
class Block:
    """One block of the answer: ``text`` is the reasoning, the text, or a tool call's
    arguments (a JSON object's text) so far; ``index`` its place in the answer."""

    kind: Kind
    index: int
    text: str = ""
    name: str = ""  # a tool call's function
    call_id: str = ""  # a tool call's id (the chat answer's)
    tool_index: int = -1  # the tool call's index in the chat answer
    ident: str = ""  # the API's own id for the block, set by its user


@dataclass(frozen=True)
class Step:
    """``open`` a block, add ``delta`` to it, or ``close`` it."""

    op: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""


class BlockStream:
    """Feed chat deltas, get :class:`Step` objects; :meth:`finish` closes the last block."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, deltas: Iterable[dict[str, Any]]) -> list[Step]:
        steps: list[Step] = []
        for d in deltas:
            if d.get("reasoning_content"):
                steps += self._add("reasoning", -1, d["reasoning_content"])
            if d.get("content"):
                steps += self._add("text", -1, d["content"])
            for tc in d.get("tool_calls") or ():
                fn = tc.get("function") or {}
                steps += self._add("tool", tc["index"], fn.get("arguments") or "",
                                   name=fn.get("name", ""), call_id=tc.get("id", ""))
        return steps

    def finish(self) -> list[Step]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [Step("close", block)]

    def _add(self, kind: Kind, tool_index: int, text: str, name: str = "",
             call_id: str = "") -> list[Step]:
        steps: list[Step] = []
        cur = self._open
        if cur is None or cur.kind != kind or cur.tool_index != tool_index:
            steps += self.finish()
            cur = Block(kind, len(self.blocks), name=name, call_id=call_id,
                        tool_index=tool_index)
            self.blocks.append(cur)
            self._open = cur
            steps.append(Step("open", cur))
        if text:
            cur.text += text
            steps.append(Step("delta", cur, text))
        return steps


def message_blocks(message: Any) -> list[Block]:
    """A whole answer's blocks (``chat_parse.ChatMessage``): reasoning, text, tool calls."""
    out: list[Block] = []
    if message.reasoning_content:
        out.append(Block("reasoning", len(out), message.reasoning_content))
    if message.content:
        out.append(Block("text", len(out), message.content))
    for i, tc in enumerate(message.tool_calls):
        out.append(Block("tool", len(out), tc.arguments, name=tc.name, call_id=tc.id,
                         tool_index=i))
    return out


def final_blocks(text: str, syntax: Any) -> list[Block]:
    """The blocks of a whole generated answer ``text`` (parsed by the prompt's ``syntax``)."""
    return message_blocks(parse_final(text, syntax))


class AnswerSteps:
    """A streamed answer's steps: its text through the chat parser (``syntax``: the
    prompt's) and :class:`BlockStream`. ``blocks``: every block opened so far."""

    def __init__(self, syntax: Any) -> None:
        self._parser = ChatStream(syntax)
        self._blocks = BlockStream()

    @property
    def blocks(self) -> list[Block]:
        return self._blocks.blocks

    def feed(self, text: str) -> list[Step]:
        return self._blocks.feed(self._parser.feed(text))

    def finish(self) -> list[Step]:
        """The parser's held-back text, then the last block closed."""
        return self._blocks.feed(self._parser.finish()) + self._blocks.finish()
