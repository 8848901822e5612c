"""Known-broken device rules (pyggspec/ggml/quirks.py): which devices they match, that a
user's own setting of a ggml switch is kept, and that each is reported in one line."""

from __future__ import annotations

import pytest

from pyggspec.ggml import quirks, vulkan_driver

LAVAPIPE = "llvmpipe (LLVM 15.0.6, 256 bits)"


@pytest.fixture
def mesa(monkeypatch):
    """Pretend the Vulkan loader reports this driverInfo for the lavapipe device."""
    def use(info: str | None) -> None:
        monkeypatch.setattr(vulkan_driver, "driver_infos",
                            lambda: {} if info is None else {LAVAPIPE: info})
    return use


@pytest.mark.parametrize("info,expected", [
    ("Mesa 22.3.6 (LLVM 15.0.6)", True),
    ("Mesa 24.2.8-1 (LLVM 19)", True),
    ("Mesa 25.0.7-2~bpo12+1 (LLVM 15.0.6)", False),
    ("Mesa 26.1.0", False),
    (None, True),  # unknown driver: assume the worst
])
def test_lavapipe_fusion_rule_follows_the_mesa_version(mesa, info, expected):
    mesa(info)
    (rule,) = [q for q in quirks.QUIRKS if q.key == "lavapipe-fusion"]
    assert rule.matches("Vulkan", LAVAPIPE) is expected
    assert not rule.matches("Vulkan", "NVIDIA H100 80GB HBM3")
    assert not rule.matches("CUDA", LAVAPIPE)


def test_mesa_version_parsing(mesa):
    mesa("Mesa 25.0.7-2~bpo12+1 (LLVM 15.0.6)")
    assert vulkan_driver.mesa_version(LAVAPIPE) == (25, 0)
    assert vulkan_driver.mesa_version("some other GPU") is None


class _Lib:
    """The few registry calls quirks.apply makes, over a fixed device list."""

    def __init__(self, devs):
        self.devs = devs

    def ggml_backend_dev_count(self):
        return len(self.devs)

    def ggml_backend_dev_get(self, i):
        return self.devs[i]

    def ggml_backend_dev_name(self, d):
        return d[0]

    def ggml_backend_dev_description(self, d):
        return d[1]

    def ggml_backend_dev_backend_reg(self, d):
        return d[2]

    def ggml_backend_reg_name(self, reg):
        return reg


class _Ffi:
    @staticmethod
    def string(b):
        return b.encode()


def test_apply_sets_the_switch_unless_the_user_did_and_reports_one_line(mesa, monkeypatch):
    mesa("Mesa 22.3.6")
    monkeypatch.setattr(quirks, "_applied", {})
    monkeypatch.delenv("GGML_VK_DISABLE_FUSION", raising=False)
    lib = _Lib([("Vulkan0", LAVAPIPE, "Vulkan"), ("CPU", "AMD EPYC", "CPU")])
    quirks.apply(lib, _Ffi())
    import os

    assert os.environ["GGML_VK_DISABLE_FUSION"] == "1"
    assert [q.key for q in quirks.applied("Vulkan0")] == ["lavapipe-fusion"]
    assert quirks.applied("CPU") == []
    (line,) = quirks.lines("Vulkan0")
    assert line.startswith("Vulkan0: ") and "\n" not in line and "test-backend-ops" in line
    monkeypatch.setattr(quirks, "_applied", {})
    monkeypatch.setenv("GGML_VK_DISABLE_FUSION", "user")
    quirks.apply(lib, _Ffi())
    assert os.environ["GGML_VK_DISABLE_FUSION"] == "user"
