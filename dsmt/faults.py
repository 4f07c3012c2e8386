"""Faults injected on purpose, for the reliability tests, from the ``DSMT_FAULT`` environment variable.

``DSMT_FAULT="nan@5,kill_in_save@20@1"``: a comma-separated list of ``kind@step`` or ``kind@step@rank``
(without a rank, every rank). Kinds: ``nan`` (the loss of that step's batch becomes NaN), ``kill``
(SIGKILL at the start of the step), ``kill_in_save`` (SIGKILL after this rank wrote its part of the step's
checkpoint, before it becomes visible), ``enospc`` (writing the step's checkpoint fails: no space left),
``hang`` (this rank stops at the start of the step until a signal arrives: a stuck rank).
Unset, nothing happens; the training loop pays one dict lookup per hook.
"""

import errno
import os
import signal

KINDS = ("nan", "kill", "kill_in_save", "enospc", "hang")


def _parse(spec: str) -> set[tuple[str, int, int | None]]:
    faults = set()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, step, *rank = item.split("@")
        if kind not in KINDS or len(rank) > 1:
            raise ValueError(f"DSMT_FAULT item {item!r}: expected KIND@STEP[@RANK] with KIND in {KINDS}")
        faults.add((kind, int(step), int(rank[0]) if rank else None))
    return faults


FAULTS = _parse(os.environ.get("DSMT_FAULT", ""))


def due(kind: str, step: int, rank: int) -> bool:
    return (kind, step, None) in FAULTS or (kind, step, rank) in FAULTS


def trigger(kind: str, step: int, rank: int) -> None:
    """Carry out a ``kill``, ``kill_in_save``, ``enospc`` or ``hang`` fault if one is due here."""
    if not due(kind, step, rank):
        return
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"step{step} (DSMT_FAULT)")
    if kind == "hang":
        signal.pause()
        return
    os.kill(os.getpid(), signal.SIGKILL)
