"""gpu_check's row groups for the large shapes: processes that outlive their requests.

A row group (one shape, one agreement, one ``-np``) opens our engines once in one process
(``ours_host.py``: a speculating engine with the default draft-length rule, and one with
fixed drafts whose per-request cap gives n_max 1..4; plain requests ask that one for no
speculation, which takes its plain step, with no drafter work) and starts one llama-server
per setting (llama-server 0.3.36 takes its draft settings from its command line only:
``server-schema.cpp`` keeps the per-request speculative fields under ``#if 0``). While a
llama-server is up, each repetition sends the same request to it and to our matching
setting, in alternating order, seconds apart: the pairs of the ratios. Requests are greedy,
``ignore_eos``, the same seeded prompts for both engines.

Where the time goes (item 3 of issue 54) comes with every run: ours from the engine's own
counters (``ours_host.py``), llama-server's from its ``timings`` (predicted_ms over its
steps: generated tokens less accepted drafts, less the prompt's token) and its log's
"graphs reused" line (its per-phase MTP durations, ``dur(b,g,a)``, are logged at trace
verbosity only, which would slow it: not asked for).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import bench_mtp
import benchlib

PREFILL = 512  # prompt tokens of the prefill request of each repetition


class OursHost:
    """``ours_host.py`` in a child process: ``request(...)`` -> its JSON answer."""

    def __init__(self, path: Path, engines: dict, common: dict, timeout: float = 900) -> None:
        cfg = {"path": str(path), "engines": engines, "common": common}
        if benchlib.OFFLOAD.ngl is not None:
            cfg["common"]["n_gpu_layers"] = benchlib.OFFLOAD.ngl
        if benchlib.OFFLOAD.device:
            cfg["common"]["device"] = benchlib.OFFLOAD.device
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen([sys.executable, str(HERE / "ours_host.py"), json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True)
        t0 = time.monotonic()
        self.ready = self._read()
        self.ready["start_s"] = round(time.monotonic() - t0, 2)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._err.seek(0)
            raise RuntimeError(f"ours_host exited ({self.proc.wait()}):\n{self._err.read()[-3000:]}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"ours_host: {out['error']}")
        return out

    def request(self, engine: str, prompts: list[list[int]], n: int,
                speculative: bool | None = None, n_draft_max: int | None = None) -> dict:
        cmd = {"engine": engine, "prompts": prompts, "n": n, "speculative": speculative,
               "n_draft_max": n_draft_max}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


class LlamaSrv:
    """One llama-server for a row group's setting (0: plain, k: draft-mtp n_max k), its log
    in a file for the per-request lines the split reads."""

    def __init__(self, path: Path, threads: int, ctx: int, P: int, n_max: int) -> None:
        self.log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        flags = ["-t", str(threads), "-c", str(ctx * P), "-np", str(P), "--log-file",
                 str(self.log)]
        if n_max:
            flags += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)]
        t0 = time.monotonic()
        self.srv = benchlib.LlamaServer(path, flags)
        self.srv.__enter__()
        self.start_s = round(time.monotonic() - t0, 2)
        self.n_max = n_max
        self.srv.complete(bench_mtp.prompts(1, path)[0][:8], 64)  # warm-up, as ours_host
        self._last = self._wait_reused(0)  # the log's counter after the warm-up

    def _wait_reused(self, n_lines: int) -> int | None:
        """The log's last "graphs reused" value once it has more than ``n_lines`` of them
        (the slot's lines follow its response by a moment), else None."""
        for _ in range(40):
            got = self._reused()
            if len(got) > n_lines:
                return got[-1]
            time.sleep(0.05)
        return None

    def _reused(self) -> list[int]:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return [int(m) for m in re.findall(r"graphs reused =\s+(\d+)", text)]

    def request(self, prompts: list[list[int]], n: int) -> dict:
        seen = len(self._reused())
        if len(prompts) == 1:
            res, wall = [self.srv.complete(prompts[0], n)], None
        else:
            res, wall = self.srv.complete_many(prompts, n)
        tim = [r["timings"] for r in res]
        n_gen = sum(t["predicted_n"] for t in tim)
        out = {"tokens": [r.get("tokens", []) for r in res],
               "tps": tim[0]["predicted_per_second"] if wall is None else n_gen / wall,
               "prefill_tps": tim[0].get("prompt_per_second")}
        drafted = sum(t.get("draft_n", 0) for t in tim)
        acc = sum(t.get("draft_n_accepted", 0) for t in tim)
        if self.n_max and drafted:
            out["accept"] = acc / drafted
        # its steps: every target decode gives one token plus its accepted drafts; the
        # first token came with the prompt (predicted_ms counts from it, as ours)
        steps = max(1, sum(t["predicted_n"] - 1 for t in tim) - acc) / len(tim)
        ms = statistics.mean(t["predicted_ms"] for t in tim)
        split = {"steps": round(steps, 1), "ms_per_step": ms / steps}
        now = self._wait_reused(seen + len(res) - 1)
        if now is not None and self._last is not None:
            # the log's counter runs over the server's life: this request's part
            split["graphs_reused"] = now - self._last
        self._last = now
        out["split"] = split
        return out

    def close(self) -> None:
        self.srv.__exit__(None, None, None)
        self.log.unlink(missing_ok=True)


def median_split(splits: list[dict]) -> dict:
    keys = sorted({k for s in splits for k in s})
    return {k: statistics.median(s[k] for s in splits if k in s) for k in keys}


def split_note(who: str, s: dict) -> str:
    """One line of a row's notes: the median step split."""
    if not s:
        return ""
    parts = [f"{who}: step {s['ms_per_step']:.2f} ms"
             + (f" (median {s['ms_per_step_median']:.2f})" if "ms_per_step_median" in s else "")]
    if "verify_ms_per_step" in s:
        parts.append(f"verify {s['verify_ms_per_step']:.2f}")
        if s.get("mtp_runs_per_step"):
            parts.append(f"MTP {s['mtp_runs_per_step']:.1f} x {s['mtp_ms_per_run']:.2f}")
        parts.append(f"host {s['host_ms_per_step']:.2f}")
        parts.append(f"{s['syncs_per_step']:.1f} syncs/step, {s['rebuilds']:.0f} rebuilds "
                     f"({s['builds']:.0f} builds)")
    if "graphs_reused" in s:
        parts.append(f"graphs reused {s['graphs_reused']:.0f} of ~{s['steps']:.0f} steps")
    return ", ".join(parts)
