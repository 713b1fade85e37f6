"""zl-host's one-line user error, in its own module so that commands kept in other modules
(host/cli/plan.py) raise the very class host/cli/zl_host.py catches, also under `python -m host.cli`."""


class CliError(Exception):
    """A one-line error for the user."""
