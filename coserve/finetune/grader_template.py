"""OpenAI's grader templates: text with ``{{ item.answer }}`` places (a path ``item.a.b`` goes deeper into the data-set
item) and ``{{ sample.output_text }}`` / ``{{ sample.output_json.x }}`` places (the model's output, as text or read as
JSON), filled per sample; and the ``sample`` namespace of a model output."""

from __future__ import annotations

import json
import re
from typing import Any

_PLACE = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_PATH = re.compile(r"(item|sample)((?:\.[A-Za-z_][A-Za-z0-9_-]*|\.\d+)*)")
SAMPLE_FIELDS = ("output_text", "output_json", "output_tools")


def make_sample(text: str) -> dict:
    """The ``sample`` namespace of a model output: its text, the text read as JSON (None when it is not JSON) and
    its tool calls (none: coserve's completions are text)."""
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    return {"output_text": text, "output_json": parsed, "output_tools": []}


class Template:
    """A grader's ``input`` or ``reference``: text with ``{{ item.* }}`` and ``{{ sample.* }}`` places."""

    def __init__(self, text: object, where: str) -> None:
        if not isinstance(text, str):
            raise ValueError(f"{where}: expected text (a template such as '{{{{ item.answer }}}}')")
        self.text, self.where = text, where
        self.places: list[tuple[str, tuple[str, ...]]] = []
        for m in _PLACE.finditer(text):
            path = _PATH.fullmatch(m.group(1))
            if path is None:
                raise ValueError(f"{where}: {m.group(0)} is not item.<field> or sample.<field>")
            keys = tuple(path.group(2).split(".")[1:])
            if path.group(1) == "sample" and (not keys or keys[0] not in SAMPLE_FIELDS
                                               or (keys[0] != "output_json" and len(keys) > 1)):
                raise ValueError(f"{where}: {m.group(0)}: the sample has {', '.join(SAMPLE_FIELDS)} "
                                 "(output_json.<field> goes into the output read as JSON)")
            self.places.append((path.group(1), keys))

    def render(self, item: Any, sample: dict) -> str:
        """The text with each place filled (text as it is, other values as JSON); ValueError naming a place the
        item or the sample does not have."""
        values = iter(self.places)

        def fill(m: re.Match) -> str:
            root, keys = next(values)
            value: Any = item if root == "item" else sample
            for k in keys:
                if isinstance(value, dict) and k in value:
                    value = value[k]
                elif isinstance(value, list) and k.isdigit() and int(k) < len(value):
                    value = value[int(k)]
                else:
                    raise ValueError(f"{self.where}: {m.group(0)}: the {root} has no {'.'.join((root, *keys))}")
            return value if isinstance(value, str) else json.dumps(value)

        return _PLACE.sub(fill, self.text)
