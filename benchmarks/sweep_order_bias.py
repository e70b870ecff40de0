"""Does a tactic's time in a sweep depend on the tactic timed before it? (NOTES.md session 50.)

    python benchmarks/sweep_order_bias.py --shape gate_up_e4_m112576_balanced --op fwd \
        --orders "c1x2,c2x1_rasterN;c2x1,c2x1_rasterN,c1x2;c2x1,c1x2,c2x1_rasterN" --alone c1x2,c2x1_rasterN

Each --orders entry is one rotation (bench_grouped_gemm's Timer: rep 1 of each in that order, then
rep 2, ...), the names short for `fixed_coop_128x256x64_<name>` unless they name a whole tactic.
--alone times each of those tactics by itself (its own settle and reps). If the power cap carries
over from one call to the next, a tactic timed after a slow (low-power) one reads faster than it
does after a fast one or alone.
"""
import argparse

import torch

import cake_ops
from bench_grouped_gemm import Timer, cases, operands, shape_dims, with_tactics


def full_name(op, short):
    names = cake_ops._C.grouped_gemm_tactics(op)
    for name in (short, f"{op}_bf16_{short}", f"{op}_bf16_fixed_coop_128x256x64_{short}"):
        if name in names:
            return name, names.index(name)
    raise SystemExit(f"sweep_order_bias: no {op} tactic named {short!r}; known: {', '.join(names)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gate_up_e4_m112576_balanced")
    p.add_argument("--op", default="fwd", choices=["fwd", "dgrad"])
    p.add_argument("--orders", required=True, help="rotations, ';' between them, ',' between tactics")
    p.add_argument("--alone", default="", help="tactics to time each by itself")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sizes, x, w, g, offs = operands(*shape_dims(args.shape), "cuda")
    fn = cases(args.op, x, w, g, offs, sizes)["cake"][0]
    timer = Timer("cuda", args.reps, warmup=2)
    print(f"# {torch.cuda.get_device_name()}: {args.shape} {args.op}, median ms of {args.reps} reps, "
          f"names short for {args.op}_bf16_fixed_coop_128x256x64_*")
    for rnd in range(1, args.rounds + 1):
        for order in args.orders.split(";"):
            tactics = [full_name(args.op, s) for s in order.split(",")]
            times = timer.many({name: (with_tactics(fn, {args.op: i}), None) for name, i in tactics})
            print(f"round {rnd} rotation [{order}]: " + "  ".join(f"{s} {times[name]:.3f}"
                                                            for s, (name, _) in zip(order.split(","), tactics)))
        for s in filter(None, args.alone.split(",")):
            name, i = full_name(args.op, s)
            print(f"round {rnd} alone {s}: {timer(with_tactics(fn, {args.op: i})):.3f}")


if __name__ == "__main__":
    main()
