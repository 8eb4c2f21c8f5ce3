"""OpenAI's listing queries: cursor paging over a listing held whole (``limit`` objects after the object ``after``)
and the ``metadata[k]=v`` filter."""

from __future__ import annotations

from fastapi import Request

from coserve.server.errors import bad_request


def check_limit(limit: int, most: int) -> None:
    """A 400 naming ``limit`` unless it is 1 to ``most``."""
    if not 1 <= limit <= most:
        raise bad_request(f"limit: must be between 1 and {most}, got {limit}", "limit")


def page_after(items: list[dict], after: str | None, limit: int, what: str) -> tuple[list[dict], bool]:
    """``(page, has_more)``: the first ``limit`` of ``items`` (in listing order) after the one whose id is
    ``after`` (from the first where None); a 400 naming ``after`` where no item has that id (``what`` says what an
    item is, for the message)."""
    if after is not None:
        at = next((i for i, x in enumerate(items) if x["id"] == after), None)
        if at is None:
            raise bad_request(f"after: {after!r} is not {what}", "after")
        items = items[at + 1:]
    return items[:limit], len(items) > limit


def metadata_filter(request: Request) -> tuple[dict[str, str], bool]:
    """OpenAI's metadata filter of a listing (jobs, stored chat completions): ``metadata[k]=v`` pairs (every one
    must match) or ``metadata=null`` (only those without metadata: True), or neither. Errors name the parameter."""
    pairs, null = {}, False
    for key, value in request.query_params.multi_items():
        if key == "metadata":
            if value != "null":
                raise bad_request(f"metadata: give metadata[key]=value pairs or metadata=null, not {value!r}",
                                  "metadata")
            null = True
        elif key.startswith("metadata[") and key.endswith("]"):
            name = key[len("metadata["):-1]
            if not name or len(name) > 64 or '"' in name or "\\" in name:
                raise bad_request(f"{key}: a metadata key is 1-64 characters, without quotes or backslashes", key)
            pairs[name] = value
    if null and pairs:
        raise bad_request("metadata: give metadata[key]=value pairs or metadata=null, not both", "metadata")
    return pairs, null
