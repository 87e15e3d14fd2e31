import numpy as np
import pytest
from torch_support import needs_torch, torch

from chorus.buffers import as_buffer
from chorus.errors import InvalidTensorError

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_contiguous_is_zero_copy(dtype):
    a = np.arange(12).astype(dtype).reshape(3, 4)
    buf = as_buffer(a)
    assert buf.dtype == dtype and buf.numel == 12 and not buf.copied
    assert np.shares_memory(buf.array, a)
    assert len(buf.bytes_view()) == a.nbytes


def test_numpy_non_contiguous_copies_and_writes_back():
    a = np.zeros((4, 4), np.int32)
    view = a[:, 1]
    buf = as_buffer(view)
    assert buf.copied
    buf.array[:] = [1, 2, 3, 4]
    buf.finish()
    assert a[:, 1].tolist() == [1, 2, 3, 4] and a[:, 0].tolist() == [0, 0, 0, 0]


@needs_torch
@pytest.mark.parametrize("dtype", ["bool", "int8", "int64", "float16", "bfloat16", "float32", "complex64"])
def test_torch_tensors_zero_copy_including_bfloat16(dtype):
    t = torch.ones(6, dtype=getattr(torch, dtype))
    buf = as_buffer(t)
    assert buf.dtype == dtype and buf.is_torch and not buf.copied
    assert buf.nbytes == t.numel() * t.element_size()
    view = buf.bytes_view()
    view[:] = bytes(len(view))  # writing the view writes the tensor
    assert torch.equal(t, torch.zeros_like(t))


@needs_torch
def test_torch_non_contiguous_bfloat16_writes_back():
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    col = t[:, 2]
    buf = as_buffer(col)
    assert buf.copied
    src = torch.tensor([1.5, 2.5, 3.5, 4.5], dtype=torch.bfloat16)
    buf.array[:] = src.view(torch.int16).numpy().view(np.uint16)
    buf.finish()
    assert t[:, 2].tolist() == [1.5, 2.5, 3.5, 4.5] and t[:, 1].abs().sum().item() == 0


@needs_torch
def test_requires_grad_tensor_is_accepted():
    t = torch.ones(3, requires_grad=True)
    assert as_buffer(t).numel == 3


@pytest.mark.parametrize("bad", [[1, 2, 3], 3.0, "abc", np.array(["a", "b"]), np.array([object()])])
def test_non_tensors_are_rejected_with_op_name(bad):
    with pytest.raises(InvalidTensorError, match="send"):
        as_buffer(bad, op="send")
