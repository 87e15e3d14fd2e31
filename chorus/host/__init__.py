"""This machine as chorus's ranks share it: which host a rank is on (``identity``), the
``/dev/shm`` segments they map (``segment``) and the secret a job on one host derives
when nobody gave it a token (``secret``).  Below the transport, which moves same-host
payloads through segments, and the shared-memory windows (chorus.shm), which live in them."""
