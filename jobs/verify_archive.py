"""Ray job entrypoint: `ray job submit --working-dir . -- python jobs/verify_archive.py ...`.

Takes the arguments of `fp8ray verify`; joins the cluster the job runs in (RAY_ADDRESS).
"""

import sys

from fp8ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
