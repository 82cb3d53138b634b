"""``python -m torchshard {demo,bench,layout}``."""

from torchshard._cli import main

raise SystemExit(main())
