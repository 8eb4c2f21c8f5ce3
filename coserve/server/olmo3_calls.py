"""OLMo 3's tool calls (vLLM's ``olmo3`` parser): the reply is ``<function_calls>``, then one Python call per line,
then ``</function_calls>``::

    <function_calls>
    get_weather(city="Paris", days=3, metric=true)
    get_time()
    </function_calls>

Keyword arguments are Python literals, or JSON's ``null``, ``true`` and ``false`` (the tool descriptions the model
reads are JSON). The lines are read as the Python list of calls they make, by ``pythonic``'s reader
(``pythonic_calls.py``): whole, and as they are written (a call named once ``name(`` is, its arguments whole once its
``)`` is). A reply that does not begin with ``<function_calls>`` is text (vLLM's whole-reply parser also takes bare
lines of calls, which its stream sends as text; here both read the same).
"""

from __future__ import annotations

from coserve.server.call_text import CallView, after_lead
from coserve.server.pythonic_calls import parse_pythonic, pythonic_views

OPEN, CLOSE = "<function_calls>", "</function_calls>"


def _lines_as_list(body: str) -> str:
    """``[call, call, ...`` of the body's non-blank lines (without the closing ``]``)."""
    return "[" + ", ".join(line.strip() for line in body.splitlines() if line.strip())


def parse_olmo3(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments)`` of each call of a finished reply of calls; None where it is not one."""
    body = text.strip()
    if not body.startswith(OPEN):
        return None
    body = body[len(OPEN):].removesuffix(CLOSE)  # (a reply cut after its last call may lack the closing tag)
    if CLOSE in body:
        return None  # text after the calls
    return parse_pythonic(_lines_as_list(body) + "]", json_names=True)


def olmo3_views(text: str) -> list[CallView]:
    """The calls of a growing reply as far as they are written; NotACall once it cannot be a reply of calls."""
    body = after_lead(text, OPEN)
    if body is None:
        return []
    end = body.find(CLOSE)
    return pythonic_views(_lines_as_list(body if end < 0 else body[:end]), json_names=True)
