"""ZeroLock stages as torch.distributed ranks (zl-dist, python -m host.dist) and the BP baselines through
torch.distributed.pipelining."""


def main(argv=None) -> int:
    """The zl-dist console script's entry point (pyproject: host.dist:main). Imported when called, so that
    importing host.dist.pipelining does not load the ranks' module."""
    from .ranks import main as ranks_main

    return ranks_main(argv)
