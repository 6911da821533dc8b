"""The `gflow` command line: a thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from .engine import FlowOptions
from .engine._options import CLOCKS, ROSENBROCK, TAIL_METHODS, TAIL_SCALES
from .sweeps._spec import DEFAULTS

EXAMPLE_SWEEP = Path(__file__).parent / "configs" / "sweep_example.toml"
# One set of defaults: a grid point's (sweeps, TOML) and FlowOptions' are also the CLI's.
FLOW_DEFAULTS = FlowOptions()


class UsageError(Exception):
    """A bad option: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--dept 3` is an error, not `--depth 3`
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(message)


def _float_or_inf(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _add_problem_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("problem")
    g.add_argument(
        "--problem",
        choices=["diagonal", "block-diagonal", "bernoulli", "file"],
        default="diagonal",
        help="observation pattern (default: diagonal)",
    )
    for flag, kind, help_text in (
        ("--dim", int, "matrix size d (diagonal, bernoulli)"),
        ("--blocks", int, "number of blocks n (block-diagonal)"),
        ("--block-size", int, "block size s (block-diagonal)"),
        ("--density", float, "observation probability p"),
        ("--rank", int, "rank of the bernoulli ground truth"),
        ("--value", float, "ground-truth value w (X* = wJ)"),
        ("--noise", float, "std of observation noise"),
    ):
        default = DEFAULTS[flag[2:].replace("-", "_")]
        g.add_argument(flag, type=kind, default=default, help=help_text)
    g.add_argument(
        "--target", help="target matrix .npy (--problem file; nan where unknown off the mask)"
    )
    g.add_argument("--mask", help="0/1 mask .npy (--problem file)")
    g = p.add_argument_group("initialisation")
    g.add_argument("--depth", type=int, default=DEFAULTS["depth"], help="number of layers L")
    g.add_argument(
        "--init", choices=["identity", "gaussian", "orthogonal", "file"], default="identity"
    )
    g.add_argument(
        "--alpha", type=_float_or_inf, default=DEFAULTS["alpha"], help="init scale α per layer"
    )
    g.add_argument(
        "--m", type=_float_or_inf, default=DEFAULTS["m"], help="identity-family m (inf allowed)"
    )
    g.add_argument("--init-file", help="layers .npy stack (L, d, d) or .npz (--init file)")
    g.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS["seed"],
        help="PRNG seed: the problem's key and the init's key are gflow.seed_keys(seed), "
        "as in sweeps",
    )


def _add_solver_options(p: argparse.ArgumentParser) -> None:
    from .engine._options import SOLVERS

    g = p.add_argument_group("solver")
    g.add_argument("--solver", choices=["auto", *sorted(SOLVERS)], default="auto")
    g.add_argument("--rtol", type=float, default=FLOW_DEFAULTS.rtol)
    g.add_argument("--atol", type=float, default=None, help="default: scaled to the init")
    g.add_argument(
        "--tail-rtol",
        type=float,
        default=None,
        help="the stiff tail's step rtol (default: --rtol); the stopping rule keeps --rtol",
    )
    g.add_argument(
        "--tail-scale",
        choices=list(TAIL_SCALES),
        default=FLOW_DEFAULTS.tail_scale,
        help="what the stiff tail's step error is relative to: each layer's RMS entry "
        "where an entry is smaller (layer, default) or each entry alone (entry)",
    )
    g.add_argument(
        "--tail-method",
        choices=list(TAIL_METHODS),
        default=FLOW_DEFAULTS.tail_method,
        help="how the stiff tail steps: rosenbrock, radau (Radau IIA: far longer steps where "
        "the top singular value runs off; dense P × P algebra) or auto (rosenbrock, then radau "
        "from where a tail still runs after --radau-after steps)",
    )
    g.add_argument(
        "--radau-after",
        type=int,
        default=FLOW_DEFAULTS.radau_after,
        help="with --tail-method auto, the Rosenbrock tail steps after which Radau IIA goes on",
    )
    g.add_argument(
        "--rosenbrock",
        choices=list(ROSENBROCK),
        default=FLOW_DEFAULTS.rosenbrock,
        help="the stiff tail's Rosenbrock tableau (rodas5p: order 5, fewer but dearer steps)",
    )
    g.add_argument(
        "--rounding-floor",
        action="store_true",
        help="stop the stiff tail early where its gradient is mostly float64 rounding on a "
        "plateau (status rounding_floor: not an endpoint)",
    )
    g.add_argument(
        "--rounding-allowance",
        action="store_true",
        help="widen the stiff tail's step tolerance by the float64 rounding in the gradient "
        "(much faster on some plateaus; off by default: docs/theory.md section 5)",
    )
    g.add_argument(
        "--compensated-gradient",
        choices=["auto", "on", "off"],
        default="auto",
        help="evaluate the stiff tail's gradient in double-double arithmetic: where float64 "
        "rounding may be 1e-3 of it on factorisations of width <= 32 (auto, default), "
        "always (on) or never (off)",
    )
    g.add_argument("--t-max", type=_float_or_inf, default=FLOW_DEFAULTS.t_max)
    g.add_argument("--max-steps", type=int, default=FLOW_DEFAULTS.max_steps)
    g.add_argument("--clock", choices=list(CLOCKS), default=FLOW_DEFAULTS.clock)


def build_problem(args):
    import gflow

    key = gflow.seed_keys(args.seed)[0]
    if args.problem == "diagonal":
        return gflow.diagonal(args.dim, args.value, noise=args.noise, key=key)
    if args.problem == "block-diagonal":
        return gflow.block_diagonal(
            args.blocks, args.block_size, args.value, noise=args.noise, key=key
        )
    if args.problem == "bernoulli":
        return gflow.bernoulli(args.dim, args.dim, args.density, args.rank, key, noise=args.noise)
    if not (args.target and args.mask):
        raise UsageError("--problem file needs --target PATH and --mask PATH")
    return gflow.load_problem(_existing(args.target), _existing(args.mask))


def build_model(args, problem):
    import gflow

    d_out, d_in = problem.shape
    if args.init == "file":
        if not args.init_file:
            raise UsageError("--init file needs --init-file PATH")
        return gflow.load_init(_existing(args.init_file))
    widths = [d_in] + [d_out] * args.depth
    key = gflow.seed_keys(args.seed)[1]
    if args.init == "identity":
        if d_in != d_out:
            raise UsageError("--init identity needs a square problem")
        return gflow.identity_family(d_in, args.depth, args.alpha, args.m)
    if args.init == "gaussian":
        return gflow.gaussian(widths, args.alpha, key)
    return gflow.orthogonal(widths, args.alpha, key)


def _existing(path):
    if not os.path.exists(path):
        raise UsageError(f"no such file: {path}")
    return path


def _config(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func", "json", "command", "no_cache")}


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def cmd_run(args) -> int:
    import numpy as np

    import gflow

    if args.sensitivity < 0:
        raise UsageError(f"--sensitivity K needs K >= 1 (0: off), got {args.sensitivity}")
    problem = build_problem(args)
    model = build_model(args, problem)
    options = gflow.FlowOptions(
        solver=args.solver,
        rtol=args.rtol,
        atol=args.atol,
        tail_rtol=args.tail_rtol,
        tail_scale=args.tail_scale,
        tail_method=args.tail_method,
        radau_after=args.radau_after,
        rosenbrock=args.rosenbrock,
        rounding_floor=args.rounding_floor,
        rounding_allowance=args.rounding_allowance,
        compensated_gradient={"on": True, "off": False}.get(args.compensated_gradient, "auto"),
        t_max=args.t_max,
        max_steps=args.max_steps,
        clock=args.clock,
        certificates=True,
    )
    result = gflow.flow(problem, model, options)
    sigma = gflow.singular_values(result.model)
    report = {
        "status": result.status_label,
        "status_message": result.status_message,
        "singular_values": [float(v) for v in sigma],
        "stable_rank": gflow.stable_rank_of(sigma),
        "effective_rank": gflow.effective_rank_of(sigma),
        "loss": float(result.loss),
        "loss_init": float(result.loss_init),
        "t_end": float(result.t_end),
        "num_steps": int(result.num_steps),
        "num_rejected_steps": int(result.num_rejected_steps),
        "num_rhs_evals": int(result.num_rhs_evals),
        "wall_time_s": result.wall_time_s,
        "compile_time_s": result.compile_time_s,
        "compile_cache_hit": result.compile_cache_hit,
        "unobserved_error": gflow.unobserved_error(result.model, problem),
        "certificates": gflow.certificates(result, model, problem),
        "config": _config(args),
    }
    family = None
    if args.init == "identity" and args.problem in ("diagonal", "block-diagonal"):
        family = (args.dim, 1) if args.problem == "diagonal" else (args.blocks, args.block_size)
        report["family_spectrum"] = gflow.family_spectrum(result.model, *family)
    sens = None
    if args.sensitivity:
        sens = gflow.sensitivity(
            problem,
            model,
            k=args.sensitivity,
            eps=args.sensitivity_eps,
            key=gflow.seed_keys(args.seed)[1],
            family=family,
            options=options,
        )
        report["sensitivity"] = sens.to_dict()
    if args.json:
        print(json.dumps(_jsonable(report)))
    else:
        print(f"status         {report['status_message']}")
        print(f"t_end          {report['t_end']:.6g}   steps {report['num_steps']}")
        print(f"loss           {report['loss']:.3e}")
        print(f"singular vals  {np.array2string(sigma, precision=6)}")
        print(f"stable rank    {report['stable_rank']:.6f}")
        print(f"effective rank {report['effective_rank']:.6f}")
        source = {True: " (from the persistent cache)", False: "", None: " (already compiled)"}
        print(
            f"solve {report['wall_time_s']:.3f} s, compile {report['compile_time_s']:.2f} s"
            + source[result.compile_cache_hit]
        )
        if sens is not None:
            print(sens.format())
    return 0


def cmd_theory(args) -> int:
    import gflow

    if args.problem == "diagonal":
        n, s = args.dim, 1
    elif args.problem == "block-diagonal":
        n, s = args.blocks, args.block_size
    else:
        raise UsageError("gflow theory covers --problem diagonal and block-diagonal")
    if args.init != "identity":
        raise UsageError("gflow theory covers --init identity (the family of docs/theory.md)")
    report = gflow.family_prediction(args.depth, n, s, args.alpha, args.m, args.value, t=args.t)
    report["config"] = _config(args)
    if args.json:
        print(json.dumps(_jsonable(report)))
        return 0
    mult = report["multiplicities"]
    at = "t = ∞" if math.isinf(args.t) else f"t = {args.t:g}"
    print(
        f"identity family  L = {args.depth}, n = {n}, s = {s}, α = {args.alpha:g}, m = {args.m:g}"
    )
    print("limit t = ∞ of σ_A, σ_B from the implicit equations (docs/theory.md §3):")
    print(f"  σ_A  {report['sigma_a']:.12g}   (×{mult['a']})")
    if mult["b"]:
        print(f"  σ_B  {report['sigma_b']:.12g}   (×{mult['b']})")
    if mult["c"]:
        print(f"  σ_C  {report['sigma_c']:.6g}   (×{mult['c']}, at {at}: §2 item 3)")
    print(f"stable rank     {report['stable_rank']:.15g}")
    print(f"effective rank  {report['effective_rank']:.15g}")
    print(f"escape time     {report['escape_time']:.6g}")
    return 0


def cmd_plasticity(args) -> int:
    import gflow

    if args.study == "2x2":
        problem, pretrain_mask = gflow.studies.two_by_two_problem(args.value)
        rows = []
        for depth in args.depths:
            for m in args.ms:
                init = gflow.identity_family(2, depth, args.alpha, m)
                r = gflow.studies.plasticity(problem, pretrain_mask, init)
                rows.append({"L": depth, "m": m, "alpha": args.alpha} | r.as_dict())
    else:
        rows = gflow.studies.dxd_study(
            args.dim,
            args.depths,
            args.alphas,
            rank=args.rank,
            seed=args.seed,
            m=args.ms[0],
            init=args.init,
        )
    if args.json:
        print(json.dumps(_jsonable(rows)))
        return 0
    if args.study == "2x2":
        print(
            "2×2 study: pretrain on the diagonal from αF_m, resume with X₁₂ (warm) or start afresh "
            "(cold); X21 = the unobserved entry (truth 1), srank = stable rank, moved = "
            "‖W_end − W_start‖/‖W_start‖ after resuming"
        )
    else:
        print(
            "d×d study: pretrain on the diagonal (Ω₁), resume on a connected Ω₂ ⊇ Ω₁ (warm) or "
            "start afresh on Ω₂ (cold); srank = stable rank, moved = ‖W_end − W_start‖/‖W_start‖"
        )
    for row in rows:
        if args.study == "2x2":
            w, c = row["warm"], row["cold"]
            print(
                f"L={row['L']} m={row['m']:g}: warm X21={w['unobserved_values']['1,0']:+.6f} "
                f"srank={w['stable_rank']:.6f} moved={w['distance_travelled']:.3f} | "
                f"cold X21={c['unobserved_values']['1,0']:+.6f} srank={c['stable_rank']:.6f}"
            )
        else:
            print(
                f"L={row['L']} α={row['alpha']:g}: pretrain {row['pretrain_coupling']}, "
                f"srank warm {row['warm_stable_rank']:.4f} vs cold {row['cold_stable_rank']:.4f}, "
                f"moved warm {row['warm_distance']:.3f} vs cold {row['cold_distance']:.3f}"
            )
    return 0


def _worker(text):
    if text is None:
        return None
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UsageError(f"--worker takes K/N (e.g. 0/4), got {text!r}") from None
    if not (n >= 1 and 0 <= k < n):
        raise UsageError(f"--worker K/N needs 0 <= K < N, got {text!r}")
    return k, n


def cmd_sweep(args) -> int:
    import gflow

    if args.example:
        print(EXAMPLE_SWEEP.read_text())
        return 0
    if not args.config:
        raise UsageError("gflow sweep needs CONFIG.toml (or --example to print one)")
    spec = gflow.load_spec(_existing(args.config))
    out = args.out or os.path.splitext(os.path.basename(args.config))[0] + ".zarr"
    worker = _worker(args.worker)
    try:
        ds = gflow.sweep(spec, out, resume=args.resume, progress=not args.quiet, worker=worker)
    except FileExistsError as exc:
        raise UsageError(str(exc)) from None
    if args.csv:
        gflow.export_table(ds, args.csv)
    print(json.dumps({"out": out} | gflow.sweep_summary(ds, worker)))
    return 0


def cmd_plasticity_map(args) -> int:
    import dataclasses

    from .studies import _plasticity_map as pm
    from .studies._plasticity_verdicts import (
        claim_summary,
        descent_disagreements,
        plasticity_endpoints,
        plasticity_verdicts,
        plot_deficit,
    )

    changes = {
        name: tuple(value)
        for name, value in (
            ("depths", args.depths),
            ("alphas", args.alphas),
            ("inits", args.inits),
            ("subsets", args.subsets),
            ("seeds", args.seeds),
            ("sgd_lrs", args.sgd_lrs),
        )
        if value is not None
    }
    if args.no_sgd:
        changes["sgd_lrs"] = ()
    for name in ("dim", "observed", "rank"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    try:
        spec = dataclasses.replace(pm.PRESETS[args.preset], **changes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out = args.out or f"plasticity_map-{args.preset}.zarr"
    try:
        ds = pm.plasticity_map(spec, out, resume=args.resume, progress=not args.quiet)
    except (FileExistsError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    rows = plasticity_verdicts(ds)
    summary = {
        "out": out,
        "endpoints": int(plasticity_endpoints(ds).sum()),
        "cell_seeds": int(plasticity_endpoints(ds).size),
        "claim": claim_summary(rows),
        "descent_disagreements": len(descent_disagreements(ds)),
    }
    if args.figure:
        import matplotlib.pyplot as plt

        fig = plot_deficit(ds)
        fig.savefig(args.figure, dpi=110)
        plt.close(fig)
        summary["figure"] = args.figure
    if args.json:
        summary["cells"] = rows
    print(json.dumps(_jsonable(summary)))
    return 0


def cmd_reproduce(args) -> int:
    from .studies._reproduce import reproduce

    if args.quick and args.full:
        raise UsageError("choose one of --quick and --full")
    mode = "quick" if args.quick else "full" if args.full else "default"
    facts = reproduce(args.out, mode, progress=not args.quiet)
    rows = facts["claims"]
    good = sum(all(m is not False for m in r["marks"]) for r in rows)
    print(
        f"gflow reproduce: {good}/{len(rows)} claim rows reproduced in "
        f"{facts['elapsed_s']:.0f} s; report: {os.path.join(args.out, 'report.html')}"
    )
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gflow", description="Exact gradient flow on deep matrix factorizations.")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="do not use the persistent compilation cache (also: GFLOW_NO_CACHE=1)",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="integrate one flow to its limit")
    _add_problem_options(run)
    _add_solver_options(run)
    run.add_argument(
        "--sensitivity",
        type=int,
        default=0,
        metavar="K",
        help="also run K flows from perturbed inits: how many digits of each endpoint "
        "quantity are reproducible",
    )
    run.add_argument(
        "--sensitivity-eps",
        type=float,
        default=1e-12,
        metavar="EPS",
        help="relative size of those perturbations (default 1e-12)",
    )
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.set_defaults(func=cmd_run)
    theory = sub.add_parser("theory", help="predicted singular values for the identity family")
    _add_problem_options(theory)
    theory.add_argument("--t", type=_float_or_inf, default=math.inf, help="time for σ_C(t)")
    theory.add_argument("--json", action="store_true", help="print one JSON object")
    theory.set_defaults(func=cmd_theory)
    plast = sub.add_parser("plasticity", help="pretrain on few entries, resume warm vs cold")
    plast.add_argument("--study", choices=["2x2", "dxd"], default="2x2")
    plast.add_argument("--depths", type=int, nargs="+", default=[2, 3])
    plast.add_argument("--ms", type=_float_or_inf, nargs="+", default=[2.0, 4.0, 16.0, math.inf])
    plast.add_argument("--alpha", type=float, default=0.1, help="init scale (2x2 study)")
    plast.add_argument("--alphas", type=float, nargs="+", default=[0.1], help="(dxd study)")
    plast.add_argument("--dim", type=int, default=10, help="d (dxd study)")
    plast.add_argument("--rank", type=int, default=1, help="rank of the truth (dxd study)")
    plast.add_argument("--init", choices=["identity", "gaussian"], default="identity")
    plast.add_argument("--value", type=float, default=1.0, help="X* = wJ (2x2 study)")
    plast.add_argument("--seed", type=int, default=0)
    plast.add_argument("--json", action="store_true")
    plast.set_defaults(func=cmd_plasticity)
    pmap = sub.add_parser(
        "plasticity-map",
        help="where depth protects plasticity: warm vs cold over depth, α, init, Ω₁ (zarr store)",
    )
    pmap.add_argument(
        "--preset",
        choices=["small", "report", "default", "full"],
        default="default",
        help="grid size: small (tests, ~1 min), report (the default report's, ~1 min), default "
        "(~40 min on 2 cores), full (the whole grid: days on a CPU)",
    )
    pmap.add_argument("--out", help="zarr store (default plasticity_map-PRESET.zarr)")
    pmap.add_argument("--resume", action="store_true", help="continue an interrupted store")
    pmap.add_argument("--depths", type=int, nargs="+")
    pmap.add_argument("--alphas", type=float, nargs="+")
    pmap.add_argument("--inits", nargs="+", choices=["gaussian", "identity"])
    pmap.add_argument("--subsets", nargs="+", help="diagonal, blocks, random-Q (0 < Q < 1)")
    pmap.add_argument("--seeds", type=int, nargs="+")
    pmap.add_argument("--dim", type=int)
    pmap.add_argument("--observed", type=int, help="|Ω₂|, the diagonal included")
    pmap.add_argument("--rank", type=int)
    pmap.add_argument("--sgd-lrs", type=float, nargs="+", help="η on the mean loss")
    pmap.add_argument("--no-sgd", action="store_true", help="the flow only")
    pmap.add_argument("--figure", help="write the heatmaps (PNG) here")
    pmap.add_argument("--json", action="store_true", help="also print every cell's verdict")
    pmap.add_argument("--quiet", action="store_true", help="no progress bar")
    pmap.set_defaults(func=cmd_plasticity_map)
    sweep = sub.add_parser("sweep", help="a grid of flows into a resumable zarr store")
    sweep.add_argument("config", nargs="?", help="sweep config (TOML); see --example")
    sweep.add_argument("--out", help="zarr store path (default: CONFIG name + .zarr)")
    sweep.add_argument("--resume", action="store_true", help="continue an interrupted store")
    sweep.add_argument("--csv", help="also write a flat table (.csv or .parquet)")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.add_argument(
        "--worker", metavar="K/N", help="run chunks K mod N of a store shared by N workers"
    )
    sweep.add_argument("--example", action="store_true", help="print the example config")
    sweep.set_defaults(func=cmd_sweep)
    rep = sub.add_parser("reproduce", help="regenerate the paper's claims as a report")
    rep.add_argument("--out", default="gflow-report", help="report folder (default gflow-report)")
    rep.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    rep.add_argument("--full", action="store_true", help="large grids (for a GPU)")
    rep.add_argument("--quiet", action="store_true", help="no progress bar")
    rep.set_defaults(func=cmd_reproduce)
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # silence XLA's C++ chatter on stderr
    os.environ.setdefault("MPLBACKEND", "Agg")  # the CLI writes figures to files, never windows
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
        if args.no_cache:
            from .engine import _compile

            _compile.disable()
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return args.func(args)
    except (UsageError, ValueError) as exc:
        print(f"gflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
