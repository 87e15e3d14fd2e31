"""Transports: move byte regions between ranks (``base`` defines the interface;
``loopback`` for ranks as threads, ``tcp`` for processes and hosts)."""
