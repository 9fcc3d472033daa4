"""The ``ucformat`` command line (installed as the import package ``ucformat_cli``)."""
