"""Child processes that take Ctrl-C the way a terminal's foreground job does, however the test runner was started.

A test runner started in the background by a non-interactive shell inherits SIGINT *ignored*, and so does every
process it spawns: Python then installs no KeyboardInterrupt handler, and a test that interrupts a child to check
its exit code 130 would watch the child run to completion instead.
"""

from __future__ import annotations

import signal

__all__ = ["default_sigint"]


def default_sigint() -> None:
    """Give the calling (child) process the default SIGINT disposition; for ``subprocess.Popen(preexec_fn=...)``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
