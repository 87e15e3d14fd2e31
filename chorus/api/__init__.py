"""The torch.distributed-compatible functions (``import chorus as dist`` re-exports them)."""
