"""Example-only shim: run the seeds' GPU code unchanged on a machine without a GPU.

The seeds bind a GPU (``torch.cuda.set_device(rank)``), make tensors on it
(``device="cuda"``) and pick the ``"nccl"`` backend.  A seed example imports this module
in one line, right after its imports::

    import _cpu_fallback  # noqa: F401 -- not in the seed: ...

Where ``torch.cuda.is_available()`` is True it does nothing at all: the seed runs on the
GPUs exactly as written.  Where no GPU exists it makes, for this process only:

- ``torch.cuda.set_device(...)`` a no-op;
- ``"cuda"`` (``"cuda:N"``, ``torch.device("cuda", N)``) mean the CPU wherever a tensor
  is made or moved (``device=`` of factories such as ``torch.tensor``, ``.to(...)``,
  ``.cuda()``), through a ``torch.overrides.TorchFunctionMode`` on the main thread;
- ``torch.distributed.init_process_group(backend="nccl")`` use ``"gloo"``, because
  torch's CPU builds have no NCCL -- this only matters for the torch.distributed version
  of a seed (the tests' and run_on_gpus.sh's comparison); chorus serves ``"nccl"`` on CPU
  tensors itself and never goes through torch's function.

It lives in examples/seeds/ and nothing in chorus imports it.
"""

import functools

import torch
import torch.distributed
from torch.overrides import TorchFunctionMode


def _is_cuda(device):
    if isinstance(device, str | torch.device):
        return torch.device(device).type == "cuda"
    return False


class _CudaMeansCpu(TorchFunctionMode):
    """``device="cuda"``, ``.to("cuda")``, ``.to(0)`` and ``.cuda()`` give CPU tensors."""

    # where the device is the first argument after the tensor (Tensor.to) or the first one
    # (Module.to parses its arguments with _parse_to); an int there is a GPU's index
    _TO = {torch.Tensor.to: 1, torch._C._nn._parse_to: 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = list(args), dict(kwargs or {})
        at = self._TO.get(func)
        device = kwargs.get("device")
        if _is_cuda(device) or (at is not None and type(device) is int):
            kwargs["device"] = "cpu"
        if at is not None and len(args) > at and (_is_cuda(args[at]) or type(args[at]) is int):
            args[at] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _gloo_for_nccl(init_process_group):
    @functools.wraps(init_process_group)
    def wrapper(backend=None, *args, **kwargs):
        return init_process_group("gloo" if backend == "nccl" else backend, *args, **kwargs)

    return wrapper


if not torch.cuda.is_available():
    torch.cuda.set_device = lambda device: None
    torch.distributed.init_process_group = _gloo_for_nccl(torch.distributed.init_process_group)
    _CudaMeansCpu().__enter__()
