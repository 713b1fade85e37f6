"""zl-host's one-line user error, in its own module so that commands kept in other modules
(host/plan_cli.py) raise the very class host/cli.py catches, also under `python -m host.cli`."""


class CliError(Exception):
    """A one-line error for the user."""
