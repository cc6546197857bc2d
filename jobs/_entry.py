"""What every job entrypoint does: run an ``fp8ray`` command in the cluster the job runs
in (RAY_ADDRESS), or say in one line why it cannot.

A job runs in Ray's copy of its working directory, not where ``ray job submit`` was
typed, so a relative path would name a file the user never sees: a job refuses one,
showing the absolute form to type (``"$PWD/kv"`` expands to it where the user is)."""

import os
import sys

# The arguments of compress, decompress and verify that name local files or directories.
PATH_ARGUMENTS = ("source", "destination", "archive", "output", "against")


def _in_a_job() -> bool:
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ  # set by Ray's job supervisor


def _relative_paths(args) -> list[str]:
    paths = [getattr(args, name, None) for name in PATH_ARGUMENTS]
    return [p for p in paths if p and "://" not in p and not os.path.isabs(p)]


def run(command: str) -> None:
    try:
        from fp8ray.cli import build_parser, main
    except ModuleNotFoundError as exc:
        sys.exit(
            f"fp8ray: error: {exc.name} is not installed for {sys.executable}, the Python this job runs in: "
            "start Ray from the environment fp8ray is installed in (. .venv/bin/activate && ray start --head), "
            "or give the job a runtime_env that installs it (README: Ray jobs and clusters)"
        )
    argv = [command, *sys.argv[1:]]
    if _in_a_job():
        relative = _relative_paths(build_parser().parse_args(argv))
        if relative:
            shown = ", ".join(f'{p!r} (type "$PWD/{p}")' for p in relative)
            sys.exit(
                f"fp8ray: error: a job runs in Ray's copy of its working directory, not where it was submitted: "
                f"give absolute paths, not {shown}"
            )
    sys.exit(main(argv))
