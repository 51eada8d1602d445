"""The ``fedpart`` command (``python -m fedpart``): main.py parses the command line and runs each
subcommand; the subcommands that exist only on the command line live beside it: ``fedpart
compare`` (compare.py) and ``fedpart export`` (export.py). What a command drives lives in its own
folder: the local launcher and the run credentials in ``fedpart.deploy``, the report in
``fedpart.report``, the server and the client in theirs."""
