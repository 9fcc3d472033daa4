"""``python -m ucformat_cli``: the ``ucformat`` command (what ``torchrun -m ucformat_cli`` runs)."""

from ucformat_cli._entry import run

run()
