"""``hilumctl``: the admin CLI that queries the global coordinator over gRPC.

The coordinator and its admin API land with the control-plane issue; until then the command says so.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    del argv
    print(
        "hilumctl: the global coordinator's admin API is not built yet (control-plane issue); nothing to query.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
