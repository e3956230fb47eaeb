"""The command line: ``d9dfn train``, ``d9dfn infer``, ``d9dfn export`` (also ``python -m d9dfn``).

Under ``torchrun``, the evaluation (after ``train``, and ``infer``) runs on rank 0 alone after the other ranks
leave, except on a pipeline mesh (``mesh.pipeline_parallel > 1``): there every rank evaluates its stage with the
inference schedule, and rank 0 prints.

Argument parsing and exit codes live here and nowhere else. The code says *when* something went wrong:

* 0: success.
* 2: bad input found before the run starts: a usage error (argparse), a config that does not load or
  validate, a missing file, a model too large for the device's memory, a checkpoint that is missing,
  corrupted or does not fit the job on resume. Exactly one line ``d9dfn: error: ...`` names the field or file
  and the fix (a message of several lines is joined into one). A corrupted checkpoint is refused alike by
  ``train``, ``infer`` and ``export`` (each checks the whole step: ``docs/design/checkpoints.md``), and the line
  names the command's option that reads another step (``--resume-from`` / ``--step``). Under ``torchrun`` the
  line goes to torchrun's error file instead of stderr: torchrun's block of failed ranks ends with it, once
  (``_errors.to_torchrun``).
* 1: a failure once the run has started (after ``train.ready`` / ``inference.ready``: a task's shape
  error, a NaN loss, a full disk, a dead peer), or an unexpected error during set-up: a one-line
  ``d9dfn: error: ...`` summary (what failed, the newest checkpoint on disk, how to resume), then the
  traceback, then the summary again, so that it is also the last line (under ``torchrun``, also in torchrun's
  block).
* 143 (SIGTERM) / 130 (SIGINT, Ctrl-C): stopped by the signal. During training the step in flight finishes and
  its checkpoint is committed first (``Trainer.train`` raises ``TrainingStopped``), except the first step, whose
  compile stops at once (nothing of it is written yet); elsewhere (set-up, evaluation) the command stops where it
  is. One line ``d9dfn: stopped by SIGTERM ...`` says what happened,
  the checkpoint a rerun resumes from and the command to rerun. A second signal exits at once, same code.

Errors that background threads report while the command runs (orbax's writer threads log each failed write
with its traceback; tensorstore's callbacks print theirs) are held back: after a failure they go to
``error.log`` in the run directory (``error.rank<N>.log`` on other ranks; on stderr before the last line when
that cannot be written, e.g. on a full disk), and the last line says where; after a success they are printed.
"""

from d9dfn.cli._main import main

__all__ = ["main"]
