"""The native NCCL transport: NCCL loaded at run time, communicators, and failure operations.

NCCL is never linked. The first use loads ``libnccl.so.2`` from, in order:

1. the file named by ``$LAYOUTLANG_NCCL_LIBRARY`` (when set, only that file: an explicit
   choice that fails is an error, not a silent fallback);
2. a libnccl already loaded in this process (torch's): a symbol in the global namespace
   (``dlsym(RTLD_DEFAULT)``), then any loaded ``libnccl.so*``;
3. the ``nvidia/nccl/lib`` folder of an installed ``nvidia-nccl-cu*`` wheel;
4. ``libnccl.so.2`` from the system's library path.

Functions are resolved on first call; a missing one raises :class:`NcclUnavailableError`
naming it and the NCCL version that introduced it (``ncclCommShrink`` 2.27,
``ncclCommRevoke`` 2.28, ``ncclCommGrow`` and ``ncclCommGetUniqueId`` 2.29). The CUDA
runtime (events, pitched copies) is found the same way (``$LAYOUTLANG_CUDART_LIBRARY``,
this process, the ``nvidia-cuda-runtime-cu*`` wheels, the system).

A :class:`Communicator` is created from a unique id that rank 0 publishes in a
``torch.distributed`` Store (raw bytes, never pickled). It is non-blocking, so a hung peer
can always be aborted. :class:`NcclTransport` runs the executor's exchanges over it: one
``ncclGroupStart``/``ncclGroupEnd`` of sends and receives per exchange, waited on with a
deadline; on a failure or a timeout the communicator is aborted (or revoked) and an
:class:`NcclError` (an :class:`~layoutlang.errors.ExecutionError`) names the peers.

NCCL point-to-point messages carry no tag: between two ranks they match in the order they
are posted. The executor posts its steps in plan order on every rank, so the order is
the same on both ends; the ``tag`` of :meth:`NcclTransport.exchange` is accepted and
ignored.
"""

from .communicator import Communicator, new_unique_id
from .copies import copy_pairs
from .library import (
    CUDART_ENV,
    FEATURES,
    LIBRARY_ENV,
    FeatureFacts,
    LibraryFacts,
    cudart_candidates,
    library_facts,
    load_cuda_runtime,
    load_library,
    nccl_candidates,
)
from .transport import WATCH_SLICE, NcclTransport

__all__ = [
    "CUDART_ENV",
    "FEATURES",
    "LIBRARY_ENV",
    "WATCH_SLICE",
    "Communicator",
    "FeatureFacts",
    "LibraryFacts",
    "NcclTransport",
    "copy_pairs",
    "cudart_candidates",
    "library_facts",
    "load_cuda_runtime",
    "load_library",
    "nccl_candidates",
    "new_unique_id",
]
