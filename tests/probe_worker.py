"""A tiny worker for tests/test_process_start.py: reports what it sees, then exits or
waits to be signalled, as its arguments say."""

import json
import os
import sys
import time

if __name__ == "__main__":
    import torch

    print(json.dumps({"argv": sys.argv[1:], "name": __name__, "cwd": os.getcwd(),
                      "probe": os.environ.get("PROBE"), "threads": torch.get_num_threads(),
                      "pid": os.getpid()}), flush=True)
    sys.stderr.write("to stderr\n")
    if sys.argv[1] == "wait":
        time.sleep(60)
    sys.exit(int(sys.argv[2]))
