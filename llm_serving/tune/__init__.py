"""``llm-serving tune``: search the batch, token-budget and KV-cache knobs for a machine and a
workload, by starting the real server per trial and measuring it with our own load client,
and write the best settings as an llm-serving YAML that ``start.py --config`` takes.

- ``space.py``: the knobs searched and their ranges;
- ``objective.py``: what a trial's measurement is scored by (throughput, TTFT/TPOT p99, goodput);
- ``trial_server.py``: one trial: write its YAML, start ``start.py`` on it, drive it with
  ``clients/benchmark_serving.py``, stop it;
- ``tuned_yaml.py``: the output file (the base config with the chosen knobs, a comment header);
- ``search.py``: the Optuna study (TPE, successive-halving pruning, the time budget, Ctrl-C),
  the progress bar, the table and the plot;
- ``cli.py``: the ``tune`` command line.
"""
