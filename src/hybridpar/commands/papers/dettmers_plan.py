"""`hybridpar plan --model-of dettmers`: Dettmers' Appendix A speed-up model at 32 and 8 bits, on
the paper's own inputs (`--dettmers-profile appendix-a`), a JSON profile, or the model's FLOPs on
the cluster."""

from __future__ import annotations

import argparse
import json

from hybridpar.commands.papers import dettmers as dm
from hybridpar.core.cluster import load_cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.zoo import is_factory
from hybridpar.planning.analysis_cache import zoo_cost_layers
from hybridpar.planning.config import PlanConfig

__all__ = ["plan_dettmers"]


def _profile(cfg: PlanConfig, args: argparse.Namespace):
    if args.dettmers_profile:
        prof = dm.load_profile(args.dettmers_profile)
        if prof.gpus != args.procs:
            raise ConfigError(
                f"{args.dettmers_profile} describes {prof.gpus} GPUs; pass --procs {prof.gpus}"
            )
        return prof
    if is_factory(cfg.model):
        raise ConfigError("--model-of dettmers prices a zoo model; drop --model-of for your own")
    layers = zoo_cost_layers(cfg.model, cfg.input_size)
    cluster = load_cluster(cfg.cluster)
    # the busiest GPU's batch: the first B mod P ranks take one example more
    return dm.profile_from_layers(layers, cluster, args.procs, -(-cfg.batch // args.procs))


def _predictions(prof) -> dict:
    preds = {b: dm.node_speedup(prof, b) for b in (32, 8)}
    out: dict = {
        "model_of": "dettmers",
        "source": prof.source,
        "gpus": prof.gpus,
        "node": {
            str(b): {
                "conv_ms": p.conv,
                "fc_ms": p.fc,
                "penalty_ms": p.penalty,
                "speedup": p.speedup,
            }
            for b, p in preds.items()
        },
    }
    if prof is dm.APPENDIX_A_4GPU:  # the paper's own inputs: its numbers next to ours
        out["paper_node"] = {str(k): v for k, v in dm.PAPER_4GPU.items()}
        out["convnet2_check"] = dm.node_speedup(prof, 32, total=dm.CONVNET2_TOTAL).speedup
        c = dm.APPENDIX_A_96GPU
        out["cluster_96"] = {
            str(s): {
                "ours": [
                    dm.cluster_speedup(c, t, s, b)["speedup"]
                    for t in (prof.total, dm.CONVNET2_TOTAL)
                    for b in (32, 8)
                ],
                "paper": list(dm.PAPER_96GPU[s]),
            }
            for s in c.sync_single
        }
    return out


def _print(out: dict) -> None:
    paper = "paper_node" in out
    print(f"Dettmers' Appendix A model, {out['gpus']} GPUs; inputs: {out['source']}")
    print(f"{'bits':>4} {'conv ms':>8} {'fc ms':>7} {'penalty ms':>11} {'speed-up':>9}  paper")
    for b, p in out["node"].items():
        ref = f"{dm.PAPER_4GPU[int(b)]:.2f}x" if paper else "-"
        times = f"{p['conv_ms']:8.2f} {p['fc_ms']:7.2f} {p['penalty_ms']:11.2f}"
        print(f"{b:>4} {times} {p['speedup']:8.2f}x  {ref}")
    if not paper:
        return
    print(
        f"with convnet2 kernels (17 s / 96 per pass): {out['convnet2_check']:.2f}x; "
        f"Krizhevsky measured {dm.PAPER_4GPU['krizhevsky_measured']:.2f}x"
    )
    print("\n32 nodes x 3 GPUs (Table 7): ours | paper, NervanaGPU 32/8-bit, convnet2 32/8-bit")
    for s, row in out["cluster_96"].items():
        ours = " ".join(f"{v:6.2f}" for v in row["ours"])
        ref = " ".join(f"{v:6.2f}" for v in row["paper"])
        print(f"  sub-batch {s:>5}: {ours} | {ref}")


def plan_dettmers(cfg: PlanConfig, args: argparse.Namespace) -> int:
    if args.out or args.scenario != "all":
        raise ConfigError("--model-of dettmers predicts one layout; drop --out and --scenario")
    out = _predictions(_profile(cfg, args))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _print(out)
    return 0
