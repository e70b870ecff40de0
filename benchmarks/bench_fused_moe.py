"""Pre-routed MoE forward: cake_ops.fused_moe.fused_moe_bf16 vs the plain PyTorch pipeline and the floors.

    python benchmarks/bench_fused_moe.py                       # the issue-4 models and token counts
    python benchmarks/bench_fused_moe.py --models qwen3_30b --tokens 1,4096 --json out.json --plot out.png
    python benchmarks/bench_fused_moe.py --from-json a.json,b.json --json all.json --plot all.png  # runs merged

Per (model, T): cake with the fused and the deterministic finalize, eager and as CUDA-graph
replays; the plain PyTorch pipeline (stable sort, torch._grouped_mm for both GEMMs, SwiGLU,
index_add combine; no host sync) eager and under torch.compile; and two floors: the weight bytes
of the experts the routing touches / the card's read bandwidth (`HBM_TBPS`: the H200's 4.8 TB/s),
and the FLOPs / the rate of the dense torch.mm products of the same size (the model's widths, as
many rows as kept routes, at least DENSE_MIN_ROWS), measured in the same run. Timings are medians
over rotations (every peer once per round, graph replays of one captured call among the eager
calls) after an L2 flush.
"""
import argparse
import datetime
import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import cake_ops
from cake_ops.fused_moe import fused_moe_bf16, interleave_up_gate_sm90
from bench_grouped_gemm import CARD, HBM_TBPS, Timer, floor_note, fmt, geomean, seed_case

# (E total, top_k, hidden, intermediate, E local, local expert offset)
MODELS = {
    "qwen3_30b": (128, 8, 2048, 768, 128, 0),
    "qwen3_235b": (128, 8, 4096, 1536, 128, 0),
    "mixtral_8x7b": (8, 2, 4096, 14336, 8, 0),
    "kimi_k2_ep8": (384, 8, 7168, 2048, 48, 96),  # one rank's shard of 48 of the 384 experts
}
CPU_MODELS = {"tiny": (16, 4, 128, 64, 16, 0), "tiny_ep": (32, 4, 128, 64, 8, 8)}
TOKENS = [1, 16, 64, 256, 1024, 4096, 16384]
CPU_TOKENS = [1, 16, 64]
# The dense products behind the FLOP floor have the MoE's rows (the kept routes) but at least this
# many: fewer rows make the dense product weight-bound, and its rate no longer a rate of FLOPs. The
# same size matters at the top: Qwen3-235B's widths ran at 771 TFLOP/s with 16384 rows and 715 with
# the 131072 of T=16384 (a 6 ms product runs under the power cap, as the MoE call does).
DENSE_MIN_ROWS = 16384


def torch_moe(x, ids, scales, w1_gate_up, w2, num_local, offset):
    """The plain PyTorch pipeline a user writes with torch._grouped_mm (gate-first w1)."""
    t, k = ids.shape
    inter = w2.shape[2]
    local = ids.flatten().long() - offset
    valid = (local >= 0) & (local < num_local)
    key = torch.where(valid, local, num_local)  # other shards sort to the end
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w1_gate_up.transpose(-2, -1), offs=offs)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    weight = torch.where(valid, scales.flatten(), 0.0)[order]
    y = torch.where(weight[:, None] != 0, y.float() * weight[:, None], 0.0)  # rows past offs[-1]: 0
    return torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, order // k, y).to(x.dtype)


def routing(t, e, k, device):
    logits = torch.randn(t, e, device=device)
    scales, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids.to(torch.int32), (scales / scales.sum(-1, keepdim=True)).float()


def dense_rate(timer, m, h, inter, device):
    """TFLOP/s of the dense products of the same widths (what the large-T floor divides by)."""
    a = torch.randn(m, h, device=device).bfloat16()
    b = torch.randn(2 * inter, h, device=device).bfloat16()
    c = torch.randn(m, inter, device=device).bfloat16()
    d = torch.randn(h, inter, device=device).bfloat16()
    ms = timer(lambda: (torch.mm(a, b.t()), torch.mm(c, d.t())))
    return 2.0 * m * h * 3 * inter / ms / 1e9


def dense_rate_for(timer, rates, routes, h, inter, device):
    """(TFLOP/s, rows) of the dense products the FLOP floor of `routes` kept routes divides by; rates
    caches them by row count."""
    rows = max(routes, DENSE_MIN_ROWS if device == "cuda" else 1)
    if rows not in rates:
        rates[rows] = dense_rate(timer, rows, h, inter, device)
    return rates[rows], rows


def run(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    models = MODELS if device == "cuda" else CPU_MODELS
    names = args.models.split(",") if args.models else list(models)
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else (TOKENS if device == "cuda" else CPU_TOKENS)
    timer = Timer(device, args.reps, args.warmup)
    compiled_tokens = {int(v) for v in args.compiled_tokens.split(",")} if args.compiled_tokens else None
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled_moe = torch.compile(torch_moe, dynamic=False)
    main_layout = "gate_up" if args.w1_layout == "gate_up" else "interleaved"
    if args.w1_layout == "both":
        print("# gu/il: fused_moe_bf16 with w1 as [gate; up] halves (w1_layout='gate_up') over the interleaved "
              "w1, fused finalize, graph replays")
    rows = []
    for name in names:
        e, k, h, inter, e_local, offset = {**MODELS, **CPU_MODELS}[name]
        seed_case(name)
        w1 = (torch.randn(e_local, 2 * inter, h, device=device) / h**0.5).bfloat16()
        w2 = (torch.randn(e_local, h, inter, device=device) / inter**0.5).bfloat16()
        w1i = interleave_up_gate_sm90(w1)
        rates = {}  # dense TFLOP/s by row count
        for t in tokens:
            seed_case(name, t)
            x = torch.randn(t, h, device=device).bfloat16()
            ids, scales = routing(t, e, k, device)
            local = ids.long() - offset
            kept = ((local >= 0) & (local < e_local))
            touched = local[kept].unique().numel()
            routes = int(kept.sum())
            flops = 2.0 * routes * 3 * h * inter
            rate, dense_rows = dense_rate_for(timer, rates, routes, h, inter, device)
            row = {"model": name, "T": t, "E": e, "top_k": k, "hidden": h, "I": inter, "E_local": e_local,
                   "weight_floor_ms": touched * 3 * h * inter * 2 / (HBM_TBPS * 1e12) * 1e3,
                   "flop_floor_ms": flops / (rate * 1e12) * 1e3, "dense_tflops": rate, "dense_rows": dense_rows,
                   "w1_layout": main_layout}

            def cake(fused, layout=main_layout):
                weights = w1 if layout == "gate_up" else w1i
                return lambda: fused_moe_bf16(x, ids, scales, weights, w2, e, k, e_local, offset,
                                              use_fused_finalize=fused, w1_layout=layout)
            eager = {"cake_fused": (cake(True), None), "cake_det": (cake(False), None),
                     "torch": (lambda: torch_moe(x, ids, scales, w1, w2, e_local, offset), None)}
            if args.w1_layout == "both":
                eager["cake_fused_gu"] = (cake(True, "gate_up"), None)
            if args.compiled and (compiled_tokens is None or t in compiled_tokens):
                eager["torch_compiled"] = (lambda: compiled_moe(x, ids, scales, w1, w2, e_local, offset), None)
            if args.autotune is not None:
                # The winners stay cached for the timed calls below.
                with cake_ops.autotune(cache_file=args.autotune or None):
                    eager["cake_fused"][0](), eager["cake_det"][0]()
            # Both pipelines compute the same thing: check before timing.
            b = eager["torch"][0]().float()
            for peer in [p for p in ("cake_det", "cake_fused_gu") if p in eager]:
                a = eager[peer][0]().float()
                diff = float((a - b).norm() / b.norm().clamp_min(1e-30)) if t else 0.0
                if diff > 3e-2:
                    raise AssertionError(f"{name} T={t}: cake ({peer}) and the torch pipeline differ by {diff:.3g}")
                row.setdefault("rel_diff_vs_torch", diff)
            graphed = {f"{p}_graph": eager[p] for p in ("cake_fused", "cake_det", "cake_fused_gu")
                       if p in eager} if device == "cuda" else {}
            results = timer.many({**eager, **graphed}, graphs=set(graphed))
            for peer, ms in results.items():
                row[f"{peer}_ms" if not isinstance(ms, str) else f"{peer}_error"] = ms
            best = row.get("cake_fused_graph_ms", row.get("cake_fused_ms"))
            floor = max(row["weight_floor_ms"], row["flop_floor_ms"])
            if best:
                # No route into the shard (an EP rank at T=1): no floor to compare with.
                row["cake_x_floor"] = best / floor if floor > 0 else None
                row["cake_tflops"] = flops / best / 1e9
                if "torch_ms" in row:
                    row["speedup_vs_torch"] = row["torch_ms"] / best
                if "torch_compiled_ms" in row:
                    row["speedup_vs_torch_compiled"] = row["torch_compiled_ms"] / best
            if row.get("cake_det_ms") and row.get("cake_fused_ms"):
                row["det_over_fused"] = row["cake_det_ms"] / row["cake_fused_ms"]
            gu = row.get("cake_fused_gu_graph_ms", row.get("cake_fused_gu_ms"))
            if gu and best:
                row["gate_up_over_interleaved"] = gu / best
            rows.append(row)
            print_row(row)
    return device, rows


HEADER = (f"{'model':13} {'T':>6} {'fused':>8} {'det':>8} {'fused gr':>8} {'det gr':>8} {'torch':>8} "
          f"{'compiled':>8} {'W floor':>8} {'F floor':>8} {'x floor':>7} {'x torch':>7} {'x comp':>7} {'TF/s':>6}  (ms)")


def print_row(r):
    cols = ["cake_fused_ms", "cake_det_ms", "cake_fused_graph_ms", "cake_det_graph_ms", "torch_ms",
            "torch_compiled_ms", "weight_floor_ms", "flop_floor_ms"]
    print(f"{r['model']:13} {r['T']:6d} " + " ".join(fmt(r.get(c), "8.3f") for c in cols) +
          f" {fmt(r.get('cake_x_floor'), '7.2f')} {fmt(r.get('speedup_vs_torch'), '7.2f')}"
          f" {fmt(r.get('speedup_vs_torch_compiled'), '7.2f')} {fmt(r.get('cake_tflops'), '6.1f')}"
          + (f" {fmt(r['gate_up_over_interleaved'], '6.3f')}" if "gate_up_over_interleaved" in r else ""), flush=True)


def summarize(rows, keys):
    """{key: geomean, min, max} over the rows that have it, printed."""
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key)]
        if values:
            out[key] = {"geomean": geomean(values), "min": min(values), "max": max(values)}
            print(f"{key:28} geomean {out[key]['geomean']:.3f} (min {out[key]['min']:.3f}, max {out[key]['max']:.3f})")
    return out


def plot_panels(panels, series, path):
    """One log-log panel of ms against tokens per (title, rows); series = [(row key, line style)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5 * max(len(panels), 1), 4), squeeze=False)
    for ax, (title, sel) in zip(axes[0], panels):
        ts = [r["T"] for r in sel]
        for key, style in series:
            if any(key in r for r in sel):
                ax.plot(ts, [r.get(key, float("nan")) for r in sel], style, label=key[:-3])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_runs(paths, print_row):
    """The rows of earlier runs' JSON files (comma-separated paths), printed: (device, rows, the runs' meta)."""
    runs = [json.loads(Path(path).read_text()) for path in paths.split(",")]
    sources = [run["meta"] for run in runs]
    rows = [r for run in runs for r in run["rows"]]
    for r in rows:
        print_row(r)
    return sources[0]["device"], rows, sources


def write_results(path, device, summary, rows, reps, sources=None):
    """sources: the meta of the runs whose rows these are (--from-json), kept instead of this process's (which
    may have no GPU: GPU runs are merged anywhere)."""
    if sources:
        meta = {"merged_from": sources}
    else:
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device,
                "gpu": CARD if device == "cuda" else "cpu",
                "torch": torch.__version__, "cake_ops": cake_ops.build_info(), "reps": reps, "hbm_tbps": HBM_TBPS}
    result = {"meta": meta, "summary": summary, "rows": rows}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def add_output_args(p, from_json_help):
    """The options every MoE benchmark shares: where it runs and where its results go."""
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--from-json", default="",
                   help="comma-separated JSON files of earlier runs (" + from_json_help + "): print, summarize and "
                        "plot their rows instead of measuring")


def check_names(p, option, given, known):
    """Refuse unknown names in a comma-separated option (--models, --shapes, ...) with argparse's usage error
    (exit 2) before any table, rather than a KeyError partway through one."""
    unknown = [n for n in given.split(",") if n not in known] if given else []
    if unknown:
        p.error(f"unknown {option} {unknown}; known: {', '.join(known)}")


def report(args, run, header, print_row, summary_keys, series, panels):
    """Measure (run(args) -> device, rows) or load --from-json runs, print the table, then write the JSON and
    draw the plot (panels(rows) -> [(title, rows)]) where asked."""
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    if not args.from_json:
        print(floor_note())
    print(header)
    sources = None  # the merged runs' meta
    if args.from_json:
        device, rows, sources = load_runs(args.from_json, print_row)
    else:
        device, rows = run(args)
    summary = summarize(rows, summary_keys)
    if args.json:
        write_results(args.json, device, summary, rows, args.reps, sources)
    if args.plot:
        plot_panels(panels(rows), series, args.plot)


SUMMARY_KEYS = ("cake_x_floor", "speedup_vs_torch", "speedup_vs_torch_compiled", "det_over_fused",
                "gate_up_over_interleaved")
SERIES = [("cake_fused_graph_ms", "r-o"), ("cake_fused_ms", "r--"), ("cake_det_ms", "m:"), ("torch_ms", "b-s"),
          ("torch_compiled_ms", "c-^"), ("weight_floor_ms", "k:"), ("flop_floor_ms", "k-.")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="")
    p.add_argument("--tokens", default="", help="comma-separated token counts")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compiled", dest="compiled", action="store_false", help="skip the torch.compile peer")
    p.add_argument("--compiled-tokens", default="",
                   help="time the torch.compile peer at these token counts only (it compiles once per model and T, "
                        "~30 s each on the H200: all 28 do not fit a 10-minute call; the 1.5x target is at T >= 4096)")
    p.add_argument("--autotune", nargs="?", const="", default=None, metavar="CACHE_FILE",
                   help="tune both paths' GEMMs under cake_ops.autotune() before timing each (model, T); "
                        "the winners go to CACHE_FILE when given")
    p.add_argument("--w1-layout", choices=("interleaved", "gate_up", "both"), default="interleaved",
                   help="w1 as fused_moe_bf16 takes it: interleaved at 32 rows (the default), or transformers' "
                        "[gate; up] halves (w1_layout='gate_up'); 'both' times the halves too, fused finalize, "
                        "as a last column (gate_up / interleaved)")
    add_output_args(p, "say, one per model where the compiled peer's compiles take a call each")
    args = p.parse_args()
    check_names(p, "--models", args.models, {**MODELS, **CPU_MODELS})
    header = HEADER.replace("TF/s  (ms)", "TF/s  gu/il  (ms)") if args.w1_layout == "both" else HEADER
    report(args, run, header, print_row, SUMMARY_KEYS, SERIES, panels_by_model)


def panels_by_model(rows):
    models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
    return [(m, [r for r in rows if r["model"] == m]) for m in models]

if __name__ == "__main__":
    main()
