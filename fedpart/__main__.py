"""``python -m fedpart ...``: the ``fedpart`` command."""

from fedpart.cli.main import command

command()
