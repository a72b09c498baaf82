"""KV transfer per request, both connectors: how long a consumer waits for a prompt's KV and
at what bandwidth, against computing the prefill itself, on the 97 M bench model.

For each connector (MooncakeConnector = P2P over TCP loopback, MooncakeStoreConnector = a
pool on a local ``mooncake_master`` started here) a producer and a consumer engine run in this
process (each its own Mooncake endpoint; the data still goes through Mooncake's TCP path).
Per prompt length: the producer's prefill (with the pool: the put included), the consumer's
wait in WAITING_FOR_REMOTE_KVS (load time), bytes moved and bandwidth, and a colocated
prefill of the same prompt for comparison. Prints a table.

    python bench/bench_kv_transfer.py [--lengths 256,1024,2000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import subprocess
import time

import numpy as np
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drive(engine, rid, others=()):
    """Step until ``rid`` finishes; its final output."""
    while True:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o
        for e in others:
            if e.has_unfinished_requests():
                e.step()


def _load_time(D, P, rid):
    """Seconds from ``rid``'s admission on D until its KV has arrived (stepping P too):
    D's steps until then do nothing else (the request is alone)."""
    seq = D.requests[rid].seqs[0]
    t0 = time.perf_counter()
    while not seq.kv_remote_done or seq.kv_load_key in D.remote_kv.loading:
        D.step()
        if P.has_unfinished_requests():
            P.step()
    return time.perf_counter() - t0


def run(model, connector, lengths, repeats, master):
    from llm_serving.config import EngineArgs
    from llm_serving.engine.llm_engine import LLMEngine
    from llm_serving.sampling_params import SamplingParams
    extra = {"master_server_address": master, "global_segment_size": 1 << 30} \
        if connector == "MooncakeStoreConnector" else {}

    def engine(role, eid):
        return LLMEngine(EngineArgs(model, block_size=16, num_blocks=1024,
                                    max_num_batched_tokens=max(lengths), kv_transfer_config={
                                        "kv_connector": connector, "kv_role": role,
                                        "engine_id": eid, "kv_connector_extra_config": extra}))
    P, D = engine("kv_producer", f"P-{connector}"), engine("kv_consumer", f"D-{connector}")
    C = LLMEngine(EngineArgs(model, block_size=16, num_blocks=1024,
                             max_num_batched_tokens=max(lengths)))
    rng = np.random.default_rng(0)
    vocab = C.model_config.vocab_size
    rows = []
    for n in lengths:
        t_prefill, t_colo, t_load, nbytes = [], [], [], []
        for r in range(repeats):
            ids = rng.integers(3, vocab, n).tolist()
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            t0 = time.perf_counter()
            C.add_request({"prompt_token_ids": ids}, one, request_id=f"c{n}-{r}")
            _drive(C, f"c{n}-{r}")
            t_colo.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            P.add_request({"prompt_token_ids": ids}, SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True,
                kv_transfer_params={"do_remote_decode": True}), request_id=f"p{n}-{r}")
            out = _drive(P, f"p{n}-{r}")
            t_prefill.append(time.perf_counter() - t0)
            b0 = D.stats.kv_transfer_bytes
            D.add_request({"prompt_token_ids": ids}, SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True,
                kv_transfer_params=out.kv_transfer_params), request_id=f"d{n}-{r}")
            t_load.append(_load_time(D, P, f"d{n}-{r}"))
            _drive(D, f"d{n}-{r}", [P])
            nbytes.append(D.stats.kv_transfer_bytes - b0)
        while P.has_unfinished_requests() or D.has_unfinished_requests():
            for e in (P, D):
                if e.has_unfinished_requests():
                    e.step()
        load = float(np.median(t_load))
        rows.append((connector, n, np.median(t_colo) * 1e3, np.median(t_prefill) * 1e3,
                     load * 1e3, np.median(nbytes) / 2**20,
                     np.median(nbytes) / load / 2**30 if load > 0 else float("nan")))
    for e in (P, D, C):
        e.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--lengths", default="256,1024,2000",
                    help="prompt lengths (each + 1 output token within the model length)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--connectors", default="MooncakeConnector,MooncakeStoreConnector")
    args = ap.parse_args()
    model = model_path(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    port = _free_port()
    master = subprocess.Popen([shutil.which("mooncake_master"), f"--port={port}",
                               "--enable_http_metadata_server=false"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        print(f"# KV transfer per request, {datetime.date.today()}, {cpu_description()}, "
              f"load {os.getloadavg()[0]:.2f}")
        print(f"model: {model}")
        rows = []
        for c in args.connectors.split(","):
            rows += run(model, c, lengths, args.repeats, f"127.0.0.1:{port}")
        print("| connector | prompt tokens | colocated prefill ms | P prefill (+put) ms | "
              "D load ms | MiB moved | GiB/s |")
        print("|---|---|---|---|---|---|---|")
        for c, n, colo, pre, load, mib, bw in rows:
            print(f"| {c} | {n} | {colo:.0f} | {pre:.0f} | {load:.1f} | {mib:.1f} | "
                  f"{bw:.2f} |")
    finally:
        master.terminate()
        master.wait(10)


if __name__ == "__main__":
    main()
