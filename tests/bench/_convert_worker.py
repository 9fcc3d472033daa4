"""torchrun worker: time ``convert_distributed`` inside the job (no start-up in the number).

::

    torchrun --nproc_per_node W tests/bench/_convert_worker.py SRC DST RESULT

Every process joins the group, meets at a barrier, converts, meets again; rank 0 writes the
slowest process's seconds to RESULT. Start-up (torchrun, imports) is left out, so 1 and 2
processes compare the conversion itself.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from ucformat.write.convert import ConvertSettings
from ucformat.write.distributed_convert import convert_distributed


def main() -> int:
    """Convert ``argv[1]`` into ``argv[2]``; write the timing to ``argv[3]``."""
    src, dst, result = sys.argv[1:4]
    dist.init_process_group("gloo")
    dist.barrier()
    started = time.perf_counter()
    report = convert_distributed(src, dst, ConvertSettings(overwrite=True))
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        written = report.bytes_written
        with open(result, "w") as out:
            json.dump({"seconds": float(seconds.item()), "rank0_bytes": written}, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
