"""A command run as a Ray job's entrypoint (``ray job submit -- fp8ray compress ...``, or
the checkout's ``jobs/*.py``). A job runs in Ray's copy of its working directory, not
where ``ray job submit`` was typed, so a relative path would name a file the user never
sees: a job refuses one, showing the absolute form to type (``"$PWD/kv"`` expands to it
where the user is)."""

from __future__ import annotations

import os

from ..errors import BadInputError
from .common import INPUT_ARGUMENTS

# The arguments of the commands that name local files or directories: those read, then
# the outputs, and the directory serve reads archives from.
PATH_ARGUMENTS = (*INPUT_ARGUMENTS, "destination", "output", "out", "plot", "archives")


def in_a_job() -> bool:
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ  # set by Ray's job supervisor


def check_job_paths(args) -> None:
    """Refuse, in a job, the relative local paths among ``args``, naming each."""
    if not in_a_job():
        return
    given = [getattr(args, name, None) for name in PATH_ARGUMENTS]
    relative = [str(p) for p in given if p is not None and str(p) != "-"]  # -: standard output
    relative = [p for p in relative if "://" not in p and not os.path.isabs(p)]
    if relative:
        shown = ", ".join(f'{p!r} (type "$PWD/{p}")' for p in relative)
        raise BadInputError(
            f"a job runs in Ray's copy of its working directory, not where it was submitted: give absolute paths, not {shown}"
        )
