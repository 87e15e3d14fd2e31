"""``python -m chorus.run ...`` is ``chorusrun ...`` (like ``python -m torch.distributed.run``)."""

import sys

from chorus.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
