"""CPU weight repacking (llama.cpp's default extra buffer types) and the AMX probe.

Repacked weights run ggml's interleaved GEMV/GEMM kernels: the same quantized arithmetic in
another order, so logits move by float rounding only. The fixtures here are the
constructed-agreement models (layers scaled down, not chaotic), where that rounding stays
far below anything that could change a greedy token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import SpecConfig
from pyggspec.ggml import amx_probe
from pyggspec.ggml.device import cpu_device
from pyggspec.ggml.repack import extra_buffer_types, supports_weight
from pyggspec.testing.oracle import oracle_greedy, rel_err

PROMPT = [int(t) for t in np.random.default_rng(3).integers(5, 900, size=24)]


def qmodel(models, dtype, arch="dense", agreement=0.9, tied=False):
    # rows of 256 so that every type (Q4_K / IQ4_XS blocks) quantizes the matrices
    kw = {"n_embd": 256, "n_ff": 512} if arch == "dense" else {"n_embd": 256, "n_ff_exp": 256,
                                                               "n_ff_shexp": 256}
    return models.get(arch, dtype=dtype, agreement=agreement, tied_embeddings=tied, **kw)


def repack_expected(dtype: str) -> bool:
    """Does ggml on this CPU repack the bulk of a model of this type?"""
    from pyggspec.ggml.dtypes import GGMLType

    qt = {"q4_0": "Q4_0", "q4_k": "Q4_K", "q8_0": "Q8_0", "iq4_xs": "IQ4_XS", "f32": "F32"}[dtype]
    cpu = cpu_device()
    return any(supports_weight(cpu, b, GGMLType[qt], (256, 512))
               for b in extra_buffer_types(cpu) if b.name != "AMX")


def held_to_llamacpp(path, rp: bool, ours: np.ndarray, toks: list[int], n: int,
                     prompt=None, bound: float = 1e-4) -> None:
    """Repacked and plain kernels sum in different orders, so each mode is held to
    llama.cpp's own logits in the same mode, bit for bit (the difference between our modes
    is then exactly ggml's on this host). llama.cpp repacks into every extra buffer type,
    AMX included: where ggml lists AMX but the probe saw it fail, our repacking (without
    AMX) has no llama.cpp twin, and the bound is the measured rounding of a different
    summation order instead (``bound``: 1e-4, as the test this replaced had between
    repacked and plain; 1e-3 where that test had it: MoE routers, the tied head)."""
    names = [b.name for b in extra_buffer_types(cpu_device())]
    twin = not rp or "AMX" not in names or amx_probe.amx_usable()[0]
    ref, ref_toks = oracle_greedy(path, PROMPT if prompt is None else prompt, n,
                                  repack=rp if twin else False)
    assert toks == ref_toks
    if twin:
        assert np.array_equal(ours, ref), rel_err(ours, ref)
    else:
        assert rel_err(ours, ref) <= bound


def greedy(engine, prompt, n):
    lg = engine.eval(prompt, 0)
    rows, toks = [lg], []
    for _ in range(n):
        t = int(lg[-1].argmax())
        toks.append(t)
        lg = engine.eval([t], 0)
        rows.append(lg)
    return np.concatenate(rows), toks


def test_extra_buffer_types_listed_and_probe_asked_once():
    names = [b.name for b in extra_buffer_types(cpu_device())]
    assert "CPU_REPACK" in names  # llama-cpp-python builds ggml with the repack kernels
    usable, why = amx_probe.amx_usable()
    assert isinstance(usable, bool) and why
    if "AMX" not in names:
        assert not usable and "no AMX" in why


@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q4_0", "q4_k", "iq4_xs"])
def test_repacked_logits_and_greedy_equal_plain(models, make_engine, dtype):
    path = qmodel(models, dtype)
    out = {}
    for rp in (False, True):
        with make_engine(path, n_ctx=128, repack=rp) as e:
            logits, toks = greedy(e, PROMPT, 16)
            out[rp] = (logits, toks, e.weights.repacked())
    plain, packed = out[False], out[True]
    assert plain[2] == {}
    if repack_expected(dtype):
        assert len(packed[2]) > 0 and "output.weight" in packed[2]
        assert not any("token_embd" in k or "norm" in k for k in packed[2])
    elif dtype == "f32":
        assert packed[2] == {}
    assert packed[1] == plain[1]
    for rp, (logits, toks, _) in out.items():
        held_to_llamacpp(path, rp, logits, toks, 16)


def test_moe_experts_repacked_and_equal(models, make_engine):
    path = qmodel(models, "q4_0", arch="moe")
    out = {}
    for rp in (False, True):
        with make_engine(path, n_ctx=128, repack=rp) as e:
            out[rp] = greedy(e, PROMPT, 12), e.weights.repacked()
    if repack_expected("q4_0"):
        assert any("_exps" in k for k in out[True][1])  # MUL_MAT_ID weights too
    assert out[True][0][1] == out[False][0][1]
    for rp, ((logits, toks), _) in out.items():
        held_to_llamacpp(path, rp, logits, toks, 12, bound=1e-3)


def test_tied_head_gets_its_own_repacked_copy(models, make_engine):
    path = qmodel(models, "q4_0", agreement=None, tied=True)
    with make_engine(path, n_ctx=64) as e:
        rep = e.weights.repacked()
        if repack_expected("q4_0"):
            assert "output.weight" in rep and "token_embd.weight" not in rep
            assert e.weights.get("output.weight").ptr != e.weights.get("token_embd.weight").ptr
        with make_engine(path, n_ctx=64, repack=False) as p:
            assert p.weights.repacked() == {}
            a, toks_a = greedy(e, PROMPT[:8], 2)
            b, toks_b = greedy(p, PROMPT[:8], 2)
    for rp, logits, toks in ((True, a, toks_a), (False, b, toks_b)):
        held_to_llamacpp(path, rp, logits, toks, 2, PROMPT[:8], bound=1e-3)


def test_repacked_matches_llamacpp(models, make_engine):
    """Against llama.cpp on the same file, with its repacking too (bit for bit), unless
    ggml lists an AMX buffer type the probe saw fail (see :func:`held_to_llamacpp`)."""
    path = qmodel(models, "q4_0")
    with make_engine(path, n_ctx=128) as e:
        ours, our_toks = greedy(e, PROMPT, 12)
    held_to_llamacpp(path, True, ours, our_toks, 12)


@pytest.mark.parametrize("draft_vocab", [0, 256])
def test_speculation_lossless_with_repacked_weights(models, make_engine, draft_vocab):
    """The MTP head's LM head is repacked too; the draft-vocabulary view of it must still
    read the right rows (drafts and acceptance equal the plain-weight run)."""
    path = qmodel(models, "q4_0")
    res = {}
    for rp in (False, True):
        with make_engine(path, n_ctx=128, repack=rp, spec_type="draft-mtp",
                         spec=SpecConfig(n_max=3, draft_vocab=draft_vocab, adaptive=False)) as e:
            r = e.generate(PROMPT[:4], max_tokens=40, ignore_eos=True)
            res[rp] = (r.tokens, r.spec.n_drafted, r.spec.n_accepted)
    with make_engine(path, n_ctx=128) as e:
        plain = e.generate(PROMPT[:4], max_tokens=40, ignore_eos=True).tokens
    assert res[True] == res[False]
    assert res[True][0] == plain
    assert res[True][2] > 0


def test_cli_no_repack_flag_and_memory(models):
    path = qmodel(models, "q4_0")
    base = ["run", "-m", str(path), "--prompt-tokens", "300,301,302", "-n", "6",
            "--ignore-eos", "--json"]
    on = CliRunner().invoke(main, base)
    off = CliRunner().invoke(main, [*base, "--no-repack"])
    assert on.exit_code == 0 and off.exit_code == 0, (on.output, off.output)
    a, b = json.loads(on.output), json.loads(off.output)
    assert a["tokens"] == b["tokens"]
    # repacked tensors are copies of the same bytes (untied head): weights are counted once
    assert a["memory"]["weights"] == b["memory"]["weights"]


@pytest.mark.parametrize("tied", [True, False])
def test_inspect_predicts_repacked_weights(models, make_engine, tied):
    """inspect counts what loading will hold: the tied head's own repacked copy, and the
    bytes in the repack buffer type (none with -nr)."""
    path = qmodel(models, "q4_0", agreement=None, tied=tied)
    for flags, rp in (([], True), (["-nr"], False)):
        r = CliRunner().invoke(main, ["inspect", str(path), "--json", "-c", "64", "-ngl", "0",
                                      *flags])  # on the CPU, as the engine below
        assert r.exit_code == 0, r.output
        mem = json.loads(r.output)["memory"]
        with make_engine(path, n_ctx=64, repack=rp,
                         spec_type="draft-mtp") as e:  # inspect plans the MTP head too
            assert mem["weights"] == e.memory()["weights"]
            assert mem["repacked"]["bytes"] == e.weights.repacked_bytes
            assert mem["repacked"]["tensors"] == len(e.weights.repacked())
        copy = sum(mem["repacked"]["tied_head_copy"].values())
        assert (copy > 0) == (tied and rp and repack_expected("q4_0"))


def test_amx_probe_verdicts(tmp_path, monkeypatch):
    """A probe child that dies by a signal, hangs or exits non-zero means no AMX; the
    verdict is cached per host key and re-asked with fresh=True."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_run(code):
        def run(cmd, **kw):
            calls.append(cmd)
            if code == "hang":
                raise subprocess.TimeoutExpired(cmd, 1)
            return subprocess.CompletedProcess(cmd, code)
        return run

    monkeypatch.setattr(amx_probe.subprocess, "run", fake_run(-11))
    usable, why = amx_probe.amx_usable(fresh=True)
    assert not usable and "signal 11" in why
    monkeypatch.setattr(amx_probe.subprocess, "run", fake_run(0))
    assert amx_probe.amx_usable() == (False, why)  # cached
    assert amx_probe.amx_usable(fresh=True)[0] is True
    monkeypatch.setattr(amx_probe.subprocess, "run", fake_run("hang"))
    assert "hung" in amx_probe.amx_usable(fresh=True)[1]
    assert len(calls) == 3


def test_amx_probe_child_runs_here():
    """The real child process: exits 0 (AMX ran) or 3 (no AMX buffer type in this build);
    or it dies by a signal on a host whose CPU lists AMX but will not run the tile code --
    the case the probe exists for (an Intel Xeon VM of this project's CI: SIGILL, though
    the kernel grants the tile state). The suite must pass on any x86 host, so there the
    check is the fallback: the verdict the engine acts on says AMX is not used and why,
    and a warning names the host. Any other exit fails."""
    r = subprocess.run([sys.executable, "-m", "pyggspec.ggml.amx_probe", "--child"],
                       check=False, capture_output=True, timeout=120)
    err = r.stderr.decode(errors="replace")
    names = [b.name for b in extra_buffer_types(cpu_device())]
    if r.returncode < 0:
        cpuinfo = Path("/proc/cpuinfo")
        flags = cpuinfo.read_text() if cpuinfo.exists() else ""
        assert "AMX" in names and " amx_tile" in flags, (
            f"the AMX probe child died by signal {-r.returncode} without AMX here: {err}")
        usable, why = amx_probe.amx_usable(fresh=True)
        assert not usable and f"signal {-r.returncode}" in why, why
        warnings.warn(f"this CPU lists AMX but its tile code dies here ({why}): AMX weight "
                      "buffers are not used", stacklevel=1)
        return
    want = 0 if "AMX" in names else 3
    assert r.returncode == want, (r.returncode, err)


@pytest.mark.parametrize("repack", [False, True])
def test_requantized_copy_of_a_weight(models, make_engine, repack):
    """A lower-bit copy (the draft LM head): ggml's own quantization of the dequantized
    rows, on the same device, repacked where ggml takes it (the bytes are compared in the
    plain buffer; drafting with a repacked copy is test_draft_head_copy_is_lossless)."""
    from gguf.quants import GGMLQuantizationType, dequantize

    from pyggspec.ggml.quantize import quantize_rows
    from pyggspec.modelfile import ggml_type

    path = qmodel(models, "q8_0", agreement=None)
    with make_engine(path, n_ctx=64, repack=repack) as e:
        w = e.weights
        src = w.get("output.weight")
        t = w.add_requantized("draft:head", "output.weight", "q4_0")
        assert w.get("draft:head") is t and t.type == ggml_type("q4_0").id
        assert t.shape == src.shape and w.device_of("draft:head").is_cpu
        assert ("draft:head" in w.repacked()) == (repack and repack_expected("q4_0"))
        file, info = w._sources["output.weight"]
        rows = dequantize(np.asarray(file.tensor_data(info.name)).reshape(info.ne[1], -1),
                          GGMLQuantizationType(info.type.id))
        if not repack:  # plain buffer: the bytes read back as written
            want = quantize_rows(ggml_type("q4_0").id, rows.reshape(info.ne[1], info.ne[0]))
            assert t.get().tobytes() == want


@pytest.mark.parametrize("head", ["q4_0", "q4_k"])
def test_draft_head_copy_is_lossless(models, make_engine, head):
    """--spec-draft-head: drafts come from a lower-bit copy of the LM head, the target still
    verifies with its own, so the output equals plain decoding; acceptance stays up."""
    path = qmodel(models, "q8_0", agreement=0.9)
    with make_engine(path, n_ctx=128) as e:
        plain = e.generate(PROMPT[:4], max_tokens=40, ignore_eos=True).tokens
    acc = {}
    for dh in ("", head):
        with make_engine(path, n_ctx=128, spec_type="draft-mtp",
                         spec=SpecConfig(n_max=3, draft_head=dh, adaptive=False)) as e:
            assert e.weights.has("draft:head") == bool(dh)
            if dh:
                assert e.mtp.weights.head is e.weights.get("draft:head")
                assert e.memory()["weights"] == e.memory_plan.to_dict()["weights"]
            r = e.generate(PROMPT[:4], max_tokens=40, ignore_eos=True)
            assert r.tokens == plain
            acc[dh] = r.spec.acceptance
    assert acc[head] >= acc[""] - 0.1 and acc[head] > 0.5


@pytest.mark.parametrize("bad,why", [("q9_9", "unknown"), ("iq2_xxs", "importance matrix")])
def test_draft_head_bad_type(models, make_engine, bad, why):
    from pyggspec.errors import PyggspecError

    path = qmodel(models, "q8_0", agreement=0.9)
    with pytest.raises(PyggspecError, match=f"--spec-draft-head.*{why}"):
        make_engine(path, n_ctx=64, spec_type="draft-mtp", spec=SpecConfig(draft_head=bad))
