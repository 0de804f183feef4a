"""fusion_compiler: fuse convolution chains of PyTorch models into cuDNN execution plans.

Front doors: :func:`compile` (returns an ``nn.Module``; its options are the fields of
:class:`CompileOptions`), :func:`check` (numerics against an fp64 reference, per region),
``torch.compile(model, backend="fusion_compiler")`` (registered by this import) and the
``fusion-compiler`` CLI (``dump``, ``check``, ``bench``). The layout of the package:
``docs/architecture.md``.
Logging goes to the ``fusion_compiler`` logger; ``FUSION_COMPILER_LOG=debug`` (or ``info``) sends
it to stderr at that level, ``debug`` including every pass's graph.
"""

import logging as _logging
import os as _os

from .compiler import CompiledModule, compile
from .config import CompileOptions
from .dynamo import register as _register_dynamo_backend
from .ir.errors import FusionError, InputError, UnsupportedError
from .tools.check import CheckReport, check

__all__ = ["compile", "CompiledModule", "CompileOptions", "check", "CheckReport", "FusionError",
           "InputError", "UnsupportedError", "__version__"]
__version__ = "0.1.0"

_register_dynamo_backend()

_level = _os.environ.get("FUSION_COMPILER_LOG")
if _level:
    _logger = _logging.getLogger("fusion_compiler")
    _logger.setLevel(_level.upper())
    _logger.addHandler(_logging.StreamHandler())
