"""One exception type per kind of bad input, so the CLI prints one clear line and exits non-zero."""


class ExportError(Exception):
    """Base class: the message is a single line naming the problem and the fix."""


class ChunkSpecError(ExportError):
    pass


class ModelDirError(ExportError):
    pass


class OutputDirError(ExportError):
    pass


class VerifyError(ExportError):
    pass
