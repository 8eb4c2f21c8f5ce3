"""JSON bodies whose strings are Unicode text: a lone UTF-16 surrogate is refused at the boundary.

JSON lets a string spell any UTF-16 code unit as an escape, and Python's ``json`` decodes an unpaired one
(``"\\ud800"``) into a ``str`` that no UTF-8 encoder, tokenizer or SQLite bind accepts: such a value got past
validation and failed deep inside a route (a 500 from the tokenizer's ``TypeError`` or the store's
``UnicodeEncodeError``). Every JSON body is checked once after parsing, naming the first field at fault. The check
walks the parsed body only when the raw bytes hold an escape in the surrogate range, so ordinary bodies pay one
byte search. Paired escapes (an emoji written as two) decode to one character and pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi.routing import APIRoute
from starlette.requests import Request

from coserve.finetune.chat_format import NOT_UNICODE, is_unicode_text
from coserve.server.errors import APIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_field(data) -> str | None:
    """The name of the first value (or key) in ``data`` that holds a lone surrogate, as ``messages[0].content``
    (``""`` for a bare string; a key is named by its object), or None when every string is Unicode text. Walked
    without recursion: a body may nest as deep as the JSON parser allows."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not is_unicode_text(value):
                return path
        elif isinstance(value, dict):
            if not all(is_unicode_text(k) for k in value):
                return path
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def check_text(raw: bytes, data) -> None:
    """Raise a 400 naming the field when ``data`` (``raw`` parsed as JSON) holds a string that is no Unicode text."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return
    field = lone_surrogate_field(data)
    if field is not None:
        raise APIError(400, f"{field or 'body'}: {NOT_UNICODE}", field or None, "invalid_unicode")


class TextJSONRoute(APIRoute):
    """A FastAPI route whose JSON body must be Unicode text (``check_text``) before the endpoint sees it. FastAPI
    parses the body itself; the bytes it read are cached on the request, so the check parses them again only when
    they hold a surrogate escape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def checked(request: Request):
            if request.method in ("POST", "PUT", "PATCH") and is_json(request.headers.get("content-type")):
                raw = await request.body()
                if raw and _SURROGATE_ESCAPE.search(raw) is not None:
                    try:
                        data = await request.json()
                    except (ValueError, RecursionError):  # no JSON at all: FastAPI's own parse answers that
                        data = None
                    check_text(raw, data)
            return await handler(request)

        return checked


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI would parse a body of this content type as JSON (``application/json`` or
    ``application/...+json``; none at all is not, its content types being strict by default)."""
    if not content_type:
        return False
    main, _, sub = content_type.partition(";")[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))
