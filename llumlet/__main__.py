"""``python -m llumlet``: see :mod:`llumlet.cli`."""

from llumlet.cli import main

raise SystemExit(main())
