// pyggspec: Vulkan-Hpp compatibility shim for system headers older than 1.3.254.
//
// Why: ggml-vulkan.cpp in llama-cpp-python 0.3.36 names the VK_EXT_layer_settings types
// (vk::LayerSettingEXT, vk::LayerSettingsCreateInfoEXT) unconditionally, but Debian 12 and
// Ubuntu 22.04 ship Vulkan headers (1.3.239 / 1.3.204) that predate that extension, so the
// Vulkan backend does not compile there. install.sh puts this directory first on the C++
// include path ONLY when the system's vulkan_core.h lacks VK_EXT_layer_settings; every other
// file of the build sees the system headers unchanged, and ggml itself is not modified.
//
// It includes the real vulkan.hpp, then declares the few types that code uses with the
// layouts of the Vulkan registry (VK_EXT_layer_settings, revision 2). ggml only enables the
// extension when built with GGML_VULKAN_VALIDATE and a validation layer offers it; otherwise
// the struct rides in the instance pNext chain with its registered sType, which loaders and
// drivers that do not know it skip, exactly as with newer headers and an older loader.
#pragma once
#include_next <vulkan/vulkan.hpp>

#ifndef VK_EXT_layer_settings
#define VK_EXT_layer_settings 1
#define PYGGSPEC_VULKAN_LAYER_SETTINGS_SHIM 1
#include <cstdint>

namespace VULKAN_HPP_NAMESPACE {

enum class LayerSettingTypeEXT : int32_t {
    eBool32 = 0,
    eInt32 = 1,
    eInt64 = 2,
    eUint32 = 3,
    eUint64 = 4,
    eFloat32 = 5,
    eFloat64 = 6,
    eString = 7,
};

struct LayerSettingEXT {
    const char * pLayerName = nullptr;
    const char * pSettingName = nullptr;
    LayerSettingTypeEXT type = LayerSettingTypeEXT::eBool32;
    uint32_t valueCount = 0;
    const void * pValues = nullptr;
};

struct LayerSettingsCreateInfoEXT {
    // VK_STRUCTURE_TYPE_LAYER_SETTINGS_CREATE_INFO_EXT in the Vulkan registry
    StructureType sType = static_cast<StructureType>(1000496000);
    const void * pNext = nullptr;
    uint32_t settingCount = 0;
    const LayerSettingEXT * pSettings = nullptr;

    LayerSettingsCreateInfoEXT() = default;
    LayerSettingsCreateInfoEXT(ArrayProxyNoTemporaries<const LayerSettingEXT> const & settings,
                               const void * next = nullptr)
        : pNext(next), settingCount(static_cast<uint32_t>(settings.size())), pSettings(settings.data()) {}
};

}  // namespace VULKAN_HPP_NAMESPACE
#endif
