"""What the compiler (exporter/) and the runtime (zl_mobile/) both use: a file's sha256, quieting
library messages that are not errors, and an ExecuTorch program called by the names its manifest
records. It imports none of the project's other packages."""
