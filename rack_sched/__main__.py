"""``python -m rack_sched`` runs one domain scheduler (see ``rack_sched.cli``)."""

from rack_sched.cli import main

raise SystemExit(main())
