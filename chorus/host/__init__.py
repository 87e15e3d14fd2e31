"""This machine as chorus's ranks share it: which host a rank is on (``identity``) and the
``/dev/shm`` segments they map (``segment``).  Below the transport, which moves same-host
payloads through segments, and the shared-memory windows (chorus.shm), which live in them."""
