"""The ``accelfn`` command line: ``config``, ``env``, ``test``, ``launch`` (one module per command)."""
