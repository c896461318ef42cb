"""The exception types a user can cause. The CLI turns each into one line and an exit code."""


class ReflexError(Exception):
    """Bad input or an unsupported request: reported as one line, exit code 1. `field` names the
    request field at fault, where there is one (an IPC error line carries it)."""

    exit_code = 1

    def __init__(self, message: str = "", *, field: str | None = None):
        super().__init__(message)
        self.field = field


class GGUFError(ReflexError):
    """A malformed or unsupported GGUF file; the message names the field and byte offset."""

    exit_code = 2


class CudaUnavailable(ReflexError):
    """No NVIDIA driver, no GPU, or no kernels in this install for the GPU: `--device auto`
    falls back to the CPU; `--device cuda` reports it."""


class ContextExceeded(ReflexError):
    """The prompt (with system1's candidates) does not fit the context."""
