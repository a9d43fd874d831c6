"""Fault injection for the kill-storm tests: a worker that SIGKILLs itself at a chosen moment of its work.

`ATTNLAB_DIE_AT="<moment>:<n>"` makes this process SIGKILL itself the n-th time it reaches `<moment>`; with
`ATTNLAB_DIE_LOG=<file>` it first appends `{"pid", "moment", "n"}` to that file, so a test knows where each death
landed. The moments are the ones an external `kill` rarely hits, where a trial could be lost or counted twice:

- `claim`: the claim lock held, the point's RUNNING trial created, not yet checked against other claims;
- `fit_done`: the fit returned (its run directory marked finished), nothing of it recorded in the study yet;
- `recording`: the result's user attrs written, the trial not yet COMPLETE;
- `journal_write`: the journal file's lock held and half of an append written (a torn record left behind);
- `db_commit`: a database transaction open, before its COMMIT (row locks held; the server rolls it back).

Without ATTNLAB_DIE_AT, `reached` is one dictionary lookup and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

MOMENTS = ("claim", "fit_done", "recording", "journal_write", "db_commit")
_seen: dict[str, int] = {}


def planned() -> tuple[str, int] | None:
    """The (moment, n) of ATTNLAB_DIE_AT, or None. A value that does not parse is an error naming it."""
    spec = os.environ.get("ATTNLAB_DIE_AT")
    if not spec:
        return None
    moment, _, n = spec.partition(":")
    if moment not in MOMENTS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"ATTNLAB_DIE_AT={spec!r}: expected <moment>:<n> with a moment of {MOMENTS} and n >= 1")
    return moment, int(n)


def reached(moment: str, before_death: Callable[[], object] | None = None) -> None:
    """This process is at `moment`: SIGKILL it now if ATTNLAB_DIE_AT says so (after `before_death`, e.g. half
    a write)."""
    plan = planned()
    if plan is None or plan[0] != moment:
        return
    _seen[moment] = _seen.get(moment, 0) + 1
    if _seen[moment] != plan[1]:
        return
    log = os.environ.get("ATTNLAB_DIE_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "moment": moment, "n": plan[1]}) + "\n")
    if before_death is not None:
        before_death()
    os.kill(os.getpid(), signal.SIGKILL)
