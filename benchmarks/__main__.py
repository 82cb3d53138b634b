"""``python -m benchmarks NAME [options]``, from a checkout's root (``benchmarks/cli.py``)."""

from benchmarks.cli import main

# Guarded: multiprocessing's forkserver/spawn start methods re-import the main module.
if __name__ == "__main__":
    raise SystemExit(main())
