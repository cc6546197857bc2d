"""What every job entrypoint does: run an ``fp8ray`` command in the cluster the job runs
in (RAY_ADDRESS), or say in one line why it cannot. The command itself refuses relative
paths in a job (``fp8ray.cli.jobs``): the same as ``ray job submit -- fp8ray compress ...``
where fp8ray is installed on the cluster, without these files."""

import sys


def run(command: str) -> None:
    try:
        from fp8ray.cli import main
    except ModuleNotFoundError as exc:
        sys.exit(
            f"fp8ray: error: {exc.name} is not installed for {sys.executable}, the Python this job runs in: "
            "start Ray from the environment fp8ray is installed in (. .venv/bin/activate && ray start --head), "
            "or give the job a runtime_env that installs it (README: Ray jobs and clusters)"
        )
    sys.exit(main([command, *sys.argv[1:]]))
