"""Our graphs on a real non-CPU ggml device (Vulkan through Mesa's lavapipe in CI, CUDA on
a lent GPU): everything equals the CPU run.

The device is the ``accel_device`` fixture (tests/conftest.py): ``PYGGSPEC_TEST_DEVICE``
names it, else the first GPU-API device ggml lists; CI sets ``PYGGSPEC_REQUIRE_DEVICE=1``
so that a missing device fails instead of skipping. Logits are held to the tolerance ggml
itself shows between the CPU and that device: llama.cpp (through llama_cpp, same file,
same prompt, offloaded to the same device) measured in the same test. Tokens must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.ggml import quirks
from pyggspec.sampling import SamplingParams
from pyggspec.serving.request import Request
from pyggspec.testing.oracle import oracle_greedy, rel_err
from tests.test_trunk_oracle import ours_greedy

pytestmark = pytest.mark.device

PROMPT = [int(t) for t in np.random.default_rng(7).integers(5, 900, size=24)]
PROMPTS = [[300, 301, 302], [400, 401]]
N = 24
SAMPLED = SamplingParams(temp=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=1234)


@pytest.fixture(scope="module")
def paths(models):
    """f32 constructed-agreement fixtures (acceptance well above 0): grafted and split."""
    out = {}
    for arch in ("dense", "moe"):
        kw = {"dtype": "f32", "agreement": 0.8, "tied_embeddings": False}
        out[arch] = models.get(arch, **kw)
        out[f"{arch}-split"] = models.split(arch, **kw)
    return out


@pytest.fixture
def engine(make_engine):
    """``engine(path, dev=None, **kw)``: an engine on the CPU (``dev`` None) or fully
    offloaded to ``dev``; ``path`` may be a (trunk, mtp) pair."""

    def make(path, dev=None, **kw) -> Engine:
        kw.setdefault("n_ctx", 256)
        if dev is not None:
            kw.setdefault("n_gpu_layers", "all")
            kw["device"] = dev.name
        return make_engine(path, **kw)

    return make


def oracle_logits(path, prompt, n, dev=None):
    """llama.cpp's greedy logits and tokens, on the CPU or offloaded to ``dev``."""
    kw = {"n_gpu_layers": 99, "devices": [dev.name]} if dev is not None else {}
    return oracle_greedy(path, prompt, n, **kw)


def tokens(e: Engine, prompts, n=N, stats: list | None = None, **kw) -> list[list[int]]:
    """Each prompt's tokens; ``stats`` (a list) receives the call's speculation counts."""
    g = e.generate_batch(prompts, max_tokens=n, ignore_eos=True, **kw)
    if stats is not None:
        stats.append(g.stats)
    return [r.tokens for r in g]


def on_device(e: Engine, dev) -> None:
    """The engine really placed its layers and output on ``dev``."""
    assert dev.name in e.placement.layer_devices and e.placement.output_device == dev.name
    assert e.memory()["weights"].get(dev.name, 0) > 0


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_trunk_logits_and_greedy_equal_cpu(paths, engine, accel_device, arch):
    """Full offload: greedy tokens equal the CPU's; logits within the CPU-vs-device
    difference llama.cpp itself shows on this device (measured here, never below 1e-6,
    with a factor 2 for graphs that are not op-for-op llama.cpp's)."""
    path = paths[arch]
    with engine(path) as e:
        cpu, cpu_toks = ours_greedy(e, PROMPT, 16)
    with engine(path, accel_device) as e:
        on_device(e, accel_device)
        dev, dev_toks = ours_greedy(e, PROMPT, 16)
    assert dev_toks == cpu_toks
    ref_cpu, ref_toks = oracle_logits(path, PROMPT, 16)
    ref_dev, ref_dev_toks = oracle_logits(path, PROMPT, 16, accel_device)
    assert ref_toks == ref_dev_toks == cpu_toks
    assert np.array_equal(cpu, ref_cpu)  # f32 on the CPU: bit-identical to llama.cpp
    ggml_noise = rel_err(ref_dev, ref_cpu)
    assert rel_err(dev, cpu) <= max(2 * ggml_noise, 1e-6), (rel_err(dev, cpu), ggml_noise)


@pytest.mark.parametrize("how", ["ngl", "override", "cpu-moe"])
def test_partial_offload_equals_cpu(paths, engine, accel_device, how):
    """Part of the model on the device (-ngl 3, -ot, --cpu-moe), the rest on the CPU:
    greedy and speculative tokens equal the CPU's."""
    path = paths["moe"]
    with engine(path, spec_type="draft-mtp", spec=SpecConfig(n_max=3, adaptive=False),
                n_parallel=2) as e:
        ref = tokens(e, PROMPTS)
    kw: dict = {"n_gpu_layers": 3}
    if how == "override":
        kw = {"n_gpu_layers": "all", "override_tensor": [(r"blk\.[02]\.", "CPU")]}
    elif how == "cpu-moe":
        kw = {"n_gpu_layers": "all", "cpu_moe": True}
    with engine(path, accel_device, spec_type="draft-mtp", n_parallel=2,
                spec=SpecConfig(n_max=3, adaptive=False), **kw) as e:
        w = e.memory()["weights"]
        assert w.get(accel_device.name, 0) > 0 and w.get("CPU", 0) > 0
        on_cpu = {"ngl": "blk.0.attn_norm.weight", "override": "blk.2.ffn_gate_inp.weight",
                  "cpu-moe": "blk.1.ffn_up_exps.weight"}[how]
        assert e.placement.device_of(on_cpu) == "CPU"
        assert e.placement.device_of("blk.3.ffn_gate_inp.weight") == accel_device.name
        assert tokens(e, PROMPTS) == ref


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("layout", ["grafted", "split"])
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_mtp_drafting_lossless_on_device(paths, engine, accel_device, arch, layout, rollback):
    """MTP speculation on the device, two sequences (-np 2), grafted and separate heads,
    snapshot and checkpoint rollback: tokens equal plain decoding on the CPU, and the
    drafts are accepted as often as on the CPU (the same drafts)."""
    path = paths[arch] if layout == "grafted" else paths[f"{arch}-split"]
    trunk = path[0] if isinstance(path, tuple) else path
    with engine(trunk, n_parallel=2) as e:
        plain = tokens(e, PROMPTS)
    spec = SpecConfig(n_max=3, rollback=rollback, adaptive=False)
    with engine(path, spec_type="draft-mtp", spec=spec, n_parallel=2) as e:
        st: list = []
        assert tokens(e, PROMPTS, stats=st) == plain
        cpu_stats = (st[0].n_drafted, st[0].n_accepted)
    with engine(path, accel_device, spec_type="draft-mtp", spec=spec, n_parallel=2) as e:
        on_device(e, accel_device)
        assert e.rollback == rollback
        st = []
        assert tokens(e, PROMPTS, stats=st) == plain
        assert (st[0].n_drafted, st[0].n_accepted) == cpu_stats
        assert st[0].n_accepted > 0


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_seeded_sampling_in_graph_and_on_host(paths, engine, accel_device, arch):
    """Seeded sampling with the chain in the device graph (-bs) and on the host gives the
    CPU's tokens; with MTP the coupled drafts (drawn in the device's MTP graph) keep them."""
    path = paths[arch]
    with engine(path, n_parallel=2, sampling=SAMPLED, backend_sampling=False) as e:
        ref = tokens(e, PROMPTS)
    for bs in (True, False):
        with engine(path, accel_device, n_parallel=2, sampling=SAMPLED,
                    backend_sampling=bs) as e:
            assert tokens(e, PROMPTS) == ref, f"backend_sampling={bs}"
            st = e.samplers.stats.to_dict()
            if bs:
                assert st["device"] == accel_device.name and st["device_stages"], st
            else:
                assert not st["device_stages"], st
    spec = SpecConfig(n_max=3, adaptive=False, draft_sampling="coupled")
    with engine(path, accel_device, n_parallel=2, sampling=SAMPLED, backend_sampling=True,
                spec_type="draft-mtp", spec=spec) as e:
        st = []
        assert tokens(e, PROMPTS, stats=st) == ref
        assert st[0].n_accepted > 0


def test_scheduler_continuous_batching_on_device(paths, engine, accel_device):
    """The server's scheduler on the device: four requests of their own (greedy and seeded,
    speculation on and off) joining one batch give what each gives alone."""
    path = paths["dense"]
    reqs = [(PROMPTS[0], None, True), (PROMPTS[1], SAMPLED, True),
            ([500, 501, 502, 503], None, False), ([310], SAMPLED, False)]
    with engine(path, accel_device, n_parallel=4, spec_type="draft-mtp", ctx_checkpoints=0,
                spec=SpecConfig(n_max=3, adaptive=False)) as e:
        solo = [e.submit(Request(p, max_tokens=16, ignore_eos=True, sampling=sp, speculative=spec,
                                 cache_prompt=False)).result().tokens
                for p, sp, spec in reqs]
        hs = [e.submit(Request(p, max_tokens=16, ignore_eos=True, sampling=sp, speculative=spec,
                               cache_prompt=False)) for p, sp, spec in reqs]
        assert [h.result().tokens for h in hs] == solo


def test_device_runs_every_op_or_reports_the_fallback(paths, engine, accel_device):
    """Every graph the loop builds (prompt, decode, verify, MTP catch-up and drafts, device
    sampling) is probed against the device before ggml splits it: what the device lacks is
    a reported CPU fallback, never an abort; the output still equals the CPU's. Quirks in
    force for this device are reported in one line each."""
    path = paths["moe"]
    spec = SpecConfig(n_max=3, adaptive=False)
    with engine(path, spec_type="draft-mtp", spec=spec, sampling=SAMPLED,
                backend_sampling=False) as e:
        ref = tokens(e, PROMPTS[:1])
    with engine(path, accel_device, spec_type="draft-mtp", spec=spec, sampling=SAMPLED,
                backend_sampling=True) as e:
        assert tokens(e, PROMPTS[:1]) == ref
        report = e.device_report()
        # every graph the loop ran went through the probe (devices + CPU: multi-backend)
        built = [g for r in (e.target, e.mtp) for c in (r.graphs.steps, r.graphs.prompts)
                 for g in c._entries.values()]
        assert built and all(g.graph.probed for g in built)
    assert set(report) >= {"fallbacks", "quirks", "refused"}
    for fb in report["fallbacks"]:
        assert fb["device"] == accel_device.name and fb["op"]
    for q in quirks.applied(accel_device.name):
        assert any(q.key == k["key"] for k in report["quirks"])


def test_a_weight_the_device_cannot_hold_is_an_error_not_an_abort(accel_device):
    """A weight over what the device can bind as one operand (lavapipe: a 128 MiB
    storage-buffer range) makes ggml's scheduler abort; the graph probe raises a
    DeviceError naming the weight instead, and the placement would have kept it on the
    CPU (``Device.accepts`` says no for that shape)."""
    from pyggspec.errors import DeviceError
    from pyggspec.ggml import context, sched
    from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
    from pyggspec.ggml.device import cpu_device
    from pyggspec.ggml.dtypes import GGMLType

    n = (128 << 20) // 4 + 1024  # f32 elements: just over 128 MiB
    if accel_device.accepts("f32", (n,)):
        pytest.skip(f"{accel_device.name} binds {n * 4} bytes as one operand: nothing to refuse")
    wctx = context.Context(1)
    w = wctx.new_tensor("f32", (n,), "big.weight")
    buf = Buffer.for_context(wctx, accel_device, "weights", usage=USAGE_WEIGHTS)
    ctx = context.Context(8, graph_size=16)
    x = ctx.input(GGMLType.F32, (n,), "x")
    graph = sched.Graph(ctx, [ctx.mul(x, w)], size=16)
    with accel_device.open() as dev, cpu_device().open(1) as cpu:
        s = sched.BackendScheduler([dev, cpu], graph_size=16)
        with pytest.raises(DeviceError, match="big.weight"):
            s.alloc(graph)
        s.close()
    ctx.close()
    buf.close()
    wctx.close()


@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_image_prompt_with_mtp_on_device(models, engine, accel_device, tmp_path, rollback):
    """An image prompt (issue 52) with the model on the device and libmtmd's encoder
    offloaded as llama-server offloads it: greedy and seeded outputs with MTP equal plain
    decoding on the device and on the CPU (projector on the CPU), the drafts over the
    image rows are accepted, and the head's cache holds every prompt row."""
    from pyggspec.testing.hf_vision import VisionSpec, png_bytes, test_image_pixels, write_mmproj

    img = tmp_path / "wide.png"
    img.write_bytes(png_bytes(test_image_pixels(200, 70, seed=3)))
    mmproj = write_mmproj(tmp_path / "mmproj.gguf", VisionSpec(), 64)
    path = models.get("dense", dtype="f32", agreement=0.95, tied_embeddings=False)
    prompt = "<|im_start|>user\nLook <__media__> here<|im_end|>\n<|im_start|>assistant\n"
    spec = SpecConfig(rollback=rollback)
    for sampling in (None, SAMPLED):
        outs = {}
        for where, dev in (("cpu", None), ("device", accel_device)):
            for st in (None, "draft-mtp"):
                with engine(path, dev, spec_type=st, spec=spec, load_tokenizer=True,
                            mmproj=mmproj, mmproj_offload=dev is not None, n_ubatch=16,
                            n_batch=16, backend_sampling=dev is not None) as e:
                    if dev is not None:
                        on_device(e, accel_device)
                        # libmtmd reserved the encoder's compute on the device, not the CPU
                        assert accel_device.name in e.projector.compute_buffers
                    r = e.generate(prompt, max_tokens=N, ignore_eos=True, images=[img],
                                   sampling=sampling)
                    outs[where, st] = r.tokens
                    if st:
                        assert e.rollback == rollback
                        assert r.spec.n_accepted > 0.3 * r.spec.n_drafted > 0
                        assert e.worker.memory.mtp_length(0) >= len(r.prompt_tokens) - 1
        assert len(set(map(tuple, outs.values()))) == 1, (sampling, outs)
