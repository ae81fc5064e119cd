"""Where each message's content lies in a rendered chat prompt, so that role markup a user typed
(`<｜Assistant｜>`) can be encoded as text while the template's own markup stays control tokens.

The template is rendered twice: with the real contents, and with each content replaced by a marker.
The marker render gives the template's own text between contents; the real render is then read as
those template pieces with a content piece between each pair. A template may transform a content
(DeepSeek's drops an assistant turn's reasoning before `</think>`), so a content piece is any
substring of its message's content, not necessarily all of it."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]
Span = tuple[str, bool]  # (text, whether it came from a message's content)
Part = tuple[str, bool]  # (text, whether it is markup the caller wrote: control tokens)
# A message may carry its content in parts under this key, when a caller (the server's tool calls)
# wrote markup around the client's text: that markup is read as the template's own.
CONTENT_PARTS = "content_parts"


def joined(parts: list[Part]) -> str:
    return "".join(text for text, _ in parts)


class TemplateNotSplittable(ValueError):
    """The template changes a content, or renders differently around it, so its pieces are unknown."""


def split_rendered(messages: list[Message], render: Callable[[list[Message]], str]) -> list[Span]:
    """The real render as (text, from content) spans in order; TemplateNotSplittable when the
    marker render does not line up with the real one."""
    nonce = secrets.token_hex(8)
    markers: dict[str, str] = {}  # marker -> the content text it stands for

    def with_markers(m: Message) -> Message:
        content = m.get("content")
        parts = m.get(CONTENT_PARTS) or ([(content, False)] if isinstance(content, str) else [])
        text = ""
        for piece, is_markup in parts:
            if not is_markup:
                # Private-use characters around a random nonce: survive trim/strip; no content can guess it.
                marker = f"\ue000{nonce}.{len(markers)}\ue001"
                markers[marker], piece = piece, marker
            text += piece
        return {**m, "content": text} if parts else m

    marked = render([with_markers(m) for m in messages])
    parts = re.split(f"({'|'.join(map(re.escape, markers))})", marked) if markers else [marked]
    template_pieces = parts[0::2]
    pieces = _content_pieces(render(messages), template_pieces, [markers[p] for p in parts[1::2]])
    if pieces is None:
        raise TemplateNotSplittable(
            "the chat template changes message content (or what it renders around it) so that its own "
            "markup cannot be told apart from the content's"
        )
    spans: list[Span] = [(template_pieces[0], False)]
    for piece, template_piece in zip(pieces, template_pieces[1:], strict=True):
        spans += [(piece, True), (template_piece, False)]
    return [s for s in spans if s[0]]


def _content_pieces(rendered: str, template: list[str], contents: list[str]) -> list[str] | None:
    """Content pieces c_j with rendered == t_0 c_0 t_1 c_1 ... t_n, each c_j a substring of
    contents[j]: the whole content where it fits, else the longest substring that does (more text
    read as text is the safe side). None when no such reading is found."""
    if not rendered.startswith(template[0]):
        return None
    pieces, start = [], len(template[0])
    for j, content in enumerate(contents):
        following = template[j + 1]
        if j == len(contents) - 1:  # the last piece runs up to the template's closing text
            ends = [len(rendered) - len(following)] if rendered.endswith(following) else []
        elif rendered.startswith(content + following, start):
            ends = [start + len(content)]
        else:
            ends = _occurrences(rendered, following, start, start + len(content))[::-1]
        end = next((e for e in ends if e >= start and rendered[start:e] in content), None)
        if end is None:
            return None
        pieces.append(rendered[start:end])
        start = end + len(following)
    return pieces if start == len(rendered) else None


def _occurrences(text: str, sub: str, start: int, last: int) -> list[int]:
    """Positions p in [start, last] where `sub` occurs in `text`, in order."""
    found, p = [], text.find(sub, start, last + len(sub))
    while p != -1:
        found.append(p)
        p = text.find(sub, p + 1, last + len(sub))
    return found
