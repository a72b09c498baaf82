"""``llm-serving tune``: the command line.

    llm-serving tune --config X.yaml [--model DIR] [--dataset FILE] [--rate R | --all-at-once]
        [--num-prompts N] [--budget-s S] [--objective throughput|ttft-p99|tpot-p99|goodput
        --slo ttft:500 tpot:100] --out tuned.yaml

Engine flags given here (``--max-model-len 1024``, ``--block-size 16`` ...) are fixed for
every trial and not searched. Prints a line per trial under a progress bar, then the table of
trials; writes the best setting to ``--out`` (also on Ctrl-C, when a trial has completed), a
PNG plot beside it (``--plot``) and the trials as JSON (``<out>.trials.json``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from llm_serving.errors import ConfigError

DEFAULT_DATASET = Path(__file__).resolve().parents[2] / "clients" / "data" / "alpaca_5010.json"


def add_tune_parser(sub) -> argparse.ArgumentParser:
    from llm_serving.cli_args import DEFAULT_CONFIG, add_engine_arguments
    t = sub.add_parser("tune", help="search batch, token-budget and KV settings on the real "
                       "server and write the best as a config file",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", default=None,
                   help="the base config file (default: none with --model, the engine's "
                        f"defaults as start.py --model DIR takes them; else {DEFAULT_CONFIG})")
    t.add_argument("--out", required=True, help="where to write the tuned config file")
    t.add_argument("--dataset", default=str(DEFAULT_DATASET),
                   help="alpaca-style JSON: instruction, input, output (the output's token "
                        "count, capped by --max-output, is each request's length)")
    t.add_argument("--num-prompts", type=int, default=64,
                   help="prompts per trial: the first N of the dataset (default 64)")
    rate = t.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, default=None, help="requests per second (Poisson)")
    rate.add_argument("--all-at-once", action="store_true",
                      help="send every prompt at once (the default)")
    t.add_argument("--max-output", type=int, default=256,
                   help="cap of each request's output tokens (default 256)")
    t.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: ignore it, so output lengths are fixed)")
    t.add_argument("--budget-s", type=float, default=900.0,
                   help="time budget in seconds (default 900): no trial starts once the rest "
                        "would not hold a typical trial")
    t.add_argument("--n-trials", type=int, default=None, help="stop after this many trials")
    t.add_argument("--objective", default="throughput",
                   choices=("throughput", "ttft-p99", "tpot-p99", "goodput"))
    t.add_argument("--slo", nargs="+", default=[], metavar="KEY:MS",
                   help="goodput's SLOs, e.g. ttft:500 tpot:100 e2el:10000")
    t.add_argument("--first-rung", type=int, default=None,
                   help="prompts of the first, pruning rung (default: a quarter of "
                        "--num-prompts); a trial in the worse half there stops")
    t.add_argument("--no-pruning", dest="pruning", action="store_false",
                   help="measure every trial on the whole sample")
    t.add_argument("--tune-seed", type=int, default=0,
                   help="seed of the sampler and of the client's arrivals")
    t.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds a trial's server may take to be ready")
    t.add_argument("--plot", default=None, help="PNG of the objective against the main "
                   "knobs (default: the --out path with .png)")
    t.add_argument("--workdir", default=None,
                   help="keep each trial's config file and server log here")
    t.add_argument("--no-progress", dest="progress", action="store_false",
                   help="a line per trial, no progress bar")
    t.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    add_engine_arguments(t)
    return t


def _max_model_len(kw: dict) -> int:
    if kw.get("max_model_len"):
        return int(kw["max_model_len"])
    try:
        from llm_serving.cli_args import resolve_model
        cfg = json.loads((Path(resolve_model(kw["model"])) / "config.json").read_text())
        return int(cfg.get("max_position_embeddings", 2048))
    except (OSError, ValueError):
        return 2048


def baseline_params(kw: dict) -> dict:
    """The settings engine arguments ``kw`` run with (the model's and the base config's; only
    the model's: the engine's defaults), as knob values: what trials 0 and 1 measure. They are
    resolved as the server resolves them (its model in WorkAgents): the KV pool from
    kv_cache_space unless num_blocks, the token budget, asynchronous scheduling on."""
    from llm_serving.config import EngineArgs
    e = EngineArgs.from_kwargs(**{"distributed_executor_backend": "mp", **kw}
                               ).create_engine_config()
    return {"max_num_seqs": e.scheduler.max_num_seqs,
            "max_num_batched_tokens": e.scheduler.max_num_batched_tokens,
            "block_size": e.cache.block_size,
            "kv_tokens": e.cache.num_blocks * e.cache.block_size,
            "enable_prefix_caching": e.cache.enable_prefix_caching,
            "async_scheduling": e.scheduler.async_scheduling,
            "enable_multi_stream": e.multi_stream is not None}


def check_arguments(args) -> None:
    """The flags, checked before any trial server starts: a bad one is a
    ConfigError naming the flag."""
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-output", args.max_output),
                        ("--n-trials", args.n_trials)):
        if value is not None and value < 1:
            raise ConfigError(flag, f"expected a positive integer, got {value}")
    if args.budget_s <= 0:
        raise ConfigError("--budget-s", f"expected seconds > 0, got {args.budget_s}")
    if Path(args.out).is_dir():
        raise ConfigError("--out", f"{args.out!r} is a directory; give the config file to "
                          "write, e.g. tuned.yaml in it")
    if args.rate is not None and not args.rate > 0:      # inf: all at once
        raise ConfigError("--rate", f"expected requests per second > 0, got {args.rate} "
                          "(--all-at-once sends every prompt at once)")
    if not Path(args.dataset).is_file():
        raise ConfigError("--dataset", f"file {args.dataset!r} not found")
    try:
        rows = json.loads(Path(args.dataset).read_text())
    except (ValueError, OSError) as e:
        raise ConfigError("--dataset", f"{args.dataset!r} is not JSON: {e}") from None
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and isinstance(r.get("instruction"), str)
            and isinstance(r.get("output"), str) for r in rows[:args.num_prompts]):
        raise ConfigError("--dataset", f"{args.dataset!r} is not an alpaca-style JSON list of "
                          "records with instruction, input and output")


def run_tune(args) -> int:
    from llm_serving.cli_args import cli_engine_overrides, resolve_model, serve_config
    from llm_serving.serving_config import load_config
    from llm_serving.tune.objective import make_objective
    from llm_serving.tune.search import Tuner, plot, short, table
    from llm_serving.tune.space import default_space, without_fixed
    from llm_serving.tune.trial_server import ServerEvaluator, Workload
    from llm_serving.tune.tuned_yaml import header_lines, read_base, write_tuned_yaml

    try:
        import optuna  # noqa: F401
    except ImportError:
        raise SystemExit("error: llm-serving tune needs Optuna: pip install -e '.[tune]'") \
            from None
    objective = make_objective(args.objective, args.slo)
    check_arguments(args)
    # SIGTERM (kill, timeout, a cancelled job) stops the search as Ctrl-C does: the trial
    # under way is dropped and the best so far written. Taken as a SIGINT, it is held back
    # while a trial server is being stopped, as a Ctrl-C is.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    base_path = serve_config(args)        # None: --model alone, the engine's defaults
    fixed = cli_engine_overrides(args)
    cfg = load_config(base_path, fixed)          # a bad base file fails here, not per trial
    kw = cfg.engine_kwargs
    mml = _max_model_len(kw)
    model_dir = resolve_model(kw["model"])
    with cfg.named_as_in_file():
        base = baseline_params({**kw, "model": model_dir})
    # the engine's own defaults (for this model and the fixed flags)
    defaults = baseline_params({**fixed, "model": model_dir})
    space = without_fixed(default_space(mml, kw.get("tensor_parallel_size", 1),
                                        max(base["kv_tokens"], defaults["kv_tokens"])), fixed)
    first = args.first_rung or max(1, args.num_prompts // 4)
    rungs = [first, args.num_prompts] if args.pruning and first < args.num_prompts \
        else [args.num_prompts]
    workload = Workload(dataset=str(args.dataset),
                        request_rate=args.rate if args.rate is not None else float("inf"),
                        ignore_eos=args.ignore_eos, max_output=args.max_output,
                        seed=args.tune_seed, tokenizer=model_dir if Path(model_dir).is_dir() else None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"tuning {objective.name} ({objective.direction}) of "
          f"{base_path or 'the engine defaults'} within "
          f"{args.budget_s:.0f} s; per trial: {workload.describe(args.num_prompts)}; rungs "
          f"{rungs}; knobs: {', '.join(k.name for k in space)}"
          + (f"; fixed: {short({k: v for k, v in fixed.items() if k != 'model'})}"
             if len(fixed) > ('model' in fixed) else ""), flush=True)

    # a temporary directory only when none is given: a tune killed outright leaves it behind
    with (contextlib.nullcontext(args.workdir) if args.workdir
          else tempfile.TemporaryDirectory(prefix="llm_serving_tune_")) as workdir:
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        evaluator = ServerEvaluator(read_base(base_path) if base_path else {}, workload, workdir, objective.slo,
                                    args.startup_timeout)
        tuner = Tuner(evaluator, space, fixed, objective, rungs, args.budget_s, args.n_trials,
                      seed=args.tune_seed, pruning=args.pruning,
                      baseline=base, seeds=(defaults,),
                      progress=args.progress)
        result = tuner.run()

    print()
    print(table(result, objective, space))
    png = plot(result, objective, space, Path(args.plot) if args.plot else out.with_suffix(".png"))
    Path(str(out) + ".trials.json").write_text(json.dumps(
        [{"number": t.number, "state": t.state, "value": t.value, "rung": t.rung,
          "params": t.params, "seconds": t.seconds, "error": t.error, "summary": t.summary}
         for t in result.trials], indent=1, default=str))
    print(f"\n{len(result.trials)} trials in {result.elapsed:.0f} s"
          + (" (interrupted)" if result.interrupted else "") + f"; plot: {png or 'none'}")
    best = result.best
    if best is None:
        print("error: no trial completed, so there is no setting to write; see the reasons "
              "above", file=sys.stderr)
        return 130 if result.interrupted else 1
    base_trial = next((t for t in result.trials if t.number == 0), None)
    gain = ""
    if base_trial is not None and base_trial.state == "complete" and best is not base_trial:
        gain = f" ({best.value / base_trial.value:.2f}x the base config's {base_trial.value:.4g})"
    best_line = f"trial {best.number}, {objective.name} {best.value:.4g} {objective.unit}{gain}: " \
        + short(best.params)
    write_tuned_yaml(out, read_base(base_path) if base_path else {}, best.kwargs, header_lines(
        base_path=base_path or "the engine's defaults", objective=objective,
        workload=workload.describe(args.num_prompts), best=best_line,
        trials=f"{result.counts()} in {result.elapsed:.0f} s", interrupted=result.interrupted))
    print(f"best: {best_line}\nwrote {out}")
    return 130 if result.interrupted else 0
