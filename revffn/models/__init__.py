"""Loading: model references (`builtin:`, hub IDs, directories, GGUF) resolved and built (`loading`, `hub`,
`cache`, `gguf`), the tiny presets and tiny configs of any architecture (`presets`, `tiny_any`), generation,
and the remote code a converted directory carries (`hf_remote`). The conversion itself is `revffn.conversion`;
the architecture specs are `revffn.archs`.

Submodules are not imported here, so the package has no import-time side effects.
"""
