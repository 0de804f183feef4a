"""Exceptions raised by fusion_compiler."""

from __future__ import annotations

from typing import Mapping


class FusionError(RuntimeError):
    """A graph the compiler cannot handle, or a pass result that breaks the cuDNN graph rules.

    Attributes:
        node: name of the fx node at fault, or ``None`` when the error is not tied to one node.
    """

    def __init__(self, message: str, node: str | None = None):
        self.node = node
        super().__init__(f"{node}: {message}" if node else message)


class InputError(ValueError):
    """A compiled model called with inputs it cannot take: another device than its parameters, or
    a shape the model does not take. The message names the input, what it got and, where known,
    what the model takes; it is raised without the compiler's frames or chained errors."""


class InputTypeError(InputError, TypeError):
    """An :class:`InputError` of type: the wrong number of inputs, or a floating input of another
    dtype than the model's parameters (also a ``TypeError``)."""


class InputShapeError(InputError):
    """An :class:`InputError` found by running the captured graph on the inputs: the model does
    not take their shapes. The message carries the failing op's error; the compiled module
    replaces it with eager PyTorch's own message for the inputs."""


class UnsupportedError(RuntimeError):
    """A backend declined a region; ``reason`` is the backend's own explanation.

    Attributes:
        reason: why, in the backend's words.
        region: the region id, or ``None``.
        timing: when the backend declined because it timed slower, ms per call by backend name
            (``"reference"``: the region's PyTorch ops), else empty.
        nhwc_inputs: positions of the region inputs the PyTorch ops were timed on as
            channels_last activations (the graph should hand them so), else empty.
    """

    def __init__(self, reason: str, region: str | None = None, *,
                 timing: Mapping[str, float] | None = None,
                 nhwc_inputs: frozenset[int] = frozenset()):
        self.reason = reason
        self.region = region
        self.timing = dict(timing or {})
        self.nhwc_inputs = nhwc_inputs
        super().__init__(f"{region}: {reason}" if region else reason)


class TimingDeferred(RuntimeError):
    """GPU timing was asked for where it must not run (beside a caller's GPU work: tier 0's
    background lowering, :func:`fusion_compiler.backends.timing.timing_deferred`); the work is
    to be redone where timing may run."""


def condense(text: str, limit: int = 300) -> str:
    """One line of at most ``limit`` characters from a (often multi-line) backend message."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
