"""The paper's Table 2 arms (serving-paper.md §6): the full tokenflow setup and three cache-config changes to it.

Both the engine bench (`tokenflow bench policies --ablation`) and the simulator (`tokenflow simulate --ablation`)
run these arms, so each names the same change in both.
"""

from __future__ import annotations

ABLATIONS = {  # the paper's Table 2 columns, as cache-config changes to the full tokenflow setup
    "tokenflow": {},
    "no_offload": {"num_host_blocks": 0},  # recompute only
    "no_write_through": {"write_through": False},  # write on preempt
    "no_overlap": {"overlap_copies": False},  # copies block the model step
}
