"""``python -m paddle_cluster`` and the ``paddle-cluster`` command (pyproject's entry point)."""

import sys


def entry() -> None:
    """The CLI; Ctrl+C while its modules are still being imported (the first few tenths of a second) ends it as
    at any other moment -- one line and exit 130 -- not with a traceback of the import."""
    try:
        from paddle_cluster.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("paddle-cluster: interrupted\n")
        sys.exit(130)
    main()


if __name__ == "__main__":
    entry()
