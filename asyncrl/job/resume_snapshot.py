"""On resume: the checkpoint's buffer snapshot into the buffer, and no prompt lost when it cannot be.

The checkpoint's data cursor lists the prompts whose groups are in its buffer snapshot as `buffered`
(asyncrl.job.checkpoint): they are issued again only if the snapshot is missing or damaged, which is
said by name with the number of prompts issued again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from asyncrl.startup import one_line, root_cause, say


def restore_buffer(snapshot: Path, restore: Callable[[str], int], present: Callable[[], list[int]],
                   reissue_lost: Callable[[list[int]], list[int]]) -> list[int]:
    """On resume: the checkpoint's buffer snapshot into the buffer (`restore(path)`), then every prompt
    the checkpoint's cursor lists as `buffered` that the buffer does not hold (`present()`) issued
    again (`reissue_lost`): a missing or damaged snapshot (each said by name) loses no prompt. Returns
    the re-issued prompt indices."""
    if not snapshot.exists():
        say(f"  buffer snapshot {snapshot} is missing")
    else:
        try:
            say(f"  buffer restored from {snapshot}: {restore(str(snapshot.resolve()))} group(s)")
        except Exception as exc:  # noqa: BLE001 - a damaged snapshot: named, its prompts re-issued below
            say(f"  buffer snapshot {snapshot} is damaged and was not loaded ({one_line(root_cause(exc), 200)})")
    lost = reissue_lost(present())
    if lost:
        say(f"  {len(lost)} prompt(s) the checkpoint lists as buffered are not in the buffer: issued again")
    return lost
