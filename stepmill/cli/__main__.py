"""``python -m stepmill.cli``: the same as the ``stepmill`` command."""

from stepmill.cli import main

main()
