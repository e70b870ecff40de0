"""Diagnostic (modules TA / TB: main / 0001 with globaltimer stamps, branches trace-a / trace-b of session 44, diffs
in 0002-trace-stamps-*.patch): per-CTA stamps of the layer kernel's plain launch at T=1, written at the end of the
workspace's slice-sum region (the workspace's end). Eager, no PDL. Stamps in us from the earliest entry."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "layer-trace-s36"))
from trace_layer import print_stamps, run_layer  # noqa: E402

NAMES = {0: "entry", 1: "routes", 8: "ph1_u0_start", 9: "ph1_u0_end", 10: "ph1_u1_start", 11: "ph1_u1_end",
         2: "ph1_end", 3: "sync1", 7: "tail_stored", 12: "ph2_u0_start", 13: "ph2_u0_end", 14: "ph2_u1_start",
         15: "ph2_u1_end", 4: "ph2_end", 5: "sync2", 6: "end"}


def trace(name, e, k, h, inter, family):
    ws, dynamic = run_layer(e, k, h, inter, family)
    grid = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    t = ws[ws.numel() - grid * 16 * 8:].view(torch.int64).view(grid, 16)
    print_stamps(f"{name} {family}, scales {'dynamic' if dynamic else 'static'}", t, NAMES, list(NAMES))


if __name__ == "__main__":
    for family in ("bf16", "fp8"):
        trace("stepfun_issue", 64, 8, 4096, 1536, family)
        trace("step35_flash", 288, 8, 4096, 1280, family)
