"""``python -m ucformat``: the ``ucformat`` command (the same as ``python -m ucformat_cli``).

The library does not import the command line; only running the package as a program does.
"""

from ucformat_cli._entry import run

run()
