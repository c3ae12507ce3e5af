"""Start training processes on torch's elastic agent: `accelfn launch` as a library.

This package's ``__init__`` imports nothing heavy, so core modules may read the launcher's
environment contract (``accelfn.launch_env``) without loading the launcher itself.

Example:
    >>> from accelfn.launch_env import read_env
    >>> read_env({"ACCELFN_MESH": "dp=2,tp=1"}).mesh
    {'dp': 2, 'tp': 1}
"""
