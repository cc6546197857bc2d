"""Ray job entrypoint: `ray job submit --working-dir . -- python jobs/compress_archive.py ...`.

Takes the arguments of `fp8ray compress`; joins the cluster the job runs in (RAY_ADDRESS).
"""

import sys

from fp8ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["compress", *sys.argv[1:]]))
