"""``python -m bench.showcase``: see :mod:`bench.showcase.report`."""

from bench.showcase.report import main

raise SystemExit(main())
