"""Connect to the store the launcher hosts (CHORUS_STORE_PORT), add 1 to "n", wait until n == world size."""

import os
import time

from chorus.store import TCPStore

world = int(os.environ["WORLD_SIZE"])
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["CHORUS_STORE_PORT"]), is_master=False,
                 token=os.environ["CHORUS_TOKEN"])
store.add("n", 1)
deadline = time.monotonic() + 20
while int(store.add("n", 0)) < world:
    if time.monotonic() > deadline:
        raise SystemExit(f"rank {os.environ['RANK']}: only {store.add('n', 0)} of {world} arrived")
    time.sleep(0.02)
print(f"rank {os.environ['RANK']} saw {world} ranks in the store")
