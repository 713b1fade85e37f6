"""zl-host's command line: the parser (zl_host.py) and the subcommands' front ends."""


def main(argv=None) -> int:
    """The zl-host console script's entry point (pyproject: host.cli:main). Imported when called, so that
    importing host.cli.error or host.cli.option_types, which run modules use, does not load every command."""
    from .zl_host import main as zl_host_main

    return zl_host_main(argv)
