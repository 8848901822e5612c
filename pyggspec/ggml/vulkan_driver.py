"""Which driver runs a Vulkan device: its driverInfo string (e.g. "Mesa 25.0.7 (LLVM 15)").

ggml's device description is only the device name, and a known-broken driver can be told
from a fixed one only by its version (Mesa 22.3's lavapipe vs 25.0's, see ``quirks.py``).
This asks the Vulkan loader directly, through ctypes: one short-lived instance, created
only when a quirk needs a version, before ggml initialises any device. Any failure gives
no answer, and the caller then assumes the worst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from functools import cache

_STRUCTURE_TYPE_APPLICATION_INFO = 0
_STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 1
_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001
_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES = 1000196000
_API_1_2 = (1 << 22) | (2 << 12)
_DEVICE_NAME_OFFSET = 20  # VkPhysicalDeviceProperties: 5 uint32 before deviceName[256]


class _AppInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("pApplicationName", ctypes.c_char_p), ("applicationVersion", ctypes.c_uint32),
                ("pEngineName", ctypes.c_char_p), ("engineVersion", ctypes.c_uint32),
                ("apiVersion", ctypes.c_uint32)]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.POINTER(_AppInfo)),
                ("enabledLayerCount", ctypes.c_uint32), ("ppEnabledLayerNames", ctypes.c_void_p),
                ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


class _DriverProps(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("driverID", ctypes.c_uint32), ("driverName", ctypes.c_char * 256),
                ("driverInfo", ctypes.c_char * 256), ("conformance", ctypes.c_uint8 * 4)]


class _Props2(ctypes.Structure):
    # VkPhysicalDeviceProperties is ~830 bytes on x86-64; only deviceName is read from it
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("properties", ctypes.c_uint8 * 4096)]


@cache
def driver_infos() -> dict[str, str]:
    """deviceName -> driverInfo for every physical device the loader lists ({} on error)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("vulkan") or "libvulkan.so.1")
        app = _AppInfo(_STRUCTURE_TYPE_APPLICATION_INFO, None, b"pyggspec", 1, None, 0, _API_1_2)
        info = _InstanceInfo(_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app),
                             0, None, 0, None)
        inst = ctypes.c_void_p()
        if lib.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(inst)) != 0:
            return {}
        try:
            n = ctypes.c_uint32()
            lib.vkEnumeratePhysicalDevices(inst, ctypes.byref(n), None)
            devs = (ctypes.c_void_p * n.value)()
            lib.vkEnumeratePhysicalDevices(inst, ctypes.byref(n), devs)
            out: dict[str, str] = {}
            for d in devs:
                drv = _DriverProps(_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES, None)
                props = _Props2(_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                ctypes.cast(ctypes.pointer(drv), ctypes.c_void_p))
                lib.vkGetPhysicalDeviceProperties2(ctypes.c_void_p(d), ctypes.byref(props))
                raw = bytes(props.properties[_DEVICE_NAME_OFFSET:_DEVICE_NAME_OFFSET + 256])
                name = raw.split(b"\0")[0].decode(errors="replace")
                out[name] = drv.driverInfo.decode(errors="replace")
            return out
        finally:
            lib.vkDestroyInstance(inst, None)
    except (OSError, AttributeError, ValueError):
        return {}


def mesa_version(device_name: str) -> tuple[int, int] | None:
    """(major, minor) of the Mesa driving the device of that name, None if unknown."""
    m = re.search(r"Mesa (\d+)\.(\d+)", driver_infos().get(device_name, ""))
    return (int(m.group(1)), int(m.group(2))) if m else None
