"""Image prompts through the engine and ``pyggspec run`` (issue 52): the projector from
``mmproj=`` / ``--mmproj``, ``Engine.generate(prompt, images=[...])`` with ``<__media__>``
markers, chunked prefill through image rows, and the one-line errors.

Oracle: llama.cpp + libmtmd on the same files (``pyggspec.testing.oracle_vision``), greedy
tokens identical. The projector is ``write_mmproj``'s, the text models the project's own
(f32, so llama.cpp's and our tokens agree exactly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyggspec.errors import PyggspecError
from pyggspec.testing.hf_vision import VisionSpec, png_bytes, test_image_pixels, write_mmproj
from pyggspec.testing.oracle_vision import image_prompt
from pyggspec.vision.projector import ImageError

REPO = Path(__file__).resolve().parents[1]
PROMPT = "<|im_start|>user\nLook <__media__> here<|im_end|>\n<|im_start|>assistant\n"
N = 8


@pytest.fixture(scope="module")
def files(models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("imgeng")
    img = d / "a.png"
    img.write_bytes(png_bytes(test_image_pixels(200, 70, seed=3)))
    return {"model": models.dense(dtype="f32"), "moe": models.moe(dtype="f32"),
            "mmproj": write_mmproj(d / "mmproj.gguf", VisionSpec(), 64), "image": img}


@pytest.fixture(scope="module")
def ref(files) -> list[int]:
    return image_prompt(files["model"], files["mmproj"], PROMPT, [files["image"].read_bytes()],
                        n_new=N).greedy


def _gen(e, prompt: str, images, **kw) -> list[int]:
    return e.generate(prompt, max_tokens=N, ignore_eos=True, images=images, **kw).tokens


def test_generate_matches_libmtmd(files, ref, make_engine):
    img = files["image"]
    e = make_engine(files["model"], n_ctx=256, mmproj=files["mmproj"], mmproj_offload=False)
    assert _gen(e, PROMPT, [img]) == ref  # a path
    assert _gen(e, PROMPT, [img.read_bytes()]) == ref  # bytes; the slot reused up to the image
    # no marker: the images go first
    ref0 = image_prompt(files["model"], files["mmproj"], "<__media__>describe",
                        [img.read_bytes()], n_new=N).greedy
    assert _gen(e, "describe", [img]) == ref0


def test_images_are_encoded_on_the_engine_thread(files, ref, make_engine, monkeypatch):
    """With the scheduler's background thread running (an app serving from Python), an
    image given to ``Engine.generate`` is encoded on that thread, the one that computes the
    engine's graphs (a second OpenMP caller of ggml left every later decode step ~2x
    slower, journal row 95); without it, on the caller's thread, which drives the loop."""
    import threading

    from pyggspec.vision import rows as rows_mod

    seen: list[str] = []
    real = rows_mod.prompt_rows

    def spy(*a, **kw):
        seen.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(rows_mod, "prompt_rows", spy)
    e = make_engine(files["model"], n_ctx=256, mmproj=files["mmproj"], mmproj_offload=False)
    assert _gen(e, PROMPT, [files["image"]]) == ref
    e.scheduler.start()
    try:
        assert _gen(e, PROMPT, [files["image"].read_bytes()]) == ref
    finally:
        e.scheduler.stop()
    assert seen == [threading.current_thread().name, "pyggspec-scheduler"]


def test_chunked_prefill_through_the_image(files, ref, make_engine):
    """Ubatches of 7 rows and logical batches of 11: chunks start and end inside the
    image; the tokens are llama.cpp's (f32 split noise does not move greedy here)."""
    e = make_engine(files["model"], n_ctx=256, n_ubatch=7, n_batch=11, mmproj=files["mmproj"],
                    mmproj_offload=False)
    assert _gen(e, PROMPT, [files["image"]]) == ref


def test_parallel_image_and_text(files, ref, make_engine):
    """-np 2: an image prompt beside a text prompt in shared batches, each as alone; then
    a text request in the slot that held the image (its positions are plain again)."""
    e = make_engine(files["model"], n_ctx=256, n_parallel=2, load_tokenizer=True,
                    mmproj=files["mmproj"], mmproj_offload=False)
    text = "a text prompt of some length, here"
    solo = e.generate(text, max_tokens=N, ignore_eos=True).tokens
    g = e.generate_batch([PROMPT, text], max_tokens=N, ignore_eos=True,
                         images=[[files["image"]], None])
    assert [r.tokens for r in g] == [ref, solo]
    g = e.generate_batch([text, text], max_tokens=N, ignore_eos=True)
    assert [r.tokens for r in g] == [solo, solo]


@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_speculative_engine_takes_images(files, ref, make_engine, rollback):
    """With --spec-type draft-mtp an image request decodes (without drafts, for now) to
    the same tokens, and a text request after it speculates as on a fresh engine."""
    from pyggspec.config import SpecConfig

    e = make_engine(files["model"], n_ctx=256, spec_type="draft-mtp",
                    spec=SpecConfig(rollback=rollback), load_tokenizer=True,
                    mmproj=files["mmproj"], mmproj_offload=False)
    assert _gen(e, PROMPT, [files["image"]]) == ref
    text = "a text prompt of some length, here"
    after = e.generate(text, max_tokens=N, ignore_eos=True)
    plain = make_engine(files["model"], n_ctx=256, load_tokenizer=True)
    assert after.tokens == plain.generate(text, max_tokens=N, ignore_eos=True).tokens
    assert after.spec is not None and after.spec.n_target_evals > 0


def test_bad_image_input(files, make_engine):
    e = make_engine(files["model"], n_ctx=256)
    with pytest.raises(PyggspecError, match="--mmproj: an image needs the model's vision"):
        e.generate(PROMPT, images=[files["image"]])
    e = make_engine(files["model"], n_ctx=64, mmproj=files["mmproj"], mmproj_offload=False)
    with pytest.raises(ImageError, match="cannot decode"):
        e.generate(PROMPT, images=[b"\x89PNG\r\n\x1a\n broken"])
    with pytest.raises(ImageError, match="no such file|No such file"):
        e.generate(PROMPT, images=[files["image"].with_name("missing.png")])
    with pytest.raises(ImageError, match="2 <__media__> marker"):
        e.generate(PROMPT + "<__media__>", images=[files["image"]])
    with pytest.raises(PyggspecError, match="must be text"):
        e.generate([1, 2, 3], images=[files["image"]])
    big = png_bytes(test_image_pixels(640, 640, seed=1))
    with pytest.raises(PyggspecError, match="does not fit the context"):
        e.generate(PROMPT, images=[big])


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyggspec", "run", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300, check=False)


def test_cli_run_image(files, ref):
    base = ["-m", str(files["model"]), "-c", "256", "-t", "2", "--temp", "0", "-n", str(N),
            "--ignore-eos"]
    r = _run(*base, "--mmproj", str(files["mmproj"]), "--no-mmproj-offload", "--image",
             str(files["image"]), "-p", PROMPT, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["tokens"] == ref
    r = _run(*base, "-mm", str(files["mmproj"]), "--image", str(files["image"]), "-p", PROMPT)
    assert r.returncode == 0, r.stderr[-2000:]
    for args, msg in ((["--image", str(files["image"]), "-p", PROMPT], "--mmproj FILE"),
                      (["-mm", str(files["mmproj"]), "--image", "nope.png", "-p", PROMPT],
                       "nope.png: no such file"),
                      (["-mm", str(files["model"]), "--image", str(files["image"]), "-p", "x"],
                       "not a projector")):
        r = _run(*base, *args)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_image_token_budget_flags(files):
    """--image-max-tokens / --image-min-tokens reach libmtmd: the same image takes fewer
    rows under a smaller budget (the prompt count in --json's timings)."""
    base = ["-m", str(files["model"]), "-c", "256", "-t", "2", "--temp", "0", "-n", "1",
            "--mmproj", str(files["mmproj"]), "--no-mmproj-offload", "--image",
            str(files["image"]), "-p", PROMPT, "--json"]
    counts = []
    for extra in ([], ["--image-max-tokens", "8"]):
        r = _run(*base, *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        counts.append(json.loads(r.stdout)["timings"]["prompt_n"])
    assert counts[1] < counts[0]
    r = _run(*base, "--image-min-tokens", "0")
    assert r.returncode != 0 and "--image-min-tokens" in r.stderr
