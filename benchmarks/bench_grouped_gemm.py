"""Ragged bf16 grouped GEMM: cake_ops vs torch._grouped_mm vs dense torch.mm, measured in one run.

    python benchmarks/bench_grouped_gemm.py                 # the MoE shapes on a GPU (tiny ones on CPU)
    python benchmarks/bench_grouped_gemm.py --ops fwd --shapes mixtral_fc1 --json out.json --plot out.png

Prints a table (ms, TFLOP/s, ratios to the peers) and the geometric mean of cake / torch._grouped_mm
per op, and writes JSON rows (and a PNG plot with --plot). Timing: CUDA events around each call
after an L2 flush, median of --reps calls after warm-up.
"""
import argparse
import datetime
import json
import math
import os
import re
import statistics
import time
import zlib

import warnings

import torch

import cake_ops
from cake_ops import grouped_gemm as gg
from cake_ops.autotune import candidate_tactics

# (E, sum_m, N, K, distribution of rows over groups)
SHAPES = {
    "qwen3_30b_fc1": (128, 65536, 1536, 2048, "balanced"),
    "qwen3_30b_fc2": (128, 65536, 2048, 768, "balanced"),
    "mixtral_fc1": (8, 16384, 28672, 4096, "balanced"),
    "mixtral_fc2": (8, 16384, 4096, 14336, "balanced"),
    "decode_qwen3_fc1_t16": (128, 128, 1536, 2048, "balanced"),
    "decode_qwen3_fc1_t128": (128, 1024, 1536, 2048, "balanced"),
}
for _proj, (_n, _k) in {"gate_up": (4096, 6144), "down": (6144, 2048)}.items():
    for _m in (112576, 136064):
        for _dist in ("balanced", "skewed", "one_empty"):
            SHAPES[f"{_proj}_e4_m{_m}_{_dist}"] = (4, _m, _n, _k, _dist)
    for _e in (8, 16, 32):
        SHAPES[f"{_proj}_e{_e}_m131072"] = (_e, 131072, _n, _k, "balanced")
CPU_SHAPES = {"tiny_e8": (8, 512, 256, 256, "balanced"), "tiny_e4_skewed": (4, 384, 128, 256, "skewed")}
DIMS_NAME = re.compile(r"e(\d+)_m(\d+)_n(\d+)_k(\d+)(?:_(balanced|skewed|one_empty))?")


def shape_dims(name):
    """(E, sum_m, N, K, distribution) of a named shape, or of any name spelled
    e{E}_m{sum_m}_n{N}_k{K}[_balanced|_skewed|_one_empty] (e.g. e8_m8192_n28672_k4096)."""
    if name in SHAPES or name in CPU_SHAPES:
        return {**SHAPES, **CPU_SHAPES}[name]
    match = DIMS_NAME.fullmatch(name)
    if not match:
        raise SystemExit(f"bench_grouped_gemm: unknown shape {name!r}; expected one of {sorted(SHAPES)} "
                         f"or {sorted(CPU_SHAPES)}, or e{{E}}_m{{sum_m}}_n{{N}}_k{{K}}[_skewed|_one_empty]")
    e, sum_m, n, k = map(int, match.groups()[:4])
    return e, sum_m, n, k, match.group(5) or "balanced"
OPS = ["fwd", "dgrad", "wgrad", "wgrad_f32", "fwdbwd"]
GRAPH_MAX_ROWS = 4096  # problems this small are timed as CUDA-graph replays (both libraries)


def seed_case(*key):
    """Seed torch's generators from a case's name: the same routing and data in every run and
    whatever subset of cases a run takes, so that results (and weight floors) compare."""
    torch.manual_seed(zlib.crc32("/".join(map(str, key)).encode()))


def group_sizes(e, sum_m, dist):
    weights = {"balanced": [1.0] * e, "skewed": [8.0] + [1.0] * (e - 1),
               "one_empty": [1.0] * (e - 1) + [0.0]}[dist]
    sizes = [int(sum_m * w / sum(weights)) for w in weights]
    sizes[0] += sum_m - sum(sizes)
    return sizes


def operands(e, sum_m, n, k, dist, device):
    """A shape's group sizes and random bf16 operands: x [sum_m, K], w [E, N, K], grad_out [sum_m, N], and
    the int32 group ends."""
    sizes = group_sizes(e, sum_m, dist)
    x = torch.randn(sum_m, k, device=device).bfloat16()
    w = torch.randn(e, n, k, device=device).bfloat16() * 0.05
    g = torch.randn(sum_m, n, device=device).bfloat16()
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    return sizes, x, w, g, offs


class Timer:
    """Median times of several callables measured in rotation (rep 1 of each, then rep 2 of
    each, ...), so clock and temperature drift over a long run biases none of them. The order is
    fixed: each callable follows the same one every rep. (A seeded shuffle per rep exposed that the
    CUDA-graph replay of the one-shot stepfun_moe, PDL on, runs 1.2-1.6x slower than eager at large T
    depending on what ran before it: NOTES.md session 27, item 3. A fixed order leaves a case after a
    much slower one, as a sweep's first tactic, with that one's state.)"""

    def __init__(self, device, reps, warmup, settle_s=None):
        self.device, self.reps, self.warmup = device, reps, warmup
        # Before its timed reps a set of callables runs in rotation for settle_s seconds. The H200's
        # power cap acts on a ~1 s average: a light case timed right after a heavy one ran at the
        # heavy one's capped clocks (1400-1550 MHz instead of 1980; Mixtral T=1 0.216 ms after
        # Qwen3-235B T=16384, 0.183 ms on its own). Settling times each case at its own clocks.
        self.settle_s = (1.0 if device == "cuda" else 0.0) if settle_s is None else settle_s
        # Read before every timed call so that no operand sits in L2. A read, not a zero_(): a write
        # leaves ~50 MB of dirty lines that the timed call's first reads must write back (H200: +5 us
        # on a T=1 MoE forward), a cost no model step has ahead of its MoE layer.
        self.flush = torch.zeros(256 * 2**20, dtype=torch.int8, device=device) if device == "cuda" else None

    def __call__(self, fn, setup=None, graph=False, calls=1):
        return self.many({"fn": (fn, setup)}, graph, calls)["fn"]

    def many(self, fns, graph=False, calls=1, graphs=()):
        """{name: (fn, setup)} -> {name: median ms per call}; a callable that raises
        RuntimeError or TypeError gets the message instead. graph: time replays of a CUDA graph
        of `calls` back-to-back calls (no launch overhead, as inside a model's decode graph);
        graphs: the names to time so (one call each) in the same rotation as the eager others, so
        that the clock drift of a long run at full power biases neither mode."""
        runs, out = {}, {}
        for name, (fn, setup) in fns.items():
            replay = graph or name in graphs
            try:
                for _ in range(self.warmup):
                    if setup:
                        setup()
                    fn()
                if replay:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(calls if graph else 1):
                            fn()
                    fn = g.replay
                runs[name] = (fn, setup)
            except (RuntimeError, TypeError) as exc:  # a peer that cannot run this case
                out[name] = str(exc).split("\n")[0][:120]
        self.settle(runs)
        times = {name: [] for name in runs}
        for _ in range(self.reps):
            for name, (fn, setup) in runs.items():
                if setup:
                    setup()
                if self.device == "cuda":
                    self.flush.sum(dtype=torch.int32)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) / (calls if graph else 1))
                else:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        out.update({name: statistics.median(t) for name, t in times.items()})
        return out

    def settle(self, runs):
        end = time.perf_counter() + self.settle_s
        while runs and time.perf_counter() < end:
            for fn, setup in runs.values():
                if setup:
                    setup()
                fn()
            torch.cuda.synchronize()


def torch_grouped_mm(*args, **kwargs):
    return torch._grouped_mm(*args, **kwargs)


def cases(op, x, w, g, offs, sizes):
    """{peer: (fn, setup or None)} for one op; every fn computes the same problem."""
    e, n, k = w.shape
    w0 = w[0]
    if op == "fwd":
        bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
        out = x.new_empty(x.shape[0], n)

        def loop():
            for i in range(e):
                torch.mm(x[bounds[i]:bounds[i + 1]], w[i].t(), out=out[bounds[i]:bounds[i + 1]])
        return {"cake": (lambda: gg.grouped_gemm_fwd(x, w, offs), None),
                "torch_gmm": (lambda: torch_grouped_mm(x, w.transpose(-2, -1), offs=offs), None),
                "dense_mm": (lambda: torch.mm(x, w0.t()), None),
                "loop_mm": (loop, None)}
    if op == "dgrad":
        return {"cake": (lambda: gg.grouped_gemm_dgrad(g, w, offs), None),
                "torch_gmm": (lambda: torch_grouped_mm(g, w, offs=offs), None),
                "dense_mm": (lambda: torch.mm(g, w0), None)}
    if op in ("wgrad", "wgrad_f32"):
        dt = torch.float32 if op == "wgrad_f32" else torch.bfloat16
        peers = {"cake": (lambda: gg.grouped_gemm_wgrad(g, x, offs, out_dtype=dt), None),
                 "dense_mm": (lambda: torch.mm(g.t(), x, out_dtype=dt) if dt != x.dtype else torch.mm(g.t(), x), None)}
        peers["torch_gmm"] = (lambda: torch_grouped_mm(g.t(), x, offs=offs, out_dtype=dt), None)
        return peers
    if op == "fwdbwd":
        xr, wr, w0r = x.clone().requires_grad_(), w.clone().requires_grad_(), w0.clone().requires_grad_()

        def clear():
            xr.grad = wr.grad = w0r.grad = None
        return {"cake": (lambda: gg.cake_grouped_mm(xr, wr, offs).backward(g), clear),
                "torch_gmm": (lambda: torch_grouped_mm(xr, wr.transpose(-2, -1), offs=offs).backward(g), clear),
                "dense_mm": (lambda: torch.mm(xr, w0r.t()).backward(g), clear)}
    raise ValueError(op)


def run(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    shapes = SHAPES if device == "cuda" else CPU_SHAPES
    names = args.shapes.split(",") if args.shapes else list(shapes)
    ops = args.ops.split(",")
    timer = Timer(device, args.reps, args.warmup)
    l2_bytes = torch.cuda.get_device_properties().L2_cache_size if device == "cuda" else 0
    rows = []
    for name in names:
        if device == "cuda" and args.autotune:
            cake_ops.clear_tuning()  # distributions of one shape share a bucket: tune each
        e, sum_m, n, k, dist = shape_dims(name)
        sizes, x, w, g, offs = operands(e, sum_m, n, k, dist, device)
        flops = 2.0 * sum_m * n * k
        touched = sum(1 for s in sizes if s > 0)
        weight_bytes = touched * n * k * 2
        for op in ops:
            row = {"shape": name, "op": op, "E": e, "sum_m": sum_m, "N": n, "K": k, "dist": dist}
            op_flops = flops * (3 if op == "fwdbwd" else 1)
            graph = device == "cuda" and sum_m <= GRAPH_MAX_ROWS and op != "fwdbwd"
            # Back-to-back calls in one graph amortise the graph launch, unless the weights fit
            # in L2 (then later calls would read them from cache).
            calls = 10 if graph and weight_bytes > 2 * l2_bytes else 1
            row["timing"] = f"graph x{calls}" if graph else "eager"
            peers = cases(op, x, w, g, offs, sizes)
            if (args.sweep or args.sweep_all) and device == "cuda" and op != "fwdbwd":
                sweep(row, op, peers["cake"][0], timer, graph, calls, args.sweep_all, e, sum_m)
            if device == "cuda":
                families = ["fwd", "dgrad", "wgrad"] if op == "fwdbwd" else [op]  # op = family
                heuristic = {f: cake_ops._C.grouped_gemm_tactic_for(f, e, sum_m, n, k) for f in families}
                if op != "fwdbwd":
                    row["cake_tactic"] = cake_ops._C.grouped_gemm_tactics(op)[heuristic[op]]
                if args.autotune:  # tune this bucket: cake_tuned runs the winner, cake the heuristic
                    fn, setup = peers["cake"]
                    if setup:
                        setup()
                    with cake_ops.autotune():
                        fn()
                    peers["cake_tuned"] = peers["cake"]
                    peers["cake"] = (with_tactics(fn, heuristic), setup)
                    if op != "fwdbwd":
                        index = cake_ops._C.grouped_gemm_tactic_for(op, e, sum_m, n, k)
                        row["cake_tuned_tactic"] = cake_ops._C.grouped_gemm_tactics(op)[index]
            if not (args.loop and not graph):
                peers.pop("loop_mm", None)
            for peer, ms in timer.many(peers, graph, calls).items():
                if isinstance(ms, str):
                    row[f"{peer}_error"] = ms
                    continue
                row[f"{peer}_ms"] = ms
                row[f"{peer}_tflops"] = op_flops / ms / 1e9
            if op in ("fwd", "dgrad"):  # weight-read bandwidth: what bounds decode-sized problems
                for peer in ("cake", "cake_tuned", "torch_gmm"):
                    if f"{peer}_ms" in row:
                        row[f"{peer}_weight_tbps"] = weight_bytes / row[f"{peer}_ms"] / 1e9
            for ours in ("cake", "cake_tuned"):
                for peer in ("torch_gmm", "dense_mm", "loop_mm"):
                    if f"{ours}_ms" in row and f"{peer}_ms" in row:
                        row[f"{ours}_vs_{peer}"] = row[f"{peer}_ms"] / row[f"{ours}_ms"]
            rows.append(row)
            print_row(row)
    return device, rows


def with_tactics(fn, tactics):
    """fn run with the given {family: tactic index} forced (at launch, so also at graph capture)."""
    def run():
        for family, index in tactics.items():
            cake_ops._C.set_grouped_gemm_tactic(family, index)
        try:
            return fn()
        finally:
            for family in tactics:
                cake_ops._C.set_grouped_gemm_tactic(family, -1)
    return run


def sweep(row, op, fn, timer, graph, calls, every_order, num_groups, sum_m):
    """Time the kernel configurations the autotuner would (each in its default tile order, or in
    every tile order with every_order), in rotation; record each and the fastest."""
    family = op
    tactics = {name: (with_tactics(fn, {family: i}), None)
               for name, i in candidate_tactics(family, num_groups, sum_m).items()
               if every_order or not ("_raster" in name or "_swz" in name)}
    times = {k: v for k, v in timer.many(tactics, graph, calls).items() if not isinstance(v, str)}
    for name, ms in times.items():
        row[f"tactic_{name}_ms"] = ms
    row["best_tactic"] = min(times, key=times.get)
    row["best_tactic_ms"] = times[row["best_tactic"]]


def fmt(v, spec):
    width = int(spec.split(".")[0])
    return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(width)


HEADER = (f"{'shape':30} {'op':9} {'cake ms':>8} {'cake TF/s':>9} {'tuned TF/s':>10} {'gmm TF/s':>8} "
          f"{'x gmm':>6} {'tuned x gmm':>11} {'dense TF/s':>10} {'x dense':>7} {'W TB/s':>6}  tactic (heuristic, tuned, sweep)")


def print_row(r):
    tactics = " ".join(r.get(t, "") for t in ("cake_tactic", "cake_tuned_tactic", "best_tactic"))
    print(f"{r['shape']:30} {r['op']:9} {fmt(r.get('cake_ms'), '8.3f')} {fmt(r.get('cake_tflops'), '9.1f')} "
          f"{fmt(r.get('cake_tuned_tflops'), '10.1f')} {fmt(r.get('torch_gmm_tflops'), '8.1f')} "
          f"{fmt(r.get('cake_vs_torch_gmm'), '6.3f')} {fmt(r.get('cake_tuned_vs_torch_gmm'), '11.3f')} "
          f"{fmt(r.get('dense_mm_tflops'), '10.1f')} {fmt(r.get('cake_vs_dense_mm'), '7.3f')} "
          f"{fmt(r.get('cake_weight_tbps'), '6.2f')}  {tactics}", flush=True)


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


# Datasheet read bandwidth (TB/s) of the card: the floor of weight-bound (decode) problems. The issues'
# targets are the H200's 4.8; on another card the floor is that card's, so an H100's "x floor" reads the
# same way (3.35 there). The first name found in the device's name wins; CAKE_HBM_TBPS overrides; a card
# not listed (and the CPU) gets the H200's.
HBM_TBPS_BY_NAME = (("GH200 480GB", 4.0), ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35),
                    ("H800 PCIe", 2.0), ("H800", 3.35), ("H20", 4.0))


def hbm_tbps(device_name):
    if os.environ.get("CAKE_HBM_TBPS"):
        return float(os.environ["CAKE_HBM_TBPS"])
    return next((tbps for name, tbps in HBM_TBPS_BY_NAME if name in device_name), 4.8)


CARD = torch.cuda.get_device_name() if torch.cuda.is_available() else None
HBM_TBPS = hbm_tbps(CARD or "cpu")


def floor_note():
    card = CARD or "no GPU: the H200's"
    return f"# weight floor: bytes read / {HBM_TBPS} TB/s ({card}; CAKE_HBM_TBPS overrides)"


def summary(rows, ops):
    out = {"decode": []}
    for r in rows:
        if r.get("timing", "").startswith("graph") and "cake_weight_tbps" in r:
            entry = {"shape": r["shape"], "op": r["op"], "cake_tbps": r["cake_weight_tbps"],
                     "cake_tuned_tbps": r.get("cake_tuned_weight_tbps"),
                     "torch_gmm_tbps": r.get("torch_gmm_weight_tbps"),
                     "fraction_of_hbm": r["cake_weight_tbps"] / HBM_TBPS}
            out["decode"].append(entry)
            print(f"{r['shape']:30} {r['op']:6} weight read {entry['cake_tbps']:.2f} TB/s = "
                  f"{100 * entry['fraction_of_hbm']:.0f}% of {HBM_TBPS} TB/s (tuned "
                  f"{fmt(entry['cake_tuned_tbps'], '4.2f')}, torch._grouped_mm "
                  f"{fmt(entry['torch_gmm_tbps'], '4.2f')} TB/s)")
    for op in ops:
        for ours, label in (("cake", "cake (heuristic)"), ("cake_tuned", "cake (autotuned)")):
            ratios = [r.get(f"{ours}_vs_torch_gmm") for r in rows if r["op"] == op]
            ratios = [v for v in ratios if v]
            if ratios:
                out.setdefault(op, {})[f"{ours}_geomean_vs_torch_gmm"] = geomean(ratios)
                out[op][f"{ours}_min_vs_torch_gmm"] = min(ratios)
                print(f"{op:9} geomean {label} / torch._grouped_mm = {geomean(ratios):.3f} "
                      f"(min {min(ratios):.3f}, {len(ratios)} shapes)")
    return out


def plot(rows, ops, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ops), 1, figsize=(14, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        sel = [r for r in rows if r["op"] == op]
        names = [r["shape"] for r in sel]
        peers = [("cake", "tab:red"), ("cake_tuned", "tab:orange"), ("torch_gmm", "tab:blue"),
                 ("dense_mm", "tab:gray")]
        for i, (peer, color) in enumerate(peers):
            ax.bar([j + 0.2 * (i - 1.5) for j in range(len(sel))], [r.get(f"{peer}_tflops", 0) for r in sel],
                   width=0.2, color=color, label=peer)
        ax.set_xticks(range(len(sel)), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"grouped GEMM {op}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="",
                   help="comma-separated names, or e{E}_m{sum_m}_n{N}_k{K} (default: all for the device)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--loop", action="store_true", help="also time a per-expert torch.mm loop (fwd)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--sweep", action="store_true", help="also time every kernel configuration (GPU)")
    p.add_argument("--sweep-all", action="store_true",
                   help="... in every scheduler tile order too (a shortlist: at an H100's power cap a rotation of ~50 "
                        "large GEMMs carries several %% of clock noise per tactic; rank the finalists with "
                        "sweep_order_bias.py, NOTES.md session 50)")
    p.add_argument("--autotune", action="store_true",
                   help="time cake with the tactic cake_ops.autotune() picks per shape (GPU)")
    p.add_argument("--json", default="", help="write the rows here")
    p.add_argument("--plot", default="", help="write a PNG plot here")
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    for name in filter(None, args.shapes.split(",")):
        shape_dims(name)  # an unknown name fails here, before any table
    print(floor_note())
    print(HEADER)
    device, rows = run(args)
    ops = args.ops.split(",")
    result = {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device,
                 "gpu": CARD if device == "cuda" else "cpu",
                 "torch": torch.__version__, "cuda": torch.version.cuda, "cake_ops": cake_ops.build_info(),
                 "reps": args.reps, "autotune": args.autotune, "hbm_tbps": HBM_TBPS},
        "summary": summary(rows, ops),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, ops, args.plot)


if __name__ == "__main__":
    main()
