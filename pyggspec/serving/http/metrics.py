"""``GET /metrics``: counters kept by the HTTP front end, rendered in Prometheus text format.

The front end sees every finished request's result (tokens, timings, the request's own
speculation stats), so request, token, throughput and acceptance counters are accumulated
here, per request, without reaching into the scheduler's thread. Gauges that describe the
scheduler now (queue depth, busy slots) and memory by component are passed in at render
time. Names follow llama-server's ``llamacpp:`` metrics where one exists (with a
``pyggspec:`` prefix).

Beside them, :meth:`ServeMetrics.llamacpp_families` renders llama-server's own series
(``llamacpp:prompt_tokens_total`` ... ``llamacpp:n_busy_slots_per_decode``) with its HELP
and TYPE lines and its semantics, so dashboards and alerts built for llama-server work
unchanged: its two throughput gauges are averaged over the window since the previous scrape
(llama-server resets them at each ``/metrics``), while the ``pyggspec:`` ones stay
lifetime averages. :func:`prometheus_text` puts the two together into the body of
``/metrics``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PREFIX = "pyggspec:"
# time-to-first-token histogram bounds, seconds (a value equal to a bound counts in it)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Metric:
    """One metric family: name (without prefix), type, help, samples (labels, value)."""

    name: str
    type: str  # counter | gauge | histogram
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, suffix: str = "", **labels: str) -> Metric:
        self.samples.append(({"__suffix__": suffix, **labels}, value))
        return self


def _fmt_value(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(metrics: Iterable[Metric], prefix: str = PREFIX) -> str:
    """Prometheus text exposition format (version 0.0.4), every name under ``prefix``."""
    lines: list[str] = []
    for m in metrics:
        name = prefix + m.name
        lines.append(f"# HELP {name} {m.help}")
        lines.append(f"# TYPE {name} {m.type}")
        for labels, value in m.samples:
            labels = dict(labels)
            suffix = labels.pop("__suffix__", "")
            lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{suffix}{{{lab}}} {_fmt_value(value)}" if lab
                         else f"{name}{suffix} {_fmt_value(value)}")
    return "\n".join(lines) + "\n"


class ServeMetrics:
    """Totals over the server's life, updated once per finished request (thread-safe)."""

    def __init__(self, n_max: int = 0) -> None:
        self._lock = threading.Lock()
        self.n_max = n_max
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.finished: dict[str, int] = {}  # stop reason -> count
        self.prompt_tokens = 0  # evaluated (not cached)
        self.cached_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.verify_steps = 0
        self.drafted_at: list[int] = []  # per draft position
        self.accepted_at: list[int] = []
        self.draft_len_steps: list[int] = []  # verify steps that drafted exactly k tokens
        # time to first token as a histogram: counts per bucket (O(1) memory whatever
        # the number of requests; a list of every value grew ~32 bytes a request)
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)  # the last: above every bucket
        self.ttft_sum = 0.0
        self.n_tokens_max = 0  # longest sequence seen (prompt + generated)
        # llama-server's throughput buckets: (tokens, seconds) since the last scrape
        self.prompt_bucket = [0, 0.0]
        self.predict_bucket = [0, 0.0]

    # --- updates -------------------------------------------------------------------------
    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def record_result(self, result: Any) -> None:
        """Add one finished request (a ``serving.request.Result``)."""
        t = result.timings
        with self._lock:
            self.finished[result.stop_reason] = self.finished.get(result.stop_reason, 0) + 1
            self.prompt_tokens += t.prompt_n
            self.cached_tokens += t.cache_n
            self.prompt_seconds += t.prompt_ms / 1000
            self.predicted_tokens += t.predicted_n
            self.predicted_seconds += t.predicted_ms / 1000
            self.prompt_bucket[0] += t.prompt_n
            self.prompt_bucket[1] += t.prompt_ms / 1000
            self.predict_bucket[0] += t.predicted_n
            self.predict_bucket[1] += t.predicted_ms / 1000
            self.n_tokens_max = max(self.n_tokens_max,
                                    len(result.prompt_tokens) + len(result.tokens))
            spec = result.spec
            if spec is None:
                return
            self.draft_tokens += spec.n_drafted
            self.accepted_tokens += spec.n_accepted
            self.verify_steps += spec.n_steps
            _grow(self.drafted_at, len(spec.drafted_at))
            _grow(self.accepted_at, len(spec.accepted_at))
            for i, (d, a) in enumerate(zip(spec.drafted_at, spec.accepted_at)):
                self.drafted_at[i] += d
                self.accepted_at[i] += a
            lengths = getattr(spec, "draft_lengths", None)
            if lengths is None:
                # drafted_at[k] = steps with more than k drafts, so exactly k = [k-1] - [k]
                more = list(spec.drafted_at) + [0]
                lengths = [spec.n_steps - more[0]] + [more[k - 1] - more[k]
                                                      for k in range(1, len(more))]
            _grow(self.draft_len_steps, len(lengths))
            for k, n in enumerate(lengths):
                self.draft_len_steps[k] += n

    def record_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
            self.ttft_sum += seconds

    # --- rendering -------------------------------------------------------------------------
    def families(self, *, busy_slots: int, n_slots: int, queued: int,
                 memory: Mapping[str, Mapping[str, int]] | None = None,
                 extra: Iterable[Metric] = ()) -> list[Metric]:
        with self._lock:
            req = Metric("requests_total", "counter", "HTTP requests by endpoint and status.")
            for (ep, st), n in sorted(self.requests.items()):
                req.add(n, endpoint=ep, status=str(st))
            fin = Metric("requests_finished_total", "counter",
                         "Generations finished, by stop reason (eos, stop, length, context, "
                         "cancelled).")
            for reason, n in sorted(self.finished.items()):
                fin.add(n, reason=reason)
            out = [
                req, fin,
                Metric("prompt_tokens_total", "counter",
                       "Prompt tokens evaluated (not counting reused ones).").add(
                    self.prompt_tokens),
                Metric("prompt_tokens_cached_total", "counter",
                       "Prompt tokens reused from a slot's cache.").add(self.cached_tokens),
                Metric("prompt_seconds_total", "counter", "Prompt evaluation time.").add(
                    self.prompt_seconds),
                Metric("prompt_tokens_seconds", "gauge",
                       "Average prompt throughput in tokens/s.").add(
                    _rate(self.prompt_tokens, self.prompt_seconds)),
                Metric("tokens_predicted_total", "counter", "Generated tokens.").add(
                    self.predicted_tokens),
                Metric("tokens_predicted_seconds_total", "counter",
                       "Generation time, summed over requests.").add(self.predicted_seconds),
                Metric("predicted_tokens_seconds", "gauge",
                       "Average generation throughput per request in tokens/s.").add(
                    _rate(self.predicted_tokens, self.predicted_seconds)),
                Metric("requests_processing", "gauge", "Slots generating now.").add(busy_slots),
                Metric("requests_deferred", "gauge", "Requests waiting for a slot.").add(queued),
                Metric("slots_total", "gauge", "Sequence slots (-np).").add(n_slots),
                Metric("spec_decode_num_draft_tokens_total", "counter",
                       "Draft tokens proposed by the MTP head.").add(self.draft_tokens),
                Metric("spec_decode_num_accepted_tokens_total", "counter",
                       "Draft tokens accepted by the target.").add(self.accepted_tokens),
                Metric("spec_decode_num_drafts_total", "counter",
                       "Speculative verification steps.").add(self.verify_steps),
                Metric("spec_decode_acceptance_rate", "gauge",
                       "Accepted / drafted tokens over the server's life.").add(
                    self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0),
            ]
            pos = Metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                         "Accepted draft tokens per draft position.")
            rate = Metric("spec_decode_acceptance_rate_per_pos", "gauge",
                          "Acceptance rate per draft position.")
            for i, (d, a) in enumerate(zip(self.drafted_at, self.accepted_at)):
                pos.add(a, position=str(i))
                rate.add(a / d if d else 0.0, position=str(i))
            out += [pos, rate]
            hist = Metric("spec_decode_draft_length", "histogram",
                          "Draft tokens per verification step.")
            cum = 0
            for k, n in enumerate(self.draft_len_steps):
                cum += n
                hist.add(cum, "_bucket", le=str(k))
            hist.add(cum, "_bucket", le="+Inf")
            hist.add(sum(k * n for k, n in enumerate(self.draft_len_steps)), "_sum")
            hist.add(cum, "_count")
            out.append(hist)
            out.append(_histogram("time_to_first_token_seconds",
                                  "Time from request arrival to its first token.",
                                  TTFT_BUCKETS, self.ttft_counts, self.ttft_sum))
        if memory:
            mem = Metric("memory_bytes", "gauge", "Memory by component and device.")
            dev_total = Metric("memory_device_bytes", "gauge",
                               "Memory by device (host: the slots' prompt checkpoints).")
            for comp, by_dev in memory.items():
                if not isinstance(by_dev, Mapping):
                    continue
                for dev, n in by_dev.items():
                    if comp == "by_device":
                        dev_total.add(int(n), device=dev)
                    else:
                        mem.add(int(n), component=comp, device=dev)
            out += [mem, dev_total]
        out.extend(extra)
        return out

    def llamacpp_families(self, *, busy_slots: int, queued: int, n_decode: int,
                          n_busy_slots_decoded: int) -> list[Metric]:
        """llama-server's ``/metrics`` series (render with ``prefix="llamacpp:"``): its
        names, HELP texts, types and order. ``n_decode``: decode steps run;
        ``n_busy_slots_decoded``: busy slots summed over those steps. Resets the two
        throughput buckets, as each llama-server scrape does."""
        with self._lock:
            prompt_rate = _rate(*self.prompt_bucket)
            predict_rate = _rate(*self.predict_bucket)
            self.prompt_bucket = [0, 0.0]
            self.predict_bucket = [0, 0.0]
            counters = [
                ("prompt_tokens_total",
                 "Number of prompt tokens processed, excluding cached tokens",
                 self.prompt_tokens),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
                 self.cached_tokens),
                ("prompt_seconds_total", "Total time spent processing prompts",
                 self.prompt_seconds),
                ("tokens_predicted_total", "Number of generation tokens processed",
                 self.predicted_tokens),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens",
                 self.predicted_seconds),
                ("n_decode_total", ("Total number of llama_decode() calls, excluding "
                                    "speculative decoding and multimodal decoding"), n_decode),
                ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
                 self.n_tokens_max),
                ("spec_decode_num_draft_tokens_total",
                 "Speculative: Total draft tokens generated", self.draft_tokens),
                ("spec_decode_num_accepted_tokens_total",
                 "Speculative: Total draft tokens accepted by the target model",
                 self.accepted_tokens),
                ("spec_decode_num_drafts_total",
                 "Speculative: Total speculative decoding verification steps",
                 self.verify_steps),
            ]
            gauges = [
                ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
                ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
                 predict_rate),
                ("requests_processing", "Number of requests processing", busy_slots),
                ("requests_deferred", "Number of requests deferred", queued),
                ("n_busy_slots_per_decode",
                 "Average number of busy slots per llama_decode() call",
                 n_busy_slots_decoded / max(n_decode, 1)),
            ]
            out = [Metric(n, "counter", h).add(v) for n, h, v in counters]
            out += [Metric(n, "gauge", h).add(float(v)) for n, h, v in gauges]
            if self.accepted_at:
                pos = Metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                             "Accepted tokens per draft position")
                for i, a in enumerate(self.accepted_at):
                    pos.add(a, position=str(i))
                out.append(pos)
        return out


def _grow(xs: list[int], n: int) -> None:
    while len(xs) < n:
        xs.append(0)


def _rate(n: float, s: float) -> float:
    return n / s if s > 0 else 0.0


def _histogram(name: str, help: str, buckets: tuple[float, ...], counts: list[int],
               total: float) -> Metric:
    """A Prometheus histogram from per-bucket counts (``counts[i]``: values in
    (buckets[i-1], buckets[i]]; the last: above every bucket) and the values' sum."""
    h = Metric(name, "histogram", help)
    cum = 0
    for b, n in zip(buckets, counts, strict=False):
        cum += n
        h.add(cum, "_bucket", le=repr(float(b)))
    cum += counts[-1]
    h.add(cum, "_bucket", le="+Inf")
    h.add(float(total), "_sum")
    h.add(cum, "_count")
    return h


def lengths_families(lengths: Mapping[str, Any] | None) -> list[Metric]:
    """The draft-length rule (``DraftLengths.to_dict()``), per drafter kind: the survival
    of each draft position, what a step drafting k tokens costs in plain steps of its
    batch size, and how often each length was chosen -- so a scrape shows why it drafts."""
    if not lengths:
        return []
    surv = Metric("spec_draft_survival", "gauge",
                  "Share of verified drafts whose first position+1 tokens were accepted.")
    ratio = Metric("spec_draft_step_cost_ratio", "gauge",
                   "A step drafting k tokens, in plain steps of its batch size (medians of "
                   "recent steps).")
    chosen = Metric("spec_draft_length_chosen_total", "counter",
                    "Steps for which the rule chose this draft length.")
    for kind, d in lengths.items():
        for i, v in enumerate(d["survival"]):
            surv.add(float(v), kind=kind, position=str(i))
        for shape, r in d["ratios"].items():
            batch, k = shape.split("x")
            ratio.add(float(r), kind=kind, batch=batch, k=k)
        for k, n in enumerate(d["lengths"]):
            chosen.add(int(n), kind=kind, k=str(k))
    return [surv, ratio, chosen]


def hot_vocab_families(hot: Mapping[str, Any] | None) -> list[Metric]:
    """The draft head's hot vocabulary (``HotVocab.to_dict()``): how many ids it holds,
    whether drafts use it now, the running share of emitted tokens inside it (it is used
    while that is >= 0.97), the share over the server's life, and how often it was chosen
    again -- so a scrape shows when real traffic falls outside it (drafts then score the
    whole vocabulary: slower, never wrong)."""
    if not hot:
        return []
    out = [Metric("spec_draft_hot_vocab_size", "gauge",
                  "Token ids the draft head's hot vocabulary holds.").add(int(hot["size"])),
           Metric("spec_draft_hot_vocab_active", "gauge",
                  "1 while drafts are scored over the hot vocabulary, 0 over the whole one."
                  ).add(int(bool(hot["active"]))),
           Metric("spec_draft_hot_vocab_coverage", "gauge",
                  "Running share of emitted tokens inside the hot vocabulary (~256 tokens)."
                  ).add(float(hot["coverage"])),
           Metric("spec_draft_hot_vocab_choices_total", "counter",
                  "Times the hot vocabulary was chosen again from the tokens seen."
                  ).add(int(hot["choices"]))]
    if hot.get("emitted_in_set") is not None:
        out.append(Metric("spec_draft_hot_vocab_emitted_in_set", "gauge",
                          "Share of all emitted tokens that were inside the set of their time."
                          ).add(float(hot["emitted_in_set"])))
    return out


def prometheus_text(counters: ServeMetrics, sched: Mapping[str, Any],
                    memory: Mapping[str, Mapping[str, int]] | None) -> str:
    """The whole ``GET /metrics`` body: llama-server's ``llamacpp:`` series, then
    pyggspec's ``pyggspec:`` ones. ``counters``: what the front end counted; ``sched``:
    the scheduler's view now (``Scheduler.metrics()``: queue, slots, recent throughput,
    failed requests, decode steps); ``memory``: bytes by component
    (``Scheduler.memory()``)."""
    extra = [
        Metric("tokens_per_second", "gauge",
               "Generation throughput of the whole server over the last seconds.").add(
            float(sched["tokens_per_second"])),
        Metric("requests_failed_total", "counter",
               "Requests whose step failed (the others carried on).").add(
            int(sched["requests_failed"])),
        Metric("n_decode_total", "counter", "Decode / verify batches run.").add(
            int(sched["decode_steps"])),
    ]
    extra += lengths_families(sched.get("draft_lengths"))
    extra += hot_vocab_families(sched.get("hot_vocab"))
    ours = counters.families(busy_slots=int(sched["busy_slots"]), n_slots=int(sched["n_slots"]),
                             queued=int(sched["queue_depth"]), memory=memory, extra=extra)
    llama = counters.llamacpp_families(
        busy_slots=int(sched["busy_slots"]), queued=int(sched["queue_depth"]),
        # llama-server counts every llama_decode() but speculative drafts: prompt batches too
        n_decode=int(sched["decode_steps"]) + int(sched.get("prompt_chunks", 0)),
        n_busy_slots_decoded=int(sched.get("decode_busy_slots", 0)))
    return render(llama, prefix="llamacpp:") + render(ours)
