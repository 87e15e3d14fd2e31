"""chorus.cuda.peer_sum's PTX kernel on a GPU: the column sums of int64 rows read through
their addresses, for the widths the workspace check uses and the largest."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from chorus.cuda import peer_sum  # noqa: E402


@pytest.mark.parametrize("width", [1, 2, 3, 4, 8, 1000, peer_sum.MAX_WIDTH])
def test_sum_rows_sums_each_column_of_rows_read_by_address(width):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(width)
    rows = [torch.randint(-2**40, 2**40, (width,), generator=gen, dtype=torch.int64).to(dev) for _ in range(width)]
    table = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=dev)
    out = torch.full((width,), -1, dtype=torch.int64, device=dev)
    stream = torch.cuda.current_stream(dev)
    peer_sum.sum_rows(table.data_ptr(), out.data_ptr(), width, stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(out, torch.stack(rows).sum(dim=0))

