"""Key-value stores for rendezvous (the torch.distributed ``Store`` family).

- ``HashStore``: in one process (ranks as threads).
- ``FileStore``: a file on a shared file system.
- ``TCPStore``: over TCP, served by a ``TCPStoreServer`` (hosted by rank 0 or a launcher).
- ``PrefixStore``: a namespaced view of another store.
"""

from chorus.store.base import Store
from chorus.store.file_store import FileStore
from chorus.store.hash_store import HashStore
from chorus.store.prefix_store import PrefixStore
from chorus.store.tcp_server import REFUSALS_KEY, REFUSED_KEY, TCPStoreServer
from chorus.store.tcp_store import TCPStore

__all__ = ["REFUSALS_KEY", "REFUSED_KEY", "FileStore", "HashStore", "PrefixStore", "Store", "TCPStore",
           "TCPStoreServer"]
