"""The search of ``llm-serving tune``: an Optuna study (TPE sampling, successive-halving
pruning over the workload sample) within a time budget, with a progress bar, a table of the
trials and a plot of the objective against the main knobs.

Each trial measures one setting through an *evaluator* (``trial_server.ServerEvaluator`` for
the real server; tests pass a deterministic fake). The sample is measured in rungs of growing
size (e.g. 1/4 of the prompts, then all): after a rung the pruner compares the trial with the
others at that rung and stops the ones in the worse half, so a poor setting costs a quarter of
a trial. Trial 0 measures the base config's own settings (the baseline); then any other
known starting points (``seeds``, e.g. the engine's defaults) before the sampler's own picks.
For throughput, a rung that runs longer than ``slack`` times the fastest run of that rung so
far cannot win (same requests, same output tokens): it is stopped there and recorded as
pruned, so a hopeless setting (a decode batch of 1, say) costs little.

A trial whose server does not start, or whose requests fail, is recorded as failed with the
reason, and the search goes on. Ctrl-C stops the search: the trial under way is dropped (its
server stopped), and the best completed trial so far is the result.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from llm_serving.tune.objective import Objective
from llm_serving.tune.space import Knob, engine_kwargs, suggest
from llm_serving.tune.trial_server import TrialFailed, TrialTooSlow

PLOT_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_tokens")


@dataclass
class TrialRecord:
    number: int
    params: dict
    kwargs: dict
    state: str = "running"        # complete | pruned | failed | interrupted
    value: Optional[float] = None  # the objective (the last rung measured, when pruned)
    rung: Optional[int] = None     # prompts of the last rung measured
    summary: Optional[dict] = None
    error: Optional[str] = None
    seconds: float = 0.0


@dataclass
class TuneResult:
    trials: list[TrialRecord] = field(default_factory=list)
    best: Optional[TrialRecord] = None
    interrupted: bool = False
    elapsed: float = 0.0

    def counts(self) -> str:
        by = {}
        for t in self.trials:
            by[t.state] = by.get(t.state, 0) + 1
        return f"{len(self.trials)} (" + ", ".join(f"{n} {s}" for s, n in sorted(by.items())) + ")"


class Tuner:
    """Runs the study. ``evaluator.evaluate(number, kwargs, rungs, report)`` measures a
    setting (see ``ServerEvaluator``); ``baseline`` (knob values) is measured first when
    given."""

    def __init__(self, evaluator, space: list[Knob], fixed: dict, objective: Objective,
                 rungs: list[int], budget_s: float, n_trials: Optional[int] = None,
                 seed: int = 0, pruning: bool = True, startup_trials: int = 2,
                 baseline: Optional[dict] = None, seeds: tuple = (),
                 slack: float = 1.25, progress: bool = True,
                 log: Callable[[str], None] = print):
        if not rungs or sorted(rungs) != list(rungs) or rungs[0] < 1:
            raise ValueError(f"rungs must be increasing prompt counts, got {rungs}")
        self.evaluator, self.space, self.fixed = evaluator, space, fixed
        self.objective, self.rungs, self.budget_s = objective, list(rungs), budget_s
        self.n_trials, self.seed, self.pruning = n_trials, seed, pruning
        self.startup_trials, self.baseline = startup_trials, baseline
        self.seeds, self.slack = tuple(seeds), slack
        self.fastest: dict[int, float] = {}     # rung (prompts) -> shortest run, seconds
        self.progress, self.log = progress, log

    # -- the study ---------------------------------------------------------------------------

    def _study(self):
        import optuna
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=5)
        if self.pruning and len(self.rungs) > 1:
            pruner = optuna.pruners.SuccessiveHalvingPruner(
                min_resource=self.rungs[0], reduction_factor=2)
        else:
            pruner = optuna.pruners.NopPruner()
        study = optuna.create_study(direction=self.objective.direction, sampler=sampler,
                                    pruner=pruner)
        for start in ((self.baseline,) if self.baseline else ()) + self.seeds:
            study.enqueue_trial(self._clamp(start), skip_if_exists=True)
        return study

    def _time_limit(self, prompts: int) -> Optional[float]:
        if not self.objective.worse_when_slower or prompts not in self.fastest:
            return None
        return self.slack * self.fastest[prompts]

    def _ran(self, prompts: int, summary: dict) -> None:
        d = summary.get("duration")
        if d is not None and d < self.fastest.get(prompts, float("inf")):
            self.fastest[prompts] = float(d)

    def _clamp(self, values: dict) -> dict:
        out = {}
        for k in self.space:
            if k.name not in values or values[k.name] is None:
                continue
            v = values[k.name]
            if k.kind == "int_log":
                v = min(max(int(v), k.low), k.high)
            elif k.kind == "choice" and v not in k.choices:
                v = min(k.choices, key=lambda c: abs(c - v))
            elif k.kind == "bool":
                v = bool(v)
            out[k.name] = v
        return out

    def run(self) -> TuneResult:
        import optuna
        result = TuneResult()
        study = self._study()
        t0 = time.monotonic()
        bar = self._bar()

        def objective(trial) -> float:
            params = suggest(trial, self.space)
            kwargs = engine_kwargs(params, self.fixed)
            rec = TrialRecord(trial.number, params, kwargs)
            result.trials.append(rec)
            start = time.monotonic()

            def report(n: int, summary: dict) -> None:
                value = self.objective.value(summary)
                rec.value, rec.rung, rec.summary = value, n, summary
                self._ran(n, summary)
                trial.report(value, n)
                if trial.number >= self.startup_trials and trial.should_prune():
                    raise optuna.TrialPruned(f"{value:.4g} after {n} prompts")
            try:
                summary = self.evaluator.evaluate(trial.number, kwargs, self.rungs, report,
                                                  self._time_limit)
            except optuna.TrialPruned:
                rec.state = "pruned"
                raise
            except TrialTooSlow as e:
                rec.state, rec.error = "pruned", str(e)
                raise optuna.TrialPruned(str(e)) from None
            except TrialFailed as e:
                rec.state, rec.error = "failed", str(e)
                trial.set_user_attr("error", str(e))
                raise
            except KeyboardInterrupt:
                rec.state = "interrupted"
                raise
            finally:
                rec.seconds = time.monotonic() - start
            rec.state, rec.summary, rec.rung = "complete", summary, self.rungs[-1]
            rec.value = self.objective.value(summary)
            self._ran(self.rungs[-1], summary)
            return rec.value

        def after_trial(study, frozen) -> None:
            rec = result.trials[-1]
            if rec.state == "complete" and (result.best is None or self.objective.better(
                    rec.value, result.best.value)):
                result.best = rec
            self._tick(bar, rec, result, t0)
            # Stop when the rest of the budget would not hold another trial.
            done = [t.seconds for t in result.trials if t.state == "complete"]
            left = self.budget_s - (time.monotonic() - t0)
            if done and left < statistics.median(done):
                study.stop()

        try:
            study.optimize(objective, n_trials=self.n_trials, timeout=self.budget_s,
                           callbacks=[after_trial], catch=(TrialFailed,))
        except KeyboardInterrupt:
            result.interrupted = True
            if result.trials and result.trials[-1].state == "running":
                result.trials[-1].state = "interrupted"
            if result.trials:
                self._tick(bar, result.trials[-1], result, t0)
        finally:
            if bar is not None:
                bar.close()
        result.elapsed = time.monotonic() - t0
        return result

    # -- progress ----------------------------------------------------------------------------

    def _bar(self):
        if not self.progress:
            return None
        from tqdm import tqdm
        if self.n_trials:
            return tqdm(total=self.n_trials, desc="tune", unit="trial", dynamic_ncols=True)
        return tqdm(total=round(self.budget_s), desc="tune", unit="s", dynamic_ncols=True,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s "
                               "of budget{postfix}")

    def _tick(self, bar, rec: TrialRecord, result: TuneResult, t0: float) -> None:
        line = f"trial {rec.number} {rec.state}: {short(rec.params)}"
        if rec.value is not None:
            line += f" -> {rec.value:.4g} {self.objective.unit}"
            if rec.state == "pruned":
                line += f" (after {rec.rung} prompts)"
        if rec.error:
            line += f" ({rec.error})"
        line += f" [{rec.seconds:.0f} s]"
        if bar is None:
            self.log(line)
            return
        bar.write(line)
        if self.n_trials:
            bar.update(1)
        else:
            bar.n = min(bar.total, round(time.monotonic() - t0))
        best = result.best
        bar.set_postfix_str(f"trials {len(result.trials)}, best "
                            + (f"{best.value:.4g} {self.objective.unit} (#{best.number})"
                               if best else "-"))


def short(params: dict) -> str:
    names = {"max_num_seqs": "seqs", "max_num_batched_tokens": "tokens", "block_size": "block",
             "kv_tokens": "kv", "enable_prefix_caching": "prefix", "async_scheduling": "async",
             "enable_multi_stream": "ms"}
    return " ".join(f"{names.get(k, k)}={fmt(v)}" for k, v in params.items())


def fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def table(result: TuneResult, objective: Objective, space: list[Knob]) -> str:
    """The trials as a Markdown table, the best marked with *."""
    names = [k.name for k in space]
    head = ["#", "state", f"{objective.name} ({objective.unit})", *names,
            "TTFT p99 ms", "TPOT p99 ms", "s", "note"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in result.trials:
        s = t.summary or {}
        value = "-" if t.value is None else f"{t.value:.4g}"
        if t.state == "pruned" and t.value is not None:
            value += f" @{t.rung}"
        cells = [f"{t.number}{'*' if t is result.best else ''}", t.state, value,
                 *[fmt(t.params.get(n, "-")) for n in names],
                 f"{s['ttft_ms']['p99']:.0f}" if s else "-",
                 f"{s['tpot_ms']['p99']:.1f}" if s else "-",
                 f"{t.seconds:.0f}", (t.error or "").replace("|", "/")[:120]]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(result: TuneResult, objective: Objective, space: list[Knob], path) -> Optional[str]:
    """A PNG of the objective against each main knob searched (complete trials filled, pruned
    ones hollow at the value of the rung they reached, the best starred)."""
    knobs = [k for k in space if k.name in PLOT_KNOBS]
    measured = [t for t in result.trials if t.value is not None]
    if not knobs or not measured:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(2, len(knobs))
    rows = math.ceil(len(knobs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, k in zip(axes.flat, knobs):
        for state, style in (("complete", dict(marker="o", color="tab:blue")),
                             ("pruned", dict(marker="o", facecolors="none",
                                             edgecolors="tab:gray"))):
            pts = [(t.params[k.name], t.value) for t in measured
                   if t.state == state and k.name in t.params]
            if pts:
                ax.scatter(*zip(*pts), label=state, **style)
        if result.best is not None and k.name in result.best.params:
            ax.scatter([result.best.params[k.name]], [result.best.value], marker="*", s=250,
                       color="tab:red", label="best", zorder=3)
        if k.kind == "int_log" or k.kind == "choice":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(k.name)
        ax.set_ylabel(f"{objective.name} ({objective.unit})")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(knobs):]:
        ax.set_visible(False)
    axes.flat[0].legend()
    fig.suptitle(f"llm-serving tune: {objective.name} per trial")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
