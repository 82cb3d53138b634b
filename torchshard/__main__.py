"""``python -m torchshard {demo,bench,layout}``."""

from torchshard._tools.cli import main

# Guarded: multiprocessing's forkserver/spawn start methods re-import the main module.
if __name__ == "__main__":
    raise SystemExit(main())
