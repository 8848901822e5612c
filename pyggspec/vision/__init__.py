"""Image inputs: the vision projector through libmtmd, and the M-RoPE positions of image rows.

``projector`` wraps libmtmd (``_mtmd`` is the only module that calls it) and reads mmproj
GGUF facts; ``report`` is the projector's part of ``pyggspec inspect``; ``positions`` is pure
position arithmetic for the trunk and the MTP head.
"""
