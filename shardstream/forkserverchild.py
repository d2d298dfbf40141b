"""Imported by a fork server that `loader.sigterm_held_for_new_workers` starts (its preload
list names this module), and by nothing else.

That fork server starts with SIGTERM held back, so that a job's SIGTERM (a scheduler signals
every process of the job) cannot end it: its end tells the training process that every
worker it forked has died (multiprocessing reads a worker's exit from the server, and takes
the server's end for an exit, status 255), and a training loop on its way to a checkpoint
failed with "DataLoader worker exited unexpectedly" though the workers lived. A mask lasts
through fork, so each process the server forks lets SIGTERM through again here, as it would
have been: a `Pool`'s workers end at its `terminate()`, and DataLoader workers hold SIGTERM
back again in their `worker_init_fn` (`worker_waits_for_its_parent_on_sigterm`).
"""

from __future__ import annotations

import os
import signal


def _let_sigterm_through() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


os.register_at_fork(after_in_child=_let_sigterm_through)
