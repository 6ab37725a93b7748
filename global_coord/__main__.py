"""``python -m global_coord`` runs one coordinator replica (see ``global_coord.cli``)."""

from global_coord.cli import main

raise SystemExit(main())
