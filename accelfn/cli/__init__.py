"""The ``accelfn`` command line: ``config``, ``env``, ``test``, ``launch``, ``estimate-memory`` (one module per
command)."""
