"""Ray job entrypoint: `ray job submit --working-dir . -- python jobs/decompress_archive.py ...`.

Takes the arguments of `fp8ray decompress`; joins the cluster the job runs in (RAY_ADDRESS).
"""

from _entry import run

if __name__ == "__main__":
    run("decompress")
