"""Command-line front ends: ``pinpriq-server`` (``cli.server``) and the ``pinpriq`` client
(``cli.client``), with the argument types they share (``cli.args``).

Argument errors, startup failures and connection errors print one line and exit non-zero; no
traceback reaches the user.
"""
