"""accelfn's version, in a module that imports nothing (so `accelfn.checkpoint` need not import the package)."""

__version__ = "0.1.0"
