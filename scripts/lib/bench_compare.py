#!/usr/bin/env python3
"""The side-by-side table of `scripts/bench --baseline`: each step's wall
time for the baseline commit and for this checkout (the median of the
rounds, and every round's figure), the ratio of the medians, and the
summary lines of both, which must match.

    bench_compare.py SHORT_REV baseline=FILE current=FILE ...
"""

import json
import statistics
import sys

STEPS = ["register", "connect", "converged", "normal", "forced", "full_push", "rollout", "resync", "ingest"]


def main(argv):
    if len(argv) < 3:
        sys.exit("usage: bench_compare.py SHORT_REV baseline=FILE current=FILE ...")
    rev = argv[1]
    runs = {"baseline": [], "current": []}
    for arg in argv[2:]:
        side, _, path = arg.partition("=")
        if side not in runs:
            sys.exit(f"bench_compare.py: {arg}: expected baseline=FILE or current=FILE")
        with open(path) as f:
            runs[side].append(json.load(f))
    if not runs["baseline"] or not runs["current"]:
        sys.exit("bench_compare.py: needs at least one run of each side")

    def walls(run):
        return {s["name"]: s["wall_s"] for s in run["steps"]}

    def figures(side, name):
        return [walls(r)[name] for r in runs[side] if name in walls(r)]

    n = runs["current"][0]["settings"]["devices"]
    print(f"\n{rev} against this checkout, {n} devices, "
          f"{len(runs['baseline'])} + {len(runs['current'])} runs alternated (medians; each run in brackets):")
    print(f"{'step':<10} {rev + ' s':>12} {'this s':>9} {'this / ' + rev:>18}   runs")
    names = STEPS + sorted({s["name"] for r in runs["current"] for s in r["steps"]} - set(STEPS))
    for name in names:
        base, cur = figures("baseline", name), figures("current", name)
        if not base or not cur:
            continue
        b, c = statistics.median(base), statistics.median(cur)
        ratio = c / b if b else float("nan")
        each = lambda xs: " ".join(f"{x:.3f}" for x in xs)
        print(f"{name:<10} {b:>12.3f} {c:>9.3f} {ratio:>18.3f}   [{each(base)}] [{each(cur)}]")
    floors = {side: statistics.median([r["write_floor_s"] for r in rs]) for side, rs in runs.items()}
    print(f"{'floor':<10} {floors['baseline']:>12.3f} {floors['current']:>9.3f} "
          f"{floors['current'] / floors['baseline'] if floors['baseline'] else float('nan'):>18.3f}"
          "   (the COPY write floor, measured in each run)")

    def growth(run, key):
        step = next((s for s in run["steps"] if s["name"] == "resync"), None)
        return (step or {}).get("details", {}).get(key)

    for key, label in [("database_growth_bytes", "the database"), ("table_growth_bytes", "its tables")]:
        grown = {side: [g for g in (growth(r, key) for r in rs) if g is not None] for side, rs in runs.items()}
        if grown["baseline"] and grown["current"]:
            b, c = statistics.median(grown["baseline"]), statistics.median(grown["current"])
            each = lambda xs: " ".join(f"{x / 2**20:.2f}" for x in xs)
            ratio = f"{c / b:.3f}" if b > 0 else "n/a (the baseline did not grow)"
            print(f"resync passes grew {label:<12} {b / 2**20:>9.2f} MiB {c / 2**20:>9.2f} MiB   "
                  f"this / {rev} {ratio}   [{each(grown['baseline'])}] [{each(grown['current'])}]")

    def rows(run, name):
        step = next((s for s in run["steps"] if s["name"] == name), None)
        tables = (step or {}).get("details", {}).get("table_rows")
        if tables is None:
            return None
        return {t: r["inserted"] + r["updated"] + r["deleted"] for t, r in tables.items()}

    print("\nrows written per step, per table (inserted + updated + deleted, by pg_stat_user_tables; "
          "the median of the runs):")
    for name in names:
        per_side = {}
        for side, rs in runs.items():
            counted = [c for c in (rows(r, name) for r in rs) if c is not None]
            if counted:
                tables = sorted({t for c in counted for t in c})
                per_side[side] = {t: int(statistics.median([c.get(t, 0) for c in counted])) for t in tables}
        if not per_side:
            continue
        for side in ("baseline", "current"):
            if side in per_side:
                label = rev if side == "baseline" else "this"
                listed = ", ".join(f"{t} {n}" for t, n in per_side[side].items() if n) or "none"
                print(f"  {name:<10} {label:>10}: {listed} (total {sum(per_side[side].values())})")

    def summaries(run):
        return {s["name"]: s["details"]["summary"] for s in run["steps"] if "summary" in s.get("details", {})}

    differing = [name for name in names
                 if len({summaries(r).get(name) for side in runs for r in runs[side]}) > 1]
    if differing:
        print("\nsummaries differ between runs in: " + ", ".join(differing))
        for side, rs in runs.items():
            for r in rs:
                print(f"  {side}: " + "; ".join(f"{k}: {v}" for k, v in summaries(r).items() if k in differing))
    else:
        print("\nevery run's summaries are the same: "
              + "; ".join(f"{k}: {v}" for k, v in summaries(runs["current"][0]).items()))


if __name__ == "__main__":
    main(sys.argv)
