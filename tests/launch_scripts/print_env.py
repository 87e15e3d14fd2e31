"""Print this rank's launcher environment and argv as JSON (stdout) plus stderr lines."""

import json
import os
import sys

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "CHORUS_TOKEN", "CHORUS_JOB_ID", "TORCHELASTIC_RUN_ID",
        "PYTHONUNBUFFERED", "CHORUS_STORE_HOSTED", "CHORUS_STORE_PORT"]

rank = os.environ["RANK"]
print("ENV " + json.dumps({"env": {k: os.environ.get(k) for k in KEYS}, "argv": sys.argv[1:]}))
print(f"second stdout line of rank {rank}")
print(f"stderr line of rank {rank}", file=sys.stderr)
sys.stdout.write(f"partial last line of rank {rank}")
