"""`python -m pdserve`: the `pdserve` command (where the package is not installed, e.g. a GPU
machine that has the source tree only)."""

from pdserve.cli import main

raise SystemExit(main())
