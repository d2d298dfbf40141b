"""fsspec's event loop across fork: what a forked child must be told about its parent's loop.

fsspec runs remote filesystems' I/O on one event loop in a thread of its own. A process
that has used it and then forks (a DataLoader starting its workers) hands the child that
loop object, the epoll file it polls, and the HTTP sessions of its filesystems; the
loop's thread does not come along. Two things go wrong in the child unless it is told:

* fsspec's finalizers close the inherited sessions, unregistering their sockets from
  the *shared* epoll: the parent's pooled connection then never reports its response,
  and the parent's next request hangs until the read timeout (seen: 300 s, on the
  manifest read of a resume after a first iteration). The child gets a private epoll.
* The inherited loop still says it is running, so those finalizers hand the close to
  it and wait for an answer that cannot come: fsspec's `sync` waits in whole seconds,
  so every worker stalled 1 s at its first garbage collection (seen: every epoch's
  first batch 1 s late, also from local data, once the main process had read over
  HTTP). Marked as stopped, the loop lets the finalizers close the sockets directly.
  They then find the sessions open, and say so: the child's copy of the loop does not
  report that (`_quiet_about_the_parents_sessions`).

Importing this module registers the fork handlers (`storage` imports it); it has nothing
else to call.
"""

from __future__ import annotations

import os
import select
import sys
from typing import Any

__all__: list[str] = []

_parent_loop: list[Any] = [None]


def _remember_loop() -> None:
    asyn = sys.modules.get("fsspec.asyn")  # not imported: no loop to hand over
    _parent_loop[0] = asyn.loop[0] if asyn is not None else None


def _detach_loop_in_child() -> None:
    loop, _parent_loop[0] = _parent_loop[0], None
    if loop is None:
        return
    asyn = sys.modules.get("fsspec.asyn")
    if asyn is not None and not hasattr(asyn, "reset_after_fork"):
        # fsspec before 2025.5 (the library takes 2023.6 on) handed the child its parent's loop
        # as its own, whose thread stayed in the parent: a forked DataLoader worker's first
        # read through fsspec waited forever. What later fsspec does at fork, done for it.
        asyn.loop[0] = asyn.iothread[0] = None
        asyn._lock = None
    selector = getattr(getattr(loop, "_selector", None), "_selector", None)
    if selector is not None and hasattr(select, "epoll") and isinstance(selector, select.epoll):
        loop._selector._selector = select.epoll()  # unregister() on it fails quietly (OSError is ignored)
        selector.close()  # this process's copy only
    if getattr(loop, "_thread_id", None) is not None:
        loop._thread_id = None  # its thread stayed in the parent: is_running() is now False
    if hasattr(loop, "set_exception_handler"):
        loop.set_exception_handler(_quiet_about_the_parents_sessions)


def _quiet_about_the_parents_sessions(loop: Any, context: dict[str, Any]) -> None:
    """The inherited loop's exception handler in a child. Only the parent's sessions use that
    loop (fsspec makes the child a loop of its own, or `_detach_loop_in_child` has it make
    one), and the child must not close them:
    their finalizers, finding them open, logged "Unclosed client session" once a worker
    for each (every DataLoader worker, every epoch, once the main process had used s3fs),
    which read as a leak. Anything else is reported as usual."""
    if str(context.get("message", "")).startswith(("Unclosed client session", "Unclosed connector")):
        return
    loop.default_exception_handler(context)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_remember_loop, after_in_child=_detach_loop_in_child,
                        after_in_parent=lambda: _parent_loop.__setitem__(0, None))
