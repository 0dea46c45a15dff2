"""How much of a streamed text's end may be the beginning of a tag, which a splitter must hold until
the next chunk tells (tool-call markers, think tags): one rule for every splitter on the fronts."""

from __future__ import annotations


def partial_tag_len(text: str, *tags: str) -> int:
    """The length of the longest end of `text` that begins one of `tags` without completing it (0: none)."""
    for size in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        end = text[-size:]
        if any(len(tag) > size and tag.startswith(end) for tag in tags):
            return size
    return 0
