#!/usr/bin/env python3
"""Sampling benchmark: host sampling vs in-graph (device) sampling at a real vocabulary.

For each device (CPU, and an RPC server on loopback serving this CPU) and each sequence
count, the logits sit in a buffer on the device (as the LM head's output would) and a graph
produces them; the host path reads the full logits back and runs the chain in numpy, the
device path appends the sampler prefix to the graph and reads back only candidates or ids.
Reports milliseconds per sampled token and bytes device->host per token, a table and a
JSON line.

    python3 scripts/bench_sampling.py                 # vocab 248320, 1 and 4 seqs
    python3 scripts/bench_sampling.py --steps 20 --threads 2 --no-rpc
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pyggspec.ggml import buffer, context, device, sched
from pyggspec.sampling import (
    DeviceSampling,
    RowInput,
    SamplerChain,
    SamplingParams,
    SamplingStats,
    plan_chain,
    sample_host,
)

CHAINS = {
    "default": SamplingParams(seed=1, repeat_penalty=1.1),
    "greedy": SamplingParams(seed=1, temp=0.0),
    # no truncation: every stage in the graph, the token drawn there with in-graph noise
    "dist": SamplingParams(seed=1, temp=1.0, top_k=0, top_p=1.0, min_p=0.0),
}


def bench_one(backends, dev, params, V, n_seq, steps, device_sampling: bool) -> dict:
    R = n_seq
    rng = np.random.default_rng(0)
    logits = (rng.standard_t(2, size=(R, V)) * 1.5).astype(np.float32)
    lctx = context.Context(2)
    leaf = lctx.new_tensor("f32", (V, R), "logits_store")
    lbuf = buffer.Buffer.for_context(lctx, dev, "logits")
    leaf.set(logits)
    ctx = context.Context(256, graph_size=512)
    graph = sched.Graph(ctx, [], 512)
    out = ctx.scale(leaf, 1.0).set_output()
    graph.expand(out)
    stats = SamplingStats()
    plan = plan_chain(params, dev, V, R, device_sampling, stats=stats)
    handle = DeviceSampling.build(ctx, graph, out, plan, 1, stats=stats)
    s = sched.BackendScheduler(backends, graph_size=512)
    chains = [SamplerChain(params, V) for _ in range(n_seq)]
    for c in chains:
        c.accept_prompt(rng.integers(0, V, 64).tolist())
    host_buf = np.empty((R, V), dtype=np.float32)
    times, d2h = [], 0
    try:
        for step in range(steps + 2):
            t0 = time.perf_counter()
            s.alloc(graph)
            rows = [RowInput(c) for c in chains]
            if plan.n_device:
                handle.set_inputs(rows)
                s.compute(graph)
                toks = handle.finish_host(rows).tolist()
            else:
                s.compute(graph)
                out.get(host_buf)
                d2h += host_buf.nbytes if step >= 2 else 0
                toks = [sample_host(c, host_buf[i]) for i, c in enumerate(chains)]
            for c, t in zip(chains, toks):
                c.accept(t)
            if step >= 2:
                times.append(time.perf_counter() - t0)
    finally:
        handle.close()
        s.close()
        ctx.close()
        lbuf.close()
        lctx.close()
    n_tok = steps * n_seq
    if plan.n_device:
        d2h = stats.bytes_d2h - 0  # includes the 2 warm-up steps: subtract proportionally
        d2h = d2h * steps / (steps + 2)
    return {"ms_per_token": statistics.median(times) * 1000 / n_seq,
            "bytes_d2h_per_token": d2h / n_tok,
            "device_stages": [st.name for st in plan.device_stages]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--seqs", default="1,4")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (2 busy-waiting threads on a 2-core VM distort timings)")
    ap.add_argument("--chains", default="default,greedy,dist")
    ap.add_argument("--no-rpc", action="store_true")
    a = ap.parse_args()

    cpu_dev = device.cpu_device()
    cpu = cpu_dev.open(n_threads=a.threads)
    devs = [("CPU", [cpu], cpu_dev)]
    server = None
    if not a.no_rpc and device.has_rpc():
        server = device.RpcServer(n_threads=a.threads)
        rpc_dev = device.add_rpc_server(server.endpoint)[0]
        devs.append(("RPC", [rpc_dev.open(), cpu], rpc_dev))
    results = []
    try:
        for dname, backends, dev in devs:
            for chain in a.chains.split(","):
                for n_seq in (int(x) for x in a.seqs.split(",")):
                    row = {"device": dname, "chain": chain, "n_seq": n_seq, "vocab": a.vocab}
                    for mode, on in (("host", False), ("device", True)):
                        r = bench_one(backends, dev, CHAINS[chain], a.vocab, n_seq, a.steps, on)
                        row[f"{mode}_ms"] = round(r["ms_per_token"], 3)
                        row[f"{mode}_bytes"] = round(r["bytes_d2h_per_token"])
                        if on:
                            row["device_stages"] = "+".join(r["device_stages"])
                    row["speedup"] = round(row["host_ms"] / row["device_ms"], 2)
                    results.append(row)
    finally:
        if server is not None:
            server.close()
    hdr = (f"{'device':6} {'chain':8} {'seqs':>4} {'host ms/tok':>11} {'dev ms/tok':>10} "
           f"{'x':>5} {'host B/tok':>10} {'dev B/tok':>9}  device stages")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['device']:6} {r['chain']:8} {r['n_seq']:>4} {r['host_ms']:>11.3f} "
              f"{r['device_ms']:>10.3f} {r['speedup']:>5.2f} {r['host_bytes']:>10} "
              f"{r['device_bytes']:>9}  {r['device_stages']}")
    print(json.dumps({"bench": "sampling", "threads": a.threads, "results": results}))


if __name__ == "__main__":
    main()
