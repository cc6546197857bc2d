"""Ray job entrypoint: `ray job submit --working-dir . -- python jobs/decompress_archive.py ...`.

Takes the arguments of `fp8ray decompress`; joins the cluster the job runs in (RAY_ADDRESS).
"""

import sys

from fp8ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["decompress", *sys.argv[1:]]))
