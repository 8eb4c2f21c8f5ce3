"""OpenAI's cursor paging over a listing held whole: ``limit`` objects after the object ``after``."""

from __future__ import annotations

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
