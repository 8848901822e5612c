"""Sampler chains that run partly in the ggml graph and finish on the host, token-identical.

Chain
    ``SamplingParams`` (llama.cpp names and defaults) resolves to stages: logit bias first,
    then ``--samplers`` in order (penalties, top_k, typ_p, top_p, min_p, temperature; dry,
    top_n_sigma, xtc, infill, adaptive_p are not implemented and, with their parameters at
    llama.cpp's disabled defaults, are no-ops), disabled members dropped, then ``dist``.
    Temperature <= 0 is ``greedy``; top_k/top_p/min_p are then dropped because they always
    keep a maximum and cannot change an argmax under the tie rule.

Exactness (why the graph and the host pick the same token)
    * Only IEEE float32 add/sub/mul, negation, ``step`` (x > 0), ``log`` of exactly 0 or 1,
      copies and integer-valued sums run in the graph; the host does the same operations on
      the same float32 values, so every intermediate value is bit-identical. No division
      (CUDA builds use fast-math), no exp, no fused scale+bias on non-{0,1} values.
    * Temperature multiplies by ``float32(1/temp)``; the repeat penalty multiplies by
      ``float32(1/penalty)`` or ``float32(penalty)`` chosen by sign with an exact 0/1 select
      (llama.cpp divides; the results differ from llama.cpp's in the last bit, not between
      our two paths). Frequency/presence amounts are computed on the host in float32.
    * min_p is a logit-space threshold: keep l >= max + float32(log p); the max is the value
      at ggml_argmax (whatever its tie rule), the comparison is ``step(-(l - thr))``.
    * Ties go to the lowest id. ggml's CPU argmax returns the *last* maximum and top_k's
      order among ties is unspecified, so the graph never relies on either: the argmax marks
      all maxima (l - max == 0), weights them by V - id (exact in float32) and takes the
      argmax of that unique maximum. top_k returns its k ids plus the count of logits >= the
      k-th largest; more than k means a boundary tie, and the host re-selects from the full
      row (rare, logged once, counted in stats).
    * top_p and typical_p threshold cumulative sums of exponentials, whose last bits differ
      between ggml and numpy and could move the cut; they run on the host only, in float64
      over the candidates sorted by (logit desc, id asc), so their result depends only on
      the candidate set, not on where it came from.
    * ``dist`` is Gumbel-max: argmax(l + g). The noise g for token id i of the n-th sampled
      token is a pure function of (seed, n, i) (SplitMix64 counter hash -> float32 Gumbel,
      computed on the host only). The graph adds a full-width noise input; the host adds the
      same values for its candidates. One draw per emitted token, whichever path runs and
      however many verify rows were evaluated, so speculative decoding stays lossless and a
      chain's RNG state is just a counter (``snapshot``/``restore``).
    * Limits: NaN logits are undefined; backends that flush denormals (CUDA fast-math) could
      differ for |logit| < 1.2e-38.

Planning and fallback
    ``plan_chain`` probes each stage's ops with ``ggml_backend_dev_supports_op`` at the real
    ``[n_vocab, n_rows]`` shape on the output device; the longest supported prefix runs in
    the graph, a top_k or token-choosing stage ends it. What comes back is the chosen id,
    k candidates (ids + logits), or (when the prefix ends on a host-only stage) the
    filtered logits. Backend sampling off, a split output layer or an unsupported op send
    the chain (or its rest) to the host at planning time. Plans are registered with the
    target once per structure (``SamplingPlan.key``: stage signatures, device, rows), so
    later generations reuse the plan id and its cached graph; each row's own chain supplies
    the values (inputs and host suffix). A step whose device part fails at run time
    (graph build, allocation, inputs, reading or checking the ids) is finished on the host:
    before compute the target redoes it with logits as output, after compute it reads the
    raw logits, which stay a graph output. From then on that generation's chains run on the
    host (``SequenceSamplers.device_failed``). Nothing is accepted for the failed attempt,
    so no random number is drawn twice and the tokens equal a host-only run. Each reason is
    logged once on logger ``pyggspec.sampling`` and counted in stats (``fallbacks``).
    ``force_unsupported("TOP_K")`` is the planning test hook. A failed graph compute is not
    redone (the recurrent state may have advanced): it raises.

API
    ``SamplerChain(params, n_vocab)`` per sequence (``accept``, ``accept_prompt``,
    ``snapshot``/``restore``); ``sample_host(chain, logits_row, prefix=())``;
    ``plan_chain(params, device, n_vocab, n_rows, backend_sampling)`` (``plan_chains`` for
    several sequences sharing one graph);
    ``plan.build(ctx, graph, logits, rows_per_seq)`` (a :class:`DeviceSampling`) then per step
    ``set_inputs(rows)`` before compute and ``finish_host(rows)`` after it, with ``rows`` a
    list of ``RowInput(chain, prefix)`` (prefix = drafts before that verify row).

Modules
    ``params`` (SamplingParams), ``stages`` (each stage's host and graph version), ``noise``
    (the Gumbel noise), ``chain`` (SamplerChain, RowInput), ``host`` (host sampling),
    ``plan`` (planning), ``graph`` (the device part), ``stats``, ``session`` (the chains of
    the sequences in the slots).
"""

from pyggspec.sampling.chain import ChainState, RowInput, SamplerChain
from pyggspec.sampling.graph import DeviceSampling, finish_host
from pyggspec.sampling.host import sample_host
from pyggspec.sampling.params import (
    DEFAULT_SAMPLERS,
    SamplingParams,
    graph_sampling,
)
from pyggspec.sampling.plan import SamplingPlan, force_unsupported, plan_chain, plan_chains
from pyggspec.sampling.stages import gumbel_noise
from pyggspec.sampling.stats import SamplingStats

__all__ = [
    "DEFAULT_SAMPLERS",
    "ChainState",
    "DeviceSampling",
    "RowInput",
    "SamplerChain",
    "SamplingParams",
    "SamplingPlan",
    "SamplingStats",
    "finish_host",
    "force_unsupported",
    "graph_sampling",
    "gumbel_noise",
    "plan_chain",
    "plan_chains",
    "sample_host",
]
