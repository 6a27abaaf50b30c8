#!/usr/bin/env python3
"""The plot of `scripts/soak`: the server's RSS and open files, the
database's size and the SSE follower's lag over the soak, one panel each,
from the soak's CSV.

    soak_plot.py SAMPLES.csv OUT.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: soak_plot.py SAMPLES.csv OUT.png")
    with open(argv[1]) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"soak_plot.py: {argv[1]} has no samples")
    minutes = [float(r["elapsed_s"]) / 60 for r in rows]
    panels = [
        ("server RSS (MiB)", [int(r["server_rss_bytes"]) / 2**20 for r in rows]),
        ("server open files", [int(r["server_open_files"]) for r in rows]),
        ("database size (MiB)", [int(r["database_bytes"]) / 2**20 for r in rows]),
        ("SSE follower lag (events)", [int(r["sse_lag_events"]) for r in rows]),
    ]
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 10), sharex=True)
    for axis, (label, values) in zip(axes, panels):
        axis.plot(minutes, values)
        axis.set_ylabel(label)
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
    axes[-1].set_xlabel("minutes into the soak")
    figure.suptitle(f"idem soak: {argv[1]}")
    figure.tight_layout()
    figure.savefig(argv[2], dpi=100)


if __name__ == "__main__":
    main(sys.argv)
