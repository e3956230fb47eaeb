"""Run ``python -m d9dfn ARGV`` (or the script ``ARGV[0]``) and SIGKILL it at a chosen write into a compile cache
(tests/test_cache_heal.py).

    python tests/_kill_at_write.py MODE PATTERN ORDINAL LOG -- ARGV...

Every ``os.replace``, ``os.rename`` and ``os.link`` (torch's atomic writes, d9dfn's builds, seals and host links go
through them) whose destination lies under one of the roots in ``D9DFN_TEST_WRITE_ROOTS`` (``os.pathsep``-separated)
and matches the regular expression ``PATTERN`` is counted. ``MODE``:

- ``record``: append each such destination to ``LOG`` (one a line) and kill nothing;
- ``kill``: SIGKILL the process at the ``ORDINAL``-th one (from 1), before it is made: its temporary file is left;
- ``truncate``: make the ``ORDINAL``-th one, empty the file, then SIGKILL the process: a file under its final name that
  was never finished (what a non-atomic write, or a crash that lost the unsynced data, leaves).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

# Read at run time only: pytest's --doctest-modules imports this file too, with no arguments.
if __name__ == "__main__":
    MODE, PATTERN, ORDINAL, LOG = sys.argv[1], re.compile(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ROOTS = [os.path.abspath(root) for root in os.environ["D9DFN_TEST_WRITE_ROOTS"].split(os.pathsep) if root]
_count = 0
_lock = threading.Lock()


def _matches(destination: object) -> bool:
    path = os.path.abspath(os.fsdecode(destination))  # type: ignore[arg-type]
    return any(path.startswith(root + os.sep) for root in ROOTS) and PATTERN.search(path) is not None


def _watched(write):  # type: ignore[no-untyped-def]
    def watched(source, destination, *args, **kwargs):  # type: ignore[no-untyped-def]
        global _count
        if not _matches(destination):
            return write(source, destination, *args, **kwargs)
        with _lock:
            _count += 1
            hit = _count == ORDINAL
            if MODE == "record":
                with open(LOG, "a") as log:
                    log.write(os.fsdecode(destination) + "\n")
            elif hit and MODE == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            result = write(source, destination, *args, **kwargs)
            if hit and MODE == "truncate":
                os.truncate(destination, 0)
                os.kill(os.getpid(), signal.SIGKILL)
            return result

    return watched


if __name__ == "__main__":
    os.replace, os.rename, os.link = _watched(os.replace), _watched(os.rename), _watched(os.link)
    argv = sys.argv[sys.argv.index("--") + 1 :]
    if argv[0].endswith(".py"):  # a script of its own (tests/_tiny_compiled_job.py)
        import runpy

        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    else:
        from d9dfn.cli import main

        sys.exit(main(argv))
